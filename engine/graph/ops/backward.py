"""Ops only gradients use (``engine.autodiff`` builds them), and ``BACKWARD_OPS``, the list
autodiff does not differentiate again.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from .forward import _SQRT_2_OVER_PI, _ce_check, _reduce_shape, packed_layout, softmax_ref
from .table import CONV, GATHER, POINTWISE, REDUCTION, TensorType, _fail, _require_float, defop


# ---------------------------------------------------------------- backward ops (autodiff)
# Ops that only gradients use (engine/autodiff.py builds them). Most gradients are
# composed from the forward ops above; these are the ones where composing would be
# awkward or wasteful: derivatives with no closed form in the forward ops, index
# scatter, and convolution transposes.

def _like_operand(i):
    def rule(ts, a):
        _require_float([ts[i]])
        if any(t.shape != ts[i].shape for t in ts if t.dtype == "f32"):
            _fail("operands must share one shape: " + ", ".join(str(list(t.shape)) for t in ts))
        return TensorType(ts[i].shape)
    return rule


def gelu_grad_ref(dout, x, approximate="none"):
    if approximate == "tanh":
        c = _SQRT_2_OVER_PI
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        return dout * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x))
    cdf = 0.5 * (1.0 + special.erf(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return dout * (cdf + x * pdf)


defop("relu_grad", POINTWISE, _like_operand(1), lambda dout, x: dout * (x > 0), elementwise=True,
      doc="dout * (x > 0)")
defop("abs_grad", POINTWISE, _like_operand(1), lambda dout, x: dout * np.sign(x), elementwise=True,
      doc="dout * sign(x)")
defop("gelu_grad", POINTWISE, _like_operand(1), gelu_grad_ref, elementwise=True,
      doc="dout * gelu'(x)", approximate="none")


def _norm_grad_shape(ts, a):
    _require_float(ts)
    dout, x = ts[0], ts[1]
    if dout.shape != x.shape or not x.shape:
        _fail(f"dout {list(dout.shape)} and x {list(x.shape)} must share one shape of at least one axis")
    if len(ts) > 2 and ts[2].shape != (x.shape[-1],):
        _fail(f"w has shape {list(ts[2].shape)}, expected [{x.shape[-1]}]")
    if len(ts) > 3 and ts[3].shape != x.shape:
        _fail(f"the residual gradient has shape {list(ts[3].shape)}, expected {list(x.shape)}")
    return TensorType(x.shape)


def _standardized(x, eps, center):
    """(x - mean) * r over the last axis (no centring: RMS norm) and r = 1 / sqrt(var + eps)."""
    xc = x - x.mean(axis=-1, keepdims=True) if center else x
    r = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    return xc * r, r


def norm_grad_ref(dout, x, w, residual=None, eps=1e-5, center=True):
    """r * (g - mean(g) - x_hat * mean(g * x_hat)), g = dout * w (no mean(g): RMS norm),
    plus ``residual`` (the gradient along a residual connection) where given."""
    xh, r = _standardized(x, eps, center)
    g = dout * w
    mean_g = g.mean(axis=-1, keepdims=True) if center else 0.0
    dx = r * (g - mean_g - xh * (g * xh).mean(axis=-1, keepdims=True))
    return dx if residual is None else dx + residual


def norm_param_grad_ref(dout, x, eps=1e-5, center=True):
    """The weight's gradient (dout * standardized x summed over the leading axes) and, for
    a layer norm (``center``), the bias's (dout summed): the rows of a [2 or 1, N rounded
    up to PART_ALIGN] result, zeros past N, so that each row is a ``part`` of it."""
    n = x.shape[-1]
    sums = [(dout * _standardized(x, eps, center)[0]).reshape(-1, n).sum(axis=0)]
    if center:
        sums.append(dout.reshape(-1, n).sum(axis=0))
    out = np.zeros((len(sums), packed_layout([n])[1]), dtype=np.result_type(dout, x))
    out[:, :n] = sums
    return out


def _norm_param_grad_shape(ts, a):
    _require_float(ts)
    dout, x = ts
    if dout.shape != x.shape or not x.shape:
        _fail(f"dout {list(dout.shape)} and x {list(x.shape)} must share one shape of at least one axis")
    return TensorType((2 if a["center"] else 1, packed_layout([x.shape[-1]])[1]))


defop("norm_grad", REDUCTION, _norm_grad_shape, norm_grad_ref,
      doc="d layer_norm / d x (center) or d rms_norm / d x, over the last axis: one pass per row; a fourth "
          "operand (the gradient along a residual) is added to it", eps=1e-5, center=True)
defop("norm_param_grad", REDUCTION, _norm_param_grad_shape, norm_param_grad_ref,
      doc="a layer norm's (center) or RMS norm's parameter gradients from dout and x: the sums over "
          "the leading axes of dout * standardized x (the weight's) and of dout (the bias's, center "
          "only), one row each, padded to a multiple of PART_ALIGN", eps=1e-5, center=True)


def _row_dot_shape(ts, a):
    _require_float(ts)
    if ts[0].shape != ts[1].shape or not ts[0].shape:
        _fail(f"a {list(ts[0].shape)} and b {list(ts[1].shape)} must share one shape of at least one axis")
    return TensorType(ts[0].shape[:-1])


defop("row_dot", REDUCTION, _row_dot_shape, lambda a, b: (a * b).sum(axis=-1),
      doc="the dot products of a's and b's rows (over the last axis): attention's Delta = rowsum(dO * O) "
          "in one pass, not a product written in full and summed")


def _max_grad_shape(ts, a):
    _require_float(ts)
    if _reduce_shape(ts[1:], a).shape != ts[0].shape:
        _fail(f"dout {list(ts[0].shape)} is not the max of {list(ts[1].shape)}")
    return TensorType(ts[1].shape)


def max_grad_ref(dout, x, axis=None, keepdims=False):
    """Routes dout to the maxima, split evenly among ties (as torch.amax)."""
    y = x.max(axis=axis, keepdims=True)
    hit = x == y
    share = hit / hit.sum(axis=axis, keepdims=True)
    d = dout.reshape(y.shape) if axis is not None or keepdims else dout
    return share * d


defop("max_grad", REDUCTION, _max_grad_shape, max_grad_ref,
      doc="gradient of max(x): dout routed to the maxima", axis=None, keepdims=False)


def _ce_grad_shape(ts, a):
    _ce_check(ts[:2], a)
    if ts[2].shape != ():
        _fail(f"dout must be a scalar, found {list(ts[2].shape)}")
    return TensorType(ts[0].shape)


def cross_entropy_grad_ref(logits, labels, dout, ignore_index=-100):
    """(softmax - onehot) / count on kept rows, zero on ignored ones."""
    flat = softmax_ref(logits).reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1).astype(np.int64)
    keep = lab != ignore_index
    rows = np.nonzero(keep)[0]
    flat[rows, lab[rows]] -= 1.0
    flat *= keep[:, None] * (dout / max(int(keep.sum()), 1))
    return flat.reshape(logits.shape)


defop("cross_entropy_grad", REDUCTION, _ce_grad_shape, cross_entropy_grad_ref,
      doc="d cross_entropy / d logits, scaled by the scalar dout", ignore_index=-100)


def _embedding_grad_shape(ts, a):
    dout, ids = ts
    if ids.dtype != "i32" or dout.shape[:-1] != ids.shape:
        _fail(f"dout {list(dout.shape)} must be ids {list(ids.shape)} + [dim]")
    return TensorType((a["vocab"], dout.shape[-1]))


def embedding_grad_ref(dout, ids, vocab):
    table = np.zeros((vocab, dout.shape[-1]), dtype=dout.dtype)
    np.add.at(table, np.asarray(ids).reshape(-1).astype(np.int64), dout.reshape(-1, dout.shape[-1]))
    return table


defop("embedding_grad", GATHER, _embedding_grad_shape, embedding_grad_ref,
      doc="scatter-add of dout rows into a [vocab, dim] table", vocab=1)


def _conv_windows(shape, kernel, stride):
    """Index tuples of every kernel offset into a padded input: x[win] lines up with
    the output grid."""
    out = shape[2:]
    for k in np.ndindex(*kernel):
        yield k, (slice(None), slice(None)) + tuple(
            slice(k[i], k[i] + stride[i] * (out[i] - 1) + 1, stride[i]) for i in range(len(kernel)))


def _conv_input_grad_shape(ts, a):
    _require_float(ts)
    return TensorType(tuple(a["input_shape"]))


def conv_input_grad_ref(dout, w, stride, padding, input_shape):
    nd = len(stride)
    padded = [input_shape[0], input_shape[1]] + [input_shape[2 + i] + 2 * padding[i] for i in range(nd)]
    dx = np.zeros(padded, dtype=dout.dtype)
    for k, win in _conv_windows(dout.shape, w.shape[2:], stride):
        dx[win] += np.einsum("no...,oc->nc...", dout, w[(slice(None), slice(None)) + k])
    crop = (slice(None), slice(None)) + tuple(slice(p, p + n) for p, n in zip(padding, input_shape[2:]))
    return np.ascontiguousarray(dx[crop])


def _conv_weight_grad_shape(ts, a):
    _require_float(ts)
    x, dout = ts
    return TensorType((dout.shape[1], x.shape[1]) + tuple(a["kernel"]))


def conv_weight_grad_ref(x, dout, stride, padding, kernel):
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    dw = np.zeros((dout.shape[1], x.shape[1]) + tuple(kernel), dtype=dout.dtype)
    for k, win in _conv_windows(dout.shape, kernel, stride):
        summed = [0] + list(range(2, dout.ndim))  # batch and output positions
        dw[(slice(None), slice(None)) + k] = np.tensordot(dout, xp[win], axes=(summed, summed))
    return dw


defop("conv_input_grad", CONV, _conv_input_grad_shape, conv_input_grad_ref,
      doc="d conv / d x: the transposed convolution of dout with w", stride=(1,), padding=(0,),
      input_shape=())
defop("conv_weight_grad", CONV, _conv_weight_grad_shape, conv_weight_grad_ref,
      doc="d conv / d w: correlation of the padded input with dout", stride=(1,), padding=(0,), kernel=())

# Ops above that exist only for gradients; autodiff does not differentiate them again.
BACKWARD_OPS = ("relu_grad", "abs_grad", "gelu_grad", "max_grad", "norm_grad", "norm_param_grad", "row_dot", "cross_entropy_grad",
                "embedding_grad", "conv_input_grad", "conv_weight_grad",
                "conv_general_input_grad", "conv_general_weight_grad", "max_pool_grad",
                "attention_lse", "attention_grad_q", "attention_grad_kv", "part")
