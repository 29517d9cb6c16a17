"""``TrainingRun``: a ``Trainer`` on a model's data that writes a run directory
(``engine.train.run_dir``) as it goes, and resumes one.

Per step it appends the metrics line, evaluates the validation examples every
``eval_every`` steps (and at the last), and writes ``checkpoint-STEP`` every
``save_every`` steps and at the end. Ctrl-C (KeyboardInterrupt, held until the step
is complete) and a stop request end the run "stopped"; a non-finite loss ends it
"diverged"; both after a checkpoint of the last good step. ``resume`` reads the run's
config.json and latest checkpoint and goes on with the batches an uninterrupted run
would have taken (the order of examples is a function of the seed and the step).

Steps in metrics, status and checkpoint names count updates done: the line of step s
reports the s-th update, and ``checkpoint-s`` holds the parameters after it. A line's
``seconds`` is the wall time since the line before (the update, its evaluation, the
previous step's checkpoint), so their sum is the run's time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..data.datasets import check_batch, example_count, hold_out
from ..errors import TrainingError
from .config import TrainConfig
from .data import DataLoader
from .run_dir import RunDirectory, now
from .trainer import DivergedError, Trainer, interrupts_deferred

VAL_FRACTION = 0.05       # of a user's data, held out when neither --val-data nor --val-fraction is given
STATUS_SECONDS = 1.0      # status.json is rewritten at most this often while running


@dataclass
class RunOptions:
    """What a run records beside its TrainConfig: where model and data come from, how
    often it evaluates and saves, its backend. ``import_options`` are what opening the
    model took besides its settings (an ONNX model's loss and target)."""

    source: str
    settings: dict
    weights: str | None = None
    data: str | None = None
    val_data: str | None = None
    val_fraction: float | None = None
    eval_every: int = 50
    save_every: int = 500
    backend: str = "reference"
    import_options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise TrainingError(f"--{name.replace('_', '-')} must be 0 or more, found {getattr(self, name)}")
        if self.val_fraction is not None and not 0 <= self.val_fraction < 1:
            raise TrainingError(f"--val-fraction must be at least 0 and below 1, found {self.val_fraction}")

    @property
    def holdout(self) -> float:
        """The fraction held out for validation: as given, else 0.05 of a user's data
        and none of a model's own synthetic dataset."""
        if self.val_fraction is not None:
            return self.val_fraction
        return VAL_FRACTION if self.data and not self.val_data else 0.0


@dataclass
class RunData:
    train: dict[str, np.ndarray]
    val: dict[str, np.ndarray] | None
    kind: str
    notes: list[str]
    files: dict[str, str] = dataclasses.field(default_factory=dict)   # written into every checkpoint


def prepare_data(model, options: RunOptions, config: TrainConfig) -> RunData:
    """The training examples (``--data``, else the model's own dataset from the seed) and
    the validation ones (``--val-data``, else held out), each at least one batch."""
    train = model.training_data(options.data) if options.data else None
    arrays = train.arrays if train else model.dataset(config.seed)
    notes = list(train.notes) if train else []
    val = None
    if options.val_data:
        val_data = model.training_data(options.val_data)
        val = val_data.arrays
        notes += [n for n in val_data.notes if n not in notes]
    elif options.holdout:
        arrays, val = hold_out(arrays, options.holdout)
    held = f" after {example_count(val)} held out for validation" if val is not None and not options.val_data else ""
    check_batch(arrays, config.batch_size, f"training data{held}")
    return RunData(arrays, val, train.kind if train else "builtin", notes, dict(train.files) if train else {})


def evaluation_batches(dataset: Mapping[str, np.ndarray], batch_size: int) -> list[dict[str, np.ndarray]]:
    """Every example once, in batches of ``batch_size`` (the graph's); the last batch is
    filled up by wrapping around to the first examples."""
    n = example_count(dataset)
    rows = np.arange(-(-n // batch_size) * batch_size) % n
    return [{k: v[rows[i:i + batch_size]] for k, v in dataset.items()} for i in range(0, len(rows), batch_size)]


def run_config(model, config: TrainConfig, options: RunOptions, data: RunData) -> dict:
    """config.json's fields (``created`` and ``format`` are added on writing)."""
    from ..runtime.device import adapter_summary, versions
    return {
        "model": {"source": options.source, "name": model.name, "settings": dict(model.settings),
                  "weights": options.weights, "import_options": dict(options.import_options)},
        "data": {"train": options.data, "val": options.val_data, "val_fraction": options.holdout,
                 "kind": data.kind, "train_examples": example_count(data.train),
                 "val_examples": example_count(data.val) if data.val is not None else 0},
        "train": dataclasses.asdict(config),
        "seed": config.seed, "backend": options.backend,
        "eval_every": options.eval_every, "save_every": options.save_every,
        "versions": versions(), "adapter": adapter_summary() if options.backend == "gpu" else None,
        "resumes": [],
    }


class TrainingRun:
    """One run of ``model`` writing ``directory``. Build it with ``start`` (a new run) or
    ``resume`` (from a run directory's latest checkpoint), then call ``run()``.
    ``on_step(row)`` gets each metrics line; ``should_stop()`` is asked after each step."""

    def __init__(self, model, params, config: TrainConfig, options: RunOptions, data: RunData,
                 directory: RunDirectory, on_step: Callable[[dict], None] | None = None,
                 should_stop=None, resume_from: tuple[int, Mapping, dict] | None = None):
        self.model, self.config, self.options, self.data, self.directory = model, config, options, data, directory
        graph = model.build(train=True, batch=config.batch_size)
        self.trainer = Trainer(graph, params, config, backend=options.backend, on_step=self._after_step,
                               should_stop=should_stop)
        self.loader = DataLoader(data.train, config.batch_size, shuffle=True, seed=config.seed, drop_last=True)
        self.val_batches = evaluation_batches(data.val, config.batch_size) if data.val is not None else None
        self.on_step = on_step
        self.first_step, self.seconds_before = 0, 0.0
        if resume_from is not None:
            step, optimizer_state, state = resume_from
            self.trainer.restore(step, optimizer_state)
            self.first_step, self.seconds_before = step, float(state.get("seconds", 0.0))
        self.saved_step = self.first_step if resume_from is not None else None
        self.status, self.error, self.checkpoint = "running", None, None
        self._started = self._last_row = self._status_written = 0.0

    # ------------------------------------------------------------ building

    @classmethod
    def start(cls, model, params, config: TrainConfig, options: RunOptions, path, prepared=None,
              **hooks) -> "TrainingRun":
        """A new run in ``path`` (created; it must not hold a run already). ``prepared(data)``
        is called once the data is read, before the session is built."""
        data = prepare_data(model, options, config)
        if prepared is not None:
            prepared(data)
        directory = RunDirectory.create(path, run_config(model, config, options, data))
        try:
            return cls(model, params, config, options, data, directory, **hooks)
        except KeyboardInterrupt:
            directory.write_status("stopped", 0)
            raise
        except BaseException as exc:   # the session did not build: the run never started
            directory.write_status("failed", 0, error=failure_reason(exc))
            raise

    @classmethod
    def resume(cls, directory: RunDirectory, model, steps: int | None = None, backend: str | None = None,
               prepared=None, **hooks) -> "TrainingRun":
        """Go on from the latest checkpoint of ``directory`` up to ``steps`` in all (default:
        the run's own), on ``backend`` (default: the run's). ``model`` is the run's model,
        opened from config.json's ``model`` source, settings and import options."""
        saved = directory.config()
        latest = directory.latest_checkpoint()
        if latest is None:
            raise TrainingError(f"{directory.path} has no checkpoint to resume from (checkpoint-STEP with its "
                                f"state.json)")
        step, folder = latest
        params, optimizer_state, state = directory.load_checkpoint(folder, model)
        config = saved_train_config(directory, saved, steps)
        run_options = options_from_config(saved, backend)
        data = prepare_data(model, run_options, config)
        expected = saved.get("data", {}).get("train_examples")
        if expected is not None and expected != example_count(data.train):
            data.notes.append(f"the training data now has {example_count(data.train)} examples, the run started "
                              f"with {expected}: the batches differ from an uninterrupted run's")
        if prepared is not None:
            prepared(data)
        directory.keep_metrics_through(step)
        resumes = saved.get("resumes", []) + [{"at": now(), "from_step": step, "steps": config.steps,
                                              "backend": run_options.backend}]
        directory.update_config(resumes=resumes, train=dataclasses.asdict(config))
        return cls(model, params, config, run_options, data, directory, resume_from=(step, optimizer_state, state),
                   **hooks)

    # ------------------------------------------------------------ running

    @property
    def total_steps(self) -> int:
        return int(self.config.steps or self.config.epochs * len(self.loader))

    def run(self) -> str:
        """Train to the end, a stop, Ctrl-C or divergence; returns the final status. A
        divergence raises TrainingError after the checkpoint, naming it. Any error, the
        final checkpoint's included, leaves status.json "failed" with its reason, never
        "running"."""
        self._started = self._last_row = time.perf_counter()
        self.directory.write_status("running", self.trainer.step_count)
        try:
            self._fit()
            self._finish()
        except BaseException as exc:
            self._record_end(exc)
            raise
        if self.error is not None:
            where = f"; the last good step's checkpoint is {self.checkpoint}" if self.checkpoint else ""
            raise TrainingError(f"{self.error}{where}") from None
        return self.status

    def _fit(self) -> None:
        """Train; a stop or Ctrl-C ends the run "stopped", a non-finite loss "diverged"
        (kept in ``error``): both are saved by ``_finish`` like a finished run."""
        try:
            history = self.trainer.fit(self.loader)
            self.status = "stopped" if history.stopped else "finished"
        except KeyboardInterrupt:
            self.status = "stopped"
        except DivergedError as exc:
            self.status, self.error = "diverged", exc

    def _finish(self) -> None:
        """The last checkpoint (unless this step has one) and the final status."""
        step = self.trainer.step_count
        if step > 0 and step != self.saved_step:
            with interrupts_deferred():
                self._save(step)
        elif self.saved_step:
            self.checkpoint = self.directory.path / f"checkpoint-{self.saved_step}"
        self.directory.write_status(self.status, step, error=str(self.error) if self.error else None)

    def _record_end(self, exc: BaseException) -> None:
        """status.json for a run ended by ``exc``: "stopped" for a Ctrl-C, else "failed"
        with the reason. Should that write fail too (a full disk), ``exc`` still goes up."""
        stopped = isinstance(exc, KeyboardInterrupt)
        self.status = "stopped" if stopped else "failed"
        with contextlib.suppress(Exception):
            self.directory.write_status(self.status, self.trainer.step_count,
                                        error=None if stopped else failure_reason(exc))

    def _after_step(self, index: int, loss: float) -> None:
        """After update ``index`` (0-based), inside the trainer's step (a Ctrl-C waits for
        it): its metrics line, an evaluation and a checkpoint when due."""
        step, history = index + 1, self.trainer.history
        row = {"step": step, "loss": loss, "lr": history.lrs[-1], "grad_norm": history.grad_norms[-1]}
        if self.val_batches is not None and self._evaluation_due(step):
            row["val_loss"] = self.trainer.evaluate(self.val_batches)
        clock = time.perf_counter()
        row["seconds"], self._last_row = clock - self._last_row, clock
        self.directory.append_metrics(row)
        if self.options.save_every and step % self.options.save_every == 0:
            self._save(step)
        if time.perf_counter() - self._status_written >= STATUS_SECONDS:
            self.directory.write_status("running", step)
            self._status_written = time.perf_counter()
        if self.on_step is not None:
            self.on_step(row)

    def _evaluation_due(self, step: int) -> bool:
        every = self.options.eval_every
        return step >= self.total_steps or bool(every and step % every == 0)

    def seconds(self) -> float:
        """Wall seconds of training so far (a resumed run goes on from its checkpoint's)."""
        return self.seconds_before + time.perf_counter() - self._started

    def _save(self, step: int) -> None:
        position = self.loader.position(step)
        state = {"data": {**position, "batch_size": self.config.batch_size, "examples": self.loader.size,
                          "seed": self.config.seed},
                 "random": {"generator": "numpy default_rng([seed, epoch]) permutes each epoch's examples",
                            "seed": self.config.seed, "epoch": position["epoch"]},
                 "optimizer": {"kind": self.config.optimizer, "updates": step},
                 "loss": self.trainer.history.last, "seconds": self.seconds()}
        self.checkpoint = self.directory.save_checkpoint(step, self.model, self.trainer.params,
                                                         self.trainer.optimizer_state(), state, self.data.files)
        self.saved_step = step
        self.directory.write_status("running", step)


def saved_train_config(directory: RunDirectory, saved: Mapping, steps: int | None) -> TrainConfig:
    """The TrainConfig config.json records, going to ``steps`` in all where given."""
    try:
        fields = {**saved["train"], **({"steps": steps} if steps is not None else {})}
        return TrainConfig(**{**fields, "betas": tuple(fields.get("betas", (0.9, 0.999)))})
    except (KeyError, TypeError) as exc:
        raise TrainingError(f"{directory.path / 'config.json'}: its \"train\" is not a training configuration "
                            f"this version reads ({type(exc).__name__}: {exc})") from None


def failure_reason(exc: BaseException) -> str:
    """What status.json's ``error`` says of the error that ended a run: its message, or
    its type where it has none."""
    return str(exc) or type(exc).__name__


def options_from_config(saved: Mapping, backend: str | None = None) -> RunOptions:
    """The RunOptions a run directory's config.json records."""
    model, data = saved.get("model", {}), saved.get("data", {})
    if "source" not in model:
        raise TrainingError("the run's config.json names no model source (model.source)")
    return RunOptions(source=model["source"], settings=dict(model.get("settings", {})), weights=model.get("weights"),
                      data=data.get("train"), val_data=data.get("val"), val_fraction=data.get("val_fraction"),
                      eval_every=int(saved.get("eval_every", 50)), save_every=int(saved.get("save_every", 500)),
                      backend=backend or saved.get("backend", "reference"),
                      import_options=dict(model.get("import_options", {})))


def settings_overrides(settings: Mapping) -> list[str]:
    """A settings dict as the ``NAME=VALUE`` strings ``--set`` takes."""
    return [f"{k}={v}" for k, v in settings.items()]


__all__ = ["TrainingRun", "RunOptions", "RunData", "prepare_data", "evaluation_batches", "options_from_config",
           "settings_overrides"]
