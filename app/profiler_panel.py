"""The profiler: N steps (forward or training) with GPU timestamps, in a worker thread.

The run is ``engine.cli.profile.profile_built_model`` (what ``meganeura profile``
runs) in a superqt ``thread_worker``; its per-step progress lines come back through a
queued signal and Cancel makes the next one raise. The result fills two sortable tables
(every dispatch of every step; per kernel) and a bar chart of the last step's dispatch
times, coloured by kernel archetype. Clicking a dispatch row asks the window to select
its node in the graph view. "Export Perfetto trace…" writes a .pftrace (or a Chrome
trace .json).
"""

from __future__ import annotations

import re

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, Qt, Signal, Slot
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QFileDialog, QHBoxLayout, QHeaderView,
                               QLabel, QProgressBar, QPushButton, QSpinBox, QSplitter, QTableView,
                               QTabWidget, QVBoxLayout, QWidget)
from superqt.utils import thread_worker

from engine.errors import MeganeuraError

from .graph_view import ARCHETYPE_COLOURS, fmt_bytes
from .state import ProfileResult

STEP_LINE = re.compile(r"profile step (\d+)/(\d+)")


class ProfileCancelled(Exception):
    """Raised inside the worker (from the progress callback) when Cancel was pressed."""


class _Relay(QObject):
    """Lives in the UI thread; ``emit`` from the worker is queued to it."""
    line = Signal(str)


class RecordsModel(QAbstractTableModel):
    """Rows of (display values, sort keys); sorting happens here, not per item."""

    def __init__(self, headers: list[str], parent=None):
        super().__init__(parent)
        self.headers = headers
        self.rows: list[tuple[list[str], list]] = []
        self.right = set()

    def set_rows(self, rows, right=()) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.right = set(right)
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.headers)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return self.rows[index.row()][0][index.column()]
        if role == Qt.ItemDataRole.UserRole:
            return self.rows[index.row()][1][index.column()]
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() in self.right:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.headers[section]
        return None

    def sort(self, column: int, order=Qt.SortOrder.AscendingOrder) -> None:
        self.layoutAboutToBeChanged.emit()
        self.rows.sort(key=lambda r: r[1][column], reverse=order == Qt.SortOrder.DescendingOrder)
        self.layoutChanged.emit()

    def key(self, row: int, column: int):
        return self.rows[row][1][column]


def _table(model) -> QTableView:
    view = QTableView()
    view.setModel(model)
    view.setSortingEnabled(True)
    view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    view.verticalHeader().setVisible(False)
    view.verticalHeader().setDefaultSectionSize(20)
    view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
    view.horizontalHeader().setStretchLastSection(True)
    return view


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f}"


DISPATCH_COLUMNS = ["Step", "#", "Kernel", "Archetype", "Nodes", "GPU µs", "% of step", "GB/s", "TFLOP/s",
                    "Bytes", "Workgroups"]
KERNEL_COLUMNS = ["Kernel", "Archetype", "Calls", "GPU µs total", "GPU µs avg", "% of GPU", "GB/s", "TFLOP/s"]


class ProfilerPanel(QWidget):
    dispatchSelected = Signal(int)        # dispatch position in a step (ProfileResult.dispatch_nodes)
    message = Signal(str)                 # a status bar message
    failed = Signal(str, object)          # title, exception -> error dialog
    runFinished = Signal(str)             # "finished" | "cancelled" | "failed"

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.worker = None
        self.cancel_requested = False
        self.can_run = lambda: True        # the window vetoes a run while training uses the GPU
        self._relay = _Relay(self)
        self._relay.line.connect(self._on_line)
        self._end_reason = "finished"

        self.steps = QSpinBox()
        self.steps.setObjectName("profileSteps")
        self.steps.setRange(1, 10_000)
        self.steps.setValue(10)
        self.mode = QComboBox()
        self.mode.setObjectName("profileMode")
        self.mode.addItem("Inference (forward)", False)
        self.mode.addItem("Training step (fwd + bwd + update)", True)
        self.run_button = QPushButton("Run profile")
        self.run_button.setObjectName("profileRun")
        self.run_button.clicked.connect(self.run)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("profileCancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.export_button = QPushButton("Export Perfetto trace…")
        self.export_button.setObjectName("profileExport")
        self.export_button.clicked.connect(self.export_trace)
        self.progress = QProgressBar()
        self.progress.setObjectName("profileProgress")
        self.progress.setMaximumWidth(220)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Steps"))
        bar.addWidget(self.steps)
        bar.addWidget(self.mode)
        bar.addWidget(self.run_button)
        bar.addWidget(self.cancel_button)
        bar.addWidget(self.progress)
        bar.addStretch(1)
        bar.addWidget(self.export_button)

        self.summary = QLabel("Run a profile to time every dispatch on the GPU.")
        self.summary.setObjectName("profileSummary")
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)

        self.dispatch_model = RecordsModel(DISPATCH_COLUMNS, self)
        self.kernel_model = RecordsModel(KERNEL_COLUMNS, self)
        self.dispatch_table = _table(self.dispatch_model)
        self.dispatch_table.setObjectName("dispatchTable")
        self.kernel_table = _table(self.kernel_model)
        self.kernel_table.setObjectName("kernelTable")
        self.dispatch_table.selectionModel().currentRowChanged.connect(self._dispatch_row)
        self.dispatch_table.clicked.connect(lambda index: self._dispatch_row(index))
        self.tables = QTabWidget()
        self.tables.addTab(self.kernel_table, "Per kernel")
        self.tables.addTab(self.dispatch_table, "Per dispatch")

        self.chart = pg.PlotWidget(background="w")
        self.chart.setObjectName("dispatchChart")
        self.chart.setLabel("bottom", "dispatch (last step, in order)")
        self.chart.setLabel("left", "GPU time", units="s")
        self.chart.showGrid(y=True, alpha=0.3)
        self.chart.setMouseEnabled(y=False)
        self.bars = None

        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.tables)
        split.addWidget(self.chart)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(self.summary)
        layout.addWidget(split, 1)
        state.modelChanged.connect(self.clear)
        self._update_buttons()

    # ------------------------------------------------------------ the run

    def running(self) -> bool:
        return self.worker is not None

    def run(self):
        s = self.state
        if self.worker is not None or s.model is None:
            return None
        if not self.can_run():
            self.failed.emit("Cannot profile", MeganeuraError("the GPU is training: stop the run first"))
            return None
        from engine.cli.profile import profile_built_model
        train = bool(self.mode.currentData())
        steps = self.steps.value()
        model, params = s.model, dict(s.params)
        graph = None if train else s.graphs.get("optimized")     # reuse the optimized graph on screen
        self.cancel_requested = False
        self._end_reason = "finished"
        self.progress.setRange(0, 0)                           # busy while building
        self.summary.setText(f"Building the {'training' if train else 'inference'} session of "
                             f"{s.model_name}…")
        relay, panel = self._relay, self

        def progress(line: str) -> None:
            if panel.cancel_requested:
                raise ProfileCancelled()
            relay.line.emit(line)

        @thread_worker
        def work():
            report, session = profile_built_model(model, params, steps, train=train, graph=graph,
                                                  progress=progress)
            return ProfileResult(report, session, session.graph, train), session

        worker = work(_start_thread=False, _ignore_errors=True)
        worker.returned.connect(lambda result, m=model: self._on_result(result, m))
        worker.errored.connect(self._on_error)
        worker.finished.connect(self._on_finished)
        self.worker = worker
        self._update_buttons()
        worker.start()
        return worker

    def cancel(self) -> None:
        if self.worker is not None:
            self.cancel_requested = True
            self.summary.setText("Cancelling after the current step…")

    @Slot(str)
    def _on_line(self, line: str) -> None:
        m = STEP_LINE.search(line)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            self.progress.setRange(0, total)
            self.progress.setValue(done)
        self.summary.setText(line)

    def _on_result(self, result, model) -> None:
        profile, session = result
        if self.state.model is not model:          # the model changed meanwhile
            self._end_reason = "cancelled"
            return
        self.state.set_session(session, "profile, training" if profile.train else "profile, inference")
        self.state.set_profile(profile)
        self.show_profile(profile)

    def _on_error(self, exc) -> None:
        if isinstance(exc, ProfileCancelled):
            self._end_reason = "cancelled"
            self.summary.setText("Profile cancelled.")
            return
        self._end_reason = "failed"
        self.summary.setText(f"Profile failed: {exc}")
        self.failed.emit("Profile failed", exc)

    def _on_finished(self) -> None:
        self.worker = None
        reason, self._end_reason = self._end_reason, "finished"
        if reason != "finished":
            self.progress.setRange(0, 1)
            self.progress.setValue(0)
        self._update_buttons()
        self.runFinished.emit(reason)

    def _update_buttons(self) -> None:
        running = self.worker is not None
        self.run_button.setEnabled(not running and self.state.model is not None)
        self.cancel_button.setEnabled(running)
        self.export_button.setEnabled(not running and self.state.profile is not None)
        self.steps.setEnabled(not running)
        self.mode.setEnabled(not running)

    # ------------------------------------------------------------ showing a report

    def clear(self) -> None:
        self.dispatch_model.set_rows([])
        self.kernel_model.set_rows([])
        if self.bars is not None:
            self.chart.removeItem(self.bars)
            self.bars = None
        self.summary.setText("Run a profile to time every dispatch on the GPU.")
        self._update_buttons()

    def show_profile(self, profile: ProfileResult) -> None:
        r = profile.report
        step_ns = r.gpu_step_ns
        rows = []
        for d in r.dispatches:
            pct = 100.0 * d.gpu_ns / step_ns[d.step] if step_ns[d.step] else 0.0
            nodes = ", ".join(d.nodes[:4]) + (" …" if len(d.nodes) > 4 else "")
            wg = "×".join(str(w) for w in d.workgroups)
            rows.append(([str(d.step), str(d.index), d.kernel, d.archetype, nodes, _us(d.gpu_ns), f"{pct:.1f}",
                          f"{d.gb_per_s:.2f}", f"{d.tflop_per_s:.4f}", fmt_bytes(d.bytes), wg],
                         [d.step, d.index, d.kernel, d.archetype, nodes, d.gpu_ns, pct, d.gb_per_s,
                          d.tflop_per_s, d.bytes, wg]))
        self.dispatch_model.set_rows(rows, right={0, 1, 5, 6, 7, 8, 9})
        krows = []
        for k in r.per_kernel():
            krows.append(([k["name"], k["archetype"], str(k["calls"]), _us(k["gpu_ns"]), _us(k["avg_ns"]),
                           f"{k['percent']:.1f}", f"{k['gb_per_s']:.2f}", f"{k['tflop_per_s']:.4f}"],
                          [k["name"], k["archetype"], k["calls"], k["gpu_ns"], k["avg_ns"], k["percent"],
                           k["gb_per_s"], k["tflop_per_s"]]))
        self.kernel_model.set_rows(krows, right={2, 3, 4, 5, 6, 7})
        self.kernel_table.sortByColumn(3, Qt.SortOrder.DescendingOrder)
        self.dispatch_table.horizontalHeader().setSortIndicator(-1, Qt.SortOrder.AscendingOrder)
        for view in (self.kernel_table, self.dispatch_table):
            view.resizeColumnsToContents()
            for c in range(view.model().columnCount()):
                view.setColumnWidth(c, min(view.columnWidth(c), 320))
        self._chart(r)
        a = r.achieved()
        med = float(np.median(step_ns)) if step_ns else 0.0
        timing = r.mode + ("" if r.timestamps else " — no GPU timestamps, CPU wall time per submission")
        self.summary.setText(
            f"<b>{r.model}</b> {'training' if r.train else 'inference'} · {r.steps} steps × "
            f"{r.dispatches_per_step} dispatches · GPU step (median) <b>{med / 1e3:,.1f} µs</b> · "
            f"{a['gb_per_s']:.2f} GB/s · {a['tflop_per_s']:.4f} TFLOP/s · peak memory "
            f"{fmt_bytes(profile.peak_bytes)} · timing: {timing} · {r.adapter.get('name', '?')}")
        self.progress.setRange(0, r.steps)
        self.progress.setValue(r.steps)
        self._update_buttons()

    def _chart(self, r) -> None:
        if self.bars is not None:
            self.chart.removeItem(self.bars)
        last = [d for d in r.dispatches if d.step == r.steps - 1]
        x = np.arange(len(last), dtype=float)
        h = np.array([d.gpu_ns * 1e-9 for d in last], dtype=float)
        brushes = [pg.mkBrush(ARCHETYPE_COLOURS.get(d.archetype, "#888888")) for d in last]
        self.bars = pg.BarGraphItem(x=x, height=h, width=0.85, brushes=brushes, pen=pg.mkPen("#555555", width=0.5))
        self.chart.addItem(self.bars)
        self.chart.setXRange(-1, max(len(last), 1), padding=0.01)
        self.chart.setYRange(0, float(h.max()) * 1.05 if len(h) else 1.0, padding=0)

    def bar_count(self) -> int:
        return 0 if self.bars is None else len(self.bars.opts["height"])

    def _dispatch_row(self, index, _previous=None) -> None:
        if index is None or not index.isValid() or self.state.profile is None:
            return
        self.dispatchSelected.emit(int(self.dispatch_model.key(index.row(), 1)))

    # ------------------------------------------------------------ export

    def export_trace(self):
        p = self.state.profile
        if p is None:
            self.message.emit("Nothing to export: run a profile first.")
            return None
        name = f"{p.report.model}-{'train' if p.train else 'forward'}.pftrace"
        path, _ = QFileDialog.getSaveFileName(self, "Export Perfetto trace", name,
                                              "Perfetto trace (*.pftrace);;Chrome trace JSON (*.json)")
        if not path:
            return None
        from engine.runtime.profiler import write_trace
        try:
            written = write_trace(p.report, path)
        except (OSError, MeganeuraError) as exc:
            self.failed.emit("Cannot export the trace", exc)
            return None
        self.message.emit(f"Wrote the Perfetto trace to {written} (open it in ui.perfetto.dev)")
        return str(written)
