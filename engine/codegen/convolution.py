"""Convolutions (1-D and 2-D, forward and both gradients) as implicit GEMM on the matmul template.
"""

from __future__ import annotations

import math

from ..errors import DeviceError
from ..graph.ir import Graph, Node
from .common import Capabilities, Kernel, MAX_WORKGROUPS, PLAIN, _render
from .matmul import (LONG_SLICE, _scaled_operands, _tile_note, _tile_of, _tile_subs, _tiled_kernel, matmul_variant,
                     slice_fill, split_rule)
from .matmul_coop import COOP, coop_workgroup_bytes
from .pointwise import ACTIVATION_EXPR
from .tile_operands import operand_fetch


# ---------------------------------------------------------------- convolution as implicit GEMM
# Every convolution kernel is the tiled matmul with one or both operands gathered (the
# im2col matrix is read straight from the tensor, zero where the window leaves it):
#   conv:              out[n] (O x OH*OW)  = w (O x C*KH*KW)          @ im2col(x[n])
#   conv_input_grad:   dx[n]  (C x H*W)    = w as (C x O*KH*KW)       @ windows of dout[n]
#   conv_weight_grad:  dw     (O x C*KH*KW) = dout as (O x N*OH*OW)   @ im2col(x) over the batch
# (1-d convolutions are 2-d ones of height 1). The direct kernels (one thread per output,
# summing its window) ran at 0.2-1.9 TFLOP/s on the H100: whisper-tiny's conv2 input
# gradient alone took 6.9 ms of a 25 ms training step. The geometry (_CONV_WORDS) is
# written into each kernel as constants, not meta words: every gathered element divides
# by it, and a division by a constant compiles to a multiply and a shift.

_CONV_WORDS = ("C", "O", "H", "W", "KH", "KW", "OH", "OW", "SH", "SW", "PH", "PW")


def _conv_geometry(graph: Graph, node: Node) -> dict:
    """The convolution's sizes (``_CONV_WORDS`` and the batch N), whichever op it is."""
    a = node.attrs
    if node.op in ("conv1d", "conv2d"):
        x, w, out = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape, node.shape
    elif node.op == "conv_input_grad":
        dout, w = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape
        x, out = tuple(a["input_shape"]), dout
    else:
        x, dout = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape
        w, out = (dout[1], x[1], *a["kernel"]), dout
    one_d = len(x) == 3
    lift = (lambda t, height=1: (height, *t)) if one_d else (lambda t, height=1: tuple(t))
    (h, wd), (kh, kw), (oh, ow) = lift(x[2:]), lift(w[2:]), lift(out[2:])
    (sh, sw), (ph, pw) = lift(a["stride"]), lift(a["padding"], height=0)
    return dict(N=x[0], C=x[1], O=w[0], H=h, W=wd, KH=kh, KW=kw, OH=oh, OW=ow, SH=sh, SW=sw, PH=ph, PW=pw)


def _window(go_pos: str, r: str) -> tuple[str, str]:
    """(input row, input column) as i32 of output position ``go_pos`` and kernel tap ``r``."""
    return (f"i32(({go_pos} / cv_OW) * cv_SH + {r} / cv_KW) - i32(cv_PH)",
            f"i32(({go_pos} % cv_OW) * cv_SW + {r} % cv_KW) - i32(cv_PW)")


def _inside(iy: str, ix: str) -> str:
    return f"{iy} >= 0 && {iy} < i32(cv_H) && {ix} >= 0 && {ix} < i32(cv_W)"


def _im2col_forward(go, gk):
    """B of the forward conv: k = (c, ky, kx), outer = output position of batch b."""
    iy, ix = _window(go, f"{gk} % (cv_KH * cv_KW)")
    return ([f"let iy = {iy};", f"let ix = {ix};"],
            f"{go} < N && {gk} < K && {_inside('iy', 'ix')}",
            f"b0 + ({gk} / (cv_KH * cv_KW) * cv_H + u32(iy)) * cv_W + u32(ix)")


def _weights_by_channel(go, gk):
    """A of the input gradient: w[o, c, ky, kx] at row c, k = (o, ky, kx)."""
    return ([], f"{go} < M && {gk} < K",
            f"({gk} / (cv_KH * cv_KW) * cv_C + {go}) * cv_KH * cv_KW + {gk} % (cv_KH * cv_KW)")


def _dout_windows(go, gk):
    """B of the input gradient: the dout element that tap (o, ky, kx) of input position
    ``go`` received, where the stride lets one."""
    return ([f"let r = {gk} % (cv_KH * cv_KW);",
             f"let ty = i32({go} / cv_W + cv_PH) - i32(r / cv_KW);",
             f"let tx = i32({go} % cv_W + cv_PW) - i32(r % cv_KW);"],
            f"{go} < N && {gk} < K && ty >= 0 && tx >= 0 && u32(ty) % cv_SH == 0u && u32(tx) % cv_SW == 0u "
            f"&& u32(ty) / cv_SH < cv_OH && u32(tx) / cv_SW < cv_OW",
            f"b0 + ({gk} / (cv_KH * cv_KW) * cv_OH + u32(ty) / cv_SH) * cv_OW + u32(tx) / cv_SW")


# A strided convolution's input gradient by classes of input positions: position (y, x)
# takes taps (ky, kx) with ky = (y + PH) % SH (mod SH), kx likewise, and no others, so the
# positions of one class (a parity, for stride 2) make a GEMM of their own over
# O x ceil(KH / SH) x ceil(KW / SW) taps instead of O x KH x KW (whisper's conv2, stride 2,
# 3 taps: 2 instead of 3, none of them skipped by a failed divisibility test). Workgroup
# z covers batch element z / classes and class z % classes (so A, the weights, is the
# same for the whole workgroup), its columns the class's positions on a grid of
# ceil(H / SH) x ceil(W / SW) (those past the input are masked); OUT_AT puts each result
# back at its position.
def _class_origin(r: str, stride: str, pad: str) -> str:
    """WGSL: the first input coordinate along an axis whose positions of class ``r`` take
    taps r, r + stride, ...: the y with (y + pad) % stride == r."""
    return f"({r} + {stride} - {pad} % {stride}) % {stride}"


_CLASS_LETS = ("let cls = b % cv_CLS;", "let ry = cls / cv_SW;", "let rx = cls % cv_SW;",
               f"let y0 = {_class_origin('ry', 'cv_SH', 'cv_PH')};", f"let x0 = {_class_origin('rx', 'cv_SW', 'cv_PW')};",
               "let db0 = b / cv_CLS * cv_O * cv_OH * cv_OW;")


def _class_taps(gk):
    """(lines, validity) of tap (o, ky, kx) at column ``gk`` of a class's K."""
    return ([f"let o = {gk} / (cv_JY * cv_JX);", f"let ky = ry + cv_SH * ({gk} % (cv_JY * cv_JX) / cv_JX);",
             f"let kx = rx + cv_SW * ({gk} % cv_JX);"], "ky < cv_KH && kx < cv_KW")


def _class_weights(go, gk):
    """A of a class's input gradient: w[o, c, ky, kx] at row c, k = (o, jy, jx)."""
    taps, valid = _class_taps(gk)
    return (taps, f"{go} < M && {gk} < K && {valid}", f"((o * cv_C + {go}) * cv_KH + ky) * cv_KW + kx")


def _class_dout(go, gk):
    """B of a class's input gradient: the dout element tap (o, ky, kx) of the class's
    position ``go`` received."""
    taps, valid = _class_taps(gk)
    return ([*taps, f"let y = y0 + cv_SH * ({go} / cv_NX);", f"let x = x0 + cv_SW * ({go} % cv_NX);",
             "let ty = i32(y + cv_PH) - i32(ky);", "let tx = i32(x + cv_PW) - i32(kx);"],
            f"{go} < N && {gk} < K && {valid} && y < cv_H && x < cv_W && ty >= 0 && tx >= 0 "
            f"&& u32(ty) / cv_SH < cv_OH && u32(tx) / cv_SW < cv_OW",
            "db0 + (o * cv_OH + u32(ty) / cv_SH) * cv_OW + u32(tx) / cv_SW")


def _class_out_at(g: dict, classes: int, nx: int) -> str:
    """matmul_tiled.wgsl's OUT_AT for a class's input gradient: column col of z's class
    at its input position, nothing past the input."""
    sh, sw, ph, pw = (f"{g[w]}u" for w in ("SH", "SW", "PH", "PW"))
    return "\n".join([
        f"    let cls = z % {classes}u;",
        f"    let y = {_class_origin(f'cls / {sw}', sh, ph)} + {sh} * (col / {nx}u);",
        f"    let x = {_class_origin(f'cls % {sw}', sw, pw)} + {sw} * (col % {nx}u);",
        f"    if (y >= {g['H']}u || x >= {g['W']}u) {{ return; }}",
        f"    let at = (z / {classes}u * M + row) * {g['H'] * g['W']}u + y * {g['W']}u + x;"])


def _dout_rows(go, gk):
    """A of the weight gradient: dout[n, o, oy, ox] at row o, k = (n, oy, ox)."""
    return ([], f"{go} < M && {gk} < K",
            f"({gk} / (cv_OH * cv_OW) * cv_O + {go}) * cv_OH * cv_OW + {gk} % (cv_OH * cv_OW)")


def _im2col_batch(go, gk):
    """B of the weight gradient: k = (n, oy, ox), outer = (c, ky, kx)."""
    iy, ix = _window(f"({gk} % (cv_OH * cv_OW))", f"({go} % (cv_KH * cv_KW))")
    return ([f"let iy = {iy};", f"let ix = {ix};"],
            f"{go} < N && {gk} < K && {_inside('iy', 'ix')}",
            f"(({gk} / (cv_OH * cv_OW) * cv_C + {go} / (cv_KH * cv_KW)) * cv_H + u32(iy)) * cv_W + u32(ix)")


def _conv_variant(op: str, m_: int, n_: int, nbatch: int, k_: int, caps: Capabilities) -> str:
    """The matmul kernel of a convolution's implicit GEMM: ``matmul_variant``'s, except
    that a weight gradient whose K splits into long slices (``LONG_SLICE``) takes the
    128 x 128 cooperative tile (lean where the slices allow, as ``coop_variant``'s) where
    that rule gives 64 x 64. Both of its operands are gathered
    (index arithmetic an element), and a tile twice as wide gathers half as much a FLOP:
    whisper's conv1 weight gradient ([384, 240] over K = 24000 at batch 8, 6 tiles in 16
    slices) took 150 us a step on the H100 where 64 x 64 tiles took 225 (c64 in 8 or 4
    slices: 261 and 374; run 35). Products of loaded operands keep the rule: there the
    smaller tile's occupancy wins (``coop_variant``)."""
    preset = matmul_variant(m_, n_, nbatch, k_, caps=caps)
    splits = split_rule(-(-m_ // 128) * -(-n_ // 128) * nbatch, k_, caps.tuning, caps.tuning.wide_fill)
    wide = "c128l" if k_ // splits <= caps.tuning.lean_k else "c128"
    if (op == "conv_weight_grad" and preset in ("c64", "c64l") and caps.knobs.matmul == "auto"
            and coop_workgroup_bytes(wide) <= caps.workgroup_storage and COOP[wide].threads <= caps.invocations
            and splits > 1 and k_ // splits >= LONG_SLICE):
        return wide
    return "64" if preset == "simple" else preset


def _conv(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """Any convolution op as an implicit GEMM on the tiled matmul kernel. Each gathered
    operand is fetched with a warp's threads along the axis that is contiguous in memory
    (or nearly): the input gradient's weights along channels (w[o, c, tap]: a stride of
    KH * KW), the weight gradient's im2col along k (output positions of one channel and
    tap). Along the other axis a warp's 32 loads touched 11 to 16 lines: whisper's conv2
    input gradient took 404 us a step where it now takes 238, its weight gradient 210
    where 180, conv1's 151 where 130 (f16 on the H100; f32 600 -> 576 and 464 -> 437 us;
    run 35)."""
    g = _conv_geometry(graph, node)
    taps, spatial_in, spatial_out = g["KH"] * g["KW"], g["H"] * g["W"], g["OH"] * g["OW"]
    words = lambda batch_stride, s_row, s_col: [batch_stride, s_row, s_col]   # BR = 1: one batch stride
    classes, out_at, extra_lets = 1, None, []
    if node.op == "conv_input_grad" and g["SH"] * g["SW"] > 1:
        classes = g["SH"] * g["SW"]
        jy, jx, ny, nx = (-(-g["KH"] // g["SH"]), -(-g["KW"] // g["SW"]),
                          -(-g["H"] // g["SH"]), -(-g["W"] // g["SW"]))
        m_, n_, k_, nbatch = g["C"], ny * nx, g["O"] * jy * jx, g["N"] * classes
        ops = words(0, 0, 0) + words(0, 0, 0)
        fetch_a, gather_a, fetch_b, gather_b = "outer-scalar", _class_weights, "outer-scalar", _class_dout
        extra_lets = [f"    const cv_{w} = {v}u;" for w, v in (("CLS", classes), ("JY", jy), ("JX", jx), ("NX", nx))]
        extra_lets += [f"    {line}" for line in _CLASS_LETS]
        out_at = _class_out_at(g, classes, nx)
    elif node.op == "conv_input_grad":
        m_, n_, k_, nbatch = g["C"], spatial_in, g["O"] * taps, g["N"]
        ops = words(0, 0, 0) + words(g["O"] * spatial_out, 0, 0)
        fetch_a, gather_a, fetch_b, gather_b = "outer-scalar", _weights_by_channel, "outer-scalar", _dout_windows
    elif node.op == "conv_weight_grad":
        m_, n_, k_, nbatch = g["O"], g["C"] * taps, g["N"] * spatial_out, 1
        ops = words(0, 0, 0) + words(0, 0, 0)
        fetch_a, gather_a, fetch_b, gather_b = "k-scalar", _dout_rows, "k-scalar", _im2col_batch
    else:
        m_, n_, k_, nbatch = g["O"], spatial_out, g["C"] * taps, g["N"]
        ops = words(0, k_, 1) + words(g["C"] * spatial_in, 0, 0)
        fetch_a, gather_a = operand_fetch([0, k_, 1], m_, k_), None
        fetch_b, gather_b = "outer-scalar", _im2col_forward
    has_bias = node.op in ("conv1d", "conv2d") and len(node.inputs) == 3
    activation = node.attrs.get("activation", "none")
    epilogue = ["    v = v + add_in[row];"] * has_bias + ["    v = act(v);"] * (activation != "none")
    meta = [m_, n_, k_, nbatch, 0, nbatch] + ops
    lets = [f"    const cv_{w} = {g[w]}u;" for w in _CONV_WORDS] + extra_lets
    # bindings follow the node's inputs: B (x or dout) comes first in all three ops
    names = ["b_in", "a_in"] + (["add_in"] if has_bias else [])
    types = ["f32", "vec4<f32>" if fetch_a.endswith("vec4") else "f32"] + (["f32"] if has_bias else [])
    preset = _conv_variant(node.op, m_, n_, nbatch, k_, caps)
    tile_m, tile_n = _tile_of(preset)
    grid = (-(-n_ // tile_n), -(-m_ // tile_m), nbatch)
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: convolution grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension")
    common = dict(BR=1, OPERANDS=_render("matmul_operands.wgsl", ACTIVATION=ACTIVATION_EXPR[activation]),
                  EPILOGUE="\n".join(epilogue))
    if out_at is not None:
        common["OUT_AT"] = out_at
    scaled = _scaled_operands(graph, node, preset, node.inputs[1], node.inputs[0])   # A, B as bound
    return _tiled_kernel(f"conv:{node.op}", "conv", names, types, meta, grid, k_,
                         f"implicit GEMM {m_}x{n_}x{k_}{f' in {classes} classes of positions' if classes > 1 else ''}, "
                         f"{_tile_note(preset, scaled)}", common,
                         _tile_subs(preset, fetch_a, fetch_b, gather_a, gather_b, lets, (m_, n_, k_), scaled),
                         caps, extras=int(has_bias), fill=slice_fill(preset, math.prod(grid), caps.tuning))
