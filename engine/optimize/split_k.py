"""The ``split_k`` rule: a long-K matmul with few output tiles -> K-slices + a sum.

A weight gradient (dW = Xᵀ·dY: M x N = in x out, K = every token of the batch) has a
small output and a long reduction, so its matmul runs as a handful of workgroups that
each loop over all of K while most of the GPU idles (gpt-tiny: 36 to 144 tiles of 64 x
64 for 132 SMs, K = 2048). Both operands of such a matmul are stored K-major (Xᵀ is
read transposed), so cutting K into S slices is a reshape of each, a view: one batched
matmul computes the S partial products as S times more workgroups, and ``sum_to`` adds
them. Like ``pointwise_dag`` this is a graph pass after extraction (a choice of schedule
for the GPU, not an algebraic identity worth searching), named in rules.py and counted
in the report.
"""

from __future__ import annotations

from ..graph import Graph
from ..ops import TensorType

TILE = 64            # the output tile of the kernel such matmuls get (codegen.matmul_variant)
TARGET_TILES = 264   # two waves of workgroups on a 132-SM GPU
MIN_SLICE = 256      # no slice shorter than this: each still streams a useful length of K
MIN_K = 1024


def splits_for(m: int, n: int, k: int) -> int:
    """How many K-slices a [m, n] output with reduction length k gets (1: leave it)."""
    tiles = -(-m // TILE) * -(-n // TILE)
    s = 1
    while tiles * s < TARGET_TILES and k % (2 * s) == 0 and k // (2 * s) >= MIN_SLICE:
        s *= 2
    return s if k >= MIN_K else 1


def _split(g: Graph, node) -> int:
    """K-slices for ``node`` (1 when it is not a plain 2-D matmul with both operands K-major)."""
    a = node.attrs
    if node.op != "matmul" or not a.get("transpose_a") or a.get("transpose_b") or len(node.shape) != 2:
        return 1
    x, y = g[node.inputs[0]], g[node.inputs[1]]
    if len(x.shape) != 2 or len(y.shape) != 2:
        return 1
    k = x.shape[0]
    return splits_for(node.shape[0], node.shape[1], k)


def split_long_k(g: Graph, origins: dict[int, list[int]]):
    """Returns (new graph, new origins, ids in the new graph of the sums that replaced a
    matmul)."""
    if all(_split(g, n) == 1 for n in g.nodes):
        return g, origins, []
    out = Graph(g.name)
    out.param_meta = {k: dict(v) for k, v in g.param_meta.items()}
    remap, new_origins, made = {}, {}, []
    for n in g.nodes:
        s = _split(g, n)
        if n.op in ("input", "parameter", "constant"):
            nid = out._append(n.op, (), TensorType(n.shape, n.dtype), n.attrs, n.name)
            if n.id in g.constants:
                out.constants[nid] = g.constants[n.id]
        elif s > 1:
            (k, m), (_, cols) = g[n.inputs[0]].shape, g[n.inputs[1]].shape
            xs = out.reshape(remap[n.inputs[0]], (s, k // s, m))
            ys = out.reshape(remap[n.inputs[1]], (s, k // s, cols))
            part = out.matmul(xs, ys, transpose_a=True)
            nid = out.apply("sum_to", part, shape=n.shape, name=n.name)
            for i in (xs, ys, part, nid):
                new_origins[i] = list(origins.get(n.id, []))
            made.append(nid)
        else:
            nid = out.apply(n.op, *[remap[i] for i in n.inputs], name=n.name, **n.attrs)
        remap[n.id] = nid
        new_origins[nid] = list(origins.get(n.id, []))
    out.inputs = {k: remap[v] for k, v in g.inputs.items()}
    out.parameters = {k: remap[v] for k, v in g.parameters.items()}
    out.outputs = {k: remap[v] for k, v in g.outputs.items()}
    return out, new_origins, made
