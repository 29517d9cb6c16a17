"""Building the two graphs of cached generation from a causal model's own modules.

A generation graph carries a ``KVCache`` (``graph.kv_cache``): the i32 input
``positions`` [batch, seq] of this call's tokens and, per attention layer in build
order, a cache parameter ``kv_cache.N`` [2, batch, capacity, kv_heads*dim] (keys, then
values) that one ``cache_write`` fills in place and that is an output of the graph (so
nothing prunes the write); attention reads its two planes as ``part`` views. The
capacity is a multiple of PART_ALIGN rows, so the values' plane starts where a view
may. The prefill graph runs the prompt (positions 0..P-1) with ordinary causal
attention on its fresh keys, and takes the logits of the row its i32 input ``last``
[1, 1] names: a prompt padded at its end (so that prompts of nearby lengths share one
compiled prefill) ends before the padding. The decode graph runs one token and attends
over the cache. Both name the same cache parameters, so a decode session shares the
prefill's buffers.

Modules call the functions below instead of ``Graph.attention``/``rope`` directly; on
a graph without a cache they build exactly what they built before.
"""

from __future__ import annotations

import math

from ..errors import GraphError
from .ir import Graph
from .ops import PART_ALIGN

CACHE_PREFIX = "kv_cache."
NEXT_ID = "next_id"
LAST = "last"


class KVCache:
    """The generation state of a graph being built. In a decode graph RoPE is not a node
    of its own: ``rotary`` leaves q and k as they are and notes (``pending``) the rotation
    that ``cache_write`` and ``cached_attention`` then apply as they read them, saving a
    decode step two dispatches a layer."""

    def __init__(self, positions: int, capacity: int, prefill: bool, last: int | None = None):
        self.positions, self.prefill, self.last = positions, bool(prefill), last
        self.capacity = -(-int(capacity) // PART_ALIGN) * PART_ALIGN
        self.layers = 0
        self.pending: dict[int, tuple[int, float, tuple]] = {}   # node -> (heads, base, scaling) of its deferred rope

    def rotary(self, g: Graph, x: int, num_heads: int, base: float, scaling: tuple = ()) -> int:
        if self.prefill:
            return g.rope(x, num_heads, base=base, positions=self.positions, scaling=scaling)
        self.pending[x] = (int(num_heads), float(base), tuple(scaling))
        return x

    def attend(self, g: Graph, q: int, k: int, v: int, num_heads: int, num_kv_heads: int | None,
               scale: float | None) -> int:
        batch, _, width = g.shape(k)
        heads, base, scaling = self.pending.pop(k, (0, 10000.0, ()))
        q_rope = self.pending.pop(q, None)
        name = f"{CACHE_PREFIX}{self.layers}"
        plane = (batch, self.capacity, width)
        cache = g.parameter(name, (2, *plane), trainable=False, decay=False)
        written = g.output(name, g.cache_write(cache, [k, v], self.positions, heads, base, scaling))
        self.layers += 1
        if self.prefill:
            return g.attention(q, k, v, num_heads, num_kv_heads=num_kv_heads, causal=True, scale=scale)
        keys, values = (g.apply("part", written, offset=i * math.prod(plane), shape=plane) for i in range(2))
        return g.cached_attention(q, keys, values, self.positions, num_heads, num_kv_heads, scale,
                                  rope=q_rope is not None, rope_base=q_rope[1] if q_rope else 10000.0,
                                  rope_scaling=q_rope[2] if q_rope else ())

    def finish(self) -> None:
        if self.pending:
            raise GraphError(f"a decode graph rotated nodes {sorted(self.pending)} by RoPE without attending over "
                             f"them; only q and k of self_attention can defer their rotation")


def cache_of(g: Graph) -> KVCache | None:
    return getattr(g, "kv_cache", None)


def self_attention(g: Graph, q: int, k: int, v: int, num_heads: int, num_kv_heads: int | None = None,
                   scale: float | None = None) -> int:
    """Causal self-attention; over the KV cache in a generation graph."""
    cache = cache_of(g)
    if cache is None:
        return g.attention(q, k, v, num_heads, num_kv_heads=num_kv_heads, causal=True, scale=scale)
    return cache.attend(g, q, k, v, num_heads, num_kv_heads, scale)


def rotary(g: Graph, x: int, num_heads: int, base: float, scaling: tuple = ()) -> int:
    """RoPE at positions 0..seq-1, or at the generation graph's positions (``scaling``:
    ``ops.rope_inverse_frequencies``)."""
    cache = cache_of(g)
    return (g.rope(x, num_heads, base=base, scaling=scaling) if cache is None
            else cache.rotary(g, x, num_heads, base, scaling))


def position_rows(g: Graph, table: int, seq: int) -> int:
    """Rows 0..seq-1 of a learned position table, or the rows of the generation graph's positions."""
    cache = cache_of(g)
    if cache is None:
        return g.slice(table, 0, 0, seq)
    return g.embedding(table, cache.positions)


def last_token(g: Graph, x: int) -> int:
    """In a generation graph only the prompt's last position's logits are needed: x [1, T,
    W] -> [1, 1, W], in a prefill its row ``last``."""
    cache = cache_of(g)
    if cache is None or not cache.prefill:
        return x
    _, t, w = g.shape(x)
    return g.embedding(g.reshape(x, (t, w)), cache.last)


def generation_graph(name: str, token_input: str, seq: int, capacity: int, prefill: bool, logits) -> Graph:
    """A batch-1 generation graph: inputs ``token_input`` and ``positions`` [1, seq] (and in a
    prefill ``last`` [1, 1], the prompt's last row), output ``logits`` [1, 1, vocab] of the
    last token (``logits(g, ids)`` builds the model) and, in a decode graph, ``next_id`` [1,
    1], their argmax: greedy decoding feeds it to the next step on the GPU
    (engine.train.generation)."""
    g = Graph(f"{name}-{'prefill' if prefill else 'decode'}-{seq}of{capacity}")
    ids = g.input(token_input, (1, seq), "i32")
    positions = g.input("positions", (1, seq), "i32")
    g.kv_cache = KVCache(positions, capacity, prefill, g.input(LAST, (1, 1), "i32") if prefill else None)
    last = g.output("logits", logits(g, ids))
    if not prefill:
        g.output(NEXT_ID, g.argmax(last))
    g.kv_cache.finish()
    g.kv_cache = None
    return g
