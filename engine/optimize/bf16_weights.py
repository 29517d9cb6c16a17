"""Weights kept in bf16 for generation: half the bytes a decode step reads, exactly.

Most checkpoints on the Hub are stored in bf16, which the importer widens to f32. A decode
step reads every weight once and little else, so its time is the weights' bytes over the
memory bandwidth: kept as the bf16 they were, they are half the bytes, and the same
numbers (a bf16 value is an f32 whose lower 16 bits are zero). Kernels that read them
(the products, the embedding gather: ``codegen.reads_bf16``) widen each element as they
load it and compute in f32 as before, so the results are the f32 results, bit for bit.
Any other reader (none in the generation graphs of the importer's families) reads a
``widen`` of the weight, an f32 copy made in the step.

The caller chooses the weights (``bf16_candidates``: their values must all be bf16
values) and gives the predicate of the kernels that read bf16; this module knows no
kernels.

Weights may also be kept [out, in], as checkpoints store them (``keep_out_in``): the
importer lays a linear weight [in, out], so a one-row product's warps read a few bytes of
each of many rows; kept [out, in], each output's weights are one contiguous run that a
warp streams whole, and a decode step's products need no split of K (nor the dispatch
that adds the slices up). The graph says so before it is optimized, its products reading
the weights with ``transpose_b``, so every pass sees the layout (a prefill stacks the
weights as they are); the caller gives the session those weights transposed.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import numpy as np

from ..arrays import bf16_exact
from ..errors import GraphError
from ..graph.ir import Graph, Node
from ..graph.ops import TensorType, product_weights

ReadsBf16 = Callable[[Graph, Node, int], bool]


def bf16_candidates(params: Mapping[str, np.ndarray]) -> set[str]:
    """The weights that can be stored in bf16: matrices (of an even count, whole u32 words)
    whose values are all bf16 values, so that nothing is rounded."""
    return {name for name, value in params.items()
            if np.ndim(value) == 2 and np.size(value) % 2 == 0 and bf16_exact(value)}


def _reads_itself(graph: Graph, reader: int, weight: int, reads_bf16: ReadsBf16) -> bool:
    """Whether node ``reader`` reads node ``weight`` in bf16 wherever it is one of its operands."""
    return all(reads_bf16(graph, graph[reader], i) for i, x in enumerate(graph[reader].inputs) if x == weight)


def _readers(graph: Graph, users, node: int):
    """(reader, what it reads) for the readers of ``node``, through reshapes: a reshape of a
    bf16 weight is the same words (a view), so it is bf16 too and its readers read the weight."""
    for u in users[node]:
        if graph[u].op == "reshape":
            yield from _readers(graph, users, u)
        else:
            yield u, node


def _views(graph: Graph, users, node: int) -> set[int]:
    """The reshapes of ``node``, and theirs."""
    return {v for u in users[node] if graph[u].op == "reshape" for v in {u} | _views(graph, users, u)}


def direct_readers(graph: Graph, names: Iterable[str], reads_bf16: ReadsBf16) -> set[str]:
    """Those of parameters ``names`` that every reader in ``graph`` reads in bf16 itself: in
    a decode step, a weight a widen would copy on every step is better left in f32."""
    users = graph.users()
    return {name for name in names if name in graph.parameters
            and all(_reads_itself(graph, u, x, reads_bf16) for u, x in _readers(graph, users, graph.parameters[name]))}


def _reads_as_b(node: Node, weights: set[int]) -> bool:
    """Whether product ``node`` reads ``weights`` as its Bs only, and all its Bs are among
    them, none transposed: it can read them kept [out, in] with ``transpose_b``."""
    at = product_weights(node.op, len(node.inputs))
    return (bool(at) and not node.attrs.get("transpose_b", False) and all(node.inputs[j] in weights for j in at)
            and all(i in at for i, x in enumerate(node.inputs) if x in weights))


def transposable(graph: Graph, names: Iterable[str]) -> set[str]:
    """Those of 2-D parameters ``names`` that ``graph`` reads only as products' Bs, not
    transposed, and whose products' other Bs are among them (a product's Bs share one
    ``transpose_b``): the weights that can be kept [out, in]."""
    users = graph.users()
    ids = {graph.parameters[n]: n for n in names if n in graph.parameters and len(graph.shape(graph.parameters[n])) == 2}
    while True:   # a product whose other Bs are not kept so keeps all of its Bs as they are
        kept = set(ids)
        apart = {i for i in ids if not users[i] or not all(_reads_as_b(graph[u], kept) for u in users[i])}
        if not apart:
            return set(ids.values())
        ids = {i: n for i, n in ids.items() if i not in apart}


def keep_out_in(graph: Graph, names: Iterable[str]) -> Graph:
    """``graph`` with 2-D parameters ``names`` (``transposable`` there) kept [out, in]: each
    one's shape reversed (its name and meta kept), its products reading it with
    ``transpose_b``. Their values are then the transposes of the graph's own."""
    kept = {graph.parameters[n] for n in names if n in graph.parameters}
    if not kept:
        return graph
    users = graph.users()
    products = {u for p in kept for u in users[p]}
    if not all(_reads_as_b(graph[u], kept) for u in products):
        raise GraphError(f"{graph.name}: not every reader of {sorted(names)} is a product reading them as B")

    def stand_in(g: Graph, n: Node, remap: dict[int, int]):
        if n.id in kept:
            return g._append("parameter", (), TensorType(n.shape[::-1], n.dtype), n.attrs, n.name, n.modules)
        if n.id in products:
            return g._append(n.op, tuple(remap[i] for i in n.inputs), TensorType(n.shape, n.dtype),
                             {**n.attrs, "transpose_b": True}, n.name, n.modules)
        return None

    return graph.rebuild(stand_in=stand_in)[0]


def store_weights_bf16(graph: Graph, names: Iterable[str], reads_bf16: ReadsBf16) -> tuple[Graph, int]:
    """``graph`` with parameters ``names`` stored as bf16: readers that ``reads_bf16`` read
    them so, the others a ``widen`` of them (one per weight, made where first needed).
    Returns the graph and how many readers read a widen."""
    names = {n for n in names if n in graph.parameters}
    if not names:
        return graph, 0
    stored = {graph.parameters[n] for n in names}
    users = graph.users()
    views = {v for p in stored for v in _views(graph, users, p)}   # reshapes of them: bf16 as well
    widened = {u for p in stored for u, x in _readers(graph, users, p)
               if not _reads_itself(graph, u, x, reads_bf16)}   # old ids
    widen_of: dict[int, int] = {}

    def stand_in(g: Graph, n: Node, remap: dict[int, int]):
        if n.id in stored:
            return g._append("parameter", (), TensorType(n.shape, "bf16"), {}, n.name, n.modules)
        if n.id in views:
            return g._append(n.op, (remap[n.inputs[0]],), TensorType(n.shape, "bf16"), n.attrs, n.name, n.modules)
        if n.id not in widened:
            return None
        for x in n.inputs:
            if (x in stored or x in views) and x not in widen_of:
                widen_of[x] = g._append("widen", (remap[x],), TensorType(graph[x].shape), {}, f"{graph[x].name}:f32",
                                        n.modules)
        inputs = tuple(widen_of.get(x, remap[x]) for x in n.inputs)
        return g._append(n.op, inputs, TensorType(n.shape, n.dtype), n.attrs, n.name, n.modules)

    new, _ = graph.rebuild(stand_in=stand_in)
    return new, len(widened)
