"""A run directory: what a training run leaves, written so that a crash never leaves a
half-written file, and read back to resume it.

    DIR/config.json          every option: model source and settings, data, TrainConfig, seed,
                             backend, package versions, adapter, created time, resumes
    DIR/metrics.jsonl        one JSON object a line per step: step, loss, lr, grad_norm,
                             seconds; val_loss on evaluation steps
    DIR/status.json          {"status": running|finished|stopped|diverged|failed, "step", "updated"}
    DIR/checkpoint-STEP/     model.safetensors (the model's own names and layout; a Hugging
                             Face model's config.json and tokenizer files beside it),
                             optimizer.safetensors ("PARAM:m", "PARAM:v" or "PARAM:momentum"),
                             state.json (step, data position, random state, seconds)

JSON files go to a temp file that is renamed over the old one; a checkpoint is written
into a temp folder that is renamed to ``checkpoint-STEP`` once complete; a metrics line
is one ``write`` to a file opened for appending. ``docs/cli.md`` documents every field.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Mapping

import numpy as np

from .. import config
from ..errors import TrainingError
from ..files import write_atomically
from ..weights import load_safetensors, save_safetensors

STATUSES = ("running", "finished", "stopped", "diverged", "failed")
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
CONFIG, METRICS, STATUS, STATE = "config.json", "metrics.jsonl", "status.json", "state.json"
WEIGHTS, OPTIMIZER = "model.safetensors", "optimizer.safetensors"
FORMAT = 1


def now() -> str:
    """The local time, ISO 8601 with its UTC offset, to the second."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def default_runs_folder() -> Path:
    """Where new run directories go: ``MEGANEURA_RUNS`` (engine.config), else runs/ here."""
    return Path(config.current().runs_dir or "runs")


def new_run_path(model_name: str, folder=None) -> Path:
    """A new, empty ``FOLDER/MODEL-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... if taken), created
    here: a mkdir that fails on an existing folder claims the name, so two runs started
    in the same second never get the same one. The model name is reduced to letters,
    digits, dots, dashes and underscores. ``discard_if_empty`` gives it back unused."""
    folder = Path(folder) if folder is not None else default_runs_folder()
    base = f"{re.sub(r'[^A-Za-z0-9._-]+', '-', model_name).strip('-') or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            path = folder / (base if n == 1 else f"{base}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
    except OSError as exc:
        raise TrainingError(f"cannot create a run directory in {folder}: {exc.strerror or exc}") from None


def discard_if_empty(path) -> None:
    """Remove ``path`` if it is an empty folder (one ``new_run_path`` made for a run that
    never started); anything else is left as it is."""
    with contextlib.suppress(OSError):
        Path(path).rmdir()


def is_step_row(row) -> bool:
    """Whether a parsed metrics.jsonl line is a step's: an object with a whole-number step."""
    step = row.get("step") if isinstance(row, dict) else None
    return isinstance(step, int) and not isinstance(step, bool)


def write_json(path: Path, obj) -> None:
    write_atomically(str(path), json.dumps(obj, indent=2) + "\n")


def read_json(path: Path) -> dict:
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TrainingError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TrainingError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(value, dict):
        raise TrainingError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


class RunDirectory:
    """The files of one run; ``create`` a new one or ``open`` an existing one."""

    def __init__(self, path):
        self.path = Path(path)

    @classmethod
    def create(cls, path, config: Mapping) -> "RunDirectory":
        """A new run directory holding ``config`` (config.json), no metrics yet, status running."""
        run = cls(path)
        if (run.path / CONFIG).exists():
            raise TrainingError(f"{run.path} already holds a run; resume it with --resume {run.path} "
                                f"or choose another --run-dir")
        try:
            run.path.mkdir(parents=True, exist_ok=True)
            (run.path / METRICS).touch()
        except OSError as exc:
            raise TrainingError(f"cannot create the run directory {run.path}: {exc.strerror or exc}") from None
        write_json(run.path / CONFIG, {"format": FORMAT, "created": now(), **config})
        run.write_status("running", 0)
        return run

    @classmethod
    def open(cls, path) -> "RunDirectory":
        run = cls(path)
        if not (run.path / CONFIG).is_file():
            raise TrainingError(f"{run.path} is not a run directory: it has no {CONFIG}")
        return run

    # ------------------------------------------------------------ config, status, metrics

    def config(self) -> dict:
        return read_json(self.path / CONFIG)

    def update_config(self, **fields) -> None:
        write_json(self.path / CONFIG, {**self.config(), **fields})

    def write_status(self, status: str, step: int, error: str | None = None) -> None:
        """status.json; ``error`` says why a run failed or diverged (omitted otherwise)."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        reason = {"error": error} if error else {}
        write_json(self.path / STATUS, {"status": status, "step": int(step), "updated": now(), **reason})

    def status(self) -> dict:
        return read_json(self.path / STATUS)

    def append_metrics(self, row: Mapping) -> None:
        """One line, written with one ``write`` to the end of metrics.jsonl."""
        line = (json.dumps(dict(row)) + "\n").encode("utf-8")
        fd = os.open(self.path / METRICS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def metrics(self) -> list[dict]:
        """The lines of metrics.jsonl that parse (a line cut short by a crash does not)."""
        rows = []
        path = self.path / METRICS
        for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else ():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if is_step_row(row):
                rows.append(row)
        return rows

    def keep_metrics_through(self, step: int) -> None:
        """Drop the lines after ``step`` (steps a resumed run does again)."""
        kept = [row for row in self.metrics() if row["step"] <= step]
        write_atomically(str(self.path / METRICS), "".join(json.dumps(row) + "\n" for row in kept))

    # ------------------------------------------------------------ checkpoints

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint (one with its state.json), by step."""
        found = []
        for child in self.path.iterdir() if self.path.is_dir() else ():
            match = CHECKPOINT.fullmatch(child.name)
            if match and (child / STATE).is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save_checkpoint(self, step: int, model, params: Mapping[str, np.ndarray],
                        optimizer_state: Mapping[str, np.ndarray], state: Mapping,
                        files: Mapping[str, str] | None = None) -> Path:
        """Write ``checkpoint-STEP`` in a temp folder and rename it into place (replacing
        an older one of the same step); on any failure nothing but the old state remains.
        ``files`` (name -> text) join the model's own (the training data's tokenizer)."""
        final = self.path / f"checkpoint-{step}"
        temp = Path(tempfile.mkdtemp(dir=self.path, prefix=f".{final.name}.", suffix=".tmp"))
        try:
            os.chmod(temp, 0o755)
            model.save_weights(params, temp / WEIGHTS)
            for extra in model.checkpoint_files():
                shutil.copyfile(extra, temp / extra.name)
            for name, text in (files or {}).items():
                write_atomically(temp / name, text)
            save_safetensors(optimizer_state, temp / OPTIMIZER, metadata={"format": "meganeura-optimizer"})
            write_json(temp / STATE, {"step": int(step), **state, "created": now()})
            if final.exists():
                old = Path(tempfile.mkdtemp(dir=self.path, prefix=f".{final.name}.", suffix=".old"))
                os.replace(final, old / final.name)
                os.replace(temp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(temp, final)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return final

    @staticmethod
    def load_checkpoint(folder, model) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
        """(parameters bound to ``model``, optimizer state, state.json) of a checkpoint folder."""
        folder = Path(folder)
        state = read_json(folder / STATE)
        params = model.load_weights(folder / WEIGHTS)
        optimizer_state = load_safetensors(folder / OPTIMIZER)
        return params, optimizer_state, state
