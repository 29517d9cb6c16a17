"""Layout of an ``engine.Graph`` as nested module boxes, top to bottom (no Qt here).

A node remembers the module it came from (``Node.module``: ``model.layers.3.self_attn``),
so a graph is a tree of modules (``ModuleTree``). The view shows each module either
*closed*, one box, or *opened*, a frame holding its own nodes and its child modules
(``engine.graph.modules.containers`` says which modules a model opens on: the layer lists
and what leads to them, so a 30-layer Llama shows ``model.embed_tokens``,
``model.layers.0`` … ``model.layers.29``, ``model.norm`` and ``lm_head``).

How it is laid out (measured 2026-11-25 on this 2-core machine, SmolLM2-135M-shaped
Llama's optimized training graph: 2,151 nodes, 3,599 edges):

* One flat layout of every node took 12.6 s, even with the dummy budget below: every
  long edge (a parameter read again in the backward pass, a saved activation) gets a
  dummy vertex per layer it crosses. So each opened module is laid out on its own, as
  a small graph of its items (its own nodes, its child modules as boxes or frames of
  the size of *their* layout) and the edges between them, and the layouts are nested.
  A module's layout is cached by the modules opened inside it, so expanding a block
  lays out that block and re-places its ancestors (a few dozen items each); nothing
  else is computed again.
* Ranks are ours: items are ordered by their first computing node (a module's edges
  against that order, like a layer's gradient flowing back to the layer before it in a
  training graph, are laid out reversed and drawn as back edges), longest-path layers,
  then every item pulled down to just above its first user. grandalf orders each layer
  (crossing reduction) and places x (Brandes-Köpf) through a ``SugiyamaLayout`` whose
  ranking is replaced by ours; when the dummies of all edges exceed ``DUMMY_BUDGET``,
  edges spanning more than ``LONG_SPAN`` layers are left out of it (drawn dashed).
* Edges are drawn between the visible items holding their ends: a graph edge into a
  closed box ends at the box.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Union

from grandalf.graphs import Edge, Graph as GGraph, Vertex
from grandalf.layouts import Layer, SugiyamaLayout

from engine.graph.ir import common_module
from engine.graph.modules import ancestors, containers, parent_of
from engine.graph.ops import OPS, SOURCE

NODE_W, NODE_H = 160.0, 42.0
BOX_W, BOX_H = 230.0, 50.0
FRAME_W = 320.0                  # the least width of an opened module (room for its title)
X_SPACE, Y_SPACE = 26.0, 34.0
PAD, TITLE_H = 12.0, 28.0        # a frame's margin, and its title bar
COMPONENT_GAP = 50.0
DUMMY_BUDGET = 6000     # layer entries (dummies) grandalf handles in about a second here
LONG_SPAN = 4           # max layers an edge may span in the layout once over budget
FLAT_NODES = 40         # graphs this small open with every module expanded

Unit = Union[int, str]   # an item of a module's layout: a node id, or a child module's path


def child_toward(container: str, module: str) -> str:
    """The child of ``container`` on the way down to ``module`` (a descendant of it)."""
    rest = module[len(container) + 1:] if container else module
    head = rest.split(".", 1)[0]
    return f"{container}.{head}" if container else head


class ModuleTree:
    """The modules of a graph: each one's own nodes, child modules (in the order the graph
    first computes in them), node count, and the edges between the items of each."""

    def __init__(self, graph):
        self.graph = graph
        self.module_of = [n.module for n in graph.nodes]
        users = graph.users()
        outputs = set(graph.outputs.values())
        # constants nothing reads (fusion leaves the copies it merged): not drawn
        self.hidden = {n.id for n in graph.nodes if n.op == "constant" and not users[n.id] and n.id not in outputs}
        self.shared = self._place_shared_constants(users)
        self.own: dict[str, list[int]] = defaultdict(list)
        self.children: dict[str, list[str]] = defaultdict(list)
        self.count: Counter = Counter()
        first: dict[str, int] = {}
        first_source: dict[str, int] = {}
        for n in graph.nodes:
            if n.id in self.hidden:
                continue
            m = self.module_of[n.id]
            self.own[m].append(n.id)
            source = OPS[n.op].archetype == SOURCE if n.op in OPS else False
            for a in ancestors(m) + [m] if m else [""]:
                self.count[a] += 1
                table = first_source if source else first
                table.setdefault(a, n.id)
        self.key = {m: first.get(m, first_source.get(m, 0)) for m in self.count}
        # modules holding only sources (a weight whose matmul fused into the parent's kernel)
        self.sources_only = {m for m in self.count if m not in first}
        for m in self.count:
            if m:
                self.children[parent_of(m)].append(m)
        for kids in self.children.values():
            kids.sort(key=lambda m: self.key[m])
        self.edges: dict[str, set[tuple[Unit, Unit]]] = defaultdict(set)
        self.exits: dict[str, set[Unit]] = defaultdict(set)      # sources read outside their module
        self.source_ids = {n.id for n in graph.nodes if n.op in ("input", "parameter", "constant")}
        for n in graph.nodes:
            for s in set(n.inputs):
                if s not in self.shared or self.module_of[s] == self.module_of[n.id]:
                    self._add_edge(s, n.id)

    def _place_shared_constants(self, users) -> set[int]:
        """Fusion merges equal constants of many modules (a 0.5 every layer's gradient
        uses) into one node: drawn beside its first user, without edges to the others
        (they would join every layer to every other). Returns their ids."""
        shared = set()
        for n in self.graph.nodes:
            if n.op == "constant" and len(n.modules) > 1 and users[n.id]:
                self.module_of[n.id] = self.module_of[users[n.id][0]]
                shared.add(n.id)
        return shared

    def modules(self) -> list[str]:
        """Every module but the top level ('')."""
        return [m for m in self.count if m]

    def unit_in(self, nid: int, container: str) -> Unit:
        m = self.module_of[nid]
        return nid if m == container else child_toward(container, m)

    def _add_edge(self, s: int, d: int) -> None:
        ms, md = self.module_of[s], self.module_of[d]
        where = ms if ms == md else common_module((ms, md)) if ms and md else ""
        u, v = self.unit_in(s, where), self.unit_in(d, where)
        if u != v:
            self.edges[where].add((u, v))
        if s in self.source_ids:
            inner = ms
            while inner != where and inner:      # a weight leaves each module between its own and ``where``
                u = self.unit_in(s, inner)
                if isinstance(u, int) or u in self.sources_only:
                    self.exits[inner].add(u)
                inner = parent_of(inner)

    def items(self, container: str) -> list[Unit]:
        return list(self.own.get(container, ())) + list(self.children.get(container, ()))

    def default_open(self) -> set[str]:
        """Small graphs open completely (but for modules of weights alone: their op fused
        into the parent's kernel); others on their blocks (``containers``)."""
        if len(self.graph.nodes) <= FLAT_NODES:
            return set(self.count) - self.sources_only
        return containers(self.count) & set(self.count)

    def visible(self, nid: int, opened: set[str]) -> Unit:
        """The item that shows node ``nid``: itself, or the closed module holding it."""
        m = self.module_of[nid]
        if not m:
            return nid
        for a in ancestors(m)[1:] + [m]:
            if a not in opened:
                return a
        return nid

    def visible_module(self, module: str, opened: set[str]) -> str:
        """The box that shows ``module``: its first closed ancestor, else itself."""
        for a in ancestors(module)[1:]:
            if a not in opened:
                return a
        return module

    def nodes_under(self, module: str) -> list[int]:
        """Node ids of ``module`` and every module inside it."""
        prefix = module + "."
        return [i for i, m in enumerate(self.module_of) if m == module or m.startswith(prefix) or not module]


# ---------------------------------------------------------------- one module's layout

@dataclass
class Local:
    """One opened module's interior: item centres (relative to its top-left), sizes,
    edges between its items (bend points; cut = left out of the layout; back = against
    the reading order) and its extent."""

    pos: dict
    size: dict
    edges: dict                      # (u, v) -> (bends, cut, back)
    width: float
    height: float
    seconds: float = 0.0


class _View:
    __slots__ = ("w", "h", "xy")

    def __init__(self, w, h):
        self.w, self.h, self.xy = w, h, (0.0, 0.0)


class _FixedRankSugiyama(SugiyamaLayout):
    """grandalf's Sugiyama layout with the ranks given instead of computed."""

    def __init__(self, g, ranks: dict):
        super().__init__(g)
        self._ranks = ranks

    def rank_all(self, roots, optimize=False):
        self._edge_inverter()
        base = min(self._ranks[v.data] for v in self.g.sV)
        top = max(self._ranks[v.data] for v in self.g.sV)
        self.layers = [Layer([]) for _ in range(top - base + 1)]
        for v in self.g.sV:
            r = self._ranks[v.data] - base
            self.grx[v].rank = r
            self.layers[r].append(v)
        self._edge_inverter()


def rank_items(items: list, key: dict, edges, exits=()) -> tuple[dict, list, set]:
    """Longest-path ranks over ``edges`` turned to follow ``key`` order, each item then
    pulled down to just above its first user; a source only read outside (``exits``: a
    weight whose matmul was fused into the parent's kernel) goes to the bottom, where
    what reads it continues. Returns (rank, oriented edges, back pairs)."""
    oriented, back = set(), set()
    for u, v in edges:
        if key[u] <= key[v]:
            oriented.add((u, v))
        else:
            oriented.add((v, u))
            back.add((u, v))
    succ, pred = defaultdict(list), defaultdict(list)
    for u, v in oriented:
        succ[u].append(v)
        pred[v].append(u)
    order = sorted(items, key=lambda u: key[u])
    rank = {}
    for u in order:
        rank[u] = max((rank[p] + 1 for p in pred[u]), default=0)
    for u in reversed(order):
        if succ[u]:
            rank[u] = max(rank[u], min(rank[s] for s in succ[u]) - 1)
    bottom = max(rank.values(), default=0)
    for u in items:
        if not succ[u] and u in exits:
            rank[u] = bottom
    return rank, sorted(oriented, key=lambda e: (key[e[0]], key[e[1]])), back


def layout_items(items: list, size: dict, key: dict, edges, exits=()) -> Local:
    """A layered layout of ``items`` (each of ``size`` (w, h)) joined by ``edges``."""
    start = time.perf_counter()
    rank, oriented, back = rank_items(items, key, edges, exits)
    dummies = sum(max(0, rank[v] - rank[u] - 1) for u, v in oriented)
    max_span = None if dummies <= DUMMY_BUDGET else LONG_SPAN
    kept = [(u, v) for u, v in oriented if max_span is None or rank[v] - rank[u] <= max_span]
    top = max(rank.values(), default=0)
    heights = [0.0] * (top + 1)
    for u in items:
        heights[rank[u]] = max(heights[rank[u]], size[u][1])
    row_y, y = [], 0.0
    for h in heights:
        row_y.append(y + h / 2)
        y += h + Y_SPACE
    height = max(y - Y_SPACE, 0.0)

    verts = {u: Vertex(u) for u in items}
    for u, v in verts.items():
        v.view = _View(*size[u])
    gg = GGraph(list(verts.values()), [Edge(verts[u], verts[v]) for u, v in kept])
    xs: dict = {}
    bends: dict = {}
    x_cursor = 0.0
    for comp in sorted(gg.C, key=lambda c: (min(rank[v.data] for v in c.sV), -len(c.sV))):
        local, comp_bends = _place_component(comp, rank, row_y)
        lo = min(x - size[u][0] / 2 for u, x in local.items())
        hi = max(x + size[u][0] / 2 for u, x in local.items())
        shift = x_cursor - lo
        for u, x in local.items():
            xs[u] = x + shift
        for k, pts in comp_bends.items():
            bends[k] = [(x + shift, y) for x, y in pts]
        x_cursor += hi - lo + COMPONENT_GAP
    kept_set = set(kept)
    out_edges = {}
    for u, v in oriented:
        pair = (v, u) if (v, u) in back else (u, v)
        pts = bends.get((u, v), [])
        out_edges[pair] = (pts[::-1] if pair != (u, v) else pts, (u, v) not in kept_set, pair in back)
    pos = {u: (xs[u], row_y[rank[u]]) for u in items}
    width = max(x_cursor - COMPONENT_GAP, 0.0)
    return Local(pos, dict(size), out_edges, width, height, time.perf_counter() - start)


def _place_component(comp, rank: dict, row_y: list) -> tuple[dict, dict]:
    """x of each item of one connected component (grandalf), and the bend points of its long edges."""
    if len(comp.sV) == 1:
        return {comp.sV[0].data: 0.0}, {}
    sug = _FixedRankSugiyama(comp, rank)
    sug.xspace, sug.yspace = X_SPACE, Y_SPACE
    roots = [v for v in comp.sV if not v.e_in()]
    sug.init_all(roots=roots, inverted_edges=[])
    sug.draw(1 if len(comp.sV) > 300 else 2)
    local = {v.data: v.view.xy[0] for v in comp.sV}
    _separate(local, rank, {v.data: v.view.w for v in comp.sV})
    base = min(rank[v.data] for v in comp.sV)
    bends = {}
    for e, ctrl in sug.ctrls.items():
        r0, r1 = min(ctrl), max(ctrl)
        bends[(e.v[0].data, e.v[1].data)] = [(ctrl[r].view.xy[0], row_y[r + base])
                                             for r in sorted(ctrl) if r0 < r < r1]
    return local, bends


def _separate(xs: dict, rank: dict, width: dict) -> None:
    """grandalf averages four alignments, which can bring two items of a layer closer
    than their widths: push them apart (left to right), keeping the layer centred."""
    rows: dict[int, list] = defaultdict(list)
    for u in xs:
        rows[rank[u]].append(u)
    for ids in rows.values():
        if len(ids) < 2:
            continue
        ids.sort(key=lambda i: xs[i])
        before = sum(xs[i] for i in ids)
        for a, b in zip(ids, ids[1:]):
            gap = (width[a] + width[b]) / 2 + X_SPACE
            if xs[b] - xs[a] < gap:
                xs[b] = xs[a] + gap
        drift = (sum(xs[i] for i in ids) - before) / len(ids)
        for i in ids:
            xs[i] -= drift


# ---------------------------------------------------------------- the whole picture

@dataclass
class SceneLayout:
    """Absolute geometry of what is visible: node centres, closed module boxes and
    opened module frames (x, y, w, h of their top-left corner and size), and the edges
    between visible items (points from source to target, cut, back)."""

    nodes: dict[int, tuple[float, float]]
    boxes: dict[str, tuple[float, float, float, float]]
    frames: dict[str, tuple[float, float, float, float]]
    edges: list[tuple[Unit, Unit, list, bool, bool]]
    width: float
    height: float
    stats: dict = field(default_factory=dict)


class TreeLayout:
    """Lays out a graph's module tree for a set of opened modules, caching each module's
    interior by what is opened inside it."""

    def __init__(self, graph):
        start = time.perf_counter()
        self.tree = ModuleTree(graph)
        self.tree_seconds = time.perf_counter() - start
        self._local: dict = {}
        self.computed = 0            # module layouts computed (not found in the cache)

    def _signature(self, module: str, opened: set) -> tuple:
        return tuple((c, self._signature(c, opened)) for c in self.tree.children.get(module, ()) if c in opened)

    def _item_size(self, u: Unit, opened: set, sig: dict) -> tuple[float, float]:
        if isinstance(u, int):
            return NODE_W, NODE_H
        if u in opened:
            inner = self.local(u, opened, sig)
            return max(inner.width + 2 * PAD, FRAME_W), inner.height + TITLE_H + PAD
        return BOX_W, BOX_H

    def local(self, module: str, opened: set, sig: dict | None = None) -> Local:
        """The layout of an opened module's interior (cached)."""
        sig = sig if sig is not None else {}
        key = (module, sig.setdefault(module, self._signature(module, opened)))
        found = self._local.get(key)
        if found is not None:
            return found
        items = self.tree.items(module)
        size = {u: self._item_size(u, opened, sig) for u in items}
        keys = {u: (u if isinstance(u, int) else self.tree.key[u]) for u in items}
        lay = layout_items(items, size, keys, self.tree.edges.get(module, ()), self.tree.exits.get(module, ()))
        self._local[key] = lay
        self.computed += 1
        return lay

    def scene(self, opened: set) -> SceneLayout:
        """Absolute positions of every visible item with ``opened`` modules expanded
        (the top level always is)."""
        start, computed = time.perf_counter(), self.computed
        opened = set(opened) | {""}
        sig: dict = {}
        nodes, boxes, frames, routes = {}, {}, {}, {}
        stack = [("", 0.0, 0.0)]
        while stack:
            module, ox, oy = stack.pop()
            lay = self.local(module, opened, sig)
            for u, (x, y) in lay.pos.items():
                w, h = lay.size[u]
                cx, cy = ox + x, oy + y
                if isinstance(u, int):
                    nodes[u] = (cx, cy)
                elif u in opened:
                    frames[u] = (cx - w / 2, cy - h / 2, w, h)
                    inner = self.local(u, opened, sig)
                    stack.append((u, cx - inner.width / 2, cy - h / 2 + TITLE_H))
                else:
                    boxes[u] = (cx - w / 2, cy - h / 2, w, h)
            for pair, (pts, cut, back) in lay.edges.items():
                routes[pair] = ([(ox + x, oy + y) for x, y in pts], cut, back)
        root = self.local("", opened, sig)
        edges = self._visible_edges(opened, routes)
        stats = {"nodes": len(self.tree.graph.nodes), "visible": len(nodes) + len(boxes),
                 "boxes": len(boxes), "frames": len(frames), "edges": len(edges),
                 "layouts_computed": self.computed - computed, "seconds": time.perf_counter() - start}
        return SceneLayout(nodes, boxes, frames, edges, root.width, root.height, stats)

    def _visible_edges(self, opened: set, routes: dict) -> list:
        """One edge per pair of visible items that graph edges join; laid-out edges keep
        their bends, the others (ends in different frames) are drawn directly."""
        tree = self.tree
        vis = [tree.visible(i, opened) for i in range(len(tree.module_of))]
        pairs = {}
        for n in tree.graph.nodes:
            d = vis[n.id]
            for s in n.inputs:
                if s in tree.shared and tree.module_of[s] != tree.module_of[n.id]:
                    continue
                u = vis[s]
                if u != d and (u, d) not in pairs:
                    pts, cut, back = routes.get((u, d), ([], False, None))
                    if back is None:      # not laid out together: against the reading order?
                        back = self._key_of(u) > self._key_of(d)
                    pairs[(u, d)] = (u, d, pts, cut, back)
        return list(pairs.values())

    def _key_of(self, u: Unit) -> int:
        return u if isinstance(u, int) else self.tree.key[u]


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tree_layout(graph) -> TreeLayout:
    """The cached ``TreeLayout`` of ``graph`` (its module layouts survive switching views)."""
    try:
        return _CACHE[graph]
    except KeyError:
        pass
    lay = TreeLayout(graph)
    _CACHE[graph] = lay
    return lay


def fmt_seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"
