"""The fusion optimizer: each rule fires where it must and not where it must not, and
optimization never changes what a graph computes (float64 reference, and PyTorch)."""

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from engine import codegen
from engine.graph import reference
from engine.graph.ir import Graph
from engine.optimize import optimize
from engine.optimize.synthetic import decomposed_attention, transformer

RNG = np.random.default_rng(0)


def _values(g):
    rng = np.random.default_rng(1)
    ins = {k: rng.standard_normal(g[v].shape) for k, v in g.inputs.items()}
    ps = {k: rng.standard_normal(g[v].shape) * 0.5 + (1.0 if len(g[v].shape) == 1 else 0.0)
          for k, v in g.parameters.items()}
    return ins, ps


def check_same(g, o):
    ins, ps = _values(g)
    before = reference.run(g, ins, ps, np.float64)
    after = reference.run(o, ins, ps, np.float64)
    assert set(before) == set(after)
    for k in before:
        scale = max(np.abs(before[k]).max(), 1e-300)
        assert np.abs(before[k] - after[k]).max() / scale < 1e-10, k
    assert o.inputs.keys() == g.inputs.keys() and o.parameters.keys() == g.parameters.keys()
    for k in g.parameters:
        assert o[o.parameters[k]].shape == g[g.parameters[k]].shape
        assert o.param_meta[k] == g.param_meta[k]
    assert sorted(c.tobytes() for c in o.constants.values()) == sorted(c.tobytes() for c in g.constants.values())


def ops_of(o):
    return [n.op for n in o.nodes]


# ---------------------------------------------------------------- graph builders per rule
# each takes `shared`: when True the intermediate the rule would swallow has another reader

def _mm(g, shared, m=4, k=8, n=16, ta=False, tb=False):
    a = g.input("a", (k, m) if ta else (m, k))
    b = g.parameter("b", (n, k) if tb else (k, n))
    y = g.matmul(a, b, transpose_a=ta, transpose_b=tb)
    return y


def _extra_use(g, t, shared):
    if shared:
        g.output("extra", g.exp(t))


def matmul_bias(shared):
    g = Graph()
    y = _mm(g, shared)
    _extra_use(g, y, shared)
    g.output("out", g.bias_add(y, g.parameter("bias", (16,))))
    return g


def matmul_add_left_transposed(shared):
    g = Graph()
    y = _mm(g, shared, ta=True, tb=True)
    _extra_use(g, y, shared)
    g.output("out", g.add(g.input("r", (4, 16)), y))
    return g


def matmul_activation(shared):
    g = Graph()
    y = g.bias_add(_mm(g, shared), g.parameter("bias", (16,)))
    _extra_use(g, y, shared)
    g.output("out", g.relu(y))
    return g


def matmul_residual(shared):
    g = Graph()
    y = g.gelu(g.bias_add(_mm(g, shared), g.parameter("bias", (16,))))
    _extra_use(g, y, shared)
    g.output("out", g.add(y, g.input("res", (4, 16))))
    return g


def silu(shared):
    g = Graph()
    x = g.input("x", (3, 5))
    s = g.sigmoid(x)
    _extra_use(g, s, shared)
    g.output("out", g.mul(s, x))
    return g


def swiglu(shared):
    g = Graph()
    x, u = g.input("x", (3, 5)), g.input("u", (3, 5))
    s = g.silu(x)
    _extra_use(g, s, shared)
    g.output("out", g.mul(u, s))
    return g


def _eps(g):
    return g.constant(np.float32(1e-5))


def layer_norm(shared):
    g = Graph()
    x = g.input("x", (3, 6))
    mu = g.mean(x, axis=-1, keepdims=True)
    d = g.sub(x, mu)
    var = g.mean(g.mul(d, d), axis=-1, keepdims=True)
    n = g.div(d, g.sqrt(g.add(var, _eps(g))))
    _extra_use(g, var, shared)
    g.output("out", g.add(g.mul(n, g.parameter("w", (6,))), g.parameter("b", (6,))))
    return g


def rms_norm(shared):
    g = Graph()
    x = g.input("x", (3, 6))
    ms = g.mean(g.pow(x, 2.0), axis=-1, keepdims=True)
    r = g.rsqrt(g.add(ms, _eps(g)))
    _extra_use(g, r, shared)
    g.output("out", g.mul(g.mul(x, r), g.parameter("w", (6,))))
    return g


def softmax(shared):
    g = Graph()
    x = g.input("x", (3, 6))
    e = g.exp(g.sub(x, g.max(x, axis=-1, keepdims=True)))
    s = g.sum(e, axis=-1, keepdims=True)
    _extra_use(g, s, shared)
    g.output("out", g.div(e, s))
    return g


def log_softmax(shared):
    g = Graph()
    x = g.input("x", (3, 6))
    d = g.sub(x, g.max(x, axis=-1, keepdims=True))
    lse = g.log(g.sum(g.exp(d), axis=-1, keepdims=True))
    _extra_use(g, lse, shared)
    g.output("out", g.sub(d, lse))
    return g


def norm_matmul(shared):
    g = Graph()
    r = g.rms_norm(g.input("x", (4, 8)), g.parameter("w", (8,)))
    _extra_use(g, r, shared)
    g.output("out", g.matmul(r, g.parameter("b", (16, 8)), transpose_b=True))
    return g


def group_norm_silu(shared):
    g = Graph()
    y = g.group_norm(g.input("x", (2, 6, 5)), g.parameter("w", (6,)), g.parameter("b", (6,)), num_groups=3)
    _extra_use(g, y, shared)
    g.output("out", g.silu(y))
    return g


def attention(shared):
    g = Graph()
    q, k, v = (g.input(n, (2, 5, 8)) for n in "qkv")
    out = decomposed_attention(g, q, k, v, heads=2, causal=True)
    if shared:   # the attention probabilities are also an output
        probs = next(n.id for n in g.nodes if n.op == "softmax")
        g.output("probs", probs)
    g.output("out", out)
    return g


def transpose_transpose(shared):
    g = Graph()
    t = g.transpose(g.input("x", (2, 3, 4)), (2, 0, 1))
    _extra_use(g, t, shared)
    g.output("out", g.exp(g.transpose(t, (1, 2, 0))) if not shared else g.exp(g.transpose(t, (0, 2, 1))))
    return g


def reshape_chain(shared):
    g = Graph()
    x = g.input("x", (2, 3, 4))
    inner = g.transpose(x, (1, 0, 2)) if shared else g.reshape(x, (6, 4))
    r = g.reshape(inner, (4, 6))
    g.output("out", g.exp(r))
    return g


def mul_one(shared):
    g = Graph()
    x = g.exp(g.input("x", (3,)))
    g.output("out", g.mul(g.constant(np.float32(2.0 if shared else 1.0)), x))
    return g


def add_zero(shared):
    g = Graph()
    x = g.exp(g.input("x", (3,)))
    g.output("out", g.add(x, g.constant(np.float32(0.5 if shared else 0.0))))
    return g


def double_negation(shared):
    g = Graph()
    n = g.neg(g.input("x", (3,)))
    _extra_use(g, n, shared)
    g.output("out", g.exp(g.neg(n) if not shared else n))
    return g


def cse(shared):
    g = Graph()
    x = g.input("x", (3,))
    g.output("out", g.mul(g.exp(x), g.exp(x if not shared else g.neg(x))))
    return g


def pointwise_dag(shared):
    g = Graph()
    x = g.input("x", (3, 4))
    e = g.exp(x)
    _extra_use(g, e, shared)
    t = g.tanh(e)
    g.output("out", g.matmul(t if shared else g.mul(t, x), g.parameter("w", (4, 2))))
    return g


CASES = [  # rule, builder, op that must appear when it fires (None: just the count)
    ("matmul_add", matmul_bias, "fused_matmul"),
    ("matmul_add", matmul_add_left_transposed, "fused_matmul"),
    ("matmul_activation", matmul_activation, "fused_matmul"),
    ("matmul_residual", matmul_residual, "fused_matmul"),
    ("silu", silu, "silu"),
    ("swiglu", swiglu, "swiglu"),
    ("layer_norm_decomposed", layer_norm, "layer_norm"),
    ("rms_norm_decomposed", rms_norm, "rms_norm"),
    ("softmax_decomposed", softmax, "softmax"),
    ("log_softmax_decomposed", log_softmax, "log_softmax"),
    ("norm_matmul", norm_matmul, "norm_matmul"),
    ("group_norm_silu", group_norm_silu, None),
    ("attention_decomposed", attention, "attention"),
    ("transpose_transpose", transpose_transpose, None),
    ("reshape_chain", reshape_chain, None),
    ("mul_one", mul_one, None),
    ("add_zero", add_zero, None),
    ("double_negation", double_negation, None),
    ("cse", cse, None),
    ("pointwise_dag", pointwise_dag, "pointwise"),
]


@pytest.mark.parametrize("rule,build,op", CASES, ids=[f"{r}-{b.__name__}" for r, b, _ in CASES])
def test_rule_fires(rule, build, op):
    g = build(False)
    o, rep = optimize(g)
    assert rep.rules[rule] >= 1, rep.format_table()
    if op:
        assert op in ops_of(o)
    assert rep.nodes_after < rep.nodes_before
    assert rep.bytes_after <= rep.bytes_before
    check_same(g, o)


@pytest.mark.parametrize("rule,build,op", CASES, ids=[f"{r}-{b.__name__}" for r, b, _ in CASES])
def test_rule_does_not_fire(rule, build, op):
    g = build(True)
    o, rep = optimize(g)
    assert rep.rules[rule] == 0, rep.format_table()
    if op and op != "pointwise" and not rule.startswith("matmul"):
        assert ops_of(o).count(op) == ops_of(g).count(op)
    check_same(g, o)


def _weight_grad(k, m=64, n=96):
    g = Graph("dw")
    x = g.input("x", (k, m))
    dy = g.input("dy", (k, n))
    g.output("dw", g.matmul(x, dy, transpose_a=True))
    return g


@pytest.mark.usefixtures("f32_kernels")
def test_weight_gradient_stays_one_matmul_and_its_kernel_splits_k():
    """Split-K is the kernel's choice (codegen.matmul_splits), not a graph rewrite: the
    optimized graph keeps dW as one matmul, and its dispatch cuts K into slices (the f32
    kernel's, whose tiles the split rule below counts)."""
    from engine.runtime.session import build_inference_session
    g = _weight_grad(2048)
    o, rep = optimize(g)
    assert [n.op for n in o.nodes if n.op not in ("input", "parameter")] == ["matmul"], rep.format_table()
    ins, _ = _values(g)
    s = build_inference_session(o, optimize=False)
    s.set_inputs(ins)
    s.run()
    splits = codegen.split_rule(2, 2048)   # dW is 64 x 96: two 64 x 64 tiles, K = 2048
    assert splits > 1 and f"K split {splits} ways" in s.plan.dispatches[0].variant, s.plan.dispatches[0].variant
    want = ins["x"].T @ ins["dy"]
    assert np.abs(s.read_output("dw") - want).max() / np.abs(want).max() < 1e-5


def test_group_norm_silu_attribute():
    o, _ = optimize(group_norm_silu(False))
    assert [n.attrs["activation"] for n in o.nodes if n.op == "group_norm"] == ["silu"]


def test_against_torch():
    g = matmul_residual(False)
    o, _ = optimize(g)
    ins, ps = _values(g)
    got = reference.run(o, ins, ps, np.float64)["out"]
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    want = torch.nn.functional.gelu(t(ins["a"]) @ t(ps["b"]) + t(ps["bias"])) + t(ins["res"])
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_report_dict_and_table():
    g = transformer(layers=1, width=16, heads=2, mlp=32, seq=4)
    o, rep = optimize(g)
    d = rep.to_dict()
    for key in ("nodes_before", "nodes_after", "dispatches_before", "dispatches_after", "bytes_before",
                "bytes_after", "rules", "rule_bytes_saved", "saturated", "stop_reason", "seconds", "origins"):
        assert key in d
    assert d["saturated"] is True and d["stop_reason"] == "saturated"
    assert d["dispatches_after"] < d["dispatches_before"] and d["bytes_after"] < d["bytes_before"]
    assert set(map(int, d["origins"])) == set(range(len(o)))
    att = next(n.id for n in o.nodes if n.op == "attention")
    assert {g[i].op for i in rep.origins[att]} >= {"softmax", "matmul", "transpose", "reshape"}
    assert "attention_decomposed" in rep.format_table()
    check_same(g, o)


def test_iteration_limit_is_reported():
    _, rep = optimize(transformer(layers=1, width=16, heads=2, mlp=32, seq=4), max_iterations=1)
    assert not rep.saturated and rep.stop_reason == "iteration_limit"


def test_optimizing_twice_changes_nothing_more():
    o1, _ = optimize(transformer(layers=2, width=16, heads=2, mlp=32, seq=4))
    o2, rep = optimize(o1)
    assert len(o2) == len(o1) and sum(rep.rules.values()) == 0


# ---------------------------------------------------------------- random graphs

BINOPS = ["add", "sub", "mul"]
UNOPS = ["exp", "tanh", "sigmoid", "neg", "relu", "silu", "gelu"]


@st.composite
def random_graphs(draw):
    g = Graph("random")
    pool = [g.input("x", (3, 4)), g.input("y", (3, 4)), g.parameter("b", (4,))]
    full = pool[:2]
    for i in range(draw(st.integers(3, 12))):
        kind = draw(st.sampled_from(["un", "bin", "mm", "bias", "one"]))
        a = draw(st.sampled_from(full))
        if kind == "un":
            n = g.apply(draw(st.sampled_from(UNOPS)), a)
        elif kind == "bin":
            n = g.apply(draw(st.sampled_from(BINOPS)), a, draw(st.sampled_from(full)))
        elif kind == "mm":
            n = g.matmul(a, g.parameter(f"w{i}", (4, 4)), transpose_b=draw(st.booleans()))
        elif kind == "bias":
            n = g.bias_add(a, pool[2])
        else:
            n = g.mul(a, g.constant(np.float32(1.0)))
        full.append(n)
    outs = draw(st.lists(st.sampled_from(full[2:]), min_size=1, max_size=3, unique=True))
    for j, o in enumerate(outs):
        g.output(f"o{j}", o)
    return g


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_graphs_keep_their_outputs(g):
    o, rep = optimize(g)
    assert rep.bytes_after <= rep.bytes_before
    check_same(g, o)


# ---------------------------------------------------------------- scale

def test_deep_chain():
    g = Graph("chain")
    x = g.input("x", (2, 8))
    w = g.parameter("w", (8, 8))
    for i in range(400):      # 1,200+ nodes deep
        x = g.tanh(g.bias_add(g.matmul(x, w), g.parameter(f"b{i}", (8,))))
    g.output("y", x)
    t = time.perf_counter()
    o, rep = optimize(g)
    print(f"\n1,200-node chain: {time.perf_counter() - t:.2f} s, {rep.stop_reason}")
    assert len(g) > 1200 and rep.stop_reason in ("saturated", "iteration_limit", "node_limit", "time_limit")
    assert rep.rules["matmul_add"] == 400
    check_same(g, o)


def test_24_layer_transformer():
    g = transformer(layers=24, width=16, heads=2, mlp=32, seq=4, causal=True)
    t = time.perf_counter()
    o, rep = optimize(g)
    print(f"\n24-layer transformer ({len(g)} nodes): {time.perf_counter() - t:.2f} s, {rep.stop_reason}")
    assert rep.rules["attention_decomposed"] == 24 and rep.rules["matmul_residual"] == 48
    assert isinstance(rep.saturated, bool) and rep.stop_reason


def test_rule_nodes_point_at_the_nodes_a_rule_produced():
    g = matmul_bias(False)
    o, rep = optimize(g)
    fused = [n.id for n in o.nodes if n.op == "fused_matmul"]
    assert fused and rep.rule_nodes["matmul_add"] == fused
    assert rep.to_dict()["rule_nodes"]["matmul_add"] == fused
    # every rule that fired names nodes of the result, and only those rules do
    fired = {k for k, v in rep.rules.items() if v and k != "cse"}
    assert set(rep.rule_nodes) <= set(rep.rules) and fired <= set(rep.rule_nodes)
    assert all(0 <= i < len(o.nodes) for ids in rep.rule_nodes.values() for i in ids)
    t = transformer(layers=1, width=16, heads=2, mlp=32, seq=4)
    o, rep = optimize(t)
    assert [o[i].op for i in rep.rule_nodes["attention_decomposed"]] == ["attention"]
    assert all(o[i].op == "pointwise" for i in rep.rule_nodes.get("pointwise_dag", []))


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_optimize_in_a_thread_frees_the_egraph_there():
    """egglog's EGraph may only be dropped on the thread that made it."""
    import gc
    import threading
    errors = []
    t = threading.Thread(target=lambda: optimize(matmul_bias(False)))
    old = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        t.start()
        t.join()
        gc.collect()          # would raise "unsendable, but is being dropped on another thread"
    finally:
        threading.excepthook = old
    assert not errors


def test_optimize_frees_the_egraph_without_a_full_collection(monkeypatch):
    """A gc.collect() on the Studio's optimizer thread finalized the GUI thread's garbage
    (Qt objects) there and deadlocked against the main thread at window close; the
    EGraph is freed by dropping its last reference instead."""
    import gc
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    optimize(matmul_bias(False))
    assert calls == []


@pytest.mark.parametrize("rows,columns,fused", [(8, 257, True), (8, 8192, True), (2, 49152, True), (9, 257, False),
                                                 (2048, 257, False)])
def test_norm_matmul_only_where_the_few_row_kernel_takes_it(rows, columns, fused):
    """rms_norm feeding a matmul fuses into norm_matmul where the product has at most
    codegen's few-row count of rows (the vector kernel sums each row's squares once a
    workgroup, however wide the output: a decode step's LM head); on more rows (a
    training step's or a prefill's LM head) the norm stays apart and the product takes the
    tiled or cooperative kernel instead of the simple one."""
    from engine.codegen.matmul import VECTOR_ROWS
    from engine.optimize.rules import NORM_MATMUL_MAX_ROWS
    assert NORM_MATMUL_MAX_ROWS == VECTOR_ROWS
    g = Graph("head")
    x, w = g.input("x", [rows, 24]), g.parameter("w", [24])
    g.output("y", g.matmul(g.apply("rms_norm", x, w), g.parameter("b", [24, columns])))
    opt, report = optimize(g)
    assert ({n.op for n in opt.nodes} >= {"norm_matmul"}) == fused
    assert report.to_dict()["rules"]["norm_matmul"] == int(fused)
