"""Inference graphs: a convolution's activation applied as the convolution writes its result.

whisper's two convolutions are each followed by GELU, a pass of its own over the
convolution's output ([8, 384, 3000] and [8, 384, 1500] at batch 8 and 3000 frames: 34
and 18 us on the H100, run 44). The convolution's kernel applies it in its epilogue
instead (``activation`` on conv1d and conv2d, as on ``fused_matmul``). A training graph
keeps the convolution's own result, which the activation's gradient reads, so this pass
runs on inference graphs only; a convolution with an activation is differentiated by
decomposition, like any fused op.
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from ..graph.ops import ACTIVATION_OPS, entry_of

CONVOLUTIONS = ("conv1d", "conv2d")


def fold_conv_activations(graph: Graph) -> tuple[Graph, int, dict[int, int]]:
    """The graph with each convolution read only by an activation computing it, how many
    it folded and the old -> new node ids."""
    users, outputs = graph.users(), set(graph.outputs.values())
    folded: dict[int, tuple[int, str]] = {}   # activation node -> (its convolution, activation name)
    for n in graph.nodes:
        if n.op not in CONVOLUTIONS or n.attrs["activation"] != "none" or n.id in outputs or len(users[n.id]) != 1:
            continue
        reader = graph[users[n.id][0]]
        name = entry_of(ACTIVATION_OPS, reader)
        if name is not None:
            folded[reader.id] = (n.id, name)
    if not folded:
        return graph, 0, graph.identity()
    activated = {conv: name for conv, name in folded.values()}

    def stand_in(g: Graph, n: Node, new: dict[int, int]) -> int | None:
        if n.id in activated:
            with g.scope(n.modules):
                return g.apply(n.op, *(new[i] for i in n.inputs), name=n.name,
                               **{**n.attrs, "activation": activated[n.id]})
        if n.id in folded:
            return new[folded[n.id][0]]
        return None
    out, remap = graph.rebuild(stand_in=stand_in)
    return out, len(folded), remap
