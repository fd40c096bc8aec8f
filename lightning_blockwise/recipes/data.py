"""Data modules for fine-tuning: Alpaca-style instruction pairs, and random tokens for benchmarks.

Nothing here touches the network: the tokenizer is a local directory the user names, or a
byte-level tokenizer built in memory (:func:`byte_tokenizer`).

Example::

    data = InstructionDataModule("data/instructions.jsonl", tokenizer="/models/Qwen2.5-7B", max_length=1024)
    trainer.fit(module, datamodule=data)
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

#: The ignore index of the Hugging Face causal-LM loss: no loss where a label is -100.
IGNORE_INDEX = -100

#: The prompt format for tokenizers without a chat template (Alpaca's).
_ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
_ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"

#: What a data file must hold, for the error messages.
_FORMAT = (
    "Give a JSON list of objects or one JSON object per line, each with `instruction`, optional `input`, and `output`."
)


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

    The file is UTF-8, a leading byte-order mark allowed. Each record has string fields
    ``instruction`` and ``output``, and optionally ``input``: a string, ``null`` or absent.

    Args:
        path: The JSON or JSONL file.

    Raises:
        MisconfigurationException: If the file is not UTF-8, holds neither JSON nor JSONL (naming the line), or a
            record is not an object with those fields (naming the JSONL line, or the JSON record's index).
    """
    path = Path(path)
    try:
        # `utf-8-sig` drops a leading byte-order mark (Windows editors write one), which `json` would refuse.
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise MisconfigurationException(
            f"InstructionDataModule: {path} is not UTF-8 (byte {error.start}: {error.reason}). Save it as UTF-8,"
            " e.g. `iconv -f <its encoding> -t utf-8`."
        ) from None
    # A JSON file is one document; JSONL is one per non-empty line (a one-line JSONL is both).
    located = _parse_json(text, path) if text.lstrip().startswith("[") else _parse_jsonl(text, path)
    for where, record in located:
        _check_record(record, where, path)
    return [record for _, record in located]


def _parse_json(text: str, path: Path) -> list[tuple[str, Any]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise MisconfigurationException(
            f"InstructionDataModule: cannot read {path} as JSON: line {error.lineno}, column {error.colno}:"
            f" {error.msg}. {_FORMAT}"
        ) from None
    return [(f"record {index} (counting from 0)", record) for index, record in enumerate(records)]


def _parse_jsonl(text: str, path: Path) -> list[tuple[str, Any]]:
    located = []
    # Split on "\n" only: `str.splitlines` also splits on U+2028 and other separators that JSON strings may hold
    # raw, which would cut a record in two and miscount the lines. A "\r" left by "\r\n" is JSON whitespace.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            located.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            raise MisconfigurationException(
                f"InstructionDataModule: cannot read {path} as JSONL: line {number}, column {error.colno}:"
                f" {error.msg}. {_FORMAT}"
            ) from None
    return located


def _check_record(record: Any, where: str, path: Path) -> None:
    if not isinstance(record, dict) or "instruction" not in record or "output" not in record:
        raise MisconfigurationException(
            f"InstructionDataModule: {where} of {path} needs string fields `instruction` and `output`"
            f" (and optionally `input`), got {str(record)[:100]!r}."
        )
    # A null or a number would otherwise be formatted into the prompt and trained on as the text "None" or "3".
    for field in ("instruction", "output", "input"):
        value = record.get(field)
        if not isinstance(value, str) and not (field == "input" and value is None):
            allowed = "a string, null or absent" if field == "input" else "a string"
            raise MisconfigurationException(
                f"InstructionDataModule: {where} of {path} has `{field}` = {json.dumps(value)[:100]}, which must be"
                f' {allowed}. Write it as a JSON string ("" when empty).'
            )


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


# NOTE [ Resumable data order ]
#
# A run resumed from a checkpoint must train on the batches the uninterrupted run would have trained on next: the
# rest of the interrupted epoch, then every later epoch in the same order. A `DataLoader` that shuffles with a
# generator seeded afresh in `train_dataloader()` replays epoch 0 from its first batch after any resume. Four things
# make the order resumable (tests/test_data.py resumes `Trainer.fit` from each kind of checkpoint named here):
#
# 1. An epoch's order is a function of `seed` and the epoch number alone (`_EpochOrder`: a permutation from a
#    generator seeded with `seed + epoch`, `DistributedSampler`'s rule), not of a generator's state carried from
#    epoch to epoch. Lightning calls the sampler's `set_epoch` with the fit loop's epoch, restored from the
#    checkpoint, at the start of every epoch. That covers the commonest checkpoint, saved at the end of an epoch:
#    Lightning resumes it as a fresh epoch and does not hand the loader its saved state at all.
# 2. The training loader is torchdata's `StatefulDataLoader`, and the sampler's iterator saves its epoch and the rows
#    it has yielded. Lightning saves a training loader's `state_dict()` in the checkpoint's fit-loop state and, when
#    it resumes mid-epoch, hands it back through `load_state_dict`: the loader goes on after the last batch trained.
# 3. A saved position resumes only if its epoch is the one the sampler is at when the first row is asked for, so a
#    position in an epoch that is over starts the next epoch instead. A checkpoint saved after an epoch's last batch
#    (`ModelCheckpoint(every_n_train_steps=...)`, also with `limit_train_batches`) holds such a position; Lightning
#    starts the next epoch on it, and a loader that resumed the finished epoch would yield its leftover rows, or no
#    batch at all, so that Lightning would count an empty epoch and train one epoch less. The epoch is read at the
#    first row, not at `iter()`, because Lightning calls `iter()` (in `FitLoop.setup_data`) before `set_epoch`.
# 4. No loader draws from the global RNG, which also drives dropout. `_BaseDataLoaderIter.__init__`
#    (torch/utils/data/dataloader.py) draws a base seed for the workers from `loader.generator` on every
#    `iter(loader)`, even for an unshuffled loader without workers, and from `torch`'s global RNG when the loader has
#    no generator: each validation pass (the sanity check too) would shift the dropout masks of the training steps
#    after it, and training would depend on when validation runs. Every loader here has a generator of its own.
#
# Not restored: the loader's generator. With `num_workers > 0` the workers of a resumed epoch get their saved base
# seed back, but those of later epochs are seeded differently from the uninterrupted run's. Nothing here draws random
# numbers in workers (rows are encoded in `setup`, the collator is deterministic), so the batches are the same.


class _EpochOrder(Sampler[int]):
    """Row order of each epoch: a permutation drawn from ``seed + epoch`` when shuffled, else ``0 .. size - 1``.

    ``epoch`` moves on when an epoch's last row is drawn, and Lightning sets it at every epoch start through
    :meth:`set_epoch`. See NOTE [ Resumable data order ].
    """

    def __init__(self, size: int, seed: int, shuffle: bool) -> None:
        super().__init__()
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> _EpochOrderIterator:
        return _EpochOrderIterator(self)

    def set_epoch(self, epoch: int) -> None:
        """Order the next epoch begun as epoch ``epoch``."""
        self.epoch = epoch

    def rows(self, epoch: int) -> list[int]:
        """The rows of epoch ``epoch``, in order."""
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def state_dict(self) -> dict[str, int]:
        """The epoch to begin next."""
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a :meth:`state_dict`."""
        self.epoch = state["epoch"]


class _EpochOrderIterator(Iterator[int]):
    def __init__(self, order: _EpochOrder) -> None:
        self.order = order
        self.epoch: int | None = None
        self.rows: list[int] | None = None
        self.yielded = 0

    def __next__(self) -> int:
        if self.rows is None:
            # The epoch is the sampler's at the first row, not at `iter()`, and a loaded position counts only if it
            # is in that epoch: NOTE [ Resumable data order ], point 3.
            if self.epoch != self.order.epoch:
                self.epoch, self.yielded = self.order.epoch, 0
            self.rows = self.order.rows(self.epoch)
        if self.yielded == len(self.rows):
            raise StopIteration
        row = self.rows[self.yielded]
        self.yielded += 1
        if self.yielded == len(self.rows):
            # The epoch is over with its last row, whether or not the loader asks for one more.
            self.order.epoch = self.epoch + 1
        return row

    def state_dict(self) -> dict[str, int | None]:
        """The epoch (``None`` before the first row) and the rows yielded."""
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        """Go on from a :meth:`state_dict`, if its epoch is still the sampler's at the next row."""
        self.epoch, self.yielded, self.rows = state["epoch"], state["yielded"], None


def _train_loader(dataset: Dataset, batch_size: int, seed: int, shuffle: bool, **kwargs: Any) -> StatefulDataLoader:
    sampler = _EpochOrder(len(dataset), seed, shuffle)
    with warnings.catch_warnings():
        # torchdata 0.11 calls `torch.set_vital`, which torch deprecates; the warning is not the user's to act on.
        warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
        # The generator only seeds workers: NOTE [ Resumable data order ], point 4.
        return StatefulDataLoader(
            dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed), **kwargs
        )


def _eval_loader(dataset: Dataset | None, batch_size: int, seed: int, **kwargs: Any) -> DataLoader:
    # In order, yet with a generator of its own: `iter()` draws the workers' base seed from the loader's generator,
    # else from the global RNG (NOTE [ Resumable data order ], point 4).
    return DataLoader(dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(seed), **kwargs)


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

    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled training batches, in an order fixed by ``seed``; a checkpoint resumes it mid-epoch.

        See NOTE [ Resumable data order ] in this module.
        """
        hp = self.hparams
        return _train_loader(self.train_set, hp.batch_size, hp.seed, shuffle=True, **self._loader_options())

    def val_dataloader(self) -> DataLoader:
        """Validation batches in order."""
        return self._validation_loader()

    def test_dataloader(self) -> DataLoader:
        """The validation batches, to test on."""
        return self._validation_loader()

    def predict_dataloader(self) -> DataLoader:
        """The validation batches, to predict on."""
        return self._validation_loader()

    def _validation_loader(self) -> DataLoader:
        return _eval_loader(self.val_set, self.hparams.batch_size, self.hparams.seed, **self._loader_options())

    def _loader_options(self) -> dict[str, Any]:
        return {"collate_fn": PadCollator(self.tokenizer.pad_token_id), "num_workers": self.hparams.num_workers}


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

    def train_dataloader(self) -> StatefulDataLoader:
        """Training batches in a fixed order, resumed mid-epoch from checkpoints (NOTE [ Resumable data order ])."""
        hp = self.hparams
        data = _RandomTokens(hp.num_samples, hp.seq_len, hp.vocab_size, hp.seed)
        return _train_loader(data, hp.batch_size, hp.seed, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        """Validation batches from another seed."""
        hp = self.hparams
        data = _RandomTokens(max(1, hp.num_samples // 10), hp.seq_len, hp.vocab_size, hp.seed + 1)
        return _eval_loader(data, hp.batch_size, hp.seed + 1)


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
