"""GPU kernels of the ONNX import ops (engine/graph/ops.py, "ONNX import ops") against
the float64 reference: NaN/inf/signed-zero edge cases, ragged shapes, broadcasting,
i32 operands, and one fused chain."""

import numpy as np
import pytest

from engine import Graph
from engine.graph import reference
from engine.runtime.session import build_inference_session

EW_TOL = 1e-6     # elementwise ops
WIN_TOL = 1e-5    # convolution and pooling

NAN, INF = np.nan, np.inf


def compare(name, found, expected, tol, elementwise_floor=None):
    """NaN where the reference has NaN, the same infinities, and on the rest a relative
    error (max |found - expected| / max |expected|) under tol; with ``elementwise_floor``
    each element must also be within tol * max(|expected|, floor)."""
    f, e = np.asarray(found, np.float64), np.asarray(expected, np.float64)
    assert f.shape == e.shape, (name, f.shape, e.shape)
    nan = np.isnan(e)
    assert np.array_equal(np.isnan(f), nan), f"{name}: NaN at {np.argwhere(np.isnan(f) != nan)[:5].tolist()}"
    inf = np.isinf(e)
    assert np.array_equal(f[inf], e[inf]), f"{name}: infinities differ: {f[inf]} vs {e[inf]}"
    ok = ~nan & ~inf
    assert np.isfinite(f[ok]).all(), f"{name}: non-finite where the reference is finite"
    scale = max(np.abs(e[ok]).max(initial=0.0), 1e-30)
    err = np.abs(f[ok] - e[ok]).max(initial=0.0) / scale
    assert err < tol, f"{name}: relative error {err:.3g} over {tol}"
    if elementwise_floor is not None:
        rel = np.abs(f[ok] - e[ok]) / np.maximum(np.abs(e[ok]), elementwise_floor)
        assert rel.max(initial=0.0) < tol, f"{name}: elementwise relative error {rel.max():.3g} at " \
                                           f"{e[ok][rel.argmax()]!r}"


def run_gpu(g, inputs, optimize=False):
    s = build_inference_session(g, optimize=optimize)
    s.set_inputs(inputs)
    s.run()
    ref = reference.run(g, inputs, {}, np.float64)
    return s, {k: s.read_output(k) for k in g.outputs}, ref


def check(g, inputs, tol=EW_TOL, exact=(), floors=None, optimize=False):
    s, out, ref = run_gpu(g, inputs, optimize)
    for k in g.outputs:
        if k in exact:
            assert out[k].dtype == ref[k].dtype or out[k].dtype.kind == ref[k].dtype.kind == "f", \
                (k, out[k].dtype, ref[k].dtype)
            np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
        else:
            compare(k, out[k], ref[k], tol, (floors or {}).get(k))
    return s, out, ref


EDGES = np.array([NAN, INF, -INF, 0.0, -0.0, 1e-4, -1e-4, 0.5, -0.5, 1.5, -1.5, 2.0, -3.0, 30.0, -30.0,
                  88.0, -88.0, 1e-30, -1e-30, 7.25, -7.25], np.float32)


def ragged(rng, shape, scale=3.0, edges=EDGES):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    flat = x.reshape(-1)
    flat[:len(edges)] = edges
    return x


# ---------------------------------------------------------------- unary

UNARY = ["erf", "softplus", "floor", "ceil", "sign", "logical_not"]


def test_unary_ops_with_edge_cases():
    g = Graph("onnx_unary")
    x = g.input("x", [7, 45])
    for op in UNARY:
        g.output(op, g.apply(op, x))
    g.output("leaky_relu", g.apply("leaky_relu", x))
    g.output("leaky_relu_0.3", g.apply("leaky_relu", x, alpha=0.3))
    xs = ragged(np.random.default_rng(0), (7, 45))
    xs[3, :4] = [-1.0, 1.0, 0.25, -0.75]
    _, out, ref = check(g, {"x": xs}, exact=("floor", "ceil", "sign", "logical_not"),
                        floors={"erf": 1e-30, "leaky_relu": 1e-30, "leaky_relu_0.3": 1e-30})
    # signs and NaN handling spelled out, independent of the reference
    assert out["leaky_relu"][0, 0] != out["leaky_relu"][0, 0]           # NaN kept
    assert out["logical_not"][0, :5].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert np.isnan(out["sign"][0, 0]) and np.isnan(out["erf"][0, 0]) and np.isnan(out["softplus"][0, 0])
    assert out["erf"][0, 1:3].tolist() == [1.0, -1.0]


def test_erf_relative_accuracy_everywhere():
    g = Graph("erf")
    x = g.input("x", [4003])
    g.output("erf", g.apply("erf", x))
    mags = np.concatenate([np.logspace(-20, 0.7, 2000), np.linspace(0.0, 6.0, 1001)[1:]])
    xs = np.concatenate([mags, -mags, [0.0, 10.0, -10.0, 1.0]]).astype(np.float32)[:4003]
    xs = np.pad(xs, (0, 4003 - len(xs)), constant_values=0.75)
    check(g, {"x": xs}, floors={"erf": 1e-35})


def test_softplus_accurate_over_its_range():
    g = Graph("softplus")
    x = g.input("x", [1501])
    g.output("y", g.apply("softplus", x))
    xs = np.linspace(-15.0, 40.0, 1501).astype(np.float32)
    check(g, {"x": xs}, floors={"y": 1e-30})


# ---------------------------------------------------------------- binary, f32 and i32

def test_maximum_minimum_f32_broadcast_nan():
    g = Graph("maxmin")
    a = g.input("a", [5, 1, 9])
    b = g.input("b", [4, 9])
    for op in ("maximum", "minimum"):
        g.output(op, g.apply(op, a, b))
        g.output(op + "_r", g.apply(op, b, a))
    rng = np.random.default_rng(1)
    av = ragged(rng, (5, 1, 9))
    bv = ragged(rng, (4, 9), edges=np.array([1.0, NAN, 0.0, -INF, INF], np.float32))
    _, out, _ = check(g, {"a": av, "b": bv}, exact=("maximum", "minimum", "maximum_r", "minimum_r"))
    assert np.isnan(out["maximum"][0, 0, 1]) and np.isnan(out["minimum_r"][1, 0, 1])   # NaN from b[0, 1]
    assert np.isnan(out["minimum"][0, 1, 0]) and np.isnan(out["maximum_r"][0, 2, 0])   # NaN from a[0, 0, 0]


def test_maximum_minimum_i32():
    g = Graph("maxmin_i32")
    a = g.input("a", [3, 1, 17], "i32")
    b = g.input("b", [5, 17], "i32")
    g.output("max", g.apply("maximum", a, b))
    g.output("min", g.apply("minimum", b, a))
    rng = np.random.default_rng(2)
    av = rng.integers(-2**31, 2**31 - 1, (3, 1, 17), dtype=np.int64).astype(np.int32)
    bv = rng.integers(-50, 50, (5, 17)).astype(np.int32)
    _, out, _ = check(g, {"a": av, "b": bv}, exact=("max", "min"))
    assert out["max"].dtype == np.int32


def test_power_tensor_exponent():
    g = Graph("power")
    x = g.input("x", [6, 40])
    y = g.input("y", [40])
    g.output("p", g.apply("power", x, y))
    g.output("q", g.apply("power", y, x))
    rng = np.random.default_rng(3)
    xs = rng.uniform(0.2, 3.0, (6, 40)).astype(np.float32)
    xs[1] = -xs[1]                                        # negative bases
    ys = np.round(rng.uniform(-4, 4, 40)).astype(np.float32)
    ys[:8] = [0.5, -1.5, 2.25, 0.0, -0.0, 3.0, -3.0, NAN]   # fractional: NaN for negative bases
    xs[2, :12] = [0.0, 0.0, 0.0, NAN, 1.0, -0.0, 0.0, -0.0, 1.0, -1.0, INF, -INF]
    xs[3, 5:8] = [-1.0, -2.0, 1.0]
    with np.errstate(all="ignore"):
        check(g, {"x": xs, "y": ys}, floors={"p": 1e-30})


def test_power_edge_exponents():
    g = Graph("power_edges")
    x = g.input("x", [12])
    y = g.input("y", [12])
    g.output("p", g.apply("power", x, y))
    xs = np.array([-1.0, -1.0, 1.0, 2.0, 0.5, -2.0, -0.5, 0.0, 0.0, -0.0, INF, -INF], np.float32)
    ys = np.array([INF, -INF, NAN, INF, INF, -INF, INF, -1.0, -0.5, -3.0, -2.0, 3.0], np.float32)
    with np.errstate(all="ignore"):
        check(g, {"x": xs, "y": ys}, exact=("p",))


COMPARE = ["equal", "less", "greater", "less_equal", "greater_equal"]


@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_comparisons(dtype):
    g = Graph("cmp")
    a = g.input("a", [3, 1, 11], dtype)
    b = g.input("b", [4, 11], dtype)
    for op in COMPARE:
        g.output(op, g.apply(op, a, b))
    rng = np.random.default_rng(4)
    if dtype == "f32":
        av = np.round(ragged(rng, (3, 1, 11))).astype(np.float32)
        bv = np.round(ragged(rng, (4, 11), edges=np.array([NAN, 0.0, -0.0, INF, 2.0, -3.0], np.float32)))
        bv = bv.astype(np.float32)
    else:
        av = rng.integers(-3, 4, (3, 1, 11)).astype(np.int32)
        bv = rng.integers(-3, 4, (4, 11)).astype(np.int32)
    _, out, ref = check(g, {"a": av, "b": bv}, exact=tuple(COMPARE))
    for op in COMPARE:
        assert out[op].dtype == np.float32 and set(np.unique(out[op])) <= {0.0, 1.0}
        assert 0 < out[op].sum() < out[op].size or op == "equal"


@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_where(dtype):
    g = Graph("where")
    c = g.input("c", [4, 1, 13])
    x = g.input("x", [13], dtype)
    y = g.input("y", [3, 13], dtype)
    g.output("w", g.apply("where", c, x, y))
    rng = np.random.default_rng(5)
    cv = (rng.random((4, 1, 13)) < 0.5).astype(np.float32)
    cv[0, 0, :5] = [NAN, -0.0, 0.0, -2.0, INF]             # NaN and -2 are true, -0 false
    if dtype == "f32":
        xv, yv = ragged(rng, (13,), edges=EDGES[:13]), ragged(rng, (3, 13), edges=np.array([-INF, 5.0], np.float32))
    else:
        xv = rng.integers(-1000, 1000, 13).astype(np.int32)
        yv = rng.integers(-2**31, 2**31 - 1, (3, 13), dtype=np.int64).astype(np.int32)
    _, out, _ = check(g, {"c": cv, "x": xv, "y": yv}, exact=("w",))
    assert out["w"].dtype == (np.int32 if dtype == "i32" else np.float32)


def test_cast_both_ways():
    g = Graph("cast")
    x = g.input("x", [5, 23])
    i = g.input("i", [5, 23], "i32")
    g.output("f2i", g.apply("cast", x, dtype="i32"))
    g.output("i2f", g.apply("cast", i, dtype="f32"))
    g.output("f2f", g.apply("cast", x, dtype="f32"))
    g.output("i2i", g.apply("cast", i, dtype="i32"))
    rng = np.random.default_rng(6)
    xv = (rng.standard_normal((5, 23)) * 1000).astype(np.float32)
    xv[0, :8] = [-0.5, 0.5, -1.5, 1.99, -1.99, -0.0, 2.1e9, -2.1e9]
    iv = rng.integers(-2**24, 2**24, (5, 23)).astype(np.int32)
    _, out, ref = check(g, {"x": xv, "i": iv}, exact=("f2i", "i2f", "f2f", "i2i"))
    assert out["f2i"].dtype == np.int32 and out["i2f"].dtype == np.float32
    assert out["f2i"][0, :5].tolist() == [0, 0, -1, 1, -1]   # toward zero


def test_index_wrap():
    g = Graph("wrap")
    i = g.input("i", [3, 29], "i32")
    g.output("w", g.apply("index_wrap", i, size=29))
    g.output("w7", g.apply("index_wrap", i, size=7))
    iv = np.random.default_rng(7).integers(-29, 29, (3, 29)).astype(np.int32)
    _, out, _ = check(g, {"i": iv}, exact=("w", "w7"))
    assert out["w"].min() >= 0 and out["w"].dtype == np.int32


# ---------------------------------------------------------------- conv_general

CONV_CASES = [
    # x shape, w shape, stride, pads (begin..., end...), dilation, groups, bias
    ((2, 3, 19), (4, 3, 3), (1,), (0, 0), (1,), 1, True),
    ((2, 6, 23), (9, 2, 4), (2,), (3, 1), (2,), 3, True),
    ((1, 4, 17), (4, 1, 5), (3,), (2, 4), (1,), 4, False),                 # depthwise
    ((2, 3, 11, 13), (5, 3, 3, 2), (2, 1), (1, 0, 2, 1), (1, 2), 1, True),
    ((2, 4, 9, 10), (6, 2, 3, 3), (1, 2), (0, 2, 1, 0), (2, 1), 2, False),
    ((1, 6, 7, 8), (6, 1, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 6, True),   # depthwise 2-d
    ((1, 2, 5, 6, 7), (4, 1, 2, 3, 2), (1, 2, 1), (1, 0, 1, 0, 1, 1), (2, 1, 1), 2, True),   # 3-d
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{len(c[0]) - 2}d-g{c[5]}")
def test_conv_general(case):
    xs, ws, stride, pads, dil, groups, bias = case
    g = Graph("conv")
    x = g.input("x", xs)
    w = g.input("w", ws)
    ops = [x, w]
    if bias:
        ops.append(g.input("b", [ws[0]]))
    g.output("y", g.apply("conv_general", *ops, stride=stride, pads=pads, dilation=dil, groups=groups))
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32)}
    if bias:
        feeds["b"] = rng.standard_normal(ws[0]).astype(np.float32)
    check(g, feeds, tol=WIN_TOL)


# ---------------------------------------------------------------- pooling

POOL_CASES = [
    # x shape, kernel, stride, pads, dilation, ceil_mode, count_include_pad
    ((2, 3, 20), (3,), (2,), (1, 1), (1,), False, False),
    ((2, 3, 20), (3,), (2,), (1, 2), (1,), True, True),
    ((2, 3, 12), (3,), (2,), (1, 1), (1,), True, True),      # ceil_mode's extra tap: not counted
    ((1, 2, 17), (4,), (3,), (2, 0), (2,), True, False),
    ((2, 3, 11, 13), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), False, False),
    ((2, 3, 11, 13), (3, 2), (2, 3), (1, 0, 2, 1), (1, 1), True, True),
    ((1, 2, 8, 9), (2, 2), (3, 2), (1, 0, 0, 1), (1, 2), True, True),
    ((1, 2, 12, 9), (2, 3), (1, 2), (0, 1, 1, 1), (2, 1), True, False),
    ((1, 1, 7, 7), (7, 7), (1, 1), (0, 0, 0, 0), (1, 1), False, True),     # global
]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{len(c[0]) - 2}d-ceil{int(c[5])}-inc{int(c[6])}")
def test_pools(case):
    xs, k, stride, pads, dil, ceil_mode, include = case
    g = Graph("pool")
    x = g.input("x", xs)
    attrs = dict(kernel=k, stride=stride, pads=pads, dilation=dil, ceil_mode=ceil_mode)
    g.output("max", g.apply("max_pool", x, **attrs))
    g.output("avg", g.apply("avg_pool", x, count_include_pad=include, **attrs))
    xv = np.random.default_rng(9).standard_normal(xs).astype(np.float32) - 3.0   # negative: padding must not win
    check(g, {"x": xv}, tol=WIN_TOL, exact=("max",))


def test_max_pool_keeps_nan_and_inf():
    g = Graph("pool_nan")
    x = g.input("x", [1, 2, 6, 6])
    g.output("max", g.apply("max_pool", x, kernel=(2, 2), stride=(2, 2), pads=(0, 0, 0, 0), dilation=(1, 1)))
    xv = np.random.default_rng(10).standard_normal((1, 2, 6, 6)).astype(np.float32)
    xv[0, 0, 0, 1] = NAN
    xv[0, 0, 3, 3] = INF
    xv[0, 1, 5, 5] = -INF
    xv[0, 1, 4, 4] = NAN
    xv[0, 1, 4, 5] = INF
    _, out, _ = check(g, {"x": xv}, exact=("max",))
    assert np.isnan(out["max"][0, 0, 0, 0]) and np.isnan(out["max"][0, 1, 2, 2])


# ---------------------------------------------------------------- fused

def test_fused_chain_of_new_ops():
    g = Graph("fused")
    x = g.input("x", [9, 37])
    y = g.input("y", [37])
    m = g.apply("greater", x, y)
    a = g.mul(g.apply("softplus", x), g.apply("leaky_relu", y, alpha=0.1))
    b = g.apply("erf", g.apply("minimum", x, y))
    c = g.apply("where", m, a, b)
    d = g.add(g.apply("floor", g.apply("maximum", c, g.apply("sign", x))), g.apply("ceil", x))
    e = g.apply("power", g.apply("softplus", d), g.apply("logical_not", g.apply("less_equal", x, y)))
    g.output("z", g.add(e, g.apply("equal", g.apply("greater_equal", x, y), m)))
    rng = np.random.default_rng(11)
    xv = ragged(rng, (9, 37), edges=np.array([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0], np.float32))
    yv = ragged(rng, (37,), edges=np.array([0.0, NAN, 2.0], np.float32))
    s, _, _ = check(g, {"x": xv, "y": yv}, optimize=True)
    # everything but the mask m (read twice, so kept) runs as one fused program
    assert len(s.plan.dispatches) == 2, [d.kernel for d in s.plan.dispatches]
    fused = [n for n in s.graph.nodes if n.op == "pointwise"]
    assert len(fused) == 1
    ops = {op for op, _, _ in fused[0].attrs["program"]}
    assert {"softplus", "leaky_relu", "erf", "minimum", "maximum", "where", "floor", "ceil", "sign", "power",
            "logical_not", "less_equal", "equal", "greater_equal"} <= ops, ops


def test_a_comparison_of_integers_feeding_float_math_fuses_around_it():
    """less(i32, i32) gives an f32 mask; the optimizer leaves the integer comparison out of
    the pointwise program (which reads f32 values) and fuses what follows."""
    from engine.optimize import optimize
    g = Graph("int-mask")
    a, b = g.input("a", [4, 9], "i32"), g.input("b", [4, 9], "i32")
    x = g.input("x", [4, 9])
    g.output("y", g.apply("exp", g.apply("mul", g.apply("less", a, b), x)))
    rng = np.random.default_rng(0)
    inputs = {"a": rng.integers(-5, 5, (4, 9)).astype(np.int32), "b": rng.integers(-5, 5, (4, 9)).astype(np.int32),
              "x": rng.standard_normal((4, 9)).astype(np.float32)}
    fused, _ = optimize(g)
    assert any(n.op == "pointwise" for n in fused.nodes) and any(n.op == "less" for n in fused.nodes)
    want = reference.run(g, inputs, {}, np.float64)["y"]
    s = build_inference_session(g)
    s.set_inputs(inputs)
    s.run()
    np.testing.assert_allclose(s.read_output("y"), want, rtol=1e-6)


# ---------------------------------------------------------------- gradients of conv_general and max_pool

@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{len(c[0]) - 2}d-g{c[5]}")
def test_conv_general_gradients(case):
    """dx and dw of every conv_general case: strides leaving gaps, asymmetric pads,
    dilation, groups (depthwise too), 1-, 2- and 3-d."""
    xs, ws, stride, pads, dil, groups, _ = case
    attrs = dict(stride=stride, pads=pads, dilation=dil, groups=groups)
    probe = Graph("shape")
    y = probe.apply("conv_general", probe.input("x", xs), probe.input("w", ws), **attrs)
    g = Graph("conv-grad")
    x, w, d = g.input("x", xs), g.input("w", ws), g.input("d", probe.shape(y))
    g.output("dx", g.apply("conv_general_input_grad", d, w, input_shape=tuple(xs), **attrs))
    g.output("dw", g.apply("conv_general_weight_grad", x, d, kernel=tuple(ws[2:]), **attrs))
    rng = np.random.default_rng(10)
    feeds = {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32),
             "d": rng.standard_normal(probe.shape(y)).astype(np.float32)}
    check(g, feeds, tol=WIN_TOL)


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{len(c[0]) - 2}d-ceil{int(c[5])}-inc{int(c[6])}")
def test_max_pool_gradient_routes_to_the_first_maximum(case):
    """Integer-valued inputs make ties in most windows: the gradient goes to the first
    maximum in kernel order, overlapping windows add up, padding never takes it."""
    xs, k, stride, pads, dil, ceil_mode, _ = case
    attrs = dict(kernel=k, stride=stride, pads=pads, dilation=dil, ceil_mode=ceil_mode)
    probe = Graph("shape")
    y = probe.apply("max_pool", probe.input("x", xs), **attrs)
    g = Graph("pool-grad")
    x, d = g.input("x", xs), g.input("d", probe.shape(y))
    g.output("dx", g.apply("max_pool_grad", d, x, **attrs))
    rng = np.random.default_rng(11)
    feeds = {"x": rng.integers(-6, -2, xs).astype(np.float32),
             "d": rng.standard_normal(probe.shape(y)).astype(np.float32)}
    check(g, feeds, tol=WIN_TOL)


def test_max_pool_gradient_with_nan_and_infinities():
    """As the reference's argmax: the first NaN of a window takes its dout; +inf beats
    every number; a window whose inputs are all -inf sends its dout to its first tap,
    which is lost where that tap is padding and kept where it is inside the input."""
    attrs = dict(kernel=(3, 3), stride=(2, 2), pads=(1, 1, 1, 1), dilation=(1, 1), ceil_mode=True)
    xs = (1, 3, 6, 7)
    probe = Graph("shape")
    ys = probe.shape(probe.apply("max_pool", probe.input("x", xs), **attrs))
    g = Graph("pool-grad-nan")
    x, d = g.input("x", xs), g.input("d", ys)
    g.output("dx", g.apply("max_pool_grad", d, x, **attrs))
    rng = np.random.default_rng(12)
    xv = rng.integers(-3, 0, xs).astype(np.float32)
    xv[0, 0, 0, 1] = NAN          # two NaNs in overlapping windows: the first in kernel order wins
    xv[0, 0, 1, 0] = NAN
    xv[0, 0, 3, 3] = INF
    xv[0, 0, 3, 5] = INF          # a tie of infinities
    xv[0, 0, 5, 6] = NAN
    xv[0, 1, :3, :3] = -INF       # window (0, 0) all -inf: its first tap is padding
    xv[0, 1, 2:, 2:5] = -INF      # all -inf inside the input: the first tap takes it
    xv[0, 2] = -INF               # a whole plane of -inf
    xv[0, 2, 4, 4] = NAN
    feeds = {"x": xv, "d": rng.standard_normal(ys).astype(np.float32)}
    _, out, ref = check(g, feeds, tol=WIN_TOL)
    lost = feeds["d"][0, 1].astype(np.float64).sum() - ref["dx"][0, 1].sum()    # window (0, 0)'s dout, in the padding
    assert abs(lost - feeds["d"][0, 1, 0, 0]) < 1e-5 and abs(lost) > 1e-3
    np.testing.assert_allclose(out["dx"][0, 1].sum(), ref["dx"][0, 1].sum(), rtol=1e-5, atol=1e-5)
