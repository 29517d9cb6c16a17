"""The graph view: an engine Graph drawn top to bottom, nodes coloured by kernel archetype.

One ``NodeItem`` per graph node (painted by hand, text dropped when zoomed far out),
all edges in two path items (laid-out edges and light "cut" long edges), layouts from
``app.graph_layout`` (grandalf, cached per graph). Wheel zooms, drag pans, Fit fits.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (QComboBox, QGraphicsItem, QGraphicsPathItem, QGraphicsScene,
                               QGraphicsView, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QPushButton, QSplitter, QStyle, QVBoxLayout, QWidget)

from engine.graph.ops import OPS

from .graph_layout import NODE_H, NODE_W, layout_graph

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
GRAPH_LABELS = {"original": "Original", "optimized": "Optimized", "training": "Training (fwd + bwd)"}


def archetype(op: str) -> str:
    opdef = OPS.get(op)
    return opdef.archetype if opdef is not None else "pointwise"


def node_bytes(node) -> int:
    return node.nbytes


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class NodeItem(QGraphicsItem):
    """One graph node: a rounded box with op and shape."""

    _font = None

    def __init__(self, node):
        super().__init__()
        self.node = node
        self.colour = QColor(ARCHETYPE_COLOURS.get(archetype(node.op), "#ffffff"))
        self.highlighted = False
        self.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIsSelectable)
        self.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        shape = "×".join(str(d) for d in node.shape) or "scalar"
        name = node.name or ""
        room = 22 - len(node.op)
        if name and len(name) > room:
            name = "…" + name[-max(room - 1, 4):]      # the end of a dotted name says the most
        self.lines = (f"{node.op}  {name}" if name else node.op, f"%{node.id}  [{shape}]")
        self.setToolTip(f"%{node.id} {node.op} {list(node.shape)} {node.dtype}"
                        + (f"\n{node.name}" if node.name else ""))

    def boundingRect(self) -> QRectF:
        return QRectF(-NODE_W / 2 - 3, -NODE_H / 2 - 3, NODE_W + 6, NODE_H + 6)

    def set_highlighted(self, on: bool) -> None:
        if on != self.highlighted:
            self.highlighted = on
            self.update()

    def paint(self, painter: QPainter, option, widget=None) -> None:
        rect = QRectF(-NODE_W / 2, -NODE_H / 2, NODE_W, NODE_H)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        pen = QPen(HIGHLIGHT if self.highlighted else QColor("#1f5fbf") if selected else QColor("#555555"))
        pen.setWidthF(3.0 if (self.highlighted or selected) else 1.0)
        painter.setPen(pen)
        painter.setBrush(QBrush(self.colour.lighter(115) if selected else self.colour))
        painter.drawRoundedRect(rect, 6, 6)
        lod = QStyleOptionLod(option, painter)
        if lod < 0.35:
            return
        if NodeItem._font is None:
            NodeItem._font = QFont()
            NodeItem._font.setPointSizeF(8.5)
        painter.setFont(NodeItem._font)
        painter.setPen(QColor("#111111"))
        top = QRectF(rect.left() + 6, rect.top() + 3, rect.width() - 12, rect.height() / 2 - 2)
        bottom = QRectF(rect.left() + 6, rect.center().y(), rect.width() - 12, rect.height() / 2 - 3)
        painter.drawText(top, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, self.lines[0])
        painter.drawText(bottom, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, self.lines[1])


def QStyleOptionLod(option, painter) -> float:
    t = painter.worldTransform()
    return max(abs(t.m11()), abs(t.m22()))


class GraphCanvas(QGraphicsView):
    """QGraphicsView with wheel zoom and hand-drag panning."""

    def __init__(self, scene, parent=None):
        super().__init__(scene, parent)
        self.setDragMode(QGraphicsView.DragMode.ScrollHandDrag)
        self.setRenderHints(QPainter.RenderHint.Antialiasing | QPainter.RenderHint.TextAntialiasing)
        self.setTransformationAnchor(QGraphicsView.ViewportAnchor.AnchorUnderMouse)
        self.setViewportUpdateMode(QGraphicsView.ViewportUpdateMode.MinimalViewportUpdate)
        self.setBackgroundBrush(QColor("#fbfbfb"))

    auto_fit = True      # keep the graph fitted on resize until the user zooms or pans

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.auto_fit:
            self.fit()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self.auto_fit:
            self.fit()

    def wheelEvent(self, event) -> None:
        factor = 1.2 if event.angleDelta().y() > 0 else 1 / 1.2
        self.auto_fit = False
        self.zoom(factor)

    def mousePressEvent(self, event) -> None:
        self.auto_fit = False
        super().mousePressEvent(event)

    def zoom(self, factor: float) -> None:
        scale = self.transform().m11() * factor
        if 0.02 <= scale <= 8:
            self.scale(factor, factor)

    def fit(self) -> None:
        """Fit the graph; a graph too tall to read that way is fitted by width, top shown."""
        self.auto_fit = True
        rect = self.scene().itemsBoundingRect().adjusted(-20, -20, 20, 20)
        if rect.isEmpty():
            return
        self.fitInView(rect, Qt.AspectRatioMode.KeepAspectRatio)
        if self.transform().m11() < 0.25:
            s = max(0.25, min(1.0, self.viewport().width() / rect.width()))
            self.resetTransform()
            self.scale(s, s)
            self.centerOn(rect.center().x(), rect.top() + self.viewport().height() / (2 * s))


class GraphView(QWidget):
    """Toolbar (graph kind, search, fit), the canvas and the node property panel."""

    kindRequested = Signal(str)       # the user picked another graph kind

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.kind = "optimized"          # what a model opens on
        self.graph = None
        self.items: dict[int, NodeItem] = {}
        self.scene = QGraphicsScene(self)
        self.canvas = GraphCanvas(self.scene)
        self.canvas.setObjectName("graphCanvas")

        self.kind_box = QComboBox()
        self.kind_box.setObjectName("graphKind")
        for kind, label in GRAPH_LABELS.items():
            self.kind_box.addItem(label, kind)
        self.kind_box.setCurrentIndex(list(GRAPH_LABELS).index(self.kind))
        self.kind_box.currentIndexChanged.connect(
            lambda i: self.kindRequested.emit(self.kind_box.itemData(i)))
        self.search = QLineEdit()
        self.search.setObjectName("graphSearch")
        self.search.setPlaceholderText("Search name or op (Ctrl+F)…")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.apply_search)
        self.fit_button = QPushButton("Fit")
        self.fit_button.clicked.connect(self.canvas.fit)
        self.info = QLabel("")
        self.info.setObjectName("graphInfo")

        bar = QHBoxLayout()
        bar.addWidget(QLabel("Graph:"))
        bar.addWidget(self.kind_box)
        bar.addWidget(self.search, 1)
        bar.addWidget(self.fit_button)
        bar.addWidget(self.info)

        self.props = QPlainTextEdit()
        self.props.setObjectName("nodeProperties")
        self.props.setReadOnly(True)
        self.props.setPlaceholderText("Click a node to see its properties.")
        self.legend = QLabel(" ".join(
            f'<span style="background:{c};color:#111">&nbsp;{a}&nbsp;</span>'
            for a, c in ARCHETYPE_COLOURS.items()))
        self.legend.setWordWrap(True)
        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addWidget(QLabel("<b>Node</b>"))
        side_layout.addWidget(self.props, 1)
        side_layout.addWidget(QLabel("<b>Kernel archetypes</b>"))
        side_layout.addWidget(self.legend)

        split = QSplitter()
        split.addWidget(self.canvas)
        split.addWidget(side)
        split.setStretchFactor(0, 4)
        split.setStretchFactor(1, 1)
        split.setSizes([800, 260])
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(split, 1)
        self.scene.selectionChanged.connect(self._selection_changed)

    # ------------------------------------------------------------ showing a graph

    def set_kind_silently(self, kind: str) -> None:
        self.kind_box.blockSignals(True)
        self.kind_box.setCurrentIndex(list(GRAPH_LABELS).index(kind))
        self.kind_box.blockSignals(False)

    def show_graph(self, graph, kind: str, message: str = "", note: str = "") -> None:
        self.kind = kind
        self.set_kind_silently(kind)
        if graph is self.graph and graph is not None:
            return
        self.graph = graph
        self.scene.clear()
        self.items = {}
        self.props.clear()
        if graph is None:
            self.scene.addText(message or "No graph.")
            self.info.setText("")
            return
        lay = layout_graph(graph)
        path, cut = QPainterPath(), QPainterPath()
        for s, d, bends, is_cut in lay.edges:
            (x0, y0), (x1, y1) = lay.pos[s], lay.pos[d]
            p = cut if is_cut else path
            pts = [(x0, y0 + NODE_H / 2)] + bends + [(x1, y1 - NODE_H / 2)]
            p.moveTo(*pts[0])
            for (ax, ay), (bx, by) in zip(pts, pts[1:]):
                mid = (ay + by) / 2
                p.cubicTo(ax, mid, bx, mid, bx, by)
        edge_item = QGraphicsPathItem(path)
        edge_item.setPen(QPen(QColor("#7a7a7a"), 1.2))
        edge_item.setZValue(-2)
        cut_item = QGraphicsPathItem(cut)
        pen = QPen(QColor(120, 140, 200, 90), 1.0)
        pen.setStyle(Qt.PenStyle.DashLine)
        cut_item.setPen(pen)
        cut_item.setZValue(-3)
        self.scene.addItem(cut_item)
        self.scene.addItem(edge_item)
        for n in graph.nodes:
            item = NodeItem(n)
            item.setPos(*lay.pos[n.id])
            self.scene.addItem(item)
            self.items[n.id] = item
        self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-40, -40, 40, 40))
        st = lay.stats
        self.info.setText((f"{note} · " if note else "") + f"{len(graph.nodes)} nodes · layout {st['seconds'] * 1000:.0f} ms"
                          + (f" · {st['cut_edges']} long edges dashed" if st["cut_edges"] else ""))
        self.canvas.fit()
        if self.search.text():
            self.apply_search(self.search.text())

    # ------------------------------------------------------------ search and highlight

    def highlight(self, ids) -> list[int]:
        ids = set(ids)
        for nid, item in self.items.items():
            item.set_highlighted(nid in ids)
        hits = [i for i in ids if i in self.items]
        if hits:
            rect = self.items[hits[0]].sceneBoundingRect()
            for i in hits[1:]:
                rect = rect.united(self.items[i].sceneBoundingRect())
            self.canvas.ensureVisible(rect if rect.height() < 2000 else self.items[hits[0]].sceneBoundingRect())
        return hits

    def select(self, ids) -> list[int]:
        """Select these nodes (the first one's properties are shown) and centre on them."""
        hits = [i for i in ids if i in self.items]
        self.scene.clearSelection()
        for i in hits:
            self.items[i].setSelected(True)
        if hits:
            self.canvas.auto_fit = False
            self.canvas.centerOn(self.items[hits[0]])
            self.show_properties(hits[0])
        return hits

    def selected(self) -> list[int]:
        return [nid for nid, item in self.items.items() if item.isSelected()]

    def refresh_properties(self) -> None:
        sel = self.selected() if self.graph is not None else []
        if sel:
            self.show_properties(sel[0])

    def highlighted(self) -> list[int]:
        return [nid for nid, item in self.items.items() if item.highlighted]

    def apply_search(self, text: str) -> None:
        text = text.strip().lower()
        if not text or self.graph is None:
            self.highlight(())
            if self.graph is not None:
                self.info.setText(self.info.text().split(" · match")[0])
            return
        hits = [n.id for n in self.graph.nodes
                if text in n.op.lower() or (n.name and text in n.name.lower()) or text == f"%{n.id}"]
        self.highlight(hits)
        self.info.setText(self.info.text().split(" · match")[0] + f" · matches: {len(hits)}")

    # ------------------------------------------------------------ properties

    def _selection_changed(self) -> None:
        try:
            selected = [i for i in self.scene.selectedItems() if isinstance(i, NodeItem)]
        except RuntimeError:       # scene being cleared
            return
        if selected:
            self.show_properties(selected[0].node.id)

    def show_properties(self, node_id: int) -> str:
        g = self.graph
        n = g[node_id]
        lines = [f"%{n.id}  {n.op}" + (f"   '{n.name}'" if n.name else ""),
                 f"archetype: {archetype(n.op)}",
                 f"shape: {list(n.shape)}   dtype: {n.dtype}",
                 f"bytes: {fmt_bytes(node_bytes(n))} ({node_bytes(n):,})"]
        for role, table in (("input", g.inputs), ("parameter", g.parameters), ("output", g.outputs)):
            names = [k for k, v in table.items() if v == n.id]
            if names:
                lines.append(f"{role}: {', '.join(names)}")
        if n.inputs:
            lines.append("operands:")
            lines += [f"  %{i} {g[i].op} {list(g[i].shape)}" + (f" '{g[i].name}'" if g[i].name else "")
                      for i in n.inputs]
        attrs = {k: v for k, v in n.attrs.items()}
        if attrs:
            lines.append("attributes:")
            for k, v in attrs.items():
                text = " ; ".join(op for op, *_ in v) if k == "program" else repr(v)
                lines.append(f"  {k} = {text if len(text) < 200 else text[:200] + '…'}")
        users = [u.id for u in g.nodes if n.id in u.inputs]
        if users:
            lines.append("users: " + ", ".join(f"%{u}" for u in users[:20]) + (" …" if len(users) > 20 else ""))
        if self.kind == "optimized":
            origin = self.state.origins().get(n.id)
            original = self.state.graphs.get("original")
            if origin:
                lines.append(f"fuses {len(origin)} original node(s):")
                for o in origin[:40]:
                    if original is not None and 0 <= o < len(original.nodes):
                        on = original[o]
                        lines.append(f"  %{o} {on.op} {list(on.shape)}" + (f" '{on.name}'" if on.name else ""))
                    else:
                        lines.append(f"  %{o}")
        ds = self.state.dispatches_of(g, n.id)
        if ds:
            p = self.state.profile.report
            lines += [f"dispatch: #{d['index']} {d['kernel']} ({d['gpu_ns'] / 1e3:,.1f} µs)" for d in ds]
            lines.append(f"last GPU time: {sum(d['gpu_ns'] for d in ds) / 1e3:,.1f} µs (step {p.steps - 1} of "
                         f"the last {'training' if p.train else 'inference'} profile, {p.mode})")
        elif self.state.profile is not None:
            lines.append("dispatch: none in the last profile (fused into another node's kernel, "
                         "a view, or another graph)")
        else:
            lines.append("dispatch / last GPU time: run the Profiler")
        text = "\n".join(lines)
        self.props.setPlainText(text)
        return text
