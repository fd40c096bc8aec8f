"""Arithmetic progressions: the smallest data a frozen random base with LoRA adapters learns to continue.

Within a few dozen steps, so tests and quick experiments can watch a loss fall.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class ProgressionDataset(Dataset):
    """Arithmetic progressions modulo the vocabulary: ``x[i + 1] = x[i] + step``, with random start and step.

    Token ids run over ``1 .. vocab_size - 1`` (0 is padding). Once a model has seen two
    tokens it can predict the rest exactly, so the loss has plenty of room to fall.

    Args:
        num_sequences: Number of sequences.
        vocab_size: Number of token ids, padding included.
        min_length: Shortest sequence.
        max_length: Longest sequence; every item is right-padded to this length.
        max_step: Steps are drawn from ``1 .. max_step``.
        seed: Seed of the sequences; the same arguments give the same data.
    """

    def __init__(
        self, num_sequences: int, vocab_size: int, min_length: int, max_length: int, max_step: int, seed: int
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        modulus = vocab_size - 1
        starts = torch.randint(0, modulus, (num_sequences, 1), generator=gen)
        steps = torch.randint(1, max_step + 1, (num_sequences, 1), generator=gen)
        lengths = torch.randint(min_length, max_length + 1, (num_sequences, 1), generator=gen)
        positions = torch.arange(max_length)
        tokens = (starts + steps * positions) % modulus + 1
        self.attention_mask = (positions < lengths).long()
        self.input_ids = tokens * self.attention_mask
        # -100 is the ignore index of the Hugging Face causal-LM loss: no loss on padding.
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


class DemoDataModule(pl.LightningDataModule):
    """Synthetic arithmetic-progression sequences for :class:`DemoCausalLM`, deterministic from ``seed``.

    Train, validation and test sets are drawn from distinct seeds derived from ``seed``;
    prediction runs over the validation set.

    Args:
        vocab_size: Number of token ids, padding (0) included; at most the model's.
        num_train: Training sequences.
        num_val: Validation (and test) sequences.
        min_length: Shortest sequence.
        max_length: Longest sequence (the padded length).
        max_step: Largest step of a progression.
        batch_size: Sequences per batch.
        num_workers: DataLoader worker processes.
        seed: Seed of the data and of the training shuffle.

    Raises:
        MisconfigurationException: If the lengths or step are out of range.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        num_train: int = 1024,
        num_val: int = 128,
        min_length: int = 8,
        max_length: int = 24,
        max_step: int = 3,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 2 <= min_length <= max_length:
            raise MisconfigurationException(
                f"DemoDataModule(min_length={min_length}, max_length={max_length}) needs 2 <= min_length <= max_length."
            )
        if not 1 <= max_step < vocab_size - 1:
            raise MisconfigurationException(
                f"DemoDataModule(max_step={max_step}) must be between 1 and vocab_size - 2 = {vocab_size - 2}."
            )
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.train_set: ProgressionDataset | None = None
        self.val_set: ProgressionDataset | None = None
        self.test_set: ProgressionDataset | None = None

    def setup(self, stage: str) -> None:
        """Generate the splits (cheap, so all of them whatever the stage)."""
        hp = self.hparams

        def split(num_sequences: int, index: int) -> ProgressionDataset:
            # `3 * seed + index` is distinct for every (seed, split) pair: no two splits share a generator seed.
            return ProgressionDataset(
                num_sequences, hp.vocab_size, hp.min_length, hp.max_length, hp.max_step, seed=3 * hp.seed + index
            )

        self.train_set, self.val_set, self.test_set = split(hp.num_train, 0), split(hp.num_val, 1), split(hp.num_val, 2)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches, in an order fixed by ``seed``."""
        gen = torch.Generator().manual_seed(self.hparams.seed)
        return self._loader(self.train_set, shuffle=True, generator=gen)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in order."""
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        """Test batches in order."""
        return self._loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        """The validation batches, to predict on."""
        return self._loader(self.val_set)

    def _loader(self, dataset: Dataset, shuffle: bool = False, generator: torch.Generator | None = None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.hparams.num_workers,
        )


__all__ = ["DemoDataModule", "ProgressionDataset"]
