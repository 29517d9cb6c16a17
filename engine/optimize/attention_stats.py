"""Training graphs: attention's forward keeps the statistics its backward needs.

FlashAttention-2's backward recomputes P = exp(s - L) from each row's log-sum-exp L of
the scores. Autodiff asks for L with an ``attention_lse`` node, a kernel that passes
over every score once more (0.91 ms a layer of whisper-tiny at batch 8 on the H100, a
fifth of the forward's time again). The forward has L in hand at its end; this pass
makes it write L beside its result: each ``attention`` with an ``attention_lse`` of the
same q, k and attributes becomes one ``attention_stats`` node (both packed flat,
``attention_stats_layout``) and two zero-copy ``part`` views, one standing for the
attention's result, the other for the ``attention_lse``.

Run after autodiff and the training graph's ``optimize`` (egglog knows neither op).
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from ..graph.ops import attention_stats_layout


def _key(n: Node) -> tuple:
    q, k = n.inputs[:2]
    return q, k, tuple(sorted(n.attrs.items()))


def share_attention_statistics(graph: Graph) -> tuple[Graph, int, dict[int, int]]:
    """The graph with every attention whose log-sum-exp is also computed apart computing
    both at once, how many it rewrote and the old -> new node ids."""
    lse_nodes: dict[tuple, list[int]] = {}
    for n in graph.nodes:
        if n.op == "attention_lse":
            lse_nodes.setdefault(_key(n), []).append(n.id)
    pairs = {n.id: lse_nodes.pop(_key(n)) for n in graph.nodes if n.op == "attention" and _key(n) in lse_nodes}
    if not pairs:
        return graph, 0, graph.identity()

    def stand_in(g: Graph, n: Node, new: dict[int, int]) -> int | None:
        if n.id not in pairs:
            return None
        with g.scope(n.modules):
            packed = g.apply("attention_stats", *(new[i] for i in n.inputs), **n.attrs)
            (out_at, lse_at), _ = attention_stats_layout(n.shape, n.attrs["num_heads"])
            for lse in pairs[n.id]:   # the attention_lse nodes the forward now writes
                new[lse] = g.apply("part", packed, offset=lse_at, shape=graph[lse].shape, name=graph[lse].name)
            return g.apply("part", packed, offset=out_at, shape=n.shape, name=n.name)
    out, remap = graph.rebuild(stand_in=stand_in)
    return out, len(pairs), remap
