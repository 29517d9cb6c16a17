"""Kernels of a decode step that do a neighbour's work, so that its dispatch and the wait
before the next one go, or its work spreads over the GPU: the cached attention writes the
step's keys and values into the cache it reads, the one-row product reading a split
attention's value combines its parts, and the LM head's workgroups leave the argmax
their best. What costs a decode step is its chain of dispatches and waits (run 53: a
Llama-3.2-1B step left without its cache writes ran at 547 tokens/s, without its
combines at 548, with both at 530). The plan (``engine.compile.plan``) dispatches what
these find; codegen says where a kernel can; ``MEGANEURA_DECODE_FOLDS=0`` finds none.
"""

from __future__ import annotations

from .. import codegen
from ..graph.ir import Graph


def cache_writes_in_attention(g: Graph, caps: codegen.Capabilities,
                              order: list) -> dict[int, tuple[int, codegen.Kernel]]:
    """A decode step's ``cache_write`` done by the cached attention that reads the cache
    through it (codegen's ``cached_attention_writing``): its keys and values plane views
    read by that attention alone. Returns attention -> (the cache_write, the attention's kernel)."""
    if not caps.knobs.decode_folds:
        return {}
    users = g.users()
    found: dict[int, tuple[int, codegen.Kernel]] = {}
    for n in order:
        if n.op != "cached_attention":
            continue
        w = g[g[n.inputs[1]].inputs[0]] if g[n.inputs[1]].op == "part" else None
        if w is None or w.op != "cache_write":
            continue
        views = [g[i] for i in n.inputs[1:3]]
        plane = w.size // 2
        if (any(v.op != "part" or v.inputs[0] != w.id or v.size != plane for v in views)
                or [v.attrs["offset"] for v in views] != [0, plane]
                or sorted(users[w.id]) != sorted(v.id for v in views) or any(users[v.id] != [n.id] for v in views)):
            continue
        kernel = codegen.cached_attention_writing(g, n, w, caps)
        if kernel is not None:
            found[n.id] = (w.id, kernel)
    return found


def combines_in_products(g: Graph, caps: codegen.Capabilities,
                         order: list) -> dict[int, tuple[int, codegen.Kernel]]:
    """A split cached attention's combine done by the one-row product that alone reads its
    value (codegen's ``product_combining``: a decode step's o projection), which reads the
    parts in its A's place, so the value is never stored. Returns attention -> (the product,
    its kernel)."""
    if not caps.knobs.decode_folds:
        return {}
    users, outputs = g.users(), set(g.outputs.values())
    found: dict[int, tuple[int, codegen.Kernel]] = {}
    for n in order:
        if n.op != "cached_attention" or n.id in outputs or len(users[n.id]) != 1:
            continue
        count, head_dim = codegen.cached_attention_parts(g, n)
        p = g[users[n.id][0]]
        if count < 2 or p.inputs[0] != n.id or n.id in p.inputs[1:]:
            continue
        kernel = codegen.product_combining(g, p, count, head_dim, caps)
        if kernel is not None:
            found[n.id] = (p.id, kernel)
    return found


def argmax_from_products(g: Graph, caps: codegen.Capabilities,
                         order: list) -> dict[int, tuple[int, codegen.Kernel, codegen.Kernel]]:
    """An argmax of a one-row product's value (a decode step's next id from its LM head)
    that reads the best value each of the product's workgroups leaves (codegen's
    ``product_with_argmax``), not the row: one workgroup read 128,256 logits in 47 us (run
    52), where the LM head's 16,032 workgroups each had eight in hand. Returns argmax ->
    (the product, its kernel, the argmax's kernel)."""
    if not caps.knobs.decode_folds:
        return {}
    found: dict[int, tuple[int, codegen.Kernel, codegen.Kernel]] = {}
    for n in order:
        p = g[n.inputs[0]] if n.op == "argmax" else None
        if p is None or p.size != p.shape[-1]:   # one row, the product's own value
            continue
        kernel = codegen.product_with_argmax(g, p, caps)
        if kernel is not None:
            found[n.id] = (p.id, kernel, codegen.argmax_of_partials(g, n, kernel.workgroups[0], caps))
    return found
