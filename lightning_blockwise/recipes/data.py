"""Data modules for fine-tuning: instruction pairs and conversations, and random tokens for benchmarks.

Nothing here touches the network: the tokenizer is a local directory the user names, or a
byte-level tokenizer built in memory (:func:`byte_tokenizer`). The modules put together three
others: :mod:`~lightning_blockwise.recipes.records` reads and checks the records,
:mod:`~lightning_blockwise.recipes.chat` renders them as text (chat templates),
:mod:`~lightning_blockwise.recipes.encoding` turns them into token ids and labels,
:mod:`~lightning_blockwise.recipes.packing` packs them into rows, and
:mod:`~lightning_blockwise.recipes.sampling` orders them resumably. Their public names are
importable from here too.

Example::

    data = InstructionDataModule("data/chats.jsonl", tokenizer="/models/Qwen2.5-7B", max_length=4096, packing=True)
    trainer.fit(module, datamodule=data)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_blockwise.compat.flags import check_flag
from lightning_blockwise.recipes.chat import AUTO, chat_format
from lightning_blockwise.recipes.encoding import IGNORE_INDEX, PadCollator, byte_tokenizer, encode, real_targets
from lightning_blockwise.recipes.packing import PackCollator, pack
from lightning_blockwise.recipes.records import load_records
from lightning_blockwise.recipes.sampling import eval_loader, train_loader


class _Rows(Dataset):
    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


class InstructionDataModule(pl.LightningDataModule):
    """Instruction records or conversations (JSON or JSONL) as training rows, loss on the assistant turns.

    Records are instruction pairs (``instruction``, optional ``input``, ``output``) or
    conversations (``messages``: ``{"role", "content"}`` turns), mixed freely (see
    :func:`load_records`). Each becomes one example (see :func:`encode`): rendered with the
    chat template (``chat_template``; by default the tokenizer's when it has one, else the
    Alpaca prompt), the tokens outside assistant turns and padding -100 in the labels; examples
    are cut at ``max_length`` tokens, and those left with fewer than two tokens to train on (an
    empty output, a prompt that fills ``max_length``) are dropped. The examples are split into
    train and validation sets by ``seed``; test and predict use the validation set.

    With ``packing`` the examples of each set are packed into rows of at most ``max_length``
    tokens once, at setup (:func:`~lightning_blockwise.recipes.packing.pack`), and a batch is
    ``batch_size`` rows, each example attending only to itself (NOTE [ Packed rows ] in
    recipes/packing.py): the batches hold ``position_ids`` and ``use_cache=False`` and no
    attention mask, so the module must pass the batch whole to the model (``model(**batch)``).
    The rows are shuffled each epoch and resume exactly like unpacked examples.

    Args:
        path: The JSON or JSONL file.
        tokenizer: A local tokenizer directory (e.g. the checkpoint's); ``None`` builds the
            byte-level :func:`byte_tokenizer`. Never downloaded.
        max_length: Longest example in tokens (longer ones are truncated); with ``packing``, longest row too.
        batch_size: Examples per batch; with ``packing``, packed rows per batch.
        val_fraction: Fraction of the examples held out for validation (at least one when above 0).
        num_workers: DataLoader worker processes.
        seed: Seed of the split and of the training shuffle.
        chat_template: ``"auto"``: the tokenizer's chat template if it has one, else the Alpaca prompt;
            ``"alpaca"``: the Alpaca prompt; else a Jinja chat template, its source or a file holding it. The one in
            use is logged at setup.
        assistant_only_loss: Train on the assistant turns only (instruction records: the output); ``False`` trains
            on every token.
        packing: Pack several examples into each row of ``max_length`` tokens.

    Raises:
        MisconfigurationException: If ``max_length`` < 2, ``val_fraction`` is not in [0, 1), ``chat_template`` is
            not one of its choices, ``assistant_only_loss`` or ``packing`` is not a bool, ``tokenizer`` does not exist
            or holds no tokenizer, or (at setup, when fitting) the split leaves no training example.
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
        chat_template: str = AUTO,
        assistant_only_loss: bool = True,
        packing: bool = False,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise MisconfigurationException(f"InstructionDataModule(max_length={max_length}) must be at least 2.")
        if not 0 <= val_fraction < 1:
            raise MisconfigurationException(f"InstructionDataModule(val_fraction={val_fraction}) must be in [0, 1).")
        check_flag("InstructionDataModule", "assistant_only_loss", assistant_only_loss)
        check_flag("InstructionDataModule", "packing", packing)
        self.save_hyperparameters()
        self.tokenizer = byte_tokenizer() if tokenizer is None else _local_tokenizer(tokenizer)
        if self.tokenizer.pad_token_id is None:
            # Padding is masked everywhere (label -100, and mask 0 or a sequence of its own), so any id serves.
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.vocab_size = len(self.tokenizer)
        # Resolved here, so that a bad `chat_template` is refused before the data are read.
        self.chat = chat_format(self.tokenizer, chat_template)
        self.train_set: _Rows | None = None
        self.val_set: _Rows | None = None
        self.dropped = 0
        self.examples = 0  # kept at setup (two tokens to train on), before the split

    def setup(self, stage: str) -> None:
        """Read, encode, filter and split the records, and pack them if asked (once).

        Raises:
            MisconfigurationException: If no record has two tokens to train on, or (when fitting) the split leaves no
                training example: a fit would run 0 steps and export an untrained adapter.
        """
        if self.train_set is not None:
            self._check_training_rows(stage)
            return
        hp = self.hparams
        rank_zero_info(f"InstructionDataModule: rendering the records with {self.chat.name}.")
        records = load_records(hp.path)
        rows = [encode(r, self.tokenizer, hp.max_length, self.chat, hp.assistant_only_loss) for r in records]
        kept = [row for row in rows if real_targets(row["labels"]) >= 2]
        self.dropped, self.examples = len(rows) - len(kept), len(kept)
        if not kept:
            raise MisconfigurationException(
                f"InstructionDataModule: none of the {len(rows)} records of {hp.path} has two tokens to train on"
                f" within max_length={hp.max_length}. Raise `max_length` or check the `output` fields (the"
                " assistant turns)."
            )
        order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(hp.seed)).tolist()
        num_val = max(1, round(hp.val_fraction * len(kept))) if hp.val_fraction > 0 and len(kept) > 1 else 0
        val = [kept[i] for i in order[:num_val]]
        train = [kept[i] for i in order[num_val:]]
        rank_zero_info(
            f"InstructionDataModule: {len(train)} train and {len(val)} validation examples from {hp.path};"
            f" {self.dropped} dropped (fewer than two tokens to train on within max_length={hp.max_length})."
        )
        if hp.packing:
            train, val = self._pack(train), self._pack(val)
            tokens = sum(len(example["input_ids"]) for row in train for example in row)
            rank_zero_info(
                f"InstructionDataModule: packed into {len(train)} train and {len(val)} validation rows of at most"
                f" {hp.max_length} tokens (the train rows {tokens / max(1, len(train) * hp.max_length):.0%} full)."
            )
        self.train_set, self.val_set = _Rows(train), _Rows(val)
        self._check_training_rows(stage)

    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled training batches, in an order fixed by ``seed``; a checkpoint resumes it mid-epoch.

        See NOTE [ Resumable data order ] in `recipes/sampling.py`.
        """
        hp = self.hparams
        return train_loader(self.train_set, hp.batch_size, hp.seed, shuffle=True, **self._loader_options())

    def val_dataloader(self) -> DataLoader:
        """Validation batches in order."""
        return self._validation_loader()

    def test_dataloader(self) -> DataLoader:
        """The validation batches, to test on."""
        return self._validation_loader()

    def predict_dataloader(self) -> DataLoader:
        """The validation batches, to predict on."""
        return self._validation_loader()

    def _check_training_rows(self, stage: str) -> None:
        """Refuse to fit on a split without a training example: 0 steps, then an untrained adapter exported."""
        if stage != "fit" or len(self.train_set):
            return
        hp = self.hparams
        raise MisconfigurationException(
            f"InstructionDataModule(val_fraction={hp.val_fraction}): the split leaves 0 training examples: all"
            f" {self.examples} examples kept from {hp.path} go to validation ({self.dropped} records dropped). A fit"
            " would train 0 steps and export an untrained adapter. Lower `val_fraction` (e.g. 0.1; 0.0 trains on"
            " every example) or add records."
        )

    def _pack(self, examples: list[dict[str, list[int]]]) -> list[list[dict[str, list[int]]]]:
        # Once, at setup, not per epoch: the number of rows (Lightning's batches per epoch, and the schedule's
        # length) stays fixed, and `_EpochOrder` shuffles and resumes the rows as it does examples.
        bins = pack([len(example["input_ids"]) for example in examples], self.hparams.max_length)
        return [[examples[i] for i in b] for b in bins]

    def _validation_loader(self) -> DataLoader:
        return eval_loader(self.val_set, self.hparams.batch_size, self.hparams.seed, **self._loader_options())

    def _loader_options(self) -> dict[str, Any]:
        pad_id = self.tokenizer.pad_token_id
        collate = PackCollator(pad_id) if self.hparams.packing else PadCollator(pad_id)
        return {"collate_fn": collate, "num_workers": self.hparams.num_workers}


def _local_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer in the local directory ``path``, or an error that names the path (never a download)."""
    if not Path(path).exists():
        # Hugging Face takes a missing path for a hub repo id and says its name is malformed ("Repo id must be ...").
        raise MisconfigurationException(
            f"InstructionDataModule(tokenizer={path!r}): {path} does not exist. Give the local directory that holds"
            " the model's tokenizer (the checkpoint's, usually), or None for the byte-level tokenizer; nothing is"
            " downloaded."
        )
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise MisconfigurationException(
            f"InstructionDataModule(tokenizer={path!r}): no tokenizer could be loaded from {path} ({error})."
            " Give the directory that holds the model's tokenizer files (tokenizer.json or tokenizer_config.json)."
        ) from None


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
        return train_loader(data, hp.batch_size, hp.seed, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        """Validation batches from another seed."""
        hp = self.hparams
        data = _RandomTokens(max(1, hp.num_samples // 10), hp.seq_len, hp.vocab_size, hp.seed + 1)
        return eval_loader(data, hp.batch_size, hp.seed + 1)


__all__ = [
    "IGNORE_INDEX",
    "InstructionDataModule",
    "PackCollator",
    "PadCollator",
    "SyntheticTokensDataModule",
    "byte_tokenizer",
    "encode",
    "load_records",
    "real_targets",
]
