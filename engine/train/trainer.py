"""``Trainer``: differentiates the graph once, then per step runs it on the reference
executor or the GPU (``engine.train.session``), clips, updates, and records history.

A step (its update and its ``on_step`` callback) is one unit for Ctrl-C: in the main
thread a SIGINT that arrives during a step raises KeyboardInterrupt after it, so
parameters, optimizer state, step count and whatever ``on_step`` records always agree,
and a run can write a checkpoint of its last step (``engine.train.run``).
``optimizer_state``/``restore`` carry the optimizer across a checkpoint on either backend.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import warnings
from typing import Callable, Iterable, Mapping

import numpy as np

from ..graph import reference
from ..autodiff.gradients import differentiate
from ..compile.plan import STATE_NAMES
from ..errors import MeganeuraError, MeganeuraWarning, TrainingError
from ..graph.ir import Graph
from .config import TrainConfig, clip_by_global_norm, freeze_by_multiplier, learning_rate
from .data import DataLoader
from .history import TrainHistory
from .optimizers import Optimizer


# ---------------------------------------------------------------- trainer

BACKENDS = ("reference", "gpu")


class DivergedError(TrainingError):
    """The loss or the gradient norm of a step was not finite; the step made no update."""


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
        self._params = {k: np.array(v, dtype=np.float32, order="C") for k, v in params.items()}   # copies, in row order
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
        with interrupts_deferred():
            loss, norm = self._update(batch, step, lr)
            warning = self.history.record(loss, lr, norm, time.perf_counter() - start, epoch)
            self.step_count += 1
            if warning:
                warnings.warn(warning, MeganeuraWarning, stacklevel=2)
            if self.on_step:
                self.on_step(step, loss)
        return loss

    def _update(self, batch: Mapping[str, np.ndarray], step: int, lr: float) -> tuple[float, float]:
        """Loss and gradient norm of ``batch``, and the update (none where either is not finite).
        ``step`` is the 0-based update index; messages say ``step + 1``, the number
        metrics.jsonl gives the step."""
        if self.session is not None:
            self.session.set_inputs({k: v for k, v in batch.items() if k in self.train_graph.inputs})
            loss, norm = self.session.step()
            grads = None
        else:
            out = reference.run(self.train_graph, batch, self._params, np.float32)
            loss = float(out[self.config.loss])
            grads, norm = clip_by_global_norm({p: out[gname] for p, gname in self.pairs}, self.config.clip_norm)
        if step == 0 and not (math.isfinite(loss) and math.isfinite(norm)):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
            raise DivergedError(f"the {what} at step 1, before any update: the learning rate is not the cause; "
                                f"check the weights and this batch's inputs for NaN or infinite values")
        if not math.isfinite(loss):
            raise DivergedError(f"loss became {loss} at step {step + 1}; lower the learning rate or clip gradients")
        if not math.isfinite(norm):
            raise DivergedError(f"gradient norm became {norm} at step {step + 1}; lower the learning rate")
        if grads is not None:
            self.optimizer.step(self._params, grads, lr)
        return loss, norm

    def evaluate(self, batches: Iterable[Mapping[str, np.ndarray]]) -> float:
        """The mean loss of ``batches`` at the current parameters: forward only, no update
        (on the GPU through an inference session sharing the training session's parameters)."""
        losses = []
        for batch in batches:
            if self.session is not None:
                session = self._evaluation_session()
                session.set_inputs({k: v for k, v in batch.items() if k in session.graph.inputs})
                session.run()
                losses.append(float(session.read_output(self.config.loss)))
            else:
                losses.append(float(reference.run(self.graph, batch, self._params, np.float32)[self.config.loss]))
        return float(np.mean(losses)) if losses else math.nan

    _evaluator = None

    def _evaluation_session(self):
        if self._evaluator is None:
            from ..runtime.session import build_inference_session
            self._evaluator = build_inference_session(self.graph, share_with=self.session)
        return self._evaluator

    # ------------------------------------------------------------ checkpoints

    def state_names(self) -> list[str]:
        """The optimizer-state tensors a checkpoint holds: ``PARAM:m``, ``PARAM:v`` (Adam)
        or ``PARAM:momentum`` (SGD with momentum), of every parameter that is updated."""
        kind = self.config.optimizer
        states = STATE_NAMES[kind] if kind != "sgd" or self.config.momentum else ()
        updated = [p for p, _ in self.pairs if self.config.multiplier(p) != 0.0]
        return [f"{p}:{s}" for p in updated for s in states]

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer state as ``{"PARAM:STATE": array}`` in the parameters' shapes."""
        if self.session is not None:
            return self.session.optimizer_state()
        out = {}
        for key in self.state_names():   # before the first update: zeros, what the update starts from
            name, _, kind = key.rpartition(":")
            value = self.optimizer.state.get(name, {}).get(kind)
            out[key] = np.zeros_like(self._params[name]) if value is None else np.asarray(value, np.float32)
        return out

    def restore(self, steps: int, optimizer_state: Mapping[str, np.ndarray]) -> None:
        """Go on after ``steps`` updates with ``optimizer_state`` (as ``optimizer_state``
        gave it); the parameters are the ones the trainer was built with."""
        missing = [k for k in self.state_names() if k not in optimizer_state]
        if missing:
            raise TrainingError(f"the checkpoint's optimizer state lacks {', '.join(missing[:3])}"
                                f"{' ...' if len(missing) > 3 else ''}: was it written with --optimizer "
                                f"{self.config.optimizer}?")
        self.step_count = steps
        self.history.first_step = steps
        if self.session is not None:
            self.session.set_optimizer_state(dict(optimizer_state), steps)
            return
        state: dict[str, dict] = {}
        for key in self.state_names():
            name, _, kind = key.rpartition(":")
            entry = state.setdefault(name, {} if self.config.optimizer == "sgd" else {"t": steps})
            entry[kind] = np.array(optimizer_state[key], dtype=np.float32)
        self.optimizer.state = state

    # ------------------------------------------------------------ loops

    def fit(self, data: DataLoader | Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]]) -> TrainHistory:
        """Train for config.steps steps (across epochs) or config.epochs epochs. ``data``
        is a DataLoader, a dataset dict (batched with config.batch_size, seeded
        shuffle, drop_last so every batch fits the graph) or a list of batches. A
        DataLoader is read by step (``batch_at``), so a trainer restored at step s goes
        on with the batch an uninterrupted run would take."""
        if isinstance(data, Mapping):
            data = DataLoader(data, self.config.batch_size, shuffle=True, seed=self.config.seed, drop_last=True)
        if isinstance(data, DataLoader):
            return self._fit_loader(data)
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
            self._end_epoch(epoch, epoch_start)
            epoch += 1
        return self.history

    def _fit_loader(self, data: DataLoader) -> TrainHistory:
        per_epoch = len(data)
        total = self.config.steps if self.config.steps is not None else self.config.epochs * per_epoch
        epoch_start = len(self.history)
        while self.step_count < total:
            step = self.step_count
            self.step(data.batch_at(step), step // per_epoch)
            if self._cancelled():
                self.history.stopped = True
                return self.history
            if (step + 1) % per_epoch == 0 or self.step_count >= total:
                self._end_epoch(step // per_epoch, epoch_start)
                epoch_start = len(self.history)
        return self.history

    def _end_epoch(self, epoch: int, epoch_start: int) -> None:
        self.history.epoch_losses.append(self.history.mean(len(self.history) - epoch_start))
        if self.on_epoch:
            self.on_epoch(epoch, self.history)

    def _done(self, epoch: int) -> bool:
        if self.config.steps is not None:
            return self.step_count >= self.config.steps
        return epoch >= self.config.epochs

    def _cancelled(self) -> bool:
        return bool(self.should_stop and self.should_stop())


@contextlib.contextmanager
def interrupts_deferred():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until its end, then raise
    KeyboardInterrupt (or call the handler there was). Off the main thread, where
    Python delivers no signals, it does nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (None, signal.SIG_IGN):
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signal.SIGINT, caught[0])
        else:
            raise KeyboardInterrupt
