"""Training: optimizers, learning-rate schedules, gradient clipping, data loading and
the Trainer loop, on the reference executor.

The update math is a set of small pure functions on numpy arrays with explicit state
dicts (``sgd_update``, ``adam_update``, ``learning_rate``, ``clip_by_global_norm``) so
the GPU runtime can reuse the same definitions and tests can check them one by one
against PyTorch. Steps are counted from 0: step 0 is the first update, and the
schedule, the callbacks and error messages all use that count.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np

from . import reference
from .autodiff import differentiate
from .errors import MeganeuraError, TrainingError
from .graph import Graph

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "warmup", "cosine")


# ---------------------------------------------------------------- configuration

@dataclass
class TrainConfig:
    """Everything that decides how a model trains. ``steps`` (if set) bounds the run,
    otherwise ``epochs`` passes over the data. ``total_steps`` is the horizon of the
    cosine schedule (default: ``steps``). ``lr_multipliers`` maps parameter names or
    fnmatch patterns (``"encoder.*"``) to a factor on the learning rate; 0 freezes."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    clip_norm: float | None = None
    steps: int | None = None
    epochs: int = 1
    batch_size: int = 32
    seed: int = 0
    lr_multipliers: dict[str, float] = field(default_factory=dict)
    loss: str = "loss"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise TrainingError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise TrainingError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.schedule == "cosine" and not (self.total_steps or self.steps):
            raise TrainingError("the cosine schedule needs total_steps (or steps) to know where it ends")
        if not self.lr >= 0 or self.batch_size <= 0:
            raise TrainingError(f"lr must be >= 0 and batch_size > 0, found lr={self.lr}, "
                                f"batch_size={self.batch_size}")
        self.betas = tuple(self.betas)

    def multiplier(self, name: str) -> float:
        """The LR factor of a parameter: the first matching entry of lr_multipliers, else 1."""
        for pattern, factor in self.lr_multipliers.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                return float(factor)
        return 1.0


# ---------------------------------------------------------------- schedules and clipping

def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of update ``step`` (0-based): linear warm-up over warmup_steps
    ((step + 1) / warmup_steps), then constant or a cosine decay to 0 at total_steps."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule != "cosine":
        return config.lr
    total = config.total_steps or config.steps
    span = max(total - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def global_norm(grads: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))


def clip_by_global_norm(grads: Mapping[str, np.ndarray], max_norm: float | None):
    """Scale all gradients by min(1, max_norm / (norm + 1e-6)), as
    torch.nn.utils.clip_grad_norm_; returns the clipped gradients and the norm before."""
    norm = global_norm(grads)
    if max_norm is None:
        return dict(grads), norm
    factor = min(1.0, max_norm / (norm + 1e-6))
    return {k: g * np.float32(factor) if factor < 1.0 else g for k, g in grads.items()}, norm


# ---------------------------------------------------------------- update rules (pure)

def sgd_update(p, g, state, lr, momentum=0.0, weight_decay=0.0):
    """torch.optim.SGD: L2 decay added to the gradient, momentum buffer without dampening.
    Returns (new parameter, new state)."""
    if weight_decay:
        g = g + np.float32(weight_decay) * p
    if momentum:
        buf = g.copy() if "momentum" not in state else np.float32(momentum) * state["momentum"] + g
        state, g = {"momentum": buf}, buf
    return p - np.float32(lr) * g, state


def adam_update(p, g, state, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    """Adam (L2 decay in the gradient) or AdamW (decoupled: p *= 1 - lr * wd), written
    the way torch.optim computes it. Returns (new parameter, new state)."""
    b1, b2 = betas
    if weight_decay and decoupled:
        p = p * np.float32(1.0 - lr * weight_decay)
    elif weight_decay:
        g = g + np.float32(weight_decay) * p
    t = state.get("t", 0) + 1
    m = np.float32(b1) * state.get("m", 0.0) + np.float32(1 - b1) * g
    v = np.float32(b2) * state.get("v", 0.0) + np.float32(1 - b2) * (g * g)
    step_size = lr / (1 - b1 ** t)
    denom = np.sqrt(v) / np.float32(math.sqrt(1 - b2 ** t)) + np.float32(eps)
    return p - np.float32(step_size) * (m / denom), {"t": t, "m": m, "v": v}


class Optimizer:
    """Applies one of the update rules to named parameters, with per-parameter decay
    flags and LR multipliers. A parameter with multiplier 0 is skipped entirely."""

    def __init__(self, kind: str = "adamw", lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0,
                 decay: Mapping[str, bool] | None = None, multipliers: Mapping[str, float] | None = None):
        if kind not in OPTIMIZERS:
            raise TrainingError(f"unknown optimizer {kind!r}; choose one of {', '.join(OPTIMIZERS)}")
        self.kind, self.lr, self.betas, self.eps = kind, lr, tuple(betas), eps
        self.weight_decay, self.momentum = weight_decay, momentum
        self.decay = dict(decay or {})
        self.multipliers = dict(multipliers or {})
        self.state: dict[str, dict] = {}

    @classmethod
    def from_config(cls, config: TrainConfig, graph: Graph) -> "Optimizer":
        return cls(config.optimizer, config.lr, config.betas, config.eps, config.weight_decay, config.momentum,
                   decay={n: m.get("decay", False) for n, m in graph.param_meta.items()},
                   multipliers={n: config.multiplier(n) for n in graph.parameters})

    def update(self, name: str, p: np.ndarray, g: np.ndarray, lr: float) -> np.ndarray:
        """The parameter after one step at learning rate lr (before its multiplier)."""
        lr = lr * self.multipliers.get(name, 1.0)
        wd = self.weight_decay if self.decay.get(name, False) else 0.0
        state = self.state.get(name, {})
        if self.kind == "sgd":
            p, state = sgd_update(p, g, state, lr, self.momentum, wd)
        else:
            p, state = adam_update(p, g, state, lr, self.betas, self.eps, wd, decoupled=self.kind == "adamw")
        self.state[name] = state
        return p

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray], lr: float | None = None):
        """Update ``params`` in place (by replacing entries) from ``grads``."""
        lr = self.lr if lr is None else lr
        for name, g in grads.items():
            if self.multipliers.get(name, 1.0) != 0.0:
                params[name] = self.update(name, params[name], g, lr)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "state": {k: dict(v) for k, v in self.state.items()}}

    def load_state_dict(self, d: Mapping) -> None:
        if d.get("kind") != self.kind:
            raise TrainingError(f"optimizer state is for {d.get('kind')!r}, not {self.kind!r}")
        self.state = {k: dict(v) for k, v in d["state"].items()}


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


# ---------------------------------------------------------------- history

@dataclass
class LossHistory:
    """Loss per step."""

    losses: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.losses)

    @property
    def last(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def mean(self, last_n: int | None = None) -> float:
        tail = self.losses[-last_n:] if last_n else self.losses
        return float(np.mean(tail)) if tail else math.nan


COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm", "seconds")


@dataclass
class TrainHistory(LossHistory):
    """Per step: loss, learning rate, gradient norm before clipping, wall seconds,
    epoch; per epoch: mean loss. ``stopped`` says the run was cancelled."""

    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    stopped: bool = False

    def record(self, loss, lr, grad_norm, seconds, epoch) -> None:
        self.losses.append(loss)
        self.lrs.append(lr)
        self.grad_norms.append(grad_norm)
        self.seconds.append(seconds)
        self.epochs.append(epoch)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The per-step table as CSV text; with a path, also written there atomically."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(COLUMNS)
        for i in range(len(self.losses)):
            w.writerow([i, self.epochs[i], repr(self.losses[i]), repr(self.lrs[i]),
                        repr(self.grad_norms[i]), repr(self.seconds[i])])
        text = buf.getvalue()
        if path is not None:
            write_atomically(os.fspath(path), text)
        return text


def write_atomically(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ---------------------------------------------------------------- trainer

BACKENDS = ("reference", "gpu")


def freeze_by_multiplier(graph: Graph, config: TrainConfig) -> Graph:
    """A copy of ``graph`` where parameters with LR multiplier 0 are not trainable, so
    differentiate gives them no gradient and no backward work."""
    g = graph.copy()
    for name in g.parameters:
        if config.multiplier(name) == 0.0:
            g.param_meta[name]["trainable"] = False
    return g


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
            from .training_session import build_session
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
        self.history.record(loss, lr, norm, time.perf_counter() - start, epoch)
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
