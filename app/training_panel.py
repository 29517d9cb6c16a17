"""Training: settings, the data (the model's own dataset or the user's, from Data…),
Start / Pause / Stop, a live loss plot, save weights, export CSV.

A run is an ``engine.train.run.TrainingRun`` on a superqt ``thread_worker``, on the GPU
(a ``TrainingSession``: forward, backward and update in one step's commands) or on the numpy
reference backend. It writes a run directory like ``meganeura train`` (under the Runs
panel's folder, ``runs/`` by default), and ``resume_run(path)`` continues one. Pause and
Stop take effect after the current step: its step callback waits while paused, and the
run asks the stop flag after every step. The callback appends (step, loss) to a list
that the UI's 10 Hz redraw timer reads: no Python object crosses threads through a
queued signal per step (with PySide6 6.12 + Python 3.11 thousands of those crashed the
app: "deallocating None").
"""

from __future__ import annotations

import math
import os
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGridLayout,
                               QGroupBox, QHBoxLayout, QLabel, QMenu, QMessageBox, QProgressBar, QPushButton,
                               QSpinBox, QVBoxLayout, QWidget)
from superqt.utils import thread_worker

from engine.errors import MeganeuraError
from engine.importers import load_run_model, source_kind
from engine.runtime.device import choose_backend
from engine.train.config import OPTIMIZERS, SCHEDULES, TrainConfig
from engine.train.runs import debiased_ema
from engine.train.run import RunOptions, TrainingRun, options_from_config
from engine.train.run_dir import RunDirectory, default_runs_folder, discard_if_empty, new_run_path

BACKEND_LABELS = {"gpu": "GPU (wgpu)", "reference": "reference (numpy, CPU)"}

SMOOTHING = 0.9     # weight of the smoothed curve: TensorBoard's debiased EMA, as in the Runs panel


def default_backend() -> str:
    """A new user's backend: the GPU, or the reference executor where the adapter is a
    software renderer (several times faster there)."""
    try:
        return choose_backend("auto")[0]
    except MeganeuraError:        # no adapter at all: the reference still trains
        return "reference"


DATA_FILTER = "Training data (*.npz *.txt *.jsonl *.wav *.flac);;All files (*)"
TRAIN_ONNX_HINT = ("The Studio has no loss to choose yet; train it from the command line: "
                   "meganeura train FILE.onnx --loss mse|cross-entropy --target OUTPUT")


class StepAxis(pg.AxisItem):
    """An axis of whole steps: pyqtgraph would tick 0.5, 1.5 ... over a few of them."""

    def tickValues(self, minVal, maxVal, size):
        levels = super().tickValues(minVal, maxVal, size)
        whole = [(max(spacing, 1.0), [v for v in values if float(v).is_integer()]) for spacing, values in levels]
        return [(spacing, values) for spacing, values in whole if values]


def discarding_if_unused(path: Path, make_run):
    """``make_run`` that gives the run directory ``path`` (new, made for this run) back
    with ``discard_if_empty`` when the run fails to build before writing to it (data
    unreadable, batch too large), as ``meganeura train`` does: failed starts leave no
    empty folders in the Runs panel."""
    def make(**hooks):
        try:
            return make_run(**hooks)
        except BaseException:
            discard_if_empty(path)
            raise
    return make


def time_ago(updated) -> str:
    """``updated`` (status.json's ISO time) as "5 min ago": how stale a "running" status
    is tells a run whose process died from one another process is training."""
    try:
        then = datetime.fromisoformat(str(updated))
        seconds = (datetime.now(then.tzinfo) - then).total_seconds()
    except (TypeError, ValueError):
        return "at an unknown time"
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if unit == 'day' and n > 1 else ''} ago"
    return f"{max(int(seconds), 0)} s ago"


@thread_worker
def training_run(make_run, holder: dict):
    """Builds the run (``make_run(on_step=..., should_stop=...)``: data, session) and runs
    it; appends (step, loss) to ``holder["points"]`` after every update and waits there
    while ``holder["pause"]`` is set. Returns the final status."""
    points = holder.setdefault("points", [])
    pause, stop = holder["pause"], holder["stop"]

    def on_step(row):
        points.append((row["step"], float(row["loss"])))
        while pause.is_set() and not stop.is_set():
            time.sleep(0.02)

    run = make_run(on_step=on_step, should_stop=stop.is_set, prepared=lambda data: holder.update(notes=data.notes))
    holder["run"], holder["trainer"] = run, run.trainer
    return run.run()


class TrainingPanel(QWidget):
    failed = Signal(str, object)          # title, exception -> error dialog
    runFinished = Signal(str)             # "finished" | "stopped" | "failed"

    def __init__(self, state, settings=None, parent=None):
        super().__init__(parent)
        self.state = state
        self.qsettings = settings
        self.worker = None
        self.holder: dict = {}
        self.steps_done: list[int] = []
        self.losses: list[float] = []
        self.run_started = 0.0
        self.total_steps = self.first_step = self._seen = 0
        self.run_dir: Path | None = None       # the last run's directory
        self.last_trainer = None
        self.active_path: Path | None = None   # the run directory the worker trains
        self._pending_model = None             # (source, model, graph, params) a resume opens once built
        self._dirty = False
        self.can_run = lambda: True        # the window vetoes a run while a profile uses the GPU

        self.backend = QComboBox()
        self.backend.setObjectName("backendBox")
        for key, label in BACKEND_LABELS.items():
            self.backend.addItem(label, key)

        self.optimizer = QComboBox()
        self.optimizer.addItems(OPTIMIZERS)
        self.optimizer.setCurrentText("adamw")
        self.lr = QDoubleSpinBox()
        self.lr.setDecimals(6)
        self.lr.setRange(1e-6, 10.0)   # 0 trains nothing, and TrainConfig refuses it
        self.lr.setSingleStep(1e-4)
        self.lr.setValue(1e-3)
        self.schedule = QComboBox()
        self.schedule.addItems(SCHEDULES)
        self.warmup = QSpinBox()
        self.warmup.setRange(0, 1_000_000)
        self.steps = QSpinBox()
        self.steps.setRange(1, 10_000_000)
        self.steps.setValue(100)
        self.batch = QSpinBox()
        self.batch.setRange(1, 100_000)
        self.clip = QDoubleSpinBox()
        self.clip.setRange(0.0, 1e6)
        self.clip.setSpecialValueText("off")
        for name, w in (("optimizerBox", self.optimizer), ("lrBox", self.lr), ("scheduleBox", self.schedule),
                        ("stepsBox", self.steps), ("batchBox", self.batch)):
            w.setObjectName(name)
        self.data_path: str | None = None
        self.data_label = QLabel()
        self.data_label.setObjectName("dataLabel")
        self.data_button = QPushButton("Data…")
        self.data_button.setObjectName("dataButton")
        self.data_button.setToolTip("Train on your own data: an .npz or a folder of .npy files named after the "
                                    "model's inputs, text (.txt, .jsonl) for causal LMs, audio (.wav, .flac with "
                                    "NAME.txt transcripts) for the audio models")
        menu = QMenu(self.data_button)
        menu.addAction("File (.npz, .txt, .jsonl)…", self.choose_data_file)
        menu.addAction("Folder (.npy, text or audio files)…", self.choose_data_folder)
        menu.addAction("The model's own dataset", lambda: self.set_data(None))
        self.data_button.setMenu(menu)
        self.data_label.setWordWrap(True)
        data_row = QVBoxLayout()                  # the name above the button: the side column is narrow
        data_row.addWidget(self.data_label)
        data_row.addWidget(self.data_button)
        self.set_data(None)
        form = QFormLayout()
        form.addRow("Data", data_row)
        form.addRow("Backend", self.backend)
        form.addRow("Optimizer", self.optimizer)
        form.addRow("Learning rate", self.lr)
        form.addRow("Schedule", self.schedule)
        form.addRow("Warm-up steps", self.warmup)
        form.addRow("Steps", self.steps)
        form.addRow("Batch", self.batch)
        form.addRow("Clip grad norm", self.clip)
        box = QGroupBox("Settings")
        box.setLayout(form)

        self.start_button = QPushButton("Start")
        self.pause_button = QPushButton("Pause")
        self.stop_button = QPushButton("Stop")
        self.save_button = QPushButton("Save weights…")
        self.export_button = QPushButton("Export CSV…")
        for name, b in (("startButton", self.start_button), ("pauseButton", self.pause_button),
                        ("stopButton", self.stop_button), ("saveButton", self.save_button),
                        ("exportButton", self.export_button)):
            b.setObjectName(name)
        self.start_button.clicked.connect(self.start)
        self.pause_button.clicked.connect(self.toggle_pause)
        self.stop_button.clicked.connect(self.stop)
        buttons = QGridLayout()
        buttons.addWidget(self.start_button, 0, 0)
        buttons.addWidget(self.pause_button, 0, 1)
        buttons.addWidget(self.stop_button, 0, 2)
        buttons.addWidget(self.save_button, 1, 0, 1, 2)
        buttons.addWidget(self.export_button, 1, 2)

        self.progress = QProgressBar()
        self.progress.setObjectName("trainProgress")
        self.stats = QLabel("Idle.")
        self.stats.setObjectName("trainStats")
        self.stats.setWordWrap(True)
        self.log_y = QCheckBox("Log y")
        self.log_y.setObjectName("logY")
        self.log_y.toggled.connect(lambda on: self.plot.setLogMode(y=on))

        left = QVBoxLayout()
        left.addWidget(box)
        left.addLayout(buttons)
        left.addWidget(self.progress)
        left.addWidget(self.stats)
        left.addWidget(self.log_y)
        left.addStretch(1)

        pg.setConfigOptions(antialias=True)
        self.plot = pg.PlotWidget(background="w", axisItems={"bottom": StepAxis("bottom")})
        self.plot.setObjectName("lossPlot")
        self.plot.setLabel("bottom", "step")
        self.plot.setLabel("left", "loss")
        self.plot.showGrid(x=True, y=True, alpha=0.3)
        self.plot.addLegend(offset=(-10, 10))
        self.raw_curve = self.plot.plot([], [], pen=pg.mkPen("#9ab8de", width=1), name="loss")
        self.smooth_curve = self.plot.plot([], [], pen=pg.mkPen("#d1495b", width=2), name="smoothed (EMA 0.9)")

        layout = QHBoxLayout(self)
        side = QWidget()
        side.setLayout(left)
        side.setMaximumWidth(300)
        layout.addWidget(side)
        layout.addWidget(self.plot, 1)

        self.redraw_timer = QTimer(self)
        self.redraw_timer.setInterval(100)
        self.redraw_timer.timeout.connect(self.redraw)
        state.modelChanged.connect(self._model_changed)
        self._update_buttons()

    # ------------------------------------------------------------ settings

    def backend_name(self) -> str:
        return str(self.backend.currentData())

    def set_backend(self, name: str) -> None:
        i = self.backend.findData(name)
        if i >= 0:
            self.backend.setCurrentIndex(i)

    def config(self) -> TrainConfig:
        return TrainConfig(optimizer=self.optimizer.currentText(), lr=self.lr.value(),
                           schedule=self.schedule.currentText(), warmup_steps=self.warmup.value(),
                           steps=self.steps.value(), batch_size=self.batch.value(),
                           clip_norm=self.clip.value() or None)

    def _model_changed(self) -> None:
        if self.state.model is not None:
            self.batch.setValue(int(self.state.settings.get("batch", self.batch.value())))
        if self.worker is None:
            refusal = self.state.model.cannot_train if self.state.model is not None else None
            self.stats.setText(f"{refusal}. {TRAIN_ONNX_HINT}" if refusal else "Idle.")
        self._update_buttons()

    def save_settings(self, qs) -> None:
        for key, value in (("backend", self.backend_name()), ("data", self.data_path or ""),
                           ("optimizer", self.optimizer.currentText()), ("lr", self.lr.value()),
                           ("schedule", self.schedule.currentText()), ("warmup", self.warmup.value()),
                           ("steps", self.steps.value()), ("clip", self.clip.value())):
            qs.setValue(f"training/{key}", value)

    def restore_settings(self, qs) -> None:
        self.set_backend(str(qs.value("training/backend", default_backend())))
        self.optimizer.setCurrentText(str(qs.value("training/optimizer", "adamw")))
        self.lr.setValue(float(qs.value("training/lr", 1e-3)))
        self.schedule.setCurrentText(str(qs.value("training/schedule", "constant")))
        self.warmup.setValue(int(qs.value("training/warmup", 0)))
        self.steps.setValue(int(qs.value("training/steps", 100)))
        self.clip.setValue(float(qs.value("training/clip", 0.0)))
        self.set_data(str(qs.value("training/data", "") or "") or None)

    # ------------------------------------------------------------ the run

    def running(self) -> bool:
        return self.worker is not None

    def start(self):
        """A new run of the loaded model on the chosen data, in a new run directory."""
        if self.worker is not None or self.state.model is None:
            return None
        if not self.can_run():
            self.failed.emit("Cannot start training", MeganeuraError("a profile is running on the GPU: "
                                                                     "wait for it or cancel it"))
            return None
        try:
            config = self.config()
            model, params = self.state.model, self.state.params
            options = RunOptions(source=self._source(), settings=dict(model.settings),
                                 weights=self.state.weights_path, data=self.data_path, backend=self.backend_name(),
                                 import_options={"default_dims": 1} if source_kind(self._source()) == "onnx" else {})
            path = new_run_path(model.name, self.runs_folder())
        except Exception as exc:
            self.failed.emit("Cannot start training", exc)
            return None
        make_run = discarding_if_unused(path, lambda **hooks: TrainingRun.start(model, params, config, options,
                                                                                path, **hooks))
        return self._launch(make_run, config.steps, 0, [], path)

    def training_path(self) -> Path | None:
        """The run directory this Studio is training now (the Runs panel keeps its Resume off)."""
        return self.active_path if self.worker is not None else None

    def resume_run(self, path):
        """Continue the run directory ``path`` from its latest checkpoint (the Runs panel's
        Resume): the run's model (opened when another one is loaded), data and options, up
        to its own steps, or to Steps where the run has done its own already."""
        if self.worker is not None or not self.can_run():
            self.failed.emit("Cannot resume the run", MeganeuraError("a training run or a profile is running: "
                                                                     "stop it first"))
            return None
        try:
            directory = RunDirectory.open(path)
            saved = directory.config()
            latest = directory.latest_checkpoint()
            if latest is None:
                raise MeganeuraError(f"{directory.path} has no checkpoint to resume from")
            total = int(saved.get("train", {}).get("steps") or 0)
            if latest[0] >= total:
                if self.steps.value() <= latest[0]:
                    raise MeganeuraError(f"the run is at step {latest[0]} of its {total}; raise Steps above "
                                         f"{latest[0]} to go on")
                total = self.steps.value()
            if not self._confirm_running(directory):
                return None
            pending = self._run_model(saved)
            earlier = [(r["step"], float(r["loss"])) for r in directory.metrics()
                       if r["step"] <= latest[0] and isinstance(r.get("loss"), (int, float))]
        except Exception as exc:
            self.failed.emit("Cannot resume the run", exc)
            return None
        model = pending[1] if pending is not None else self.state.model
        backend = self.backend_name()
        self.steps.setValue(total)
        self._pending_model = pending        # opened by _install_run_model once the worker bound the checkpoint
        return self._launch(lambda **hooks: TrainingRun.resume(directory, model, total, backend, **hooks),
                            total, latest[0], earlier, directory.path)

    def _confirm_running(self, directory: RunDirectory) -> bool:
        """True unless status.json says "running" and the user declines: the process that
        wrote it may have died (``meganeura train --resume`` goes on with such a run too),
        or may still be training, and two writers would interleave checkpoints."""
        try:
            status = directory.status()
        except MeganeuraError:             # no or unreadable status.json: nothing says it runs
            return True
        if status.get("status") != "running":
            return True
        answer = QMessageBox.question(
            self, "Resume a run that says it is running?",
            f"{directory.path.name}'s status.json says it is running, last updated {time_ago(status.get('updated'))} "
            f"(step {status.get('step', '?')}).\n\nIf its process died, resume it. If another process is still "
            f"training it, resuming here too would interleave the two processes' checkpoints and metrics.\n\n"
            f"Resume it?",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def _run_model(self, config: dict):
        """None when the model a run trained (its ``config.json``) is the one open (same
        source and settings), else (source, model, graph, params) of it, opened and built
        as ``meganeura train --resume`` opens it but not installed: the open model and its
        weights stay until the worker has read the checkpoint into it (``_install_run_model``)."""
        options = options_from_config(config)
        same = self.state.model is not None and self._source() == options.source \
            and all(str(self.state.settings.get(k)) == str(v) for k, v in options.settings.items())
        if same:
            return None
        model = load_run_model(config)
        return options.source, model, model.build(train=False), model.init_params(0)

    def _install_run_model(self) -> None:
        """Open the resumed run's model in the window once the worker built the run (its
        checkpoint read and bound to the model, its data read): never before, so a run
        that cannot resume leaves the open model alone."""
        if self._pending_model is not None and "run" in self.holder:
            pending, self._pending_model = self._pending_model, None
            self.state.install_model(*pending)

    def _launch(self, make_run, total: int, first: int, earlier: list[tuple[int, float]], path: Path | None = None):
        """Start the worker that builds and runs ``make_run`` (training the run directory
        ``path``); the plot starts with ``earlier`` points."""
        self.steps_done, self.losses = [s for s, _ in earlier], [v for _, v in earlier]
        self.first_step, self.total_steps, self.run_dir = first, total, None
        self.active_path = path
        self.progress.setRange(0, total)
        self.progress.setValue(first)
        self.holder = {"points": [], "pause": threading.Event(), "stop": threading.Event()}
        self._seen = 0
        self._dirty = True
        self.run_started = time.perf_counter()
        self.stats.setText("Building the GPU training session…" if self.backend_name() == "gpu"
                           else "Differentiating and starting…")
        worker = training_run(make_run, self.holder, _start_thread=False, _ignore_errors=True)
        worker.returned.connect(self._on_end)
        worker.errored.connect(self._on_error)
        worker.finished.connect(self._on_finished)
        self.worker = worker
        self.redraw_timer.start()
        self._update_buttons()
        worker.start()
        return worker

    def _source(self) -> str:
        """What the state opened, as a path that works from any folder where it is a file."""
        source = str(self.state.source or self.state.model.name)
        return os.path.abspath(source) if source_kind(source) != "builtin" else source

    def runs_folder(self) -> Path:
        """Where new run directories go: the Runs panel's folder, else runs/ (or $MEGANEURA_RUNS)."""
        folder = self.qsettings.value("runs/folder") if self.qsettings is not None else None
        return Path(str(folder)) if folder else default_runs_folder()

    # ------------------------------------------------------------ data

    def set_data(self, path: str | None) -> None:
        """Train on ``path`` (a file or folder) or, with None, the model's own dataset."""
        self.data_path = str(path) if path else None
        self.data_label.setText(Path(self.data_path).name if self.data_path else "the model's own dataset")
        self.data_label.setToolTip(self.data_path or "synthetic examples the model generates from the seed")

    def _data_start(self) -> str:
        return str(Path(self.data_path).parent) if self.data_path else str(Path.cwd())

    def choose_data_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Training data", self._data_start(), DATA_FILTER)
        if path:
            self.set_data(path)

    def choose_data_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "A folder of training data (.npy, text or audio files)",
                                                self._data_start())
        if path:
            self.set_data(path)

    # ------------------------------------------------------------ pause, stop, progress

    def toggle_pause(self) -> None:
        pause = self.holder.get("pause")
        if self.worker is None or pause is None:
            return
        if pause.is_set():
            pause.clear()
            self.pause_button.setText("Pause")
        else:
            pause.set()                            # the worker waits after the current step
            self.pause_button.setText("Resume")
            self.stats.setText(self.stats.text() + "  (paused)")

    def stop(self) -> None:
        if self.worker is not None:
            self.holder["stop"].set()
            self.holder["pause"].clear()

    def _poll(self) -> None:
        """Take the steps the worker finished since the last call."""
        points = self.holder.get("points") or []
        new = points[self._seen:]
        if new:
            self._seen += len(new)
            self.steps_done.extend(step for step, _ in new)
            self.losses.extend(loss for _, loss in new)
            self._dirty = True

    def _on_error(self, exc) -> None:
        self._end_reason = "failed"
        self.failed.emit("Training stopped" if "run" in self.holder else "Cannot start training", exc)

    def _on_end(self, reason: str) -> None:
        self._end_reason = reason

    def _on_finished(self) -> None:
        reason = getattr(self, "_end_reason", "finished")
        self._end_reason = "finished"
        self._install_run_model()              # while the worker still counts as running: stats stay
        self._pending_model = None             # the run never got built: the open model stays
        self.worker = None
        self.redraw_timer.stop()
        self._dirty = True
        self.redraw()
        trainer, run = self.holder.get("trainer"), self.holder.get("run")
        if trainer is not None and len(trainer.history):
            self.last_trainer = trainer
            self.state.set_params(trainer.params, source=None)
        if trainer is not None and trainer.session is not None:
            self.state.set_session(trainer.session, "training")
        self.pause_button.setText("Pause")
        done = trainer.step_count if trainer is not None else self.first_step
        self.run_dir = run.directory.path if run is not None else None
        where = f"\nRun directory: {self.run_dir}" if self.run_dir is not None else ""
        self.stats.setText(self.stats.text().split("\n")[0] + f"\nRun {reason} after step {done}.{where}")
        self._update_buttons()
        self.runFinished.emit(reason)

    def redraw(self) -> None:
        self._install_run_model()
        self._poll()
        if not self._dirty:
            return
        self._dirty = False
        x = np.asarray(self.steps_done, dtype=float)
        y = np.asarray(self.losses, dtype=float)
        self.raw_curve.setData(x, y)
        self.smooth_curve.setData(x, debiased_ema(y, SMOOTHING))
        step = self.steps_done[-1] if self.steps_done else self.first_step
        self.progress.setValue(step)
        if self._seen:
            elapsed = time.perf_counter() - self.run_started
            rate = self._seen / elapsed if elapsed > 0 else math.inf
            left = (self.total_steps - step) / rate if rate > 0 else math.inf
            self.stats.setText(f"step {step}/{self.total_steps} · loss {self.losses[-1]:.4g} · "
                               f"{rate:.1f} steps/s · ETA {left:.0f} s")
        trainer = self.holder.get("trainer")
        for note in self.holder.get("notes", []):
            self.stats.setText(self.stats.text() + f"\nNote: {note}")
        if trainer is not None and trainer.history.warning:
            self.stats.setText(self.stats.text() + f"\nWarning: {trainer.history.warning}")

    def _update_buttons(self) -> None:
        running = self.worker is not None
        refusal = self.state.model.cannot_train if self.state.model is not None else None
        self.start_button.setEnabled(not running and self.state.model is not None and refusal is None)
        self.start_button.setToolTip(f"{refusal}. {TRAIN_ONNX_HINT}" if refusal else "")
        self.backend.setEnabled(not running)
        self.pause_button.setEnabled(running)
        self.stop_button.setEnabled(running)
        self.save_button.setEnabled(not running and self.last_trainer is not None)
        self.export_button.setEnabled(not running and self.last_trainer is not None)

    def plotted_points(self) -> int:
        x, _ = self.raw_curve.getData()
        return 0 if x is None else len(x)
