"""Fusions for graphs whose products have a few rows: a generation's decode step, where every
dispatch is small and the count of dispatches, not the bytes, sets the time.

Run after ``optimize`` (its extraction weighs bytes, and these change few): a decode step of
a 30-layer Llama went from 13 dispatches a layer to 7 with them (8 where the cached attention is split;
the plan then folds the cache write and the combine into their neighbours, engine.compile.decode_folds: 5).

- ``norm_matmul_shared``: an RMS norm read only by matmuls (as their left operand) moves
  into each one's prologue; with one row the norm costs each matmul a few hundred reads.
  (``optimize`` fuses a norm read by a single matmul already.)
- ``norm_matmuls``: those matmuls of one norm (a layer's q, k and v projections) then run
  as one kernel, ``norm_matmuls``, whose packed result ``part`` views pick apart: two
  dispatches fewer a layer, where each dispatch costs the GPU some 4 us of its own.
- ``swiglu_matmul``: silu(x @ w_gate) * (x @ w_up), two matmuls and their product,
  becomes one kernel, with x's RMS norm too where only those two read it.
"""

from __future__ import annotations

import math
from collections import Counter

from ..graph.ir import Graph, Node
from ..graph.ops import norm_matmuls_layout

FEW_ROWS = 4   # rows of a product these apply to (the swiglu kernel's two accumulators fit up to 4)


def fuse_few_rows(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """The graph with the fusions above applied, and how often each applied."""
    users = graph.users()
    outputs = set(graph.outputs.values())
    rewrite: dict[int, tuple[str, tuple[int, ...], dict]] = {}
    counts: Counter = Counter()
    for n in graph.nodes:
        if n.op == "mul" and (found := _swiglu(graph, n, users, outputs)):
            rewrite[n.id] = found
            counts["swiglu_matmul"] += 1
    packs: dict[int, list[int]] = {}   # the first of a norm's matmuls -> all of them, one norm_matmuls
    for n in graph.nodes:
        if n.op == "rms_norm" and _few(n) and n.id not in outputs and _only_matmuls_read(graph, n, users[n.id]):
            x, w = n.inputs
            readers = sorted(u for u in set(users[n.id]) if u not in rewrite)
            for u in readers:
                b = graph[u].inputs[1]
                rewrite[u] = ("norm_matmul", (x, w, b),
                              {"eps": n.attrs["eps"], "transpose_b": graph[u].attrs["transpose_b"]})
                counts["norm_matmul_shared"] += 1
            group = [u for u in readers if graph[u].attrs["transpose_b"] == graph[readers[0]].attrs["transpose_b"]]
            if len(group) > 1 and all(graph[u].inputs[1] < group[0] for u in group):
                packs[group[0]] = group
                counts["norm_matmuls"] += 1
    if not rewrite:
        return graph, {}

    def stand_in(g: Graph, n: Node, new: dict[int, int]) -> int | None:
        if n.id in packs:
            return _pack(graph, g, packs[n.id], [rewrite[u] for u in packs[n.id]], new)
        if n.id not in rewrite:
            return None
        op, inputs, attrs = rewrite[n.id]
        with g.scope(n.modules):
            made = g.apply(op, *(new[i] for i in inputs), name=n.name, **attrs)
        assert g.shape(made) == n.shape, (op, g.shape(made), n.shape)
        return made
    return graph.rebuild(stand_in=stand_in)[0].prune()[0], dict(counts)


def _few(n: Node) -> bool:
    return math.prod(n.shape[:-1]) <= FEW_ROWS


def _plain_matmul(n: Node) -> bool:
    return n.op == "matmul" and not n.attrs["transpose_a"]


def _only_matmuls_read(graph: Graph, norm: Node, readers: list[int]) -> bool:
    return bool(readers) and all(_plain_matmul(graph[u]) and graph[u].inputs[0] == norm.id
                                 and graph[u].inputs[1] != norm.id for u in readers)


def _swiglu(graph: Graph, mul: Node, users, outputs) -> tuple[str, tuple[int, ...], dict] | None:
    """mul(fused_matmul(x, wg, silu), matmul(x, wu)) (either order), each product read by the
    mul alone; with x = rms_norm(h, w) read by those two alone, the norm is taken in."""
    if len(set(mul.inputs)) != 2:
        return None
    for gate_id, up_id in (mul.inputs, mul.inputs[::-1]):
        gate, up = graph[gate_id], graph[up_id]
        if not (gate.op == "fused_matmul" and gate.attrs["activation"] == "silu" and not gate.attrs["has_add"]
                and not gate.attrs["has_residual"] and gate.attrs["gradient_of"] == "none"
                and not gate.attrs["transpose_a"] and _plain_matmul(up)):
            continue
        x, tb = gate.inputs[0], gate.attrs["transpose_b"]
        if up.inputs[0] != x or up.attrs["transpose_b"] != tb or not _few(graph[x]):
            continue
        if any(users[i] != [mul.id] or i in outputs for i in (gate_id, up_id)):
            continue
        norm = graph[x]
        if norm.op == "rms_norm" and sorted(users[x]) == sorted((gate_id, up_id)) and x not in outputs:
            return "swiglu_matmul", (norm.inputs[0], gate.inputs[1], up.inputs[1], norm.inputs[1]), \
                {"eps": norm.attrs["eps"], "transpose_b": tb}
        return "swiglu_matmul", (x, gate.inputs[1], up.inputs[1]), {"transpose_b": tb}
    return None


def _pack(graph: Graph, g: Graph, group: list[int], products, new: dict[int, int]) -> int:
    """One norm_matmuls in ``g`` for the matmuls ``group`` of ``graph`` (their norm_matmul
    rewrites ``products``: one x, norm weight, eps and transpose_b; each weight made before
    the group's first node), and a ``part`` of it for each, with its name; returns the first's."""
    (x, norm_weight, _), attrs = products[0][1], products[0][2]
    weights = [inputs[2] for _, inputs, _ in products]
    with g.scope([m for u in group for m in graph[u].modules]):
        packed = g.apply("norm_matmuls", new[x], new[norm_weight], *(new[w] for w in weights), **attrs)
    _, offsets, _ = norm_matmuls_layout(graph[x].shape, [graph[w].shape for w in weights], attrs["transpose_b"])
    for u, at in zip(group, offsets):
        with g.scope(graph[u].modules):
            new[u] = g.apply("part", packed, offset=at, shape=graph[u].shape, name=graph[u].name)
    return new[group[0]]
