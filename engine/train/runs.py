"""Reading run directories: what ``meganeura runs`` and the Studio's Runs panel show.

A run directory (written by ``train --run-dir``) holds ``config.json`` (every option),
``metrics.jsonl`` (one JSON object per step: ``step``, ``loss``, ``lr``, ``grad_norm``,
``seconds``; ``val_loss`` on evaluation steps), ``status.json`` (``status``, ``step``,
``updated``; missing means unknown) and ``checkpoint-STEP/`` folders. A run may be
written while it is read: a partial last line of ``metrics.jsonl`` is left for the next
read, and ``RunMetrics.update`` reads only the bytes appended since the last one, so a
watcher can poll cheaply. ``debiased_ema`` is TensorBoard's smoothing of a scalar curve.
Pure numpy: no Qt.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .run_dir import CONFIG, METRICS, STATUS, RunDirectory, is_step_row

UNKNOWN = "unknown"


# ---------------------------------------------------------------- smoothing

def debiased_ema(values, weight: float) -> np.ndarray:
    """TensorBoard's scalar smoothing: an exponential moving average started at 0 and
    divided by ``1 - weight**n`` (n: finite points seen), so the smoothed line starts
    on the first value instead of rising from 0, and follows the raw one without the
    lag of an EMA started at the first point. As TensorBoard does, non-finite points
    pass through unsmoothed (and are not counted) and a constant series stays exactly
    constant. ``weight`` in [0, 1): 0 is no smoothing."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight {weight} is outside [0, 1)")
    y = np.asarray(values, dtype=np.float64)
    out = y.copy()
    finite = np.isfinite(y)
    if y.size == 0 or np.all(y == y[0]) or not finite.any():
        return out
    ema = _ema_from_zero(y[finite], weight)
    counts = np.arange(1, ema.size + 1)
    smoothed = ema / (1.0 - weight ** counts)
    smoothed[0] = y[finite][0]        # equal already, but for the last bit of rounding
    out[finite] = smoothed
    return out


def _ema_from_zero(v: np.ndarray, weight: float) -> np.ndarray:
    """last = weight * last + (1 - weight) * x over ``v``, from 0, a block of points at a
    time: inside a block the recurrence is a cumulative sum of x * weight^-k scaled back
    by weight^k, the block kept short enough that weight^-k stays far inside float64
    (1e150). No Python step a point, and no scipy.signal: importing it took 0.7 s, which
    the Studio paid on its UI thread at the first loss plot."""
    block = 64 if weight >= 0.005 else max(1, int(150 / -math.log10(weight)) if weight > 0 else 1)
    out = np.empty_like(v)
    last = 0.0
    for start in range(0, v.size, block):
        x = v[start:start + block]
        powers = weight ** np.arange(x.size)
        out[start:start + x.size] = weight * powers * last + (1.0 - weight) * np.cumsum(x / powers) * powers
        last = out[start + x.size - 1]
    return out


# ---------------------------------------------------------------- metrics.jsonl

def read_metrics(run_dir, offset: int = 0) -> tuple[list[dict], int]:
    """The metric rows of ``run_dir/metrics.jsonl`` from byte ``offset`` on, and the
    offset to read from next time. A last line without its newline that is not yet a
    whole JSON object (the writer is mid-line) is left for the next call; a line that is
    not a JSON object is skipped. A missing file is no rows."""
    path = Path(run_dir) / METRICS
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = [row for line in data[:end].splitlines() if (row := _parse(line)) is not None]
    tail = _parse(data[end:])
    if tail is not None:
        rows.append(tail)
        end = len(data)
    return rows, offset + end


def _parse(line: bytes) -> dict | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) else None


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


class RunMetrics:
    """The curves of one run, kept up to date by ``update()``: per training row its
    step, loss, seconds and cumulative wall time; per evaluation its step and validation
    loss. A row whose step is not past the last one (a resumed run repeating the steps
    after its checkpoint) replaces the rows from that step on: the latest history wins;
    a row with a ``val_loss`` and no ``loss`` for the last step joins that step's row."""

    KEYS = ("step", "loss", "seconds", "val_loss", "has_loss", "has_val")     # has_*: the row has the key

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir)
        self.offset = 0
        self.size = -1
        self.inode = None
        self.rewrites = 0              # times the file was read again from the start
        self._clear()

    def _clear(self) -> None:
        self.values: dict[str, list[float]] = {key: [] for key in self.KEYS}   # one entry per row
        self._columns: dict | None = None

    def __len__(self) -> int:
        return len(self.values["step"])

    def update(self) -> int:
        """Read what was appended since the last call; returns the number of new rows.
        A file that was replaced or shrank is read again from the start."""
        try:
            st = (self.run_dir / METRICS).stat()
            size, inode = st.st_size, st.st_ino
        except OSError:
            size, inode = 0, None
        if size == self.size and inode == self.inode:
            return 0
        if size < self.offset or inode != self.inode:     # rewritten (a resume keeps the steps up to its checkpoint)
            self.offset = 0
            self.rewrites += self.inode is not None
            self._clear()
        self.size, self.inode = size, inode
        rows, self.offset = read_metrics(self.run_dir, self.offset)
        rows = [row for row in rows if is_step_row(row)]   # as RunDirectory.metrics: a row is a step's
        for row in rows:
            self._add(row)
        if rows:
            self._columns = None
        return len(rows)

    def _add(self, row: dict) -> None:
        new = {key: _number(row.get(key)) for key in self.KEYS[:4]}
        new.update(has_loss="loss" in row, has_val="val_loss" in row)
        steps = self.values["step"]
        if steps and math.isfinite(new["step"]) and new["step"] <= steps[-1]:
            if new["step"] == steps[-1] and not new["has_loss"]:           # an evaluation of the last step
                self.values["val_loss"][-1] = new["val_loss"]
                self.values["has_val"][-1] = new["has_val"]
                return
            keep = next(i for i, s in enumerate(steps) if s >= new["step"])
            for values in self.values.values():
                del values[keep:]
        for key, value in new.items():
            self.values[key].append(value)

    def columns(self) -> dict[str, np.ndarray]:
        """``step``, ``loss``, ``seconds``, ``wall`` (cumulative seconds at the end of each
        step) over training rows; ``val_step``, ``val_loss``, ``val_wall`` over
        evaluations."""
        if self._columns is None:
            v = {key: np.array(values, dtype=np.float64) for key, values in self.values.items()}
            wall = np.cumsum(np.nan_to_num(v["seconds"], nan=0.0))
            train, val = v["has_loss"] > 0, v["has_val"] > 0
            self._columns = {"step": v["step"][train], "loss": v["loss"][train], "seconds": v["seconds"][train],
                             "wall": wall[train], "val_step": v["step"][val], "val_loss": v["val_loss"][val],
                             "val_wall": wall[val]}
        return self._columns


# ---------------------------------------------------------------- run directories

@dataclass
class RunSummary:
    """One line of ``meganeura runs``; ``to_dict`` is its ``--json`` object."""
    name: str
    path: str
    model: str | None
    last_step: int | None
    last_loss: float | None
    best_val_loss: float | None
    status: str
    created: str | None
    checkpoints: list[int] = field(default_factory=list)
    steps: int | None = None          # the steps the run was asked for, from config.json
    model_name: str | None = None     # the model's own name (a checkpoint's "llama:folder"), for tables

    def to_dict(self) -> dict:
        """The fields as JSON values: a loss that is not finite (a diverged run) is null."""
        d = asdict(self)
        for key in ("last_loss", "best_val_loss"):
            if d[key] is not None and not math.isfinite(d[key]):
                d[key] = None
        return d


def _read_json(path: Path) -> dict:
    """A JSON object file, or {} when it is missing, being replaced or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def is_run_dir(path) -> bool:
    path = Path(path)
    return (path / CONFIG).is_file() or (path / METRICS).is_file()


class Run:
    """A run directory as read so far; ``refresh()`` reads what changed (cheap when
    nothing did) and ``summary()`` describes it."""

    def __init__(self, path):
        self.path = Path(path)
        self.name = self.path.name
        self.config: dict = {}
        self.status: dict = {}
        self.metrics = RunMetrics(self.path)
        self.checkpoints: list[int] = []
        self._stamps: dict[str, float] = {}
        self.refresh()

    def _changed(self, name: str) -> bool:
        try:
            stamp = os.stat(self.path / name).st_mtime_ns
        except OSError:
            stamp = -1
        changed = self._stamps.get(name) != stamp
        self._stamps[name] = stamp
        return changed

    def refresh(self) -> bool:
        """Read new metric rows, and config and status if their files changed; returns
        whether anything did."""
        rewrites = self.metrics.rewrites
        changed = self.metrics.update() > 0 or self.metrics.rewrites != rewrites
        if self._changed(CONFIG):
            self.config, changed = _read_json(self.path / CONFIG), True
        if self._changed(STATUS):
            self.status, changed = _read_json(self.path / STATUS), True
        checkpoints = list_checkpoints(self.path)
        if checkpoints != self.checkpoints:
            self.checkpoints, changed = checkpoints, True
        return changed

    @property
    def state(self) -> str:
        """The status.json status, or "unknown" without one."""
        status = self.status.get("status")
        return status if isinstance(status, str) and status else UNKNOWN

    def summary(self) -> RunSummary:
        cols = self.metrics.columns()
        last_step = int(cols["step"][-1]) if cols["step"].size and math.isfinite(cols["step"][-1]) else None
        if last_step is None and isinstance(self.status.get("step"), int):
            last_step = self.status["step"]
        val = cols["val_loss"][np.isfinite(cols["val_loss"])]
        return RunSummary(name=self.name, path=str(self.path), model=self.model, last_step=last_step,
                          last_loss=float(cols["loss"][-1]) if cols["loss"].size else None,
                          best_val_loss=float(val.min()) if val.size else None,
                          status=self.state, created=_text(self.config.get("created")),
                          checkpoints=list(self.checkpoints), steps=self.steps, model_name=self.model_name)

    @property
    def model(self) -> str | None:
        """The model source: config.json's ``model`` {"source": ...} (or a plain string)."""
        model = self.config.get("model")
        return _text(model.get("source") or model.get("name")) if isinstance(model, dict) else _text(model)

    @property
    def model_name(self) -> str | None:
        """config.json's ``model`` ``name``, else the last part of the source."""
        model = self.config.get("model")
        if isinstance(model, dict) and model.get("name"):
            return str(model["name"])
        source = self.model
        return os.path.basename(source.rstrip("/\\")) or source if source else None

    @property
    def steps(self) -> int | None:
        """The steps the run is to reach: config.json's ``train`` {"steps": ...} (or ``steps``)."""
        train = self.config.get("train")
        steps = train.get("steps") if isinstance(train, dict) else self.config.get("steps")
        return steps if isinstance(steps, int) else None


def _text(value) -> str | None:
    return None if value is None else str(value)


def list_checkpoints(run_dir) -> list[int]:
    """The steps of the run's complete checkpoints (``checkpoint-STEP`` with its state.json)."""
    try:
        return [step for step, _ in RunDirectory(run_dir).checkpoints()]
    except OSError:
        return []


def find_run_dirs(folder) -> list[Path]:
    """The run directories in ``folder`` (``folder`` itself when it is one), by name."""
    folder = Path(folder)
    if is_run_dir(folder):
        return [folder]
    try:
        entries = [Path(e.path) for e in os.scandir(folder) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return []
    return sorted((p for p in entries if is_run_dir(p)), key=lambda p: p.name)


def open_runs(folder) -> list[Run]:
    """The run directories in ``folder`` read, oldest first: by config.json's ``created``
    (ISO time), then name; a new run comes last, so the ones before keep their places."""
    return sorted((Run(p) for p in find_run_dirs(folder)), key=run_order)


def run_order(run: Run) -> tuple[str, str]:
    return str(run.config.get("created") or ""), run.name


def list_runs(folder) -> list[RunSummary]:
    """A summary of every run directory in ``folder``, oldest first."""
    return [run.summary() for run in open_runs(folder)]
