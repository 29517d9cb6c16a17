"""The update rules as small pure functions on numpy arrays with explicit state dicts
(``sgd_update``, ``adam_update``), shared by the reference trainer and checked one by one
against PyTorch, and ``Optimizer``, which holds the state.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from ..errors import TrainingError
from ..graph.ir import Graph
from .config import OPTIMIZERS, TrainConfig


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
