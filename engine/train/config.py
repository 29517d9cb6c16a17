"""How a run trains: ``TrainConfig`` (optimizer, learning rate and its schedule, clipping,
per-parameter multipliers) and the ranges its values must lie in, the schedule, gradient
clipping and freezing by multiplier. ``learning_rate`` takes the 0-based update index;
what users see (metrics.jsonl, messages, CSV) counts steps from 1.
"""

from __future__ import annotations

import fnmatch
import math
import numbers
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..errors import TrainingError
from ..graph.ir import Graph


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
        self.betas = tuple(self.betas)
        check_ranges(self)

    def multiplier(self, name: str) -> float:
        """The LR factor of a parameter: the first matching entry of lr_multipliers, else 1."""
        for pattern, factor in self.lr_multipliers.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                return float(factor)
        return 1.0


# ---------------------------------------------------------------- valid ranges

# How a message names each field: the Studio's label and the command line's option.
LABELS = {"lr": "learning rate (--lr)", "clip_norm": "gradient clipping norm (--clip)",
          "warmup_steps": "warm-up steps (--warmup)", "weight_decay": "weight decay (--weight-decay)",
          "momentum": "momentum (--momentum)", "steps": "steps (--steps)", "seed": "seed (--seed)",
          "batch_size": "batch size", "epochs": "epochs", "total_steps": "total steps", "eps": "eps"}


def _require(ok: bool, field_name: str, valid: str, value) -> None:
    if not ok:
        raise TrainingError(f"{LABELS.get(field_name, field_name)} must be {valid}, found {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_seed(seed) -> int:
    """``seed`` if it can seed numpy's generators (an integer >= 0); else one clear
    TrainingError, so no command or panel meets numpy's ValueError traceback."""
    _require(_is_int(seed) and seed >= 0, "seed", "an integer >= 0", seed)
    return int(seed)


def check_ranges(config: "TrainConfig") -> None:
    """Refuse a value the update would misuse rather than reject: a negative clip norm
    reverses the gradients, 0 freezes them, momentum >= 1 never forgets, a negative
    weight decay grows the weights. The single check behind the CLI and the Studio."""
    _require(_is_number(config.lr) and config.lr > 0, "lr", "a finite number > 0", config.lr)
    _require(config.clip_norm is None or (_is_number(config.clip_norm) and config.clip_norm > 0), "clip_norm",
             "a finite number > 0, or off (no clipping)", config.clip_norm)
    _require(_is_number(config.weight_decay) and config.weight_decay >= 0, "weight_decay", "a finite number >= 0",
             config.weight_decay)
    _require(_is_number(config.momentum) and 0 <= config.momentum < 1, "momentum", "in [0, 1)", config.momentum)
    _require(len(config.betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in config.betas), "betas",
             "two numbers in [0, 1)", config.betas)
    _require(_is_number(config.eps) and config.eps > 0, "eps", "a finite number > 0", config.eps)
    _require(_is_int(config.warmup_steps) and config.warmup_steps >= 0, "warmup_steps", "an integer >= 0",
             config.warmup_steps)
    for name in ("steps", "total_steps"):
        value = getattr(config, name)
        _require(value is None or (_is_int(value) and value > 0), name, "an integer > 0", value)
    for name in ("epochs", "batch_size"):
        _require(_is_int(getattr(config, name)) and getattr(config, name) > 0, name, "an integer > 0",
                 getattr(config, name))
    check_seed(config.seed)
    for pattern, factor in config.lr_multipliers.items():
        _require(_is_number(factor) and factor >= 0, f"the LR multiplier of {pattern!r}", "a finite number >= 0",
                 factor)


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


def freeze_by_multiplier(graph: Graph, config: TrainConfig) -> Graph:
    """A copy of ``graph`` where parameters with LR multiplier 0 are not trainable, so
    differentiate gives them no gradient and no backward work."""
    g = graph.copy()
    for name in g.parameters:
        if config.multiplier(name) == 0.0:
            g.param_meta[name]["trainable"] = False
    return g
