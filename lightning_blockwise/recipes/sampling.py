"""The order of rows in an epoch, resumable from a checkpoint, and the loaders that use it.

The training loader resumes mid-epoch and across epochs exactly where the uninterrupted run
would have gone on; no loader draws from the global RNG. See NOTE [ Resumable data order ].

Example::

    loader = train_loader(dataset, batch_size=8, seed=0, shuffle=True, collate_fn=collate)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

# NOTE [ Resumable data order ]
#
# A run resumed from a checkpoint must train on the batches the uninterrupted run would have trained on next: the
# rest of the interrupted epoch, then every later epoch in the same order. A `DataLoader` that shuffles with a
# generator seeded afresh in `train_dataloader()` replays epoch 0 from its first batch after any resume. Four things
# make the order resumable (tests/recipes/test_data.py resumes `Trainer.fit` from each kind of checkpoint named here):
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


def train_loader(dataset: Dataset, batch_size: int, seed: int, shuffle: bool, **kwargs: Any) -> StatefulDataLoader:
    """A training loader whose order is fixed by ``seed`` and the epoch, and resumes from its ``state_dict``.

    Args:
        dataset: The rows.
        batch_size: Rows per batch.
        seed: Seed of the shuffle (``seed + epoch`` each epoch) and of the workers' base seed.
        shuffle: Whether each epoch is a permutation; else rows come in order.
        kwargs: Further :class:`~torchdata.stateful_dataloader.StatefulDataLoader` arguments.
    """
    sampler = _EpochOrder(len(dataset), seed, shuffle)
    with warnings.catch_warnings():
        # torchdata 0.11 calls `torch.set_vital`, which torch deprecates; the warning is not the user's to act on.
        warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
        # The generator only seeds workers: NOTE [ Resumable data order ], point 4.
        return StatefulDataLoader(
            dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed), **kwargs
        )


def eval_loader(dataset: Dataset | None, batch_size: int, seed: int, **kwargs: Any) -> DataLoader:
    """An evaluation loader in order, with a generator of its own (NOTE [ Resumable data order ], point 4).

    Args:
        dataset: The rows.
        batch_size: Rows per batch.
        seed: Seed of the workers' base seed.
        kwargs: Further :class:`~torch.utils.data.DataLoader` arguments.
    """
    # In order, yet with a generator of its own: `iter()` draws the workers' base seed from the loader's generator,
    # else from the global RNG (NOTE [ Resumable data order ], point 4).
    return DataLoader(dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(seed), **kwargs)


__all__ = ["eval_loader", "train_loader"]
