"""Reverse-mode autodiff: every op against central differences in float64, whole
networks against PyTorch autograd, frozen parameters and stop_gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.graph import reference
from engine.autodiff.gradients import GRADIENTS, differentiate
from engine.errors import GraphError
from engine.graph.ir import Graph
from engine.graph.ops import BACKWARD_OPS, OPS, SOURCE, rope_tables


class CaseBuilder:
    """A graph under construction whose float operands are all trainable parameters
    with random values, so the gradient of every operand is checked."""

    def __init__(self, seed: int):
        self.g = Graph("case")
        self.rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}
        self.inputs: dict[str, np.ndarray] = {}

    def p(self, *shape, low=None, high=None):
        name = f"p{len(self.params)}"
        if low is None:
            value = self.rng.standard_normal(shape)
        else:
            value = self.rng.uniform(low, high, shape)
        self.params[name] = value
        return self.g.parameter(name, shape)

    def ids(self, values):
        name = f"i{len(self.inputs)}"
        self.inputs[name] = np.asarray(values, np.int32)
        return self.g.input(name, self.inputs[name].shape, "i32")


PROGRAM = (("mul", (("in", 0), ("in", 1)), ()),
           ("add", (("t", 0), ("c", 0.5)), ()),
           ("tanh", (("t", 1),), ()),
           ("gelu", (("t", 2),), (("approximate", "tanh"),)),
           ("mul", (("t", 3), ("in", 0)), ()))

# (case id, op, builder): at least one case per differentiable op.
CASES = [
    ("neg", "neg", lambda c: c.g.neg(c.p(3, 4))),
    ("exp", "exp", lambda c: c.g.exp(c.p(3, 4))),
    ("log", "log", lambda c: c.g.log(c.p(3, 4, low=0.5, high=2.0))),
    ("sqrt", "sqrt", lambda c: c.g.sqrt(c.p(3, 4, low=0.5, high=2.0))),
    ("rsqrt", "rsqrt", lambda c: c.g.rsqrt(c.p(3, 4, low=0.5, high=2.0))),
    ("reciprocal", "reciprocal", lambda c: c.g.reciprocal(c.p(3, 4, low=0.5, high=2.0))),
    ("abs", "abs", lambda c: c.g.abs(c.p(3, 4))),
    ("relu", "relu", lambda c: c.g.relu(c.p(3, 4))),
    ("sigmoid", "sigmoid", lambda c: c.g.sigmoid(c.p(3, 4))),
    ("tanh", "tanh", lambda c: c.g.tanh(c.p(3, 4))),
    ("silu", "silu", lambda c: c.g.silu(c.p(3, 4))),
    ("gelu", "gelu", lambda c: c.g.gelu(c.p(3, 4))),
    ("gelu-tanh", "gelu", lambda c: c.g.gelu(c.p(3, 4), approximate="tanh")),
    ("pow-3", "pow", lambda c: c.g.pow(c.p(3, 4), 3.0)),
    ("pow-half", "pow", lambda c: c.g.pow(c.p(3, 4, low=0.5, high=2.0), 0.5)),
    ("add-broadcast", "add", lambda c: c.g.add(c.p(2, 3, 4), c.p(3, 1))),
    ("sub-broadcast", "sub", lambda c: c.g.sub(c.p(4), c.p(2, 3, 4))),
    ("mul-broadcast", "mul", lambda c: c.g.mul(c.p(2, 3, 4), c.p(1, 4))),
    ("div-broadcast", "div", lambda c: c.g.div(c.p(2, 3, 4), c.p(3, 1, low=0.5, high=2.0))),
    ("bias_add", "bias_add", lambda c: c.g.bias_add(c.p(2, 3, 4), c.p(4))),
    ("pointwise", "pointwise", lambda c: c.g.apply("pointwise", c.p(3, 4), c.p(4), program=PROGRAM)),
    ("swiglu", "swiglu", lambda c: c.g.apply("swiglu", c.p(3, 4), c.p(3, 4))),
    ("sum-all", "sum", lambda c: c.g.sum(c.p(3, 4))),
    ("sum-last", "sum", lambda c: c.g.sum(c.p(2, 3, 4), axis=-1)),
    ("mean-last-keep", "mean", lambda c: c.g.mean(c.p(2, 3, 4), axis=-1, keepdims=True)),
    ("mean-all", "mean", lambda c: c.g.mean(c.p(3, 4))),
    ("max-last", "max", lambda c: c.g.max(c.p(3, 5), axis=-1)),
    ("max-all-keep", "max", lambda c: c.g.max(c.p(3, 5), axis=None, keepdims=True)),
    ("sum_to", "sum_to", lambda c: c.g.apply("sum_to", c.p(2, 3, 4), shape=(3, 1))),
    ("softmax", "softmax", lambda c: c.g.softmax(c.p(3, 5))),
    ("log_softmax", "log_softmax", lambda c: c.g.log_softmax(c.p(3, 5))),
    ("layer_norm", "layer_norm", lambda c: c.g.layer_norm(c.p(2, 3, 5), c.p(5), c.p(5))),
    ("rms_norm", "rms_norm", lambda c: c.g.rms_norm(c.p(3, 5), c.p(5))),
    ("group_norm", "group_norm", lambda c: c.g.group_norm(c.p(2, 4, 3), c.p(4), c.p(4), num_groups=2)),
    ("group_norm-silu", "group_norm",
     lambda c: c.g.apply("group_norm", c.p(2, 4, 3), c.p(4), c.p(4), num_groups=2, activation="silu")),
    ("cross_entropy-ignore", "cross_entropy",
     lambda c: c.g.cross_entropy_loss(c.p(2, 3, 5), c.ids([[1, -100, 4], [0, 2, -100]]))),
    ("soft_cross_entropy", "soft_cross_entropy",
     lambda c: c.g.cross_entropy_loss(c.p(3, 5), c.p(3, 5, low=0.0, high=1.0))),
    ("mse_loss", "mse_loss", lambda c: c.g.mse_loss(c.p(3, 4), c.p(3, 4))),
    ("bce_loss", "bce_loss", lambda c: c.g.bce_loss(c.p(3, 4), c.p(3, 4, low=0.0, high=1.0))),
    ("matmul-batched-weight", "matmul", lambda c: c.g.matmul(c.p(2, 3, 4), c.p(4, 5))),
    ("matmul-transposed", "matmul",
     lambda c: c.g.matmul(c.p(2, 4, 3), c.p(1, 5, 4), transpose_a=True, transpose_b=True)),
    ("fused_matmul-epilogue", "fused_matmul",
     lambda c: c.g.apply("fused_matmul", c.p(2, 3, 4), c.p(4, 5), c.p(5), c.p(2, 3, 5),
                         activation="gelu_tanh", has_add=True, has_residual=True)),
    ("fused_matmul-transposed-silu", "fused_matmul",
     lambda c: c.g.apply("fused_matmul", c.p(4, 3), c.p(5, 4), transpose_a=True, transpose_b=True,
                         activation="silu")),
    ("fused_matmul-relu", "fused_matmul",
     lambda c: c.g.apply("fused_matmul", c.p(3, 4), c.p(4, 5), c.p(3, 5), activation="relu", has_add=True)),
    ("norm_matmul", "norm_matmul",
     lambda c: c.g.apply("norm_matmul", c.p(2, 3, 4), c.p(4), c.p(5, 4), transpose_b=True)),
    ("attention-causal-gqa", "attention",
     lambda c: c.g.attention(c.p(2, 3, 8), c.p(2, 3, 4), c.p(2, 3, 4), num_heads=2, num_kv_heads=1, causal=True)),
    ("attention-cross-scaled", "attention",
     lambda c: c.g.attention(c.p(1, 3, 8), c.p(1, 5, 8), c.p(1, 5, 8), num_heads=2, scale=0.3)),
    ("rope", "rope", lambda c: c.g.rope(c.p(1, 4, 8), num_heads=2, offset=1)),
    ("conv1d-bias-stride", "conv1d", lambda c: c.g.conv1d(c.p(2, 3, 7), c.p(4, 3, 3), c.p(4), stride=2, padding=1)),
    ("conv2d", "conv2d", lambda c: c.g.conv2d(c.p(1, 2, 5, 4), c.p(3, 2, 2, 3), stride=(2, 1), padding=(1, 0))),
    ("reshape", "reshape", lambda c: c.g.reshape(c.p(2, 6), (3, 4))),
    ("transpose", "transpose", lambda c: c.g.transpose(c.p(2, 3, 4), (2, 0, 1))),
    ("concat", "concat", lambda c: c.g.concat([c.p(2, 3), c.p(2, 2)], axis=-1)),
    ("slice", "slice", lambda c: c.g.slice(c.p(2, 5), -1, 1, 4)),
    ("pad", "pad", lambda c: c.g.apply("pad", c.p(2, 3), axis=0, before=1, after=2)),
    ("broadcast_to", "broadcast_to", lambda c: c.g.apply("broadcast_to", c.p(3, 1), shape=(2, 3, 4))),
    ("embedding", "embedding", lambda c: c.g.embedding(c.p(5, 3), c.ids([[0, 3, 3], [4, 0, 1]]))),
    # ONNX import ops
    ("erf", "erf", lambda c: c.g.apply("erf", c.p(3, 4))),
    ("softplus", "softplus", lambda c: c.g.apply("softplus", c.p(3, 4, low=-4.0, high=4.0))),
    ("leaky_relu", "leaky_relu", lambda c: c.g.apply("leaky_relu", c.p(3, 4), alpha=0.2)),
    ("maximum-broadcast", "maximum", lambda c: c.g.apply("maximum", c.p(2, 3, 4), c.p(3, 1))),
    ("minimum-broadcast", "minimum", lambda c: c.g.apply("minimum", c.p(4), c.p(2, 3, 4))),
    ("power-broadcast", "power", lambda c: c.g.apply("power", c.p(2, 3, 4, low=0.5, high=2.0), c.p(3, 1))),
    ("where-broadcast", "where",
     lambda c: c.g.apply("where", c.g.constant(c.rng.integers(0, 2, (3, 1)).astype(np.float32)), c.p(2, 3, 4),
                         c.p(4))),
    ("cast-f32", "cast", lambda c: c.g.apply("cast", c.p(3, 4), dtype="f32")),
    ("conv_general-1d-groups-dilation-pads", "conv_general",
     lambda c: c.g.apply("conv_general", c.p(2, 4, 9), c.p(6, 2, 3), c.p(6), stride=(2,), pads=(2, 1),
                         dilation=(2,), groups=2)),
    ("conv_general-2d-depthwise", "conv_general",
     lambda c: c.g.apply("conv_general", c.p(1, 3, 5, 6), c.p(3, 1, 2, 3), stride=(1, 2), pads=(1, 0, 0, 2),
                         dilation=(2, 1), groups=3)),
    ("max_pool-2d-overlap-pads", "max_pool",
     lambda c: c.g.apply("max_pool", c.p(2, 2, 5, 6), kernel=(3, 2), stride=(2, 1), pads=(1, 0, 1, 1),
                         dilation=(1, 1))),
    ("max_pool-1d-dilation-ceil", "max_pool",
     lambda c: c.g.apply("max_pool", c.p(2, 3, 10), kernel=(3,), stride=(3,), pads=(1, 0), dilation=(2,),
                         ceil_mode=True)),
    ("avg_pool-2d-count-pad-ceil", "avg_pool",
     lambda c: c.g.apply("avg_pool", c.p(1, 2, 5, 6), kernel=(3, 3), stride=(2, 2), pads=(1, 1, 1, 1), dilation=(1, 1),
                         ceil_mode=True, count_include_pad=True)),
    ("avg_pool-1d-exclude-pad-dilation", "avg_pool",
     lambda c: c.g.apply("avg_pool", c.p(2, 2, 9), kernel=(3,), stride=(2,), pads=(2, 1), dilation=(2,),
                         ceil_mode=True)),
]
_ZERO = "its gradient is zero almost everywhere (piecewise constant): the rule gives none"
_BOOL = "a comparison: its f32 0/1 mask has a zero gradient almost everywhere; the rule gives none"
NOT_GRADCHECKED = {
    "stop_gradient": "its gradient is none by definition: test_stop_gradient_blocks",
    "floor": _ZERO, "ceil": _ZERO, "sign": _ZERO,
    "logical_not": "a boolean 0/1 mask: zero gradient almost everywhere; the rule gives none",
    "equal": _BOOL, "less": _BOOL, "greater": _BOOL, "less_equal": _BOOL, "greater_equal": _BOOL,
    "index_wrap": "i32 indices in and out: nothing to differentiate",
    "cache_write": "generation (inference) only: its rule refuses, test_generation_ops_refuse_gradients",
    "cached_attention": "generation (inference) only: its rule refuses, test_generation_ops_refuse_gradients",
    "argmax": "an i32 index, piecewise constant in its operand: the rule gives none",
    "swiglu_matmul": "made by the few-row pass after autodiff (engine.optimize.few_rows); its rule refuses",
    "norm_matmuls": "made by the few-row pass after autodiff (engine.optimize.few_rows); its rule refuses",
    "attention_stats": "made after autodiff (engine.optimize.attention_stats); its rule refuses, test_attention_stats",
    "widen": "made after autodiff (engine.optimize.bf16_weights) for generation; its rule refuses",
}


def project_to_loss(c: CaseBuilder, out: int) -> None:
    """loss = sum(out * R) with a fixed random R, so every output element counts."""
    r = c.g.constant(c.rng.standard_normal(c.g.shape(out)))
    c.g.output("loss", c.g.sum(c.g.mul(out, r)))


def central_differences(graph, inputs, params, name, h=1e-6):
    value = params[name]
    grad = np.zeros_like(value)
    for idx in np.ndindex(*value.shape):
        old = value[idx]
        value[idx] = old + h
        up = reference.run(graph, inputs, params, np.float64)["loss"]
        value[idx] = old - h
        down = reference.run(graph, inputs, params, np.float64)["loss"]
        value[idx] = old
        grad[idx] = (up - down) / (2 * h)
    return grad


def relative_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


@pytest.mark.parametrize("case_id, op, build", CASES, ids=[c[0] for c in CASES])
def test_gradient_matches_central_differences(case_id, op, build):
    c = CaseBuilder(seed=sum(map(ord, case_id)))
    out = build(c)
    assert c.g[out].op == op
    project_to_loss(c, out)
    train, pairs = differentiate(c.g)
    assert sorted(p for p, _ in pairs) == sorted(c.params)
    values = reference.run(train, c.inputs, c.params, np.float64)
    for name, grad_name in pairs:
        fd = central_differences(c.g, c.inputs, c.params, name)
        err = relative_error(values[grad_name], fd)
        assert err < 1e-6, f"{case_id}: d loss / d {name} off by {err:.2e}"


def test_every_op_has_a_gradient_rule_and_a_gradcheck():
    differentiable = {n for n, d in OPS.items() if d.archetype != SOURCE and n not in BACKWARD_OPS}
    assert differentiable == set(GRADIENTS)
    assert differentiable == {op for _, op, _ in CASES} | set(NOT_GRADCHECKED)
    assert all(OPS[n].grad is GRADIENTS[n] for n in differentiable)


def test_cross_entropy_gradient_ignores_positions_and_averages_over_the_rest():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 3, 5))
    labels = np.array([[1, -100, 4], [0, 2, -100]], np.int32)
    g = Graph()
    x = g.parameter("x", logits.shape)
    g.output("loss", g.cross_entropy_loss(x, g.input("labels", labels.shape, "i32")))
    train, _ = differentiate(g)
    got = reference.run(train, {"labels": labels}, {"x": logits}, np.float64)
    t = torch.tensor(logits, requires_grad=True)
    loss = F.cross_entropy(t.reshape(-1, 5), torch.tensor(labels.reshape(-1), dtype=torch.long), ignore_index=-100)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got["grad:x"], t.grad.numpy(), rtol=1e-10, atol=1e-14)
    assert np.all(got["grad:x"][0, 1] == 0) and np.all(got["grad:x"][1, 2] == 0)


def frozen_encoder_graph():
    g = Graph("frozen")
    x = g.input("x", (4, 6))
    h = g.relu(g.linear(x, g.parameter("enc.w", (6, 5), trainable=False), g.parameter("enc.b", (5,), trainable=False)))
    y = g.linear(h, g.parameter("head.w", (5, 3)), g.parameter("head.b", (3,)))
    g.output("loss", g.mse_loss(y, g.input("target", (4, 3))))
    return g


def test_frozen_parameters_get_no_gradient_and_their_path_no_backward_nodes():
    train, pairs = differentiate(frozen_encoder_graph())
    assert pairs == [("head.w", "grad:head.w"), ("head.b", "grad:head.b")]
    ops = [n.op for n in train.nodes]
    assert "relu_grad" not in ops  # the encoder's activation is never differentiated
    assert ops.count("matmul") == 3  # two forward, d head.w; no d h, no d enc.w
    assert ops.count("sum_to") == 1  # d head.b only


def test_stop_gradient_blocks():
    g = Graph()
    w = g.parameter("w", (3,))
    g.output("loss", g.sum(g.mul(w, g.stop_gradient(g.exp(w)))))
    train, pairs = differentiate(g)
    value = np.array([0.1, -0.4, 0.7])
    got = reference.run(train, {}, {"w": value}, np.float64)["grad:w"]
    np.testing.assert_allclose(got, np.exp(value), rtol=1e-12)  # not exp(w) * (1 + w)
    assert "exp" not in [n.op for n in train.nodes if n.id > train.outputs["loss"]]


def test_zero_gradient_ops_give_their_operands_none():
    """floor, ceil, sign, logical_not and comparisons pass no gradient (torch: zeros),
    cast to i32 leaves the gradient path, and where's condition gets none."""
    g = Graph()
    w = g.parameter("w", (4,))
    blocked = [g.apply(op, w) for op in ("floor", "ceil", "sign", "logical_not")]
    blocked += [g.apply(op, w, g.exp(w)) for op in ("equal", "less", "greater", "less_equal", "greater_equal")]
    blocked.append(g.apply("cast", g.apply("cast", w, dtype="i32"), dtype="f32"))
    loss = g.sum(g.apply("where", g.apply("greater", w, g.constant(np.float32(0))), w, g.neg(w)))
    for b in blocked:
        loss = g.add(loss, g.sum(g.mul(b, w)))
    g.output("loss", loss)
    train, _ = differentiate(g)
    value = np.array([-1.5, -0.2, 0.3, 2.7])
    got = reference.run(train, {}, {"w": value}, np.float64)["grad:w"]
    t = torch.tensor(value, requires_grad=True)
    tb = [torch.floor(t), torch.ceil(t), torch.sign(t), torch.logical_not(t).double()]
    tb += [f(t, torch.exp(t)).double() for f in (torch.eq, torch.lt, torch.gt, torch.le, torch.ge)]
    tb.append(t.int().double())
    tl = torch.where(t > 0, t, -t).sum() + sum((b * t).sum() for b in tb)
    tl.backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-12)


def test_maximum_minimum_and_max_pool_ties_split_as_torch():
    """Ties: maximum / minimum give half to each operand, max_pool all to the window's
    first maximum, as torch autograd does."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 3, (3, 4)).astype(np.float64), rng.integers(0, 3, (4,)).astype(np.float64)
    x = rng.integers(0, 3, (2, 2, 5, 6)).astype(np.float64)
    g = Graph()
    pa, pb, px = g.parameter("a", a.shape), g.parameter("b", b.shape), g.parameter("x", x.shape)
    ra, rb, rx = (rng.standard_normal(s).astype(np.float32).astype(np.float64)  # constants are f32
                  for s in ((3, 4), (3, 4), (2, 2, 3, 5)))
    terms = [g.mul(g.apply("maximum", pa, pb), g.constant(ra)), g.mul(g.apply("minimum", pa, pb), g.constant(rb)),
             g.mul(g.apply("max_pool", px, kernel=(3, 2), stride=(2, 1), pads=(1, 0, 1, 0),
                                                  dilation=(1, 1)), g.constant(rx))]
    g.output("loss", g.sum(g.add(g.sum(terms[0]), g.add(g.sum(terms[1]), g.sum(terms[2])))))
    train, _ = differentiate(g)
    got = reference.run(train, {}, {"a": a, "b": b, "x": x}, np.float64)
    ta, tb, tx = (torch.tensor(v, requires_grad=True) for v in (a, b, x))
    pooled = F.max_pool2d(F.pad(tx, (0, 0, 1, 1), value=-math.inf), (3, 2), (2, 1))
    loss = ((torch.maximum(ta, tb) * torch.tensor(ra)).sum() + (torch.minimum(ta, tb) * torch.tensor(rb)).sum()
            + (pooled * torch.tensor(rx)).sum())
    loss.backward()
    for name, t in (("a", ta), ("b", tb), ("x", tx)):
        np.testing.assert_allclose(got["grad:" + name], t.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=name)


def test_loss_must_exist_and_be_scalar():
    g = Graph()
    g.output("y", g.exp(g.parameter("w", (3,))))
    with pytest.raises(GraphError, match="no output 'loss'"):
        differentiate(g)
    with pytest.raises(GraphError, match="must be a scalar"):
        differentiate(g, loss="y")


# ---------------------------------------------------------------- against torch autograd

def torch_grads(fn, params):
    ts = {k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in params.items()}
    loss = fn(ts)
    loss.backward()
    return loss.item(), {k: t.grad.numpy() for k, t in ts.items()}


def assert_matches_torch(g, inputs, params, torch_fn):
    train, pairs = differentiate(g)
    got = reference.run(train, inputs, params, np.float32)
    want_loss, want = torch_grads(torch_fn, params)
    np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-5)
    assert {p for p, _ in pairs} == set(params)
    for name, grad_name in pairs:
        err = relative_error(got[grad_name].astype(np.float64), want[name].astype(np.float64))
        assert err < 1e-4, f"d loss / d {name}: relative error {err:.2e}"


def test_mlp_gradients_match_torch():
    rng = np.random.default_rng(1)
    x, labels = rng.standard_normal((8, 20)), rng.integers(0, 5, 8).astype(np.int32)
    params = {"w1": rng.standard_normal((20, 32)) * 0.3, "b1": rng.standard_normal(32) * 0.1,
              "w2": rng.standard_normal((32, 5)) * 0.3, "b2": rng.standard_normal(5) * 0.1}
    g = Graph("mlp")
    xi, li = g.input("x", x.shape), g.input("labels", (8,), "i32")
    h = g.gelu(g.linear(xi, g.parameter("w1", (20, 32)), g.parameter("b1", (32,))))
    g.output("loss", g.cross_entropy_loss(g.linear(h, g.parameter("w2", (32, 5)), g.parameter("b2", (5,))), li))
    xt, lt = torch.tensor(x, dtype=torch.float32), torch.tensor(labels, dtype=torch.long)
    assert_matches_torch(g, {"x": x, "labels": labels}, params, lambda p: F.cross_entropy(
        F.gelu(xt @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], lt))


B, T, H, KV, D, V = 2, 5, 4, 2, 4, 11
WIDTH = H * D


def build_block() -> Graph:
    """Pre-norm decoder block: layer norm, RoPE causal GQA attention, residual, RMS norm,
    SwiGLU MLP, residual, vocabulary head, cross-entropy."""
    g = Graph("block")
    x, labels = g.input("x", (B, T, WIDTH)), g.input("labels", (B, T), "i32")
    p = lambda name, *shape: g.parameter(name, shape)
    h = g.layer_norm(x, p("ln.w", WIDTH), p("ln.b", WIDTH))
    q = g.rope(g.matmul(h, p("wq", WIDTH, WIDTH)), H)
    k = g.rope(g.matmul(h, p("wk", WIDTH, KV * D)), KV)
    v = g.matmul(h, p("wv", WIDTH, KV * D))
    x = g.add(x, g.matmul(g.attention(q, k, v, H, KV, causal=True), p("wo", WIDTH, WIDTH)))
    h = g.rms_norm(x, p("rms.w", WIDTH))
    mlp = g.apply("swiglu", g.matmul(h, p("wg", WIDTH, 16)), g.matmul(h, p("wu", WIDTH, 16)))
    x = g.add(x, g.matmul(mlp, p("wd", 16, WIDTH)))
    g.output("loss", g.cross_entropy_loss(g.matmul(x, p("head", WIDTH, V)), labels))
    return g


def torch_rope(x, heads):
    b, t, w = x.shape
    d = w // heads
    cos, sin = (torch.tensor(a, dtype=torch.float32)[None, :, None, :] for a in rope_tables(t, d))
    xh = x.reshape(b, t, heads, d)
    x1, x2 = xh[..., : d // 2], xh[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(b, t, w)


def torch_block(p, x, labels):
    heads = lambda y, n: y.reshape(B, T, n, D).transpose(1, 2)
    h = F.layer_norm(x, (WIDTH,), p["ln.w"], p["ln.b"])
    q, k, v = torch_rope(h @ p["wq"], H), torch_rope(h @ p["wk"], KV), h @ p["wv"]
    k, v = (heads(y, KV).repeat_interleave(H // KV, dim=1) for y in (k, v))
    o = F.scaled_dot_product_attention(heads(q, H), k, v, is_causal=True)
    x = x + o.transpose(1, 2).reshape(B, T, WIDTH) @ p["wo"]
    h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * p["rms.w"]
    x = x + (F.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]
    return F.cross_entropy((x @ p["head"]).reshape(-1, V), labels.reshape(-1).long(), ignore_index=-100)


def test_transformer_block_gradients_match_torch():
    rng = np.random.default_rng(2)
    g = build_block()
    params = {}
    for name, nid in g.parameters.items():
        shape = g.shape(nid)
        params[name] = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
                        else rng.standard_normal(shape) / math.sqrt(shape[0]))
    x = rng.standard_normal((B, T, WIDTH))
    labels = rng.integers(0, V, (B, T)).astype(np.int32)
    labels[0, 0] = -100
    xt, lt = torch.tensor(x, dtype=torch.float32), torch.tensor(labels)
    assert_matches_torch(g, {"x": x, "labels": labels}, params, lambda p: torch_block(p, xt, lt))


# ---------------------------------------------------------------- built-in models against torch

def jittered(model, seed=0):
    """Initial values plus noise, so zero-initialised layers (audio-align's projector.fc2)
    and unit norms do not make gradients trivially zero or symmetric."""
    rng = np.random.default_rng(seed + 1)
    return {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in model.init_params(seed).items()}


def builtin_model_grads_against_torch(model, inputs, torch_loss, params=None):
    """Engine gradients (float32 reference) of a built-in model's training graph against
    autograd (float64) through the independent torch implementation in
    tests/torch_reference.py, with the same weights. Frozen parameters are torch leaves
    with requires_grad=False: both sides must give them no gradient."""
    import torch_reference as tr
    params = model.init_params(seed=0) if params is None else params
    graph = model.build(train=True)
    train, pairs = differentiate(graph)
    got = reference.run(train, inputs, params, np.float32)
    trainable = {n for n, m in graph.param_meta.items() if m["trainable"]}
    w = tr.leaves(model.to_file_layout(params), trainable=trainable.__contains__)
    loss = torch_loss(tr, w)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    assert {p for p, _ in pairs} == trainable
    assert all(w[n].grad is None for n in set(params) - trainable)
    for name, grad_name in pairs:
        want = w[name].grad.numpy()
        want = want.T if name in model.weight_transposes else want
        err = relative_error(got[grad_name].astype(np.float64), want)
        assert err < 1e-4, f"{model.name}: d loss / d {name}: relative error {err:.2e}"
    return pairs


def test_gpt_tiny_gradients_match_torch():
    from engine import models
    model = models.create("gpt-tiny", batch=1, seq=8)
    inputs = model.example_inputs(train=True)
    builtin_model_grads_against_torch(model, inputs, lambda tr, w: tr.cross_entropy(
        tr.gpt_forward(inputs["tokens"], w), inputs["targets"]))


def test_mlp_model_gradients_match_torch():
    from engine import models
    model = models.create("mlp", batch=4)
    inputs = model.example_inputs(train=True)
    labels = torch.from_numpy(inputs["labels"].astype(np.int64))
    builtin_model_grads_against_torch(model, inputs, lambda tr, w: F.cross_entropy(
        tr.mlp_forward(tr.as_tensor(inputs["x"]), w), labels))


def test_whisper_tiny_gradients_match_torch():
    from engine import models
    model = models.create("whisper-tiny", batch=1, mel_len=16, samples=1)
    inputs = model.example_inputs(train=True)
    pairs = builtin_model_grads_against_torch(model, inputs, lambda tr, w: tr.whisper_loss(
        tr.as_tensor(inputs["mel"]), tr.as_tensor(inputs["target"]), w), params=jittered(model))
    assert "model.encoder.embed_positions.weight" not in dict(pairs)  # not trained, as in HF
    assert "model.encoder.conv1.weight" in dict(pairs)


def test_audio_align_gradients_match_torch_and_skip_the_frozen_encoder():
    from engine import models
    model = models.create("audio-align", batch=2, mel_len=8, seq=6)
    inputs = model.example_inputs(train=True)
    pairs = builtin_model_grads_against_torch(model, inputs, lambda tr, w: tr.cross_entropy(
        tr.audio_align_forward(tr.as_tensor(inputs["mel"]), inputs["tokens"], w), inputs["targets"]),
        params=jittered(model))
    names = dict(pairs)
    assert not any(n.startswith("model.encoder.") for n in names)
    assert {"projector.fc1.weight", "projector.fc2.weight", "audio_norm.weight", "gpt.embed.weight"} <= set(names)


def test_audio_align_frozen_encoder_costs_only_its_forward():
    from engine import models
    g = models.create("audio-align", batch=1, mel_len=20, seq=6).build(train=True)
    train, pairs = differentiate(g)
    frozen = {n for n, m in g.param_meta.items() if not m["trainable"]}
    assert frozen and not frozen & {p for p, _ in pairs}
    ops = {n.op for n in train.nodes}
    assert "conv1d" in ops and not ops & {"conv_input_grad", "conv_weight_grad"}
