"""The Memory view: the bytes of live tensors across one step's dispatches (a profile's
``memory`` object, ``engine.compile.memory``), the peak marked, the plan's allocation
as a line, the tensors alive at the peak listed biggest first, and what buffer reuse
saves in words."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QSplitter, QVBoxLayout, QWidget

from engine.compile.memory import describe_saving, format_bytes
from engine.runtime.report import short_kernel

from .records import RecordsModel, fit_columns, records_table

PEAK_COLUMNS = ["Size", "Kind", "Buffer", "Tensors"]
EMPTY = "Run a profile to see the step's memory, dispatch by dispatch."


def _unit(peak: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= scale:
            return scale, name
    return 1, "B"


class MemoryView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.plot = pg.PlotWidget(background="w")
        self.plot.setObjectName("memoryPlot")
        self.plot.setLabel("bottom", "dispatch (in step order)")
        self.plot.showGrid(y=True, alpha=0.3)
        self.plot.setMenuEnabled(False)
        self.plot.addLegend(offset=(-10, 10), labelTextColor="#333333", brush=pg.mkBrush("#ffffffd0"))
        self.pinned = pg.PlotCurveItem(pen=pg.mkPen("#7f7f7f", width=1), fillLevel=0, brush=pg.mkBrush("#7f7f7f55"),
                                       name="pinned for the whole step (inputs, parameters, gradients, optimizer state)")
        self.curve = pg.PlotCurveItem(pen=pg.mkPen("#1f77b4", width=2), fillLevel=0, brush=pg.mkBrush("#1f77b455"),
                                      name="intermediates alive while the dispatch runs")
        self.peak_marker = pg.ScatterPlotItem(symbol="star", size=18, brush=pg.mkBrush("#d62728"),
                                              pen=pg.mkPen("#7a1010"))
        self.peak_label = pg.TextItem("", color="#7a1010", anchor=(0.5, 1.2))
        self.allocated_line = pg.InfiniteLine(angle=0, pen=pg.mkPen("#555555", width=1, style=Qt.PenStyle.DashLine))
        self.allocated_label = pg.TextItem("", color="#444444", anchor=(0, 1))
        for item in (self.pinned, self.curve, self.allocated_line, self.allocated_label, self.peak_marker,
                     self.peak_label):
            self.plot.addItem(item)
        self.allocated_line.hide()
        self.allocated_label.hide()
        self.saving = QLabel(EMPTY)
        self.saving.setObjectName("memorySaving")
        self.saving.setWordWrap(True)
        self.model = RecordsModel(PEAK_COLUMNS, self)
        self.table = records_table(self.model)
        self.table.setObjectName("peakBuffers")
        self.heading = QLabel("")
        lower = QWidget()
        lower_layout = QVBoxLayout(lower)
        lower_layout.setContentsMargins(0, 0, 0, 0)
        lower_layout.addWidget(self.heading)
        lower_layout.addWidget(self.table)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.plot)
        split.addWidget(lower)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.saving)
        layout.addWidget(split, 1)
        self.peak: tuple[int, int] | None = None   # (dispatch, bytes)

    def clear(self) -> None:
        self.curve.setData([], [], stepMode=None)
        self.pinned.setData([], [], stepMode=None)
        self.peak_marker.clear()
        self.peak_label.setText("")
        self.allocated_line.hide()
        self.allocated_label.hide()
        self.model.set_rows([])
        self.heading.setText("")
        self.saving.setText(EMPTY)
        self.peak = None

    def show_memory(self, memory: dict, kernels: list[str]) -> None:
        """``memory``: a profile's memory object; ``kernels``: the kernel of each
        dispatch of a step, in order (to name the one at the peak)."""
        self.clear()
        live = memory.get("live_bytes") or []
        if not live:
            self.saving.setText("This profile has no memory timeline.")
            return
        peak_at, peak = memory["peak_dispatch"], memory["peak_bytes"]
        scale, unit = _unit(max(peak, memory.get("plan_bytes", 0)))
        self.plot.setLabel("left", f"live tensors ({unit})")
        edges = np.arange(len(live) + 1, dtype=float) - 0.5     # dispatch i spans [i - 0.5, i + 0.5]
        pinned = memory.get("pinned_bytes", 0) / scale
        self.pinned.setData(edges, np.full(len(live), pinned), stepMode="center")
        self.curve.setFillLevel(pinned)
        self.curve.setData(edges, np.asarray(live, dtype=float) / scale, stepMode="center")
        self.peak = (peak_at, peak)
        self.peak_marker.setData([float(peak_at)], [peak / scale])
        kernel = kernels[peak_at] if 0 <= peak_at < len(kernels) else ""
        self.peak_label.setText(f"peak {format_bytes(peak)} at dispatch {peak_at}"
                                + (f": {short_kernel(kernel)}" if kernel else ""))
        self.peak_label.setPos(float(peak_at), peak / scale)
        # centred over the star, shifted inwards near either end so that it stays in view
        self.peak_label.setAnchor((min(0.9, max(0.1, peak_at / max(len(live) - 1, 1))), 1.2))
        allocated = memory.get("plan_bytes")
        if allocated:
            self.allocated_line.setValue(allocated / scale)
            self.allocated_label.setText(f"allocated by the plan (buffers reused): {format_bytes(allocated)}")
            self.allocated_label.setPos(-0.4, allocated / scale)
            self.allocated_line.show()
            self.allocated_label.show()
        top = max(peak, allocated or 0) / scale
        self.plot.setXRange(-0.5, len(live) - 0.5, padding=0.01)
        self.plot.setYRange(0, top * 1.3, padding=0)
        if "unshared_bytes" in memory and "plan_bytes" in memory:
            self.saving.setText(describe_saving(memory["unshared_bytes"], memory["plan_bytes"], peak))
        rows = memory.get("peak_buffers") or []
        self.heading.setText(f"{len(rows)} buffers alive at the peak (dispatch {peak_at}), biggest first:")
        self.model.set_rows([([format_bytes(r["bytes"]), r["kind"], str(r["buffer"]), ", ".join(r["names"])],
                              [r["bytes"], r["kind"], r["buffer"], ", ".join(r["names"])]) for r in rows],
                            right={0, 2})
        self.table.horizontalHeader().setSortIndicator(0, Qt.SortOrder.DescendingOrder)
        fit_columns(self.table, 520)
