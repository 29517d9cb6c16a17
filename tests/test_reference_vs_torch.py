"""The numpy reference executor against PyTorch, op by op.

Every op of ``engine.graph.ops.OPS`` (sources aside) is built into a small graph with the
public builders (or ``Graph.apply`` for the fused ops, which have no sugar), run by
``reference.run`` and compared with an independent PyTorch CPU computation on the
same random inputs. ``test_every_op_has_a_torch_case`` fails when an op is added
without a case here.

Tolerances. In float32 the issue asks for a relative error under 1e-5. We measure it
as ``max|ours - torch| / max|torch|``: normalising by the largest magnitude of the
result, not element by element, because both sides round differently (numpy and
torch sum in different orders, use different exp/erf kernels), and an output element
that is small through cancellation (a layer-norm output near 0, a difference of two
close numbers) carries an absolute error of a few ulps of the *large* intermediate
values, so its own relative error means nothing. 1e-5 is ~80 float32 ulps of the
largest value, enough for the sums of up to a few hundred terms used here and far
below what any real mistake (a wrong axis, a missing scale, an off-by-one mask)
produces. To still catch mistakes that only touch small elements, each case also runs
in float64 on both sides and must agree element by element to ``rtol=1e-9`` (plus
an ``atol`` of 1e-12 of the largest magnitude for elements that are exactly 0 on one
side).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.graph import reference
from engine.graph.ir import Graph
from engine.graph.ops import OPS, PART_ALIGN, SOURCE, attention_grad_kv_layout, attention_stats_layout

F32_REL_TOL = 1e-5
F64_RTOL = 1e-9


# ---------------------------------------------------------------- harness

@dataclass
class Case:
    """One comparison: named input arrays, a graph builder over their nodes, and the
    PyTorch computation over the same arrays as tensors."""

    id: str
    arrays: dict[str, np.ndarray]
    build: Callable[..., int]
    torch_fn: Callable[..., torch.Tensor]
    bf16: tuple[str, ...] = ()   # arrays given as weights stored in bf16 (parameters, not inputs)


def relative_error(got: np.ndarray, want: np.ndarray, floor: float = 1e-6) -> float:
    """Max error over the larger of the result's magnitude and ``floor``: float32 sums
    err in proportion to the terms, so a sum that cancels to near 0 is measured against
    its inputs' magnitude (check_case's floor), not its own."""
    scale = max(float(np.abs(want).max(initial=0.0)), floor)
    return float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max(initial=0.0)) / scale


def build_graph(case: Case) -> Graph:
    g = Graph(case.id)
    nodes = {name: g.parameter(name, a.shape, dtype="bf16") if name in case.bf16 else
             g.input(name, a.shape, "i32" if a.dtype.kind in "iu" else "f32") for name, a in case.arrays.items()}
    g.output("y", case.build(g, **nodes))
    return g


def run_reference(case: Case, g: Graph, dtype) -> np.ndarray:
    params = {k: v for k, v in case.arrays.items() if k in case.bf16}
    inputs = {k: v for k, v in case.arrays.items() if k not in case.bf16}
    return reference.run(g, inputs, params, dtype=dtype)["y"]


def to_torch(array: np.ndarray, float_dtype: torch.dtype) -> torch.Tensor:
    """Indices as int64 (what torch's index ops take), floats as ``float_dtype``: in
    float64 mode both sides see the same float32-valued inputs, widened."""
    if array.dtype.kind in "iu":
        return torch.from_numpy(array.astype(np.int64))
    return torch.from_numpy(array).to(float_dtype)


def run_torch(case: Case, dtype: torch.dtype) -> np.ndarray:
    tensors = {k: to_torch(v, dtype) for k, v in case.arrays.items()}
    with torch.no_grad():
        return case.torch_fn(**tensors).numpy()


def check_case(case: Case) -> None:
    g = build_graph(case)
    ours32 = run_reference(case, g, np.float32)
    torch32 = run_torch(case, torch.float32)
    assert ours32.shape == torch32.shape == g[g.outputs["y"]].shape
    assert ours32.dtype == np.float32
    assert np.isfinite(ours32).all()
    floor = max([float(np.abs(a).max(initial=0.0)) for a in case.arrays.values() if a.dtype.kind == "f"] + [1e-6])
    err = relative_error(ours32, torch32, floor)
    assert err < F32_REL_TOL, f"{case.id}: float32 relative error {err:.3g}"

    ours64 = run_reference(case, g, np.float64)
    torch64 = run_torch(case, torch.float64)
    assert ours64.dtype == np.float64
    scale = max(float(np.abs(torch64).max(initial=0.0)), 1e-300)
    np.testing.assert_allclose(ours64, torch64, rtol=F64_RTOL, atol=1e-12 * scale, err_msg=case.id)


def rng_for(name: str) -> np.random.Generator:
    """A generator seeded by the case name, so each case is reproducible on its own."""
    return np.random.default_rng(zlib.crc32(name.encode()))


def normal(rng, *shape, scale=1.0) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape) * scale, dtype=np.float32)


def positive(rng, *shape) -> np.ndarray:
    return np.asarray(rng.uniform(0.2, 3.0, shape), dtype=np.float32)


def away_from_zero(rng, *shape) -> np.ndarray:
    return np.asarray(rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 2.0, shape), dtype=np.float32)


def dims(rng, n, lo=1, hi=6) -> tuple[int, ...]:
    return tuple(int(v) for v in rng.integers(lo, hi + 1, n))


CASES: list[Case] = []


def case(fn):
    """Register ``fn(rng) -> Case | list[Case]`` under its name."""
    made = fn(rng_for(fn.__name__))
    for i, c in enumerate(made if isinstance(made, list) else [made]):
        c.id = f"{fn.__name__.removesuffix('_cases')}[{c.id or i}]"
        CASES.append(c)
    return fn


# ---------------------------------------------------------------- elementwise

UNARY_TORCH = {  # op: (torch function, input domain)
    "neg": (torch.neg, normal),
    "exp": (torch.exp, normal),
    "log": (torch.log, positive),
    "sqrt": (torch.sqrt, positive),
    "rsqrt": (torch.rsqrt, positive),
    "reciprocal": (torch.reciprocal, away_from_zero),
    "abs": (torch.abs, normal),
    "relu": (F.relu, normal),
    "sigmoid": (torch.sigmoid, lambda rng, *s: normal(rng, *s, scale=3.0)),
    "tanh": (torch.tanh, normal),
    "silu": (F.silu, lambda rng, *s: normal(rng, *s, scale=3.0)),
    "stop_gradient": (torch.Tensor.detach, normal),
}


@case
def unary_cases(rng):
    return [Case(op, {"x": domain(rng, *dims(rng, 3))},
                 (lambda op: lambda g, x: getattr(g, op)(x))(op),
                 (lambda fn: lambda x: fn(x))(fn))
            for op, (fn, domain) in UNARY_TORCH.items()]


@case
def gelu_cases(rng):
    return [Case(form, {"x": normal(rng, *dims(rng, 2), scale=3.0)},
                 (lambda form: lambda g, x: g.gelu(x, approximate=form))(form),
                 (lambda form: lambda x: F.gelu(x, approximate=form))(form))
            for form in ("none", "tanh")]


@case
def pow_cases(rng):
    return [Case(str(e), {"x": positive(rng, *dims(rng, 3))},
                 (lambda e: lambda g, x: g.pow(x, e))(e),
                 (lambda e: lambda x: torch.pow(x, e))(e))
            for e in (2.0, 3.0, 0.5, -1.5)]


BINARY_BUILDERS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


@case
def binary_cases(rng):
    """Fixed broadcasting patterns; the hypothesis test below draws random ones."""
    patterns = [((3, 4), (3, 4)), ((2, 1, 4), (3, 1)), ((5,), (2, 3, 5)), ((1, 1), (4, 1, 3)), ((), (2, 3))]
    out = []
    for op, fn in BINARY_BUILDERS.items():
        for sa, sb in patterns:
            b = away_from_zero(rng, *sb) if op == "div" else normal(rng, *sb)
            out.append(Case(f"{op}{list(sa)}{list(sb)}", {"a": normal(rng, *sa), "b": b},
                            (lambda op: lambda g, a, b: getattr(g, op)(a, b))(op),
                            (lambda fn: lambda a, b: fn(a, b))(fn)))
    return out


@case
def bias_add_cases(rng):
    n, c = dims(rng, 2, 2, 7)
    return Case("", {"x": normal(rng, 2, n, c), "b": normal(rng, c)},
                lambda g, x, b: g.bias_add(x, b), lambda x, b: x + b)


@case
def swiglu_cases(rng):
    return Case("", {"gate": normal(rng, 3, 8, scale=2.0), "up": normal(rng, 3, 8)},
                lambda g, gate, up: g.apply("swiglu", gate, up), lambda gate, up: F.silu(gate) * up)


# tanh(a * b + 0.5) - exp(c) / 2, with c broadcast
POINTWISE_PROGRAM = (
    ("mul", (("in", 0), ("in", 1)), ()),
    ("add", (("t", 0), ("c", 0.5)), ()),
    ("tanh", (("t", 1),), ()),
    ("exp", (("in", 2),), ()),
    ("div", (("t", 3), ("c", 2.0)), ()),
    ("sub", (("t", 2), ("t", 4)), ()),
    ("gelu", (("t", 5),), (("approximate", "tanh"),)),
)


@case
def pointwise_cases(rng):
    return Case("", {"a": normal(rng, 2, 3, 4), "b": normal(rng, 3, 4), "c": normal(rng, 2, 1, 1)},
                lambda g, a, b, c: g.apply("pointwise", a, b, c, program=POINTWISE_PROGRAM),
                lambda a, b, c: F.gelu(torch.tanh(a * b + 0.5) - torch.exp(c) / 2.0, approximate="tanh"))


# ---------------------------------------------------------------- reductions and norms

REDUCE_TORCH = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax}


def reduce_case(op, x, axis, keepdims) -> Case:
    """axis=None reduces everything: torch spells it as the tuple of all axes."""
    return Case(f"{op} axis={axis} keepdims={keepdims} {list(x.shape)}", {"x": x},
                lambda g, x: getattr(g, op)(x, axis=axis, keepdims=keepdims),
                lambda x: REDUCE_TORCH[op](x, dim=tuple(range(x.ndim)) if axis is None else axis, keepdim=keepdims))


@case
def reductions_cases(rng):
    return [reduce_case(op, normal(rng, *dims(rng, 3)), axis, keepdims)
            for op in REDUCE_TORCH for axis in (None, -1, 2) for keepdims in (False, True)]


def torch_sum_to(target):
    """Tensor.sum_to_size keeps the rank, so sum to the target padded with leading
    1s, then drop them."""
    def fn(x):
        return x.sum_to_size((1,) * (x.ndim - len(target)) + target).reshape(target)
    return fn


@case
def sum_to_cases(rng):
    """The gradient of broadcasting."""
    return [Case(str(target), {"x": normal(rng, 2, 3, 4)},
                 (lambda t: lambda g, x: g.apply("sum_to", x, shape=t))(target), torch_sum_to(target))
            for target in [(3, 4), (1, 3, 1), (4,), (3, 1), (2, 3, 4), ()]]


@case
def part_cases(rng):
    """A segment of a packed result, read at its offset (a multiple of PART_ALIGN) in
    another shape: torch's view of the flat storage is the reference."""
    def build(offset, shape):
        return lambda g, x: g.apply("part", x, offset=offset, shape=shape)

    def torch_part(offset, shape):
        return lambda x: x.reshape(-1)[offset:offset + math.prod(shape)].reshape(shape)
    return [Case(f"offset={offset} {list(shape)}", {"x": normal(rng, 3, 100)},
                 build(offset, shape), torch_part(offset, shape))
            for offset, shape in ((0, (2, 5)), (64, (4, 3, 5)), (192, (108,)))]


@case
def softmax_cases(rng):
    return [Case(f"{op}{list(s)}", {"x": normal(rng, *s, scale=3.0)},
                 (lambda op: lambda g, x: getattr(g, op)(x))(op),
                 (lambda fn: lambda x: fn(x, dim=-1))(fn))
            for op, fn in (("softmax", F.softmax), ("log_softmax", F.log_softmax))
            for s in ((4, 7), (2, 3, 1), (5,))]


@case
def layer_norm_cases(rng):
    out = []
    for eps in (1e-5, 1e-3):
        n, c = dims(rng, 2, 2, 9)
        out.append(Case(f"eps={eps}", {"x": normal(rng, 2, n, c, scale=2.0) + 1.0, "w": normal(rng, c), "b": normal(rng, c)},
                        (lambda eps: lambda g, x, w, b: g.layer_norm(x, w, b, eps=eps))(eps),
                        (lambda eps: lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, eps))(eps)))
    return out


@case
def rms_norm_cases(rng):
    return [Case(f"eps={eps}", {"x": normal(rng, 3, 2, 10), "w": normal(rng, 10)},
                 (lambda eps: lambda g, x, w: g.rms_norm(x, w, eps=eps))(eps),
                 (lambda eps: lambda x, w: F.rms_norm(x, x.shape[-1:], w, eps))(eps))
            for eps in (1e-6, 1e-2)]


@case
def group_norm_cases(rng):
    out = []
    for shape, groups in (((2, 6, 5), 3), ((2, 8, 3, 4), 2), ((1, 4, 7), 4), ((3, 4, 5), 1)):
        arrays = {"x": normal(rng, *shape, scale=2.0), "w": normal(rng, shape[1]), "b": normal(rng, shape[1])}
        out.append(Case(f"{list(shape)}/{groups}", dict(arrays),
                        (lambda k: lambda g, x, w, b: g.group_norm(x, w, b, k))(groups),
                        (lambda k: lambda x, w, b: F.group_norm(x, k, w, b, 1e-5))(groups)))
        out.append(Case(f"{list(shape)}/{groups} silu", dict(arrays),
                        (lambda k: lambda g, x, w, b: g.apply("group_norm", x, w, b, num_groups=k, activation="silu"))(groups),
                        (lambda k: lambda x, w, b: F.silu(F.group_norm(x, k, w, b, 1e-5)))(groups)))
    return out


# ---------------------------------------------------------------- losses

def torch_int_cross_entropy(ignore_index):
    def fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)
    return fn


@case
def cross_entropy_cases(rng):
    out = []
    for batch, ignore_index in (((6,), -100), ((2, 5), -100), ((3, 4), 0), ((2, 3), 7)):
        classes = 7
        labels = rng.integers(0, classes, batch).astype(np.int32)
        ignored = rng.random(batch) < 0.3
        labels[ignored] = ignore_index
        out.append(Case(f"{list(batch)} ignore={ignore_index}",
                        {"logits": normal(rng, *batch, classes, scale=2.0), "labels": labels},
                        (lambda ii: lambda g, logits, labels: g.cross_entropy_loss(logits, labels, ignore_index=ii))(ignore_index),
                        torch_int_cross_entropy(ignore_index)))
    # every position ignored but one: the mean is over that one position
    labels = np.full((3, 4), -100, np.int32)
    labels[1, 2] = 5
    out.append(Case("all ignored but one", {"logits": normal(rng, 3, 4, 9, scale=2.0), "labels": labels},
                    lambda g, logits, labels: g.cross_entropy_loss(logits, labels),
                    torch_int_cross_entropy(-100)))
    return out


@case
def soft_cross_entropy_cases(rng):
    out = []
    for shape in ((5, 6), (2, 3, 4)):
        targets = rng.random(shape)
        targets = (targets / targets.sum(-1, keepdims=True)).astype(np.float32)
        out.append(Case(str(list(shape)), {"logits": normal(rng, *shape, scale=2.0), "targets": targets},
                        lambda g, logits, targets: g.cross_entropy_loss(logits, targets),
                        lambda logits, targets: F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                targets.reshape(-1, targets.shape[-1]))))
    return out


@case
def mse_and_bce_cases(rng):
    s = dims(rng, 2, 2, 6)
    return [Case("mse", {"p": normal(rng, *s), "t": normal(rng, *s)},
                 lambda g, p, t: g.mse_loss(p, t), lambda p, t: F.mse_loss(p, t)),
            Case("bce", {"p": normal(rng, *s, scale=4.0), "t": rng.random(s).astype(np.float32)},
                 lambda g, p, t: g.bce_loss(p, t), lambda p, t: F.binary_cross_entropy_with_logits(p, t)),
            Case("bce hard", {"p": normal(rng, 7, scale=30.0), "t": (rng.random(7) < 0.5).astype(np.float32)},
                 lambda g, p, t: g.bce_loss(p, t), lambda p, t: F.binary_cross_entropy_with_logits(p, t))]


# ---------------------------------------------------------------- matmul family

def torch_matmul(ta, tb):
    return lambda a, b: torch.matmul(a.mT if ta else a, b.mT if tb else b)


def matmul_operands(rng, batch_a, batch_b, m, k, n, ta, tb):
    a = normal(rng, *batch_a, *((k, m) if ta else (m, k)))
    b = normal(rng, *batch_b, *((n, k) if tb else (k, n)))
    return a, b


@case
def matmul_cases(rng):
    out = []
    for ta in (False, True):
        for tb in (False, True):
            for batch_a, batch_b in (((), ()), ((2,), ()), ((3, 1), (2,))):
                a, b = matmul_operands(rng, batch_a, batch_b, *dims(rng, 3, 1, 9), ta, tb)
                out.append(Case(f"ta={ta} tb={tb} {list(a.shape)}@{list(b.shape)}", {"a": a, "b": b},
                                (lambda ta, tb: lambda g, a, b: g.matmul(a, b, transpose_a=ta, transpose_b=tb))(ta, tb),
                                torch_matmul(ta, tb)))
    return out


TORCH_ACTIVATIONS = {"none": lambda y: y, "relu": F.relu, "silu": F.silu, "gelu": F.gelu,
                     "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}


@case
def fused_matmul_cases(rng):
    out = []
    for activation, act in TORCH_ACTIVATIONS.items():
        for has_add, has_residual in ((False, False), (True, False), (True, True), (False, True)):
            tb = has_add
            a, b = matmul_operands(rng, (2,), (), 3, 5, 4, False, tb)
            arrays = {"a": a, "b": b}
            if has_add:
                arrays["add"] = normal(rng, 4)
            if has_residual:
                arrays["res"] = normal(rng, 2, 3, 4)
            names = list(arrays)

            def build(g, *, _a=activation, _add=has_add, _res=has_residual, _tb=tb, _names=tuple(names), **nodes):
                return g.apply("fused_matmul", *(nodes[k] for k in _names), transpose_b=_tb,
                               activation=_a, has_add=_add, has_residual=_res)

            def torch_fn(a, b, add=None, res=None, _act=act, _tb=tb):
                y = torch.matmul(a, b.mT if _tb else b)
                y = _act(y + add if add is not None else y)
                return y + res if res is not None else y

            out.append(Case(f"{activation} add={has_add} residual={has_residual}", arrays, build, torch_fn))
    for gradient, act in TORCH_ACTIVATIONS.items():   # times the activation's derivative at h
        if gradient in ("none", "silu"):   # silu's gradient is no op of its own
            continue
        a, b = matmul_operands(rng, (2,), (), 3, 5, 4, False, False)

        def build(g, a, b, h, _gradient=gradient):
            return g.apply("fused_matmul", a, b, h, gradient_of=_gradient)

        out.append(Case(f"gradient of {gradient}", {"a": a, "b": b, "h": normal(rng, 2, 3, 4)}, build,
                        (lambda f: lambda a, b, h: torch_vjp(lambda h: f(h), "h")(torch.matmul(a, b), h=h))(act)))
    return out


@case
def norm_matmul_cases(rng):
    return [Case(f"tb={tb}", {"x": normal(rng, 2, 3, 6), "w": normal(rng, 6),
                              "b": normal(rng, *((5, 6) if tb else (6, 5)))},
                 (lambda tb: lambda g, x, w, b: g.apply("norm_matmul", x, w, b, transpose_b=tb))(tb),
                 (lambda tb: lambda x, w, b: torch.matmul(F.rms_norm(x, x.shape[-1:], w, 1e-6), b.mT if tb else b))(tb))
            for tb in (False, True)]


# ---------------------------------------------------------------- attention, rope

def heads_first(x, heads):
    b, t, width = x.shape
    return x.reshape(b, t, heads, width // heads).transpose(1, 2)


def torch_attention(heads, kv_heads, causal, scale):
    def fn(q, k, v):
        o = F.scaled_dot_product_attention(heads_first(q, heads), heads_first(k, kv_heads), heads_first(v, kv_heads),
                                           is_causal=causal, scale=scale, enable_gqa=kv_heads != heads)
        b, h, t, d = o.shape
        return o.transpose(1, 2).reshape(b, t, h * d)
    return fn


@case
def attention_cases(rng):
    out = []
    for heads, kv_heads, tq, tk, causal, scale in (
            (2, 2, 5, 5, False, None), (2, 2, 5, 5, True, None), (4, 2, 6, 6, True, None),
            (4, 1, 3, 7, False, 0.3), (3, 3, 3, 6, True, None), (2, 2, 1, 1, True, None), (1, 1, 4, 4, False, None)):
        d, b = 4, 2
        arrays = {"q": normal(rng, b, tq, heads * d), "k": normal(rng, b, tk, kv_heads * d),
                  "v": normal(rng, b, tk, kv_heads * d)}
        out.append(Case(f"h={heads} kv={kv_heads} tq={tq} tk={tk} causal={causal} scale={scale}", arrays,
                        (lambda h, kv, c, s: lambda g, q, k, v: g.attention(q, k, v, h, kv, c, s))(heads, kv_heads, causal, scale),
                        torch_attention(heads, kv_heads, causal, scale)))
    return out


def torch_scores(q, k, heads, kv_heads, causal, scale):
    """scale q kᵀ per query head, [B, H, T, S], -inf above the diagonal when causal."""
    qh = heads_first(q, heads)
    kh = heads_first(k, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    s = qh @ kh.mT * (qh.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return s


def heads_last(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def torch_attention_backward(op, heads, kv_heads, causal, scale):
    """The backward ops (and attention_stats, the forward keeping its lse for them) by flash
    attention's backward formulas, in torch: P = exp(s - lse),
    dS = P (dO vᵀ - delta), dq = scale dS k, dk = scale dSᵀ q, dv = Pᵀ dO (kv groups summed;
    attention_grad_kv packs dk and dv as attention_grad_kv_layout says)."""
    def repeat(x):
        return heads_first(x, kv_heads).repeat_interleave(heads // kv_heads, dim=1)

    def group_sum(x):
        b, _, t, d = x.shape
        return x.reshape(b, kv_heads, heads // kv_heads, t, d).sum(2)

    def fn(q, k, v=None, dout=None, lse=None, delta=None):
        s = torch_scores(q, k, heads, kv_heads, causal, scale)
        if op == "attention_lse":
            return torch.logsumexp(s, -1).transpose(1, 2)
        if op == "attention_stats":   # the forward's result and lse, packed
            (out_at, lse_at), total = attention_stats_layout(q.shape, heads)
            packed = torch.zeros(total, dtype=q.dtype)
            packed[out_at:out_at + q.numel()] = heads_last(torch.softmax(s, -1) @ repeat(v)).reshape(-1)
            packed[lse_at:lse_at + q.numel() // (q.shape[-1] // heads)] = torch.logsumexp(s, -1).transpose(1, 2).reshape(-1)
            return packed
        p = torch.exp(s - lse.transpose(1, 2)[..., None])
        do = heads_first(dout, heads)
        ds = p * (do @ repeat(v).mT - delta.transpose(1, 2)[..., None])
        factor = (q.shape[-1] // heads) ** -0.5 if scale is None else scale
        if op == "attention_grad_q":
            return heads_last(factor * ds @ repeat(k))
        offsets, total = attention_grad_kv_layout(k.shape)
        packed = torch.zeros(total, dtype=q.dtype)
        for at, x in zip(offsets, (factor * ds.mT @ heads_first(q, heads), p.mT @ do)):
            packed[at:at + k.numel()] = heads_last(group_sum(x)).reshape(-1)
        return packed
    return fn


ATTENTION_BACKWARD_OPERANDS = {"attention_stats": ("q", "k", "v"), "attention_lse": ("q", "k"),
                               "attention_grad_q": ("q", "k", "v", "dout", "lse", "delta"),
                               "attention_grad_kv": ("q", "k", "v", "dout", "lse", "delta")}


@case
def attention_backward_cases(rng):
    """lse and delta are the true statistics of q, k, v, dout (to float32), so the ops see
    inputs like those the gradient rule gives them."""
    out = []
    for heads, kv_heads, tq, tk, causal, scale in (
            (2, 2, 5, 5, False, None), (4, 2, 6, 6, True, None), (4, 1, 3, 7, False, 0.3), (3, 3, 6, 3, True, None)):
        d, b = 4, 2
        full = {"q": normal(rng, b, tq, heads * d), "k": normal(rng, b, tk, kv_heads * d),
                "v": normal(rng, b, tk, kv_heads * d), "dout": normal(rng, b, tq, heads * d)}
        attrs = dict(num_heads=heads, num_kv_heads=kv_heads, causal=causal, scale=scale)
        wide = {n: a.astype(np.float64) for n, a in full.items()}
        full["lse"] = OPS["attention_lse"].ref(wide["q"], wide["k"], **attrs).astype(np.float32)
        o = OPS["attention"].ref(wide["q"], wide["k"], wide["v"], **attrs)
        full["delta"] = (wide["dout"] * o).reshape(b, tq, heads, d).sum(-1).astype(np.float32)
        for op, names in ATTENTION_BACKWARD_OPERANDS.items():
            out.append(Case(f"{op} h={heads} kv={kv_heads} tq={tq} tk={tk} causal={causal} scale={scale}",
                            {n: full[n] for n in names},
                            (lambda op, names, attrs: lambda g, **x: g.apply(op, *(x[n] for n in names), **attrs))(
                                op, names, attrs),
                            torch_attention_backward(op, heads, kv_heads, causal, scale)))
    return out


def torch_rope(heads, base, offset, inverse):
    """Rotate-half RoPE (Llama/NeoX): pair i with i + d/2, angle = position * base^(-2i/d)."""
    def fn(x):
        b, t, width = x.shape
        d = width // heads
        xh = x.reshape(b, t, heads, d)
        freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(offset, offset + t, dtype=torch.float64)[:, None] * freqs[None, :]
        cos = torch.cat([angles.cos()] * 2, -1)[None, :, None, :].to(x.dtype)
        sin = torch.cat([angles.sin()] * 2, -1)[None, :, None, :].to(x.dtype)
        rotated = torch.cat([-xh[..., d // 2:], xh[..., : d // 2]], -1)
        return (xh * cos + rotated * (-sin if inverse else sin)).reshape(b, t, width)
    return fn


@case
def rope_cases(rng):
    out = []
    for heads, d, t, base, offset, inverse in ((2, 4, 5, 10000.0, 0, False), (3, 8, 6, 500.0, 7, False),
                                               (1, 2, 3, 10000.0, 0, False), (2, 6, 4, 10000.0, 3, True)):
        arrays = {"x": normal(rng, 2, t, heads * d)}
        if inverse:
            build = (lambda h, bs, o: lambda g, x: g.apply("rope", x, num_heads=h, base=bs, offset=o, inverse=True))(heads, base, offset)
        else:
            build = (lambda h, bs, o: lambda g, x: g.rope(x, h, base=bs, offset=o))(heads, base, offset)
        out.append(Case(f"h={heads} d={d} base={base} offset={offset} inverse={inverse}", arrays, build,
                        torch_rope(heads, base, offset, inverse)))
    return out


def torch_rope_at(heads, base, positions, x):
    """torch_rope's rotation at explicit positions [B, T] (a generation step's)."""
    b, t, width = x.shape
    d = width // heads
    xh = x.reshape(b, t, heads, d)
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[..., None] * freqs
    cos = torch.cat([angles.cos()] * 2, -1)[:, :, None, :].to(x.dtype)
    sin = torch.cat([angles.sin()] * 2, -1)[:, :, None, :].to(x.dtype)
    rotated = torch.cat([-xh[..., d // 2:], xh[..., : d // 2]], -1)
    return (xh * cos + rotated * sin).reshape(b, t, width)


@case
def rope_positions_cases(rng):
    positions = np.array([[3, 9, 0], [41, 42, 43]], np.int32)
    return Case("h=2 d=6", {"x": normal(rng, 2, 3, 12), "positions": positions},
                lambda g, x, positions: g.rope(x, 2, base=500.0, positions=positions),
                lambda x, positions: torch_rope_at(2, 500.0, positions, x))


# ---------------------------------------------------------------- generation: the KV cache's ops

@case
def cache_write_cases(rng):
    positions = np.array([[4, 1], [0, 6]], np.int32)
    arrays = {"cache": normal(rng, 2, 7, 8), "x": normal(rng, 2, 2, 8), "positions": positions}

    def torch_write(cache, x, positions, heads=0):
        x = torch_rope_at(heads, 300.0, positions, x) if heads else x
        out = cache.clone()
        for b in range(cache.shape[0]):
            out[b].index_copy_(0, positions[b], x[b])
        return out
    return [Case("plain", dict(arrays), lambda g, cache, x, positions: g.cache_write(cache, x, positions),
                 torch_write),
            Case("rope", dict(arrays), lambda g, cache, x, positions: g.cache_write(cache, x, positions, 2, 300.0),
                 lambda cache, x, positions: torch_write(cache, x, positions, heads=2)),
            Case("keys and values", {"kv": normal(rng, 2, 2, 7, 8), "k": normal(rng, 2, 2, 8),
                                     "v": normal(rng, 2, 2, 8), "positions": positions},
                 lambda g, kv, k, v, positions: g.cache_write(kv, [k, v], positions, 2, 300.0),
                 lambda kv, k, v, positions: torch.stack([torch_write(kv[0], k, positions, heads=2),
                                                          torch_write(kv[1], v, positions)]))]


def torch_cached_attention(heads, kv_heads, scale, rope_base=None):
    def fn(q, k, v, positions):
        if rope_base:
            q = torch_rope_at(heads, rope_base, positions, q)
        visible = torch.arange(k.shape[1])[None, None, :] <= positions[:, :, None]   # [B, T, S]
        o = F.scaled_dot_product_attention(heads_first(q, heads), heads_first(k, kv_heads), heads_first(v, kv_heads),
                                           attn_mask=visible[:, None], scale=scale, enable_gqa=kv_heads != heads)
        return heads_last(o)
    return fn


@case
def cached_attention_cases(rng):
    out = []
    for heads, kv_heads, t, s, scale, rope_base in ((2, 2, 1, 9, None, None), (4, 2, 3, 8, 0.4, None),
                                                    (3, 1, 2, 5, None, 1000.0)):
        d, b = 4, 2
        positions = np.stack([rng.permutation(s)[:t] for _ in range(b)]).astype(np.int32)
        arrays = {"q": normal(rng, b, t, heads * d), "k": normal(rng, b, s, kv_heads * d),
                  "v": normal(rng, b, s, kv_heads * d), "positions": positions}
        build = (lambda h, kv, sc, rb: lambda g, q, k, v, positions: g.cached_attention(
            q, k, v, positions, h, kv, sc, rope=rb is not None, rope_base=rb or 10000.0))(heads, kv_heads, scale, rope_base)
        out.append(Case(f"h={heads} kv={kv_heads} t={t} s={s} scale={scale} rope={rope_base}", arrays, build,
                        torch_cached_attention(heads, kv_heads, scale, rope_base)))
    return out


@case
def argmax_cases(rng):
    """A decode step's greedy choice; rows with a tie (the first wins, as torch's) and of -inf."""
    x = normal(rng, 3, 4, 9)
    x[0, 1, [2, 6]] = x[0, 1].max() + 1.0
    x[1, 2] = -np.inf
    return Case("rows", {"x": x}, lambda g, x: g.apply("cast", g.argmax(x), dtype="f32"),
                lambda x: torch.argmax(x, dim=-1).to(x.dtype))


@case
def swiglu_matmul_cases(rng):
    out = []
    for rows, tb, norm in ((1, False, True), (3, True, False), (2, True, True)):
        k, n = 6, 5
        arrays = {"x": normal(rng, 1, rows, k), "wg": normal(rng, *((n, k) if tb else (k, n))),
                  "wu": normal(rng, *((n, k) if tb else (k, n)))}
        if norm:
            arrays["nw"] = normal(rng, k)

        def build(g, x, wg, wu, nw=None, tb=tb):
            return g.apply("swiglu_matmul", *(x, wg, wu) + ((nw,) if nw is not None else ()), transpose_b=tb,
                           eps=1e-5)

        def torch_fn(x, wg, wu, nw=None, tb=tb):
            if nw is not None:
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
            wg, wu = (wg.T, wu.T) if tb else (wg, wu)
            return F.silu(x @ wg) * (x @ wu)
        out.append(Case(f"rows={rows} tb={tb} norm={norm}", arrays, build, torch_fn))
    return out


@case
def norm_matmuls_cases(rng):
    """The products of one RMS-normalised x, packed flat with zeros up to each next
    multiple of PART_ALIGN (torch: the products flattened and padded alike)."""
    out = []
    for rows, tb, widths in ((1, True, (5, 3, 3)), (2, False, (70, 6))):
        k = 6
        arrays = {"x": normal(rng, 1, rows, k), "nw": normal(rng, k),
                  **{f"w{i}": normal(rng, *((n, k) if tb else (k, n))) for i, n in enumerate(widths)}}

        def build(g, x, nw, tb=tb, **weights):
            return g.apply("norm_matmuls", x, nw, *weights.values(), transpose_b=tb, eps=1e-5)

        def torch_fn(x, nw, tb=tb, **weights):
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
            flat = [(xn @ (w.T if tb else w)).reshape(-1) for w in weights.values()]
            return torch.cat([F.pad(f, (0, -len(f) % PART_ALIGN)) for f in flat])
        out.append(Case(f"rows={rows} tb={tb} widths={widths}", arrays, build, torch_fn))
    return out


# ---------------------------------------------------------------- convolution

@case
def conv1d_cases(rng):
    out = []
    for (n, c, length), (o, k), stride, padding, bias in (
            ((2, 3, 10), (4, 3), 1, 0, True), ((1, 2, 9), (3, 3), 2, 1, True), ((2, 4, 5), (2, 5), 1, 2, False),
            ((3, 1, 7), (2, 1), 3, 0, True)):
        arrays = {"x": normal(rng, n, c, length), "w": normal(rng, o, c, k)}
        if bias:
            arrays["b"] = normal(rng, o)
        out.append(Case(f"{list(arrays['x'].shape)}*{list(arrays['w'].shape)} s={stride} p={padding} bias={bias}", arrays,
                        (lambda s, p: lambda g, x, w, b=None: g.conv1d(x, w, b, stride=s, padding=p))(stride, padding),
                        (lambda s, p: lambda x, w, b=None: F.conv1d(x, w, b, stride=s, padding=p))(stride, padding)))
    return out


@case
def conv2d_cases(rng):
    out = []
    for (n, c, h, w), (o, kh, kw), stride, padding, bias in (
            ((2, 3, 6, 5), (4, 3, 3), 1, 1, True), ((1, 2, 7, 8), (3, 3, 2), (2, 3), (1, 0), True),
            ((2, 1, 5, 5), (2, 5, 5), 1, 0, False), ((1, 3, 4, 6), (2, 1, 1), 2, 0, True)):
        arrays = {"x": normal(rng, n, c, h, w), "w": normal(rng, o, c, kh, kw)}
        if bias:
            arrays["b"] = normal(rng, o)
        out.append(Case(f"{[n, c, h, w]}*{[o, c, kh, kw]} s={stride} p={padding} bias={bias}", arrays,
                        (lambda s, p: lambda g, x, w, b=None: g.conv2d(x, w, b, stride=s, padding=p))(stride, padding),
                        (lambda s, p: lambda x, w, b=None: F.conv2d(x, w, b, stride=s, padding=p))(stride, padding)))
    return out


# ---------------------------------------------------------------- data movement, embedding

@case
def embedding_cases(rng):
    vocab, dim = 11, 5
    ids = rng.integers(0, vocab, (3, 4)).astype(np.int32)
    ids[0, 0], ids[-1, -1] = 0, vocab - 1
    return Case("", {"table": normal(rng, vocab, dim), "ids": ids},
                lambda g, table, ids: g.embedding(table, ids), lambda table, ids: F.embedding(ids, table))


@case
def reshape_cases(rng):
    return [Case(str(shape), {"x": normal(rng, 2, 3, 4)},
                 (lambda s: lambda g, x: g.reshape(x, s))(shape),
                 (lambda s: lambda x: x.reshape(s))(shape))
            for shape in ((6, 4), (-1, 2), (2, -1, 3), (24,), (1, 24, 1))]


@case
def transpose_cases(rng):
    cases = [Case(str(perm), {"x": normal(rng, 2, 3, 4, 5)},
                  (lambda p: lambda g, x: g.permute(x, p))(perm),
                  (lambda p: lambda x: x.permute(p))(perm))
             for perm in ((0, 1, 3, 2), (3, 0, 2, 1), (0, 1, 2, 3))]
    cases.append(Case("default swaps the last two", {"x": normal(rng, 3, 4, 5)},
                      lambda g, x: g.transpose(x), lambda x: x.transpose(-1, -2)))
    return cases


@case
def concat_cases(rng):
    return [Case(f"axis={axis}", {"a": normal(rng, 2, 3, 4), "b": normal(rng, *shape_b), "c": normal(rng, *shape_c)},
                 (lambda ax: lambda g, a, b, c: g.concat([a, b, c], axis=ax))(axis),
                 (lambda ax: lambda a, b, c: torch.cat([a, b, c], dim=ax))(axis))
            for axis, shape_b, shape_c in ((0, (1, 3, 4), (3, 3, 4)), (1, (2, 5, 4), (2, 1, 4)), (-1, (2, 3, 2), (2, 3, 1)))]


@case
def slice_cases(rng):
    return [Case(f"axis={axis} [{start}:{stop}]", {"x": normal(rng, 4, 5, 6)},
                 (lambda a, s, e: lambda g, x: g.slice(x, a, s, e))(axis, start, stop),
                 (lambda a, s, e: lambda x: x.narrow(a, s, e - s))(axis, start, stop))
            for axis, start, stop in ((0, 1, 3), (1, 0, 5), (2, 5, 6), (-1, 2, 4), (-2, 3, 4))]


def torch_pad(axis, before, after):
    def fn(x):
        ax = axis % x.ndim
        widths = [0, 0] * (x.ndim - 1 - ax) + [before, after]
        return F.pad(x, widths)
    return fn


@case
def pad_cases(rng):
    return [Case(f"axis={axis} ({before}, {after})", {"x": normal(rng, 2, 3, 4)},
                 (lambda a, b, e: lambda g, x: g.apply("pad", x, axis=a, before=b, after=e))(axis, before, after),
                 torch_pad(axis, before, after))
            for axis, before, after in ((0, 1, 2), (1, 0, 3), (2, 2, 0), (-1, 1, 1))]


@case
def broadcast_to_cases(rng):
    return [Case(f"{list(src)}->{list(dst)}", {"x": normal(rng, *src)},
                 (lambda d: lambda g, x: g.apply("broadcast_to", x, shape=d))(dst),
                 (lambda d: lambda x: torch.broadcast_to(x, d))(dst))
            for src, dst in (((3, 1), (2, 3, 4)), ((4,), (3, 4)), ((), (2, 2)), ((2, 3), (2, 3)))]


# ---------------------------------------------------------------- backward ops (against torch.autograd)

def torch_vjp(forward, wrt, shape=None):
    """What a backward op computes, by torch.autograd: the gradient of
    ``forward(**tensors)`` with respect to ``tensors[wrt]``, contracted with ``dout``.
    With ``shape``, ``wrt`` is not an operand of the op: ``forward`` is linear in it
    (a convolution in x or w, an embedding in its table), so zeros of that shape give
    the same gradient as any other value."""
    def fn(dout, **tensors):
        value = tensors[wrt] if shape is None else torch.zeros(shape, dtype=dout.dtype)
        with torch.enable_grad():
            leaf = value.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(forward(**{**tensors, wrt: leaf}), leaf, dout)
        return grad
    return fn


@case
def pointwise_grad_cases(rng):
    forwards = {"relu_grad": ({}, F.relu), "abs_grad": ({}, torch.abs), "gelu_grad": ({}, F.gelu),
                "gelu_grad tanh": ({"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh"))}
    out = []
    for label, (attrs, forward) in forwards.items():
        s = dims(rng, 3)
        op = label.split()[0]
        out.append(Case(label, {"dout": normal(rng, *s), "x": normal(rng, *s, scale=2.0)},
                        (lambda op, attrs: lambda g, dout, x: g.apply(op, dout, x, **attrs))(op, attrs),
                        torch_vjp((lambda f: lambda x: f(x))(forward), "x")))
    return out


@case
def max_grad_cases(rng):
    """Small integers as values, so maxima tie: the gradient is split among them."""
    out = []
    for axis, keepdims in ((None, False), (-1, False), (-1, True), (None, True)):
        x = rng.integers(0, 3, (3, 2, 5)).astype(np.float32)
        reduced = np.amax(x, axis=axis, keepdims=keepdims)
        out.append(Case(f"axis={axis} keepdims={keepdims}", {"dout": normal(rng, *reduced.shape), "x": x},
                        (lambda a, k: lambda g, dout, x: g.apply("max_grad", dout, x, axis=a, keepdims=k))(axis, keepdims),
                        torch_vjp((lambda a, k: lambda x: torch.amax(
                            x, dim=tuple(range(x.ndim)) if a is None else a, keepdim=k))(axis, keepdims), "x")))
    return out


def torch_norm_param_grads(norm, center: bool):
    """norm_param_grad by torch.autograd: the gradients of the norm's weight and (center)
    bias, contracted with dout, as rows padded with zeros to a multiple of PART_ALIGN."""
    def fn(dout, x):
        n = x.shape[-1]
        params = [torch.ones(n, dtype=x.dtype, requires_grad=True)]
        if center:
            params.append(torch.zeros(n, dtype=x.dtype, requires_grad=True))
        with torch.enable_grad():
            grads = torch.autograd.grad(norm(x, *params), params, dout)
        out = torch.zeros(len(grads), -(-n // PART_ALIGN) * PART_ALIGN, dtype=x.dtype)
        out[:, :n] = torch.stack(grads)
        return out
    return fn


@case
def norm_grad_cases(rng):
    """The norms' backward kernels against torch.autograd through F.layer_norm and
    F.rms_norm: dx, and the weight's and bias's gradients."""
    out = []
    for center, eps in ((True, 1e-5), (False, 1e-6), (True, 1e-2)):
        shape = (2,) + dims(rng, 2, 2, 9)
        n = shape[-1]
        norm = ((lambda e: lambda x, w, b=None: F.layer_norm(x, x.shape[-1:], w, b, e)) if center
                else (lambda e: lambda x, w: F.rms_norm(x, x.shape[-1:], w, e)))(eps)
        attrs = dict(eps=eps, center=center)
        x, dout = normal(rng, *shape, scale=2.0) + 1.0, normal(rng, *shape)
        out.append(Case(f"dx center={center} eps={eps}", {"dout": dout, "x": x, "w": normal(rng, n)},
                        (lambda a: lambda g, dout, x, w: g.apply("norm_grad", dout, x, w, **a))(attrs),
                        torch_vjp(norm, "x")))
        out.append(Case(f"dw db center={center} eps={eps}", {"dout": dout, "x": x},
                        (lambda a: lambda g, dout, x: g.apply("norm_param_grad", dout, x, **a))(attrs),
                        torch_norm_param_grads(norm, center)))
    return out


@case
def row_dot_cases(rng):
    out = []
    for shape in ((2, 5, 3, 8), (4, 7), (6,)):
        out.append(Case(f"rows of {shape[-1]}", {"a": normal(rng, *shape), "b": normal(rng, *shape)},
                        lambda g, a, b: g.apply("row_dot", a, b), lambda a, b: (a * b).sum(dim=-1)))
    return out


@case
def cross_entropy_grad_cases(rng):
    out = []
    for label, batch, ignored in (("some ignored", (2, 5), 0.3), ("none ignored", (6,), 0.0), ("all but one", (4,), 1.0)):
        labels = rng.integers(0, 7, batch).astype(np.int32)
        drop = rng.random(batch) < ignored
        drop.reshape(-1)[0] = False
        labels[drop] = -100
        arrays = {"logits": normal(rng, *batch, 7, scale=2.0), "labels": labels, "dout": np.float32(rng.uniform(0.5, 2))}
        out.append(Case(label, {k: np.asarray(v) for k, v in arrays.items()},
                        lambda g, logits, labels, dout: g.apply("cross_entropy_grad", logits, labels, dout),
                        torch_vjp(lambda logits, labels: torch_int_cross_entropy(-100)(logits, labels), "logits")))
    return out


@case
def embedding_grad_cases(rng):
    vocab, dim = 6, 3
    ids = rng.integers(0, vocab, (3, 5)).astype(np.int32)  # 15 ids over 6 rows: repeats accumulate
    return Case("", {"dout": normal(rng, 3, 5, dim), "ids": ids},
                lambda g, dout, ids: g.apply("embedding_grad", dout, ids, vocab=vocab),
                torch_vjp(lambda ids, table: F.embedding(ids, table), "table", shape=(vocab, dim)))


CONV_GRAD_SETTINGS = (  # input shape, weight shape, stride, padding
    ((2, 3, 10), (4, 3, 3), (2,), (0,)),   # stride leaves the last input column unused
    ((1, 2, 7), (3, 2, 2), (1,), (1,)),
    ((2, 2, 6, 5), (3, 2, 3, 2), (1, 2), (1, 0)),
    ((1, 3, 5, 5), (2, 3, 3, 3), (2, 2), (1, 1)),
)
TORCH_CONV = {1: F.conv1d, 2: F.conv2d}


def conv_out_shape(x_shape, w_shape, stride, padding):
    spatial = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(x_shape[2:], w_shape[2:], stride, padding)]
    return (x_shape[0], w_shape[0], *spatial)


@case
def conv_input_grad_cases(rng):
    out = []
    for x_shape, w_shape, stride, padding in CONV_GRAD_SETTINGS:
        conv = TORCH_CONV[len(stride)]
        arrays = {"dout": normal(rng, *conv_out_shape(x_shape, w_shape, stride, padding)), "w": normal(rng, *w_shape)}
        out.append(Case(f"{list(x_shape)} s={stride} p={padding}", arrays,
                        (lambda xs, s, p: lambda g, dout, w: g.apply(
                            "conv_input_grad", dout, w, stride=s, padding=p, input_shape=xs))(x_shape, stride, padding),
                        torch_vjp((lambda c, s, p: lambda x, w: c(x, w, stride=s, padding=p))(conv, stride, padding),
                                  "x", shape=x_shape)))
    return out


@case
def conv_weight_grad_cases(rng):
    out = []
    for x_shape, w_shape, stride, padding in CONV_GRAD_SETTINGS:
        conv = TORCH_CONV[len(stride)]
        arrays = {"x": normal(rng, *x_shape), "dout": normal(rng, *conv_out_shape(x_shape, w_shape, stride, padding))}
        out.append(Case(f"{list(w_shape)} s={stride} p={padding}", arrays,
                        (lambda k, s, p: lambda g, x, dout: g.apply(
                            "conv_weight_grad", x, dout, stride=s, padding=p, kernel=k))(w_shape[2:], stride, padding),
                        torch_vjp((lambda c, s, p: lambda x, w: c(x, w, stride=s, padding=p))(conv, stride, padding),
                                  "w", shape=w_shape)))
    return out


# ---------------------------------------------------------------- ONNX import ops

def small_ints(rng, *shape, lo=-2, hi=2) -> np.ndarray:
    """Integer-valued floats: comparisons, maximum/minimum and pooling see ties."""
    return rng.integers(lo, hi + 1, shape).astype(np.float32)


ONNX_UNARY_TORCH = {  # label: (op, attrs, torch function, input domain)
    "erf": ("erf", {}, torch.special.erf, lambda rng, *s: normal(rng, *s, scale=2.0)),
    "softplus": ("softplus", {}, F.softplus, lambda rng, *s: normal(rng, *s, scale=5.0)),
    "softplus large": ("softplus", {}, F.softplus, lambda rng, *s: normal(rng, *s, scale=30.0)),
    "floor": ("floor", {}, torch.floor, lambda rng, *s: np.concatenate([normal(rng, *s, scale=3.0), small_ints(rng, *s)])),
    "ceil": ("ceil", {}, torch.ceil, lambda rng, *s: np.concatenate([normal(rng, *s, scale=3.0), small_ints(rng, *s)])),
    "sign": ("sign", {}, torch.sign, lambda rng, *s: np.concatenate([normal(rng, *s), small_ints(rng, *s)])),
    "logical_not": ("logical_not", {}, lambda x: torch.logical_not(x).to(x.dtype),
                    lambda rng, *s: normal(rng, *s) * small_ints(rng, *s, lo=0, hi=1)),
    "leaky_relu": ("leaky_relu", {}, F.leaky_relu, normal),
    "leaky_relu alpha=0.2": ("leaky_relu", {"alpha": 0.2}, lambda x: F.leaky_relu(x, 0.2), normal),
    "cast f32": ("cast", {"dtype": "f32"}, lambda x: x.clone(), normal),
}


@case
def onnx_unary_cases(rng):
    return [Case(label, {"x": domain(rng, *dims(rng, 3))},
                 (lambda op, attrs: lambda g, x: g.apply(op, x, **attrs))(op, attrs),
                 (lambda fn: lambda x: fn(x))(fn))
            for label, (op, attrs, fn, domain) in ONNX_UNARY_TORCH.items()]


@case
def cast_and_index_cases(rng):
    """i32 results come back through cast to f32, which the harness compares."""
    ids = rng.integers(-5, 5, (3, 4)).astype(np.int32)
    return [Case("f32 -> i32 truncates toward zero", {"x": normal(rng, 3, 5, scale=4.0)},
                 lambda g, x: g.apply("cast", g.apply("cast", x, dtype="i32"), dtype="f32"),
                 lambda x: x.to(torch.int32).to(x.dtype)),
            Case("i32 -> f32", {"ids": ids}, lambda g, ids: g.apply("cast", ids, dtype="f32"),
                 lambda ids: ids.double()),
            Case("index_wrap", {"ids": ids},
                 lambda g, ids: g.apply("cast", g.apply("index_wrap", ids, size=5), dtype="f32"),
                 lambda ids: torch.where(ids < 0, ids + 5, ids).double())]


@case
def widen_cases(rng):
    """A weight stored as bf16, read back as f32: torch's bfloat16 holds the same values."""
    w = torch.from_numpy(normal(rng, 6, 10, scale=3.0)).to(torch.bfloat16).float().numpy()
    return [Case("bf16 -> f32", {"w": w}, lambda g, w: g.apply("widen", w),
                 lambda w: w.to(torch.bfloat16).to(w.dtype), bf16=("w",))]


ONNX_BINARY_TORCH = {"maximum": torch.maximum, "minimum": torch.minimum, "power": torch.pow,
                     "equal": torch.eq, "less": torch.lt, "greater": torch.gt, "less_equal": torch.le,
                     "greater_equal": torch.ge}


@case
def onnx_binary_cases(rng):
    """Broadcast float operands (integer-valued for ties), and i32 operands where the op takes them."""
    out = []
    for op, fn in ONNX_BINARY_TORCH.items():
        tf = (lambda fn: lambda a, b: fn(a, b).to(torch.float64 if a.dtype == torch.int64 else a.dtype))(fn)
        build = (lambda op: lambda g, a, b: g.apply(op, a, b))(op)
        if op == "power":
            out.append(Case(f"{op} positive base", {"a": positive(rng, 2, 3, 4), "b": normal(rng, 3, 1)}, build, tf))
            out.append(Case(f"{op} integer exponents", {"a": normal(rng, 3, 4), "b": small_ints(rng, 4, lo=-2, hi=3)},
                            build, tf))
            continue
        out.append(Case(f"{op} normal", {"a": normal(rng, 2, 3, 4), "b": normal(rng, 3, 1)}, build, tf))
        out.append(Case(f"{op} ties", {"a": small_ints(rng, 4), "b": small_ints(rng, 2, 3, 4)}, build, tf))
        ints = {"a": rng.integers(-3, 4, (3, 4)).astype(np.int32), "b": rng.integers(-3, 4, (4,)).astype(np.int32)}
        int_build = build if op not in ("maximum", "minimum") else \
            (lambda op: lambda g, a, b: g.apply("cast", g.apply(op, a, b), dtype="f32"))(op)
        out.append(Case(f"{op} i32", ints, int_build, tf))
    return out


@case
def where_cases(rng):
    out = []
    for sc, sx, sy in (((3, 4), (3, 4), (3, 4)), ((3, 1), (2, 3, 4), (4,)), ((2, 1, 4), (), (3, 1))):
        cond = small_ints(rng, *sc, lo=0, hi=1) * normal(rng, *sc)  # any non-zero value is true
        out.append(Case(f"{list(sc)} {list(sx)} {list(sy)}", {"c": cond, "x": normal(rng, *sx), "y": normal(rng, *sy)},
                        lambda g, c, x, y: g.apply("where", c, x, y),
                        lambda c, x, y: torch.where(c != 0, x, y)))
    return out


def torch_pads(pads):
    """ONNX order (begins, then ends; first axis first) -> F.pad's (last axis first)."""
    nd = len(pads) // 2
    return tuple(p for i in reversed(range(nd)) for p in (pads[i], pads[nd + i]))


TORCH_CONV_ND = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_GENERAL_SETTINGS = (  # input shape, weight shape, stride, pads, dilation, groups
    ((2, 4, 11), (6, 2, 3), (2,), (2, 1), (2,), 2),
    ((1, 3, 9), (3, 1, 4), (1,), (0, 3), (1,), 3),
    ((2, 4, 6, 7), (4, 2, 3, 2), (1, 2), (1, 0, 2, 1), (2, 1), 2),
    ((1, 6, 5, 5), (6, 1, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 6),
    ((1, 2, 4, 5, 4), (2, 2, 2, 3, 2), (1, 2, 1), (1, 0, 1, 0, 1, 1), (1, 1, 2), 1),
)


def torch_conv_general(stride, pads, dilation, groups):
    return lambda x, w, b=None: TORCH_CONV_ND[len(stride)](F.pad(x, torch_pads(pads)), w, b, stride=stride,
                                                           dilation=dilation, groups=groups)


@case
def conv_general_cases(rng):
    out = []
    for i, (xs, ws, stride, pads, dil, groups) in enumerate(CONV_GENERAL_SETTINGS):
        arrays = {"x": normal(rng, *xs), "w": normal(rng, *ws)}
        if i % 2 == 0:
            arrays["b"] = normal(rng, ws[0])
        attrs = dict(stride=stride, pads=pads, dilation=dil, groups=groups)
        out.append(Case(f"{list(xs)}*{list(ws)} s={stride} p={pads} d={dil} g={groups} bias={'b' in arrays}", arrays,
                        (lambda a: lambda g, x, w, b=None: g.apply("conv_general", *([x, w] if b is None else [x, w, b]),
                                                                   **a))(attrs),
                        torch_conv_general(stride, pads, dil, groups)))
    return out


def conv_general_out_shape(xs, ws, stride, pads, dil):
    nd = len(stride)
    return (xs[0], ws[0]) + tuple((xs[2 + i] + pads[i] + pads[nd + i] - dil[i] * (ws[2 + i] - 1) - 1) // stride[i] + 1
                                  for i in range(nd))


@case
def conv_general_grad_cases(rng):
    out = []
    for xs, ws, stride, pads, dil, groups in CONV_GENERAL_SETTINGS:
        attrs = dict(stride=stride, pads=pads, dilation=dil, groups=groups)
        forward = torch_conv_general(stride, pads, dil, groups)
        dout = normal(rng, *conv_general_out_shape(xs, ws, stride, pads, dil))
        label = f"{list(xs)}*{list(ws)} s={stride} p={pads} d={dil} g={groups}"
        out.append(Case(f"input {label}", {"dout": dout, "w": normal(rng, *ws)},
                        (lambda a, s: lambda g, dout, w: g.apply("conv_general_input_grad", dout, w, input_shape=s,
                                                                 **a))(attrs, xs),
                        torch_vjp(forward, "x", shape=xs)))
        out.append(Case(f"weight {label}", {"x": normal(rng, *xs), "dout": dout},
                        (lambda a, k: lambda g, x, dout: g.apply("conv_general_weight_grad", x, dout, kernel=k,
                                                                 **a))(attrs, ws[2:]),
                        torch_vjp(forward, "w", shape=ws)))
    return out


POOL_SETTINGS = (  # input shape, kernel, stride, pads, dilation, ceil_mode; pads within torch's half-kernel limit
    ((2, 3, 11), (3,), (2,), (1, 1), (1,), False),
    ((2, 3, 10), (3,), (3,), (1, 1), (2,), True),
    ((1, 2, 7, 8), (3, 2), (2, 1), (1, 0, 1, 0), (1, 1), False),
    ((2, 2, 6, 7), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True),
    ((1, 3, 7, 6), (2, 3), (2, 2), (0, 1, 0, 1), (2, 1), True),
    ((1, 2, 6, 6), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), False),
)
TORCH_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d}
TORCH_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d}


def torch_max_pool(kernel, stride, pads, dilation, ceil_mode):
    """Symmetric pads by torch's padding; other pads by F.pad with -inf first."""
    nd = len(kernel)
    pool = TORCH_MAX_POOL[nd]
    if pads[:nd] == pads[nd:]:
        return lambda x: pool(x, kernel, stride, pads[:nd], dilation, ceil_mode=ceil_mode)
    assert not ceil_mode
    return lambda x: pool(F.pad(x, torch_pads(pads), value=-torch.inf), kernel, stride, 0, dilation)


def pool_attrs(kernel, stride, pads, dilation, ceil_mode):
    return dict(kernel=kernel, stride=stride, pads=pads, dilation=dilation, ceil_mode=ceil_mode)


@case
def max_pool_cases(rng):
    out = []
    for xs, *setting in POOL_SETTINGS + (((1, 2, 6, 7), (3, 2), (1, 2), (2, 0, 0, 1), (1, 2), False),):
        for values in ("normal", "ties"):
            x = normal(rng, *xs) if values == "normal" else small_ints(rng, *xs)
            out.append(Case(f"{list(xs)} k={setting[0]} s={setting[1]} p={setting[2]} d={setting[3]} "
                            f"ceil={setting[4]} {values}", {"x": x},
                            (lambda a: lambda g, x: g.apply("max_pool", x, **a))(pool_attrs(*setting)),
                            torch_max_pool(*setting)))
    return out


@case
def max_pool_grad_cases(rng):
    """Small integers as values, so window maxima tie: torch routes dout to the first."""
    out = []
    for xs, *setting in POOL_SETTINGS + (((1, 2, 6, 7), (3, 2), (1, 2), (2, 0, 0, 1), (1, 2), False),):
        attrs = pool_attrs(*setting)
        x = small_ints(rng, *xs)
        dout = normal(rng, *OPS["max_pool"].ref(x, **attrs).shape)
        out.append(Case(f"{list(xs)} k={setting[0]} s={setting[1]} p={setting[2]} d={setting[3]} ceil={setting[4]}",
                        {"dout": dout, "x": x},
                        (lambda a: lambda g, dout, x: g.apply("max_pool_grad", dout, x, **a))(attrs),
                        torch_vjp(torch_max_pool(*setting), "x")))
    return out


def torch_avg_pool(kernel, stride, pads, dilation, ceil_mode, count_include_pad):
    """torch's avg_pool (symmetric pads, no dilation); dilated windows (pads not counted,
    no ceil_mode) as window sums over window counts by depthwise convolutions with ones."""
    nd = len(kernel)
    if all(d == 1 for d in dilation):
        assert pads[:nd] == pads[nd:]
        return lambda x: TORCH_AVG_POOL[nd](x, kernel, stride, pads[:nd], ceil_mode=ceil_mode,
                                            count_include_pad=count_include_pad)
    assert not ceil_mode and not count_include_pad

    def fn(x):
        ones = torch.ones((x.shape[1], 1) + kernel, dtype=x.dtype)
        conv = lambda t: TORCH_CONV_ND[nd](F.pad(t, torch_pads(pads)), ones, stride=stride, dilation=dilation,
                                           groups=x.shape[1])
        return conv(x) / conv(torch.ones_like(x))
    return fn


@case
def avg_pool_cases(rng):
    out = []
    settings = [s for s in POOL_SETTINGS if all(d == 1 for d in s[4])]
    for xs, *setting in settings:
        for include in (False, True):
            out.append(Case(f"{list(xs)} k={setting[0]} s={setting[1]} p={setting[2]} ceil={setting[4]} "
                            f"count_include_pad={include}", {"x": normal(rng, *xs)},
                            (lambda a: lambda g, x: g.apply("avg_pool", x, **a))(
                                dict(pool_attrs(*setting), count_include_pad=include)),
                            torch_avg_pool(*setting, include)))
    for xs, *setting in (((2, 3, 11), (3,), (2,), (2, 1), (2,), False),
                         ((1, 2, 7, 8), (2, 3), (2, 1), (1, 0, 0, 2), (2, 2), False)):
        out.append(Case(f"{list(xs)} k={setting[0]} s={setting[1]} p={setting[2]} d={setting[3]}",
                        {"x": normal(rng, *xs)},
                        (lambda a: lambda g, x: g.apply("avg_pool", x, **a))(pool_attrs(*setting)),
                        torch_avg_pool(*setting, False)))
    return out


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_matches_torch(case):
    check_case(case)


def test_every_op_has_a_torch_case():
    """The coverage table: the ops that appear in the graphs of the cases above."""
    covered = {node.op for c in CASES for node in build_graph(c).nodes}
    expected = {name for name, opdef in OPS.items() if opdef.archetype != SOURCE}
    missing = sorted(expected - covered)
    assert not missing, f"ops without a PyTorch comparison in {__name__}: {missing}"


# ---------------------------------------------------------------- random shapes (hypothesis)

HYPOTHESIS = settings(max_examples=25, deadline=None)


@st.composite
def broadcast_pair(draw):
    """Two shapes that broadcast: a full shape, each operand dropping leading axes and
    turning some axes into length 1."""
    full = draw(st.lists(st.integers(1, 5), min_size=0, max_size=4))

    def operand():
        rank = draw(st.integers(0, len(full)))
        tail = full[len(full) - rank:]
        return tuple(1 if draw(st.booleans()) else n for n in tail)

    return operand(), operand()


@HYPOTHESIS
@given(op=st.sampled_from(sorted(BINARY_BUILDERS)), shapes=broadcast_pair(), seed=st.integers(0, 2**32 - 1))
def test_binary_broadcasting_random_shapes(op, shapes, seed):
    rng = np.random.default_rng(seed)
    sa, sb = shapes
    b = away_from_zero(rng, *sb) if op == "div" else normal(rng, *sb)
    check_case(Case(op, {"a": normal(rng, *sa), "b": b},
                    lambda g, a, b: getattr(g, op)(a, b), lambda a, b: BINARY_BUILDERS[op](a, b)))


@HYPOTHESIS
@given(batch=st.lists(st.integers(1, 3), max_size=2), mkn=st.tuples(*[st.integers(1, 12)] * 3),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()), seed=st.integers(0, 2**32 - 1))
def test_matmul_random_shapes(batch, mkn, flags, seed):
    """Batch axes broadcast: each operand keeps or drops each batch axis, or has it length 1."""
    rng = np.random.default_rng(seed)
    ta, tb, a_ones, b_drop = flags
    batch_a = tuple(1 if a_ones else n for n in batch)
    batch_b = tuple(batch[1:]) if b_drop else tuple(batch)
    a, b = matmul_operands(rng, batch_a, batch_b, *mkn, ta, tb)
    check_case(Case("matmul", {"a": a, "b": b},
                    lambda g, a, b: g.matmul(a, b, transpose_a=ta, transpose_b=tb), torch_matmul(ta, tb)))


@HYPOTHESIS
@given(op=st.sampled_from(sorted(REDUCE_TORCH)), shape=st.lists(st.integers(1, 7), min_size=1, max_size=4),
       axis=st.sampled_from([None, -1]), keepdims=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_reductions_random_shapes(op, shape, axis, keepdims, seed):
    check_case(reduce_case(op, normal(np.random.default_rng(seed), *shape), axis, keepdims))


@HYPOTHESIS
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_softmax_and_norms_random_shapes(shape, seed):
    rng = np.random.default_rng(seed)
    c = shape[-1]
    arrays = {"x": normal(rng, *shape, scale=3.0), "w": normal(rng, c), "b": normal(rng, c)}
    check_case(Case("log_softmax", {"x": arrays["x"]}, lambda g, x: g.log_softmax(x), lambda x: F.log_softmax(x, -1)))
    check_case(Case("layer_norm", arrays, lambda g, x, w, b: g.layer_norm(x, w, b),
                    lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5)))
