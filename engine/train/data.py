"""``DataLoader``: batches of a model's example arrays, shuffled by a seeded generator.
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

    def batches(self, epoch: int) -> Iterator[dict[str, np.ndarray]]:
        idx = self.order(epoch)
        for b in range(len(self)):
            pick = idx[b * self.batch_size:(b + 1) * self.batch_size]
            yield {k: v[pick] for k, v in self.dataset.items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """One epoch; the next iteration is the next epoch."""
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self.batches(epoch)
