"""What the graph view draws: graph nodes, closed module boxes, opened module frames,
and the colours (kernel archetype, or GPU time after a profile).

Items paint themselves by hand (text dropped when zoomed far out) and know nothing of
the layout; the view places them and gives each the text and colour it shows.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QRectF, Qt, QTimer
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QGraphicsItem, QStyle

from engine.graph.ops import OPS

from .graph_layout import NODE_H, NODE_W, TITLE_H

ARCHETYPE_COLOURS = {
    "source": "#d9d9d9",
    "pointwise": "#a6d8f0",
    "reduction": "#f7c873",
    "matmul": "#f29e8e",
    "attention": "#c9a6e8",
    "conv": "#b5dd8b",
    "gather": "#f2d0e4",
    "view": "#eeeeee",
    "copy": "#c8d3de",
    "optimizer": "#9fd9b4",  # a training step's parameter-group updates (profiler bars)
}
HIGHLIGHT = QColor("#ff2d6f")
SELECTED = QColor("#1f5fbf")
TEXT_LOD = 0.32            # below this zoom, boxes are drawn without text
FLAT_LOD = 0.12            # below this, as plain filled rectangles (thousands of them in an overview)
# GPU time as a share of the step, on a log scale from HEAT_LOW to HEAT_HIGH (Oranges)
HEAT_LOW, HEAT_HIGH = 5e-4, 0.1
HEAT_RAMP = ("#fff5eb", "#fdd0a2", "#fdae6b", "#f16913", "#d94801", "#7f2704")
NO_DISPATCH = QColor("#f3f3f3")


def archetype(op: str) -> str:
    opdef = OPS.get(op)
    return opdef.archetype if opdef is not None else "pointwise"


def node_bytes(node) -> int:
    return node.nbytes


def fmt_bytes(n: float) -> str:
    if n < 0:
        return "−" + fmt_bytes(-n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def fmt_time(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:,.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:,.2f} ms"
    return f"{ns / 1e3:,.1f} µs"


def heat_level(share: float) -> float:
    """0..1 on the heat ramp for a share of the step's GPU time (log scale)."""
    if share <= 0:
        return 0.0
    lo, hi = math.log10(HEAT_LOW), math.log10(HEAT_HIGH)
    return min(1.0, max(0.0, (math.log10(share) - lo) / (hi - lo)))


def heat_colour(share: float) -> QColor:
    """The ramp's colour for a share of the step (interpolated between its stops)."""
    t = heat_level(share) * (len(HEAT_RAMP) - 1)
    i = min(int(t), len(HEAT_RAMP) - 2)
    a, b = QColor(HEAT_RAMP[i]), QColor(HEAT_RAMP[i + 1])
    f = t - i
    return QColor(round(a.red() + (b.red() - a.red()) * f), round(a.green() + (b.green() - a.green()) * f),
                  round(a.blue() + (b.blue() - a.blue()) * f))


def nodes_text(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def text_on(colour: QColor) -> QColor:
    return QColor("#ffffff") if colour.lightness() < 120 else QColor("#111111")


def lod_of(painter: QPainter) -> float:
    t = painter.worldTransform()
    return max(abs(t.m11()), abs(t.m22()))


_FONTS: dict = {}


def font(size: float, bold: bool = False) -> QFont:
    key = (size, bold)
    if key not in _FONTS:
        f = QFont()
        f.setPointSizeF(size)
        f.setBold(bold)
        _FONTS[key] = f
    return _FONTS[key]


class _Box(QGraphicsItem):
    """A rounded box of a given size, selectable, highlightable, with two lines of text."""

    def __init__(self, width: float, height: float):
        super().__init__()
        self.w, self.h = width, height
        self.colour = QColor("#ffffff")
        self.lines = ("", "")
        self.highlighted = False
        self.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIsSelectable)
        self.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)

    def boundingRect(self) -> QRectF:
        return QRectF(-self.w / 2 - 3, -self.h / 2 - 3, self.w + 6, self.h + 6)

    def set_highlighted(self, on: bool) -> None:
        if on != self.highlighted:
            self.highlighted = on
            self.update()

    def set_look(self, colour: QColor, lines: tuple[str, str]) -> None:
        self.colour, self.lines = colour, lines
        self.update()

    def _outline(self, painter, option) -> QRectF:
        rect = QRectF(-self.w / 2, -self.h / 2, self.w, self.h)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        if lod_of(painter) < FLAT_LOD:
            painter.fillRect(rect, HIGHLIGHT if self.highlighted else SELECTED if selected else self.colour)
            return rect
        pen = QPen(HIGHLIGHT if self.highlighted else SELECTED if selected else QColor("#555555"))
        pen.setWidthF(3.0 if (self.highlighted or selected) else 1.0)
        painter.setPen(pen)
        painter.setBrush(QBrush(self.colour.lighter(112) if selected else self.colour))
        painter.drawRoundedRect(rect, 6, 6)
        return rect

    def _two_lines(self, painter, rect, first_font, right: str = "") -> None:
        painter.setPen(text_on(self.colour))
        inner = rect.adjusted(8, 2, -8 - (14 if right else 0), -2)
        top = QRectF(inner.left(), inner.top(), inner.width(), inner.height() / 2)
        bottom = QRectF(inner.left(), inner.center().y(), inner.width(), inner.height() / 2)
        left = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter
        painter.setFont(first_font)
        painter.drawText(top, left, painter.fontMetrics().elidedText(self.lines[0], Qt.TextElideMode.ElideLeft,
                                                                     int(top.width())))
        painter.setFont(font(8.5))
        painter.drawText(bottom, left, painter.fontMetrics().elidedText(self.lines[1], Qt.TextElideMode.ElideRight,
                                                                        int(bottom.width())))
        if right:
            painter.setFont(font(12, True))
            painter.drawText(QRectF(rect.right() - 20, rect.top(), 16, rect.height()),
                             Qt.AlignmentFlag.AlignCenter, right)


class NodeItem(_Box):
    """One graph node: its op and name, its id and shape (or its GPU time)."""

    def __init__(self, node):
        super().__init__(NODE_W, NODE_H)
        self.node = node
        shape = "×".join(str(d) for d in node.shape) or "scalar"
        name = node.name or ""
        self.base_lines = (f"{node.op}  {name}" if name else node.op, f"%{node.id}  [{shape}]")
        self.lines = self.base_lines
        self.colour = QColor(ARCHETYPE_COLOURS.get(archetype(node.op), "#ffffff"))
        self.setToolTip(f"%{node.id} {node.op} {list(node.shape)} {node.dtype}"
                        + (f"\n{node.name}" if node.name else "")
                        + (f"\nmodule: {', '.join(node.modules)}" if node.modules else ""))

    def paint(self, painter: QPainter, option, widget=None) -> None:
        rect = self._outline(painter, option)
        if lod_of(painter) >= TEXT_LOD:
            self._two_lines(painter, rect, font(9.0))


class ModuleBox(_Box):
    """A closed module: its name and size (and GPU time); double-click opens it."""

    def __init__(self, path: str, label: str, count: int, on_toggle):
        from .graph_layout import BOX_H, BOX_W
        super().__init__(BOX_W, BOX_H)
        self.path, self.label, self.count = path, label, count
        self.on_toggle = on_toggle
        self.matches = 0
        self.colour = QColor("#e8eef7")
        self.lines = (label, nodes_text(count))
        self.setToolTip(f"{path}: {nodes_text(count)} (double-click to open)")

    def set_matches(self, n: int) -> None:
        if n != self.matches:
            self.matches = n
            self.set_highlighted(n > 0)

    def paint(self, painter: QPainter, option, widget=None) -> None:
        rect = self._outline(painter, option)
        if lod_of(painter) < TEXT_LOD:
            return
        self._two_lines(painter, rect, font(10.0, True), right="+")
        if self.matches:
            badge = QRectF(rect.right() - 34, rect.top() - 9, 30, 16)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(HIGHLIGHT)
            painter.drawRoundedRect(badge, 8, 8)
            painter.setPen(QColor("#ffffff"))
            painter.setFont(font(8, True))
            painter.drawText(badge, Qt.AlignmentFlag.AlignCenter, str(self.matches))

    def mouseDoubleClickEvent(self, event) -> None:
        toggle(self, event)


class ModuleFrame(QGraphicsItem):
    """An opened module: a frame around its items, its name in a title bar (double-click
    the title to close it)."""

    def __init__(self, path: str, label: str, count: int, rect: tuple, depth: int, on_toggle):
        super().__init__()
        self.path, self.label, self.count = path, label, count
        self.on_toggle = on_toggle
        x, y, w, h = rect
        self.rect = QRectF(0, 0, w, h)
        self.setPos(x, y)
        self.setZValue(-20 + depth)
        self.title = f"{label}  ·  {nodes_text(count)}"
        self.title_colour = QColor("#dfe6f0")
        self.fill = QColor(90, 120, 170, 14 + 8 * (depth % 3))
        self.highlighted = False
        self.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIsSelectable)
        self.setToolTip(f"{path}: {nodes_text(count)} (double-click the title to close it)")

    def boundingRect(self) -> QRectF:
        return self.rect.adjusted(-2, -2, 2, 2)

    def shape(self):
        from PySide6.QtGui import QPainterPath
        path = QPainterPath()
        path.addRect(QRectF(0, 0, self.rect.width(), TITLE_H))     # only the title takes clicks
        return path

    def set_highlighted(self, on: bool) -> None:
        if on != self.highlighted:
            self.highlighted = on
            self.update()

    def set_look(self, colour: QColor, title: str) -> None:
        self.title_colour, self.title = colour, title
        self.update()

    def paint(self, painter: QPainter, option, widget=None) -> None:
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        if lod_of(painter) < FLAT_LOD:
            painter.fillRect(QRectF(0, 0, self.rect.width(), TITLE_H), self.title_colour)
            return
        pen = QPen(HIGHLIGHT if self.highlighted else SELECTED if selected else QColor(110, 125, 150))
        pen.setWidthF(2.5 if (self.highlighted or selected) else 1.0)
        painter.setPen(pen)
        painter.setBrush(self.fill)
        painter.drawRoundedRect(self.rect, 8, 8)
        bar = QRectF(0, 0, self.rect.width(), TITLE_H - 4)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(self.title_colour)
        painter.drawRoundedRect(bar.adjusted(1, 1, -1, 0), 7, 7)
        if lod_of(painter) < TEXT_LOD:
            return
        painter.setPen(text_on(self.title_colour))
        painter.setFont(font(9.5, True))
        text = bar.adjusted(10, 0, -26, 0)
        painter.drawText(text, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         painter.fontMetrics().elidedText(self.title, Qt.TextElideMode.ElideRight, int(text.width())))
        painter.setFont(font(12, True))
        painter.drawText(QRectF(bar.right() - 22, bar.top(), 18, bar.height()), Qt.AlignmentFlag.AlignCenter, "−")

    def mouseDoubleClickEvent(self, event) -> None:
        toggle(self, event)


def toggle(item, event) -> None:
    """Open or close the item's module once the event is over: that redraws the scene,
    which deletes the item handling the event."""
    path, on_toggle = item.path, item.on_toggle
    QTimer.singleShot(0, lambda: on_toggle(path))
    event.accept()


def module_label(path: str, parent: str) -> str:
    """What a box or frame is called inside its parent frame: the path below the parent
    (``self_attn``), a list entry with its list's name (``layers.3``)."""
    rest = path[len(parent) + 1:] if parent else path
    if rest.isdigit() and parent:
        return f"{parent.rpartition('.')[2]}.{rest}"
    return rest
