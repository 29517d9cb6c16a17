"""The forward ops: sources, elementwise, reductions, losses, the matmul family, attention and
rope (with the attention backward's ops), convolution and data movement.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from scipy import special

from ...errors import GraphError
from .table import ATTENTION, CONV, COPY, GATHER, MATMUL, OPS, OpShapeError, POINTWISE, REDUCTION, SOURCE, Shape, TensorType, VIEW, _fail, _norm_axis, _require_float, broadcast_shapes, defop


# ---------------------------------------------------------------- sources

def _no_shape(ts, a):
    raise OpShapeError("sources are created with Graph.input/parameter/constant")


for _src in ("input", "parameter", "constant"):
    defop(_src, SOURCE, _no_shape, lambda *a, **k: None, doc=f"a graph {_src}")


# ---------------------------------------------------------------- elementwise

def _unary_shape(ts, a):
    _require_float(ts)
    return TensorType(ts[0].shape)


def _binary_shape(ts, a):
    _require_float(ts)
    return TensorType(broadcast_shapes(ts[0].shape, ts[1].shape))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_ref(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + special.erf(x / math.sqrt(2.0)))


def sigmoid_ref(x):
    return special.expit(x)


UNARY: dict[str, Callable] = {
    "neg": lambda x: -x,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x,
    "abs": np.abs,
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": sigmoid_ref,
    "tanh": np.tanh,
    "silu": lambda x: x * sigmoid_ref(x),
    "stop_gradient": lambda x: x,
}
for _name, _fn in UNARY.items():
    defop(_name, POINTWISE, _unary_shape, (lambda fn: lambda x: fn(x))(_fn), elementwise=True)

defop("gelu", POINTWISE, _unary_shape, gelu_ref, elementwise=True,
      doc="approximate='none' (erf) or 'tanh'", approximate="none")
defop("pow", POINTWISE, _unary_shape, lambda x, exponent: np.power(x, exponent),
      elementwise=True, doc="x ** exponent, exponent a constant", exponent=None)

BINARY: dict[str, Callable] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
}
for _name, _fn in BINARY.items():
    defop(_name, POINTWISE, _binary_shape, (lambda fn: lambda x, y: fn(x, y))(_fn), elementwise=True)


def _bias_add_shape(ts, a):
    _require_float(ts)
    x, b = ts
    if len(b.shape) != 1 or not x.shape or x.shape[-1] != b.shape[0]:
        _fail(f"bias {list(b.shape)} must be 1-D and match the last axis of {list(x.shape)}")
    return TensorType(x.shape)


defop("bias_add", POINTWISE, _bias_add_shape, lambda x, b: x + b, elementwise=True,
      doc="x + b with b over the last axis")


# Fused pointwise DAG. `program` is a tuple of instructions (op, args, attrs) where each
# arg is ("in", i) for the i-th input, ("t", j) for instruction j's result or
# ("c", float) for a scalar constant. The last instruction is the result.

def _pointwise_shape(ts, a):
    _require_float(ts)
    return TensorType(broadcast_shapes(*(t.shape for t in ts)))


def run_program(program, inputs, xp=np):
    temps = []
    for op, args, attrs in program:
        vals = [inputs[v] if k == "in" else temps[v] if k == "t" else xp.asarray(v, dtype=inputs[0].dtype)
                for k, v in args]
        temps.append(OPS[op].ref(*vals, **dict(attrs)))
    return temps[-1]


def _pointwise_ref(*xs, program):
    out = run_program(program, xs)
    return np.broadcast_to(out, np.broadcast_shapes(*(x.shape for x in xs))).copy()


defop("pointwise", POINTWISE, _pointwise_shape, _pointwise_ref, elementwise=True,
      doc="a fused DAG of elementwise ops (attribute 'program')", program=())


def _swiglu_shape(ts, a):
    return _binary_shape(ts, a)


defop("swiglu", POINTWISE, _swiglu_shape, lambda g, u: g * sigmoid_ref(g) * u, elementwise=True,
      doc="silu(gate) * up")


# ---------------------------------------------------------------- reductions

def _reduce_shape(ts, a):
    _require_float(ts)
    shape = ts[0].shape
    axis = a.get("axis")
    if axis is None:
        return TensorType((1,) * len(shape) if a.get("keepdims") else ())
    if not shape:
        _fail("cannot reduce over an axis of a scalar")
    ax = _norm_axis(axis, len(shape))
    if ax != len(shape) - 1:
        _fail(f"reductions run over the last axis or everything, got axis {axis}")
    return TensorType(shape[:-1] + ((1,) if a.get("keepdims") else ()))


for _name, _fn in (("sum", np.sum), ("mean", np.mean), ("max", np.max)):
    defop(_name, REDUCTION, _reduce_shape,
          (lambda fn: lambda x, axis=None, keepdims=False: np.asarray(fn(x, axis=axis, keepdims=keepdims)))(_fn),
          doc="over the last axis (axis=-1) or everything (axis=None)", axis=None, keepdims=False)


def _sum_to_shape(ts, a):
    target = tuple(a["shape"])
    if broadcast_shapes(ts[0].shape, target) != ts[0].shape:
        _fail(f"cannot sum {list(ts[0].shape)} down to {list(target)}")
    return TensorType(target)


def sum_to_ref(x, shape):
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


defop("sum_to", REDUCTION, _sum_to_shape, sum_to_ref,
      doc="sum a broadcast result back to an operand's shape (gradient of broadcasting)", shape=())


def _last_axis_shape(ts, a):
    _require_float(ts)
    if not ts[0].shape:
        _fail("needs at least one axis")
    return TensorType(ts[0].shape)


def softmax_ref(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax_ref(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


defop("softmax", REDUCTION, _last_axis_shape, softmax_ref, doc="over the last axis")
defop("log_softmax", REDUCTION, _last_axis_shape, log_softmax_ref, doc="over the last axis")


def _norm_shape(n_params):
    def rule(ts, a):
        _require_float(ts)
        x = ts[0]
        if not x.shape:
            _fail("needs at least one axis")
        for i, p in enumerate(ts[1:1 + n_params]):
            if p.shape != (x.shape[-1],):
                _fail(f"parameter {i} has shape {list(p.shape)}, expected [{x.shape[-1]}]")
        return TensorType(x.shape)
    return rule


def layer_norm_ref(x, w, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rms_norm_ref(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


defop("layer_norm", REDUCTION, _norm_shape(2), layer_norm_ref, doc="over the last axis", eps=1e-5)
defop("rms_norm", REDUCTION, _norm_shape(1), rms_norm_ref, doc="over the last axis", eps=1e-6)


def _group_norm_shape(ts, a):
    _require_float(ts)
    x = ts[0]
    if len(x.shape) < 2:
        _fail(f"input must be [batch, channels, ...], found {list(x.shape)}")
    c, g = x.shape[1], a["num_groups"]
    if g <= 0 or c % g:
        _fail(f"{c} channels do not split into {g} groups")
    for i, p in enumerate(ts[1:]):
        if p.shape != (c,):
            _fail(f"parameter {i} has shape {list(p.shape)}, expected [{c}]")
    return TensorType(x.shape)


def group_norm_ref(x, w, b, num_groups, eps=1e-5, activation="none"):
    n, c = x.shape[:2]
    xg = x.reshape(n, num_groups, -1)
    mu = xg.mean(axis=-1, keepdims=True)
    var = ((xg - mu) ** 2).mean(axis=-1, keepdims=True)
    bshape = (1, c) + (1,) * (x.ndim - 2)
    y = ((xg - mu) / np.sqrt(var + eps)).reshape(x.shape) * w.reshape(bshape) + b.reshape(bshape)
    return y * sigmoid_ref(y) if activation == "silu" else y


defop("group_norm", REDUCTION, _group_norm_shape, group_norm_ref,
      doc="over channel groups of [N, C, ...]; activation 'none' or 'silu' (fused)",
      num_groups=1, eps=1e-5, activation="none")


# ---------------------------------------------------------------- losses

def _scalar_loss_shape(check):
    def rule(ts, a):
        check(ts, a)
        return TensorType(())
    return rule


def _ce_check(ts, a):
    logits, labels = ts
    _require_float([logits], "logits")
    if labels.dtype != "i32":
        _fail(f"integer labels must be i32, found {labels.dtype}")
    if not logits.shape or logits.shape[:-1] != labels.shape:
        _fail(f"labels {list(labels.shape)} must match logits {list(logits.shape)} without the class axis")


def cross_entropy_ref(logits, labels, ignore_index=-100):
    lp = log_softmax_ref(logits).reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1).astype(np.int64)
    keep = lab != ignore_index
    check_index_range(lab[keep], logits.shape[-1], "cross_entropy labels (other than ignore_index)")
    picked = lp[np.arange(lab.size), np.where(keep, lab, 0)]
    return np.asarray(-(picked * keep).sum() / max(int(keep.sum()), 1), dtype=logits.dtype)


def _soft_ce_check(ts, a):
    _require_float(ts)
    if ts[0].shape != ts[1].shape or not ts[0].shape:
        _fail(f"soft targets {list(ts[1].shape)} must have the logits' shape {list(ts[0].shape)}")


def soft_cross_entropy_ref(logits, targets):
    rows = int(np.prod(logits.shape[:-1]))
    return np.asarray(-(targets * log_softmax_ref(logits)).sum() / max(rows, 1), dtype=logits.dtype)


def _same_shape_check(ts, a):
    _require_float(ts)
    if ts[0].shape != ts[1].shape:
        _fail(f"prediction {list(ts[0].shape)} and target {list(ts[1].shape)} differ")


def bce_ref(logits, targets):
    loss = np.maximum(logits, 0) - logits * targets + np.log1p(np.exp(-np.abs(logits)))
    return np.asarray(loss.mean(), dtype=logits.dtype)


defop("cross_entropy", REDUCTION, _scalar_loss_shape(_ce_check), cross_entropy_ref,
      doc="mean over non-ignored positions of -log softmax(logits)[label]; 0 if all are ignored",
      ignore_index=-100)
defop("soft_cross_entropy", REDUCTION, _scalar_loss_shape(_soft_ce_check), soft_cross_entropy_ref,
      doc="mean over rows of -sum(targets * log_softmax(logits))")
defop("mse_loss", REDUCTION, _scalar_loss_shape(_same_shape_check),
      lambda p, t: np.asarray(((p - t) ** 2).mean(), dtype=p.dtype), doc="mean squared error")
defop("bce_loss", REDUCTION, _scalar_loss_shape(_same_shape_check), bce_ref,
      doc="binary cross-entropy on logits (as torch's binary_cross_entropy_with_logits), mean")


# ---------------------------------------------------------------- matmul family

def _mm_dims(a: TensorType, b: TensorType, ta: bool, tb: bool) -> Shape:
    _require_float([a, b])
    if len(a.shape) < 2 or len(b.shape) < 2:
        _fail(f"matmul needs operands of rank >= 2, found {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape[-2:][::-1] if ta else a.shape[-2:]
    k2, n = b.shape[-2:][::-1] if tb else b.shape[-2:]
    if k != k2:
        _fail(f"inner dimensions differ: {list(a.shape)}{'ᵀ' if ta else ''} @ "
              f"{list(b.shape)}{'ᵀ' if tb else ''} ({k} != {k2})")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return batch + (m, n)


def _t(x, flag):
    return np.swapaxes(x, -1, -2) if flag else x


def _matmul_shape(ts, a):
    return TensorType(_mm_dims(ts[0], ts[1], a.get("transpose_a", False), a.get("transpose_b", False)))


def matmul_ref(a, b, transpose_a=False, transpose_b=False):
    return np.matmul(_t(a, transpose_a), _t(b, transpose_b))


defop("matmul", MATMUL, _matmul_shape, matmul_ref,
      doc="a @ b over the last two axes, batch axes broadcast; either operand may be transposed",
      transpose_a=False, transpose_b=False)

ACTIVATIONS = {"none": lambda x: x, "relu": UNARY["relu"], "silu": UNARY["silu"],
               "gelu": gelu_ref, "gelu_tanh": lambda x: gelu_ref(x, "tanh")}
ACTIVATION_OPS = {"relu": ("relu", {}), "silu": ("silu", {}), "gelu": ("gelu", {}),   # each as an op of its own
                  "gelu_tanh": ("gelu", {"approximate": "tanh"})}
# A fused_matmul's ``gradient_of``: the activation whose gradient op (dout, its input)
# multiplies the result, the activation's input the last operand (engine.optimize.activation_grad).
GRADIENT_OF = {"relu": ("relu_grad", {}), "gelu": ("gelu_grad", {}), "gelu_tanh": ("gelu_grad", {"approximate": "tanh"})}


def entry_of(table: dict, node) -> str | None:
    """The name under which ``table`` (ACTIVATION_OPS, GRADIENT_OF: name -> (op, attrs))
    lists what ``node`` computes, or None."""
    return next((name for name, (op, attrs) in table.items()
                 if node.op == op and node.attrs == {**OPS[op].attrs, **attrs}), None)


def _fused_matmul_shape(ts, a):
    out = _mm_dims(ts[0], ts[1], a.get("transpose_a", False), a.get("transpose_b", False))
    if a.get("activation", "none") not in ACTIVATIONS:
        _fail(f"unknown activation {a.get('activation')!r}")
    gradient = a.get("gradient_of", "none")
    if gradient != "none" and gradient not in GRADIENT_OF:
        _fail(f"unknown gradient_of {gradient!r}: one of none, {', '.join(GRADIENT_OF)}")
    n_extra = int(a.get("has_add", False)) + int(a.get("has_residual", False)) + int(gradient != "none")
    if len(ts) != 2 + n_extra:
        _fail(f"expected {2 + n_extra} operands, found {len(ts)}")
    for t in ts[2:]:
        _require_float([t])
        if broadcast_shapes(out, t.shape) != out:
            _fail(f"epilogue operand {list(t.shape)} does not broadcast to {list(out)}")
    if gradient != "none" and ts[-1].shape != out:
        _fail(f"the activation's input {list(ts[-1].shape)} must have the result's shape {list(out)}")
    return TensorType(out)


def fused_matmul_ref(a, b, *extra, transpose_a=False, transpose_b=False, activation="none",
                     has_add=False, has_residual=False, gradient_of="none"):
    y = matmul_ref(a, b, transpose_a, transpose_b)
    extra = list(extra)
    if has_add:
        y = y + extra.pop(0)
    y = ACTIVATIONS[activation](y)
    if has_residual:
        y = y + extra.pop(0)
    if gradient_of != "none":
        op, attrs = GRADIENT_OF[gradient_of]
        y = OPS[op].ref(y, extra.pop(0), **attrs)
    return y


defop("fused_matmul", MATMUL, _fused_matmul_shape, fused_matmul_ref,
      doc="act(a @ b + add) + residual: a matmul with its epilogue; with ``gradient_of``, that times the "
          "activation's derivative at the last operand (its gradient op applied to the result)",
      transpose_a=False, transpose_b=False, activation="none", has_add=False, has_residual=False,
      gradient_of="none")


def _norm_matmul_shape(ts, a):
    x, w, b = ts
    _norm_shape(1)([x, w], a)
    return TensorType(_mm_dims(x, b, False, a.get("transpose_b", False)))


def norm_matmul_ref(x, w, b, eps=1e-6, transpose_b=False):
    return matmul_ref(rms_norm_ref(x, w, eps), b, False, transpose_b)


defop("norm_matmul", MATMUL, _norm_matmul_shape, norm_matmul_ref,
      doc="rms_norm(x, w) @ b with the normalisation in the matmul's prologue",
      eps=1e-6, transpose_b=False)


# ---------------------------------------------------------------- attention, rope

def _attention_shape(ts, a):
    _require_float(ts)
    q, k, v = ts
    h, hkv = a["num_heads"], a.get("num_kv_heads") or a["num_heads"]
    if len(q.shape) != 3 or len(k.shape) != 3 or len(v.shape) != 3:
        _fail(f"q, k, v must be [batch, seq, heads*dim], found {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if h <= 0 or hkv <= 0:
        _fail(f"head counts must be positive, found num_heads={h}, num_kv_heads={a.get('num_kv_heads')}")
    if h % hkv:
        _fail(f"{h} query heads do not group over {hkv} key/value heads")
    if q.shape[2] % h:
        _fail(f"q width {q.shape[2]} does not split into {h} heads")
    d = q.shape[2] // h
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != hkv * d:
        _fail(f"k {list(k.shape)} and v {list(v.shape)} must be [{q.shape[0]}, seq, {hkv * d}]")
    return TensorType(q.shape)


def split_heads(x, heads):
    b, t, w = x.shape
    return x.reshape(b, t, heads, w // heads).transpose(0, 2, 1, 3)


def attention_scores(q, k, num_heads, num_kv_heads=None, causal=False, scale=None):
    """scale * q kᵀ per query head, [B, H, T, S]; -inf where the causal mask hides a key
    (key j is visible to query i iff j <= i). Grouped-query: head h reads kv head h // (H / HKV)."""
    hkv = num_kv_heads or num_heads
    qh, kh = split_heads(q, num_heads), np.repeat(split_heads(k, hkv), num_heads // hkv, axis=1)
    scale = 1.0 / math.sqrt(qh.shape[-1]) if scale is None else scale
    s = qh @ np.swapaxes(kh, -1, -2) * scale
    if causal:
        tq, tk = s.shape[-2:]
        s = np.where(np.tril(np.ones((tq, tk), dtype=bool)), s, -np.inf)
    return s


def merge_heads(x):
    """[B, H, T, D] -> [B, T, H*D]."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def attention_ref(q, k, v, num_heads, num_kv_heads=None, causal=False, scale=None):
    hkv = num_kv_heads or num_heads
    vh = np.repeat(split_heads(v, hkv), num_heads // hkv, axis=1)
    return merge_heads(softmax_ref(attention_scores(q, k, num_heads, num_kv_heads, causal, scale)) @ vh)


defop("attention", ATTENTION, _attention_shape, attention_ref,
      doc="multi-head softmax(q kᵀ * scale [+ causal mask]) v on [batch, seq, heads*dim]; "
          "grouped-query when num_kv_heads < num_heads",
      num_heads=1, num_kv_heads=None, causal=False, scale=None)


def attention_stats_layout(q_shape: Shape, num_heads: int) -> tuple[list[int], int]:
    """(offsets of the result and of the rows' log-sum-exp, total elements) of
    attention_stats' packed result: [B, T, H*D], then [B, T, H]."""
    b, t, _ = q_shape
    return packed_layout([math.prod(q_shape), b * t * num_heads])


def _attention_stats_shape(ts, a):
    q = _attention_shape(ts, a)
    return TensorType((attention_stats_layout(q.shape, a["num_heads"])[1],))


def attention_stats_ref(q, k, v, **attrs):
    (out_at, lse_at), total = attention_stats_layout(q.shape, attrs["num_heads"])
    packed = np.zeros(total, dtype=np.result_type(q, k, v))
    for at, x in ((out_at, attention_ref(q, k, v, **attrs)), (lse_at, attention_lse_ref(q, k, **attrs))):
        packed[at:at + x.size] = x.reshape(-1)
    return packed


defop("attention_stats", ATTENTION, _attention_stats_shape, attention_stats_ref,
      doc="attention's result and its rows' log-sum-exp (attention_lse) packed flat, as "
          "attention_stats_layout says (``part`` picks each): a training graph's forward keeps the "
          "statistics its backward needs (engine.optimize.attention_stats)",
      num_heads=1, num_kv_heads=None, causal=False, scale=None)


def tiled_attention_head_dim(head_dim: int) -> bool:
    """Head dims the tiled attention kernels take (the forward and the fused backward):
    multiples of 4 up to 64. Others run the per-query forward and a decomposed backward."""
    return head_dim % 4 == 0 and 4 <= head_dim <= 64


# ---------------------------------------------------------------- attention backward
# FlashAttention-2's backward as ops that never hold a T x S matrix: the row statistics
# of the forward's softmax (attention_lse), then dq (attention_grad_q) and dk with dv
# (attention_grad_kv), each recomputing the scores block by block. With s = scores,
# L = logsumexp_j s, P = exp(s - L), dP = dO vᵀ and Delta = rowsum(dO * O) (= rowsum(P * dP)):
# dS = P * (dP - Delta), dq = scale dS k, dk = scale dSᵀ q, dv = Pᵀ dO, summed over the query
# heads that share a kv head. lse and delta are [B, T, H] (query-major, like q).
# The IR has one result a node: attention_grad_kv's is dk and dv packed into one flat tensor
# (attention_grad_kv_layout), and ``part`` views pick each out.

PART_ALIGN = 64   # elements: a part starts at a multiple of 256 bytes, a storage binding's offset alignment


def packed_layout(sizes) -> tuple[list[int], int]:
    """(offsets, total) of tensors of ``sizes`` elements packed one after the other into a
    flat tensor, each starting at a multiple of PART_ALIGN elements."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // PART_ALIGN) * PART_ALIGN
    return offsets, total


def attention_grad_kv_layout(k_shape: Shape) -> tuple[list[int], int]:
    """(offsets of dk and dv, total elements) of attention_grad_kv's packed result."""
    return packed_layout([math.prod(k_shape)] * 2)


def _attention_backward_shape(names: tuple[str, ...], result: str):
    """Shape rule of an op whose operands are ``names`` (among q, k, v, dout, lse, delta)
    and whose result is shaped as q ("q"), the row statistics ("lse") or dk and dv packed ("kv")."""
    def rule(ts, a):
        _require_float(ts)
        named = dict(zip(names, ts))
        q, k = named["q"], named["k"]
        _attention_shape([q, k, named.get("v", k)], a)
        rows = q.shape[:2] + (a["num_heads"],)
        for key, want in (("dout", q.shape), ("lse", rows), ("delta", rows)):
            if key in named and named[key].shape != want:
                _fail(f"{key} {list(named[key].shape)} must be {list(want)}")
        if result == "kv":
            return TensorType((attention_grad_kv_layout(k.shape)[1],))
        return TensorType(rows if result == "lse" else named[result].shape)
    return rule


def attention_lse_ref(q, k, num_heads, num_kv_heads=None, causal=False, scale=None):
    s = attention_scores(q, k, num_heads, num_kv_heads, causal, scale)
    top = s.max(axis=-1, keepdims=True)
    lse = (top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True)))[..., 0]
    return np.ascontiguousarray(lse.transpose(0, 2, 1))


def _probabilities(q, k, lse, attrs):
    """P = exp(s - L) per query head, [B, H, T, S]; 0 where masked."""
    return np.exp(attention_scores(q, k, **attrs) - lse.transpose(0, 2, 1)[..., None])


def _score_grads(q, k, v, dout, lse, delta, attrs):
    """(P, dS) per query head: dS = P * (dO vᵀ - Delta)."""
    h = attrs["num_heads"]
    hkv = attrs["num_kv_heads"] or h
    p = _probabilities(q, k, lse, attrs)
    dp = split_heads(dout, h) @ np.swapaxes(np.repeat(split_heads(v, hkv), h // hkv, axis=1), -1, -2)
    return p, p * (dp - delta.transpose(0, 2, 1)[..., None])


def _scale_of(q, attrs) -> float:
    d = q.shape[2] // attrs["num_heads"]
    return 1.0 / math.sqrt(d) if attrs["scale"] is None else attrs["scale"]


def _sum_groups(x, num_heads, num_kv_heads):
    """[B, H, S, D] -> [B, HKV, S, D]: the sum over the query heads that share each kv head."""
    hkv = num_kv_heads or num_heads
    b, _, s, d = x.shape
    return x.reshape(b, hkv, num_heads // hkv, s, d).sum(axis=2)


def attention_grad_q_ref(q, k, v, dout, lse, delta, **attrs):
    hkv = attrs["num_kv_heads"] or attrs["num_heads"]
    _, ds = _score_grads(q, k, v, dout, lse, delta, attrs)
    kh = np.repeat(split_heads(k, hkv), attrs["num_heads"] // hkv, axis=1)
    return merge_heads(_scale_of(q, attrs) * (ds @ kh))


def attention_grad_kv_ref(q, k, v, dout, lse, delta, **attrs):
    """dk and dv packed as attention_grad_kv_layout says (zeros between them)."""
    h, hkv = attrs["num_heads"], attrs["num_kv_heads"]
    p, ds = _score_grads(q, k, v, dout, lse, delta, attrs)
    dk = _scale_of(q, attrs) * (np.swapaxes(ds, -1, -2) @ split_heads(q, h))
    dv = np.swapaxes(p, -1, -2) @ split_heads(dout, h)
    offsets, total = attention_grad_kv_layout(k.shape)
    packed = np.zeros(total, dtype=np.result_type(q, k, v, dout))
    for at, x in zip(offsets, (dk, dv)):
        packed[at:at + k.size] = merge_heads(_sum_groups(x, h, hkv)).reshape(-1)
    return packed


_ATTENTION_ATTRS = dict(num_heads=1, num_kv_heads=None, causal=False, scale=None)
defop("attention_lse", ATTENTION, _attention_backward_shape(("q", "k"), "lse"), attention_lse_ref,
      doc="log-sum-exp over the keys of each query's scaled, masked scores, [B, T, H] "
          "(the softmax statistics attention's backward recomputes P from)", **_ATTENTION_ATTRS)
defop("attention_grad_q", ATTENTION,
      _attention_backward_shape(("q", "k", "v", "dout", "lse", "delta"), "q"), attention_grad_q_ref,
      doc="d attention / d q from (q, k, v, dout, lse, delta = rowsum(dout * out) [B, T, H])",
      **_ATTENTION_ATTRS)
defop("attention_grad_kv", ATTENTION,
      _attention_backward_shape(("q", "k", "v", "dout", "lse", "delta"), "kv"), attention_grad_kv_ref,
      doc="d attention / d k and d v from (q, k, v, dout, lse, delta), summed over each kv head's query "
          "heads, packed flat as attention_grad_kv_layout says (``part`` picks each)",
      **_ATTENTION_ATTRS)


def _rope_shape(ts, a):
    x = ts[0]
    _require_float([x])
    h = a["num_heads"]
    if h <= 0 or len(x.shape) != 3 or x.shape[2] % h or (x.shape[2] // h) % 2:
        _fail(f"rope needs [batch, seq, heads*dim] with an even head dim, found {list(x.shape)} "
              f"with {h} heads")
    if len(ts) == 2 and (ts[1].dtype != "i32" or ts[1].shape != x.shape[:2]):
        _fail(f"rope's positions must be i32 [batch, seq] = {list(x.shape[:2])}, found "
              f"{list(ts[1].shape)} {ts[1].dtype}")
    if len(ts) > 2:
        _fail(f"rope takes x and optionally positions, found {len(ts)} operands")
    return TensorType(x.shape)


ROPE_SCALINGS = {"linear": 1, "llama3": 4}   # kind -> how many numbers follow it in ``scaling``


def rope_inverse_frequencies(dim: int, base: float = 10000.0, scaling: tuple = ()) -> np.ndarray:
    """RoPE's inverse frequencies over a head of ``dim``: base^(-2i / dim), rewritten by
    ``scaling`` as transformers computes them: ``("linear", factor)`` divides them all;
    ``("llama3", factor, low_freq_factor, high_freq_factor, original_positions)`` (Llama
    3.1 and 3.2) divides those of wavelengths above original / low, keeps those below
    original / high and blends the ones between."""
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not scaling:
        return inv
    kind, *numbers = scaling
    if ROPE_SCALINGS.get(kind) != len(numbers):
        raise GraphError(f"rope scaling {scaling!r}: expected one of {', '.join(ROPE_SCALINGS)} with "
                         f"{ROPE_SCALINGS.get(kind, '?')} numbers")
    if kind == "linear":
        return inv / numbers[0]
    factor, low, high, original = numbers
    wavelength = 2 * np.pi / inv
    scaled = np.where(wavelength > original / low, inv / factor, inv)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return np.where(medium, blended, scaled)


def rope_tables(seq, dim, base=10000.0, offset=0, dtype=np.float64, scaling=()):
    inv = rope_inverse_frequencies(dim, base, scaling)
    ang = np.outer(np.arange(offset, offset + seq, dtype=np.float64), inv)
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def rope_ref(x, positions=None, num_heads=1, base=10000.0, offset=0, inverse=False, scaling=()):
    """Rotate by position offset..offset+seq, or by ``positions`` [batch, seq] where given
    (a generation step, whose tokens sit at positions only known when it runs)."""
    b, t, w = x.shape
    d = w // num_heads
    xh = x.reshape(b, t, num_heads, d)
    if positions is None:
        cos, sin = rope_tables(t, d, base, offset, x.dtype, scaling)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        inv = rope_inverse_frequencies(d, base, scaling)
        ang = np.asarray(positions, np.float64)[..., None] * inv
        cos, sin = np.cos(ang).astype(x.dtype)[:, :, None, :], np.sin(ang).astype(x.dtype)[:, :, None, :]
    if inverse:
        sin = -sin
    x1, x2 = xh[..., : d // 2], xh[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(b, t, w)


defop("rope", POINTWISE, _rope_shape, rope_ref,
      doc="rotary position embedding (rotate-half form) on [batch, seq, heads*dim]; positions "
          "offset..offset+seq, or an i32 [batch, seq] second operand; inverse=True rotates back "
          "(its gradient); scaling rewrites the frequencies (rope_inverse_frequencies)",
      num_heads=1, base=10000.0, offset=0, inverse=False, scaling=())


# ---------------------------------------------------------------- convolution

def _conv_shape(nd):
    def rule(ts, a):
        _require_float(ts)
        x, w = ts[0], ts[1]
        stride, pad = a["stride"], a["padding"]
        if len(x.shape) != nd + 2 or len(w.shape) != nd + 2:
            _fail(f"conv{nd}d needs x of rank {nd + 2} and weight of rank {nd + 2}, "
                  f"found {list(x.shape)} and {list(w.shape)}")
        if x.shape[1] != w.shape[1]:
            _fail(f"input has {x.shape[1]} channels, weight {list(w.shape)} expects {w.shape[1]}")
        if len(ts) == 3 and ts[2].shape != (w.shape[0],):
            _fail(f"bias {list(ts[2].shape)} must be [{w.shape[0]}]")
        if len(stride) != nd or len(pad) != nd or min(stride) <= 0 or min(pad) < 0:
            _fail(f"stride {list(stride)} must be {nd} positive ints and padding {list(pad)} "
                  f"{nd} non-negative ints")
        spatial = []
        for i in range(nd):
            n = (x.shape[2 + i] + 2 * pad[i] - w.shape[2 + i]) // stride[i] + 1
            if n <= 0 or stride[i] <= 0:
                _fail(f"kernel {list(w.shape[2:])} with stride {list(stride)} and padding {list(pad)} "
                      f"does not fit input {list(x.shape[2:])}")
            spatial.append(n)
        return TensorType((x.shape[0], w.shape[0], *spatial))
    return rule


def conv_ref(x, w, b=None, stride=(1,), padding=(0,), activation="none"):
    """N-d cross-correlation as im2col + matmul (float64-exact, no loops over pixels)."""
    nd = x.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    k = w.shape[2:]
    out_sp = [(xp.shape[2 + i] - k[i]) // stride[i] + 1 for i in range(nd)]
    win = np.lib.stride_tricks.sliding_window_view(xp, k, axis=tuple(range(2, 2 + nd)))
    win = win[(slice(None), slice(None)) + tuple(slice(None, out_sp[i] * stride[i], stride[i]) for i in range(nd))]
    # win: [N, C, *out, *k]  ->  y[n, o, *out] = sum_c,k win * w[o, c, *k]
    letters = "defg"[:nd]
    kl = "hijk"[:nd]
    y = np.einsum(f"nc{letters}{kl},oc{kl}->no{letters}", win, w, optimize=True)
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * nd)
    return np.ascontiguousarray(ACTIVATIONS[activation](y))


defop("conv1d", CONV, _conv_shape(1), conv_ref,
      doc="x [N, C, L] * w [O, C, K] (+ b [O]) with stride and zero padding, then an activation "
          "(fused: engine.optimize.conv_activation)", stride=(1,), padding=(0,), activation="none")
defop("conv2d", CONV, _conv_shape(2), conv_ref,
      doc="x [N, C, H, W] * w [O, C, KH, KW] (+ b [O]) with stride and zero padding, then an activation "
          "(fused: engine.optimize.conv_activation)", stride=(1, 1), padding=(0, 0), activation="none")


# ---------------------------------------------------------------- data movement

def _reshape_shape(ts, a):
    shape = tuple(a["shape"])
    size = math.prod(ts[0].shape)
    if shape.count(-1) > 1:
        _fail(f"at most one -1 in {list(shape)}")
    if -1 in shape:
        rest = math.prod(n for n in shape if n != -1)
        if rest == 0 or size % rest:
            _fail(f"cannot reshape {list(ts[0].shape)} to {list(shape)}")
        shape = tuple(size // rest if n == -1 else n for n in shape)
    if math.prod(shape) != size or any(n < 0 for n in shape):
        _fail(f"cannot reshape {list(ts[0].shape)} ({size} elements) to {list(shape)}")
    return TensorType(shape, ts[0].dtype)


defop("reshape", VIEW, _reshape_shape, lambda x, shape: x.reshape(shape),
      doc="same elements, new shape (row-major); no data moves", shape=())


def _part_shape(ts, a):
    shape, offset, size = tuple(a["shape"]), a["offset"], math.prod(ts[0].shape)
    if any(n < 0 for n in shape) or offset < 0 or offset % PART_ALIGN or offset + math.prod(shape) > size:
        _fail(f"part of {math.prod(shape)} elements at offset {offset} does not fit {size} elements, or the "
              f"offset is not a multiple of {PART_ALIGN}")
    return TensorType(shape, ts[0].dtype)


def part_ref(x, offset, shape):
    return x.reshape(-1)[offset:offset + math.prod(shape)].reshape(shape)


defop("part", VIEW, _part_shape, part_ref,
      doc="elements offset.. of x (row-major) as a tensor of shape, in x's storage: a segment of a "
          "packed result (attention_grad_kv's); no data moves", offset=0, shape=())


def _transpose_shape(ts, a):
    perm = tuple(a["perm"])
    if sorted(perm) != list(range(len(ts[0].shape))):
        _fail(f"perm {list(perm)} is not a permutation of the axes of {list(ts[0].shape)}")
    return TensorType(tuple(ts[0].shape[p] for p in perm), ts[0].dtype)


defop("transpose", COPY, _transpose_shape, lambda x, perm: np.ascontiguousarray(x.transpose(perm)),
      doc="permute axes", perm=())


def _concat_shape(ts, a):
    first = ts[0].shape
    ax = _norm_axis(a["axis"], len(first))
    for t in ts[1:]:
        if len(t.shape) != len(first) or any(t.shape[i] != first[i] for i in range(len(first)) if i != ax):
            _fail(f"cannot concatenate {' and '.join(str(list(t.shape)) for t in ts)} on axis {a['axis']}")
        if t.dtype != ts[0].dtype:
            _fail("operands have different dtypes")
    return TensorType(first[:ax] + (sum(t.shape[ax] for t in ts),) + first[ax + 1:], ts[0].dtype)


defop("concat", COPY, _concat_shape, lambda *xs, axis: np.concatenate(xs, axis=axis),
      doc="join along an axis", axis=0)


def _slice_shape(ts, a):
    shape = ts[0].shape
    ax = _norm_axis(a["axis"], len(shape))
    start, stop = a["start"], a["stop"]
    if not 0 <= start < stop <= shape[ax]:
        _fail(f"slice [{start}:{stop}] out of range for axis {a['axis']} of length {shape[ax]}")
    return TensorType(shape[:ax] + (stop - start,) + shape[ax + 1:], ts[0].dtype)


def slice_ref(x, axis, start, stop):
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(start, stop)
    return np.ascontiguousarray(x[tuple(idx)])


defop("slice", COPY, _slice_shape, slice_ref, doc="x[start:stop] along an axis", axis=0, start=0, stop=0)


def _pad_shape(ts, a):
    shape = ts[0].shape
    ax = _norm_axis(a["axis"], len(shape))
    if a["before"] < 0 or a["after"] < 0:
        _fail("padding must be non-negative")
    return TensorType(shape[:ax] + (shape[ax] + a["before"] + a["after"],) + shape[ax + 1:], ts[0].dtype)


def pad_ref(x, axis, before, after):
    width = [(0, 0)] * x.ndim
    width[axis] = (before, after)
    return np.pad(x, width)


defop("pad", COPY, _pad_shape, pad_ref, doc="zero padding along an axis (gradient of slice)",
      axis=0, before=0, after=0)


def _broadcast_to_shape(ts, a):
    target = tuple(a["shape"])
    if broadcast_shapes(ts[0].shape, target) != target:
        _fail(f"cannot broadcast {list(ts[0].shape)} to {list(target)}")
    return TensorType(target, ts[0].dtype)


defop("broadcast_to", COPY, _broadcast_to_shape,
      lambda x, shape: np.array(np.broadcast_to(x, tuple(shape))),  # ascontiguousarray makes 0-d 1-d
      doc="repeat along broadcast axes (gradient of sums)", shape=())


def _embedding_shape(ts, a):
    table, ids = ts
    _require_float([table], "table")
    if len(table.shape) != 2:
        _fail(f"table must be [vocab, dim], found {list(table.shape)}")
    if ids.dtype != "i32":
        _fail(f"ids must be i32, found {ids.dtype}")
    return TensorType(ids.shape + (table.shape[1],))


def check_index_range(ids: np.ndarray, size: int, what: str) -> None:
    """Indices come from user data; numpy would wrap negative ones silently."""
    if ids.size and (ids.min() < 0 or ids.max() >= size):
        raise IndexError(f"{what} must lie in [0, {size}), found {ids.min()}..{ids.max()}")


def embedding_ref(table, ids):
    ids = np.asarray(ids).astype(np.int64)
    check_index_range(ids, table.shape[0], "embedding ids")
    return table[ids]


defop("embedding", GATHER, _embedding_shape, embedding_ref, doc="rows of table [vocab, dim] picked by i32 ids")


def _widen_shape(ts, a):
    if ts[0].dtype != "bf16":
        _fail(f"widen reads a tensor stored as bf16, found {ts[0].dtype}")
    return TensorType(ts[0].shape)


defop("widen", COPY, _widen_shape, lambda x: np.asarray(x, np.float32),
      doc="a weight stored as bf16 as f32 (exact), for a kernel that reads f32 only")
