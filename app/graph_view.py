"""The graph view: an engine Graph drawn top to bottom as nested module boxes.

Nodes remember their module (``model.layers.3.self_attn``), so a big model opens on its
blocks (``app.graph_layout``: a 30-layer Llama shows its embedding, 30 layer boxes, norm
and head), each box double-clicks open into a frame of its nodes and child modules and
closes again from the frame's title. Search highlights nodes by op, name or ``%id``
(and the closed boxes holding them, with a count), Enter selects the next match and
opens what holds it. After a profile of the graph shown, nodes and boxes are coloured
by GPU time (a box: its module's total). Wheel zooms, drag pans, Fit shows everything;
the overview in the corner shows where the view is. The view opens at a zoom where the
text is readable.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (QComboBox, QGraphicsPathItem, QGraphicsScene, QGraphicsView, QHBoxLayout, QLabel,
                               QLineEdit, QPlainTextEdit, QPushButton, QSplitter, QVBoxLayout, QWidget)

from engine.graph.modules import ancestors, parent_of

from .graph_items import (ARCHETYPE_COLOURS, HEAT_HIGH, HEAT_LOW, HEAT_RAMP, NO_DISPATCH, ModuleBox, ModuleFrame,
                          NodeItem, archetype, fmt_bytes, fmt_time, heat_colour, module_label, node_bytes, nodes_text)
from .graph_layout import NODE_H, NODE_W, fmt_seconds, tree_layout
from .graph_minimap import Minimap

__all__ = ["GraphView", "GraphCanvas", "NodeItem", "ModuleBox", "ModuleFrame", "ARCHETYPE_COLOURS", "fmt_bytes",
           "archetype", "node_bytes"]

GRAPH_LABELS = {"original": "Original", "optimized": "Optimized", "training": "Training (fwd + bwd)"}
COLOUR_MODES = {"archetype": "Archetype", "heat": "GPU time"}
READABLE = 0.8          # the least zoom the view opens at: node text stays legible
MAX_REVEAL = 12         # selecting nodes opens the boxes holding them, up to this many blocks
EDGE, BACK_EDGE, CUT_EDGE = QColor("#7a7a7a"), QColor(214, 120, 40, 150), QColor(120, 140, 200, 110)


class GraphCanvas(QGraphicsView):
    """QGraphicsView with wheel zoom and hand-drag panning; ``viewChanged`` when what it
    shows moves (the overview follows)."""

    auto_fit = True      # keep the opening view on resize until the user zooms or pans
    viewChanged = Signal()

    def __init__(self, scene, parent=None):
        super().__init__(scene, parent)
        self.setDragMode(QGraphicsView.DragMode.ScrollHandDrag)
        self.setRenderHints(QPainter.RenderHint.Antialiasing | QPainter.RenderHint.TextAntialiasing)
        self.setTransformationAnchor(QGraphicsView.ViewportAnchor.AnchorUnderMouse)
        self.setViewportUpdateMode(QGraphicsView.ViewportUpdateMode.MinimalViewportUpdate)
        self.setBackgroundBrush(QColor("#fbfbfb"))
        self.minimap = Minimap(self)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.auto_fit:
            self.home()
        self.viewChanged.emit()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self.auto_fit:
            self.home()

    def wheelEvent(self, event) -> None:
        factor = 1.2 if event.angleDelta().y() > 0 else 1 / 1.2
        self.auto_fit = False
        self.zoom(factor)

    def mousePressEvent(self, event) -> None:
        self.auto_fit = False
        super().mousePressEvent(event)

    def scrollContentsBy(self, dx, dy) -> None:
        super().scrollContentsBy(dx, dy)
        self.viewChanged.emit()

    def zoom(self, factor: float) -> None:
        scale = self.transform().m11() * factor
        if 0.005 <= scale <= 8:
            self.scale(factor, factor)
            self.viewChanged.emit()

    def _content(self) -> QRectF:
        return self.scene().itemsBoundingRect().adjusted(-20, -20, 20, 20)

    def fit(self) -> None:
        """Everything in view (an overview: text may be too small to read)."""
        rect = self._content()
        if not rect.isEmpty():
            self.fitInView(rect, Qt.AspectRatioMode.KeepAspectRatio)
            self.viewChanged.emit()

    def home(self) -> None:
        """The opening view: everything when it fits at a readable zoom, else the top of
        the graph at the readable zoom (the overview shows the rest)."""
        self.auto_fit = True
        rect = self._content()
        if rect.isEmpty():
            return
        vp = self.viewport()
        s = min(vp.width() / rect.width(), vp.height() / rect.height(), 1.0)
        if s >= READABLE:
            self.resetTransform()
            self.scale(s, s)
            self.centerOn(rect.center())
        else:
            self.resetTransform()
            self.scale(READABLE, READABLE)
            half_w, half_h = vp.width() / (2 * READABLE), vp.height() / (2 * READABLE)
            x = rect.center().x() if rect.width() <= 2 * half_w else rect.left() + half_w
            self.centerOn(x, rect.top() + half_h)
        self.viewChanged.emit()


class GraphView(QWidget):
    """Toolbar (graph kind, search, colours, expand/collapse, fit), the canvas and the
    property panel of the selected node or module."""

    kindRequested = Signal(str)       # the user picked another graph kind
    nodesSelected = Signal(list)      # node ids the user selected (a module: all of its nodes)

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.kind = "optimized"          # what a model opens on
        self.graph = None
        self.note = ""
        self.layout = None               # the graph's TreeLayout
        self.last_scene = None           # its SceneLayout as drawn
        self.opened: set[str] = set()
        self.items: dict[int, NodeItem] = {}
        self.boxes: dict[str, ModuleBox] = {}
        self.frames: dict[str, ModuleFrame] = {}
        self.hits: set[int] = set()
        self.module_hits: set[str] = set()
        self.heat: dict[int, int] | None = None      # node id -> GPU ns of the last profiled step
        self.module_heat: dict[str, int] = {}
        self.heat_total = 0
        self.colour_mode = "archetype"
        self.timings: dict[str, float] = {}
        self._match = -1
        self._programmatic = False
        self.scene = QGraphicsScene(self)
        self.canvas = GraphCanvas(self.scene)
        self.canvas.setObjectName("graphCanvas")
        self._toolbar()
        self._panels()
        self.scene.selectionChanged.connect(self._selection_changed)

    def _toolbar(self) -> None:
        self.kind_box = QComboBox()
        self.kind_box.setObjectName("graphKind")
        for kind, label in GRAPH_LABELS.items():
            self.kind_box.addItem(label, kind)
        self.kind_box.setCurrentIndex(list(GRAPH_LABELS).index(self.kind))
        self.kind_box.currentIndexChanged.connect(lambda i: self.kindRequested.emit(self.kind_box.itemData(i)))
        self.search = QLineEdit()
        self.search.setObjectName("graphSearch")
        self.search.setPlaceholderText("Search op, name, %id or module (Ctrl+F, Enter: next)…")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.apply_search)
        self.search.returnPressed.connect(self.select_next_match)
        self.colour_box = QComboBox()
        self.colour_box.setObjectName("graphColour")
        for mode, label in COLOUR_MODES.items():
            self.colour_box.addItem(label, mode)
        self.colour_box.currentIndexChanged.connect(lambda i: self.set_colour_mode(self.colour_box.itemData(i)))
        self.expand_button = QPushButton("Expand all")
        self.expand_button.setObjectName("graphExpandAll")
        self.expand_button.clicked.connect(self.expand_all)
        self.collapse_button = QPushButton("Collapse")
        self.collapse_button.setObjectName("graphCollapse")
        self.collapse_button.setToolTip("Back to the model's blocks")
        self.collapse_button.clicked.connect(self.collapse_all)
        self.fit_button = QPushButton("Fit")
        self.fit_button.setToolTip("Show the whole graph (Ctrl+0)")
        self.fit_button.clicked.connect(self.canvas.fit)
        self.info = QLabel("")
        self.info.setObjectName("graphInfo")
        self.bar = QHBoxLayout()
        self.bar.addWidget(QLabel("Graph:"))
        self.bar.addWidget(self.kind_box)
        self.bar.addWidget(self.search, 1)
        self.bar.addWidget(QLabel("Colour:"))
        self.bar.addWidget(self.colour_box)
        for b in (self.expand_button, self.collapse_button, self.fit_button):
            self.bar.addWidget(b)

    def _panels(self) -> None:
        self.props = QPlainTextEdit()
        self.props.setObjectName("nodeProperties")
        self.props.setReadOnly(True)
        self.props.setPlaceholderText("Click a node or a module to see its properties; double-click a module "
                                      "to open or close it.")
        self.legend = QLabel("")
        self.legend.setObjectName("graphLegend")
        self.legend.setWordWrap(True)
        self.legend_title = QLabel("<b>Kernel archetypes</b>")
        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addWidget(QLabel("<b>Selection</b>"))
        side_layout.addWidget(self.props, 1)
        side_layout.addWidget(QLabel("<b>Overview</b> (click or drag to move)"))
        side_layout.addWidget(self.canvas.minimap)
        side_layout.addWidget(self.legend_title)
        side_layout.addWidget(self.legend)
        split = QSplitter()
        split.addWidget(self.canvas)
        split.addWidget(side)
        split.setStretchFactor(0, 4)
        split.setStretchFactor(1, 1)
        split.setSizes([900, 280])
        layout = QVBoxLayout(self)
        layout.addLayout(self.bar)
        layout.addWidget(self.info)
        layout.addWidget(split, 1)
        self._legend()

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
        self.graph, self.note = graph, note
        self.scene.clear()
        self.items, self.boxes, self.frames = {}, {}, {}
        self.props.clear()
        if graph is None:
            self.layout = None
            self.scene.addText(message or "No graph.")
            self.info.setText("")
            self.canvas.minimap.scene_changed()
            return
        self.layout = tree_layout(graph)
        self.opened = self.layout.tree.default_open()
        self.hits, self.module_hits = set(), set()
        self.refresh_heat()
        self.rebuild()
        self.canvas.home()
        if self.search.text():
            self.apply_search(self.search.text())

    def rebuild(self, anchor: str | None = None) -> None:
        """Lay out what is opened and draw it; ``anchor``: a module whose box or frame stays
        where it was on screen."""
        before = self._screen_corner(anchor)
        selected_nodes, selected_modules = self.selected(), self.selected_modules()
        start = time.perf_counter()
        lay = self.last_scene = self.layout.scene(self.opened)
        self.timings["layout"] = time.perf_counter() - start
        t = time.perf_counter()
        self._programmatic = True
        try:
            self.scene.clear()
            self.items, self.boxes, self.frames = {}, {}, {}
            tree = self.layout.tree
            for path, rect in lay.frames.items():
                frame = ModuleFrame(path, module_label(path, self._shown_parent(path)), tree.count[path], rect,
                                    path.count(".") + 1, self.toggle)
                self.scene.addItem(frame)
                self.frames[path] = frame
            for path, (x, y, w, h) in lay.boxes.items():
                box = ModuleBox(path, module_label(path, self._shown_parent(path)), tree.count[path], self.toggle)
                box.setPos(x + w / 2, y + h / 2)
                self.scene.addItem(box)
                self.boxes[path] = box
            for nid, (x, y) in lay.nodes.items():
                item = NodeItem(self.graph[nid])
                item.setPos(x, y)
                self.scene.addItem(item)
                self.items[nid] = item
            self._draw_edges(lay)
            self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-60, -60, 60, 60))
            self._colour()
            self._show_hits()
            for nid in selected_nodes:
                if nid in self.items:
                    self.items[nid].setSelected(True)
            for path in selected_modules:
                item = self.boxes.get(path) or self.frames.get(path)
                if item is not None:
                    item.setSelected(True)
        finally:
            self._programmatic = False
        self.timings["items"] = time.perf_counter() - t
        if not self.selected() and not self.selected_modules():
            self.props.clear()              # what it showed is inside a closed box now
        self._keep_on_screen(anchor, before)
        self.canvas.minimap.scene_changed()
        self._info(lay)

    def _shown_parent(self, path: str) -> str:
        """The frame a module is drawn in ('' for the canvas)."""
        return parent_of(path)

    def _draw_edges(self, lay) -> None:
        paths = {"edge": QPainterPath(), "back": QPainterPath(), "cut": QPainterPath()}
        for u, v, bends, cut, back in lay.edges:
            a, b = self._rect_of(u, lay), self._rect_of(v, lay)
            if a is None or b is None:
                continue
            if back:     # against the reading order: leave from the top, arrive at the bottom, on the right
                pts = [(a.center().x() + a.width() / 4, a.top())] + bends + [(b.center().x() + b.width() / 4, b.bottom())]
            else:
                pts = [(a.center().x(), a.bottom())] + bends + [(b.center().x(), b.top())]
            p = paths["cut" if cut else "back" if back else "edge"]
            p.moveTo(*pts[0])
            for (ax, ay), (bx, by) in zip(pts, pts[1:]):
                mid = (ay + by) / 2
                p.cubicTo(ax, mid, bx, mid, bx, by)
        for kind, colour, width, z in (("cut", CUT_EDGE, 1.0, -32), ("back", BACK_EDGE, 1.1, -31),
                                       ("edge", EDGE, 1.2, -30)):
            item = QGraphicsPathItem(paths[kind])
            pen = QPen(colour, width)
            if kind == "cut":
                pen.setStyle(Qt.PenStyle.DashLine)
            item.setPen(pen)
            item.setZValue(z)
            self.scene.addItem(item)

    @staticmethod
    def _rect_of(unit, lay) -> QRectF | None:
        if isinstance(unit, int):
            if unit not in lay.nodes:
                return None
            x, y = lay.nodes[unit]
            return QRectF(x - NODE_W / 2, y - NODE_H / 2, NODE_W, NODE_H)
        r = lay.boxes.get(unit)
        return QRectF(*r) if r else None

    def _screen_corner(self, path: str | None):
        item = (self.boxes.get(path) or self.frames.get(path)) if path else None
        if item is None:
            return None
        return self.canvas.mapFromScene(item.sceneBoundingRect().topLeft())

    def _keep_on_screen(self, path: str | None, before) -> None:
        item = (self.boxes.get(path) or self.frames.get(path)) if path else None
        if item is None or before is None:
            return
        now = item.sceneBoundingRect().topLeft()
        drift = now - self.canvas.mapToScene(before)
        centre = self.canvas.mapToScene(self.canvas.viewport().rect().center())
        self.canvas.centerOn(centre + QPointF(drift.x(), drift.y()))

    def _info(self, lay) -> None:
        st = lay.stats
        hidden = len(self.layout.tree.hidden)
        parts = ([self.note] if self.note else []) + [
            f"{len(self.graph.nodes)} nodes", f"{st['visible']} shown ({st['boxes']} closed modules)",
            f"layout {fmt_seconds(self.timings['layout'])}, drawing {fmt_seconds(self.timings['items'])}"]
        if hidden:
            parts.append(f"{hidden} unused constants not drawn")
        if self.hits or self.module_hits:
            parts.append(f"matches: {len(self.hits) + len(self.module_hits)}")
        self.info.setText(" · ".join(parts))

    # ------------------------------------------------------------ opening and closing modules

    def toggle(self, path: str) -> None:
        """Open a closed module, close an opened one (double-click)."""
        if path in self.opened:
            self.collapse(path)
        else:
            self.expand(path)

    def expand(self, path: str) -> None:
        if self.graph is None or path not in self.layout.tree.count:
            return
        self.opened |= {path, *ancestors(path)}
        self.rebuild(anchor=path)

    def collapse(self, path: str) -> None:
        if self.graph is None:
            return
        prefix = path + "."
        self.opened = {m for m in self.opened if m != path and not m.startswith(prefix)}
        self.rebuild(anchor=path)

    def expand_all(self) -> None:
        if self.graph is not None:
            self.opened = set(self.layout.tree.count)
            self.rebuild()
            self.canvas.home()

    def collapse_all(self) -> None:
        """Back to the model's blocks."""
        if self.graph is not None:
            self.opened = self.layout.tree.default_open()
            self.rebuild()
            self.canvas.home()

    def reveal(self, ids) -> bool:
        """Open the modules holding these nodes (unless they span more than MAX_REVEAL
        blocks); returns whether every one of them is drawn now."""
        tree = self.layout.tree
        hidden = {tree.visible(i, self.opened) for i in ids if i < len(tree.module_of) and i not in tree.hidden}
        closed = {u for u in hidden if isinstance(u, str)}
        if closed and len(closed) <= MAX_REVEAL:
            for i in ids:
                m = tree.module_of[i]
                if m:
                    self.opened |= {m, *ancestors(m)}
            self.rebuild()
        return all(i in self.items for i in ids)

    # ------------------------------------------------------------ search, highlight, selection

    def highlight(self, ids) -> list[int]:
        """Mark these nodes (a closed module holding some shows their count) and bring the
        first into view; returns the ids that are nodes of the graph."""
        n = len(self.graph.nodes) if self.graph is not None else 0
        self.hits = {i for i in ids if 0 <= i < n}
        self.module_hits = set()
        self._show_hits()
        self._bring_into_view(sorted(self.hits))
        return sorted(self.hits)

    def _show_hits(self) -> None:
        for nid, item in self.items.items():
            item.set_highlighted(nid in self.hits)
        counts: dict[str, int] = {}
        if self.layout is not None:
            tree = self.layout.tree
            for u in [tree.visible(i, self.opened) for i in self.hits] + [
                    tree.visible_module(m, self.opened) for m in self.module_hits]:
                if isinstance(u, str) and u not in self.module_hits:
                    counts[u] = counts.get(u, 0) + 1
        for path, box in self.boxes.items():
            box.set_matches(counts.get(path, 0))
            if path in self.module_hits:
                box.set_highlighted(True)
        for path, frame in self.frames.items():
            frame.set_highlighted(path in self.module_hits)

    def _bring_into_view(self, ids) -> None:
        targets = [self.items[i] for i in ids if i in self.items]
        if not targets and self.layout is not None:
            boxes = [self.boxes.get(self.layout.tree.visible(i, self.opened)) for i in ids]
            targets = [b for b in boxes if b is not None]
        seen = self.canvas.mapToScene(self.canvas.viewport().rect()).boundingRect()
        if targets and not any(seen.intersects(t.sceneBoundingRect()) for t in targets):
            self.canvas.ensureVisible(targets[0].sceneBoundingRect(), 80, 80)      # the first, if none shows

    def highlighted(self) -> list[int]:
        """Node ids marked by the search or a fusion rule (drawn, or counted on their box)."""
        return sorted(self.hits)

    def apply_search(self, text: str) -> None:
        text = text.strip().lower()
        self._match = -1
        if not text or self.graph is None:
            self.hits, self.module_hits = set(), set()
            self._show_hits()
            if self.graph is not None:
                self._info(self.last_scene)
            return
        self.hits = {n.id for n in self.graph.nodes if n.id not in self.layout.tree.hidden and (
            text in n.op.lower() or (n.name and text in n.name.lower()) or text == f"%{n.id}")}
        self.module_hits = {m for m in self.layout.tree.modules() if m.lower() == text
                            or m.lower().endswith("." + text)}
        self._show_hits()
        self._bring_into_view(sorted(self.hits))
        self._info(self.last_scene)

    def select_next_match(self) -> list[int]:
        """Enter in the search box: select the next matching node (opening what holds it),
        or the next matching module."""
        matches = [("n", i) for i in sorted(self.hits)] + [("m", m) for m in sorted(self.module_hits)]
        if not matches:
            return []
        self._match = (self._match + 1) % len(matches)
        kind, what = matches[self._match]
        if kind == "m":
            self.select_module(what)
            return []
        return self.select([what])

    def select(self, ids) -> list[int]:
        """Select these nodes (opening the modules that hold them), show the first one's
        properties and centre on it."""
        if self.graph is None:
            return []
        ids = [i for i in ids if 0 <= i < len(self.graph.nodes)]
        self.reveal(ids)
        hits = [i for i in ids if i in self.items]
        self._programmatic = True
        try:
            self.scene.clearSelection()
            for i in hits:
                self.items[i].setSelected(True)
            if not hits:        # spread over too many blocks: select the boxes holding them
                for path in {self.layout.tree.visible(i, self.opened) for i in ids} & set(self.boxes):
                    self.boxes[path].setSelected(True)
        finally:
            self._programmatic = False
        if hits:
            self.canvas.auto_fit = False
            self.canvas.centerOn(self.items[hits[0]])
            self.show_properties(hits[0])
        return hits

    def select_module(self, path: str) -> bool:
        """Select a module's box (or frame), opening what holds it, and show its summary."""
        if self.graph is None or path not in self.layout.tree.count or not path:
            return False
        if not all(a in self.opened for a in ancestors(path)):
            self.opened |= set(ancestors(path))
            self.rebuild()
        item = self.boxes.get(path) or self.frames.get(path)
        if item is None:
            return False
        self._programmatic = True
        try:
            self.scene.clearSelection()
            item.setSelected(True)
        finally:
            self._programmatic = False
        self._show_rect(item.sceneBoundingRect())
        self.show_module(path)
        return True

    def _show_rect(self, rect: QRectF) -> None:
        """Bring ``rect`` into view; one bigger than the view shows its top, centred."""
        self.canvas.auto_fit = False
        seen = self.canvas.mapToScene(self.canvas.viewport().rect()).boundingRect()
        if rect.width() <= seen.width() and rect.height() <= seen.height():
            self.canvas.centerOn(rect.center())
        else:
            x = rect.center().x() if rect.width() <= seen.width() else rect.left() + seen.width() / 2 - 10
            self.canvas.centerOn(x, rect.top() + min(rect.height(), seen.height()) / 2 - 10)
        self.canvas.viewChanged.emit()

    def selected(self) -> list[int]:
        return [nid for nid, item in self.items.items() if item.isSelected()]

    def selected_modules(self) -> list[str]:
        return [p for p, item in [*self.boxes.items(), *self.frames.items()] if item.isSelected()]

    def refresh_properties(self) -> None:
        sel = self.selected() if self.graph is not None else []
        if sel:
            self.show_properties(sel[0])
        elif self.graph is not None and self.selected_modules():
            self.show_module(self.selected_modules()[0])

    def _selection_changed(self) -> None:
        try:
            nodes, modules = self.selected(), self.selected_modules()
        except RuntimeError:       # scene being cleared
            return
        if nodes:
            self.show_properties(nodes[0])
        elif modules:
            self.show_module(modules[0])
        if not self._programmatic and (nodes or modules):
            tree = self.layout.tree
            self.nodesSelected.emit(sorted(set(nodes) | {i for m in modules for i in tree.nodes_under(m)}))

    # ------------------------------------------------------------ colours

    def set_colour_mode(self, mode: str) -> None:
        if mode not in COLOUR_MODES:
            raise ValueError(f"unknown colour mode {mode!r}")
        self.colour_mode = mode
        self.colour_box.blockSignals(True)
        self.colour_box.setCurrentIndex(list(COLOUR_MODES).index(mode))
        self.colour_box.blockSignals(False)
        self._colour()
        self._legend()
        self.canvas.minimap.scene_changed()

    def refresh_heat(self, switch: bool = True) -> None:
        """GPU times from the last profile when it profiled the graph shown (else none);
        ``switch``: colour by them as soon as there are some."""
        p = self.state.profile
        self.heat, self.module_heat, self.heat_total = None, {}, 0
        if p is not None and self.graph is not None and p.graph is self.graph:
            last = p.report.steps - 1
            self.heat_total = sum(d.gpu_ns for d in p.report.dispatches if d.step == last)
            self.heat = {nid: sum(d["gpu_ns"] for d in ds) for nid, ds in p.node_dispatches.items()}
            tree = self.layout.tree
            for nid, ns in self.heat.items():
                m = tree.module_of[nid]
                for a in ancestors(m) + [m] if m else []:
                    self.module_heat[a] = self.module_heat.get(a, 0) + ns
        mode = "heat" if self.heat is not None and switch else self.colour_mode
        if self.heat is None:
            mode = "archetype"
        self.colour_box.model().item(1).setEnabled(self.heat is not None)
        if self.graph is not None:
            self.set_colour_mode(mode)

    def _share(self, ns: float) -> float:
        return ns / self.heat_total if self.heat_total else 0.0

    def _colour(self) -> None:
        heat = self.colour_mode == "heat" and self.heat is not None
        for nid, item in self.items.items():
            if not heat:
                item.set_look(QColor(ARCHETYPE_COLOURS.get(archetype(item.node.op), "#ffffff")), item.base_lines)
            elif nid in self.heat:
                ns = self.heat[nid]
                item.set_look(heat_colour(self._share(ns)),
                              (item.base_lines[0], f"%{nid} · {fmt_time(ns)} · {100 * self._share(ns):.1f}%"))
            else:
                item.set_look(NO_DISPATCH, (item.base_lines[0], f"%{nid} · no dispatch"))
        for path, box in self.boxes.items():
            ns = self.module_heat.get(path, 0)
            if heat:
                box.set_look(heat_colour(self._share(ns)) if ns else NO_DISPATCH,
                             (box.label, f"{nodes_text(box.count)} · {self._time_text(ns)}"))
            else:
                box.set_look(QColor("#e8eef7"), (box.label, nodes_text(box.count)))
        for path, frame in self.frames.items():
            ns = self.module_heat.get(path, 0)
            if heat:
                frame.set_look(heat_colour(self._share(ns)) if ns else NO_DISPATCH,
                               f"{frame.label}  ·  {self._time_text(ns)}")
            else:
                frame.set_look(QColor("#dfe6f0"), f"{frame.label}  ·  {nodes_text(frame.count)}")

    def _time_text(self, ns: int) -> str:
        return f"{fmt_time(ns)} · {100 * self._share(ns):.1f}%" if ns else "no dispatch"

    def _legend(self) -> None:
        if self.colour_mode == "heat":
            self.legend_title.setText("<b>GPU time</b> (share of the profiled step)")
            steps = [HEAT_LOW * (HEAT_HIGH / HEAT_LOW) ** (k / (len(HEAT_RAMP) - 1)) for k in range(len(HEAT_RAMP))]
            cells = "".join(f'<span style="background:{heat_colour(s).name()};color:{"#fff" if k > 3 else "#111"}">'
                            f'&nbsp;{100 * s:.2g}%&nbsp;</span>' for k, s in enumerate(steps))
            self.legend.setText(f"{cells}<br><span style='background:{NO_DISPATCH.name()};color:#111'>&nbsp;"
                                f"no dispatch&nbsp;</span> (a view, a source, or fused into another node's kernel)")
        else:
            self.legend_title.setText("<b>Kernel archetypes</b>")
            self.legend.setText(" ".join(f'<span style="background:{c};color:#111">&nbsp;{a}&nbsp;</span>'
                                         for a, c in ARCHETYPE_COLOURS.items()))

    # ------------------------------------------------------------ properties

    def show_module(self, path: str) -> str:
        """A module's summary: its nodes by op, its children, its GPU time."""
        tree = self.layout.tree
        ids = tree.nodes_under(path)
        ops: dict[str, int] = {}
        for i in ids:
            ops[self.graph[i].op] = ops.get(self.graph[i].op, 0) + 1
        lines = [f"module {path}", f"{len(ids)} nodes ({'opened' if path in self.opened else 'closed'}: "
                                   f"double-click to {'close' if path in self.opened else 'open'})"]
        kids = tree.children.get(path, [])
        if kids:
            lines.append(f"modules inside: {', '.join(module_label(k, path) for k in kids[:12])}"
                         + (" …" if len(kids) > 12 else ""))
        lines.append("ops: " + ", ".join(f"{op} ×{n}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1])))
        if self.heat is not None:
            ns = self.module_heat.get(path, 0)
            lines.append(f"GPU time (last step): {fmt_time(ns)}, {100 * self._share(ns):.1f}% of the step")
            top = sorted((i for i in ids if i in self.heat), key=lambda i: -self.heat[i])[:8]
            lines += [f"  %{i} {self.graph[i].op}: {fmt_time(self.heat[i])}" for i in top]
        text = "\n".join(lines)
        self.props.setPlainText(text)
        return text

    def show_properties(self, node_id: int) -> str:
        g = self.graph
        n = g[node_id]
        lines = [f"%{n.id}  {n.op}" + (f"   '{n.name}'" if n.name else ""),
                 f"archetype: {archetype(n.op)}",
                 f"shape: {list(n.shape)}   dtype: {n.dtype}",
                 f"bytes: {fmt_bytes(node_bytes(n))} ({node_bytes(n):,})",
                 f"module: {n.module or '(top level)'}"
                 + (f"  (from {', '.join(n.modules)})" if len(n.modules) > 1 else "")]
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
            lines += self._origin_lines(n.id)
        lines += self._dispatch_lines(n.id)
        text = "\n".join(lines)
        self.props.setPlainText(text)
        return text

    def _origin_lines(self, node_id: int) -> list[str]:
        origin = self.state.origins().get(node_id)
        original = self.state.graphs.get("original")
        if not origin:
            return []
        lines = [f"fuses {len(origin)} original node(s):"]
        for o in origin[:40]:
            if original is not None and 0 <= o < len(original.nodes):
                on = original[o]
                lines.append(f"  %{o} {on.op} {list(on.shape)}" + (f" '{on.name}'" if on.name else ""))
            else:
                lines.append(f"  %{o}")
        return lines

    def _dispatch_lines(self, node_id: int) -> list[str]:
        ds = self.state.dispatches_of(self.graph, node_id)
        if ds:
            p = self.state.profile.report
            lines = [f"dispatch: #{d['index']} {d['kernel']} ({d['gpu_ns'] / 1e3:,.1f} µs)" for d in ds]
            lines.append(f"last GPU time: {sum(d['gpu_ns'] for d in ds) / 1e3:,.1f} µs (step {p.steps - 1} of "
                         f"the last {'training' if p.train else 'inference'} profile, {p.mode})")
            return lines
        if self.state.profile is not None:
            return ["dispatch: none in the last profile (fused into another node's kernel, a view, or another graph)"]
        return ["dispatch / last GPU time: run the Profiler"]
