"""Synthetic transformer-shaped graphs for the optimizer's tests and benchmark."""

from __future__ import annotations

import math

import numpy as np

from ..graph.ir import Graph


def decomposed_attention(g: Graph, q, k, v, heads: int, causal: bool = False):
    """Attention as an imported graph spells it: split heads, q kᵀ * scale, [mask], softmax, @ v."""
    b, t, width = g.shape(q)
    d = width // heads
    split = lambda x: g.transpose(g.reshape(x, (b, t, heads, d)), (0, 2, 1, 3))  # noqa: E731
    s = g.scale(g.matmul(split(q), split(k), transpose_b=True), 1.0 / math.sqrt(d))
    if causal:
        mask = np.triu(np.full((t, t), -np.inf, dtype=np.float32), 1)
        s = g.add(s, g.constant(mask))
    o = g.matmul(g.softmax(s), split(v))
    return g.reshape(g.transpose(o, (0, 2, 1, 3)), (b, t, width))


def transformer(layers=4, width=384, heads=6, mlp=1536, seq=1500, batch=1, decomposed=True,
                causal=False) -> Graph:
    """Pre-norm encoder blocks: x + attn(ln(x)); x + mlp(ln(x)) with GELU."""
    g = Graph(f"transformer-{layers}x{width}")
    x = g.input("x", (batch, seq, width))
    for i in range(layers):
        p = lambda name, shape: g.parameter(f"l{i}.{name}", shape)  # noqa: E731
        h = g.layer_norm(x, p("ln1.w", (width,)), p("ln1.b", (width,)))
        q, k, v = (g.linear(h, p(f"{n}.w", (width, width)), p(f"{n}.b", (width,))) for n in "qkv")
        a = (decomposed_attention(g, q, k, v, heads, causal) if decomposed
             else g.attention(q, k, v, heads, causal=causal))
        x = g.add(x, g.linear(a, p("o.w", (width, width)), p("o.b", (width,))))
        h = g.layer_norm(x, p("ln2.w", (width,)), p("ln2.b", (width,)))
        h = g.gelu(g.linear(h, p("fc1.w", (width, mlp)), p("fc1.b", (mlp,))))
        x = g.add(x, g.linear(h, p("fc2.w", (mlp, width)), p("fc2.b", (width,))))
    g.output("y", g.layer_norm(x, g.parameter("ln_f.w", (width,)), g.parameter("ln_f.b", (width,))))
    return g
