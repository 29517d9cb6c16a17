"""GPU kernels of the ops that gradients and the remaining forward ops use, against
the reference executor, on shapes that are not multiples of any tile size."""

import numpy as np
import pytest

from engine import Graph

from test_runtime import check


def test_pointwise_gradients():
    g = Graph("pw-grad")
    d = g.input("d", [5, 37])
    x = g.input("x", [5, 37])
    g.output("relu", g.apply("relu_grad", d, x))
    g.output("abs", g.apply("abs_grad", d, x))
    g.output("gelu", g.apply("gelu_grad", d, x))
    g.output("gelu_tanh", g.apply("gelu_grad", d, x, approximate="tanh"))
    check(g)


@pytest.mark.parametrize("axis", [-1, None])
def test_max_grad(axis):
    g = Graph("max-grad")
    x = g.input("x", [6, 19])
    y = g.max(x, axis=axis)
    d = g.input("d", g.shape(y))
    g.output("dx", g.apply("max_grad", d, x, axis=axis))
    rng = np.random.default_rng(3)
    xv = rng.integers(0, 4, (6, 19)).astype(np.float32)  # many ties
    check(g, inputs={"x": xv, "d": rng.standard_normal(g.shape(y)).astype(np.float32)})


def test_cross_entropy_grad_with_ignored_rows():
    g = Graph("ce-grad")
    logits = g.input("logits", [3, 7, 11])
    labels = g.input("labels", [3, 7], "i32")
    d = g.input("d", [])
    g.output("dl", g.apply("cross_entropy_grad", logits, labels, d, ignore_index=-1))
    rng = np.random.default_rng(4)
    lab = rng.integers(0, 11, (3, 7)).astype(np.int32)
    lab[0, :5] = -1
    check(g, inputs={"logits": rng.standard_normal((3, 7, 11)).astype(np.float32), "labels": lab,
                     "d": np.float32(1.7)})


@pytest.mark.parametrize("batch,seq,dim,vocab", [(2, 9, 13, 7), (3, 50, 150, 70)], ids=["small", "blocks"])
def test_embedding_grad_sums_repeated_ids(batch, seq, dim, vocab):
    """"blocks": ragged in every direction the kernel tiles (16 table rows and 64 columns a
    workgroup, ids streamed 64 at a time), ids repeated, some table rows never picked."""
    g = Graph("emb-grad")
    d = g.input("d", [batch, seq, dim])
    ids = g.input("ids", [batch, seq], "i32")
    g.output("dt", g.apply("embedding_grad", d, ids, vocab=vocab))
    rng = np.random.default_rng(5)
    picked = rng.integers(0, vocab - 3, (batch, seq)).astype(np.int32)   # the last rows stay zero
    check(g, inputs={"d": rng.standard_normal((batch, seq, dim)).astype(np.float32), "ids": picked})


@pytest.mark.parametrize("dims,stride,padding,wide", [(1, (2,), (1,), False), (1, (1,), (0,), False),
                                                      (2, (2, 1), (1, 0), False), (1, (2,), (1,), True)])
def test_conv_gradients(dims, stride, padding, wide):
    """The convolution kernels are implicit GEMMs: ``wide`` spans several tiles and K
    steps of the matmul kernel in every one of them (whisper's conv2 in miniature)."""
    g = Graph("conv-grad")
    xs = ([2, 20, 150] if wide else [2, 3, 11]) if dims == 1 else [2, 3, 9, 7]
    ws = ([70, 20, 3] if wide else [5, 3, 3]) if dims == 1 else [5, 3, 3, 2]
    x = g.input("x", xs)
    w = g.parameter("w", ws)
    y = g.apply(f"conv{dims}d", x, w, stride=stride, padding=padding)
    d = g.input("d", g.shape(y))
    g.output("dx", g.apply("conv_input_grad", d, w, stride=stride, padding=padding, input_shape=tuple(xs)))
    g.output("dw", g.apply("conv_weight_grad", x, d, stride=stride, padding=padding, kernel=tuple(ws[2:])))
    g.output("y", y)
    s = check(g)
    assert all(d.variant.startswith("implicit GEMM") for d in s.plan.dispatches)


@pytest.mark.parametrize("center", [True, False])
def test_norm_gradient_kernels(center):
    """dx and dout * standardized x of layer (center) and RMS norms, rows longer than a
    workgroup (300) and shorter (7)."""
    g = Graph("norm-grad")
    for n in (300, 7):
        x, d = g.input(f"x{n}", [3, 5, n]), g.input(f"d{n}", [3, 5, n])
        w = g.parameter(f"w{n}", [n])
        g.output(f"dx{n}", g.apply("norm_grad", d, x, w, eps=1e-5, center=center))
        g.output(f"dw{n}", g.apply("norm_grad_w", d, x, eps=1e-5, center=center))
    check(g)


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_group_norm(activation):
    g = Graph("gn")
    x = g.input("x", [2, 6, 5, 3])
    w = g.parameter("w", [6])
    b = g.parameter("b", [6])
    g.output("y", g.apply("group_norm", x, w, b, num_groups=3, activation=activation))
    check(g)


def test_soft_cross_entropy_and_bce():
    g = Graph("losses")
    logits = g.input("logits", [4, 3, 9])
    t = g.input("t", [4, 3, 9])
    g.output("soft_ce", g.cross_entropy_loss(logits, g.softmax(t)))
    g.output("bce", g.bce_loss(logits, g.sigmoid(t)))
    check(g)
