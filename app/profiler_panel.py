"""The profiler: N steps (forward or training) with GPU timestamps, in a worker thread.

The run is ``engine.cli.profile.profile_built_model`` (what ``meganeura profile``
runs) in a superqt ``thread_worker``; its per-step progress lines come back through a
queued signal and Cancel makes the next one raise. The result fills two sortable tables
(every dispatch of every step; per kernel, with its roofline bound), a bar chart of the
last step's dispatch times coloured by kernel archetype, the roofline plot, and the
Memory view (live tensors per dispatch), and the Per module table (GPU time per block
of the model; a row selects that module in the graph view). Clicking a dispatch row asks
the window to select its node in the graph view; clicking a kernel (its row or its roofline point)
selects its dispatches here and its nodes there. "Load profile to compare…" puts a
saved profile beside this one (the Compare tab), "Save profile JSON…" writes one, and
"Export Perfetto trace…" writes a .pftrace (or a Chrome trace .json).
"""

from __future__ import annotations

import re

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QItemSelection, QItemSelectionModel, QObject, Qt, Signal, Slot
from PySide6.QtWidgets import (QComboBox, QFileDialog, QHBoxLayout, QLabel, QProgressBar, QPushButton, QSpinBox,
                               QSplitter, QTabWidget, QVBoxLayout, QWidget)
from superqt.utils import thread_worker

from engine.errors import MeganeuraError

from .graph_view import ARCHETYPE_COLOURS, fmt_bytes
from .compare_view import CompareView
from .memory_view import MemoryView
from .module_table import ModuleTable
from .records import RecordsModel, fit_columns, records_table
from .roofline_view import RooflineView
from .state import ProfileResult

STEP_LINE = re.compile(r"profile step (\d+)/(\d+)")


class ProfileCancelled(Exception):
    """Raised inside the worker (from the progress callback) when Cancel was pressed."""


class _Relay(QObject):
    """Lives in the UI thread; ``emit`` from the worker is queued to it."""
    line = Signal(str)


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f}"


def timer_cost(report) -> str:
    """What the timestamps cost a dispatch, for the summary: the step's wall time with them
    less without, per dispatch, where that came out positive (on a busy host it can come
    out negative: then nothing is said). On the H100 through Dawn a gpt-tiny step's timed
    dispatches add up to 1 ms more than the step (about 4 µs each), and every dispatch
    reads at least 9-10 µs (docs/cli.md, roofline)."""
    cost = (report.overhead or {}).get("per_dispatch_ns")
    return f", which add {_us(cost)} µs a dispatch" if cost is not None and cost > 0 else ""


TIMER_TIP = ("GPU timestamps around every dispatch cost time of their own. A kernel whose time is near a few "
             "times that cost is mostly the timer's (its Bound reads latency); large kernels are timed faithfully.")

DISPATCH_COLUMNS = ["Step", "#", "Kernel", "Archetype", "Nodes", "GPU µs", "% of step", "GB/s", "TFLOP/s",
                    "Bytes", "Workgroups"]
KERNEL_COLUMNS = ["Kernel", "Archetype", "Calls", "GPU µs total", "GPU µs avg", "% of GPU", "GB/s", "TFLOP/s",
                  "Bound", "% of peak"]
SELECTED_PEN = pg.mkPen("#ff7f0e", width=3)


class ProfilerPanel(QWidget):
    dispatchSelected = Signal(int)        # dispatch position in a step (ProfileResult.dispatch_nodes)
    kernelSelected = Signal(list)         # the positions in a step of a kernel's dispatches
    moduleSelected = Signal(str)          # a row of the Per module table: a module path
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
        self.mode.addItem("Training step", True)
        self.mode.setItemData(1, "forward, backward and the optimizer's update", Qt.ItemDataRole.ToolTipRole)
        self.run_button = QPushButton("Run profile")
        self.run_button.setObjectName("profileRun")
        self.run_button.clicked.connect(self.run)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("profileCancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.export_button = QPushButton("Export trace…")
        self.export_button.setToolTip("Export the last profile as a Perfetto trace (.pftrace, or Chrome JSON)")
        self.export_button.setObjectName("profileExport")
        self.export_button.clicked.connect(self.export_trace)
        self.save_button = QPushButton("Save JSON…")
        self.save_button.setToolTip("Save profile JSON…: the last profile as `meganeura profile --json` writes it")
        self.save_button.setObjectName("profileSaveJson")
        self.save_button.clicked.connect(lambda: self.save_profile_json())
        self.compare_button = QPushButton("Compare…")
        self.compare_button.setToolTip("Load profile to compare…: a saved profile JSON beside the current one")
        self.compare_button.setObjectName("profileCompare")
        self.compare_button.clicked.connect(lambda: self.load_comparison())
        self.progress = QProgressBar()
        self.progress.setObjectName("profileProgress")
        self.progress.setMaximumWidth(220)
        self.progress.setMinimumWidth(60)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Steps"))
        bar.addWidget(self.steps)
        bar.addWidget(self.mode)
        bar.addWidget(self.run_button)
        bar.addWidget(self.cancel_button)
        bar.addWidget(self.progress)
        bar.addStretch(1)
        files = QHBoxLayout()   # beside the summary, so the run controls keep the panel narrow
        for button in (self.compare_button, self.save_button, self.export_button):
            files.addWidget(button)

        self.summary = QLabel("Run a profile to time every dispatch on the GPU.")
        self.summary.setObjectName("profileSummary")
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setToolTip(TIMER_TIP)

        self.dispatch_model = RecordsModel(DISPATCH_COLUMNS, self)
        self.kernel_model = RecordsModel(KERNEL_COLUMNS, self)
        self.dispatch_table = records_table(self.dispatch_model)
        self.dispatch_table.setObjectName("dispatchTable")
        self.kernel_table = records_table(self.kernel_model)
        self.kernel_table.setObjectName("kernelTable")
        self.dispatch_table.selectionModel().currentRowChanged.connect(self._dispatch_row)
        self.dispatch_table.clicked.connect(lambda index: self._dispatch_row(index))
        self.kernel_table.clicked.connect(lambda index: self.select_kernel(self.kernel_model.key(index.row(), 0)))
        self.roofline = RooflineView()
        self.roofline.kernelClicked.connect(self.select_kernel)
        self.compare = CompareView()
        self.compare.failed.connect(self.failed)
        self.memory = MemoryView()
        self.tables = QTabWidget()
        self.module_table = ModuleTable()
        self.module_table.moduleSelected.connect(self.moduleSelected)
        self.tables.addTab(self.kernel_table, "Per kernel")
        self.tables.addTab(self.module_table, "Per module")
        self.tables.addTab(self.dispatch_table, "Per dispatch")
        self.tables.addTab(self.roofline, "Roofline")
        self.tables.addTab(self.compare, "Compare")
        self.tables.addTab(self.memory, "Memory")
        self.tables.currentChanged.connect(self._tab_changed)

        self.chart = pg.PlotWidget(background="w")
        self.chart.setObjectName("dispatchChart")
        self.chart.setLabel("bottom", "dispatch (last step, in order)")
        self.chart.setLabel("left", "GPU time", units="s")
        self.chart.showGrid(y=True, alpha=0.3)
        self.chart.setMouseEnabled(y=False)
        self.bars = None
        self.bar_kernels: list[str] = []

        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.tables)
        split.addWidget(self.chart)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        summary_row = QHBoxLayout()
        summary_row.addWidget(self.summary, 1)
        summary_row.addLayout(files)
        layout.addLayout(summary_row)
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
            self.failed.emit("Cannot profile", MeganeuraError("the GPU is training or generating: "
                                                          "stop that first"))
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
        self.save_button.setEnabled(not running and self.state.profile is not None)
        self.steps.setEnabled(not running)
        self.mode.setEnabled(not running)

    # ------------------------------------------------------------ showing a report

    def clear(self) -> None:
        self.dispatch_model.set_rows([])
        self.kernel_model.set_rows([])
        if self.bars is not None:
            self.chart.removeItem(self.bars)
            self.bars = None
        self.bar_kernels = []
        self.roofline.clear()
        self.module_table.clear()
        self.memory.clear()
        self.compare.set_current(None)
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
        kernels = r.per_kernel()
        for k in kernels:
            pct = k.get("percent_of_peak")
            krows.append(([k["name"], k["archetype"], str(k["calls"]), _us(k["gpu_ns"]), _us(k["avg_ns"]),
                           f"{k['percent']:.1f}", f"{k['gb_per_s']:.2f}", f"{k['tflop_per_s']:.4f}",
                           k.get("bound") or "—", "—" if pct is None else f"{pct:.1f}"],
                          [k["name"], k["archetype"], k["calls"], k["gpu_ns"], k["avg_ns"], k["percent"],
                           k["gb_per_s"], k["tflop_per_s"], k.get("bound"), pct]))
        self.kernel_model.set_rows(krows, right={2, 3, 4, 5, 6, 7, 9})
        self.kernel_table.sortByColumn(3, Qt.SortOrder.DescendingOrder)
        self.dispatch_table.horizontalHeader().setSortIndicator(-1, Qt.SortOrder.AscendingOrder)
        for view in (self.kernel_table, self.dispatch_table):
            fit_columns(view)
        self._chart(r)
        self.roofline.show_kernels(kernels, r.peaks)
        self.module_table.show_profile(r)
        self.memory.show_memory(r.memory, [d.kernel for d in r.dispatches if d.step == r.steps - 1])
        self.compare.set_current(r.to_dict())
        a = r.achieved()
        med = float(np.median(step_ns)) if step_ns else 0.0
        timing = r.mode + (timer_cost(r) if r.timestamps else " — no GPU timestamps, CPU wall time per submission")
        self.summary.setText(
            f"<b>{r.model}</b> {'training' if r.train else 'inference'} · {r.steps} steps × "
            f"{r.dispatches_per_step} dispatches · GPU step (median) <b>{med / 1e3:,.1f} µs</b> · "
            f"{a['gb_per_s']:.2f} GB/s · {a['tflop_per_s']:.4f} TFLOP/s · GPU memory "
            f"{fmt_bytes(profile.peak_bytes)} allocated, live tensors at most "
            f"{fmt_bytes(r.memory.get('peak_bytes', 0))} · timing: {timing} · {r.adapter.get('name', '?')}")
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
        self.bar_kernels = [d.kernel for d in last]
        self.chart.addItem(self.bars)
        self.chart.setXRange(-1, max(len(last), 1), padding=0.01)
        self.chart.setYRange(0, float(h.max()) * 1.05 if len(h) else 1.0, padding=0)

    def bar_count(self) -> int:
        return 0 if self.bars is None else len(self.bars.opts["height"])

    def select_kernel(self, name: str) -> list[int]:
        """Select kernel ``name`` everywhere the panel shows it (its row in the kernel
        table, its dispatches in the dispatch table and the chart, its roofline point)
        and emit ``kernelSelected`` with the positions of its dispatches in a step, for
        the graph view. Returns those positions."""
        rows = self.kernel_model.find(0, name)
        if rows:
            self.kernel_table.selectRow(rows[0])
            self.kernel_table.scrollTo(self.kernel_model.index(rows[0], 0))
        last = self.state.profile.report.steps - 1 if self.state.profile is not None else 0
        picked = QItemSelection()
        for row in self.dispatch_model.find(2, name):
            if self.dispatch_model.key(row, 0) == last:
                picked.select(self.dispatch_model.index(row, 0),
                              self.dispatch_model.index(row, len(DISPATCH_COLUMNS) - 1))
        flags = QItemSelectionModel.SelectionFlag.ClearAndSelect | QItemSelectionModel.SelectionFlag.Rows
        self.dispatch_table.selectionModel().select(picked, flags)
        self.roofline.select(name)
        positions = [i for i, k in enumerate(self.bar_kernels) if k == name]
        if self.bars is not None:
            self.bars.setOpts(pens=[SELECTED_PEN if k == name else pg.mkPen("#555555", width=0.5)
                                    for k in self.bar_kernels])
        self.kernelSelected.emit(positions)
        return positions

    def _tab_changed(self, _index: int) -> None:
        """The dispatch chart belongs to the tables and the roofline, not to Compare and Memory."""
        self.chart.setVisible(self.tables.currentWidget() not in (self.compare, self.memory))

    def load_comparison(self, path: str | None = None) -> bool:
        """Load a saved profile (A, the baseline) to compare with the current one."""
        loaded = self.compare.load_a(path)
        if loaded:
            self.tables.setCurrentWidget(self.compare)
        return loaded

    def _dispatch_row(self, index, _previous=None) -> None:
        if index is None or not index.isValid() or self.state.profile is None:
            return
        self.dispatchSelected.emit(int(self.dispatch_model.key(index.row(), 1)))

    # ------------------------------------------------------------ export

    def _write_profile(self, path, title: str, suffix: str, filters: str, writer, done: str):
        """Write the current profile with ``writer(report, path)``, asking for the path
        when ``path`` is None; returns the path written, or None."""
        p = self.state.profile
        if p is None:
            self.message.emit("Nothing to write: run a profile first.")
            return None
        if path is None:
            name = f"{p.report.model}-{'train' if p.train else 'forward'}{suffix}"
            path, _ = QFileDialog.getSaveFileName(self, title, name, filters)
            if not path:
                return None
        try:
            written = writer(p.report, path)
        except (OSError, MeganeuraError) as exc:
            self.failed.emit(f"{title}: cannot write {path}", exc)
            return None
        self.message.emit(done.format(written))
        return str(written)

    def save_profile_json(self, path: str | None = None):
        """The current profile as ``profile --json`` writes it (what Compare loads)."""
        from engine.runtime.profiler import write_profile_json
        return self._write_profile(path, "Save profile JSON", "-profile.json", "Profile JSON (*.json)",
                                   write_profile_json,
                                   "Saved the profile to {} (compare it later: Load profile to compare…)")

    def export_trace(self):
        from engine.runtime.profiler import write_trace
        return self._write_profile(None, "Export Perfetto trace", ".pftrace",
                                   "Perfetto trace (*.pftrace);;Chrome trace JSON (*.json)", write_trace,
                                   "Wrote the Perfetto trace to {} (open it in ui.perfetto.dev)")
