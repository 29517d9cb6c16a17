"""The ops of cached generation: ``cache_write`` puts a step's keys or values into a
KV cache at their positions, ``cached_attention`` attends over the cache up to each
query's position. Positions are an i32 [batch, seq] operand, not an attribute: a
decode step's graph is compiled once and runs at every position.

Both can apply RoPE at the positions they are given (the key before it is written, the
query before it attends): a decode step then needs no rope dispatches of its own.

A cache is a tensor [batch, capacity, kv_heads*dim]. ``cache_write`` is in place: its
result is its cache operand with rows overwritten, in the cache's own storage, so the
plan never copies a cache and a decode step allocates nothing.
"""

from __future__ import annotations

import numpy as np

import math

from .forward import (_attention_shape, _mm_dims, _norm_shape, _rope_shape, matmul_ref, merge_heads, packed_layout,
                      rms_norm_ref, rope_ref, sigmoid_ref, softmax_ref, split_heads)
from .table import ATTENTION, COPY, MATMUL, REDUCTION, TensorType, _fail, _require_float, defop


def _positions_check(positions: TensorType, batch_seq: tuple[int, ...], what: str) -> None:
    if positions.dtype != "i32" or positions.shape != tuple(batch_seq):
        _fail(f"{what}: positions must be i32 {list(batch_seq)}, found {list(positions.shape)} {positions.dtype}")


def _cache_write_shape(ts, a):
    cache, *xs, positions = ts
    _require_float([cache, *xs])
    if not xs:
        _fail("cache_write takes a cache, at least one x and positions")
    if a["rope_heads"]:
        _rope_shape([xs[0]], {"num_heads": a["rope_heads"]})
    x = xs[0]
    planes = () if len(xs) == 1 else (len(xs),)
    if len(x.shape) != 3 or any(other.shape != x.shape for other in xs):
        _fail(f"each x must be [batch, seq, width], all alike: {[list(other.shape) for other in xs]}")
    if len(cache.shape) != len(planes) + 3 or cache.shape[:len(planes)] != planes or \
            cache.shape[-3] != x.shape[0] or cache.shape[-1] != x.shape[2]:
        want = "[planes, batch, capacity, width] with a plane per x" if planes else "[batch, capacity, width]"
        _fail(f"cache {want} and x [batch, seq, width] disagree: {list(cache.shape)}, {list(x.shape)}")
    if x.shape[1] > cache.shape[-2]:
        _fail(f"{x.shape[1]} rows do not fit a cache of {cache.shape[-2]}")
    _positions_check(positions, x.shape[:2], "cache_write")
    return TensorType(cache.shape)


def check_positions(positions: np.ndarray, capacity: int) -> None:
    if positions.size and (positions.min() < 0 or positions.max() >= capacity):
        raise IndexError(f"positions must lie in [0, {capacity}), found {positions.min()}..{positions.max()}")


def cache_write_ref(cache, *xs_positions, rope_heads=0, rope_base=10000.0, rope_scaling=()):
    """cache with rows replaced by x (rotated by RoPE at its positions where ``rope_heads``);
    with several x, cache [planes, ...] takes x_i in plane i (RoPE on the first only)."""
    *xs, positions = xs_positions
    positions = np.asarray(positions).astype(np.int64)
    check_positions(positions, cache.shape[-2])
    out = np.array(cache, copy=True)
    planes = out if len(xs) > 1 else out[None]
    for i, x in enumerate(xs):
        if rope_heads and i == 0:
            x = rope_ref(x, positions, num_heads=rope_heads, base=rope_base, scaling=rope_scaling)
        planes[i][np.arange(x.shape[0])[:, None], positions] = x
    return out


defop("cache_write", COPY, _cache_write_shape, cache_write_ref, inplace=True,
      doc="cache [B, S, W] with row positions[b, t] replaced by x[b, t] (x [B, T, W]), in the cache's storage; "
          "with several x (a layer's keys and values), cache [P, B, S, W] takes x_i in plane i, one dispatch for "
          "all; rope_heads > 0 rotates the first x by RoPE (rope_heads heads, rope_base, rope_scaling) at its "
          "positions first",
      rope_heads=0, rope_base=10000.0, rope_scaling=())


def _cached_attention_shape(ts, a):
    q, k, v, positions = ts
    out = _attention_shape([q, k, v], a)
    if a["rope"]:
        _rope_shape([q], a)
    _positions_check(positions, q.shape[:2], "cached_attention")
    return out


def cached_attention_ref(q, k, v, positions, num_heads=1, num_kv_heads=None, scale=None, rope=False,
                         rope_base=10000.0, rope_scaling=()):
    """softmax(q kᵀ * scale) v where query (b, t) sees the keys 0..positions[b, t]; ``rope``
    rotates q by RoPE at its positions first."""
    hkv = num_kv_heads or num_heads
    if rope:
        q = rope_ref(q, positions, num_heads=num_heads, base=rope_base, scaling=rope_scaling)
    qh = split_heads(q, num_heads)
    kh = np.repeat(split_heads(k, hkv), num_heads // hkv, axis=1)
    vh = np.repeat(split_heads(v, hkv), num_heads // hkv, axis=1)
    scale = 1.0 / np.sqrt(qh.shape[-1]) if scale is None else scale
    s = qh @ np.swapaxes(kh, -1, -2) * scale
    positions = np.asarray(positions).astype(np.int64)
    check_positions(positions, k.shape[1])
    visible = np.arange(k.shape[1])[None, None, :] <= positions[:, :, None]
    s = np.where(visible[:, None], s, -np.inf)
    return merge_heads(softmax_ref(s) @ vh)


defop("cached_attention", ATTENTION, _cached_attention_shape, cached_attention_ref,
      doc="attention of q [B, T, H*D] over a KV cache [B, S, HKV*D]: query (b, t) sees keys 0..positions[b, t]; "
          "rope=True rotates q by RoPE (rope_base, rope_scaling) at its positions first",
      num_heads=1, num_kv_heads=None, scale=None, rope=False, rope_base=10000.0, rope_scaling=())


# ---------------------------------------------------------------- the decode step's fused MLP

def _swiglu_matmul_shape(ts, a):
    x, w_gate, w_up = ts[:3]
    _require_float(ts)
    tb = a["transpose_b"]
    out = _mm_dims(x, w_gate, False, tb)
    if _mm_dims(x, w_up, False, tb) != out:
        _fail(f"gate {list(w_gate.shape)} and up {list(w_up.shape)} weights differ")
    if len(ts) == 4:
        _norm_shape(1)([x, ts[3]], a)
    elif len(ts) != 3:
        _fail(f"swiglu_matmul takes x, w_gate, w_up and optionally a norm weight, found {len(ts)} operands")
    return TensorType(out)


def swiglu_matmul_ref(x, w_gate, w_up, norm_weight=None, eps=1e-6, transpose_b=False):
    """silu(x @ w_gate) * (x @ w_up), x first RMS-normalised by ``norm_weight`` where given."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    gate = matmul_ref(x, w_gate, False, transpose_b)
    return gate * sigmoid_ref(gate) * matmul_ref(x, w_up, False, transpose_b)


defop("swiglu_matmul", MATMUL, _swiglu_matmul_shape, swiglu_matmul_ref,
      doc="silu(x @ w_gate) * (x @ w_up), x optionally rms-normalised by a 4th operand: a Llama MLP's first "
          "half in one kernel where x has few rows (engine.optimize.few_rows: the decode step)",
      eps=1e-6, transpose_b=False)


def product_weights(op: str, operands: int) -> tuple[int, ...]:
    """The operands of a product op (of ``operands`` operands) that are its Bs, the weights,
    all read through its one ``transpose_b``: matmul's and fused_matmul's second,
    norm_matmul's third, SwiGLU's two, norm_matmuls' from the third on; none of another op."""
    if op == "norm_matmuls":
        return tuple(range(2, operands))
    return {"matmul": (1,), "fused_matmul": (1,), "norm_matmul": (2,), "swiglu_matmul": (1, 2)}.get(op, ())


# ---------------------------------------------------------------- a shared norm's products in one dispatch

def norm_matmuls_layout(x_shape, weight_shapes, transpose_b: bool) -> tuple[list[tuple[int, ...]], list[int], int]:
    """(each product's shape, its offset, total elements) of norm_matmuls' packed result:
    rms_norm(x) @ w_i for each weight, one after another, each at a multiple of PART_ALIGN."""
    shapes = [tuple(x_shape[:-1]) + (w[0] if transpose_b else w[1],) for w in weight_shapes]
    offsets, total = packed_layout([math.prod(s) for s in shapes])
    return shapes, offsets, total


def _norm_matmuls_shape(ts, a):
    x, norm_weight, *weights = ts
    _require_float(ts)
    if len(weights) < 2:
        _fail(f"norm_matmuls takes x, a norm weight and at least two weights, found {len(ts)} operands")
    _norm_shape(1)([x, norm_weight], a)
    for w in weights:
        _mm_dims(x, w, False, a["transpose_b"])
    return TensorType((norm_matmuls_layout(x.shape, [w.shape for w in weights], a["transpose_b"])[2],))


def norm_matmuls_ref(x, norm_weight, *weights, eps=1e-6, transpose_b=False):
    """rms_norm(x, norm_weight) @ each weight, packed flat (norm_matmuls_layout; zeros between)."""
    shapes, offsets, total = norm_matmuls_layout(x.shape, [w.shape for w in weights], transpose_b)
    xn = rms_norm_ref(x, norm_weight, eps)
    out = np.zeros(total, np.result_type(x, *weights))
    for w, at, shape in zip(weights, offsets, shapes):
        out[at:at + math.prod(shape)] = matmul_ref(xn, w, False, transpose_b).reshape(-1)
    return out


defop("norm_matmuls", MATMUL, _norm_matmuls_shape, norm_matmuls_ref,
      doc="rms_norm(x) @ w_1, @ w_2, ...: the products of one normalised x (a decode step's q, k and v) in one "
          "kernel, packed flat (norm_matmuls_layout) for ``part`` views to pick apart "
          "(engine.optimize.few_rows)", eps=1e-6, transpose_b=False)


# ---------------------------------------------------------------- greedy choice on the GPU

def _argmax_shape(ts, a):
    _require_float(ts)
    if not ts[0].shape or ts[0].shape[-1] < 1:
        _fail(f"argmax needs a last axis of at least one element, found {list(ts[0].shape)}")
    return TensorType(ts[0].shape[:-1], "i32")


def argmax_ref(x):
    """The index of each row's largest element (the first of equals), i32; -1 for a row
    holding a NaN or +inf, whose choice would mean nothing (an overflow), so that the host
    can refuse it without reading the row."""
    x = np.asarray(x)
    broken = np.isnan(x).any(axis=-1) | (x == np.inf).any(axis=-1)
    return np.where(broken, -1, np.argmax(x, axis=-1)).astype(np.int32)


defop("argmax", REDUCTION, _argmax_shape, argmax_ref,
      doc="the index of the largest element along the last axis, i32 (the first of equals; -1 where the row "
          "holds a NaN or +inf): a decode step's greedy choice, made on the GPU so the next step needs no "
          "read-back")
