"""Runs: the training runs in a folder, their loss and validation curves overlaid.

Lists the run directories under a folder (default ``runs/`` of the current directory;
"Folder…" picks another), with a check box per run: the checked runs' curves share one
plot, one colour per run (the smoothed loss solid, the raw loss faint behind it, the
validation loss dashed with a marker per evaluation). The x axis is the step or the
training time (the sum of the steps' seconds); the y axis can be logarithmic; the
smoothing slider is TensorBoard's debiased EMA (``engine.train.runs.debiased_ema``).
Hovering shows each run's loss and smoothed loss at that step. The folder is watched
(a ``QFileSystemWatcher``, and a slow poll for what it misses): new runs appear and new
metric lines extend the curves, read incrementally. "Resume" asks the window to resume
the current run from its latest checkpoint. Every choice is kept in the settings.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QFileSystemWatcher, Qt, QTimer, Signal
from PySide6.QtGui import QBrush, QColor, QIcon, QPixmap
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QComboBox, QFileDialog, QHBoxLayout, QHeaderView,
                               QLabel, QPushButton, QSlider, QSplitter, QTreeWidget, QTreeWidgetItem,
                               QVBoxLayout, QWidget)

from engine.train.run_dir import default_runs_folder
from engine.train.runs import Run, debiased_ema, find_run_dirs, run_order

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f")
STATUS_COLOURS = {"running": "#2f6fce", "finished": "#2e8b3a", "diverged": "#c0392b", "failed": "#c0392b",
                  "stopped": "#8a6d1f"}
COLUMNS = ("Run", "Model", "Steps", "Last loss", "Best val loss", "Status")
X_AXES = {"step": "Step", "time": "Training time"}
SLIDER_STEPS = 1000            # the slider's 0..999 is a weight of 0 to 0.999
DEFAULT_SMOOTHING = 0.6        # TensorBoard's default
POLL_MS = 2000                 # the watcher misses some changes (network file systems): poll as well
SETTLE_MS = 150                # a burst of watcher signals becomes one refresh
MAX_READOUT = 8                # runs in the hover read-out; the others are counted


def clock(seconds: float) -> str:
    """A duration that reads without a legend: 45s, 12m05s, 1h05m."""
    if not math.isfinite(seconds):
        return ""
    s = int(round(abs(seconds)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    sign = "-" if seconds < 0 and s else ""
    if h:
        return f"{sign}{h}h{m:02d}m" if m else f"{sign}{h}h"
    if m:
        return f"{sign}{m}m{sec:02d}s" if sec else f"{sign}{m}m"
    return f"{sign}{sec}s"


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"


class TimeAxis(pg.AxisItem):
    """The bottom axis: plain numbers (steps), or clock times when ``as_time``."""

    as_time = False

    def tickStrings(self, values, scale, spacing):
        if self.as_time:
            return [clock(v * scale) for v in values]
        return super().tickStrings(values, scale, spacing)


def validation_curve(colour) -> pg.PlotDataItem:
    """Validation losses: dashed, a marker per evaluation."""
    return pg.PlotDataItem(pen=pg.mkPen(colour, width=1.5, style=Qt.PenStyle.DashLine), symbol="o", symbolSize=6,
                           symbolBrush=colour, symbolPen=colour, connect="finite")


class RunCurves:
    """One run on the plot: its table row and its three curves."""

    def __init__(self, run: Run, colour: str):
        self.run = run
        self.colour = colour
        faint = QColor(colour)
        faint.setAlpha(70)
        self.raw = pg.PlotDataItem(pen=pg.mkPen(faint, width=1), connect="finite")
        self.smoothed = pg.PlotDataItem(pen=pg.mkPen(colour, width=2), connect="finite")
        self.val = validation_curve(colour)
        for z, curve in enumerate((self.raw, self.smoothed, self.val)):     # every raw line below every other
            curve.setZValue(z)
        self.item = QTreeWidgetItem()
        swatch = QPixmap(12, 12)
        swatch.fill(QColor(colour))
        self.item.setIcon(0, QIcon(swatch))
        self.item.setData(0, Qt.ItemDataRole.UserRole, str(run.path))
        self.x = self.y = self.y_smoothed = np.zeros(0)

    def fill_row(self) -> None:
        s = self.run.summary()
        steps = "-" if s.last_step is None else str(s.last_step)
        if s.steps is not None:
            steps += f" / {s.steps}"
        for column, text in enumerate((s.name, s.model_name or "?", steps, _number(s.last_loss),
                                       _number(s.best_val_loss), s.status)):
            self.item.setText(column, text)
        for column in (2, 3, 4):
            self.item.setTextAlignment(column, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        colour = STATUS_COLOURS.get(s.status)
        self.item.setForeground(5, QBrush(QColor(colour)) if colour else QBrush())
        tip = f"{s.path}\ncreated {s.created or '?'}\ncheckpoints: {', '.join(map(str, s.checkpoints)) or 'none'}"
        for column in range(len(COLUMNS)):
            self.item.setToolTip(column, tip)

    def set_data(self, x_axis: str, smoothing: float) -> None:
        cols = self.run.metrics.columns()
        self.x = cols["wall"] if x_axis == "time" else cols["step"]
        self.y = cols["loss"]
        self.y_smoothed = debiased_ema(self.y, smoothing)
        self.raw.setData(self.x, self.y)
        self.smoothed.setData(self.x, self.y_smoothed)
        self.val.setData(cols["val_wall"] if x_axis == "time" else cols["val_step"], cols["val_loss"])

    def curves(self):
        return self.raw, self.smoothed, self.val

    def has_validation(self) -> bool:
        return self.run.metrics.columns()["val_loss"].size > 0


class RunsPanel(QWidget):
    resumeRequested = Signal(str)          # the run directory to resume

    def __init__(self, settings=None, parent=None):
        super().__init__(parent)
        self.qsettings = settings
        self.folder = default_runs_folder().absolute()    # runs/ here, until a folder is chosen
        self.folder_chosen = False
        self.entries: dict[str, RunCurves] = {}     # by run directory
        self.unchecked: set[str] = set()            # run names: any other run is shown
        self.current_name = ""
        self.training_path = lambda: None           # the run directory this Studio trains now (the window's)
        self._restoring = False
        self._build_top()
        self._build_table()
        self._build_options()
        self._build_plot()
        self._build_layout()
        self._build_watcher()
        if settings is not None:
            self.restore_settings(settings)
        self._apply_options()
        self.set_folder(self.folder, remember=False)
        self.poll.start()

    # ------------------------------------------------------------ widgets

    def _build_top(self) -> None:
        self.folder_label = QLabel()
        self.folder_label.setObjectName("runsFolder")
        self.folder_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.folder_button = QPushButton("Folder…")
        self.folder_button.setObjectName("runsFolderButton")
        self.folder_button.setToolTip("Choose the folder that holds the run directories")
        self.folder_button.clicked.connect(self.choose_folder)
        self.resume_button = QPushButton("Resume")
        self.resume_button.setObjectName("resumeButton")
        self.resume_button.clicked.connect(self._resume)

    def _build_table(self) -> None:
        self.table = QTreeWidget()
        self.table.setObjectName("runsTable")
        self.table.setHeaderLabels(list(COLUMNS))
        self.table.setRootIsDecorated(False)
        self.table.setUniformRowHeights(True)
        self.table.setAlternatingRowColors(True)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        header = self.table.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for column in range(1, len(COLUMNS)):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemChanged.connect(self._item_changed)
        self.table.currentItemChanged.connect(self._current_changed)

    def _build_options(self) -> None:
        self.x_axis = QComboBox()
        self.x_axis.setObjectName("runsXAxis")
        for key, label in X_AXES.items():
            self.x_axis.addItem(label, key)
        self.x_axis.currentIndexChanged.connect(self._options_changed)
        self.log_y = QCheckBox("Log y")
        self.log_y.setObjectName("runsLogY")
        self.log_y.toggled.connect(self._options_changed)
        self.smoothing = QSlider(Qt.Orientation.Horizontal)
        self.smoothing.setObjectName("runsSmoothing")
        self.smoothing.setRange(0, SLIDER_STEPS - 1)
        self.smoothing.setValue(round(DEFAULT_SMOOTHING * SLIDER_STEPS))
        self.smoothing.setMinimumWidth(160)
        self.smoothing.setToolTip("TensorBoard's smoothing: an exponential moving average, debiased so that "
                                  "it starts on the first value; 0 is none")
        self.smoothing_label = QLabel()
        self.smoothing_label.setMinimumWidth(40)
        self.smoothing.valueChanged.connect(self._options_changed)

    def _build_plot(self) -> None:
        self.readout = QLabel()
        self.readout.setObjectName("runsReadout")
        self.readout.setTextFormat(Qt.TextFormat.RichText)
        self.readout.setWordWrap(True)
        self.axis = TimeAxis("bottom")
        self.plot = pg.PlotWidget(axisItems={"bottom": self.axis})
        self.plot.setObjectName("runsPlot")
        self.plot.setLabel("left", "loss")
        self.plot.showGrid(x=True, y=True, alpha=0.3)
        self.legend = self.plot.addLegend(offset=(-10, 10))
        self.validation_key = validation_curve("#888888")       # one legend entry for every run's dashes
        self.legend.sigSampleClicked.connect(self._legend_clicked)
        item = self.plot.getPlotItem()
        item.setClipToView(True)
        item.setDownsampling(auto=True, mode="peak")
        self.cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen("#888888", width=1, style=Qt.PenStyle.DotLine))
        self.cursor.setVisible(False)
        self.plot.addItem(self.cursor, ignoreBounds=True)
        self.markers = pg.ScatterPlotItem(size=11, brush=pg.mkBrush("w"))     # rings on the hovered points
        self.markers.setZValue(10)
        self.plot.addItem(self.markers, ignoreBounds=True)
        self.plot.scene().sigMouseMoved.connect(self._mouse_moved)

    def _build_layout(self) -> None:
        top = QHBoxLayout()
        top.addWidget(QLabel("Folder:"))
        top.addWidget(self.folder_label, 1)
        top.addWidget(self.folder_button)
        top.addWidget(self.resume_button)
        options = QHBoxLayout()
        options.addWidget(QLabel("x axis"))
        options.addWidget(self.x_axis)
        options.addWidget(self.log_y)
        options.addSpacing(16)
        options.addWidget(QLabel("Smoothing"))
        options.addWidget(self.smoothing)
        options.addWidget(self.smoothing_label)
        options.addStretch(1)
        plot_side = QWidget()
        plot_layout = QVBoxLayout(plot_side)
        plot_layout.setContentsMargins(0, 0, 0, 0)
        plot_layout.addLayout(options)
        plot_layout.addWidget(self.readout)
        plot_layout.addWidget(self.plot, 1)
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.addWidget(self.table)
        self.splitter.addWidget(plot_side)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([170, 600])
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.splitter, 1)

    def _build_watcher(self) -> None:
        self.watcher = QFileSystemWatcher(self)
        self.watcher.directoryChanged.connect(self._soon)
        self.watcher.fileChanged.connect(self._soon)
        self.settle = QTimer(self)
        self.settle.setSingleShot(True)
        self.settle.setInterval(SETTLE_MS)
        self.settle.timeout.connect(self.refresh)
        self.poll = QTimer(self)
        self.poll.setInterval(POLL_MS)
        self.poll.timeout.connect(self.refresh)

    # ------------------------------------------------------------ options

    def smoothing_weight(self) -> float:
        return self.smoothing.value() / SLIDER_STEPS

    def x_axis_name(self) -> str:
        return str(self.x_axis.currentData())

    def _options_changed(self, *_) -> None:
        """Smoothing redraws the curves in the same view (a zoom stays); a new x axis or
        y scale also fits the view to them again."""
        self._apply_options()
        for entry in self.entries.values():
            entry.set_data(self.x_axis_name(), self.smoothing_weight())
        if self.sender() is not self.smoothing:
            self.plot.getPlotItem().enableAutoRange()
        self._clear_hover()
        self.save_settings()

    def _apply_options(self) -> None:
        self.smoothing_label.setText(f"{self.smoothing_weight():.3f}")
        self.axis.as_time = self.x_axis_name() == "time"
        self.plot.setLabel("bottom", "training time (the sum of the steps' seconds)" if self.axis.as_time else "step")
        self.plot.setLogMode(y=self.log_y.isChecked())

    # ------------------------------------------------------------ settings

    def save_settings(self, qs=None) -> None:
        """Keep the folder (once chosen: else runs/ of the directory the Studio starts in),
        the checked and current runs, smoothing and axes (written on every change, so a
        crash loses nothing). The Training panel starts its runs in this folder too."""
        qs = qs if qs is not None else self.qsettings
        if qs is None or self._restoring:
            return
        if self.folder_chosen:
            qs.setValue("runs/folder", str(self.folder))
        for key, value in (("unchecked", sorted(self.unchecked)),
                           ("current", self.current_name), ("smoothing", self.smoothing.value()),
                           ("x_axis", self.x_axis_name()), ("log_y", self.log_y.isChecked())):
            qs.setValue(f"runs/{key}", value)

    def restore_settings(self, qs) -> None:
        self._restoring = True
        try:
            folder = qs.value("runs/folder")
            if folder:
                self.folder, self.folder_chosen = Path(str(folder)), True
            unchecked = qs.value("runs/unchecked", []) or []
            self.unchecked = {unchecked} if isinstance(unchecked, str) else set(map(str, unchecked))
            self.current_name = str(qs.value("runs/current", "") or "")
            self.smoothing.setValue(int(qs.value("runs/smoothing", round(DEFAULT_SMOOTHING * SLIDER_STEPS))))
            i = self.x_axis.findData(str(qs.value("runs/x_axis", "step")))
            self.x_axis.setCurrentIndex(max(i, 0))
            self.log_y.setChecked(str(qs.value("runs/log_y", "false")).lower() == "true")
        finally:
            self._restoring = False

    # ------------------------------------------------------------ the folder

    def choose_folder(self) -> None:
        start = str(self.folder if self.folder.is_dir() else Path.cwd())
        path = QFileDialog.getExistingDirectory(self, "Choose the folder of your runs", start)
        if path:
            self.set_folder(path)

    def set_folder(self, path, remember: bool = True) -> None:
        """Show the runs under ``path`` (which may not exist yet: it is polled for)."""
        self.folder = Path(path)
        self.folder_chosen = self.folder_chosen or remember
        self.folder_label.setText(str(self.folder))
        for key in list(self.entries):
            self._remove(key)
        self._colours = 0
        watched = self.watcher.files() + self.watcher.directories()
        if watched:
            self.watcher.removePaths(watched)
        self.refresh()
        if remember:
            self.save_settings()

    def refresh(self) -> None:
        """Add new run directories, drop vanished ones, read what changed in each."""
        present = {str(p): p for p in find_run_dirs(self.folder)}
        for key in [k for k in self.entries if k not in present]:
            self._remove(key)
        known = list(self.entries.values())
        for run in sorted((Run(p) for key, p in present.items() if key not in self.entries), key=run_order):
            self._add(run)
        for entry in known:
            if entry.run.refresh():
                entry.fill_row()
                entry.set_data(self.x_axis_name(), self.smoothing_weight())
                self._show(entry, entry.run.name not in self.unchecked)
        self._watch(present)
        self._update_hint()
        self._update_resume()

    def _watch(self, present) -> None:
        wanted = [str(self.folder)] if self.folder.is_dir() else []
        for key, path in present.items():
            if path != self.folder:
                wanted.append(key)
            if (path / "metrics.jsonl").is_file():
                wanted.append(str(path / "metrics.jsonl"))
        missing = [p for p in wanted if p not in set(self.watcher.files() + self.watcher.directories())]
        if missing:
            self.watcher.addPaths(missing)

    def _soon(self, *_) -> None:
        self.settle.start()

    def _add(self, run: Run) -> None:
        entry = RunCurves(run, PALETTE[self._colours % len(PALETTE)])
        self._colours += 1           # a run keeps its colour while the folder is shown
        self.entries[str(run.path)] = entry
        for curve in entry.curves():
            self.plot.addItem(curve)
        entry.fill_row()
        self.table.blockSignals(True)
        entry.item.setCheckState(0, Qt.CheckState.Unchecked if run.name in self.unchecked
                                 else Qt.CheckState.Checked)
        self.table.addTopLevelItem(entry.item)
        self.table.blockSignals(False)
        entry.set_data(self.x_axis_name(), self.smoothing_weight())
        self._show(entry, run.name not in self.unchecked)
        self._update_legend()
        if run.name == self.current_name:
            self.table.setCurrentItem(entry.item)

    def _remove(self, key: str) -> None:
        entry = self.entries.pop(key)
        for curve in entry.curves():
            self.plot.removeItem(curve)
        self.table.takeTopLevelItem(self.table.indexOfTopLevelItem(entry.item))
        self._update_legend()

    def _show(self, entry: RunCurves, on: bool) -> None:
        """Show or hide the run's curves (hidden, not removed: pyqtgraph 0.14 cannot add
        a removed curve again); the validation curve once there is a validation point."""
        visible = (on, on, on and entry.has_validation())
        if visible != tuple(c.isVisible() for c in entry.curves()):
            for curve, show in zip(entry.curves(), visible):
                curve.setVisible(show)
            self._update_legend()

    def shown(self, entry: RunCurves) -> bool:
        return entry.smoothed.isVisible()

    def _update_legend(self) -> None:
        """The legend names each shown run once (its smoothed line), in the table's
        order, then one "validation loss" entry while any has validation points."""
        self.legend.clear()
        shown = [e for e in self.entries.values() if self.shown(e)]
        for entry in shown:
            self.legend.addItem(entry.smoothed, entry.run.name)
        if any(e.val.isVisible() for e in shown):
            self.legend.addItem(self.validation_key, "validation loss (dashed)")
        self._fit_readout()

    def _legend_clicked(self, curve) -> None:
        """A click on a run's legend entry hides it: uncheck the run to match."""
        for key, entry in self.entries.items():
            if curve is entry.smoothed:
                self.set_checked(key, False)
        self.validation_key.setVisible(True)

    def _clear_hover(self) -> None:
        self.cursor.setVisible(False)
        self.markers.clear()
        self.readout.setProperty("hovered", False)
        self._update_hint()

    def _fit_readout(self) -> None:
        """The read-out keeps a line per shown run (two at least, MAX_READOUT at most):
        its height changes when runs are checked, never under the moving mouse."""
        lines = min(max(len(self.checked_runs()), 2), MAX_READOUT + 1)
        self.readout.setFixedHeight(lines * self.readout.fontMetrics().lineSpacing() + 4)

    def _update_hint(self) -> None:
        """Until the mouse hovers the plot, the read-out line says what to do."""
        if self.readout.property("hovered") and self.entries:
            return
        if self.entries:
            self.readout.setText("Check runs to compare them; hover over the plot to read their losses.")
        else:
            where = "does not exist yet" if not self.folder.is_dir() else "holds no run directories yet"
            self.readout.setText(f"{self.folder} {where}. Train with <code>meganeura train --run-dir</code> "
                                 f"(or from the Training tab), or choose another folder.")

    # ------------------------------------------------------------ the list

    def checked_runs(self) -> list[str]:
        """The run directories shown in the plot, in the table's order."""
        return [str(e.run.path) for e in self.entries.values()
                if e.item.checkState(0) == Qt.CheckState.Checked]

    def set_checked(self, path, on: bool) -> None:
        self.entries[str(path)].item.setCheckState(0, Qt.CheckState.Checked if on else Qt.CheckState.Unchecked)

    def _item_changed(self, item, column) -> None:
        if column != 0:
            return
        entry = self.entries.get(str(item.data(0, Qt.ItemDataRole.UserRole)))
        if entry is None:
            return
        on = item.checkState(0) == Qt.CheckState.Checked
        if on == (entry.run.name not in self.unchecked):
            return
        (self.unchecked.discard if on else self.unchecked.add)(entry.run.name)
        self._show(entry, on)
        self.save_settings()

    def current_run(self) -> Run | None:
        item = self.table.currentItem()
        entry = self.entries.get(str(item.data(0, Qt.ItemDataRole.UserRole))) if item is not None else None
        return entry.run if entry is not None else None

    def _current_changed(self, item, _previous) -> None:
        run = self.current_run()
        if run is not None:
            self.current_name = run.name
            self.save_settings()
        self._update_resume()

    def _update_resume(self) -> None:
        run = self.current_run()
        if run is None:
            ok, why = False, "Select a run to resume it from its latest checkpoint"
        elif not run.checkpoints:
            ok, why = False, f"{run.name} has no checkpoint to resume from"
        elif self._trained_here(run):
            ok, why = False, f"{run.name} is training in this Studio now: stop it first"
        elif run.state == "running":
            ok, why = True, (f"{run.name}'s status says running: if its process died, continue it from step "
                             f"{run.checkpoints[-1]} in the Training tab (you will be asked first)")
        else:
            ok, why = True, f"Continue {run.name} from step {run.checkpoints[-1]} in the Training tab"
        self.resume_button.setEnabled(ok)
        self.resume_button.setToolTip(why)

    def _trained_here(self, run: Run) -> bool:
        """Whether this Studio's Training tab is writing ``run`` now: the only run whose
        Resume stays off, since a "running" status may be left by a process that died."""
        path = self.training_path()
        return path is not None and Path(path).resolve() == run.path.resolve()

    def _resume(self) -> None:
        run = self.current_run()
        if run is not None:
            self.resumeRequested.emit(str(run.path))

    # ------------------------------------------------------------ hover

    def readout_at(self, x: float) -> list[dict]:
        """Per checked run, its training point nearest to ``x`` (a step or a time, as the
        x axis): ``run``, ``step``, ``loss``, ``smoothed``, ``x`` and, where the run has
        validation points, the nearest one's ``val_loss`` and ``val_step``."""
        rows = []
        for key in self.checked_runs():
            entry = self.entries[key]
            if not entry.x.size:
                continue
            i = _nearest(entry.x, x)
            cols = entry.run.metrics.columns()
            row = {"run": entry.run.name, "colour": entry.colour, "x": float(entry.x[i]),
                   "step": int(cols["step"][i]), "loss": float(entry.y[i]), "smoothed": float(entry.y_smoothed[i])}
            val_x = cols["val_wall"] if self.x_axis_name() == "time" else cols["val_step"]
            if val_x.size:
                j = _nearest(val_x, x)
                row.update(val_loss=float(cols["val_loss"][j]), val_step=int(cols["val_step"][j]))
            rows.append(row)
        return rows

    def _mouse_moved(self, pos) -> None:
        view = self.plot.getPlotItem().vb
        if not view.sceneBoundingRect().contains(pos) or not self.entries:
            return
        x = view.mapSceneToView(pos).x()
        rows = self.readout_at(x)
        if not rows:
            return
        self.readout.setProperty("hovered", True)
        self.readout.setText(format_readout(rows, self.x_axis_name() == "time"))
        self.cursor.setPos(rows[0]["x"] if len(rows) == 1 else x)
        self.cursor.setVisible(True)
        y = np.array([r["smoothed"] for r in rows])
        with np.errstate(divide="ignore", invalid="ignore"):      # a scatter item is not put on the log scale for us
            y = np.log10(y) if self.log_y.isChecked() else y
        self.markers.setData([r["x"] for r in rows], y, pen=[pg.mkPen(r["colour"], width=2.5) for r in rows])


def _nearest(xs: np.ndarray, x: float) -> int:
    i = int(np.searchsorted(xs, x))
    if i >= xs.size:
        return xs.size - 1
    if i > 0 and abs(xs[i - 1] - x) <= abs(xs[i] - x):
        return i - 1
    return i


def format_readout(rows: list[dict], as_time: bool) -> str:
    """The hover read-out: one coloured entry per run."""
    parts = []
    for r in rows[:MAX_READOUT]:
        where = f"step {r['step']}" + (f" ({clock(r['x'])})" if as_time else "")
        text = (f"<span style='color:{r['colour']}'>&#9632;</span> <b>{r['run']}</b> {where}: "
                f"loss {r['loss']:.4g}, smoothed {r['smoothed']:.4g}")
        if "val_loss" in r:
            text += f", validation {r['val_loss']:.4g} (step {r['val_step']})"
        parts.append(text)
    if len(rows) > MAX_READOUT:
        parts.append(f"and {len(rows) - MAX_READOUT} more runs")
    return "<br>".join(parts)
