"""The tiled-matmul archetype with a fused epilogue (bias, activation, residual): which
kernel a product takes (the simple one, the few-row vector kernel, the register-blocked
f32 tiles or the cooperative-matrix f16 tiles of matmul_coop.py), split-K, and the tiled
kernels' generated parts that the convolutions (implicit GEMM) share; tile_operands.py
fetches their operands.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..config import Knobs
from ..errors import DeviceError
from ..graph.ir import Graph, Node
from ..graph.ops import GRADIENT_OF, norm_matmuls_layout, product_weights
from .attention import combined_parts_prologue
from .common import (MAX_WORKGROUPS, PLAIN, TILE, WG, Capabilities, Kernel, UnsupportedOpError, _finish, _render,
                     _thread_xy, contiguous_strides, f32_bits, forward_nodes, grid_1d, stored_load, stored_load4,
                     stored_type)
from .matmul_coop import (COOP, COOP_FRAGMENT, CoopPreset, _coop_subs, _residual_init, coop_scratch_floats,
                          coop_workgroup_bytes)
from .product_sums import NO_SUMS, sums_binding, sums_finish, sums_fit, sums_subs
from .tile_operands import _fetch_operand, _store_tiled, operand_fetch
from .pointwise import ACTIVATION_EXPR, _expr
from .tuning import Tuning


# ---------------------------------------------------------------- matmul

SIMPLE_COLUMNS = 4   # adjacent outputs of a row a thread of the simple kernel (matmul.wgsl) computes: a vec4


def _fold_batch(out, a_shape, b_shape, extra_shapes):
    """(out, A, B, extras) shapes with the batch folded into the rows where that reads the
    same memory: A ([batch, m, k], not transposed) is then one [batch * m, k] matrix, B
    and every row-broadcast extra (a bias) are shared by all batches, and the other
    extras are [batch, m, n] like the output. One [1330, 384] output of 64-row tiles
    takes 21 row tiles where 5 batches of 266 rows took 25 (audio-align), and a folded
    batch counts as rows when choosing tiles and K splits. Anything else is unchanged."""
    batch, (m_, n_) = tuple(out[:-2]), out[-2:]
    pad = lambda shape: (1,) * (len(out) - len(shape)) + tuple(shape)
    rows = math.prod(batch) * m_
    unchanged = out, a_shape, b_shape, extra_shapes
    if not batch or math.prod(batch) == 1 or tuple(a_shape[:-2]) != batch:
        return unchanged
    if any(d != 1 for d in pad(b_shape)[:len(batch)]):
        return unchanged
    folded = []
    for shape in extra_shapes:
        p = pad(shape)
        if p[:-1] == (*batch, m_):
            folded.append((rows, p[-1]))
        elif all(d == 1 for d in p[:-1]):
            folded.append((1, p[-1]))
        else:
            return unchanged
    return (rows, n_), (rows, a_shape[-1]), pad(b_shape)[-2:], folded


def _product_shapes(graph: Graph, node: Node):
    """(output, A, B, extras) shapes of a product node as its kernel runs it, the batch folded
    into the rows where it can be (``_fold_batch``); a norm_matmul's inputs are x, w, b:
    A = x (prologue * w[k], epilogue * rsqrt(mean x^2 + eps)), B = b, no extras."""
    norm = node.op == "norm_matmul"
    a, b = graph[node.inputs[0]], graph[node.inputs[2 if norm else 1]]
    extra_shapes = [] if norm else [tuple(graph[i].shape) for i in node.inputs[2:]]
    shapes = node.shape, tuple(a.shape), tuple(b.shape), extra_shapes
    return shapes if norm or node.attrs.get("transpose_a", False) else _fold_batch(*shapes)


def _matmul(graph: Graph, node: Node, caps: Capabilities = PLAIN, sums: str = "",
            parts: tuple[int, int] | None = None, best: dict | None = None) -> Kernel | None:
    """The kernel of a product node; ``sums`` ("a" or "b", product_sums.py): it also adds
    up that operand's rows (columns), where its tiled kernel can (``Kernel.sums`` says);
    ``parts``: A comes as a split cached attention's parts (dispatch.product_combining);
    ``best``: each workgroup also leaves its best value for the argmax
    (dispatch.product_with_argmax); either None where the kernel cannot."""
    attrs = node.attrs
    ta, tb = attrs.get("transpose_a", False), attrs.get("transpose_b", False)
    norm = node.op == "norm_matmul"
    extras = [] if norm else node.inputs[2:]
    out, a_shape, b_shape, extra_shapes = _product_shapes(graph, node)
    batch = out[:-2]
    m_, n_ = out[-2:]
    k_ = a_shape[-2] if ta else a_shape[-1]
    br = len(batch)
    nbatch = math.prod(batch)
    eps = attrs.get("eps", 0.0) if norm else 0.0
    meta = [m_, n_, k_, nbatch, f32_bits(eps)] + list(batch)

    def op_words(shape, s_row_axis, s_col_axis):
        # batch strides (broadcast) + strides for logical (row, col)
        padded = (1,) * (br + 2 - len(shape)) + tuple(shape)
        strides = contiguous_strides(padded)
        bs = [0 if padded[d] == 1 and batch[d] != 1 else strides[d] for d in range(br)]
        return bs + [strides[br + s_row_axis] if padded[br + s_row_axis] != 1 else 0,
                     strides[br + s_col_axis] if padded[br + s_col_axis] != 1 else 0]

    # A is (m, k): stored [.., m, k] or [.., k, m] when transposed
    words_a = op_words(a_shape, 1, 0) if ta else op_words(a_shape, 0, 1)
    words_b = op_words(b_shape, 1, 0) if tb else op_words(b_shape, 0, 1)
    meta += words_a + words_b
    extra_words = [op_words(shape, 0, 1) for shape in extra_shapes]
    for words in extra_words:
        meta += words

    names, types = ["a_in", "b_in"], ["f32", "f32"]
    epi = []
    residual = None
    prologue = row_setup = ""
    act = "x"
    if norm:
        names, types = ["a_in", "w_in", "b_in"], ["f32"] * 3
        prologue = " * w_in[ka]"
        row_setup = "\n".join(["    var ss = 0.0;",
                               "    for (var k = 0u; k < K; k = k + 1u) {",
                               "        let xv = a_in[a0 + row * sam + k * sak];",
                               "        ss = ss + xv * xv;",
                               "    }",
                               "    let inv_rms = inverseSqrt(ss / f32(K) + mf(4u));"])
        epi += ["    v = v * inv_rms;"]
    else:
        act = ACTIVATION_EXPR[attrs.get("activation", "none")]
        j = 2
        for role in ("add", "residual"):
            if not attrs.get("has_" + role, False):
                continue
            nm = f"{role}_in"
            names.append(nm)
            types.append("f32")
            line = f"    v = v + {nm}[boff(b, {j}u) + row * srow({j}u) + col * scol({j}u)];"
            if role == "residual":
                residual = (line, extra_words[j - 2], j)
            if role == "add":
                epi.append(line)
                epi.append("    v = act(v);")
            else:
                if not attrs.get("has_add", False):
                    epi.append("    v = act(v);")
                epi.append(line)
            j += 1
        if not epi:
            epi.append("    v = act(v);")
        if attrs.get("gradient_of", "none") != "none":   # engine.optimize.activation_grad
            op, op_attrs = GRADIENT_OF[attrs["gradient_of"]]
            names.append("grad_in")
            types.append("f32")
            at = f"grad_in[boff(b, {j}u) + row * srow({j}u) + col * scol({j}u)]"
            epi.append(f"    v = {_expr(op, ['v', at], op_attrs, [])};")
    common = dict(BR=br, OPERANDS=_render("matmul_operands.wgsl", ACTIVATION=act), EPILOGUE="\n".join(epi))
    if vector_rows(m_, ta, caps):
        vector = dict(common, EPILOGUE="") if norm else common   # the vector kernel sums the norm's squares itself
        return _vector_kernel(graph, node, names, types, meta, m_, n_, max(nbatch, 1), words_b, vector, norm=norm,
                              caps=caps, parts=parts, best=best)
    if parts is not None or best is not None:
        return None
    variant = "simple" if norm else matmul_variant(m_, n_, max(nbatch, 1), k_, ta, caps)
    tile_m, tile_n = _tile_of(variant)
    gx, gy = -(-n_ // tile_n), -(-m_ // tile_m)
    if max(gx, gy, nbatch) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: matmul grid {gx} x {gy} x {nbatch} exceeds "
                          f"{MAX_WORKGROUPS} workgroups per dimension")
    stored_b = graph[node.inputs[names.index("b_in")]].dtype   # a bf16 weight is widened as it is read
    if variant == "simple":
        types[names.index("b_in")], load_b = _simple_load_b(words_b, n_, k_, stored_b)
        k = _finish(f"matmul:{node.op}", "matmul", "matmul.wgsl", names, types, "f32", meta,
                    (gx, gy, max(nbatch, 1)), A_PROLOGUE=prologue, ROW_SETUP=row_setup, LOAD_B=load_b, **common)
        k.notes["variant"] = f"{TILE}x{SIMPLE_COLUMNS * TILE} tile, {SIMPLE_COLUMNS} columns a thread"
        return k
    # outer axis first: A's is m, B's is n
    fetch_a = operand_fetch(words_a, m_, k_)
    fetch_b = operand_fetch(words_b[:-2] + [words_b[-1], words_b[-2]], n_, k_)
    types[0] = "vec4<f32>" if fetch_a.endswith("vec4") else "f32"
    types[1] = stored_type("vec4<f32>" if fetch_b.endswith("vec4") else "f32", stored_b)
    scaled = _scaled_operands(graph, node, variant, node.inputs[0], node.inputs[1])
    note = f"{_tile_note(variant, scaled)}, A {fetch_a}, B {fetch_b}"
    subs = _tile_subs(variant, fetch_a, fetch_b, mnk=(m_, n_, k_), scaled=scaled, stored_b=stored_b)
    if residual is not None:
        line, words, operand = residual
        if variant in COOP and act == "x" and br == 0 and words == [n_, 1] and not any(scaled):
            subs["RESIDUAL_INIT"] = _residual_init(variant, line, operand)
    # A cooperative tile's epilogue runs in turns over its subgroups' results (CoopPreset.scratch):
    # an activation's gradient there (erfc and a load an element) made whisper-tiny's f16
    # step 0.8 ms slower than the same in a second dispatch, which runs at the bandwidth.
    apart = variant in COOP and attrs.get("gradient_of", "none") != "none"
    adds = _sums_plan(sums, variant, fetch_a, fetch_b, m_, n_) if nbatch <= 1 and not norm else None
    return _tiled_kernel(f"matmul:{node.op}", "matmul", names, types, meta, (gx, gy, max(nbatch, 1)), k_, note,
                         common, subs, caps, extras=len(extras), epilogue_apart=apart, sums=adds,
                         fill=slice_fill(variant, gx * gy * max(nbatch, 1), caps.tuning))


def _simple_load_b(words_b, n_: int, k_: int, stored: str = "f32") -> tuple[str, str]:
    """(B's binding type, matmul.wgsl's load of B's four columns at (kb, col0)): one vec4
    where B's columns are contiguous and aligned, else four checked loads; B ``stored`` in
    bf16 is read in words and widened."""
    if operand_fetch(words_b[:-2] + [words_b[-1], words_b[-2]], n_, k_) == "outer-vec4":
        return (stored_type("vec4<f32>", stored),
                f"            bv = {stored_load4('b_in', '(b0 + kb * sbk + col0) / 4u', stored)};")
    value = stored_load("b_in", "b0 + kb * sbk + (col0 + j) * sbn", stored)
    return stored_type("f32", stored), ("            for (var j = 0u; j < 4u && col0 + j < N; j = j + 1u) "
                                        f"{{ bv[j] = {value}; }}")


def _sums_plan(sums: str, variant: str, fetch_a: str, fetch_b: str, m_: int, n_: int) -> dict | None:
    """What ``sums_subs`` needs to add up operand ``sums`` in ``variant``'s kernel, or
    None where it cannot (``sums_fit``, or a reduction scratch too small)."""
    if not sums:
        return None
    (bm, bn), coop, preset = _tile_of(variant), variant in COOP, _preset(variant)
    bk, threads = preset.bk, preset.threads
    tile, fetch, extent = (bm, fetch_a, m_) if sums == "a" else (bn, fetch_b, n_)
    scratch = coop_scratch_floats(variant) if coop else 4 * 2 * bk * (tile // 4 + 1)   # floats of Cs, or of As / Bs
    if not sums_fit(sums, fetch, tile, threads, extent) or scratch < 4 * threads:   # 4 floats a thread
        return None
    count = tile * bk // threads // 4
    return dict(operand=sums, registers=[f"{sums}r{i}" for i in range(count)], tile=tile, threads=threads,
                scratch="f32" if coop else "vec4")


VECTOR_ROWS = 8        # outputs of at most this many rows take the vector kernel
VECTOR_THREADS = 256
VECTOR_UNROLL = 8      # K steps a thread loads at once (16 measured the same on the H100)
VECTOR_UNROLL_BF16 = 16   # ... B in bf16, half the bytes a load (run 51: SmolLM2 598 -> 655 tokens/s with 16, 32 worse)
VECTOR_COLUMNS = 8     # output columns of a workgroup where B is stored transposed (lanes along K)
VECTOR_WIDE_COLUMNS = 32   # ... and where B's columns are contiguous: a warp reads 128 bytes of a row
VECTOR_MIN_SLICE = 256     # K a slice of a split vector product keeps at least
VECTOR_WIDTH_BF16 = 4      # consecutive columns a thread of a one-row product whose Bs are bf16 reads at once
VECTOR_UNROLL_WIDE = 8     # ... and the K steps it loads at once (run 53: 16 lost 2%)
VECTOR_DEPTH = 4           # consecutive K steps a thread of a one-row product loads at once from a transposed weight
VECTOR_UNROLL_DEEP = 8     # ... and the loads it keeps in flight


def vector_rows(m_: int, transpose_a: bool, caps: Capabilities) -> bool:
    """Whether an output of ``m_`` rows (batch folded in) takes matmul_vector.wgsl: a
    generation step's one token would waste all but one row of every tile of the tiled
    kernels (and split K in a second dispatch to fill the GPU). Not for a transposed A
    (weight gradients), nor where ``MEGANEURA_MATMUL`` forces a kernel."""
    return m_ <= VECTOR_ROWS and not transpose_a and caps.knobs.matmul == "auto"


def product_reads_bf16(node: Node, index: int) -> bool:
    """Whether product ``node``'s kernel reads its operand ``index`` stored as bf16: its
    weight (B, SwiGLU's two, norm_matmuls' several), which every product kernel (the
    few-row vector kernel, the simple, tiled and cooperative ones) widens as it loads it.
    Those reads are nearly all of a decode step's bytes; a prefill's tiled products read
    the weights through a widen into an f32 buffer until run 52 (2.7 ms of Llama-3.2-1B's
    512-token prefill on the H100)."""
    return index in product_weights(node.op, len(node.inputs))


def vector_width(rows: int, stored: list[str], columns_contiguous: bool, extents: list[int], small: bool) -> int:
    """Consecutive columns a thread of the vector kernel takes: VECTOR_WIDTH_BF16 where
    every B is stored in bf16 with its columns contiguous and there is one row, each as two
    words (``stored_load4``), else 1. ``extents``: the Bs' column counts and row strides
    (and norm_matmuls' places in its packed result), which must be whole vec4s of columns.
    Not for a ``small`` B (``vector_small``), whose workgroups would be a quarter as many.
    Run 53: a decode step read its bf16 weights at 0.7-1.8 TB/s, each thread loading the word
    of one element."""
    whole = all(e % VECTOR_WIDTH_BF16 == 0 for e in extents)
    wide = rows == 1 and columns_contiguous and whole and set(stored) == {"bf16"} and not small
    return VECTOR_WIDTH_BF16 if wide else 1


def vector_depth(weights: bool, columns_contiguous: bool, k_: int, nbatch: int) -> int:
    """Consecutive K steps a thread of the vector kernel loads at once: VECTOR_DEPTH where
    its Bs are ``weights`` (parameters: bindings of their own, so aligned) stored transposed,
    K contiguous (a weight kept [out, in], as checkpoints store it: engine.optimize.bf16_weights),
    one batch, K whole fours; else 1. A warp then reads 256 contiguous bytes of a bf16
    column (512 of an f32 one) a load, where one element a thread read 64 (two threads a word)."""
    deep = weights and not columns_contiguous and k_ % VECTOR_DEPTH == 0 and nbatch == 1
    return VECTOR_DEPTH if deep else 1


def deep_width(depth: int, extents: list[int], caps: Capabilities) -> int:
    """Columns a thread of a vector product reading ``depth`` K steps a load takes:
    ``tuning.vector_deep_columns`` where ``extents``, its Bs' column counts and places, are
    whole multiples of it, else 1. They share each load of A (and of the norm's weight),
    which otherwise costs the L1 as many trips as the weight's own load."""
    columns = caps.tuning.vector_deep_columns
    return columns if depth > 1 and columns in (2, 4) and all(e % columns == 0 for e in extents) else 1


def vector_small(n_: int, k_: int, caps: Capabilities) -> bool:
    """Whether a B of k x n is under ``tuning.vector_small_kib`` (counted in f32): ``vector_layout``."""
    return n_ * k_ * 4 < caps.tuning.vector_small_kib * 1024


def vector_layout(n_: int, k_: int, nbatch: int, caps: Capabilities, columns_contiguous: bool,
                  splittable: bool, width: int = 1, depth: int = 1) -> tuple[int, int]:
    """(columns a workgroup, K slices) of a vector product with ``n_`` columns, reduction
    ``k_`` and ``nbatch`` batches (a B each). A large B whose columns are
    contiguous takes 32 columns, so that a warp reads 128 bytes of a row, else 8 (lanes
    along K where B is stored transposed). Where its workgroups are fewer than a wave of
    matmul ones (``tuning.matmul_resident``), K is split into as many slices as make two
    (a vector workgroup is half a 64 x 64 one), each at least ``VECTOR_MIN_SLICE`` long.
    ``knobs.matmul_splits`` forces a count. A B under ``tuning.vector_small_kib`` keeps 8
    columns and all of K: there the dispatch is the cost, and a second one costs more.
    Run 50, Llama-3.2-1B's decode on the H100: its 2048 x 8192 SwiGLU weights read at 1.0
    TB/s in workgroups of 8 columns (a warp's loads 32 bytes of 4 rows), its 8192 x 2048 down
    projection in 32 columns only when split (64 workgroups whole); 270 -> 357 tokens/s.
    SmolLM2-135M's weights (3.5 MB each) split this way decoded at 558 instead of 646.
    ``width``: columns a thread (``vector_width``): a workgroup takes ``cols`` x width.
    ``depth``: K steps a thread loads at once (``vector_depth``, a transposed weight): each
    warp then streams whole columns, and half a wave of matmul workgroups fills the GPU."""
    small = vector_small(n_, k_, caps)
    cols = VECTOR_WIDE_COLUMNS if columns_contiguous and not small else VECTOR_COLUMNS
    blocks, most = -(-n_ // (cols * width)) * nbatch, max(1, k_ // VECTOR_MIN_SLICE)
    if not splittable:
        return cols, 1
    if caps.knobs.matmul_splits:
        return cols, min(caps.knobs.matmul_splits, most)
    fill = 2 * caps.tuning.matmul_resident if depth == 1 else caps.tuning.matmul_resident // 2
    if small or 2 * blocks >= fill:
        return cols, 1
    return cols, min(-(-fill // blocks), most, MATMUL_MAX_SPLITS)


_ONE_B = dict(COLUMNS="    let N = m(1u);\n    let wsel = 0u;\n    let wx = wg.x;", OUT_AT="(b * M + row) * N + col")


def _vector_kernel(graph: Graph, node: Node, names, types, meta, m_: int, n_: int, nbatch: int, words_b,
                   common: dict, norm: bool = False, second: bool = False, columns: dict = _ONE_B,
                   workgroups: int = 0, caps: Capabilities = PLAIN,
                   parts: tuple[int, int] | None = None, best: dict | None = None) -> Kernel | None:
    """matmul_vector.wgsl for ``m_`` rows: 256 threads as columns x K slices, lanes
    along B's contiguous axis: 32 columns x 8 slices where its columns are contiguous
    (a warp reads 128 bytes of a row), 8 x 32 where K is (B stored transposed). Where
    those workgroups are too few to fill the GPU, K is split (``vector_layout``) and
    matmul_splits.wgsl adds the slices and applies the epilogue; one batch where the
    kernel also sums a norm or a second B (norm_matmuls: one row). ``norm``:
    A is RMS-normalised (weight ``w_in``, eps in meta word 4), the norm applied to the
    sums before ``common``'s epilogue; ``second``: a second B ``u_in`` (operand 2)
    accumulates into ``v2`` beside ``v``; ``columns``: the template's COLUMNS and OUT_AT
    and which B (``_ONE_B``, or norm_matmuls' several Bs over ``workgroups`` workgroups,
    its LAYOUT (with its ``vector_width``), its WEIGHTS and where its parts are, INSIDE). A B
    stored in bf16 (engine.optimize.bf16_weights) is widened as it is loaded, four columns a
    thread where ``vector_width`` says. ``parts`` (count, head dim): A is a split cached
    attention's parts, combined into workgroup memory first (``combined_parts_prologue``); None where
    the kernel cannot (one row of a transposed weight, read ``depth`` K steps a load, only, whose
    A fits the adapter's workgroup memory beside the partial sums: 8 KiB for Llama-3.2-1B's 2048).
    ``best`` (reduction.argmax_partials_slots): a row of one B, K whole, whose workgroups each
    leave their columns' best value for the argmax; None where the product is not that."""
    columns_contiguous = words_b[-1] == 1
    one_b = columns is _ONE_B
    stored = {name: graph[i].dtype for name, i in zip(names, node.inputs)}
    weights = columns.get("WEIGHTS", ["b_in"])   # B, or norm_matmuls' Bs (wsel picks one)
    k_ = meta[2]
    if one_b:
        bs = ["b_in"] + (["u_in"] if second else [])
        width = vector_width(m_ * nbatch, [stored[b] for b in bs],
                             columns_contiguous, [n_, words_b[-2]], vector_small(n_, k_, caps))
        depth = vector_depth(all(graph[node.inputs[names.index(b)]].op == "parameter" for b in bs),
                             columns_contiguous, k_, nbatch)
        width = deep_width(depth, [n_], caps) if depth > 1 else width
        cols, splits = vector_layout(n_, k_, nbatch, caps, columns_contiguous, nbatch == 1 or not (norm or second),
                                     width, depth)
    else:
        cols, splits, width, depth = columns["LAYOUT"]
    four = max(width, depth)   # elements a load: two bf16 words, or an f32 vec4 (depth only)
    held = {"bf16": "vec2<u32>" if four > 1 else "u32", "f32": "vec4<f32>" if depth > 1 else "f32"}
    types = [held[stored[name]] if name in weights + ["u_in"] else t for name, t in zip(names, types)]
    a_words = meta[5 + common["BR"]:7 + 2 * common["BR"]]   # A's batch strides, then its (row, k) strides
    a_vec4 = depth > 1 and a_words[-1] == 1 and all(w % depth == 0 for w in a_words[:-1])
    if a_vec4:   # A (and the norm's weight) a vec4 a load too: four scalar loads cost the L1 four times the trips
        types = ["vec4<f32>" if name in ("a_in", "w_in") else t for name, t in zip(names, types)]
    if parts is not None:
        staged = 4 * k_ + 4 * m_ * VECTOR_THREADS * width   # A's values beside the slices' partial sums
        if not (one_b and depth > 1 and m_ * nbatch == 1 and not norm and staged <= caps.workgroup_storage):
            return None
        types = ["f32" if name == "a_in" else t for name, t in zip(names, types)]

    def load_of(binding: str):
        if four > 1:
            return lambda at: stored_load4(binding, f"({at}) / 4u", stored.get(binding, "f32"))
        return lambda at: stored_load(binding, at, stored.get(binding, "f32"))
    loads = [{"b": load_of(b), "u": load_of("u_in")} for b in weights]
    slices = VECTOR_THREADS // cols
    blocks = workgroups or -(-n_ // (cols * width))
    span = -(-k_ // splits)
    span = -(-span // (slices * depth)) * slices * depth   # whole steps of the slices a slice, none of them empty
    splits = -(-k_ // span)
    grid = (blocks, splits, nbatch)
    if best is not None and not (one_b and m_ * nbatch == 1 and splits == 1 and parts is None):
        return None
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: matmul grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension")
    meta = [*meta, splits, span]
    unroll = (VECTOR_UNROLL_DEEP if depth > 1 else VECTOR_UNROLL_WIDE if width > 1
              else VECTOR_UNROLL_BF16 if "bf16" in stored.values() else VECTOR_UNROLL)
    extra = _vector_extras(m_, slices, norm, second, width)
    if parts is not None:
        decl, setup = combined_parts_prologue(k_, *parts, VECTOR_THREADS)
        extra = dict(extra, EXTRA_DECL=extra["EXTRA_DECL"] + "\n" + decl,
                     EXTRA_SETUP=setup + "\n" + extra["EXTRA_SETUP"])
    best = best or {"DECL": "", "AFTER_OUT": "", "AFTER_LOOP": ""}
    extra = dict(extra, EXTRA_DECL=extra["EXTRA_DECL"] + "\n" + best["DECL"], AFTER_OUT=best["AFTER_OUT"],
                 AFTER_LOOP=best["AFTER_LOOP"])
    norm_epilogue = extra.pop("NORM_EPILOGUE")
    first, out_at = dict(common, EPILOGUE=norm_epilogue + common["EPILOGUE"]), columns["OUT_AT"]
    if splits > 1:   # raw sums, slice after slice; the epilogue's operands are the finish's
        first = dict(common, EPILOGUE=_split_stores(second, norm, len(meta) - 2),
                     OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x"))
        out_at = f"wg.y * M * m(1u) * m(3u) + {out_at}"
    k = _finish(f"matmul:{node.op}", "matmul", "matmul_vector.wgsl", names, types, "f32", meta, grid,
                ROWS=m_, COLS=cols, SLICES=slices, THREADS=VECTOR_THREADS, PARTIAL=m_ * VECTOR_THREADS,
                WIDTH=width, DEPTH=depth,
                COL_OF="t % COLS" if columns_contiguous else "t / SLICES",
                SLICE_OF="t / COLS" if columns_contiguous else "t % SLICES", UNROLL=unroll, SPAN_WORD=len(meta) - 1,
                ACCUMULATE=_vector_steps(m_, ["ka"], norm, second, loads, depth, a_vec4, width, parts is not None),
                ACCUMULATE_UNROLLED=_vector_steps(m_, [f"(ka + {u}u * SLICES)" for u in range(unroll)], norm, second,
                                                  loads, depth, a_vec4, width, parts is not None),
                COLUMNS=columns["COLUMNS"], OUT_AT=out_at, **extra, **first)
    k.notes["variant"] = f"{m_}-row vector kernel, {cols * width} columns x {slices} K slices" + (
        f", {width} columns a thread" if width > 1 else "") + (f", {depth} K steps a load" if depth > 1 else "") + (
        f", A combined from {parts[0]} attention parts" if parts else "")
    if splits > 1:
        _split_finish(k, names, meta, m_ * n_ * nbatch, splits, common, norm_epilogue, second, norm,
                      operands=[n for n in names if n not in ("a_in", "u_in", "w_in", *weights)],
                      inside=columns.get("INSIDE", ""))
    return k


def _split_stores(second: bool, norm: bool, splits_word: int) -> str:
    """What a slice of a split vector product writes in its epilogue's place, besides its
    raw sums ``v`` (OUT_AT): its second sums after all the slices' first, then its sums
    of squares (a row's, from column 0's threads). ``m(1u)``: all the columns (norm_matmuls'
    N is one weight's)."""
    total = "M * m(1u) * m(3u)"
    lines = []
    if second:
        lines.append(f"        out[(m({splits_word}u) + wg.y) * {total} + (b * M + row) * N + col] = v2;")
    if norm:
        at = f"{1 + second}u * m({splits_word}u) * {total} + wg.y * M + row"
        lines.append(f"        if (col == 0u) {{ out[{at}] = ss; }}")
    return "\n".join(lines)


def _split_finish(k: Kernel, names, meta, total: int, splits: int, common: dict, norm_epilogue: str,
                  second: bool, norm: bool, operands: list[str], inside: str = "") -> None:
    """The second dispatch of a split vector product (matmul_splits.wgsl): the slices'
    sums added, their second sums and sums of squares where it has them, then the
    norm and ``common``'s epilogue; bound to the partials and the epilogue's ``operands``.
    ``inside``: where the result's elements are (norm_matmuls' parts, between which its
    packed result has gaps that no slice writes): the rest are written 0."""
    extras = [names.index(name) for name in operands]
    sums = ["    let K = m(2u);"] + ([f"    if (!({inside})) {{ v = 0.0; }}"] if inside else [])
    if second:
        sums += ["    var v2 = 0.0;",
                 "    for (var p = 0u; p < splits; p = p + 1u) { v2 = v2 + partials[(splits + p) * total + i]; }"]
    if norm:
        sums += ["    var ss = 0.0;",
                 f"    for (var p = 0u; p < splits; p = p + 1u) {{ ss = ss + partials[{1 + second}u * splits * total "
                 "+ p * M + row]; }"]
    k.partials = splits * total * (1 + second) + (splits * meta[0] if norm else 0)
    k.finish = _finish(f"{k.name}:splits", "matmul", "matmul_splits.wgsl", ["partials", *(names[i] for i in extras)],
                       ["f32"] * (1 + len(extras)), "f32", meta, grid_1d(-(-total // WG)),
                       SPLITS_WORD=len(meta) - 2, SPLIT_SUMS="\n".join(sums), SUMS_FINISH="", SUMS_BINDING="",
                       **dict(common, EPILOGUE=norm_epilogue + common["EPILOGUE"]))
    k.finish.guarded = True
    k.finish_operands = tuple(extras)
    k.notes["variant"] += f", K split {splits} ways"


def _vector_steps(rows: int, ks: list[str], norm: bool, second: bool, loads: list[dict], depth: int = 1,
                  a_vec4: bool = False, width: int = 1, staged: bool = False) -> str:
    """The vector kernel's loads and sums for K steps ``ks``: their loads first, all
    independent, then the sums (each A value once, squared too for a norm). ``loads``:
    B's and the second B's load of an element, as functions of its index; with several Bs
    (norm_matmuls), the steps of each in a case of a switch on ``wsel``, so that each
    case's loads are straight-line reads of one binding. ``depth`` > 1: each of ``ks``
    counts ``depth`` K steps, their A values a vec4 (one load where ``a_vec4``: A's and
    the norm weight's bindings are vec4s) and their products a dot, for each of ``width``
    columns (B transposed: a load each) into the lanes of a vector sum. ``staged``: A's
    values a vec4 of workgroup memory (``combined_parts_prologue``)."""
    if len(loads) > 1:
        cases = [f"case {i}u: {{\n" if i else "default: {\n" for i in range(len(loads))]
        body = [case + _vector_steps(rows, ks, norm, second, [load], depth, a_vec4, width) + "\n            }"
                for case, load in zip(cases, loads)]
        switch = "\n            ".join(["switch wsel {", *body[1:], body[0], "}"])   # default last
        return "            " + switch
    load_b, load_u = loads[0]["b"], loads[0]["u"]

    def gather(at) -> str:   # the A (or norm weight) values of a step: one, or depth in a vec4
        if depth == 1:
            return at("")
        return "vec4<f32>(" + ", ".join(at(f" + {i}u") for i in range(depth)) + ")"
    lanes = width if depth > 1 else 1   # columns loaded one by one (B transposed), each a lane of the sums

    def times(x, y) -> str:
        if depth == 1:
            return f"{x} * {y}"
        if lanes == 1:
            return f"dot({x}, {y})"
        return f"vec{lanes}<f32>(" + ", ".join(f"dot({x}, {y}_{j})" for j in range(lanes)) + ")"
    lines = []
    for u, k in enumerate(ks):
        kk = k if depth == 1 else f"{k} * {depth}u"
        for j in range(lanes):
            at = "col_b" if lanes == 1 else f"(col_b + {j}u)"
            name = "" if lanes == 1 else f"_{j}"
            lines.append(f"let bv{u}{name} = {load_b(f'b0 + {kk} * sbk + {at} * sbn')};")
            if second:
                lines.append(f"let uv{u}{name} = {load_u(f'u0 + {kk} * suk + {at} * sun')};")
        for r in range(rows):
            a = f"a_sh[{k}]" if staged else f"a_in[(a0 + {r}u * sam) / 4u + {k}]" if a_vec4 else gather(
                lambda i: f"a_in[a0 + {r}u * sam + ({kk}{i}) * sak]")
            lines.append(f"let a{r}_{u} = {a};")
        if norm:
            lines.append(f"let w{u} = " + (f"w_in[{k}]" if a_vec4 else gather(lambda i: f"w_in[{kk}{i}]")) + ";")
    for r in range(rows):
        xs = [f"a{r}_{u} * w{u}" if norm else f"a{r}_{u}" for u in range(len(ks))]
        lines.append(f"acc[{r}u] = acc[{r}u] + " + " + ".join(times(x, f"bv{u}") for u, x in enumerate(xs)) + ";")
        if second:
            lines.append(f"acc2[{r}u] = acc2[{r}u] + " + " + ".join(times(x, f"uv{u}") for u, x in enumerate(xs)) + ";")
        if norm:
            square = (lambda x: f"{x} * {x}") if depth == 1 else (lambda x: f"dot({x}, {x})")
            lines.append(f"ssq[{r}u] = ssq[{r}u] + " + " + ".join(square(f"a{r}_{u}") for u in range(len(ks))) + ";")
    return "\n".join("            " + line for line in lines)


def _vector_extras(rows: int, slices: int, norm: bool, second: bool, width: int = 1) -> dict[str, str]:
    """The EXTRA slots of matmul_vector.wgsl, the type of its sums (ACC) and how a column's
    is picked from them (LANE), and the norm's epilogue lines."""
    decl, setup, store, total, epilogue = [], [], [], [], []
    acc, lane = (f"vec{width}<f32>", "[lane]") if width > 1 else ("f32", "")
    if second:
        decl.append(f"var<workgroup> part2: array<{acc}, {rows * VECTOR_THREADS}>;")
        setup += ["let u0 = boff(b, 2u);", "let suk = srow(2u);", "let sun = scol(2u);", f"var acc2: array<{acc}, ROWS>;"]
        store.append("for (var r = 0u; r < ROWS; r = r + 1u) { part2[(r * COLS + c) * SLICES + s] = acc2[r]; }")
        total += ["    var v2 = 0.0;", f"    for (var j = 0u; j < SLICES; j = j + 1u) {{ v2 = v2 + part2[pi + j]{lane}; }}"]
    if norm:   # each column's SLICES threads see all of K once: column 0's sums of squares suffice
        decl.append(f"var<workgroup> part_ss: array<f32, {rows * slices}>;")
        setup.append("var ssq: array<f32, ROWS>;")
        store.append("if (c == 0u) { for (var r = 0u; r < ROWS; r = r + 1u) { part_ss[r * SLICES + s] = ssq[r]; } }")
        total += ["    var ss = 0.0;", "    for (var j = 0u; j < SLICES; j = j + 1u) { ss = ss + part_ss[row * SLICES + j]; }"]
        epilogue += ["        let norm = inverseSqrt(ss / f32(K) + mf(4u));", "        v = v * norm;"]
        if second:
            epilogue.append("        v2 = v2 * norm;")
    indent = lambda lines, n: "\n".join(" " * n + line for line in lines)  # noqa: E731
    return {"EXTRA_DECL": "\n".join(decl), "EXTRA_SETUP": indent(setup, 4), "EXTRA_STORE": indent(store, 4),
            "EXTRA_SUM": indent(total, 4), "ACC": acc, "LANE": lane,
            "NORM_EPILOGUE": "\n".join(epilogue) + ("\n" if epilogue else "")}


SWIGLU_ROWS = 4   # two accumulators' partial sums must fit 16 KiB of workgroup memory


def _swiglu_matmul(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """silu(x @ w_gate) * (x @ w_up) (x rms-normalised first by a 4th operand where given) on
    the vector kernel with a second accumulator: a decode step's MLP half in one dispatch
    where it took four (the norm, two matmuls, their product)."""
    x, w_gate, w_up = (graph[i] for i in node.inputs[:3])
    norm = len(node.inputs) == 4
    tb = node.attrs["transpose_b"]
    rows, k_ = math.prod(x.shape[:-1]), x.shape[-1]
    n_ = node.shape[-1]
    if rows > SWIGLU_ROWS:
        raise UnsupportedOpError(f"{graph.format_node(node)}: swiglu_matmul runs on the few-row kernel only "
                                 f"({rows} rows, at most {SWIGLU_ROWS})")
    weight_words = [1, k_] if tb else [n_, 1]        # strides of (k, n)
    meta = [rows, n_, k_, 1, f32_bits(node.attrs["eps"] if norm else 0.0)] + [k_, 1] + weight_words * 2
    names = ["a_in", "b_in", "u_in"] + (["w_in"] if norm else [])
    common = dict(BR=0, OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x"),
                  EPILOGUE="        v = v * sigmoid_(v) * v2;")
    return _vector_kernel(graph, node, names, ["f32"] * len(names), meta, rows, n_, 1, weight_words, common,
                          norm=norm, second=True, caps=caps)


def _norm_matmuls(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """rms_norm(x) @ w_i for each weight in one dispatch of the vector kernel, each product
    into its place in the packed result (norm_matmuls_layout): a decode step's q, k and v
    projections, which were three dispatches each taking the norm again. Workgroup x
    belongs to one weight (the first ceil(N_0 / COLS) to w_0, and so on), so a
    workgroup's loads all come from one binding. Columns and K slices as one product of
    all the columns (``vector_layout``; K split for one row only). Run 51, Llama-3.2-1B's
    decode with bf16 weights: 8 columns and K whole read its q, k and v at 0.3 TB/s (96
    workgroups of 32 columns would not fill the GPU either); split, 443 -> 497 tokens/s."""
    x, _, *weights = (graph[i] for i in node.inputs)
    tb = node.attrs["transpose_b"]
    rows, k_ = math.prod(x.shape[:-1]), x.shape[-1]
    if not vector_rows(rows, False, caps):
        raise UnsupportedOpError(f"{graph.format_node(node)}: norm_matmuls runs on the few-row kernel only "
                                 f"({rows} rows, at most {VECTOR_ROWS}, and no MEGANEURA_MATMUL forced)")
    shapes, offsets, _ = norm_matmuls_layout(x.shape, [w.shape for w in weights], tb)
    widths = [shape[-1] for shape in shapes]
    width = vector_width(rows, [w.dtype for w in weights], not tb, widths + list(offsets),
                         vector_small(sum(widths), k_, caps))
    depth = vector_depth(all(w.op == "parameter" for w in weights), not tb, k_, 1)
    width = deep_width(depth, widths + list(offsets), caps) if depth > 1 else width
    cols, splits = vector_layout(sum(widths), k_, 1, caps, not tb, rows == 1, width, depth)
    blocks = [-(-n // (cols * width)) for n in widths]
    words = [[1, k_] if tb else [n, 1] for n in widths]    # each weight's strides of (k, n)
    # N (meta word 1): the packed result's elements a row, the gaps between its parts included
    # (what a split's finish covers)
    meta = [rows, node.size // rows, k_, 1, f32_bits(node.attrs["eps"]), k_, 1] + [w for pair in words for w in pair]
    bs = ["b_in"] + [f"b{i}_in" for i in range(1, len(weights))]
    select = ["    var wsel = 0u;", "    var wx = wg.x;", f"    var N = {widths[0]}u;", "    var out0 = 0u;"]
    select += [f"    if (wsel == {i - 1}u && wx >= {blocks[i - 1]}u) {{ wsel = {i}u; wx = wx - {blocks[i - 1]}u; "
               f"N = {widths[i]}u; out0 = {offsets[i]}u; }}" for i in range(1, len(weights))]
    common = dict(BR=0, OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x"), EPILOGUE="")
    inside = " || ".join(f"(i >= {at}u && i < {at + n}u)" for at, n in zip(offsets, widths))
    columns = dict(COLUMNS="\n".join(select), OUT_AT="out0 + row * N + col", LAYOUT=(cols, splits, width, depth),
                   INSIDE=inside, WEIGHTS=bs)
    kernel = _vector_kernel(graph, node, ["a_in", "w_in", *bs], ["f32"] * (2 + len(bs)), meta, rows, meta[1], 1,
                            words[0], common, norm=True, columns=columns, workgroups=sum(blocks))
    kernel.notes["variant"] += f", {len(weights)} weights ({' + '.join(map(str, widths))} columns)"
    return kernel


def _scaled_operands(graph: Graph, node: Node, variant: str, a: int, b: int) -> tuple[bool, bool]:
    """Which of a cooperative product's operands (A from node ``a``, B from ``b``) are
    gradients, scaled into f16's range before they are rounded (``_coop_scales``): those
    outside ``forward_nodes``, in a product outside them. Gradients leave f16's range
    where activations do not: audio-align's first gradient norm is 7.8e21, and its
    training on unscaled f16 gradients stopped at step 0 with an infinite norm (run 18).
    A split product's operands are f32 values of any size: both are scaled."""
    if variant not in COOP:
        return False, False
    if COOP[variant].split:
        return True, True
    forward = forward_nodes(graph)
    if node.id in forward:
        return False, False
    return a not in forward, b not in forward


def _tile_note(variant: str, scaled=(False, False)) -> str:
    """How a tiled variant multiplies, for the plan's notes and the profiler."""
    tile_m, tile_n = _tile_of(variant)
    if variant in COOP:
        c = COOP[variant]
        which = " and ".join(n for n, on in zip("AB", scaled) if on)
        kind = "f32 as 3 f16 products" if c.split else "f16"
        return (f"{tile_m}x{tile_n} tile, cooperative {kind} {COOP_FRAGMENT}x{COOP_FRAGMENT}x{COOP_FRAGMENT} -> f32, "
                f"{c.wm * c.wn} subgroups, BK {c.bk}" + (f", {which} scaled" if which else ""))
    tm, tn, bk, unroll, ty = TILED[variant]
    return (f"{tile_m}x{tile_n} tile, {tm}x{tn}/thread{'' if ty == 16 else f', {16 * ty} threads'}, BK {bk}"
            f"{', unrolled' if unroll else ''}")


OUT_AT = "    let at = (z * M + row) * N + col;"   # matmul_tiled.wgsl: where result (z, row, col) goes
# matmul_tiled.wgsl's writes: 4 columns as one vec4 where ``out`` is vec4s, else one at a time
STORE_VEC4 = dict(STORE_ONE="", STORE_FOUR="""    let M = m(0u);
    let N = m(1u);
    if (row >= M || col >= N) { return; }
    out[((z * M + row) * N + col) / 4u] = vec4<f32>(epilogue(b, row, col, acc.x), epilogue(b, row, col + 1u, acc.y),
                                                   epilogue(b, row, col + 2u, acc.z), epilogue(b, row, col + 3u, acc.w));""")
STORE_SCALAR = dict(STORE_ONE="    out[at] = epilogue(b, row, col, acc);",
                    STORE_FOUR="\n".join(f"    store(b, z, row, col + {j}u, acc.{x});" for j, x in enumerate("xyzw")))


def _tiled_kernel(name, archetype, names, types, meta, grid, k_, note, common, subs, caps: Capabilities,
                  extras=0, epilogue_apart=False, sums: dict | None = None, fill: int | None = None) -> Kernel:
    """A matmul_tiled.wgsl kernel over ``grid`` (column tiles, row tiles, batch); where
    its tiles are too few to fill the GPU (``matmul_splits``), the first stage of a split-K
    node: its K slices write raw sums to partials (the epilogue left out) and a second
    dispatch (matmul_splits.wgsl; bindings: the partials, the last ``extras`` operands,
    the output) adds them and applies the epilogue. ``epilogue_apart``: that second
    dispatch applies the epilogue even where K is not split. ``sums`` (``_sums_plan``):
    it also adds up an operand, into a binding after the output (or the state), or
    where split, after the slices' results for the finish to add into one after its output."""
    subs = dict(subs)
    enables = subs.pop("ENABLES", ())
    state = subs.pop("STATE", False)
    splits = matmul_splits(grid[0] * grid[1] * grid[2], k_, subs["BK"], caps.knobs, caps.tuning, fill)
    if grid[2] * splits > MAX_WORKGROUPS or "OUT_AT" in common:   # results mapped elsewhere: never split
        splits = 1
    apart = splits > 1 or (epilogue_apart and "OUT_AT" not in common)
    first = dict(common, EPILOGUE="", OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x")) if apart else common
    residual = subs.pop("RESIDUAL_INIT", None)
    if residual is not None and not apart:   # split-K's slices write raw sums: the finish adds the residual
        first = dict(first, EPILOGUE=first["EPILOGUE"].replace(residual["line"], residual["guarded"]))
        subs.update(ACC_DECL=subs["ACC_DECL"] + "\n" + residual["init"], SMEM=subs["SMEM"] + "\n" + residual["decl"])
    vec4 = "OUT_AT" not in common and meta[1] % 4 == 0
    own_sums = sums is not None and not apart   # the first stage writes the sums' binding itself
    if sums is not None:
        parts = sums_subs(sums["operand"], sums["registers"], sums["tile"], sums["threads"], sums["scratch"],
                          apart, vec4)
        subs["ACC_DECL"] += "\n" + parts.pop("SUMS_DECL")
        subs.update(parts)
        if own_sums:
            subs["SMEM"] += "\n" + sums_binding(len(names) + 2)
    if state:   # _coop_scales' guesses, a binding after the output (and the sums)
        subs["SMEM"] += (f"\n@group(0) @binding({len(names) + 2 + own_sums}) "
                         "var<storage, read_write> scale_state: array<u32>;")
    k = _finish(name, archetype, "matmul_tiled.wgsl", names, types, "vec4<f32>" if vec4 else "f32", meta,
                (grid[0], grid[1], grid[2] * splits), enables=enables,
                **{"THREAD_XY": _thread_xy("rows", caps.knobs), "OUT_AT": OUT_AT, **NO_SUMS, **first, **subs,
                   **(STORE_VEC4 if vec4 else STORE_SCALAR)})
    k.notes["variant"] = note
    k.guarded = True
    k.state_words = 2 * grid[0] * grid[1] * grid[2] * splits if state else 0
    k.sums = sums["operand"] if sums is not None else ""
    if sums is not None:
        k.notes["variant"] += ", adds up A's rows" if k.sums == "a" else ", adds up B's columns"
    if apart:
        total = meta[0] * meta[1] * grid[2]
        summed = 0 if sums is None else meta[0 if sums["operand"] == "a" else 1]
        k.partials = splits * (total + summed)
        operands = len(names) - extras
        finish_names = ["partials", *names[operands:]]
        finish_sums = (dict(SUMS_FINISH=sums_finish(sums["operand"]),
                            SUMS_BINDING=sums_binding(len(finish_names) + 2)) if sums is not None
                       else dict(SUMS_FINISH="", SUMS_BINDING=""))
        k.finish = _finish(f"{name}:splits", archetype, "matmul_splits.wgsl", finish_names,
                           ["f32"] * (1 + extras), "f32", [*meta, splits], grid_1d(-(-(total + summed) // WG)),
                           SPLITS_WORD=len(meta), SPLIT_SUMS="", **common, **finish_sums)
        k.finish.guarded = True
        k.finish_operands = tuple(range(operands, len(names)))
        k.notes["variant"] += f", K split {splits} ways" if splits > 1 else ", epilogue in a second dispatch"
    return k


# Split-K (docs/benchmarks.md, run 15); how many workgroups fill the GPU is the adapter's
# ``Tuning.matmul_resident`` (engine/codegen/tuning.py).
MATMUL_MIN_SLICE = 256      # K a slice keeps at least: K = 384 lost at every split
MATMUL_MAX_SPLITS = 16


def matmul_splits(tiles: int, k: int, bk: int, knobs: Knobs = Knobs(), tuning: Tuning = Tuning(),
                  fill: int | None = None) -> int:
    """How many K slices a tiled matmul (or convolution) with ``tiles`` workgroups,
    reduction length ``k`` and K step ``bk`` is cut into (``split_rule``, aiming for
    ``fill`` workgroups: ``slice_fill``).
    ``knobs.matmul_splits`` (``MEGANEURA_MATMUL_SPLITS``) forces N (benchmarks and tests)."""
    if knobs.matmul_splits:
        return max(1, min(knobs.matmul_splits, -(-k // bk)))
    return split_rule(tiles, k, tuning, fill)


def slice_fill(variant: str, tiles: int, tuning: Tuning = Tuning()) -> int:
    """Workgroups the K slices of a variant's ``tiles`` workgroups aim for:
    ``tuning.wide_fill`` for the 128-row cooperative tiles that take them only for their
    slices (fewer than a quarter of ``tuning.matmul_resident``: ``coop_variant``),
    ``tuning.matmul_resident`` for the rest. One number for both split
    the H100's weight gradients at batch 8 (384 x 1536 over K = 12000) into 14 slices on
    128 x 128 tiles, four waves of those where two do: the extra slices' partials cost
    more than the fuller waves gained. matmul_resident = 256 took 0.3 ms off whisper-tiny's
    b8 f16 step but made gpt-tiny's and whisper-tiny's b1 (64 x 64 tiles, K of 1500-2048)
    0.2-0.3 ms slower (run 43), so the two are tuned apart."""
    wide_by_slices = variant in COOP and COOP[variant].bm == 128 and tiles < tuning.matmul_resident // 4
    return tuning.wide_fill if wide_by_slices else tuning.matmul_resident


def split_rule(tiles: int, k: int, tuning: Tuning = Tuning(), fill: int | None = None) -> int:
    """Where at least 3 slices would fit ``fill`` workgroups (default: the GPU's resident
    ones in one wave, ``tuning.matmul_resident``), as many as fit, each at least ``MATMUL_MIN_SLICE``
    long; else 1. On the H100 (where 528 fill a wave) whisper's
    fc2 ([1500, 384] out of K = 1536, 144 tiles) went from 0.127 to 0.100 ms in 3
    slices, gpt-tiny's weight gradient (K = 2048) from 0.163 to 0.128 ms, and a 32 x 4096
    x 4096 from 0.206 to 0.115 ms in 4; 2 slices gained nothing there, and no split of
    K = 384 did, the partials and the second dispatch (about 10 us with the barrier
    before it) costing what the slices saved. Whisper's weight gradients (36 tiles,
    K = 1500) take 5 slices of 300; at batch 8 (K = 12000) 14, which took them from
    0.27 ms (4 slices, the cap until run 17) to 0.14-0.18 ms. Outputs of more tiles
    than a third of the resident workgroups are left whole: 1024^3 (256 tiles) ran
    0.086 ms whole and 0.105 ms in 2 slices."""
    resident = fill or tuning.matmul_resident
    if tiles > resident // 3:
        return 1
    return max(1, min(resident // max(tiles, 1), k // MATMUL_MIN_SLICE, MATMUL_MAX_SPLITS))


def _preset(variant: str) -> CoopPreset | TilePreset:
    """The preset of a tiled variant, cooperative or f32 (both name ``bk`` and ``threads``)."""
    return COOP[variant] if variant in COOP else TILED[variant]


def _tile_of(variant: str) -> tuple[int, int]:
    """(rows, columns) of the output tile of a matmul kernel variant."""
    if variant == "simple":
        return TILE, SIMPLE_COLUMNS * TILE
    if variant in COOP:
        return COOP[variant].bm, COOP[variant].bn
    preset = TILED[variant]
    return preset.ty * preset.tm, 16 * preset.tn


def matmul_variant(m_: int, n_: int, nbatch: int, k_: int = 0, transpose_a: bool = False,
                   caps: "Capabilities" = None) -> str:
    """Which matmul kernel a (batched) m x n output with reduction length ``k_`` gets.
    Measured on an H100 (docs/benchmarks.md, run 5): the 128 x 128 tile with BK 8 is
    fastest once it makes at least two waves of workgroups (``tuning.matmul_resident`` / 2
    of them), or as many in long K slices (``fills_in_slices``: whisper's weight gradients
    at batch 8, [384, 1536] over K = 12000, 36 tiles in 14 slices, ran 404 us where 64 x 64
    tiles in 3 slices took 525, run 31); 33 TFLOP/s at 4096^3; with
    its k loop unrolled 34.0-36.9 in four calls where the loop gave 33.0-34.4, run 17);
    below that the 64 x 64 tile, which keeps more workgroups per SM, wins (23 TFLOP/s on
    gpt-tiny's 2048 x 1536 x 384, where the 128 tile gave 15-21). For a transposed A
    (weight gradients) that tile runs on 128 threads of 8 x 4 outputs (run 17: 10% faster
    on gpt-tiny's, 15-20% on whisper's at batch 8); elsewhere the 128-thread kernel (its
    k loop unrolled) won 3-8% on single matmuls but made whisper-tiny's inference 3-4%
    slower in the same call, so 256 threads of 4 x 4 stay. Small or thinner outputs keep
    the simple kernel (a 16 x 64 tile; 16 x 16 until run 48) unless K is long enough to split (run 15: 32 x 4096 x 4096 in
    0.206 ms on it, 0.115 ms on the 64 tile with K in 4 slices).
    With ``caps.matmul_f16`` every product of at least 16 x 16 x 16 takes a
    cooperative-matrix kernel (``coop_variant``), with ``caps.matmul_split`` a split one
    (``split_variant``).
    ``caps.knobs.matmul`` (``MEGANEURA_MATMUL``) forces one of ``MATMUL_KERNELS``
    (benchmarks and tests; a cooperative one only where ``caps`` allow it)."""
    caps = caps or PLAIN
    forced = caps.knobs.matmul
    if forced != "auto" and forced not in MATMUL_KERNELS:
        raise DeviceError(f"MEGANEURA_MATMUL={forced!r} is not one of auto, {', '.join(MATMUL_KERNELS)}")
    if forced in MATMUL_KERNELS and (forced not in COOP or caps.matmul_f16 or caps.matmul_split):
        return forced
    if (caps.matmul_f16 or caps.matmul_split) and min(m_, n_, k_) >= COOP_FRAGMENT:
        order = ((coop_variant(m_, n_, nbatch, caps.tuning, k_), "c128l", "c64l") if caps.matmul_f16
                 else (split_variant(m_, n_, nbatch, k_, caps.tuning), "c64x3"))
        for variant in order:
            if coop_workgroup_bytes(variant) <= caps.workgroup_storage and COOP[variant].threads <= caps.invocations:
                return variant
    tiles = lambda t: -(-m_ // t) * -(-n_ // t) * nbatch
    if tiles(128) >= caps.tuning.matmul_resident // 2 or fills_in_slices(tiles(128), k_, caps.tuning):
        return "128k8u"
    if (tiles(64) >= 64 and min(m_, n_) >= 64) or split_rule(tiles(64), k_, caps.tuning) > 1:
        return "64t128" if transpose_a else "64"
    return "simple"


def coop_variant(m_: int, n_: int, nbatch: int, tuning: Tuning = Tuning(), k_: int = 0) -> str:
    """The cooperative-matrix tile for an m x n output: 128 x 128 where that still makes a
    wave of its workgroups (a quarter of ``tuning.matmul_resident``: they are four times
    a 64 x 64 tile's), or where K is long enough that its K slices (``split_rule``) make
    half of that many, else 64 x 64 (split-K then fills the GPU where K is long). On the
    H100 (run 31) whisper's weight gradients at batch 8 ([384, 1536] over K = 12000: 36
    tiles in 14 slices) ran 150 us on average where 64 x 64 tiles in 3 slices took 226,
    and conv2's 278 where they took 428; its [384, 384] ones (9 tiles, 144 workgroups in
    16 slices) lost to 64 x 64 (90 against 79 us), so they keep it. Either tile takes
    its lean kernel (one buffer an operand, so that more workgroups share an SM and one's
    prologue and epilogue overlap another's products) where the K a workgroup runs
    (a slice's) is at most ``tuning.lean_k``, else the double-buffered one, whose K loop
    has half the barriers. On the H100 (run 38) the lean tiles won at K = 384-1024 and
    lost or tied at 1536 and 4096: the default 1024. Over a short K, outputs of at most
    ``tuning.narrow_columns`` columns that K does not split take 128 x 96 tiles too where
    those fill better: whisper's out projection at batch 8 (12000 x 384 x 384) ran 46-47 us
    on the lean 128 x 128 tile and 34-36 on 128 x 96 (run 41); at 1536 columns (gpt-tiny's
    and whisper's fc1, 1500-12000 rows) the lean 128 x 128 tile stayed 0-10% faster: the
    default 384."""
    tiles = -(-m_ // 128) * -(-n_ // 128) * nbatch
    by_count = tiles >= tuning.matmul_resident // 4
    wide = by_count or fills_in_slices(tiles, k_, tuning, tuning.wide_fill)
    if not wide:
        tiles = -(-m_ // 64) * -(-n_ // 64) * nbatch
    splits = split_rule(tiles, k_, tuning, tuning.wide_fill if wide and not by_count else None)
    lean = k_ // splits <= tuning.lean_k
    narrow_lean = splits == 1 and n_ <= tuning.narrow_columns   # run 41: whisper's out projection at batch 8
    if wide and (not lean or narrow_lean) and n_ % COOP["c96"].bn == 0 \
            and narrow_tiles_fill_better(m_, n_, nbatch, tuning):
        return "c96"
    return {(True, True): "c128l", (True, False): "c128", (False, True): "c64l", (False, False): "c64"}[wide, lean]


def split_variant(m_: int, n_: int, nbatch: int, k_: int, tuning: Tuning = Tuning()) -> str:
    """The split preset (f32 as three f16 products) whose workgroups finish an m x n
    output over ``k_`` first: waves of them (a 128 x 128 one an SM, its 32 KiB; two
    64 x 64 ones, 24 KiB each; an SM a quarter of ``tuning.matmul_resident``'s workgroups)
    times a workgroup's K slice (``split_rule``) times a K step's cost, 16 on 128 x 128
    and ``tuning.split_small_cost`` on 64 x 64 (a quarter of the work at about half the
    speed a FLOP: 8 by default, where 8-9 fit the H100's). On the H100 (run 46) it picks
    the faster of the two for all eight products timed both ways, where the f16 rule's
    tile picked six: whisper's b8 fc1 (0.217 against 0.248 ms), q/k/v and 4096^3 on
    128 x 128; fc2 (0.234 against 0.266), the out projection, fc1's input gradient and a
    [384, 384] weight gradient over K = 12000 (0.067 against 0.083) on 64 x 64; fc1's
    weight gradient (0.194 against 0.243) on 128 x 128 in 7 slices. Against the f32 tiles
    the split ones ran 1.6-2.2x as fast. Over whole f32 steps this rule (at 8.8 sixteenths,
    whose choices 8 repeats for every product of the built-in models' training plans)
    took whisper's b8 from 45.55-45.62 to 44.12-44.21 ms and gpt-tiny's from 7.08-7.18 to
    7.02-7.07 against the f16 tile's split twin."""
    def cost(variant: str, edge: int, per_step: int) -> int:
        tiles = -(-m_ // edge) * -(-n_ // edge) * nbatch
        splits = split_rule(tiles, k_, tuning, slice_fill(variant, tiles, tuning))
        slots = max(1, tuning.matmul_resident // 4) * (1 if edge == 128 else 2)
        return -(-tiles * splits // slots) * per_step * -(-k_ // splits)
    return "c128x3" if cost("c128x3", 128, 16) <= cost("c64x3", 64, tuning.split_small_cost) else "c64x3"


def narrow_tiles_fill_better(m_: int, n_: int, nbatch: int, tuning: Tuning = Tuning()) -> bool:
    """Whether 128 x 96 tiles (``c96``, 3/4 of a 128 x 128 tile's work) finish an m x n
    output in fewer tile-times than 128 x 128 ones, counted in waves of a quarter of
    ``tuning.matmul_resident`` (either tile has an SM to itself). Whisper's products of
    N = 384 at batch 8 are 282 tiles of 128 x 128, two waves and a seventh of one on the
    H100's 132 SMs, and 376 of 128 x 96, under three: its fc2 (K = 1536) ran 154 -> 121 us,
    the input gradient of q/k/v (K = 1152) 373 -> 370 and 520 -> 423 (run 39)."""
    slots = max(1, tuning.matmul_resident // 4)
    waves = lambda bn: -(-(-(-m_ // 128) * -(-n_ // bn) * nbatch) // slots)  # noqa: E731
    return 3 * waves(96) < 4 * waves(128)


LONG_SLICE = 512   # K a 128 x 128 tile's slice needs to pay for its start and its partials


def fills_in_slices(tiles: int, k: int, tuning: Tuning = Tuning(), fill: int | None = None) -> bool:
    """Whether ``tiles`` 128 x 128 tiles cut into K slices (``split_rule`` aiming for
    ``fill``, default ``tuning.matmul_resident``) of at least ``LONG_SLICE`` make half of
    ``fill`` workgroups. Whisper's weight gradients at batch 8 (K = 12000 in 14 slices)
    ran faster so (run 31); gpt-tiny's (K = 2048 in 8 slices of 256) ran 5% slower than on
    64 x 64 tiles in 3 slices."""
    fill = fill or tuning.matmul_resident
    splits = split_rule(tiles, k, tuning, fill)
    return splits > 1 and k // splits >= LONG_SLICE and tiles * splits >= fill // 2


class TilePreset(NamedTuple):
    """A register-blocked f32 kernel: rows and columns of outputs per thread, the K step,
    whether the k loop is unrolled, and the thread grid's rows (16 columns of threads x
    ``ty`` rows). The tile is (ty x tm) x (16 x tn)."""

    tm: int
    tn: int
    bk: int
    unroll: bool
    ty: int = 16

    @property
    def threads(self) -> int:
        return 16 * self.ty


TILED = {"64": TilePreset(4, 4, 16, False), "64u": TilePreset(4, 4, 16, True),
         "128x64": TilePreset(8, 4, 16, False), "128x64u": TilePreset(8, 4, 16, True),
         "128": TilePreset(8, 8, 16, False), "128u": TilePreset(8, 8, 16, True),
         "128k8": TilePreset(8, 8, 8, False), "128k8u": TilePreset(8, 8, 8, True),
         "64t128": TilePreset(8, 4, 16, False, ty=8), "64t128u": TilePreset(8, 4, 16, True, ty=8)}
MATMUL_KERNELS = ("simple", *TILED, *COOP)

def _tile_subs(variant: str, fetch_a: str, fetch_b: str, gather_a=None, gather_b=None, lets=(),
               mnk=(0, 0, 0), scaled=(False, False), stored_b: str = "f32") -> dict:
    """matmul_tiled.wgsl's generated parts for any tiled variant, f32 or cooperative, for
    an m x n x k product (which operand tiles always lie inside their operand); a
    cooperative kernel scales the ``scaled`` operands into f16's range. ``stored_b``: B's
    dtype (a bf16 weight is widened as it is fetched)."""
    make = _coop_subs if variant in COOP else _tiled_subs
    (bm, bn), bk = _tile_of(variant), _preset(variant).bk
    m_, n_, k_ = mnk
    edges = [_edges(extent, tile, k_, bk) for extent, tile in ((m_, bm), (n_, bn))]
    return make(variant, fetch_a, fetch_b, gather_a, gather_b, lets, edges, scaled, stored_b)


def _edges(extent: int, tile: int, k_: int, bk: int) -> str:
    """How an operand of ``extent`` rows (columns) and reduction ``k_`` is fetched in tiles
    of ``tile`` x ``bk`` without per-element checks where it can be (``_fetch_operand``):
    "none" when both divide, "clamp" when only K does, else None (the kernel's choice)."""
    if extent <= 0 or k_ <= 0 or k_ % bk:
        return None
    return "none" if extent % tile == 0 else "clamp"


def _tiled_subs(preset: str, fetch_a: str, fetch_b: str, gather_a=None, gather_b=None, lets=(),
                edges=(None, None), scaled=(False, False), stored_b: str = "f32") -> dict:
    """The generated parts of matmul_tiled.wgsl for a ``TILED`` preset and the given
    operand fetches (see ``operand_fetch`` and ``_fetch_operand``); ``lets`` are extra
    lines at the top of the kernel (values the gathers read). ``edges``: how A's and B's
    fetches meet their bounds (``_fetch_operand``; None: each element checked)."""
    tm, tn, bk, unroll, ty = TILED[preset]
    bm, bn = ty * tm, 16 * tn
    gs, hs = range(tm // 4), range(tn // 4)
    acc = [f"c{g}{i}_{h}" for g in gs for i in range(4) for h in hs]
    decl = "\n".join(f"    var {c} = vec4<f32>(0.0);" for c in acc)
    comp = []
    for kk in (range(bk) if unroll else ["kk"]):
        k = f"{kk}u" if unroll else kk
        for g in gs:
            comp.append(f"            let a{g}_{kk} = As[ab + {k} * AS + {ty * g}u + ty];")
        for h in hs:
            comp.append(f"            let b{h}_{kk} = Bs[bb + {k} * BS + {16 * h}u + tx];")
        for g in gs:
            for i, x in enumerate("xyzw"):
                for h in hs:
                    comp.append(f"            c{g}{i}_{h} = fma(vec4<f32>(a{g}_{kk}.{x}), b{h}_{kk}, c{g}{i}_{h});")
    if not unroll:
        comp = ["        for (var kk = 0u; kk < BK; kk = kk + 1u) {", *comp, "        }"]
    store = []
    for g in gs:
        for i in range(4):
            store.append(f"    let r{g}{i} = row0 + {4 * ty * g + i}u + ty * 4u;")
            store += [f"    store4(b, wg.z, r{g}{i}, col0 + {64 * h}u + tx * 4u, c{g}{i}_{h});" for h in hs]
    threads = TILED[preset].threads
    edges = [mode or "checked" for mode in edges]
    ca, da, la, ra = _fetch_operand("a", fetch_a, bm, bk, gather_a, threads, edges[0])
    cb, db, lb, rb = _fetch_operand("b", fetch_b, bn, bk, gather_b, threads, edges[1], stored_b)
    sa, sb = _store_tiled("a", fetch_a, ra), _store_tiled("b", fetch_b, rb)
    smem = (f"var<workgroup> As: array<vec4<f32>, {2 * bk * (bm // 4 + 1)}>;\n"
            f"var<workgroup> Bs: array<vec4<f32>, {2 * bk * (bn // 4 + 1)}>;")
    return dict(BM=bm, BN=bn, BK=bk, TM=tm, TN=tn, AS=bm // 4 + 1, BS=bn // 4 + 1, THREADS=threads,
                ABUF=bk * (bm // 4 + 1), BBUF=bk * (bn // 4 + 1), RESTAGE="", SMEM=smem, ARGS="", MAIN_ATTRS="",
                KEPT_SCALES="", ATTEMPT_BEGIN="", ATTEMPT_END="", STATE=False,
                ACC_DECL=decl, COMPUTE="\n".join(comp), STORE_OUT="\n".join(store),
                LOAD_DECL="\n".join([*lets, *ca, *cb, *da, *db]), LOAD="\n".join(la + lb),
                STORE="\n".join(sa + sb))
