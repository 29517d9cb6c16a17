"""Pooling (``max_pool``, ``avg_pool``) and the direct N-d convolution (``conv_general``):
one thread per output element walking its window, geometry in meta words; their
gradients (``conv_general_input_grad``, ``conv_general_weight_grad``, ``max_pool_grad``)
likewise gathered, one thread per element of the gradient.

``conv_general`` (the ONNX importer's Conv: groups, dilations, begin/end pads, any
rank) takes a direct kernel rather than the implicit GEMM of ``convolution``: it is
exact for every attribute combination; the fast path stays with ``conv1d``/``conv2d``.
"""

from __future__ import annotations

import math

from ..graph.ir import Graph, Node
from .common import PLAIN, WG, Capabilities, Kernel, _finish, _render, grid_1d


def _window(out, inp, kernel, stride, pad_begin, dilation) -> list[int]:
    """The window fields of shaders/window.wgsl, in its order."""
    return [*out, *inp, *kernel, *stride, *pad_begin, *dilation]


def _pool(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    a = node.attrs
    x = graph[node.inputs[0]].shape
    nd = len(x) - 2
    pads = list(a["pads"])
    in_size = math.prod(x[2:])
    meta = [node.size, math.prod(a["kernel"]), in_size,
            *_window(node.shape[2:], x[2:], a["kernel"], a["stride"], pads[:nd], a["dilation"]), *pads[nd:]]
    mode_max = node.op == "max_pool"
    include = bool(a.get("count_include_pad", False)) and not mode_max
    return _finish(f"pool:{node.op}", "pool", "pool.wgsl", ["in0"], ["f32"], "f32", meta,
                   grid_1d(-(-node.size // WG)), caps, ND=nd, MAX_MODE=str(mode_max).lower(),
                   INCLUDE_PAD=str(include).lower(), WINDOW=_render("window.wgsl", WINDOW_BASE=3))


def _conv_direct(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    a = node.attrs
    x, w = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape
    nd = len(x) - 2
    groups = int(a["groups"])
    o = w[0]
    meta = [node.size, o, w[1], o // groups, x[1], math.prod(w[2:]), math.prod(x[2:]),
            *_window(node.shape[2:], x[2:], w[2:], a["stride"], list(a["pads"])[:nd], a["dilation"])]
    has_bias = len(node.inputs) == 3
    names = ["x_in", "w_in"] + (["b_in"] if has_bias else [])
    return _finish(f"conv:{node.op}", "conv", "conv_direct.wgsl", names, ["f32"] * len(names), "f32", meta,
                   grid_1d(-(-node.size // WG)), caps, ND=nd, WINDOW=_render("window.wgsl", WINDOW_BASE=7),
                   BIAS="    acc = acc + b_in[o];" if has_bias else "")


def _conv_direct_grad(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    a = node.attrs
    first, second = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape
    inputs = node.op == "conv_general_input_grad"
    dout, w, x = (first, second, node.shape) if inputs else (second, node.shape, first)
    nd = len(x) - 2
    groups = int(a["groups"])
    meta = [node.size, w[0], w[1], w[0] // groups, x[1], x[0], math.prod(w[2:]), math.prod(x[2:]),
            math.prod(dout[2:]), *_window(dout[2:], x[2:], w[2:], a["stride"], list(a["pads"])[:nd], a["dilation"])]
    return _finish(f"conv:{node.op}", "conv", "conv_direct_grad.wgsl", ["in0", "in1"], ["f32", "f32"], "f32", meta,
                   grid_1d(-(-node.size // WG)), caps, ND=nd, INPUT=str(inputs).lower(),
                   WINDOW=_render("window.wgsl", WINDOW_BASE=9))


def _max_pool_grad(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    a = node.attrs
    dout, x = graph[node.inputs[0]].shape, node.shape
    nd = len(x) - 2
    pads = list(a["pads"])
    meta = [node.size, math.prod(a["kernel"]), math.prod(x[2:]), math.prod(dout[2:]),
            *_window(dout[2:], x[2:], a["kernel"], a["stride"], pads[:nd], a["dilation"])]
    return _finish("pool:max_pool_grad", "pool", "pool_grad.wgsl", ["in0", "in1"], ["f32", "f32"], "f32", meta,
                   grid_1d(-(-node.size // WG)), caps, ND=nd, WINDOW=_render("window.wgsl", WINDOW_BASE=4))
