"""Data modules for fine-tuning: Alpaca-style instruction pairs, and random tokens for benchmarks.

Nothing here touches the network: the tokenizer is a local directory the user names, or a
byte-level tokenizer built in memory (:func:`byte_tokenizer`). The modules put together three
others: :mod:`~lightning_blockwise.recipes.records` reads and checks the records,
:mod:`~lightning_blockwise.recipes.encoding` turns them into token ids and labels, and
:mod:`~lightning_blockwise.recipes.sampling` orders them resumably. Their public names are
importable from here too.

Example::

    data = InstructionDataModule("data/instructions.jsonl", tokenizer="/models/Qwen2.5-7B", max_length=1024)
    trainer.fit(module, datamodule=data)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer

from lightning_blockwise.recipes.encoding import IGNORE_INDEX, PadCollator, byte_tokenizer, encode, real_targets
from lightning_blockwise.recipes.records import load_records
from lightning_blockwise.recipes.sampling import eval_loader, train_loader


class _Rows(Dataset):
    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]


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

    def _validation_loader(self) -> DataLoader:
        return eval_loader(self.val_set, self.hparams.batch_size, self.hparams.seed, **self._loader_options())

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
        return train_loader(data, hp.batch_size, hp.seed, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        """Validation batches from another seed."""
        hp = self.hparams
        data = _RandomTokens(max(1, hp.num_samples // 10), hp.seq_len, hp.vocab_size, hp.seed + 1)
        return eval_loader(data, hp.batch_size, hp.seed + 1)


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
