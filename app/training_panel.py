"""Training: settings, Start / Pause / Stop, a live loss plot, save weights, export CSV.

The run is a superqt ``thread_worker`` generator around ``Trainer.step`` on the GPU
(a ``TrainingSession``: forward, backward and update in one submission) or on the
numpy reference backend: it yields after every step, so Pause and Stop take effect at
the next step. The worker appends (step, loss) to a list that the UI's 10 Hz redraw
timer reads: no Python object crosses threads through a queued signal per step (with
PySide6 6.12 + Python 3.11 thousands of those crashed the app: "deallocating None").
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QGridLayout,
                               QGroupBox, QHBoxLayout, QLabel, QProgressBar, QPushButton,
                               QSpinBox, QVBoxLayout, QWidget)
from superqt.utils import thread_worker

from engine.errors import MeganeuraError
from engine.runtime.device import choose_backend
from engine.train.config import OPTIMIZERS, SCHEDULES, TrainConfig
from engine.train.data import DataLoader
from engine.train.trainer import Trainer

BACKEND_LABELS = {"gpu": "GPU (wgpu)", "reference": "reference (numpy, CPU)"}

SMOOTHING = 0.9     # EMA factor of the smoothed curve


def smooth(values, alpha=SMOOTHING):
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def default_backend() -> str:
    """A new user's backend: the GPU, or the reference executor where the adapter is a
    software renderer (several times faster there)."""
    try:
        return choose_backend("auto")[0]
    except MeganeuraError:        # no adapter at all: the reference still trains
        return "reference"


@thread_worker
def training_run(graph, params, config: TrainConfig, dataset, holder: dict, backend: str = "gpu"):
    """Appends (step, loss) to ``holder["points"]`` and yields after every update."""
    trainer = Trainer(graph, params, config, backend=backend)
    holder["trainer"] = trainer
    points = holder.setdefault("points", [])
    loader = DataLoader(dataset, config.batch_size, shuffle=True, seed=config.seed, drop_last=True)
    epoch = 0
    while trainer.step_count < config.steps:
        for batch in loader:
            loss = trainer.step(batch, epoch)
            points.append((trainer.step_count, float(loss)))
            yield None
            if trainer.step_count >= config.steps:
                break
        epoch += 1
    return trainer


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
        self.total_steps = 0
        self.last_trainer = None
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
        self.lr.setRange(0.0, 10.0)
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
        form = QFormLayout()
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
        self.plot = pg.PlotWidget(background="w")
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
        self._update_buttons()

    def save_settings(self, qs) -> None:
        for key, value in (("backend", self.backend_name()),
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

    # ------------------------------------------------------------ the run

    def running(self) -> bool:
        return self.worker is not None

    def start(self):
        if self.worker is not None or self.state.model is None:
            return None
        if not self.can_run():
            self.failed.emit("Cannot start training", MeganeuraError("a profile is running on the GPU: "
                                                                     "wait for it or cancel it"))
            return None
        try:
            config = self.config()
            model = self.state.model
            graph = model.build(train=True, batch=config.batch_size)
            dataset = model.dataset(config.seed)
            rows = len(next(iter(dataset.values())))
            if rows < config.batch_size:
                from engine.errors import TrainingError
                raise TrainingError(f"the {model.name} dataset has {rows} rows, fewer than one batch "
                                    f"of {config.batch_size}; lower the batch")
        except Exception as exc:
            self.failed.emit("Cannot start training", exc)
            return None
        self.steps_done, self.losses = [], []
        self.total_steps = config.steps
        self.progress.setRange(0, config.steps)
        self.progress.setValue(0)
        self.holder = {"points": []}
        self.run_started = time.perf_counter()
        backend = self.backend_name()
        self.stats.setText("Building the GPU training session…" if backend == "gpu"
                           else "Differentiating and starting…")
        worker = training_run(graph, self.state.params, config, dataset, self.holder, backend,
                              _start_thread=False, _ignore_errors=True)
        worker.returned.connect(lambda trainer: self._on_end("finished"))
        worker.aborted.connect(lambda: self._on_end("stopped"))
        worker.errored.connect(self._on_error)
        worker.finished.connect(self._on_finished)
        self.worker = worker
        self.redraw_timer.start()
        self._update_buttons()
        worker.start()
        return worker

    def toggle_pause(self) -> None:
        if self.worker is None:
            return
        self.worker.toggle_pause()
        paused = not self.worker.is_paused        # the flag flips at the next yield
        self.pause_button.setText("Resume" if paused else "Pause")
        if paused:
            self.stats.setText(self.stats.text() + "  (paused)")

    def stop(self) -> None:
        if self.worker is not None:
            if self.worker.is_paused:
                self.worker.resume()
            self.worker.quit()

    def _poll(self) -> None:
        """Take the steps the worker finished since the last call."""
        points = self.holder.get("points") or []
        new = points[len(self.losses):]
        if new:
            self.steps_done.extend(step for step, _ in new)
            self.losses.extend(loss for _, loss in new)
            self._dirty = True

    def _on_error(self, exc) -> None:
        self._end_reason = "failed"
        self.failed.emit("Training stopped", exc)

    def _on_end(self, reason: str) -> None:
        self._end_reason = reason

    def _on_finished(self) -> None:
        reason = getattr(self, "_end_reason", "finished")
        self._end_reason = "finished"
        self.worker = None
        self.redraw_timer.stop()
        self._dirty = True
        self.redraw()
        trainer = self.holder.get("trainer")
        if trainer is not None and len(trainer.history):
            self.last_trainer = trainer
            self.state.set_params(trainer.params, source=None)
        if trainer is not None and trainer.session is not None:
            self.state.set_session(trainer.session, "training")
        self.pause_button.setText("Pause")
        self.stats.setText(self.stats.text().split("\n")[0] + f"\nRun {reason} after {len(self.losses)} steps.")
        self._update_buttons()
        self.runFinished.emit(reason)

    def redraw(self) -> None:
        self._poll()
        if not self._dirty:
            return
        self._dirty = False
        x = np.asarray(self.steps_done, dtype=float)
        y = np.asarray(self.losses, dtype=float)
        self.raw_curve.setData(x, y)
        self.smooth_curve.setData(x, np.asarray(smooth(self.losses), dtype=float))
        n = len(self.losses)
        self.progress.setValue(n)
        if n:
            elapsed = time.perf_counter() - self.run_started
            rate = n / elapsed if elapsed > 0 else math.inf
            left = (self.total_steps - n) / rate if rate > 0 else math.inf
            self.stats.setText(f"step {n}/{self.total_steps} · loss {self.losses[-1]:.4g} · "
                               f"{rate:.1f} steps/s · ETA {left:.0f} s")
        trainer = self.holder.get("trainer")
        if trainer is not None and trainer.history.warning:
            self.stats.setText(self.stats.text() + f"\nWarning: {trainer.history.warning}")

    def _update_buttons(self) -> None:
        running = self.worker is not None
        self.start_button.setEnabled(not running and self.state.model is not None)
        self.backend.setEnabled(not running)
        self.pause_button.setEnabled(running)
        self.stop_button.setEnabled(running)
        self.save_button.setEnabled(not running and self.last_trainer is not None)
        self.export_button.setEnabled(not running and self.last_trainer is not None)

    def plotted_points(self) -> int:
        x, _ = self.raw_curve.getData()
        return 0 if x is None else len(x)
