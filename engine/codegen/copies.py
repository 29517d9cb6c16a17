"""Data movement (transpose, broadcast, slice, pad, concat), embedding gathers and their scatter-add gradient, and rope.
"""

from __future__ import annotations

import numpy as np

from ..errors import DeviceError
from ..graph.ir import Graph, Node
from ..graph.ops import rope_inverse_frequencies
from .common import (MAX_WORKGROUPS, PLAIN, WG, Capabilities, Kernel, _finish, _template, _wgsl_type, stored_load,
                     broadcast_strides, contiguous_strides, f32_bits, grid_1d)
from .reduction import add_copies


# ---------------------------------------------------------------- copies

def _concat_rows(graph: Graph, node: Node) -> Kernel | None:
    """A concat of f32 pieces in vec4s (concat_rows.wgsl) where each piece's part of an
    output row is a multiple of 4 wide: along axis a, a row is everything from a on (its
    rows are the output's leading axes), so a concat along the first axis (a layer's q, k
    and v weights stacked, 12 us a step as a generic copy on the H100) is one row. None
    for any other copy."""
    operands = [graph[i] for i in node.inputs]
    if node.op != "concat" or not node.shape or node.dtype != "f32" or any(x.dtype != "f32" for x in operands):
        return None
    axis = node.attrs["axis"] % len(node.shape)
    widths = [int(np.prod(x.shape[axis:])) for x in operands]
    if any(w % 4 for w in widths):
        return None
    lines, end = [], 0
    for k, width in enumerate(w // 4 for w in widths):
        lines.append(f"    if (c < {end + width}u) {{ out[idx] = in{k}[row * {width}u + c - {end}u]; return; }}")
        end += width
    kernel = _finish("copy:concat", "copy", "concat_rows.wgsl", [f"in{k}" for k in range(len(operands))],
                     ["vec4<f32>"] * len(operands), "vec4<f32>", [node.size // 4], grid_1d(-(-node.size // (4 * WG))),
                     OUT4=end, PIECES="\n".join(lines))
    kernel.notes["variant"] = "vec4"
    return kernel


TRANSPOSE_TILE = 32   # transpose_tiles.wgsl's tile side


def _transpose_tiles(graph: Graph, node: Node) -> Kernel | None:
    """A transpose of the last two axes, both at least a tile long, through tiles of
    workgroup memory (transpose_tiles.wgsl); None for any other copy. Whisper's
    [8, 384, 1500] -> [8, 1500, 384] after its convolutions took 47 us as a generic copy
    on the H100 (780 GB/s)."""
    if node.op != "transpose" or len(node.shape) < 2:
        return None
    rank = len(node.shape)
    rows, cols = graph[node.inputs[0]].shape[-2:]
    batches = node.size // (rows * cols) if rows * cols else 0
    if (graph[node.inputs[0]].dtype != node.dtype
            or tuple(node.attrs["perm"]) != (*range(rank - 2), rank - 1, rank - 2) or min(rows, cols) < TRANSPOSE_TILE
            or not 0 < batches <= MAX_WORKGROUPS or -(-rows // TRANSPOSE_TILE) > MAX_WORKGROUPS
            or -(-cols // TRANSPOSE_TILE) > MAX_WORKGROUPS):
        return None
    t = _wgsl_type(node.dtype)
    kernel = _finish("copy:transpose", "copy", "transpose_tiles.wgsl", ["in0"], [t], t, [rows, cols],
                     (-(-cols // TRANSPOSE_TILE), -(-rows // TRANSPOSE_TILE), batches), T=t)
    kernel.notes["variant"] = f"{TRANSPOSE_TILE} x {TRANSPOSE_TILE} tiles"
    return kernel


def _copy(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """copy.wgsl, or a faster kernel for a concat or a transpose where one applies. An
    operand stored in bf16 (a weight, engine.optimize.bf16_weights) is read in words and
    widened into an f32 result: the stack of a prefill's k and v weights
    (engine.optimize.stacked_products) is one copy, not two widens and a copy."""
    special = _concat_rows(graph, node) or _transpose_tiles(graph, node)
    if special is not None:
        return special
    out = node.shape
    r = len(out)
    operands = [graph[i] for i in node.inputs]
    a = node.attrs
    pieces = []  # (start, len, base, strides) along `axis`
    axis = 0
    if node.op == "transpose":
        xs = contiguous_strides(operands[0].shape)
        pieces.append((0, out[0] if r else 1, 0, [xs[p] for p in a["perm"]]))
    elif node.op == "broadcast_to":
        pieces.append((0, out[0] if r else 1, 0, broadcast_strides(operands[0].shape, out)))
    elif node.op == "slice":
        axis = a["axis"] % r
        xs = contiguous_strides(operands[0].shape)
        pieces.append((0, out[axis], a["start"] * xs[axis], xs))
    elif node.op == "pad":
        axis = a["axis"] % r
        xs = contiguous_strides(operands[0].shape)
        pieces.append((a["before"], operands[0].shape[axis], 0, xs))
    elif node.op == "concat":
        axis = a["axis"] % r
        start = 0
        for x in operands:
            pieces.append((start, x.shape[axis], 0, contiguous_strides(x.shape)))
            start += x.shape[axis]
    if r == 0:  # a scalar: one element, one piece
        r, out, pieces = 1, (1,), [(0, 1, 0, [0])]
    meta = [node.size] + list(out)
    lines = []
    for k, (start, ln, base, strides) in enumerate(pieces):
        meta += [start, ln, base] + list(strides)
        value = stored_load(f"in{k}", f"piece_offset({k}u, idx)", operands[k].dtype)
        lines.append(f"    if (c >= {start}u && c < {start + ln}u) {{ out[idx] = {value}; return; }}")
    t = _wgsl_type(node.dtype)
    names = [f"in{k}" for k in range(len(operands))]
    return _finish(f"copy:{node.op}", "copy", "copy.wgsl", names,
                   [_wgsl_type(x.dtype) for x in operands], t, meta, grid_1d(-(-node.size // WG)),
                   RANK=r, AXIS=axis, PIECES="\n".join(lines), ZERO=f"{t}(0)")


def _embedding(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    table = graph[node.inputs[0]]
    meta = [node.size, table.shape[1], table.shape[0]]
    return _finish("gather:embedding", "gather", "embedding.wgsl", ["table", "ids"], [_wgsl_type(table.dtype), "i32"],
                   "f32", meta, grid_1d(-(-node.size // WG)), TABLE_AT=stored_load("table", "at", table.dtype))


def _widen(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """widen.wgsl: a bf16 weight as f32, for a kernel that reads f32 only (a prefill's tiled
    products), a word (two elements) a thread."""
    return _finish("copy:widen", "copy", "widen.wgsl", ["in0"], ["u32"], "f32", [node.size],
                   grid_1d(-(-node.size // (2 * WG))))


# ---------------------------------------------------------------- rope, conv, attention

def rope_frequencies(head_dim: int, base: float, scaling: tuple = ()) -> list[int]:
    """The inverse frequencies of RoPE over a head of ``head_dim`` (``scaling``:
    ``ops.rope_inverse_frequencies``), as meta words (rope_fn.wgsl)."""
    return [f32_bits(v) for v in rope_inverse_frequencies(head_dim, float(base), scaling)]


def _rope(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """rope.wgsl, four pairs a thread as vec4s where the head dim is a multiple of 8, else one."""
    b, t, w = node.shape
    a = node.attrs
    d = w // a["num_heads"]
    meta = [node.size, t, w, d, int(a["offset"]), int(bool(a.get("inverse", False)))]
    meta += rope_frequencies(d, a["base"], a["scaling"])
    pairs = 4 if d % 8 == 0 else 1
    vt = "vec4<f32>" if pairs == 4 else "f32"
    frequencies = f"{vt}({', '.join(f'mf({6 + i}u + j)' for i in range(pairs))})"
    names, types = ["x"], [vt]
    position = "row % seq + m(4u)"
    if len(node.inputs) == 2:  # at the positions a generation step is given
        names, types, position = names + ["positions"], types + ["i32"], "positions[row]"
    kernel = _finish("rope", "pointwise", "rope.wgsl", names, types, vt, meta,
                     grid_1d(-(-node.size // (2 * pairs * WG))), PAIRS=pairs, POSITION=position, FREQUENCIES=frequencies)
    kernel.notes["variant"] = f"{pairs} pair{'s' if pairs > 1 else ''} a thread" + (", vec4s" if pairs > 1 else "")
    return kernel


def _cache_write(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """Rows of each x (the first rotated where the op says ``rope_heads``) into its plane
    of the cache at their positions; the cache is the output binding (the op is in place:
    engine.compile.plan binds it once, read-write)."""
    xs = [graph[i] for i in node.inputs[1:-1]]
    b, t, w = xs[0].shape
    heads = node.attrs.get("rope_heads", 0)
    d = w // heads if heads else 0
    meta = [len(xs) * xs[0].size, t, node.shape[-2], w, d, xs[0].size, b * node.shape[-2] * w]
    meta += rope_frequencies(d, node.attrs["rope_base"], node.attrs["rope_scaling"]) if heads else []
    names = [f"x{p}" for p in range(len(xs))]
    values = ["rope_(x0[e - i + i % (d / 2u)], x0[e - i + i % (d / 2u) + d / 2u], i, d, u32(pos), 7u, false)"
              if heads and p == 0 else f"{name}[e]" for p, name in enumerate(names)]
    value = "    " + " else ".join(f"if (plane == {p}u) {{ v = {v}; }}" for p, v in enumerate(values[:-1]))
    value = (value + f" else {{ v = {values[-1]}; }}") if len(values) > 1 else f"    v = {values[0]};"
    return _finish("cache_write", "copy", "cache_write.wgsl", names + ["positions"], ["f32"] * len(xs) + ["i32"],
                   "f32", meta, grid_1d(-(-len(xs) * xs[0].size // WG)), VALUE=value,
                   ROPE_FN=_template("rope_fn.wgsl") if heads else "")


EMBEDDING_GRAD_ROWS = 16   # table rows a workgroup of the embedding gradient owns
EMBEDDING_GRAD_IDS = 256   # ids a part of the embedding gradient streams at least
EMBEDDING_GRAD_CHUNK = 256   # ids scatter.wgsl streams at a time where it skips chunks (else 64)
EMBEDDING_GRAD_COPIES = 32 * 2**20   # bytes the parts' copies of the table may take


def embedding_grad_parts(vocab: int, dim: int, rows: int) -> int:
    """How many parts the ids of an embedding gradient are cut into: as many as give each
    at least EMBEDDING_GRAD_IDS ids while their copies of the table fit
    EMBEDDING_GRAD_COPIES. A small table's grid is small (gpt-tiny's 257 x 384: 102
    workgroups), and each workgroup streamed all 2,048 ids of a batch: 220 us on the H100.
    A large vocabulary's table (49,152 x 576) fills the GPU and keeps one part."""
    return max(1, min(rows // EMBEDDING_GRAD_IDS, EMBEDDING_GRAD_COPIES // (4 * vocab * dim)))


def _embedding_grad(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """d table = scatter-add of dout's rows by id, on a (table rows / 16) x (columns / 64)
    x parts grid (scatter.wgsl): each workgroup streams its part's ids once instead of each
    table element walking them alone (a 49,152 x 576 table from 1,024 ids: 9.7 ms before on
    the H100). With several parts (``embedding_grad_parts``) each writes a copy of the table
    and ``sum_to_kernel`` adds them. Where a chunk of ids holds under one id of a
    workgroup's rows on average (a large vocabulary), a workgroup skips the chunks with
    none: a 49,152 x 576 table from 1,024 ids took 844 us, now 148 (f16 step; run 35)."""
    dout = graph[node.inputs[0]]
    vocab, dim = node.shape
    rows = dout.size // dim
    parts = embedding_grad_parts(vocab, dim, rows)
    skip = EMBEDDING_GRAD_CHUNK * EMBEDDING_GRAD_ROWS < vocab
    per = -(-rows // parts)
    grid = (-(-vocab // EMBEDDING_GRAD_ROWS), -(-dim // 64), parts)
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: embedding gradient grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension (a table of at most "
                          f"{MAX_WORKGROUPS * EMBEDDING_GRAD_ROWS} rows)")
    kernel = _finish("gather:embedding_grad", "gather", "scatter.wgsl", ["dout", "ids"], ["f32", "i32"],
                     "f32", [vocab, dim, rows, per], grid, ROWS=EMBEDDING_GRAD_ROWS, SKIP=str(skip).lower(),
                     CHUNK=EMBEDDING_GRAD_CHUNK if skip else 64)
    kernel.notes["variant"] = f"{EMBEDDING_GRAD_ROWS} table rows x 64 columns a workgroup"
    if parts > 1:
        add_copies(kernel, parts, vocab * dim, caps, "gather:embedding_grad:parts", f"ids in {parts} parts")
    return kernel
