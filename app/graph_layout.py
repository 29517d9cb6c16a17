"""Top-to-bottom DAG layout of an ``engine.Graph`` with grandalf (no Qt here).

How it is laid out (measured 2026-11-22 on this 2-core machine):

* Plain grandalf (``SugiyamaLayout.init_all(); draw()``) on a whole training graph
  spends almost all its time on *dummy vertices*: every long edge (a parameter read
  again in the backward pass, a saved activation) gets one dummy per layer it
  crosses. audio-align's training graph (1,001 nodes) grew 68,970 layer entries and
  took 11.4 s; whisper-tiny's (693 nodes) 4.1 s.
* So ranks are ours: longest-path layering, then every node is pulled down to just
  above its first user (sources sit next to what reads them). Edges spanning at
  most ``max_span`` layers are laid out by grandalf (its crossing-reducing ordering
  and Brandes-Köpf x coordinates) through a ``SugiyamaLayout`` whose ranking is
  replaced by ours; longer edges are left out of the layout (and drawn as light
  curves by the view). When the dummies of all edges fit in ``DUMMY_BUDGET`` nothing
  is left out. What that cut leaves disconnected (``Graph.C``) is laid out per
  component and the components are put side by side; y always comes from the
  global rank, so components never overlap.
* Layouts are cached per graph object (``layout_graph`` looks the graph up in a
  weak dictionary), so switching views back and forth costs nothing.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from grandalf.graphs import Edge, Graph as GGraph, Vertex
from grandalf.layouts import Layer, SugiyamaLayout

NODE_W, NODE_H = 150.0, 40.0
X_SPACE, Y_SPACE = 24.0, 36.0
COMPONENT_GAP = 60.0
DUMMY_BUDGET = 6000     # layer entries (dummies) grandalf handles in about a second here
LONG_SPAN = 4           # max layers an edge may span in the layout once over budget


class _View:
    __slots__ = ("w", "h", "xy")

    def __init__(self, w=NODE_W, h=NODE_H):
        self.w, self.h, self.xy = w, h, (0.0, 0.0)


class _FixedRankSugiyama(SugiyamaLayout):
    """grandalf's Sugiyama layout with the ranks given instead of computed."""

    def __init__(self, g, ranks: dict[int, int]):
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


@dataclass
class Layout:
    """Node centres, edges (with bend points for laid-out long edges) and stats."""

    pos: dict[int, tuple[float, float]]
    edges: list[tuple[int, int, list[tuple[float, float]], bool]]   # src, dst, bends, cut
    width: float
    height: float
    stats: dict = field(default_factory=dict)


def ranks_of(graph) -> list[int]:
    """Longest-path layers, then each node moved down to just above its first user."""
    rank = [0] * len(graph.nodes)
    for n in graph.nodes:
        if n.inputs:
            rank[n.id] = max(rank[i] for i in n.inputs) + 1
    users = graph.users()
    for n in reversed(graph.nodes):
        if users[n.id]:
            rank[n.id] = max(rank[n.id], min(rank[u] for u in users[n.id]) - 1)
    return rank


def compute_layout(graph, dummy_budget: int = DUMMY_BUDGET, long_span: int = LONG_SPAN) -> Layout:
    start = time.perf_counter()
    rank = ranks_of(graph)
    pairs = sorted({(i, n.id) for n in graph.nodes for i in n.inputs})
    dummies = sum(max(0, rank[d] - rank[s] - 1) for s, d in pairs)
    max_span = None if dummies <= dummy_budget else long_span
    kept = [(s, d) for s, d in pairs if max_span is None or rank[d] - rank[s] <= max_span]
    kept_set = set(kept)

    verts = [Vertex(n.id) for n in graph.nodes]
    for v in verts:
        v.view = _View()
    gg = GGraph(verts, [Edge(verts[s], verts[d]) for s, d in kept])
    pos: dict[int, tuple[float, float]] = {}
    bends: dict[tuple[int, int], list[tuple[float, float]]] = {}
    row = NODE_H + Y_SPACE
    components = sorted(gg.C, key=lambda c: (min(rank[v.data] for v in c.sV), -len(c.sV)))
    x_cursor = 0.0
    for comp in components:
        if len(comp.sV) == 1:
            v = comp.sV[0]
            local = {v.data: 0.0}
            comp_bends = {}
        else:
            sug = _FixedRankSugiyama(comp, rank)
            sug.xspace, sug.yspace = X_SPACE, Y_SPACE
            sug.init_all()
            sug.draw(1 if len(comp.sV) > 300 else 2)
            local = {v.data: v.view.xy[0] for v in comp.sV}
            _separate(local, rank)
            comp_bends = {}
            base = min(rank[v.data] for v in comp.sV)
            for e, ctrl in sug.ctrls.items():
                r0, r1 = min(ctrl), max(ctrl)
                comp_bends[(e.v[0].data, e.v[1].data)] = [
                    (ctrl[r].view.xy[0], (r + base) * row) for r in sorted(ctrl) if r0 < r < r1]
        lo = min(local.values()) - NODE_W / 2
        hi = max(local.values()) + NODE_W / 2
        shift = x_cursor - lo
        for nid, x in local.items():
            pos[nid] = (x + shift, rank[nid] * row)
        for key, pts in comp_bends.items():
            bends[key] = [(x + shift, y) for x, y in pts]
        x_cursor += (hi - lo) + COMPONENT_GAP
    edges = [(s, d, bends.get((s, d), []), (s, d) not in kept_set) for s, d in pairs]
    width = max(x_cursor - COMPONENT_GAP, NODE_W)
    height = (max(rank, default=0) + 1) * row
    stats = {"nodes": len(graph.nodes), "edges": len(pairs), "dummies_all_edges": dummies,
             "max_span": max_span, "cut_edges": len(pairs) - len(kept),
             "components": len(components), "seconds": time.perf_counter() - start}
    return Layout(pos, edges, width, height, stats)


def _separate(xs: dict[int, float], rank: list[int]) -> None:
    """grandalf averages four alignments, which can bring two nodes of a layer closer
    than their width: push them apart (left to right), keeping the layer centred."""
    rows: dict[int, list[int]] = {}
    for nid in xs:
        rows.setdefault(rank[nid], []).append(nid)
    step = NODE_W + X_SPACE
    for ids in rows.values():
        if len(ids) < 2:
            continue
        ids.sort(key=lambda i: xs[i])
        before = sum(xs[i] for i in ids)
        for a, b in zip(ids, ids[1:]):
            if xs[b] - xs[a] < step:
                xs[b] = xs[a] + step
        drift = (sum(xs[i] for i in ids) - before) / len(ids)
        if drift:
            for i in ids:
                xs[i] -= drift


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layout_graph(graph) -> Layout:
    """The cached layout of ``graph`` (computed on first use)."""
    try:
        return _CACHE[graph]
    except KeyError:
        pass
    lay = compute_layout(graph)
    _CACHE[graph] = lay
    return lay
