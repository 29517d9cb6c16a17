"""What a run leaves: ``LossHistory`` and ``TrainHistory`` (per-step rows, CSV), written atomically.
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from ..files import write_atomically


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
DIVERGENCE = 100   # a loss this many times its first value is worth a warning


@dataclass
class TrainHistory(LossHistory):
    """Per step: loss, learning rate, gradient norm before clipping, wall seconds,
    epoch; per epoch: mean loss. ``stopped`` says the run was cancelled; ``warning``,
    once the loss has grown a hundredfold over its first value, says so. Messages and
    CSV number steps as metrics.jsonl does (``step_number``)."""

    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    stopped: bool = False
    warning: str | None = None
    first_step: int = 0      # steps done before this history's first (a resumed run's checkpoint)

    def step_number(self, index: int) -> int:
        """The step of row ``index`` as metrics.jsonl numbers it: from 1, going on after
        a resumed run's checkpoint, so messages and CSV agree with the run directory."""
        return self.first_step + index + 1

    def record(self, loss, lr, grad_norm, seconds, epoch) -> str | None:
        """Add a step; returns the divergence warning the first time there is one."""
        self.losses.append(loss)
        self.lrs.append(lr)
        self.grad_norms.append(grad_norm)
        self.seconds.append(seconds)
        self.epochs.append(epoch)
        first = self.losses[0]
        if self.warning is None and first > 0 and loss > DIVERGENCE * first:
            self.warning = (f"the loss grew from {first:.4g} (step {self.step_number(0)}) to {loss:.4g} "
                            f"(step {self.step_number(len(self.losses) - 1)}), "
                            f"over {DIVERGENCE}x its first value: the learning rate ({lr:.3g}) may be too high")
            return self.warning
        return None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The per-step table as CSV text; with a path, also written there atomically."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(COLUMNS)
        for i in range(len(self.losses)):
            w.writerow([self.step_number(i), self.epochs[i], repr(self.losses[i]), repr(self.lrs[i]),
                        repr(self.grad_norms[i]), repr(self.seconds[i])])
        text = buf.getvalue()
        if path is not None:
            write_atomically(os.fspath(path), text)
        return text
