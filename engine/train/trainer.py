"""``Trainer``: differentiates the graph once, then per step runs it on the reference
executor or the GPU (``engine.train.session``), clips, updates, and records history.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from typing import Callable, Iterable, Mapping

import numpy as np

from ..graph import reference
from ..autodiff.gradients import differentiate
from ..errors import MeganeuraError, MeganeuraWarning, TrainingError
from ..graph.ir import Graph
from .config import TrainConfig, clip_by_global_norm, freeze_by_multiplier, learning_rate
from .data import DataLoader
from .history import TrainHistory
from .optimizers import Optimizer


# ---------------------------------------------------------------- trainer

BACKENDS = ("reference", "gpu")


class Trainer:
    """Differentiates the graph once, then per step runs the training graph (float32),
    reads loss and gradients, clips them and applies the optimizer.

    Parameters with trainable=False or LR multiplier 0 get no gradient and no backward
    work, and stay bit-identical. ``should_stop`` (a callable or threading.Event) is
    checked after every step; a non-finite loss or gradient raises TrainingError."""

    def __init__(self, graph: Graph, params: Mapping[str, np.ndarray], config: TrainConfig | None = None,
                 backend: str = "reference", on_step: Callable | None = None, on_epoch: Callable | None = None,
                 should_stop: Callable[[], bool] | threading.Event | None = None):
        if backend not in BACKENDS:
            raise MeganeuraError(f"Trainer backend {backend!r} is not available; choose one of {', '.join(BACKENDS)}")
        self.config = config or TrainConfig()
        self.backend = backend
        self.graph = graph
        self.session = None
        if backend == "gpu":
            from .session import build_session
            self.session = build_session(graph, self.config, params)
            self.train_graph, self.pairs = self.session.graph, self.session.pairs
        else:
            self.train_graph, self.pairs = differentiate(freeze_by_multiplier(graph, self.config), self.config.loss)
        self._params = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        self.optimizer = Optimizer.from_config(self.config, graph)
        self.history = TrainHistory()
        self.on_step, self.on_epoch = on_step, on_epoch
        self.should_stop = should_stop.is_set if isinstance(should_stop, threading.Event) else should_stop
        self.step_count = 0

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The current parameters (read back from the GPU on the gpu backend)."""
        return self.session.get_parameters() if self.session is not None else self._params

    def step(self, batch: Mapping[str, np.ndarray], epoch: int = 0) -> float:
        """One update on one batch; returns the loss before the update. A non-finite
        loss or gradient norm raises TrainingError and leaves the parameters as they were."""
        step, start = self.step_count, time.perf_counter()
        lr = learning_rate(self.config, step)
        if self.session is not None:
            self.session.set_inputs({k: v for k, v in batch.items() if k in self.train_graph.inputs})
            loss, norm = self.session.step()
            grads = None
        else:
            out = reference.run(self.train_graph, batch, self._params, np.float32)
            loss = float(out[self.config.loss])
            grads, norm = clip_by_global_norm({p: out[gname] for p, gname in self.pairs}, self.config.clip_norm)
        if not math.isfinite(loss):
            raise TrainingError(f"loss became {loss} at step {step}; lower the learning rate or clip gradients")
        if not math.isfinite(norm):
            raise TrainingError(f"gradient norm became {norm} at step {step}; lower the learning rate")
        if grads is not None:
            self.optimizer.step(self._params, grads, lr)
        warning = self.history.record(loss, lr, norm, time.perf_counter() - start, epoch)
        if warning:
            warnings.warn(warning, MeganeuraWarning, stacklevel=2)
        self.step_count += 1
        if self.on_step:
            self.on_step(step, loss)
        return loss

    def fit(self, data: DataLoader | Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]]) -> TrainHistory:
        """Train for config.steps steps (across epochs) or config.epochs epochs. ``data``
        is a DataLoader, a dataset dict (batched with config.batch_size, seeded
        shuffle, drop_last so every batch fits the graph) or a list of batches."""
        if isinstance(data, Mapping):
            data = DataLoader(data, self.config.batch_size, shuffle=True, seed=self.config.seed, drop_last=True)
        epoch = 0
        while not self._done(epoch):
            epoch_start = len(self.history)
            for batch in data:
                self.step(batch, epoch)
                if self._cancelled():
                    self.history.stopped = True
                    return self.history
                if self.config.steps is not None and self.step_count >= self.config.steps:
                    break
            if len(self.history) == epoch_start:
                raise TrainingError("the data gave no batch; is the dataset smaller than one batch?")
            self.history.epoch_losses.append(self.history.mean(len(self.history) - epoch_start))
            if self.on_epoch:
                self.on_epoch(epoch, self.history)
            epoch += 1
        return self.history

    def _done(self, epoch: int) -> bool:
        if self.config.steps is not None:
            return self.step_count >= self.config.steps
        return epoch >= self.config.epochs

    def _cancelled(self) -> bool:
        return bool(self.should_stop and self.should_stop())
