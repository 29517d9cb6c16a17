"""Training graphs: a product computed once, not once with its activation and once without.

The forward fuses a layer's activation into its product (``fused_matmul`` with
``activation``, e.g. whisper's fc1 with GELU). Autodiff then needs the pre-activation h
for the activation's gradient (``gelu_grad(h, d)``); the fused node does not keep it, so
the gradient rule builds the product again, which the training graph's ``optimize``
fuses into a second ``fused_matmul`` without the activation: the same matmul twice. For
whisper-tiny's fc1 at batch 8 that is a [12000, 384] x [384, 1536] product per layer and
step. This pass keeps the one without the activation and applies the activation to its
result as a pointwise node: a pass over the result instead of a second product.

Run after autodiff and the training graph's ``optimize``.
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from ..graph.ops import ACTIVATION_OPS


def _product_key(n: Node) -> tuple:
    """What a product computes before any activation: its operands, transposes and bias
    (a ``matmul``, or a ``fused_matmul`` with a bias and no residual)."""
    return n.inputs, n.attrs["transpose_a"], n.attrs["transpose_b"]


def _plain(n: Node) -> bool:
    return n.op == "matmul" or (n.op == "fused_matmul" and n.attrs["activation"] == "none"
                                and not n.attrs["has_residual"] and n.attrs["gradient_of"] == "none")


def _activated(n: Node) -> bool:
    return (n.op == "fused_matmul" and n.attrs["activation"] != "none" and not n.attrs["has_residual"]
            and n.attrs["gradient_of"] == "none")


def reuse_preactivations(graph: Graph) -> tuple[Graph, int, dict[int, int]]:
    """The graph with each activated product that is also computed without its activation
    made from that one, how many it rewrote and the old -> new node ids."""
    plain = {_product_key(n): n.id for n in graph.nodes if _plain(n)}
    twins = {n.id: plain[_product_key(n)] for n in graph.nodes if _activated(n) and _product_key(n) in plain}
    if not twins:
        return graph, 0, graph.identity()

    def stand_in(g: Graph, n: Node, new: dict[int, int]) -> int | None:
        if n.id not in twins:
            return None
        h = graph[twins[n.id]]
        if h.id not in new:   # the plain product comes later in the graph: build it here, once
            with g.scope(h.modules):
                new[h.id] = g.apply(h.op, *(new[i] for i in h.inputs), name=h.name, **h.attrs)
        op, attrs = ACTIVATION_OPS[n.attrs["activation"]]
        with g.scope(n.modules):
            made = g.apply(op, new[h.id], **attrs)
        assert g.shape(made) == n.shape
        return made
    out, remap = graph.rebuild(stand_in=stand_in)
    return out, len(twins), remap
