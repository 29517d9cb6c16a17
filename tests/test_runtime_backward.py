"""GPU kernels of the ops that gradients and the remaining forward ops use, against
the reference executor, on shapes that are not multiples of any tile size."""

import dataclasses

import numpy as np
import pytest

from engine import Graph
from engine.codegen.tuning import Tuning
from engine.runtime.device import device_capabilities, get_device

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


def test_cross_entropy_grad_over_rising_rows():
    """Rows of 700 logits rising by up to 1,000: the one-pass softmax's running maxima grow
    at every element and its sums are rescaled each time (reduce_row.wgsl's online softmax)."""
    g = Graph("ce-grad-rising")
    logits = g.input("logits", [4, 700])
    labels = g.input("labels", [4], "i32")
    g.output("dl", g.apply("cross_entropy_grad", logits, labels, g.input("d", []), ignore_index=-100))
    rng = np.random.default_rng(6)
    rising = np.linspace(-500.0, 500.0, 700)[None, :] * np.array([[1.0], [0.5], [0.1], [0.01]])
    check(g, inputs={"logits": (rising + rng.standard_normal((4, 700))).astype(np.float32),
                     "labels": np.array([699, 0, 350, 600], np.int32), "d": np.float32(0.9)})


@pytest.mark.parametrize("batch,seq,dim,vocab", [(2, 9, 13, 7), (3, 50, 150, 70), (5, 211, 40, 70), (3, 100, 40, 5000)],
                         ids=["small", "blocks", "parts", "sparse"])
def test_embedding_grad_sums_repeated_ids(batch, seq, dim, vocab):
    """"blocks": ragged in every direction the kernel tiles (16 table rows and 64 columns a
    workgroup, ids streamed 64 at a time), ids repeated, some table rows never picked.
    "parts": 1,055 ids of a small table cut into 4 parts of 264 (the last 263), each
    adding into its own copy of the table, the copies added by a second dispatch.
    "sparse": 300 ids over 5,000 rows, streamed 256 at a time: most workgroups' rows get
    none of a chunk's ids and skip it, some get ids in one chunk and not the other."""
    g = Graph("emb-grad")
    d = g.input("d", [batch, seq, dim])
    ids = g.input("ids", [batch, seq], "i32")
    g.output("dt", g.apply("embedding_grad", d, ids, vocab=vocab))
    rng = np.random.default_rng(5)
    picked = rng.integers(0, vocab - 3, (batch, seq)).astype(np.int32)   # the last rows stay zero
    s = check(g, inputs={"d": rng.standard_normal((batch, seq, dim)).astype(np.float32), "ids": picked})
    variants = [d.variant for d in s.plan.dispatches if d.nodes == [g.outputs["dt"]] and d.variant]
    assert len(variants) == 1 and ("4 parts" in variants[0]) == (batch * seq > 1000), variants
    sources = [s.plan.kernels[d.key].source for d in s.plan.dispatches if d.nodes == [g.outputs["dt"]] and d.variant]
    assert ("const SKIP: bool = true" in sources[0]) == (vocab > 4096)


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


@pytest.mark.parametrize("fill", [1, None])
@pytest.mark.parametrize("center", [True, False])
def test_norm_gradient_kernels(center, fill):
    """dx and the parameter gradients of layer (center) and RMS norms: rows longer than a
    workgroup and shorter, as vec4s (300, 36, 600 wide) and as floats (7, 301), with lanes
    sharing a column (padded rows under 128 vectors) and without (600, 301); 3 rows make
    one chunk (no second dispatch), 15 and 74 several, with a partial last one, in chunks
    of 8 and 32 where the adapter fills with one workgroup, else of 4. One norm's dx and
    parameter gradients come from one kernel (with a residual gradient added to dx too);
    a norm_grad or norm_param_grad alone keeps its own."""
    g = Graph("norm-grad")
    shapes = (([3, 5], 300), ([3, 5], 7), ([2, 37], 7), ([2, 37], 36), ([2, 37], 600), ([2, 37], 301), ([1, 3], 36))
    attrs = dict(eps=1e-5, center=center)
    for lead, n in shapes:
        name = f"{'x'.join(map(str, lead))}_{n}"
        x, d = g.input(f"x{name}", lead + [n]), g.input(f"d{name}", lead + [n])
        w = g.parameter(f"w{name}", [n])
        g.output(f"dx{name}", g.apply("norm_grad", d, x, w, **attrs))
        g.output(f"dp{name}", g.apply("norm_param_grad", d, x, **attrs))
    x, d, r = (g.input(f"{v}_res", [2, 37, 36]) for v in "xdr")
    w = g.parameter("w_res", [36])
    g.output("dx_res", g.apply("norm_grad", d, x, w, r, **attrs))
    g.output("dp_res", g.apply("norm_param_grad", d, x, **attrs))
    x, d = g.input("x_alone", [2, 37, 36]), g.input("d_alone", [2, 37, 36])
    g.output("dp_alone", g.apply("norm_param_grad", d, x, **attrs))
    g.output("dx_alone", g.apply("norm_grad", d, g.input("x_other", [2, 37, 36]), g.parameter("w_alone", [36]),
                                 **attrs))
    caps = device_capabilities(get_device())
    if fill is not None:
        caps = dataclasses.replace(caps, tuning=Tuning(sum_workgroups=fill))
    s = check(g, capabilities=caps)
    variants = [d.variant for d in s.plan.dispatches if " rows a workgroup" in d.variant]
    assert len(variants) == len(shapes) + 2 and sum("chunks" in v for v in variants) == len(shapes) + 1
    assert sum("and the input gradient" in v for v in variants) == len(shapes) + 1, variants
    assert sum(d.kernel.endswith("norm_grad") for d in s.plan.dispatches) == len(shapes) + 2   # paired, alone
    assert {v.split(" rows")[0] for v in variants} == ({"32", "8", "4"} if fill == 1 else {"4"})
    assert any("vec4s" in v for v in variants) and any("floats" in v for v in variants)


def test_a_norms_gradients_stay_apart_where_its_sums_are_read_before_its_dx():
    """The plan computes a norm's dx in its parameter gradients' kernel at dx's place: where
    a dispatch before that reads the sums, each keeps its own kernel (and the values)."""
    g = Graph("norm-grad-apart")
    x, d = g.input("x", [2, 37, 36]), g.input("d", [2, 37, 36])
    sums = g.apply("norm_param_grad", d, x, eps=1e-5, center=True)
    g.output("twice", g.add(sums, sums))
    g.output("dx", g.apply("norm_grad", d, x, g.parameter("w", [36]), eps=1e-5, center=True))
    s = check(g)
    kinds = [(d.kernel, d.variant) for d in s.plan.dispatches if "norm" in d.kernel and "total" not in d.kernel]
    assert [k for k, _ in kinds] == ["norm_param_grad", "norm_grad"], kinds
    assert not any("input gradient" in v for _, v in kinds), kinds


def test_row_dot():
    """Dot products of rows: a head dimension of 64 (vec4s, 16 threads a row), rows of 300
    (vec4s, 64 threads looping), of 7 and of 1 (floats), row counts that leave the last
    workgroup partly empty."""
    g = Graph("row-dot")
    for shape in ([2, 37, 3, 64], [3, 300], [5, 7], [9, 1]):
        name = "x".join(map(str, shape))
        a, b = g.input(f"a{name}", shape), g.input(f"b{name}", shape)
        g.output(f"dot{name}", g.apply("row_dot", a, b))
    s = check(g)
    assert sorted(d.variant for d in s.plan.dispatches) == [
        "1 thread a row, floats", "16 threads a row, vec4s", "64 threads a row, vec4s", "8 threads a row, floats"]


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
