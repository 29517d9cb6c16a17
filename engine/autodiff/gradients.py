"""Reverse-mode automatic differentiation on the graph IR.

``GRADIENTS`` is the one table of gradient rules, in the style of tinygrad's
gradient.py: ``GRADIENTS[op](g, node, dout)`` appends the nodes computing the
gradient of ``node`` with respect to each of its operands and returns their ids (None
where an operand gets no gradient: integer ids, labels, stop_gradient). A rule may
return a gradient in the broadcast shape of the output; the walk sums it back to the
operand's shape with ``sum_to``.

Fused ops (pointwise programs, fused_matmul, norm_matmul, group_norm) are differentiated by
*decomposition*: the rule rebuilds the op from simpler ops on the same operands and
backpropagates through that small subgraph with the same walk. The recomputed forward
nodes that the gradients do not read are pruned, and the optimizer then fuses the
backward like the forward. Layer and RMS norms have backward kernels of their own
(``norm_grad``, ``norm_param_grad``), and attention's gradient is FlashAttention-2's
(the ``attention_lse`` and ``attention_grad_*`` ops), whose kernels recompute the
probabilities block by block instead of storing them; only head dims with no tiled
kernel are decomposed.

Only nodes on a path from a trainable parameter to the loss are differentiated, so a
frozen encoder costs only its forward pass.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..errors import GraphError
from ..graph.ir import Graph, Node
from ..graph.ops import (ACTIVATION_OPS, GRADIENT_OF, OPS, SOURCE, attention_grad_kv_layout, pool_divisor,
                         tiled_attention_head_dim)

GradientRule = Callable[[Graph, Node, int], tuple]


# ---------------------------------------------------------------- the walk

def differentiate(graph: Graph, loss: str = "loss") -> tuple[Graph, list[tuple[str, str]]]:
    """The training graph: ``graph`` plus outputs ``"grad:" + name`` holding d loss / d
    parameter for every trainable parameter the loss depends on, and the list of
    (parameter name, gradient output name) pairs."""
    if loss not in graph.outputs:
        raise GraphError(f"graph {graph.name!r} has no output {loss!r} to differentiate; "
                         f"outputs are {sorted(graph.outputs)}")
    g = graph.copy()
    root = g.outputs[loss]
    if g[root].size != 1:
        raise GraphError(f"loss {loss!r} must be a scalar, found shape {list(g[root].shape)}")
    trainable = {name: i for name, i in g.parameters.items() if g.param_meta[name].get("trainable", True)}
    active = on_gradient_path(g, set(trainable.values()), root)
    with g.scope(g[root].modules):
        seed = g.constant(np.ones(g[root].shape, np.float32), name="d" + loss)
    grads = backprop(g, root, seed, active)
    pairs = []
    for name, i in trainable.items():
        if i in grads:
            g.output("grad:" + name, grads[i])
            pairs.append((name, "grad:" + name))
    return g.prune()[0], pairs


def on_gradient_path(g: Graph, sources: set[int], root: int) -> set[int]:
    """Nodes that depend on ``sources`` (through float values, not through
    stop_gradient) and that ``root`` depends on: the only nodes worth differentiating."""
    reach = set(sources)
    for n in g.nodes[min(sources, default=root):root + 1]:
        if n.dtype == "f32" and n.op != "stop_gradient" and any(i in reach for i in n.inputs):
            reach.add(n.id)
    needed, stack = set(), [root]
    while stack:
        i = stack.pop()
        if i in reach and i not in needed:
            needed.add(i)
            stack.extend(g[i].inputs)
    return needed


def backprop(g: Graph, root: int, seed: int, active: set[int], leaves=frozenset()) -> dict[int, int]:
    """Accumulate gradients from ``root`` (seeded with ``seed``) back through the nodes
    in ``active``, newest first; ``leaves`` get gradients but are not walked through.
    The nodes a node's rule builds carry that node's modules."""
    grads = {root: seed}
    for nid in sorted(active, reverse=True):
        node = g[nid]
        if nid not in grads or nid in leaves or OPS[node.op].archetype == SOURCE:
            continue
        with g.scope(node.modules):
            for i, d in zip(node.inputs, rule_of(g, node)(g, node, grads[nid])):
                if d is not None and i in active:
                    d = sum_to(g, d, g[i].shape)
                    grads[i] = g.add(grads[i], d) if i in grads else d
    return grads


def rule_of(g: Graph, node: Node) -> GradientRule:
    rule = GRADIENTS.get(node.op)
    if rule is None:
        raise GraphError(f"{g.format_node(node)}: op {node.op!r} has no gradient rule: it exists only in "
                         f"gradients, and second derivatives through it are not supported; "
                         f"differentiate a graph without gradient ops")
    return rule


def sum_to(g: Graph, d: int, shape) -> int:
    """Undo broadcasting: sum a gradient back to its operand's shape."""
    return d if g.shape(d) == tuple(shape) else g.apply("sum_to", d, shape=tuple(shape))


def through(build: Callable) -> GradientRule:
    """Gradient rule of a fused op: rebuild it with ``build(g, node, *operands)`` from
    simpler ops and backpropagate through that subgraph."""
    def rule(g: Graph, node: Node, dout: int) -> tuple:
        start = len(g)
        out = build(g, node, *node.inputs)
        if g.shape(out) != node.shape:
            out = g.apply("broadcast_to", out, shape=node.shape)
        operands = {i for i in node.inputs if g[i].dtype == "f32"}
        active = on_gradient_path(g, operands, out) | operands
        grads = backprop(g, out, dout, {i for i in active if i >= start} | operands, leaves=operands)
        return tuple(grads.get(i) for i in node.inputs)
    return rule


# ---------------------------------------------------------------- helpers

def const(g: Graph, value: float) -> int:
    return g.constant(np.float32(value))


def scaled(g: Graph, x: int, factor: float) -> int:
    return g.mul(x, const(g, factor))


def expand(g: Graph, d: int, shape, axis) -> int:
    """Broadcast the gradient of a reduction over ``axis`` back to the input's shape."""
    if axis is not None and len(g.shape(d)) < len(shape):
        d = g.reshape(d, tuple(shape[:-1]) + (1,))
    return g.apply("broadcast_to", d, shape=tuple(shape))


def reduced_count(shape, axis) -> int:
    return shape[-1] if axis is not None else math.prod(shape)


def matmul_grads(g: Graph, a: int, b: int, d: int, ta: bool, tb: bool) -> tuple[int, int]:
    """d(op(a) @ op(b)) for transpose flags ta, tb: matmuls with flipped flags. A
    batched activation times a 2-D weight folds the batch into rows for the weight's
    gradient instead of materialising one partial gradient per batch entry."""
    da = g.matmul(b, d, transpose_a=tb, transpose_b=True) if ta else g.matmul(d, b, transpose_b=not tb)
    a2, d2 = a, d
    if len(g.shape(b)) == 2 and len(g.shape(a)) > 2 and not ta:
        a2 = g.reshape(a, (-1, g.shape(a)[-1]))
        d2 = g.reshape(d, (-1, g.shape(d)[-1]))
    db = g.matmul(d2, a2, transpose_a=True, transpose_b=ta) if tb else g.matmul(a2, d2, transpose_a=not ta)
    return da, db


# ---------------------------------------------------------------- decompositions of fused ops

def activate(g: Graph, x: int, activation: str) -> int:
    if activation == "none":
        return x
    op, attrs = ACTIVATION_OPS[activation]
    return g.apply(op, x, **attrs)


def standardize(g: Graph, x: int, eps: float, center: bool = True) -> int:
    """(x - mean) / sqrt(var + eps) over the last axis (no centring: RMS norm)."""
    if center:
        x = g.sub(x, g.mean(x, axis=-1, keepdims=True))
    ms = g.mean(g.mul(x, x), axis=-1, keepdims=True)
    return g.mul(x, g.rsqrt(g.add(ms, const(g, eps))))


def norm_grad(center: bool) -> GradientRule:
    """layer_norm (``center``) and rms_norm: dx by one row kernel (``norm_grad``), dw
    (the sum over rows of dout * standardized x) and db (that of dout) as the rows of one
    ``norm_param_grad``. Through the decomposition each norm's backward was about 17
    dispatches (whisper-tiny: 391 a training step); these are 3, and the plan computes the
    first in the second's kernel (``_norm_gradient_pairs``). (dw as a product over
    rows, added up by two ``sum_to``, took 81 us a norm at [12000, 384] on the H100.)"""
    def rule(g: Graph, n: Node, d: int) -> tuple:
        x, w = n.inputs[:2]
        attrs = dict(eps=n.attrs["eps"], center=center)
        dx = g.apply("norm_grad", d, x, w, **attrs)
        sums = g.apply("norm_param_grad", d, x, **attrs)
        rows, width = g.shape(sums)
        return (dx, *(g.apply("part", sums, offset=i * width, shape=g.shape(w)) for i in range(rows)))
    return rule


def program_parts(g, node, *xs):
    temps = []
    for op, args, attrs in node.attrs["program"]:
        vals = [xs[v] if k == "in" else temps[v] if k == "t" else const(g, v) for k, v in args]
        temps.append(g.apply(op, *vals, **dict(attrs)))
    return temps[-1]


def fused_matmul_parts(g, node, a, b, *extra):
    at = node.attrs
    extra = list(extra)
    y = g.matmul(a, b, at["transpose_a"], at["transpose_b"])
    if at["has_add"]:
        y = g.add(y, extra.pop(0))
    y = activate(g, y, at["activation"])
    if at["has_residual"]:
        y = g.add(y, extra.pop(0))
    if at["gradient_of"] != "none":
        op, attrs = GRADIENT_OF[at["gradient_of"]]
        y = g.apply(op, y, extra.pop(0), **attrs)
    return y


def group_norm_parts(g, node, x, w, b):
    at, shape = node.attrs, node.shape
    xhat = standardize(g, g.reshape(x, (shape[0], at["num_groups"], -1)), at["eps"])
    per_channel = (shape[1],) + (1,) * (len(shape) - 2)
    y = g.reshape(xhat, shape)
    y = g.add(g.mul(y, g.reshape(w, per_channel)), g.reshape(b, per_channel))
    return g.silu(y) if at["activation"] == "silu" else y


def split_heads(g, x, heads, dim, rep):
    """[B, T, heads*dim] -> [B, heads*rep, T, dim], each head repeated rep times (GQA)."""
    b, t, _ = g.shape(x)
    x = g.transpose(g.reshape(x, (b, t, heads, dim)), (0, 2, 1, 3))
    if rep == 1:
        return x
    x = g.apply("broadcast_to", g.reshape(x, (b, heads, 1, t, dim)), shape=(b, heads, rep, t, dim))
    return g.reshape(x, (b, heads * rep, t, dim))


def attention_parts(g, node, q, k, v):
    at = node.attrs
    h = at["num_heads"]
    hkv = at["num_kv_heads"] or h
    b, tq, width = g.shape(q)
    d, tk = width // h, g.shape(k)[1]
    qh = split_heads(g, q, h, d, 1)
    kh, vh = split_heads(g, k, hkv, d, h // hkv), split_heads(g, v, hkv, d, h // hkv)
    s = scaled(g, g.matmul(qh, kh, transpose_b=True), 1.0 / math.sqrt(d) if at["scale"] is None else at["scale"])
    if at["causal"]:
        s = g.add(s, g.constant(np.where(np.tril(np.ones((tq, tk), bool)), 0.0, -np.inf)))
    o = g.matmul(g.softmax(s), vh)
    return g.reshape(g.transpose(o, (0, 2, 1, 3)), (b, tq, width))


# ---------------------------------------------------------------- rules that need more than a line

def unary(fn) -> GradientRule:
    """A rule for y = f(x) from fn(g, x, y, dout) -> dx."""
    return lambda g, n, d: (fn(g, n.inputs[0], n.id, d),)


def silu_grad(g, x, y, d):
    s = g.sigmoid(x)
    return g.mul(d, g.mul(s, g.add(const(g, 1.0), g.mul(x, g.sub(const(g, 1.0), s)))))


def pow_grad(g, n, d):
    x, e = n.inputs[0], n.attrs["exponent"]
    return (g.mul(d, scaled(g, g.pow(x, e - 1.0), e)),)


def reduction_grad(mean: bool) -> GradientRule:
    def rule(g, n, d):
        x, axis = n.inputs[0], n.attrs["axis"]
        if mean:
            d = scaled(g, d, 1.0 / reduced_count(g.shape(x), axis))
        return (expand(g, d, g.shape(x), axis),)
    return rule


def softmax_grad(g, n, d):
    y = n.id
    return (g.mul(y, g.sub(d, g.sum(g.mul(d, y), axis=-1, keepdims=True))),)


def log_softmax_grad(g, n, d):
    return (g.sub(d, g.mul(g.exp(n.id), g.sum(d, axis=-1, keepdims=True))),)


def rows_of(g, x) -> int:
    return math.prod(g.shape(x)[:-1])


def soft_cross_entropy_grad(g, n, d):
    x, t = n.inputs
    per_row = g.mul(d, const(g, 1.0 / rows_of(g, x)))
    dx = g.sub(g.mul(g.softmax(x), g.sum(t, axis=-1, keepdims=True)), t)
    return g.mul(dx, per_row), g.mul(g.neg(g.log_softmax(x)), per_row)


def mse_grad(g, n, d):
    p, t = n.inputs
    dp = g.mul(g.sub(p, t), g.mul(d, const(g, 2.0 / g[p].size)))
    return dp, g.neg(dp)


def bce_grad(g, n, d):
    x, t = n.inputs
    per_elem = g.mul(d, const(g, 1.0 / g[x].size))
    return g.mul(g.sub(g.sigmoid(x), t), per_elem), g.mul(g.neg(x), per_elem)


def matmul_grad(g, n, d):
    return matmul_grads(g, *n.inputs, d, n.attrs["transpose_a"], n.attrs["transpose_b"])


def conv_grad(g, n, d):
    if n.attrs["activation"] != "none":   # engine.optimize.conv_activation's, on an inference graph
        return through(conv_parts)(g, n, d)
    x, w = n.inputs[:2]
    st, pad = n.attrs["stride"], n.attrs["padding"]
    dx = g.apply("conv_input_grad", d, w, stride=st, padding=pad, input_shape=g.shape(x))
    dw = g.apply("conv_weight_grad", x, d, stride=st, padding=pad, kernel=g.shape(w)[2:])
    if len(n.inputs) == 2:
        return dx, dw
    out_ch, nd = g.shape(w)[0], len(st)
    db = g.reshape(g.apply("sum_to", d, shape=(1, out_ch) + (1,) * nd), (out_ch,))
    return dx, dw, db


def conv_parts(g, node, *operands):
    plain = g.apply(node.op, *operands, **{**node.attrs, "activation": "none"})
    return activate(g, plain, node.attrs["activation"])


def concat_grad(g, n, d):
    axis, start, out = n.attrs["axis"] % len(n.shape), 0, []
    for i in n.inputs:
        stop = start + g.shape(i)[axis]
        out.append(g.slice(d, axis, start, stop))
        start = stop
    return tuple(out)


def slice_grad(g, n, d):
    x, at = n.inputs[0], n.attrs
    axis = at["axis"] % len(n.shape)
    return (g.apply("pad", d, axis=axis, before=at["start"], after=g.shape(x)[axis] - at["stop"]),)


def pad_grad(g, n, d):
    axis, before = n.attrs["axis"] % len(n.shape), n.attrs["before"]
    return (g.slice(d, axis, before, before + g.shape(n.inputs[0])[axis]),)


decomposed_attention_grad = through(attention_parts)


def attention_grad(g, n, d):
    """FlashAttention-2's backward: the forward's row log-sum-exp, Delta = rowsum(dO * O)
    and fused kernels that recompute the probabilities block by block, one for dq and one
    for dk and dv together (packed in one result, which ``part`` views split), so no
    [B, H, T, S] tensor exists. Head dims the tiled kernels lack take the decomposition."""
    q, k, v = n.inputs
    h = n.attrs["num_heads"]
    b, t, width = g.shape(q)
    if not tiled_attention_head_dim(width // h):
        return decomposed_attention_grad(g, n, d)
    per_head = (b, t, h, width // h)
    lse = g.apply("attention_lse", q, k, **n.attrs)
    delta = g.apply("row_dot", g.reshape(d, per_head), g.reshape(n.id, per_head))
    kv = g.apply("attention_grad_kv", q, k, v, d, lse, delta, **n.attrs)
    dk, dv = (g.apply("part", kv, offset=at, shape=g.shape(k)) for at in attention_grad_kv_layout(g.shape(k))[0])
    return g.apply("attention_grad_q", q, k, v, d, lse, delta, **n.attrs), dk, dv


def rope_grad(g, n, d):
    return (g.apply("rope", d, *n.inputs[1:], **{**n.attrs, "inverse": not n.attrs["inverse"]}), None)


def inference_only(g, n, d):
    raise GraphError(f"{g.format_node(n)}: {n.op} belongs to cached generation, which is inference only; "
                     f"differentiate the model's training graph instead")


def after_autodiff(made_by: str):
    """The rule of an op a pass makes after autodiff (``made_by``): differentiating it is a mistake."""
    def rule(g, n, d):
        raise GraphError(f"{g.format_node(n)}: {n.op} is made by {made_by}, after autodiff; differentiate "
                         f"the graph before that pass")
    return rule


# ---------------------------------------------------------------- rules of the ONNX import ops

def no_gradient(g, n, d):
    """Piecewise-constant, boolean or integer results (floor, comparisons, index_wrap):
    the gradient is zero almost everywhere, so the operands get none."""
    return (None,) * len(n.inputs)


def extremum_grad(larger: bool) -> GradientRule:
    """maximum (``larger``) and minimum: dout to the operand that won, half to each on
    ties (as torch.maximum / torch.minimum)."""
    def rule(g, n, d):
        x, y = n.inputs
        wins = g.apply("greater" if larger else "less", x, y)
        share = g.add(wins, scaled(g, g.apply("equal", x, y), 0.5))
        dx = g.mul(d, share)
        return dx, g.sub(d, dx)
    return rule


def power_grad(g, n, d):
    """x ** y: dx = dout y x^(y-1), dy = dout x^y log x, zero where x == 0 and y >= 0
    (as torch.pow: there log x is -inf but x^y log x tends to 0)."""
    x, y = n.inputs
    dx = g.mul(d, g.mul(y, g.apply("power", x, g.sub(y, const(g, 1.0)))))
    at_zero = g.mul(g.apply("equal", x, const(g, 0.0)), g.apply("greater_equal", y, const(g, 0.0)))
    dy = g.apply("where", at_zero, const(g, 0.0), g.mul(d, g.mul(n.id, g.log(x))))
    return dx, dy


def where_grad(g, n, d):
    c = n.inputs[0]
    zero = const(g, 0.0)
    return None, g.apply("where", c, d, zero), g.apply("where", c, zero, d)


def conv_general_grad(g, n, d):
    x, w = n.inputs[:2]
    at = {k: n.attrs[k] for k in ("stride", "pads", "dilation", "groups")}
    dx = g.apply("conv_general_input_grad", d, w, input_shape=g.shape(x), **at)
    dw = g.apply("conv_general_weight_grad", x, d, kernel=g.shape(w)[2:], **at)
    if len(n.inputs) == 2:
        return dx, dw
    out_ch, nd = g.shape(w)[0], len(at["stride"])
    return dx, dw, g.reshape(g.apply("sum_to", d, shape=(1, out_ch) + (1,) * nd), (out_ch,))


POOL_ATTRS = ("kernel", "stride", "pads", "dilation", "ceil_mode")


def avg_pool_grad(g, n, d):
    """dout / divisor spread evenly over each window: the transposed depthwise
    convolution with a kernel of ones, taps in the padding dropped."""
    x, at = n.inputs[0], n.attrs
    shape = g.shape(x)
    divisor = pool_divisor(shape[2:], at["kernel"], at["stride"], at["pads"], at["dilation"], at["ceil_mode"],
                           at["count_include_pad"])
    ones = g.constant(np.ones((shape[1], 1) + tuple(at["kernel"]), np.float32))
    return (g.apply("conv_general_input_grad", g.div(d, g.constant(divisor.astype(np.float32))), ones,
                    stride=at["stride"], pads=at["pads"], dilation=at["dilation"], groups=shape[1],
                    input_shape=shape),)


# ---------------------------------------------------------------- the table

GRADIENTS: dict[str, GradientRule] = {
    "neg": unary(lambda g, x, y, d: g.neg(d)),
    "exp": unary(lambda g, x, y, d: g.mul(d, y)),
    "log": unary(lambda g, x, y, d: g.div(d, x)),
    "sqrt": unary(lambda g, x, y, d: g.div(d, scaled(g, y, 2.0))),
    "rsqrt": unary(lambda g, x, y, d: scaled(g, g.div(g.mul(d, y), x), -0.5)),
    "reciprocal": unary(lambda g, x, y, d: g.neg(g.mul(d, g.mul(y, y)))),
    "abs": unary(lambda g, x, y, d: g.apply("abs_grad", d, x)),
    "relu": unary(lambda g, x, y, d: g.apply("relu_grad", d, x)),
    "sigmoid": unary(lambda g, x, y, d: g.mul(d, g.mul(y, g.sub(const(g, 1.0), y)))),
    "tanh": unary(lambda g, x, y, d: g.mul(d, g.sub(const(g, 1.0), g.mul(y, y)))),
    "silu": unary(silu_grad),
    "stop_gradient": lambda g, n, d: (None,),
    "gelu": lambda g, n, d: (g.apply("gelu_grad", d, n.inputs[0], approximate=n.attrs["approximate"]),),
    "pow": pow_grad,
    "add": lambda g, n, d: (d, d),
    "sub": lambda g, n, d: (d, g.neg(d)),
    "mul": lambda g, n, d: (g.mul(d, n.inputs[1]), g.mul(d, n.inputs[0])),
    "div": lambda g, n, d: (g.div(d, n.inputs[1]), g.neg(g.div(g.mul(d, n.id), n.inputs[1]))),
    "bias_add": lambda g, n, d: (d, d),
    "pointwise": through(program_parts),
    "swiglu": through(lambda g, n, a, u: g.mul(g.silu(a), u)),
    "sum": reduction_grad(mean=False),
    "mean": reduction_grad(mean=True),
    "max": lambda g, n, d: (g.apply("max_grad", d, n.inputs[0], **n.attrs),),
    "sum_to": lambda g, n, d: (g.apply("broadcast_to", d, shape=g.shape(n.inputs[0])),),
    "softmax": softmax_grad,
    "log_softmax": log_softmax_grad,
    "layer_norm": norm_grad(center=True),
    "rms_norm": norm_grad(center=False),
    "group_norm": through(group_norm_parts),
    "cross_entropy": lambda g, n, d: (g.apply("cross_entropy_grad", *n.inputs, d, **n.attrs), None),
    "soft_cross_entropy": soft_cross_entropy_grad,
    "mse_loss": mse_grad,
    "bce_loss": bce_grad,
    "matmul": matmul_grad,
    "fused_matmul": through(fused_matmul_parts),
    "norm_matmul": through(lambda g, n, x, w, b: g.matmul(g.rms_norm(x, w, n.attrs["eps"]), b,
                                                          transpose_b=n.attrs["transpose_b"])),
    "attention": attention_grad,
    "rope": rope_grad,
    "cache_write": inference_only,
    "cached_attention": inference_only,
    "argmax": no_gradient,
    "swiglu_matmul": after_autodiff("the few-row pass of generation graphs"),
    "norm_matmuls": after_autodiff("the few-row pass of generation graphs"),
    "attention_stats": after_autodiff("engine.optimize.attention_stats"),
    "widen": after_autodiff("engine.optimize.bf16_weights, for generation"),
    "conv1d": conv_grad,
    "conv2d": conv_grad,
    "reshape": lambda g, n, d: (g.reshape(d, g.shape(n.inputs[0])),),
    "transpose": lambda g, n, d: (g.transpose(d, tuple(int(i) for i in np.argsort(n.attrs["perm"]))),),
    "concat": concat_grad,
    "slice": slice_grad,
    "pad": pad_grad,
    "broadcast_to": lambda g, n, d: (d,),  # the walk's sum_to undoes the broadcast
    "embedding": lambda g, n, d: (g.apply("embedding_grad", d, n.inputs[1], vocab=g.shape(n.inputs[0])[0]), None),
    "erf": unary(lambda g, x, y, d: g.mul(d, scaled(g, g.exp(g.neg(g.mul(x, x))), 2.0 / math.sqrt(math.pi)))),
    "softplus": unary(lambda g, x, y, d: g.mul(d, g.sigmoid(x))),
    "floor": no_gradient,
    "ceil": no_gradient,
    "sign": no_gradient,
    "logical_not": no_gradient,
    "leaky_relu": lambda g, n, d: (g.apply("where", g.apply("greater", n.inputs[0], const(g, 0.0)), d,
                                           scaled(g, d, n.attrs["alpha"])),),
    "maximum": extremum_grad(larger=True),
    "minimum": extremum_grad(larger=False),
    "power": power_grad,
    "equal": no_gradient,
    "less": no_gradient,
    "greater": no_gradient,
    "less_equal": no_gradient,
    "greater_equal": no_gradient,
    "where": where_grad,
    "cast": lambda g, n, d: (d if n.attrs["dtype"] == "f32" else None,),
    "index_wrap": no_gradient,
    "conv_general": conv_general_grad,
    "max_pool": lambda g, n, d: (g.apply("max_pool_grad", d, n.inputs[0], **{k: n.attrs[k] for k in POOL_ATTRS}),),
    "avg_pool": avg_pool_grad,
}

for _name, _rule in GRADIENTS.items():
    OPS[_name].grad = _rule
