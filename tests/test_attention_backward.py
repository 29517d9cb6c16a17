"""Attention's fused backward (flash attention 2): the attention_lse, attention_grad_q and
attention_grad_kv (dk and dv packed, split by ``part`` views) kernels on lavapipe against
their numpy references, the references against finite differences and torch autograd,
the gradient rule against the decomposed one, GPU training steps, and whisper-tiny's
training plan without its T x S matrices.

Sequence lengths are chosen off the 32-row blocks (1, 33, 70, 130) so the edge masking
runs; head dims off 64 so threads without an output column run too."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import Graph, codegen, config, models
from engine.graph import reference
from engine.autodiff import gradients as autodiff
from engine.autodiff.gradients import differentiate
from engine.compile.plan import OptimizerSpec, compile_plan
from engine.errors import GraphError, ShapeError
from engine.graph.ops import ATTENTION, OPS, PART_ALIGN, attention_grad_kv_layout, attention_ref, part_ref
from engine.optimize import optimize
from engine.runtime.dispatches import estimate_flops
from engine.runtime.device import device_capabilities
from engine.runtime.session import build_inference_session
from engine.train.config import TrainConfig
from engine.train.session import build_session
from test_attention_kernel import CASES as FORWARD_CASES
from test_runtime import TOL, rel_err

BACKWARD_OPS = ("attention_lse", "attention_grad_q", "attention_grad_kv")


def attention_attrs(heads, kv_heads, causal, scale):
    return dict(num_heads=heads, num_kv_heads=kv_heads, causal=causal, scale=scale)


def backward_inputs(batch, t, s, heads, kv_heads, d, attrs, seed=0, dtype=np.float32):
    """Random q, k, v, dout and the lse, delta (float64 references) they imply."""
    rng = np.random.default_rng(seed)
    x = {"q": rng.standard_normal((batch, t, heads * d)), "k": rng.standard_normal((batch, s, kv_heads * d)),
         "v": rng.standard_normal((batch, s, kv_heads * d)), "dout": rng.standard_normal((batch, t, heads * d))}
    x = {n: a.astype(dtype).astype(np.float64) for n, a in x.items()}
    return with_row_stats(x, attrs, dtype)


def with_row_stats(x, attrs, dtype=np.float32):
    batch, t, width = x["q"].shape
    out = attention_ref(x["q"], x["k"], x["v"], **attrs)
    x["lse"] = OPS["attention_lse"].ref(x["q"], x["k"], **attrs)
    x["delta"] = (x["dout"] * out).reshape(batch, t, attrs["num_heads"], -1).sum(-1)
    return {n: a.astype(dtype) for n, a in x.items()}


def backward_graph(batch, t, s, heads, kv_heads, d, attrs):
    """One node of each backward op, on inputs q, k, v, dout, lse, delta; dk and dv are
    ``part`` views of attention_grad_kv's packed result."""
    g = Graph("attention-backward")
    q, k, v, dout = (g.input(n, shape) for n, shape in (("q", [batch, t, heads * d]), ("k", [batch, s, kv_heads * d]),
                                                         ("v", [batch, s, kv_heads * d]), ("dout", [batch, t, heads * d])))
    lse, delta = g.input("lse", [batch, t, heads]), g.input("delta", [batch, t, heads])
    g.output("lse_out", g.apply("attention_lse", q, k, **attrs))
    g.output("dq", g.apply("attention_grad_q", q, k, v, dout, lse, delta, **attrs))
    kv = g.apply("attention_grad_kv", q, k, v, dout, lse, delta, **attrs)
    for name, at in zip(("dk", "dv"), attention_grad_kv_layout(g.shape(k))[0]):
        g.output(name, g.apply("part", kv, offset=at, shape=g.shape(k)))
    return g


def run_backward(batch, t, s, heads, kv_heads, d, causal=False, scale=None, inputs=None, seed=0):
    """(GPU outputs, float64 reference outputs) of the three ops (dk, dv from one), on the
    f32 kernels also where the device has subgroup matrices and MEGANEURA_PRECISION=f16
    (the cooperative ones: test_attention_coop_backward.py)."""
    attrs = attention_attrs(heads, kv_heads, causal, scale)
    g = backward_graph(batch, t, s, heads, kv_heads, d, attrs)
    inputs = inputs if inputs is not None else backward_inputs(batch, t, s, heads, kv_heads, d, attrs, seed)
    caps = device_capabilities(config=config.current().with_knobs(attention_backward="f32"))
    session = build_inference_session(g, optimize=False, capabilities=caps)
    kernels = [dispatch for dispatch in session.plan.dispatches if dispatch.archetype == ATTENTION]
    assert [dispatch.variant.startswith("tiled backward") for dispatch in kernels] == [True] * 3
    assert len(session.plan.dispatches) == 3 + sum("split" in dispatch.variant for dispatch in kernels)
    session.set_inputs(inputs)
    session.run()
    ref = reference.run(g, inputs, {}, np.float64)
    return {n: session.read_output(n) for n in g.outputs}, ref


def assert_close(got, want, tol=TOL):
    errs = {n: rel_err(got[n], want[n]) for n in want}
    assert all(e < tol for e in errs.values()), errs


# ---------------------------------------------------------------- kernels against the references

# The forward kernel's shapes; those with one visible key have a test of their own below.
CASES = {name: shape for name, shape in FORWARD_CASES.items() if name not in ("one-query-causal", "one-key")}


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split-3"])
@pytest.mark.parametrize("case", CASES)
def test_backward_kernels_match_the_reference(case, splits, monkeypatch, configure):
    """Also with the streamed side split among three workgroups a block of fixed rows:
    dq and the packed dk, dv add their parts up, lse takes their logsumexp (causal: some parts see no
    visible score and hold -inf)."""
    configure(attention_splits=splits)
    assert_close(*run_backward(*CASES[case]))


@pytest.mark.parametrize("shape,causal", [((2, 1, 70), True), ((1, 70, 1), False)], ids=["one-query-causal", "one-key"])
def test_one_visible_key_gives_zero_dq_and_dk(shape, causal):
    """With one visible key P = 1 and dP = Delta, so dS = 0: dq and dk vanish (the
    reference only rounds), while lse and dv = dout are as usual."""
    got, want = run_backward(*shape, 2, 2, 64, causal)
    assert_close(got, {n: want[n] for n in ("lse_out", "dv")})
    for n in ("dq", "dk"):
        assert np.abs(got[n]).max() < 1e-5 and np.abs(want[n]).max() < 1e-5, n


def test_lse_rescales_when_a_later_block_has_the_max():
    """Scores grow along the keys and span hundreds: each key block raises every row's
    max, so the running sums are rescaled block after block; exp of an unshifted score
    would overflow f32. (Only lse is compared: with so peaked a softmax, dS = P (dP -
    Delta) nearly cancels, and f32 scores of ~500 leave dq and dk no accurate digits.)"""
    attrs = attention_attrs(1, 1, False, 1.0)
    rng = np.random.default_rng(3)
    q = np.abs(rng.standard_normal((1, 70, 64))) + 0.5
    k = (np.abs(rng.standard_normal((1, 200, 64))) + 0.5) * np.linspace(0.0, 6.0, 200)[None, :, None]
    x = {"q": q, "k": k, "v": rng.standard_normal((1, 200, 64)), "dout": rng.standard_normal((1, 70, 64))}
    inputs = with_row_stats({n: a.astype(np.float32).astype(np.float64) for n, a in x.items()}, attrs)
    got, want = run_backward(1, 70, 200, 1, 1, 64, scale=1.0, inputs=inputs)
    assert np.abs(want["lse_out"]).max() > 300
    assert_close(got, {"lse_out": want["lse_out"]})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_over_whisper_length(causal):
    """1500 queries x 1500 keys at head dim 64, whisper-tiny's encoder."""
    assert_close(*run_backward(1, 1500, 1500, 1, 1, 64, causal, seed=1))


def test_backward_over_many_blocks():
    """llvmpipe (lavapipe) ends an invocation after ~65535 loop iterations in total and
    silently leaves the rest undone. The kernels unroll d, a block's rows and the staging,
    so one iteration a block is left: lse and dq stream 70,000 keys; dk and dv stream
    3 heads x 22,000 queries (grouped-query), 66,000: a loop a key or a query would pass
    the limit (the sizes are kept just past it: this test is among CI's slowest)."""
    assert_close(*run_backward(1, 40, 70_000, 1, 1, 64, seed=2))
    assert_close(*run_backward(1, 22_000, 40, 3, 1, 64, seed=3))


def test_layers_of_one_head_dim_share_pipelines():
    """Shapes, heads, causal and scale live in meta, not in the source; each op has its own."""
    def sources(*shape, causal=False, scale=None):
        g = backward_graph(*shape, attention_attrs(shape[3], shape[4], causal, scale))
        return [codegen.kernel_for(g, n).source for n in g.nodes if n.op in BACKWARD_OPS]
    a, b = sources(2, 70, 70, 6, 2, 64, causal=True), sources(1, 33, 130, 2, 2, 64, scale=0.3)
    assert a == b and len(set(a)) == 3


def test_profiler_counts_each_op_by_its_passes_over_the_scores():
    """The Studio colours them as attention, and the profiler's flops follow their matmul-
    shaped passes: the forward's 2 (q kᵀ, P v), lse's 1, dq's 3, dk and dv's 4."""
    attrs = attention_attrs(6, 2, False, None)
    g = backward_graph(2, 70, 45, 6, 2, 64, attrs)
    q, k, v = (g.inputs[n] for n in "qkv")
    forward = g[g.attention(q, k, v, 6, 2)]
    pairs = 2 * 6 * 70 * 45
    assert estimate_flops(g, forward) == 4 * pairs * 64 + 5 * pairs
    passes = {n.op: (estimate_flops(g, n) - 5 * pairs) / (2 * pairs * 64) for n in g.nodes if n.op in BACKWARD_OPS}
    assert passes == {"attention_lse": 1, "attention_grad_q": 3, "attention_grad_kv": 4}
    assert all(OPS[op].archetype == ATTENTION for op in BACKWARD_OPS)


def test_head_dims_without_tiled_kernels_are_refused_by_codegen():
    g = backward_graph(1, 8, 8, 2, 2, 6, attention_attrs(2, 2, False, None))
    node = next(n for n in g.nodes if n.op == "attention_grad_q")
    with pytest.raises(codegen.UnsupportedOpError, match="head dim 6"):
        codegen.kernel_for(g, node)


# ---------------------------------------------------------------- the part view

def test_parts_of_a_packed_result_bind_its_segments_through_a_plan():
    """``part`` views of one computed flat tensor (and a reshape of one) are its buffer at
    their offsets: a kernel reading two parts and the parts read as outputs give numpy's
    values; an offset off PART_ALIGN or past the end is refused."""
    g = Graph("parts")
    x = g.input("x", (3 * PART_ALIGN + 10,))
    packed = g.exp(x)
    first = g.apply("part", packed, offset=0, shape=(2, 30))
    last = g.apply("part", packed, offset=3 * PART_ALIGN, shape=(10,))
    middle = g.reshape(g.apply("part", packed, offset=PART_ALIGN, shape=(60,)), (2, 30))
    g.output("first", first)
    g.output("last", last)
    g.output("sum", g.add(first, g.mul(middle, middle)))
    value = np.random.default_rng(4).standard_normal(g.shape(x)).astype(np.float32)
    session = build_inference_session(g, optimize=False)
    session.set_input("x", value)
    session.run()
    e = np.exp(value.astype(np.float64))
    want = {"first": e[:60].reshape(2, 30), "last": e[-10:],
            "sum": e[:60].reshape(2, 30) + e[PART_ALIGN:PART_ALIGN + 60].reshape(2, 30) ** 2}
    assert_close({n: session.read_output(n) for n in want}, want)
    assert_close(reference.run(g, {"x": value}, {}, np.float64), want)
    for offset, n in ((1, 10), (3 * PART_ALIGN, 11)):
        with pytest.raises(ShapeError, match="does not fit"):
            g.apply("part", packed, offset=offset, shape=(n,))


def step_tolerances(session) -> tuple[float, float]:
    """(loss, gradients) tolerances of a training step against the float64 reference: f32's,
    or where MEGANEURA_PRECISION=f16 put the matmuls and attention on f16 fragments (a
    device with subgroup matrices; measured 7.6e-4 on the H100) f16's, as test_coop_matmul."""
    return (1e-3, 5e-3) if session.capabilities.matmul_f16 else (1e-5, TOL)


def test_gpu_training_step_with_gradients_that_are_parts():
    """k and v as parameters: their gradients are the parts of attention_grad_kv's result
    themselves, which fill it exactly: the plan lays k and v side by side in their
    arenas and computes that result right over their gradient slots (no copy), and the
    SGD step moves each parameter by -lr times its float64 gradient."""
    g, params, _ = attention_loss_graph(2, 33, 70, 4, 2, 16, True, None)
    params = {n: a.astype(np.float32) for n, a in params.items()}
    session = build_session(g, TrainConfig(optimizer="sgd", lr=0.1), params)
    assert not any(d.kernel == "copy:gradient" for d in session.plan.dispatches)
    group = next(grp for grp in session.plan.groups if "k" in grp.parameters)
    assert group.offset_of("v") == group.offset_of("k") + 4 * params["k"].size
    loss, _ = session.step()
    train, pairs = differentiate(g)
    assert [train[train.outputs[name]].op for p, name in pairs if p in "kv"] == ["part", "part"]
    want = reference.run(train, {}, params, np.float64)
    loss_tol, tol = step_tolerances(session)
    assert abs(loss - want["loss"]) <= loss_tol * abs(want["loss"])
    for p, name in pairs:
        assert rel_err(session.read_output(name), want[name]) < tol, p
        assert rel_err(session.get_parameter(p), params[p] - 0.1 * want[name]) < tol, p


# ---------------------------------------------------------------- the references against the math

def attention_loss_grads_fd(q, k, v, r, attrs, h=1e-6):
    """d sum(attention(q, k, v) * r) / d q, k, v by float64 central differences."""
    grads = []
    for x in (q, k, v):
        grad = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            old = x[idx]
            x[idx] = old + h
            up = (attention_ref(q, k, v, **attrs) * r).sum()
            x[idx] = old - h
            down = (attention_ref(q, k, v, **attrs) * r).sum()
            x[idx] = old
            grad[idx] = (up - down) / (2 * h)
        grads.append(grad)
    return grads


def reference_grads(x, attrs):
    dq = OPS["attention_grad_q"].ref(x["q"], x["k"], x["v"], x["dout"], x["lse"], x["delta"], **attrs)
    kv = OPS["attention_grad_kv"].ref(x["q"], x["k"], x["v"], x["dout"], x["lse"], x["delta"], **attrs)
    dk, dv = (part_ref(kv, at, x["k"].shape) for at in attention_grad_kv_layout(x["k"].shape)[0])
    return dq, dk, dv


def relative_error(got, want):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


REF_CASES = {
    # name: batch, T, S, heads, kv heads, D, causal, scale
    "causal-gqa": (2, 3, 3, 2, 1, 4, True, None),
    "cross-scaled": (1, 3, 5, 2, 2, 4, False, 0.3),
    "causal-fewer-keys-gqa-3": (1, 4, 3, 3, 1, 4, True, 0.8),
}


@pytest.mark.parametrize("case", REF_CASES)
def test_reference_gradients_match_central_differences(case):
    batch, t, s, heads, kv_heads, d, causal, scale = REF_CASES[case]
    attrs = attention_attrs(heads, kv_heads, causal, scale)
    x = backward_inputs(batch, t, s, heads, kv_heads, d, attrs, seed=5, dtype=np.float64)
    fd = attention_loss_grads_fd(x["q"], x["k"], x["v"], x["dout"], attrs)
    for name, got, want in zip("qkv", reference_grads(x, attrs), fd):
        assert relative_error(got, want) < 1e-7, name


TORCH_CASES = {
    "gqa-3-groups-causal": (2, 7, 7, 6, 2, 8, True, None),
    "gqa-2-groups-cross": (2, 5, 9, 6, 3, 8, False, 0.3),
    "mha-cross-causal": (1, 9, 5, 2, 2, 8, True, None),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_reference_gradients_match_torch_autograd(case):
    batch, t, s, heads, kv_heads, d, causal, scale = TORCH_CASES[case]
    attrs = attention_attrs(heads, kv_heads, causal, scale)
    x = backward_inputs(batch, t, s, heads, kv_heads, d, attrs, seed=6, dtype=np.float64)
    q, k, v = (torch.tensor(x[n], requires_grad=True) for n in "qkv")
    split = lambda y, n: y.reshape(batch, y.shape[1], n, d).transpose(1, 2)  # noqa: E731
    # torch's is_causal aligns the mask top-left (key j visible to query i iff j <= i), as ours does
    o = F.scaled_dot_product_attention(split(q, heads), split(k, kv_heads), split(v, kv_heads), is_causal=causal,
                                       scale=scale, enable_gqa=True)
    o.transpose(1, 2).reshape(batch, t, heads * d).backward(torch.tensor(x["dout"]))
    for name, got, want in zip("qkv", reference_grads(x, attrs), (q.grad, k.grad, v.grad)):
        assert relative_error(got, want.numpy()) < 1e-12, name


# ---------------------------------------------------------------- the gradient rule

def attention_loss_graph(batch, t, s, heads, kv_heads, d, causal, scale, seed=7):
    """loss = sum(attention(q, k, v) * R) with q, k, v parameters and R a fixed constant."""
    rng = np.random.default_rng(seed)
    g = Graph("attention-loss")
    q = g.parameter("q", (batch, t, heads * d))
    k, v = (g.parameter(n, (batch, s, kv_heads * d)) for n in "kv")
    out = g.attention(q, k, v, heads, kv_heads, causal=causal, scale=scale)
    r = rng.standard_normal((batch, t, heads * d)).astype(np.float32).astype(np.float64)
    g.output("loss", g.sum(g.mul(out, g.constant(r))))
    params = {n: rng.standard_normal(g[i].shape) for n, i in g.parameters.items()}
    return g, params, r


def gradients(train, pairs, params):
    values = reference.run(train, {}, params, np.float64)
    return {p: values[name] for p, name in pairs}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_rule_matches_the_decomposed_one(causal, monkeypatch):
    # scale 0.5 is exact in float32, as the decomposition's constants are
    g, params, _ = attention_loss_graph(2, 5, 7, 6, 2, 8, causal, 0.5)
    fused, pairs = differentiate(g)
    ops = [n.op for n in fused.nodes]
    assert all(ops.count(op) == 1 for op in BACKWARD_OPS) and ops.count("part") == 2 and "softmax" not in ops
    assert not any(n.shape[-2:] == (5, 7) for n in fused.nodes)   # no [.., T, S] tensor
    monkeypatch.setitem(autodiff.GRADIENTS, "attention", autodiff.decomposed_attention_grad)
    decomposed, decomposed_pairs = differentiate(g)
    assert "softmax" in [n.op for n in decomposed.nodes] and decomposed_pairs == pairs
    want = gradients(decomposed, pairs, params)
    for name, got in gradients(fused, pairs, params).items():
        assert np.abs(got - want[name]).max() <= 1e-12 * np.abs(want[name]).max(), name


def test_head_dims_without_tiled_kernels_keep_the_decomposed_rule():
    g, params, r = attention_loss_graph(1, 4, 4, 2, 1, 6, True, None)
    train, pairs = differentiate(g)
    ops = {n.op for n in train.nodes}
    assert "softmax" in ops and not ops & set(BACKWARD_OPS)
    fd = attention_loss_grads_fd(*(params[n].copy() for n in "qkv"), r, attention_attrs(2, 1, True, None))
    got = gradients(train, pairs, params)
    for name, want in zip("qkv", fd):
        assert relative_error(got[name], want) < 1e-6, name


def test_second_derivatives_of_attention_are_refused():
    g = Graph("second")
    q, k, v = (g.parameter(n, (1, 4, 8)) for n in "qkv")
    lse = g.apply("attention_lse", q, k, num_heads=2)
    g.output("loss", g.sum(lse))
    with pytest.raises(GraphError, match="attention_lse.*no gradient rule"):
        differentiate(g)


# ---------------------------------------------------------------- training

def attention_block(batch=2, t=70, width=64, heads=4, kv_heads=2):
    """x -> q, k, v projections -> causal grouped-query attention -> output projection -> mse."""
    g = Graph("attention-block")
    x, target = g.input("x", (batch, t, width)), g.input("target", (batch, t, width))
    d = width // heads
    q = g.matmul(x, g.parameter("wq", (width, width)))
    k = g.matmul(x, g.parameter("wk", (width, kv_heads * d)))
    v = g.matmul(x, g.parameter("wv", (width, kv_heads * d)))
    out = g.matmul(g.attention(q, k, v, heads, kv_heads, causal=True), g.parameter("wo", (width, width)))
    g.output("loss", g.mse_loss(out, target))
    return g


def test_gpu_training_step_gradients_match_the_reference():
    g = attention_block()
    rng = np.random.default_rng(8)
    params = {n: (rng.standard_normal(g[i].shape) / math.sqrt(g[i].shape[0])).astype(np.float32)
              for n, i in g.parameters.items()}
    batch = {n: rng.standard_normal(g[i].shape).astype(np.float32) for n, i in g.inputs.items()}
    session = build_session(g, TrainConfig(optimizer="sgd", lr=0.1), params)
    kernels = {d.kernel.split(":")[0] for d in session.plan.dispatches}
    # the forward keeps its log-sum-exp for the backward (engine.optimize.attention_stats)
    assert kernels >= set(BACKWARD_OPS) - {"attention_lse"} | {"attention_stats"} and "attention_lse" not in kernels
    session.set_inputs(batch)
    loss, _ = session.step()
    train, pairs = differentiate(g)
    want = reference.run(train, batch, params, np.float64)
    loss_tol, tol = step_tolerances(session)
    assert abs(loss - want["loss"]) <= loss_tol * abs(want["loss"])
    for p, name in pairs:
        assert rel_err(session.read_output(name), want[name]) < tol, p


def whisper_training_plan(decomposed: bool, monkeypatch) -> tuple:
    """whisper-tiny's training graph at mel_len=3000 (T = S = 1500, 6 heads of 64), fused,
    differentiated and fused again as a TrainingSession does, and its plan (no GPU needed)."""
    if decomposed:
        monkeypatch.setitem(autodiff.GRADIENTS, "attention", autodiff.decomposed_attention_grad)
    graph = models.create("whisper-tiny", mel_len=3000).build(train=True)
    forward, _ = optimize(graph)
    train, pairs = differentiate(forward)
    train, _ = optimize(train)
    spec = OptimizerSpec.from_config(TrainConfig(), graph, [p for p, _ in pairs])
    monkeypatch.undo()
    return train, compile_plan(train, gradients=dict(pairs), optimizer=spec)


def test_whisper_training_plan_holds_no_score_matrix(monkeypatch):
    train, plan = whisper_training_plan(False, monkeypatch)
    assert not [n for n in train.nodes if n.shape[-2:] == (1500, 1500)]
    ops = [n.op for n in train.nodes]
    assert all(ops.count(op) == 4 for op in BACKWARD_OPS)   # one of each per layer
    decomposed, before = whisper_training_plan(True, monkeypatch)
    assert [n for n in decomposed.nodes if n.shape[-2:] == (1500, 1500)]
    assert plan.peak_bytes < 0.6 * before.peak_bytes, (plan.peak_bytes, before.peak_bytes)


def test_fixed_rows_follow_the_devices_workgroup_memory():
    """As many fixed rows a workgroup (64, 32, 16) as the device's workgroup memory holds:
    at D = 64, NVIDIA's 48 KiB holds 32 (lse, which keeps no block of P: 64), lavapipe's
    32 KiB 16 (lse: 32); no kernel declares more than the limit. On lavapipe the 64-row
    kernels run at D = 8 (CASES' head-dim-8) and for lse at D = 36, the 32-row ones at
    D = 36 and for lse at D = 64, the 16-row ones at D = 64."""
    lavapipe, nvidia = codegen.Capabilities(), codegen.Capabilities(workgroup_storage=49152)
    g = backward_graph(1, 1500, 1500, 6, 6, 64, attention_attrs(6, 6, False, None))
    for caps, small in ((lavapipe, 16), (nvidia, 32)):
        for n in (n for n in g.nodes if n.op in BACKWARD_OPS):
            rows = 2 * small if n.op == "attention_lse" else small
            kernel = codegen.kernel_for(g, n, caps)
            assert kernel.notes["variant"].startswith(f"tiled backward: {rows} "), kernel.notes["variant"]
            assert f"@workgroup_size({4 * rows})" in kernel.source
            grads = n.op != "attention_lse"
            assert codegen.attention_backward_bytes(rows, 64, grads, grads) <= caps.workgroup_storage
    modes = codegen.ATTENTION_BACKWARD
    assert [codegen.attention_backward_rows(d, modes["attention_grad_q"], lavapipe) for d in (8, 36, 64)] == [64, 32, 16]
    assert [codegen.attention_backward_rows(d, modes["attention_lse"], lavapipe) for d in (8, 36, 64)] == [64, 64, 32]


@pytest.mark.parametrize("case", ["gqa-3-groups-causal", "cross-more-keys"])
def test_staging_without_the_register_prefetch_matches_too(case, monkeypatch, configure):
    """dq and dkdv fetch a block's streamed operands into registers at its start (dv ran 20%
    faster on the H100, dq 2%), dkdv's dO staged from there twice; MEGANEURA_ATTENTION_PREFETCH=0
    stages them where they are used, for benchmarks, and must give the same results."""
    g = backward_graph(*CASES[case][:6], attention_attrs(*CASES[case][3:5], *CASES[case][6:]))
    caps = lambda: codegen.Capabilities(knobs=config.current().knobs)  # noqa: E731
    sources = lambda: {n.op: codegen.kernel_for(g, n, caps()).source for n in g.nodes if n.op in BACKWARD_OPS}
    prefetched = sources()
    configure(attention_prefetch=0)
    direct = sources()
    for op in ("attention_grad_q", "attention_grad_kv"):
        assert "let pre0 = fetch_element" in prefetched[op] and "let pre0" not in direct[op], op
    assert prefetched["attention_grad_kv"].count("put_element(tid + 0u, ypre0);") == 2
    assert prefetched["attention_grad_q"].count("put_element(tid + 0u, ypre0);") == 1
    assert "ypre" not in direct["attention_grad_q"] + direct["attention_grad_kv"]
    assert prefetched["attention_lse"] == direct["attention_lse"]
    assert_close(*run_backward(*CASES[case]))
