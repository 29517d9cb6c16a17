"""How a run trains: ``TrainConfig`` (optimizer, learning rate and its schedule, clipping,
per-parameter multipliers), the schedule, gradient clipping and freezing by multiplier.
Steps count from 0.
"""

from __future__ import annotations

import fnmatch
import math
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


def freeze_by_multiplier(graph: Graph, config: TrainConfig) -> Graph:
    """A copy of ``graph`` where parameters with LR multiplier 0 are not trainable, so
    differentiate gives them no gradient and no backward work."""
    g = graph.copy()
    for name in g.parameters:
        if config.multiplier(name) == 0.0:
            g.param_meta[name]["trainable"] = False
    return g
