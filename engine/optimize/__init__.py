"""Kernel fusion by equality saturation (egglog) with a bytes-moved cost model.

``optimize(graph)`` translates the graph into egglog facts, runs the rules of
``rules.py`` to saturation under iteration, e-node and time limits, extracts the
cheapest equivalent graph with ``cost.py``'s model, groups elementwise DAGs into
pointwise nodes, and returns the new Graph with an ``OptimizeReport``.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from ..errors import GraphError
from ..graph.ir import Graph
from . import cost
from .report import OptimizeReport, where

__all__ = ["optimize", "OptimizeReport"]


def optimize(graph: Graph, *, max_iterations: int = 30, node_limit: int = 500_000,
             time_limit: float = 20.0, fuse_pointwise: bool = True) -> tuple[Graph, OptimizeReport]:
    """The fused equivalent of ``graph`` (same inputs, parameters, outputs, constants)."""
    from . import egraph, pointwise, rules   # egglog loads here, not with the package: a cached graph needs none of it
    if not graph.outputs:
        raise GraphError(f"graph {graph.name!r} has no outputs: nothing to optimize")
    t0 = time.perf_counter()
    phases = {}
    tr = egraph.Translation(graph)
    eg = egraph.load(tr)
    phases["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    stop, iterations, size, matches = egraph.saturate(eg, max_iterations, node_limit, time_limit)
    phases["saturate"] = time.perf_counter() - t
    t = time.perf_counter()
    classes, refs = egraph.read_egraph(eg)
    egraph.free(eg)
    del eg
    ex = egraph.Extractor(tr, classes, refs)
    ex.run()
    phases["extract"] = time.perf_counter() - t
    t = time.perf_counter()
    out, class_of_new = egraph.rebuild(graph, ex)
    origins = egraph.origins(graph, ex, class_of_new)
    applied, saved, produced = _attribute(graph, out, origins)
    applied["cse"], saved["cse"] = tr.cse_merged, sum(
        cost.graph_node_bytes(graph, n) for n in graph.nodes if tr.rep[n.id] != n.id)
    if fuse_pointwise:
        before, before_origins = out, origins
        out, origins, groups = pointwise.fuse_pointwise(out, origins)
        applied["pointwise_dag"] = len(groups)
        produced = _renumber(produced, before, before_origins, out, origins)
        produced["pointwise_dag"] = [n.id for n in out.nodes if n.op == "pointwise"]
        saved["pointwise_dag"] = sum(sum(cost.graph_node_bytes(before, before[m]) for m in members)
                                     for _, members in groups) - sum(
            cost.graph_node_bytes(out, n) for n in out.nodes if n.op == "pointwise")
    _keep_modules(graph, out, origins)
    phases["rebuild"] = time.perf_counter() - t
    bytes_before, disp_before = cost.graph_cost(graph)
    bytes_after, disp_after = cost.graph_cost(out)
    report = OptimizeReport(
        nodes_before=len(graph), nodes_after=len(out), dispatches_before=disp_before,
        dispatches_after=disp_after, bytes_before=bytes_before, bytes_after=bytes_after,
        rules={name: applied.get(name, 0) for name in rules.RULES},
        rule_bytes_saved={name: int(saved.get(name, 0)) for name in rules.RULES},
        matches={name: matches.get(name, 0) for name in rules.RULES if rules.RULES[name].in_egglog},
        saturated=stop == "saturated", stop_reason=stop, iterations=iterations, egraph_nodes=size,
        seconds=time.perf_counter() - t0, phase_seconds=phases, origins=origins,
        rule_nodes={name: sorted(ids) for name, ids in produced.items() if ids},
        rule_modules={name: dict(Counter(where(out[i]) for i in ids)) for name, ids in produced.items() if ids})
    return out, report


def _keep_modules(graph: Graph, out: Graph, origins: dict[int, list[int]]) -> None:
    """Each optimized node carries the modules of the original nodes it stands for."""
    for n in out.nodes:
        modules = {m for o in origins.get(n.id, ()) for m in graph[o].modules}
        if modules:
            out.set_modules(n.id, modules)


def _attribute(graph: Graph, out: Graph, origins: dict[int, list[int]]):
    """Per rule: applications in the result and the bytes they saved (a node's saving is
    shared evenly by the rules it embodies)."""
    from . import rules

    def const_value(i):
        c = graph.constants.get(i)
        return float(c) if c is not None and c.shape == () and c.dtype.kind == "f" else None

    applied, saved, produced = defaultdict(int), defaultdict(float), defaultdict(list)
    for n in out.nodes:
        src = [graph[i] for i in origins.get(n.id, [])]
        if len(src) <= 1:
            continue
        own = next((s for s in src if s.op == n.op), None)
        absorbed = [s for s in src if s is not own]
        names = rules.applied_rules(n.op, n.attrs, absorbed, const_value)
        if not names:
            continue
        gain = sum(cost.graph_node_bytes(graph, s) for s in src) - cost.graph_node_bytes(out, n)
        for name in names:
            applied[name] += 1
            saved[name] += gain / len(names)
            produced[name].append(n.id)
    return applied, saved, produced


def _renumber(produced: dict[str, list[int]], before: Graph, before_origins: dict[int, list[int]],
              after: Graph, after_origins: dict[int, list[int]]) -> dict[str, list[int]]:
    """Node ids of ``before`` -> the ids of the ``after`` nodes holding them (the same
    node, or the pointwise group that absorbed it), matched by their original nodes."""
    holders: dict[int, list[int]] = defaultdict(list)
    for nid, srcs in after_origins.items():
        for o in srcs:
            holders[o].append(nid)

    def find(b: int) -> int | None:
        srcs = before_origins.get(b) or []
        cands = [c for c in dict.fromkeys(h for o in srcs for h in holders.get(o, ()))
                 if set(srcs) <= set(after_origins.get(c, ()))]
        same = [c for c in cands if after[c].op == before[b].op]
        return (same or cands or [None])[0]

    out: dict[str, list[int]] = {}
    for name, ids in produced.items():
        out[name] = sorted({c for c in map(find, ids) if c is not None})
    return out
