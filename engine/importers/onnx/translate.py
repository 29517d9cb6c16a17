"""One translation per ONNX op type (``TRANSLATE``): each maps a node onto the IR's ops exactly, folds
it with numpy where its operands are constants, or raises ``Refused``.
"""

from __future__ import annotations

import ast
import math
from typing import Callable

import numpy as np

from .checks import BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64, INT_TYPES, Refused
from .values import FOLD, _axis, _const, _f32, _gather, _ints, _reduce, _reshape, _slice_axis, _transpose


# ---------------------------------------------------------------- module paths

def module_of(node) -> str:
    """The module an ONNX node came from: the exporter's name scopes (``torch.onnx.export(...,
    dynamo=True)`` stores ``pkg.torch.onnx.name_scopes`` ['', 'layers.0', 'layers.0.fc1', 'linear']
    and ``namespace`` ': Net/layers.0: Block/layers.0.fc1: Linear/linear: aten.linear'), else the
    path in the node's name (TorchScript exports: ``/layers.0/fc1/Gemm``); '' when there is none."""
    props = {p.key: p.value for p in node.metadata_props}
    try:
        scopes = ast.literal_eval(props.get("pkg.torch.onnx.name_scopes", "None"))
    except (ValueError, SyntaxError):
        scopes = None
    if isinstance(scopes, list) and scopes and all(isinstance(x, str) for x in scopes):
        return scopes[-2] if len(scopes) >= 2 else ""
    if props.get("namespace"):
        names = [part.split(":")[0].strip() for part in props["namespace"].split("/")]
        return names[-2] if len(names) >= 2 else ""
    parts = [p for p in (node.name or "").split("/") if p]
    return ".".join(parts[:-1]) if "/" in (node.name or "") else ""


# ---------------------------------------------------------------- translations

def _get(ctx, node, i):
    if i >= len(node.input) or not node.input[i]:
        return None
    return ctx.env[node.input[i]]


def _elementwise_unary(op, **attrs):
    def run(ctx, node, at, xs):
        x = _f32(ctx, xs[0])
        return [ctx.g.apply(op, x, **{k: f(at) for k, f in attrs.items()})]
    return run


def _elementwise_binary(op):
    def run(ctx, node, at, xs):
        a, b = xs
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and node.op_type in FOLD:
            return [FOLD[node.op_type](a, b)]
        return [ctx.g.apply(op, _f32(ctx, a), _f32(ctx, b))]
    return run


def t_pow(ctx, node, at, xs):
    x, y = xs
    if isinstance(y, np.ndarray) and y.size == 1 and ctx.dtype(x) == "f32":
        return [ctx.g.pow(ctx.node(x), float(y.reshape(-1)[0])) if y.ndim == 0 or
                np.broadcast_shapes(ctx.shape(x), y.shape) == ctx.shape(x)
                else ctx.g.apply("power", ctx.node(x), ctx.node(y.astype(np.float32)))]
    return [ctx.g.apply("power", _f32(ctx, x), _f32(ctx, y))]


def t_compare(op):
    def run(ctx, node, at, xs):
        a, b = xs
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return [FOLD[node.op_type](a, b)]
        if ctx.dtype(a) != ctx.dtype(b):
            raise Refused("operands of different dtypes")
        return [ctx.g.apply(op, ctx.node(a), ctx.node(b))]
    return run


def t_not(ctx, node, at, xs):
    x = xs[0]
    if isinstance(x, np.ndarray):
        return [np.logical_not(x)]
    return [ctx.g.apply("logical_not", ctx.node(x))]


def t_logic(op):
    def run(ctx, node, at, xs):
        a, b = xs
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return [FOLD[node.op_type](a, b)]
        return [ctx.g.apply(op, _f32(ctx, a.astype(np.float32) if isinstance(a, np.ndarray) else a),
                            _f32(ctx, b.astype(np.float32) if isinstance(b, np.ndarray) else b))]
    return run


def t_where(ctx, node, at, xs):
    c, x, y = xs
    if all(isinstance(v, np.ndarray) for v in xs):
        return [np.where(c, x, y)]
    if isinstance(c, np.ndarray):
        c = c.astype(np.float32)
    if ctx.dtype(x) != ctx.dtype(y):
        raise Refused("branches of different dtypes")
    return [ctx.g.apply("where", ctx.node(c), ctx.node(x), ctx.node(y))]


def t_variadic(op, fold):
    def run(ctx, node, at, xs):
        xs = [x for x in xs if x is not None]
        if all(isinstance(v, np.ndarray) for v in xs):
            out = xs[0]
            for v in xs[1:]:
                out = fold(out, v)
            return [out / len(xs) if node.op_type == "Mean" else out]
        y = ctx.node(xs[0])
        if op in ("add",):
            _f32(ctx, y)
        for v in xs[1:]:
            y = ctx.g.apply(op, y, ctx.node(v))
        if node.op_type == "Mean":
            y = ctx.g.div(y, ctx.node(np.asarray(len(xs), np.float32)))
        elif len(xs) == 1:
            y = ctx.g.apply("maximum", y, y) if op != "add" else ctx.g.add(y, ctx.node(np.zeros((), np.float32)))
        return [y]
    return run


def t_clip(ctx, node, at, xs):
    x = xs[0]
    lo, hi = _get(ctx, node, 1), _get(ctx, node, 2)
    if isinstance(x, np.ndarray) and (lo is None or isinstance(lo, np.ndarray)) and \
            (hi is None or isinstance(hi, np.ndarray)):
        y = x
        if lo is not None:
            y = np.maximum(y, lo)
        if hi is not None:
            y = np.minimum(y, hi)
        return [y.astype(x.dtype)]
    dt = ctx.dtype(x)
    y = ctx.node(x)
    for bound, op in ((lo, "maximum"), (hi, "minimum")):
        if bound is not None:
            if ctx.shape(bound) != ():
                raise Refused("Clip bounds must be scalars")
            if ctx.dtype(bound) != dt:
                raise Refused("Clip bounds of another dtype than the input")
            y = ctx.g.apply(op, y, ctx.node(bound))
    return [y]


def t_gemm(ctx, node, at, xs):
    g = ctx.g
    a, b = _f32(ctx, xs[0]), _f32(ctx, xs[1])
    c = _get(ctx, node, 2)
    if len(g.shape(a)) != 2 or len(g.shape(b)) != 2:
        raise Refused("Gemm needs 2-D A and B")
    y = g.matmul(a, b, transpose_a=bool(at.get("transA", 0)), transpose_b=bool(at.get("transB", 0)))
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    if alpha != 1.0:
        y = g.mul(y, ctx.node(np.asarray(alpha, np.float32)))
    if c is not None and beta != 0.0:
        cn = _f32(ctx, c)
        if beta != 1.0:
            cn = g.mul(cn, ctx.node(np.asarray(beta, np.float32)))
        if len(g.shape(cn)) == 1 and g.shape(cn)[0] == g.shape(y)[1]:
            y = g.bias_add(y, cn)
        else:
            y = g.add(y, cn)
        if g.shape(y) != tuple(g.shape(y)[:2]) or len(g.shape(y)) != 2:
            raise Refused("Gemm C does not broadcast to [M, N]")
    return [y]


def t_matmul(ctx, node, at, xs):
    g = ctx.g
    a, b = _f32(ctx, xs[0]), _f32(ctx, xs[1])
    sa, sb = g.shape(a), g.shape(b)
    if not sa or not sb:
        raise Refused("MatMul of a scalar")
    a2 = _reshape(ctx, a, (1,) + sa) if len(sa) == 1 else a
    b2 = _reshape(ctx, b, sb + (1,)) if len(sb) == 1 else b
    y = g.matmul(a2, b2)
    shape = g.shape(y)
    if len(sa) == 1:
        shape = shape[:-2] + shape[-1:]
    if len(sb) == 1:
        shape = shape[:-1]
    return [_reshape(ctx, y, shape)]


def _softmax(kind):
    def run(ctx, node, at, xs):
        x = _f32(ctx, xs[0])
        rank = len(ctx.shape(x))
        if rank == 0:
            raise Refused("softmax of a scalar")
        axis = _axis(int(at.get("axis", -1)), rank)
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        y = ctx.g.apply(kind, _transpose(ctx, x, perm))
        return [_transpose(ctx, y, perm)]
    return run


def t_reduce(op, pre=None, post=None):
    def run(ctx, node, at, xs):
        x = xs[0]
        axes = at.get("axes")
        if len(node.input) > 1 and node.input[1]:
            axes = _ints(xs[1], "reduction axes")
        if axes is not None and len(axes) == 0:
            axes = None
        if axes is None and at.get("noop_with_empty_axes", 0):
            return [x]
        xn = _f32(ctx, x)
        if pre == "square":
            xn = ctx.g.mul(xn, xn)
        elif pre == "abs":
            xn = ctx.g.abs(xn)
        elif pre == "exp":
            xn = ctx.g.exp(xn)
        y = _reduce(ctx, xn, axes, bool(at.get("keepdims", 1)), op)
        if post == "sqrt":
            y = ctx.g.sqrt(y)
        elif post == "log":
            y = ctx.g.log(y)
        return [y]
    return run


def t_layer_norm(ctx, node, at, xs):
    g = ctx.g
    x = _f32(ctx, xs[0])
    shape = g.shape(x)
    rank = len(shape)
    axis = _axis(int(at.get("axis", -1)), rank)
    eps = float(at.get("epsilon", 1e-5))
    lead, tail = shape[:axis], shape[axis:]
    n = math.prod(tail)
    if n == 0 or math.prod(shape) == 0:
        raise Refused("empty tensor")

    def flat_param(v, default):
        if v is None:
            return ctx.node(np.full((n,), default, np.float32))
        v = _f32(ctx, v)
        if g.shape(v) != tail:
            if np.broadcast_shapes(g.shape(v), tail) != tail:
                raise Refused(f"scale/bias {list(g.shape(v))} do not broadcast to {list(tail)}")
            v = g.apply("broadcast_to", v, shape=tail)
        return _reshape(ctx, v, (n,))
    w, b = flat_param(xs[1], 1.0), flat_param(_get(ctx, node, 2), 0.0)
    x2 = _reshape(ctx, x, lead + (n,))
    y = _reshape(ctx, g.layer_norm(x2, w, b, eps=eps), shape)
    outs = [y]
    if len(node.output) > 1:
        stat_shape = lead + (1,) * len(tail)
        mu = g.mean(x2, axis=-1, keepdims=True)
        d = g.sub(x2, mu)
        var = g.mean(g.mul(d, d), axis=-1, keepdims=True)
        inv = g.rsqrt(g.add(var, ctx.node(np.asarray(eps, np.float32))))
        outs += [_reshape(ctx, mu, stat_shape), _reshape(ctx, inv, stat_shape)]
    return outs


def _channel(ctx, v, rank):
    """A per-channel [C] vector shaped to broadcast over [N, C, ...]."""
    c = ctx.shape(v)[0]
    return _reshape(ctx, ctx.node(v), (c,) + (1,) * (rank - 2))


def t_batch_norm(ctx, node, at, xs):
    g = ctx.g
    x = _f32(ctx, xs[0])
    rank = len(g.shape(x))
    if rank < 2:
        raise Refused("BatchNormalization needs [N, C, ...]")
    if len([o for o in node.output if o]) > 1:
        raise Refused("running-statistics outputs (training mode)")
    scale, bias, mean, var = (_f32(ctx, v) for v in xs[1:5])
    eps = ctx.node(np.asarray(float(at.get("epsilon", 1e-5)), np.float32))
    factor = g.mul(scale, g.rsqrt(g.add(var, eps)))
    y = g.mul(g.sub(x, _channel(ctx, mean, rank)), _channel(ctx, factor, rank))
    return [g.add(y, _channel(ctx, bias, rank))]


def t_instance_norm(ctx, node, at, xs):
    g = ctx.g
    x = _f32(ctx, xs[0])
    shape = g.shape(x)
    if len(shape) < 3:
        raise Refused("InstanceNormalization needs [N, C, ...]")
    n, c = shape[:2]
    x3 = _reshape(ctx, x, (n, c, math.prod(shape[2:])))
    ones = ctx.node(np.ones(g.shape(x3)[-1], np.float32))
    zeros = ctx.node(np.zeros(g.shape(x3)[-1], np.float32))
    y = _reshape(ctx, g.layer_norm(x3, ones, zeros, eps=float(at.get("epsilon", 1e-5))), shape)
    y = g.mul(y, _channel(ctx, _f32(ctx, xs[1]), len(shape)))
    return [g.add(y, _channel(ctx, _f32(ctx, xs[2]), len(shape)))]


def _auto_pads(at, in_sp, k, stride, dil):
    nd = len(in_sp)
    ap = at.get("auto_pad", b"NOTSET")
    ap = ap.decode() if isinstance(ap, bytes) else ap
    if ap == "NOTSET":
        pads = list(at.get("pads", [0] * (2 * nd)))
    elif ap == "VALID":
        pads = [0] * (2 * nd)
    else:
        pads = [0] * (2 * nd)
        for i in range(nd):
            out = -(-in_sp[i] // stride[i])
            total = max(0, (out - 1) * stride[i] + dil[i] * (k[i] - 1) + 1 - in_sp[i])
            small, big = total // 2, total - total // 2
            pads[i], pads[nd + i] = (small, big) if ap == "SAME_UPPER" else (big, small)
    if len(pads) != 2 * nd or min(pads) < 0:
        raise Refused(f"pads {pads}")
    return pads


def t_conv(ctx, node, at, xs):
    g = ctx.g
    x, w = _f32(ctx, xs[0]), _f32(ctx, xs[1])
    b = _get(ctx, node, 2)
    b = None if b is None else _f32(ctx, b)
    xs_, ws = g.shape(x), g.shape(w)
    nd = len(xs_) - 2
    if nd < 1 or len(ws) != nd + 2:
        raise Refused(f"Conv input {list(xs_)} and weight {list(ws)}")
    k = list(at.get("kernel_shape", ws[2:]))
    if tuple(k) != tuple(ws[2:]):
        raise Refused(f"kernel_shape {k} differs from the weight's {list(ws[2:])}")
    stride = list(at.get("strides", [1] * nd))
    dil = list(at.get("dilations", [1] * nd))
    pads = _auto_pads(at, xs_[2:], k, stride, dil)
    groups = int(at.get("group", 1))
    ops_ = (x, w) if b is None else (x, w, b)
    if nd in (1, 2) and groups == 1 and all(d == 1 for d in dil) and pads[:nd] == pads[nd:]:
        return [g.apply(f"conv{nd}d", *ops_, stride=tuple(stride), padding=tuple(pads[:nd]))]
    return [g.apply("conv_general", *ops_, stride=tuple(stride), pads=tuple(pads), dilation=tuple(dil),
                    groups=groups)]


def t_pool(kind):
    def run(ctx, node, at, xs):
        if len([o for o in node.output if o]) > 1:
            raise Refused("the Indices output")
        x = _f32(ctx, xs[0])
        shape = ctx.g.shape(x)
        nd = len(shape) - 2
        if nd < 1:
            raise Refused(f"pooling input {list(shape)}")
        k = list(at["kernel_shape"])
        stride = list(at.get("strides", [1] * nd))
        dil = list(at.get("dilations", [1] * nd))
        if len(k) != nd:
            raise Refused(f"kernel_shape {k} for a {nd}-d input")
        pads = _auto_pads(at, shape[2:], k, stride, dil)
        extra = {"count_include_pad": bool(at.get("count_include_pad", 0))} if kind == "avg_pool" else {}
        return [ctx.g.apply(kind, x, kernel=tuple(k), stride=tuple(stride), pads=tuple(pads), dilation=tuple(dil),
                            ceil_mode=bool(at.get("ceil_mode", 0)), **extra)]
    return run


def t_global_pool(op):
    def run(ctx, node, at, xs):
        x = _f32(ctx, xs[0])
        shape = ctx.g.shape(x)
        if len(shape) < 3:
            raise Refused(f"global pooling input {list(shape)}")
        return [_reduce(ctx, x, list(range(2, len(shape))), True, op)]
    return run


def t_reshape(ctx, node, at, xs):
    x = xs[0]
    shape = _ints(xs[1], "Reshape's shape")
    src = ctx.shape(x)
    if not at.get("allowzero", 0):
        shape = [src[i] if n == 0 else n for i, n in enumerate(shape)]
    if shape.count(-1) > 1:
        raise Refused(f"shape {shape} has more than one -1")
    if -1 in shape:
        rest = math.prod(n for n in shape if n != -1)
        if rest == 0:
            raise Refused(f"shape {shape}")
        shape[shape.index(-1)] = math.prod(src) // rest
    if math.prod(shape) != math.prod(src):
        raise Refused(f"cannot reshape {list(src)} to {shape}")
    return [_reshape(ctx, x, shape)]


def t_flatten(ctx, node, at, xs):
    shape = ctx.shape(xs[0])
    axis = int(at.get("axis", 1))
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis <= len(shape):
        raise Refused(f"axis {at.get('axis')}")
    return [_reshape(ctx, xs[0], (math.prod(shape[:axis]), math.prod(shape[axis:])))]


def t_squeeze(ctx, node, at, xs):
    shape = ctx.shape(xs[0])
    axes = _ints(xs[1], "Squeeze axes") if _get(ctx, node, 1) is not None else None
    if axes is None:
        axes = [i for i, n in enumerate(shape) if n == 1]
    axes = {_axis(a, len(shape)) for a in axes}
    if any(shape[a] != 1 for a in axes):
        raise Refused(f"cannot squeeze axes {sorted(axes)} of {list(shape)}")
    return [_reshape(ctx, xs[0], [n for i, n in enumerate(shape) if i not in axes])]


def t_unsqueeze(ctx, node, at, xs):
    shape = list(ctx.shape(xs[0]))
    axes = _ints(xs[1], "Unsqueeze axes")
    rank = len(shape) + len(axes)
    axes = sorted(_axis(a, rank) for a in axes)
    if len(set(axes)) != len(axes):
        raise Refused(f"repeated axes {axes}")
    for a in axes:
        shape.insert(a, 1)
    return [_reshape(ctx, xs[0], shape)]


def t_transpose(ctx, node, at, xs):
    rank = len(ctx.shape(xs[0]))
    perm = list(at.get("perm", range(rank - 1, -1, -1)))
    if sorted(perm) != list(range(rank)):
        raise Refused(f"perm {perm}")
    return [_transpose(ctx, xs[0], perm)]


def t_concat(ctx, node, at, xs):
    xs = [x for x in xs if x is not None and math.prod(ctx.shape(x)) > 0 or x is not None and len(xs) == 1]
    if not xs:
        raise Refused("nothing to concatenate")
    axis = _axis(int(at["axis"]), len(ctx.shape(xs[0])))
    if all(isinstance(x, np.ndarray) for x in xs):
        return [np.concatenate(xs, axis=axis)]
    if len({ctx.dtype(x) for x in xs}) > 1:
        raise Refused("operands of different dtypes")
    if len(xs) == 1:
        return [xs[0]]
    return [ctx.g.concat([ctx.node(x) for x in xs], axis=axis)]


def t_split(ctx, node, at, xs):
    x = xs[0]
    shape = ctx.shape(x)
    axis = _axis(int(at.get("axis", 0)), len(shape))
    n = shape[axis]
    outs = len(node.output)
    split = _get(ctx, node, 1)
    if split is not None:
        sizes = _ints(split, "Split sizes")
    elif "split" in at:
        sizes = list(at["split"])
    else:
        parts = int(at.get("num_outputs", outs))
        chunk = -(-n // parts)
        sizes = [min(chunk, n - i * chunk) for i in range(parts)]
    if sum(sizes) != n or len(sizes) != outs or min(sizes) <= 0:
        raise Refused(f"split sizes {sizes} for axis of length {n} into {outs} outputs")
    res, start = [], 0
    for s in sizes:
        res.append(_slice_axis(ctx, x, axis, start, start + s, 1))
        start += s
    return res


def t_slice(ctx, node, at, xs):
    x = xs[0]
    shape = ctx.shape(x)
    starts = _ints(xs[1], "Slice starts")
    ends = _ints(xs[2], "Slice ends")
    axes = _ints(xs[3], "Slice axes") if _get(ctx, node, 3) is not None else list(range(len(starts)))
    steps = _ints(xs[4], "Slice steps") if _get(ctx, node, 4) is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise Refused("starts, ends, axes and steps differ in length")
    axes = [_axis(a, len(shape)) for a in axes]
    if len(set(axes)) != len(axes):
        raise Refused(f"repeated axes {axes}")
    y = x
    for a, s, e, st in zip(axes, starts, ends, steps):
        if st == 0:
            raise Refused("step 0")
        big = 2**62
        s, e = max(min(s, big), -big), max(min(e, big), -big)
        y = _slice_axis(ctx, y, a, s, e, st)
    return [y]


def t_gather(ctx, node, at, xs):
    return [_gather(ctx, xs[0], xs[1], int(at.get("axis", 0)))]


def t_expand(ctx, node, at, xs):
    x = xs[0]
    target = tuple(np.broadcast_shapes(ctx.shape(x), tuple(_ints(xs[1], "Expand's shape"))))
    if isinstance(x, np.ndarray):
        return [np.broadcast_to(x, target).copy()]
    if target == ctx.shape(x):
        return [x]
    return [ctx.g.apply("broadcast_to", x, shape=target)]


def t_cast(ctx, node, at, xs):
    x, to = xs[0], at["to"]
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f" and to in INT_TYPES and not np.all(np.isfinite(x)):
            raise Refused("casting non-finite floats to integers")
        return [x.astype({FLOAT: np.float32, INT32: np.int32, INT64: np.int64, BOOL: bool}[to])]
    src = ctx.dtype(x)
    if to == BOOL:
        ctx.bool.add(node.output[0])
        return [x if node.input[0] in ctx.bool else
                ctx.g.apply("logical_not", ctx.g.apply("equal", x, ctx.node(np.zeros((), np.float32 if src == "f32" else np.int32))))]
    want = "f32" if to == FLOAT else "i32"
    if src == want:
        return [x]
    return [ctx.g.apply("cast", x, dtype=want)]


def t_identity(ctx, node, at, xs):
    if node.input[0] in ctx.bool:
        ctx.bool.add(node.output[0])
    return [xs[0]]


def t_dropout(ctx, node, at, xs):
    training = _get(ctx, node, 2)
    if training is not None and bool(_const(training, "Dropout training_mode").reshape(-1)[0]):
        raise Refused("training_mode=true")
    if len(node.output) > 1 and node.output[1]:
        raise Refused("the mask output")
    return [xs[0]]


def _np_tensor(t) -> np.ndarray:
    from onnx import numpy_helper
    arr = numpy_helper.to_array(t)
    if arr.dtype.kind not in "fiub" or arr.dtype == np.float64 and t.data_type == DOUBLE:
        if t.data_type == DOUBLE:
            raise Refused("float64 tensor")
        raise Refused(f"tensor of dtype {arr.dtype}")
    if arr.dtype.kind == "f" and arr.dtype != np.float32:
        if t.data_type != FLOAT16:
            raise Refused(f"tensor of dtype {arr.dtype}")
        arr = arr.astype(np.float32)
    return np.array(arr)


def t_constant(ctx, node, at, xs):
    if "value" in at:
        return [_np_tensor(at["value"])]
    if "value_float" in at:
        return [np.asarray(at["value_float"], np.float32)]
    if "value_floats" in at:
        return [np.asarray(at["value_floats"], np.float32)]
    if "value_int" in at:
        return [np.asarray(at["value_int"], np.int64)]
    if "value_ints" in at:
        return [np.asarray(at["value_ints"], np.int64)]
    raise Refused("no supported value attribute")


def t_constant_of_shape(ctx, node, at, xs):
    shape = _ints(xs[0], "ConstantOfShape's shape")
    value = _np_tensor(at["value"]).reshape(-1) if "value" in at else np.zeros(1, np.float32)
    return [np.full(shape, value[0], dtype=value.dtype)]


def t_shape(ctx, node, at, xs):
    shape = np.asarray(ctx.shape(xs[0]), np.int64)
    rank = len(shape)
    start, end = int(at.get("start", 0)), int(at.get("end", rank))
    return [shape[slice(*slice(start, end).indices(rank))]]


def t_size(ctx, node, at, xs):
    return [np.asarray(math.prod(ctx.shape(xs[0])), np.int64)]


def t_range(ctx, node, at, xs):
    s, e, d = (_const(v, "Range operands").reshape(()) for v in xs)
    if d == 0:
        raise Refused("delta 0")
    n = max(int(math.ceil((e - s) / d)), 0)
    return [(s + np.arange(n) * d).astype(s.dtype)]


def t_gelu(ctx, node, at, xs):
    a = at.get("approximate", b"none")
    return [ctx.g.gelu(_f32(ctx, xs[0]), a.decode() if isinstance(a, bytes) else a)]


def _scalar(ctx, v):
    return ctx.node(np.asarray(v, np.float32))


def t_elu(ctx, node, at, xs):
    g = ctx.g
    x = _f32(ctx, xs[0])
    alpha = float(at.get("alpha", 1.0))
    neg = g.mul(g.sub(g.exp(x), _scalar(ctx, 1.0)), _scalar(ctx, alpha))
    return [g.apply("where", g.apply("less", x, _scalar(ctx, 0.0)), neg, x)]


def t_hard_sigmoid(ctx, node, at, xs):
    g = ctx.g
    x = _f32(ctx, xs[0])
    y = g.add(g.mul(x, _scalar(ctx, float(at.get("alpha", 0.2)))), _scalar(ctx, float(at.get("beta", 0.5))))
    return [g.apply("minimum", g.apply("maximum", y, _scalar(ctx, 0.0)), _scalar(ctx, 1.0))]


def t_softsign(ctx, node, at, xs):
    g = ctx.g
    x = _f32(ctx, xs[0])
    return [g.div(x, g.add(g.abs(x), _scalar(ctx, 1.0)))]


def t_prelu(ctx, node, at, xs):
    g = ctx.g
    x, s = _f32(ctx, xs[0]), _f32(ctx, xs[1])
    return [g.apply("where", g.apply("less", x, _scalar(ctx, 0.0)), g.mul(x, s), x)]


def t_leaky(ctx, node, at, xs):
    return [ctx.g.apply("leaky_relu", _f32(ctx, xs[0]), alpha=float(at.get("alpha", 0.01)))]


def t_sum_fold(name):
    return t_variadic


TRANSLATE: dict[str, Callable] = {
    "Gemm": t_gemm, "MatMul": t_matmul,
    "Add": _elementwise_binary("add"), "Sub": _elementwise_binary("sub"),
    "Mul": _elementwise_binary("mul"), "Div": _elementwise_binary("div"),
    "Pow": t_pow,
    "Relu": _elementwise_unary("relu"), "Tanh": _elementwise_unary("tanh"),
    "Sigmoid": _elementwise_unary("sigmoid"), "Erf": _elementwise_unary("erf"),
    "Softplus": _elementwise_unary("softplus"), "Sqrt": _elementwise_unary("sqrt"),
    "Exp": _elementwise_unary("exp"), "Log": _elementwise_unary("log"),
    "Reciprocal": _elementwise_unary("reciprocal"), "Floor": _elementwise_unary("floor"),
    "Ceil": _elementwise_unary("ceil"), "Sign": _elementwise_unary("sign"),
    "Gelu": t_gelu, "LeakyRelu": t_leaky, "Elu": t_elu, "HardSigmoid": t_hard_sigmoid,
    "Softsign": t_softsign, "PRelu": t_prelu,
    "Where": t_where, "Equal": t_compare("equal"), "Less": t_compare("less"),
    "Greater": t_compare("greater"), "LessOrEqual": t_compare("less_equal"),
    "GreaterOrEqual": t_compare("greater_equal"), "Not": t_not,
    "And": t_logic("mul"), "Or": t_logic("maximum"),
    "Max": t_variadic("maximum", np.maximum), "Min": t_variadic("minimum", np.minimum),
    "Sum": t_variadic("add", np.add), "Mean": t_variadic("add", np.add),
    "Clip": t_clip,
    "Softmax": _softmax("softmax"), "LogSoftmax": _softmax("log_softmax"),
    "ReduceMean": t_reduce("mean"), "ReduceSum": t_reduce("sum"), "ReduceMax": t_reduce("max"),
    "ReduceMin": t_reduce("min"), "ReduceSumSquare": t_reduce("sum", pre="square"),
    "ReduceL1": t_reduce("sum", pre="abs"), "ReduceL2": t_reduce("sum", pre="square", post="sqrt"),
    "ReduceLogSum": t_reduce("sum", post="log"), "ReduceLogSumExp": t_reduce("sum", pre="exp", post="log"),
    "LayerNormalization": t_layer_norm, "BatchNormalization": t_batch_norm,
    "InstanceNormalization": t_instance_norm,
    "Conv": t_conv, "MaxPool": t_pool("max_pool"), "AveragePool": t_pool("avg_pool"),
    "GlobalAveragePool": t_global_pool("mean"), "GlobalMaxPool": t_global_pool("max"),
    "Reshape": t_reshape, "Flatten": t_flatten, "Transpose": t_transpose, "Squeeze": t_squeeze,
    "Unsqueeze": t_unsqueeze, "Concat": t_concat, "Split": t_split, "Slice": t_slice, "Gather": t_gather,
    "Expand": t_expand, "Cast": t_cast, "Identity": t_identity, "Dropout": t_dropout,
    "Constant": t_constant, "ConstantOfShape": t_constant_of_shape, "Shape": t_shape, "Size": t_size,
    "Range": t_range,
}
# Unary ops that fold with numpy when their operand is a constant.
UNARY_FOLD = {"Neg": np.negative, "Abs": np.abs, "Sqrt": np.sqrt, "Exp": np.exp, "Log": np.log,
              "Floor": np.floor, "Ceil": np.ceil, "Reciprocal": np.reciprocal, "Sign": np.sign,
              "Relu": lambda x: np.maximum(x, 0).astype(x.dtype)}
TRANSLATE["Neg"] = _elementwise_unary("neg")
TRANSLATE["Abs"] = _elementwise_unary("abs")
# ops whose result is boolean
BOOL_OPS = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or"}
# operand slots read as constants (an initializer there is folded, not a parameter)
CONST_SLOTS = {"Pow": {1}, "Clip": {1, 2}, "Reshape": {1}, "Expand": {1}, "Slice": {1, 2, 3, 4},
               "Squeeze": {1}, "Unsqueeze": {1}, "Split": {1}, "Dropout": {1, 2}, "Range": {0, 1, 2},
               "ConstantOfShape": {0}, "ReduceMean": {1}, "ReduceSum": {1}, "ReduceMax": {1},
               "ReduceMin": {1}, "ReduceSumSquare": {1}, "ReduceL1": {1}, "ReduceL2": {1},
               "ReduceLogSum": {1}, "ReduceLogSumExp": {1}}
# integer inputs of these op slots are indices into operand 0 (for example_inputs)
INDEX_SLOTS = {"Gather": 1}
