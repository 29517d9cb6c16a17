"""The roofline plot: one point per kernel of a profile, achieved FLOP/s against
arithmetic intensity (FLOP per byte), log-log, under the adapter's roofs (memory
bandwidth rising, then the f32 compute peak flat; the f16 peak dashed where
cooperative matrices run). A point's size follows the kernel's total GPU time, its
colour the bound ``engine.runtime.roofline`` gave it. Clicking a point emits
``kernelClicked(name)``.

Everything is placed in log10 coordinates: the plot's log mode only draws the axes.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from engine.runtime.report import short_kernel

BOUND_COLOURS = {"compute": "#d62728", "memory": "#1f77b4", "latency": "#8c8c8c"}
UNCLASSIFIED = "#bbbbbb"


def _log(v: float) -> float:
    return math.log10(v)


def _si(v: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g} {prefix}{unit}".strip()
    return f"{v:.3g} {unit}".strip()


def _decades(lo: float, hi: float, label) -> list:
    """Ticks at each power of ten in [lo - 1, hi + 1] (log10 coordinates), labelled
    ``label(value)``; no minor labels, which crowd a log axis."""
    return [[(k, label(10.0 ** k)) for k in range(math.floor(lo) - 1, math.ceil(hi) + 2)], []]


class RooflineView(QWidget):
    kernelClicked = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.plot = pg.PlotWidget(background="w")
        self.plot.setObjectName("rooflinePlot")
        self.plot.setLogMode(x=True, y=True)
        self.plot.setLabel("bottom", "arithmetic intensity (FLOP / byte)")
        self.plot.setLabel("left", "achieved FLOP/s")
        self.plot.showGrid(x=True, y=True, alpha=0.25)
        self.plot.setMenuEnabled(False)
        self.plot.getAxis("left").enableAutoSIPrefix(False)
        self.plot.getAxis("bottom").enableAutoSIPrefix(False)
        self.scatter = pg.ScatterPlotItem(hoverable=True, tip=self._tip, hoverPen=pg.mkPen("k", width=2))
        self.scatter.sigClicked.connect(self._clicked)
        self.ring = pg.ScatterPlotItem(pen=pg.mkPen("#ff7f0e", width=3), brush=None, size=1)
        self.plot.addItem(self.scatter)
        self.plot.addItem(self.ring)
        self._roof_items: list = []
        self.rows: dict[str, dict] = {}
        self.positions: dict[str, tuple[float, float]] = {}   # kernel -> (log10 x, log10 y)
        self.sizes: dict[str, float] = {}
        self.selected: str | None = None
        self.caption = QLabel("Run a profile to place its kernels under the adapter's roofs.")
        self.caption.setObjectName("rooflineCaption")
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.caption)
        layout.addWidget(self.plot, 1)

    # ------------------------------------------------------------ contents

    def clear(self) -> None:
        self.scatter.clear()
        self.ring.clear()
        for item in self._roof_items:
            self.plot.removeItem(item)
        self._roof_items = []
        self.rows, self.positions, self.sizes, self.selected = {}, {}, {}, None

    def show_kernels(self, rows: list[dict], peaks: dict | None) -> None:
        """``rows``: a profile's ``per_kernel`` rows (with ``bound``); ``peaks``: its roofs."""
        self.clear()
        plotted = [r for r in rows if r["flops"] > 0 and r["bytes"] > 0 and r["gpu_ns"] > 0]
        longest = max((r["gpu_ns"] for r in plotted), default=1)
        spots = []
        for r in plotted:
            x, y = _log(r["flops"] / r["bytes"]), _log(r["flops"] / r["gpu_ns"] * 1e9)
            size = 8 + 26 * math.sqrt(r["gpu_ns"] / longest)
            colour = BOUND_COLOURS.get(r.get("bound"), UNCLASSIFIED)
            spots.append({"pos": (x, y), "size": size, "data": r["name"], "brush": pg.mkBrush(colour + "c0"),
                          "pen": pg.mkPen("#333333", width=0.8)})
            self.rows[r["name"]] = r
            self.positions[r["name"]] = (x, y)
            self.sizes[r["name"]] = size
        self.scatter.addPoints(spots)
        xs = [p[0] for p in self.positions.values()]
        ys = [p[1] for p in self.positions.values()]
        if peaks:
            ridge = _log(peaks["flop_per_s_f32"] / peaks["bytes_per_s"])
            xs, ys = xs + [ridge], ys + [_log(peaks["flop_per_s_f32"])]
            if peaks.get("flop_per_s_f16"):
                ys.append(_log(peaks["flop_per_s_f16"]))
        if not xs:
            return self.caption.setText(self._caption(rows, plotted, peaks))
        lo, hi = min(xs) - 0.6, max(xs) + 0.8
        bottom, top = min(ys) - 0.5, max(ys) + 0.35
        self.plot.setXRange(lo, hi, padding=0)
        self.plot.setYRange(bottom, top, padding=0)
        self.plot.getAxis("bottom").setTicks(_decades(lo, hi, lambda v: f"{v:g}"))
        self.plot.getAxis("left").setTicks(_decades(bottom, top, lambda v: _si(v, "")))
        if peaks:
            self._draw_roofs(peaks, lo, hi)
        self.caption.setText(self._caption(rows, plotted, peaks))

    def _draw_roofs(self, peaks: dict, lo: float, hi: float) -> None:
        """The roofline of each compute peak over [lo, hi] (log10 FLOP/byte), labelled."""
        bw = peaks["bytes_per_s"]
        roofs = [(peaks["flop_per_s_f32"], "f32", pg.mkPen("#222222", width=2))]
        if peaks.get("flop_per_s_f16"):
            roofs.append((peaks["flop_per_s_f16"], "f16 (cooperative matmul)",
                          pg.mkPen("#222222", width=2, style=Qt.PenStyle.DashLine)))
        for peak, name, pen in roofs:
            ridge = _log(peak / bw)
            x = np.array([lo - 1, ridge, hi + 1])
            y = np.array([_log(bw) + lo - 1, _log(peak), _log(peak)])
            label = pg.TextItem(f"{name} peak {_si(peak, 'FLOP/s')}", color="#222222", anchor=(1, 1))
            label.setPos(hi - 0.02, _log(peak))
            self._add(pg.PlotCurveItem(x, y, pen=pen), label)
        slope = pg.TextItem(f"memory bandwidth {_si(bw, 'B/s')}", color="#222222", anchor=(0, 0))
        slope.setPos(lo + 0.05, _log(bw) + lo - 0.05)     # under the rising roof, clear of it
        self._add(slope)

    def _add(self, *items) -> None:
        for item in items:
            self.plot.addItem(item)
            self._roof_items.append(item)

    @staticmethod
    def _caption(rows, plotted, peaks) -> str:
        legend = " ".join(f"<span style='color:{c}'>●</span> {b}" for b, c in BOUND_COLOURS.items())
        text = f"{len(plotted)} kernels, sized by total GPU time · {legend}"
        skipped = len(rows) - len(plotted)
        if skipped:
            text += f" · {skipped} kernels without floating-point work (copies, gathers) are not plotted"
        if not peaks:
            text += " · the adapter's roofs were not measured for this profile"
        elif peaks.get("cached") is False:
            text += " · roofs measured now (cached for this adapter)"
        return text

    # ------------------------------------------------------------ selection

    def select(self, name: str | None) -> None:
        """Ring the point of kernel ``name`` (None: no ring)."""
        self.selected = name if name in self.positions else None
        self.ring.clear()
        if self.selected is not None:
            self.ring.addPoints([{"pos": self.positions[name], "size": self.sizes[name] + 10}])

    def _clicked(self, _item, points, _event=None) -> None:
        if len(points):
            name = points[0].data()
            self.select(name)
            self.kernelClicked.emit(name)

    def _tip(self, x, y, data) -> str:
        r = self.rows.get(data)
        if r is None:
            return str(data)
        bound = r.get("bound") or "not classified"
        pct = f" at {r['percent_of_peak']:.1f}% of its roof" if r.get("percent_of_peak") is not None else ""
        return (f"{short_kernel(data)}\n{bound}{pct}\n{r['gpu_ns'] / 1e3:,.1f} µs in {r['calls']} calls\n"
                f"{_si(r['flops'] / r['gpu_ns'] * 1e9, 'FLOP/s')}, {_si(r['bytes'] / r['gpu_ns'] * 1e9, 'B/s')}, "
                f"{r['flops'] / r['bytes']:.3g} FLOP/byte")
