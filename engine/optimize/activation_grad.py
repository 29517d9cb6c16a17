"""Training graphs: an activation's gradient applied by the product that computes the
gradient arriving at it.

Through an activation after a product (whisper's fc1 with GELU), autodiff's gradient is
``gelu_grad(d, h)``: d, the gradient at the activation's output, is itself a product (the
next layer's input gradient, dY @ W2ᵀ), written in full and read back with h by a pass of
its own over tensors of the hidden size (whisper-tiny at batch 8: [12000, 1536], 83 us a
layer on the H100). This pass makes that product a ``fused_matmul`` whose epilogue applies
the gradient (``gradient_of``, h its last operand): d is never written.

Run after autodiff, the training graph's ``optimize`` and the passes that stack products
(which take only epilogues that add).
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from ..graph.ops import GRADIENT_OF, entry_of


def _fold(graph: Graph, n: Node, users: list[list[int]], outputs: set[int]) -> tuple[int, int, str] | None:
    """(product, activation input, ``gradient_of``) of an activation gradient this pass
    folds, or None: its first operand a product read by it alone and not an output (a
    ``matmul``, or a ``fused_matmul`` without a gradient of its own), the activation input
    of the product's shape."""
    gradient = entry_of(GRADIENT_OF, n)   # the activation whose gradient op n is
    if gradient is None:
        return None
    d, h = graph[n.inputs[0]], graph[n.inputs[1]]
    if not (d.op == "matmul" or (d.op == "fused_matmul" and d.attrs["gradient_of"] == "none")):
        return None
    if users[d.id] != [n.id] or d.id in outputs or h.shape != d.shape or not h.dtype == d.dtype == "f32":
        return None
    return d.id, h.id, gradient


def fold_activation_gradients(graph: Graph) -> tuple[Graph, int, dict[int, int]]:
    """The graph with each such gradient made by its product, how many it folded and the
    old -> new node ids."""
    users, outputs = graph.users(), set(graph.outputs.values())
    folds = {n.id: found for n in graph.nodes if (found := _fold(graph, n, users, outputs))}
    if not folds:
        return graph, 0, graph.identity()
    absorbed = {product for product, _, _ in folds.values()}

    def stand_in(g: Graph, n: Node, new: dict[int, int]) -> int | None:
        if n.id not in folds:
            return None
        product, h, gradient = folds[n.id]
        p = graph[product]
        with g.scope(p.modules):   # a matmul's attributes are its transposes
            return g.apply("fused_matmul", *(new[i] for i in p.inputs), new[h], name=n.name,
                           **dict(p.attrs, gradient_of=gradient))
    out, remap = graph.rebuild(keep=lambda n: n.id not in absorbed, stand_in=stand_in)
    remap.update({product: remap[grad] for grad, (product, _, _) in folds.items()})
    return out, len(folds), remap
