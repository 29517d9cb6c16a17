"""``DataLoader``: batches of a model's example arrays, shuffled by a seeded generator.

The batch of a step is a pure function of (seed, step): step ``s`` is batch
``s % len(loader)`` of epoch ``s // len(loader)``, whose order is the permutation
``default_rng([seed, epoch])`` draws. A run resumed at step ``s`` therefore sees the
batches an uninterrupted one would (``batch_at``, ``position``).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from ..errors import TrainingError


# ---------------------------------------------------------------- data

class DataLoader:
    """Batches over a dataset given as a dict of equally long arrays. Each epoch draws
    its own permutation from (seed, epoch), so runs are reproducible and epochs differ."""

    def __init__(self, dataset: Mapping[str, np.ndarray], batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        self.dataset = {k: np.asarray(v) for k, v in dataset.items()}
        lengths = {k: len(v) for k, v in self.dataset.items()}
        if not lengths or len(set(lengths.values())) != 1:
            raise TrainingError(f"dataset arrays must be non-empty and equally long, found lengths {lengths}")
        if batch_size <= 0:
            raise TrainingError(f"batch_size must be positive, found {batch_size}")
        self.size = next(iter(lengths.values()))
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        if drop_last and self.size < batch_size:
            raise TrainingError(f"dataset has {self.size} examples, fewer than one batch of {batch_size}")
        self.epoch = 0

    def __len__(self) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def position(self, step: int) -> dict[str, int]:
        """Where step ``step`` reads: its epoch and its batch within the epoch."""
        epoch, batch = divmod(step, len(self))
        return {"epoch": epoch, "batch": batch}

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The batch of step ``step`` (0-based, counted over epochs)."""
        epoch, b = divmod(step, len(self))
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.order(epoch))
        pick = self._order[1][b * self.batch_size:(b + 1) * self.batch_size]
        return {k: v[pick] for k, v in self.dataset.items()}

    _order: tuple[int, np.ndarray] | None = None   # the last epoch's permutation, kept for its next batch

    def batches(self, epoch: int) -> Iterator[dict[str, np.ndarray]]:
        for b in range(len(self)):
            yield self.batch_at(epoch * len(self) + b)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """One epoch; the next iteration is the next epoch."""
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self.batches(epoch)
