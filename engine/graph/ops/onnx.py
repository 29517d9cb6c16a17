"""Ops the ONNX importer needs that have no exact equivalent among the others: more
elementwise functions, comparisons and ``where`` (booleans are f32 masks), ``cast``,
``index_wrap``, N-d ``conv_general`` and the pools, with their gradients' ops.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy import special

from .forward import _binary_shape, _unary_shape
from .table import CONV, POINTWISE, REDUCTION, TensorType, _fail, _require_float, broadcast_shapes, defop


# ---------------------------------------------------------------- ONNX import ops
# Ops the ONNX importer (engine/importers/onnx.py) needs that have no exact equivalent
# above. Reference implementations only: no GPU kernels yet (the runtime refuses them by
# name). Boolean tensors are f32 masks of 0.0 / 1.0.

def _any_binary_shape(ts, a):
    if ts[0].dtype != ts[1].dtype:
        _fail(f"operands have different dtypes {ts[0].dtype} and {ts[1].dtype}")
    return TensorType(broadcast_shapes(ts[0].shape, ts[1].shape), ts[0].dtype)


def _compare_shape(ts, a):
    if ts[0].dtype != ts[1].dtype:
        _fail(f"operands have different dtypes {ts[0].dtype} and {ts[1].dtype}")
    return TensorType(broadcast_shapes(ts[0].shape, ts[1].shape))


def softplus_ref(x):
    """log(1 + e^x) without overflow; NaN stays NaN (quietly: it is an input, not a fault)."""
    with np.errstate(invalid="ignore"):
        return np.logaddexp(0, x)


ONNX_UNARY: dict[str, Callable] = {
    "erf": special.erf,
    "softplus": softplus_ref,
    "floor": np.floor,
    "ceil": np.ceil,
    "sign": np.sign,
    "logical_not": lambda x: (x == 0).astype(x.dtype),
}
for _name, _fn in ONNX_UNARY.items():
    defop(_name, POINTWISE, _unary_shape, (lambda fn: lambda x: fn(x))(_fn), elementwise=True)
defop("leaky_relu", POINTWISE, _unary_shape, lambda x, alpha=0.01: np.where(x < 0, alpha * x, x),
      elementwise=True, doc="x if x >= 0 else alpha * x", alpha=0.01)

for _name, _fn in (("maximum", np.maximum), ("minimum", np.minimum)):
    defop(_name, POINTWISE, _any_binary_shape, (lambda fn: lambda x, y: fn(x, y))(_fn), elementwise=True,
          doc="elementwise, f32 or i32 operands of one dtype")
defop("power", POINTWISE, _binary_shape, lambda x, y: np.power(x, y), elementwise=True,
      doc="x ** y elementwise (pow takes a constant exponent)")

for _name, _fn in (("equal", np.equal), ("less", np.less), ("greater", np.greater),
                   ("less_equal", np.less_equal), ("greater_equal", np.greater_equal)):
    defop(_name, POINTWISE, _compare_shape,
          (lambda fn: lambda x, y: fn(x, y).astype(np.float32))(_fn), elementwise=True,
          doc="comparison of f32 or i32 operands of one dtype -> f32 mask (1.0 true, 0.0 false)")


def _where_shape(ts, a):
    cond, x, y = ts
    if cond.dtype != "f32":
        _fail(f"condition must be an f32 mask, found {cond.dtype}")
    if x.dtype != y.dtype:
        _fail(f"branches have different dtypes {x.dtype} and {y.dtype}")
    return TensorType(broadcast_shapes(cond.shape, x.shape, y.shape), x.dtype)


defop("where", POINTWISE, _where_shape, lambda c, x, y: np.where(c != 0, x, y), elementwise=True,
      doc="x where the mask is non-zero, else y (broadcast)")


def _cast_shape(ts, a):
    if a["dtype"] not in ("f32", "i32"):
        _fail(f"dtype must be f32 or i32, found {a['dtype']!r}")
    return TensorType(ts[0].shape, a["dtype"])


def cast_ref(x, dtype="f32"):
    return np.trunc(x).astype(np.int32) if dtype == "i32" else x.astype(np.float64 if x.dtype == np.float64 else np.float32)


defop("cast", POINTWISE, _cast_shape, cast_ref, doc="convert to f32 or i32 (i32: truncation toward zero)",
      dtype="f32")


def _index_wrap_shape(ts, a):
    if ts[0].dtype != "i32":
        _fail(f"indices must be i32, found {ts[0].dtype}")
    return TensorType(ts[0].shape, "i32")


defop("index_wrap", POINTWISE, _index_wrap_shape,
      lambda i, size: np.where(i < 0, i + size, i).astype(np.int32), elementwise=True,
      doc="negative indices counted from the end of an axis of length size", size=1)


def _conv_general_shape(ts, a):
    _require_float(ts)
    x, w = ts[0], ts[1]
    nd = len(x.shape) - 2
    stride, pads, dil, groups = a["stride"], a["pads"], a["dilation"], a["groups"]
    if nd < 1 or len(w.shape) != nd + 2:
        _fail(f"needs x [N, C, ...] and weight of the same rank, found {list(x.shape)} and {list(w.shape)}")
    if len(stride) != nd or len(dil) != nd or len(pads) != 2 * nd or min(stride) <= 0 or min(dil) <= 0 \
            or min(pads) < 0:
        _fail(f"bad stride {list(stride)}, dilation {list(dil)} or pads {list(pads)} for {nd}-d")
    if groups <= 0 or x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        _fail(f"input channels {x.shape[1]} and weight {list(w.shape)} do not fit {groups} groups")
    if len(ts) == 3 and ts[2].shape != (w.shape[0],):
        _fail(f"bias {list(ts[2].shape)} must be [{w.shape[0]}]")
    out = []
    for i in range(nd):
        eff = dil[i] * (w.shape[2 + i] - 1) + 1
        n = (x.shape[2 + i] + pads[i] + pads[nd + i] - eff) // stride[i] + 1
        if n <= 0:
            _fail(f"kernel {list(w.shape[2:])} does not fit input {list(x.shape[2:])}")
        out.append(n)
    return TensorType((x.shape[0], w.shape[0], *out))


def conv_general_ref(x, w, b=None, stride=(1,), pads=(0, 0), dilation=(1,), groups=1):
    nd = x.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[nd + i]) for i in range(nd)])
    k = w.shape[2:]
    eff = [dilation[i] * (k[i] - 1) + 1 for i in range(nd)]
    out = [(xp.shape[2 + i] - eff[i]) // stride[i] + 1 for i in range(nd)]
    win = np.lib.stride_tricks.sliding_window_view(xp, eff, axis=tuple(range(2, 2 + nd)))
    win = win[(slice(None), slice(None)) + tuple(slice(None, out[i] * stride[i], stride[i]) for i in range(nd))
              + tuple(slice(None, None, dilation[i]) for i in range(nd))]
    n, c = x.shape[:2]
    cg, og = c // groups, w.shape[0] // groups
    letters, kl = "defg"[:nd], "hijk"[:nd]
    ys = [np.einsum(f"nc{letters}{kl},oc{kl}->no{letters}", win[:, gi * cg:(gi + 1) * cg],
                    w[gi * og:(gi + 1) * og], optimize=True) for gi in range(groups)]
    y = np.concatenate(ys, axis=1)
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * nd)
    return np.ascontiguousarray(y)


defop("conv_general", CONV, _conv_general_shape, conv_general_ref,
      doc="N-d convolution with stride, begin/end zero pads, dilation and groups "
          "(x [N, C, ...], w [O, C/groups, ...], b [O])",
      stride=(1,), pads=(0, 0), dilation=(1,), groups=1)


def _pool_shape(ts, a):
    _require_float(ts)
    x = ts[0]
    nd = len(x.shape) - 2
    k, stride, pads, dil = a["kernel"], a["stride"], a["pads"], a["dilation"]
    if nd < 1 or len(k) != nd or len(stride) != nd or len(dil) != nd or len(pads) != 2 * nd:
        _fail(f"kernel {list(k)}, stride {list(stride)}, pads {list(pads)} do not fit input {list(x.shape)}")
    if min(k) <= 0 or min(stride) <= 0 or min(dil) <= 0 or min(pads) < 0:
        _fail("kernel, stride and dilation must be positive, pads non-negative")
    out = []
    for i in range(nd):
        eff = dil[i] * (k[i] - 1) + 1
        span = x.shape[2 + i] + pads[i] + pads[nd + i] - eff
        n = (-(-span // stride[i]) if a["ceil_mode"] else span // stride[i]) + 1
        if a["ceil_mode"] and (n - 1) * stride[i] >= x.shape[2 + i] + pads[i]:
            n -= 1
        if span < 0 or n <= 0:
            _fail(f"kernel {list(k)} does not fit input {list(x.shape[2:])}")
        out.append(n)
    return TensorType(x.shape[:2] + tuple(out))


def pool_geometry(spatial, kernel, stride, pads, dilation, ceil_mode):
    """Per axis: the output extent, the dilated kernel extent, and the padding past the
    declared end pad that ceil_mode's last windows reach (it holds no data and counts for
    no divisor)."""
    nd = len(spatial)
    out = _pool_shape([TensorType((1, 1) + tuple(spatial))], dict(kernel=kernel, stride=stride, pads=pads,
                                                                  dilation=dilation, ceil_mode=ceil_mode)).shape[2:]
    eff = [dilation[i] * (kernel[i] - 1) + 1 for i in range(nd)]
    extra = [max(0, (out[i] - 1) * stride[i] + eff[i] - spatial[i] - pads[i] - pads[nd + i]) for i in range(nd)]
    return out, eff, extra


def _pool_windows(arr, nd, out, eff, stride, dilation):
    """[..., *padded spatial] -> [..., *out, *kernel]: the window of every output position."""
    win = np.lib.stride_tricks.sliding_window_view(arr, eff, axis=tuple(range(arr.ndim - nd, arr.ndim)))
    lead = (slice(None),) * (arr.ndim - nd)
    return win[lead + tuple(slice(None, out[i] * stride[i], stride[i]) for i in range(nd))
               + tuple(slice(None, None, dilation[i]) for i in range(nd))]


def pool_divisor(spatial, kernel, stride, pads, dilation, ceil_mode, count_include_pad=False, dtype=np.float64):
    """avg_pool's divisor per output position [*out]: the window's elements inside the
    input, or (count_include_pad) inside the input plus its declared pads."""
    nd = len(spatial)
    out, eff, extra = pool_geometry(spatial, kernel, stride, pads, dilation, ceil_mode)
    if count_include_pad:
        mask = np.ones([spatial[i] + pads[i] + pads[nd + i] for i in range(nd)], dtype=dtype)
        mask = np.pad(mask, [(0, e) for e in extra])
    else:
        mask = np.pad(np.ones(spatial, dtype=dtype), [(pads[i], pads[nd + i] + extra[i]) for i in range(nd)])
    return _pool_windows(mask, nd, out, eff, stride, dilation).sum(axis=tuple(range(-nd, 0)))


def pool_ref(x, kernel, stride, pads, dilation, ceil_mode, mode, count_include_pad=False):
    nd = x.ndim - 2
    out, eff, extra = pool_geometry(x.shape[2:], kernel, stride, pads, dilation, ceil_mode)
    fill = -np.inf if mode == "max" else 0.0
    width = [(0, 0), (0, 0)] + [(pads[i], pads[nd + i] + extra[i]) for i in range(nd)]
    win = _pool_windows(np.pad(x, width, constant_values=fill), nd, out, eff, stride, dilation)
    red = tuple(range(-nd, 0))
    if mode == "max":
        return np.ascontiguousarray(win.max(axis=red))
    counts = pool_divisor(x.shape[2:], kernel, stride, pads, dilation, ceil_mode, count_include_pad, x.dtype)
    return np.ascontiguousarray(win.sum(axis=red) / counts)


defop("max_pool", REDUCTION, _pool_shape, lambda x, **a: pool_ref(x, mode="max", **a),
      doc="N-d max pooling with stride, begin/end pads (-inf), dilation, ceil_mode",
      kernel=(1,), stride=(1,), pads=(0, 0), dilation=(1,), ceil_mode=False)
defop("avg_pool", REDUCTION, _pool_shape, lambda x, **a: pool_ref(x, mode="avg", **a),
      doc="N-d average pooling with stride, begin/end pads, dilation, ceil_mode; the divisor counts "
          "padding when count_include_pad", kernel=(1,), stride=(1,), pads=(0, 0), dilation=(1,),
      ceil_mode=False, count_include_pad=False)


# Their backward ops (autodiff builds them; listed in BACKWARD_OPS). avg_pool's gradient
# needs none: it is conv_general_input_grad of dout / divisor with a depthwise kernel of ones.

def _conv_general_input_grad_shape(ts, a):
    _require_float(ts)
    dout, w = ts
    shape = tuple(a["input_shape"])
    nd = len(shape) - 2
    if nd < 1 or len(dout.shape) != nd + 2 or len(w.shape) != nd + 2 or dout.shape[:2] != (shape[0], w.shape[0]) \
            or shape[1] != w.shape[1] * a["groups"] or len(a["pads"]) != 2 * nd:
        _fail(f"dout {list(dout.shape)} and weight {list(w.shape)} do not fit input {list(shape)} "
              f"with {a['groups']} groups")
    return TensorType(shape)


def _conv_general_weight_grad_shape(ts, a):
    _require_float(ts)
    x, dout = ts
    if len(x.shape) != len(dout.shape) or x.shape[0] != dout.shape[0] or x.shape[1] % a["groups"] \
            or dout.shape[1] % a["groups"] or len(a["kernel"]) != len(x.shape) - 2:
        _fail(f"x {list(x.shape)} and dout {list(dout.shape)} do not fit kernel {list(a['kernel'])} "
              f"with {a['groups']} groups")
    return TensorType((dout.shape[1], x.shape[1] // a["groups"]) + tuple(a["kernel"]))


def _conv_general_taps(out, kernel, stride, dilation):
    """Each kernel offset and the slices of the padded input its taps read over the output grid."""
    for k in np.ndindex(*kernel):
        yield k, tuple(slice(k[i] * dilation[i], k[i] * dilation[i] + stride[i] * (out[i] - 1) + 1, stride[i])
                       for i in range(len(kernel)))


def conv_general_input_grad_ref(dout, w, stride, pads, dilation, groups, input_shape):
    """dx[n, c, i] = sum of dout[n, o, j] * w[o, c', k] over i + pad_begin = j * stride + k * dilation,
    o in c's group; taps past the input (pads, ceil-mode windows) are dropped."""
    nd = len(stride)
    n, c = input_shape[:2]
    out, kernel = dout.shape[2:], w.shape[2:]
    og, cg = w.shape[0] // groups, c // groups
    size = [max(input_shape[2 + i] + pads[i] + pads[nd + i], (out[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1)
            for i in range(nd)]
    dx = np.zeros((n, groups, cg, *size), dtype=dout.dtype)
    d = dout.reshape(n, groups, og, *out)
    wg = w.reshape(groups, og, cg, *kernel)
    for k, taps in _conv_general_taps(out, kernel, stride, dilation):
        dx[(slice(None),) * 3 + taps] += np.einsum("ngo...,goc->ngc...", d, wg[(slice(None),) * 3 + k])
    crop = tuple(slice(pads[i], pads[i] + input_shape[2 + i]) for i in range(nd))
    return np.ascontiguousarray(dx.reshape(n, c, *size)[(slice(None),) * 2 + crop])


def conv_general_weight_grad_ref(x, dout, stride, pads, dilation, groups, kernel):
    """dw[o, c', k] = sum over n, j of dout[n, o, j] * x_padded[n, c, j * stride + k * dilation]."""
    nd = len(stride)
    n, c = x.shape[:2]
    out, o = dout.shape[2:], dout.shape[1]
    og, cg = o // groups, c // groups
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[nd + i]) for i in range(nd)])
    size = [max(xp.shape[2 + i], (out[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1) for i in range(nd)]
    xp = np.pad(xp, [(0, 0), (0, 0)] + [(0, size[i] - xp.shape[2 + i]) for i in range(nd)])
    xg = xp.reshape(n, groups, cg, *size)
    d = dout.reshape(n, groups, og, *out)
    dw = np.zeros((groups, og, cg, *kernel), dtype=dout.dtype)
    for k, taps in _conv_general_taps(out, kernel, stride, dilation):
        xs = xg[(slice(None),) * 3 + taps].reshape(n, groups, cg, -1)
        dw[(slice(None),) * 3 + k] = np.einsum("ngop,ngcp->goc", d.reshape(n, groups, og, -1), xs)
    return dw.reshape(o, cg, *kernel)


_CONV_GENERAL_ATTRS = dict(stride=(1,), pads=(0, 0), dilation=(1,), groups=1)
defop("conv_general_input_grad", CONV, _conv_general_input_grad_shape, conv_general_input_grad_ref,
      doc="d conv_general / d x: the transposed grouped, dilated convolution of dout with w",
      input_shape=(), **_CONV_GENERAL_ATTRS)
defop("conv_general_weight_grad", CONV, _conv_general_weight_grad_shape, conv_general_weight_grad_ref,
      doc="d conv_general / d w: per group, correlation of the padded input with dout", kernel=(),
      **_CONV_GENERAL_ATTRS)


def _max_pool_grad_shape(ts, a):
    _require_float(ts)
    dout, x = ts
    if _pool_shape([x], a).shape != dout.shape:
        _fail(f"dout {list(dout.shape)} is not the max_pool of {list(x.shape)}")
    return TensorType(x.shape)


def max_pool_grad_ref(dout, x, kernel, stride, pads, dilation, ceil_mode):
    """Routes each window's dout to the first maximum of the window (row-major over the
    kernel, as torch's max_pool); overlapping windows add up."""
    nd = x.ndim - 2
    out, eff, extra = pool_geometry(x.shape[2:], kernel, stride, pads, dilation, ceil_mode)
    width = [(0, 0), (0, 0)] + [(pads[i], pads[nd + i] + extra[i]) for i in range(nd)]
    xp = np.pad(x, width, constant_values=-np.inf)
    win = _pool_windows(xp, nd, out, eff, stride, dilation)
    arg = win.reshape(win.shape[:2 + nd] + (-1,)).argmax(axis=-1)
    offsets = np.unravel_index(arg, tuple(kernel))
    grid = np.indices(arg.shape, sparse=True)
    at = tuple(grid[:2]) + tuple(grid[2 + i] * stride[i] + offsets[i] * dilation[i] for i in range(nd))
    dx = np.zeros(xp.shape, dtype=dout.dtype)
    np.add.at(dx, at, dout)
    crop = tuple(slice(pads[i], pads[i] + x.shape[2 + i]) for i in range(nd))
    return np.ascontiguousarray(dx[(slice(None),) * 2 + crop])


defop("max_pool_grad", REDUCTION, _max_pool_grad_shape, max_pool_grad_ref,
      doc="d max_pool / d x: each window's dout routed to its (first) maximum",
      kernel=(1,), stride=(1,), pads=(0, 0), dilation=(1,), ceil_mode=False)


# ---------------------------------------------------------------- end of ONNX import ops
