"""Data modules for fine-tuning: Alpaca-style instruction pairs, and random tokens for benchmarks.

Nothing here touches the network: the tokenizer is a local directory the user names, or a
byte-level tokenizer built in memory (:func:`byte_tokenizer`).

Example::

    data = InstructionDataModule("data/instructions.jsonl", tokenizer="/models/Qwen2.5-7B", max_length=1024)
    trainer.fit(module, datamodule=data)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

#: The ignore index of the Hugging Face causal-LM loss: no loss where a label is -100.
IGNORE_INDEX = -100

#: The prompt format for tokenizers without a chat template (Alpaca's).
_ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
_ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in memory: 256 byte tokens plus ``<pad>`` (0), ``<s>`` and ``</s>``.

    Any text round-trips through it, so it needs neither training nor a download; its
    vocabulary (259) is fixed, so a model built for it fits any data.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate([*specials, *alphabet])}
    # A BPE without merges over the byte alphabet: every byte is one token.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="right"
    )


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Instruction records from a JSON file (a list of objects) or a JSONL file (one object per line).

    Raises:
        MisconfigurationException: If the file holds neither.
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        # A JSON file is one document; JSONL is one per non-empty line (a one-line JSONL is both).
        records = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(ln) for ln in text.splitlines() if ln.strip()]
        )
    except json.JSONDecodeError as error:
        raise MisconfigurationException(
            f"InstructionDataModule: cannot read {path} as JSON or JSONL ({error}). Give a JSON list of objects or"
            " one JSON object per line, each with `instruction`, optional `input`, and `output`."
        ) from None
    for index, record in enumerate(records):
        if not isinstance(record, dict) or "instruction" not in record or "output" not in record:
            raise MisconfigurationException(
                f"InstructionDataModule: record {index} of {path} needs string fields `instruction` and `output`"
                f" (and optionally `input`), got {str(record)[:100]!r}."
            )
    return records


def encode(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict[str, list[int]]:
    """Token ids and labels of one instruction record: loss on the response only.

    With a chat template the instruction (and input) form the user turn and the output the
    assistant turn; without one the Alpaca prompt is used, the response closed by the EOS
    token. Prompt tokens are labelled -100; the row is cut at ``max_length`` tokens.

    Args:
        record: ``instruction``, optional ``input``, ``output``.
        tokenizer: The tokenizer.
        max_length: Longest row in tokens.

    Raises:
        MisconfigurationException: If the chat template does not render the prompt as a prefix of the whole turn.
    """
    instruction, extra, output = record["instruction"], record.get("input") or "", record["output"]
    if tokenizer.chat_template:
        user = {"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction}
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": output}], tokenize=False)
        if not full.startswith(prompt):
            raise MisconfigurationException(
                "InstructionDataModule: the tokenizer's chat template does not render the prompt (with the generation"
                " prompt) as a prefix of the full conversation, so the response cannot be told apart for masking."
                " Use a tokenizer whose template does, or remove its `chat_template` to use the Alpaca format."
            )
        response = full[len(prompt) :]
        prefix: list[int] = []
    else:
        template = _ALPACA_PROMPT_WITH_INPUT if extra else _ALPACA_PROMPT
        prompt = template.format(instruction=instruction, input=extra)
        response = output + (tokenizer.eos_token or "")
        prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    # Prompt and response are tokenized apart so that no token straddles the boundary of the mask.
    prompt_ids = prefix + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def real_targets(labels: list[int]) -> int:
    """Label positions the shifted causal-LM loss trains on (the first position is never predicted)."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


class _Rows(Dataset):
    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]


class PadCollator:
    """Right-pads rows to the longest in the batch: padding is ``pad_id`` in the ids, 0 in the mask, -100 in labels.

    Args:
        pad_id: The tokenizer's padding id.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, Tensor]:
        """Stack ``rows`` into a padded batch."""
        length = max(len(row["input_ids"]) for row in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n] = torch.tensor(row["input_ids"])
            labels[i, :n] = torch.tensor(row["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class InstructionDataModule(pl.LightningDataModule):
    """Alpaca-style instruction pairs (JSON or JSONL with ``instruction``, ``input``, ``output``), loss on responses.

    Each record becomes one row (see :func:`encode`): the chat template when the tokenizer
    has one, else the Alpaca prompt; prompt and padding are -100 in the labels; rows are cut
    at ``max_length`` tokens, and rows left with fewer than two tokens to train on (an empty
    output, a prompt that fills ``max_length``) are dropped. The rows are split into train
    and validation sets by ``seed``; test and predict use the validation set.

    Args:
        path: The JSON or JSONL file.
        tokenizer: A local tokenizer directory (e.g. the checkpoint's); ``None`` builds the
            byte-level :func:`byte_tokenizer`. Never downloaded.
        max_length: Longest row in tokens; longer rows are truncated.
        batch_size: Rows per batch.
        val_fraction: Fraction of the rows held out for validation (at least one row when above 0).
        num_workers: DataLoader worker processes.
        seed: Seed of the split and of the training shuffle.

    Raises:
        MisconfigurationException: If ``max_length`` < 2 or ``val_fraction`` is not in [0, 1).
    """

    def __init__(
        self,
        path: str,
        tokenizer: str | None = None,
        max_length: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise MisconfigurationException(f"InstructionDataModule(max_length={max_length}) must be at least 2.")
        if not 0 <= val_fraction < 1:
            raise MisconfigurationException(f"InstructionDataModule(val_fraction={val_fraction}) must be in [0, 1).")
        self.save_hyperparameters()
        self.tokenizer = (
            byte_tokenizer() if tokenizer is None else AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        )
        if self.tokenizer.pad_token_id is None:
            # Padding is masked everywhere (mask 0, label -100), so any id serves; EOS is the usual choice.
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.vocab_size = len(self.tokenizer)
        self.train_set: _Rows | None = None
        self.val_set: _Rows | None = None
        self.dropped = 0

    def setup(self, stage: str) -> None:
        """Read, encode, filter and split the records (once)."""
        if self.train_set is not None:
            return
        hp = self.hparams
        rows = [encode(r, self.tokenizer, hp.max_length) for r in load_records(hp.path)]
        kept = [row for row in rows if real_targets(row["labels"]) >= 2]
        self.dropped = len(rows) - len(kept)
        if not kept:
            raise MisconfigurationException(
                f"InstructionDataModule: none of the {len(rows)} records of {hp.path} has two response tokens to train"
                f" on within max_length={hp.max_length}. Raise `max_length` or check the `output` fields."
            )
        order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(hp.seed)).tolist()
        num_val = max(1, round(hp.val_fraction * len(kept))) if hp.val_fraction > 0 and len(kept) > 1 else 0
        self.val_set = _Rows([kept[i] for i in order[:num_val]])
        self.train_set = _Rows([kept[i] for i in order[num_val:]])
        rank_zero_info(
            f"InstructionDataModule: {len(self.train_set)} train and {len(self.val_set)} validation rows from"
            f" {hp.path}; {self.dropped} dropped (fewer than two response tokens within max_length={hp.max_length})."
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches, in an order fixed by ``seed``."""
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in order."""
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        """The validation batches, to test on."""
        return self._loader(self.val_set)

    def predict_dataloader(self) -> DataLoader:
        """The validation batches, to predict on."""
        return self._loader(self.val_set)

    def _loader(self, rows: _Rows | None, shuffle: bool = False) -> DataLoader:
        return DataLoader(
            rows,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(self.hparams.seed) if shuffle else None,
            collate_fn=PadCollator(self.tokenizer.pad_token_id),
            num_workers=self.hparams.num_workers,
        )


class _RandomTokens(Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=gen)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        ids = self.input_ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class SyntheticTokensDataModule(pl.LightningDataModule):
    """Random token ids of a fixed length, for benchmarks: every position is a target, no padding.

    Args:
        seq_len: Tokens per sequence.
        vocab_size: Token ids are drawn from ``0 .. vocab_size - 1``; at most the model's vocabulary.
        num_samples: Training sequences (validation gets a tenth, at least one).
        batch_size: Sequences per batch.
        seed: Seed of the tokens (validation uses ``seed + 1``).

    Raises:
        MisconfigurationException: If ``seq_len`` < 2 or a count is below 1.
    """

    def __init__(
        self, seq_len: int = 512, vocab_size: int = 32000, num_samples: int = 64, batch_size: int = 1, seed: int = 0
    ) -> None:
        super().__init__()
        if seq_len < 2 or min(vocab_size, num_samples, batch_size) < 1:
            raise MisconfigurationException(
                f"SyntheticTokensDataModule(seq_len={seq_len}, vocab_size={vocab_size}, num_samples={num_samples},"
                f" batch_size={batch_size}) needs seq_len >= 2 and the others >= 1."
            )
        self.save_hyperparameters()
        self.vocab_size = vocab_size

    def train_dataloader(self) -> DataLoader:
        """Training batches in a fixed order."""
        hp = self.hparams
        return DataLoader(_RandomTokens(hp.num_samples, hp.seq_len, hp.vocab_size, hp.seed), batch_size=hp.batch_size)

    def val_dataloader(self) -> DataLoader:
        """Validation batches from another seed."""
        hp = self.hparams
        data = _RandomTokens(max(1, hp.num_samples // 10), hp.seq_len, hp.vocab_size, hp.seed + 1)
        return DataLoader(data, batch_size=hp.batch_size)


__all__ = [
    "IGNORE_INDEX",
    "InstructionDataModule",
    "PadCollator",
    "SyntheticTokensDataModule",
    "byte_tokenizer",
    "encode",
    "load_records",
    "real_targets",
]
