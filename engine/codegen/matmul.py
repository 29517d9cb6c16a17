"""The tiled-matmul archetype with a fused epilogue (bias, activation, residual): the
simple, register-blocked and cooperative-matrix (f16) variants, split-K, and the operand
fetches shared with the convolutions (implicit GEMM).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..config import Knobs
from ..errors import DeviceError
from ..graph.ir import Graph, Node
from ..graph.ops import GRADIENT_OF, norm_matmuls_layout
from .common import (MAX_WORKGROUPS, PLAIN, TILE, WG, Capabilities, Kernel, UnsupportedOpError, _finish, _render,
                     _thread_xy, contiguous_strides, f32_bits, forward_nodes, grid_1d)
from .pointwise import ACTIVATION_EXPR, _expr
from .tuning import Tuning


# ---------------------------------------------------------------- matmul

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


def _matmul(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    a, b = graph[node.inputs[0]], graph[node.inputs[1]]
    attrs = node.attrs
    ta, tb = attrs.get("transpose_a", False), attrs.get("transpose_b", False)
    norm = node.op == "norm_matmul"
    if norm:
        # inputs: x, w, b  ->  A = x (prologue * w[k], epilogue * rsqrt(mean x^2 + eps)), B = b
        b = graph[node.inputs[2]]
        extras = []
    else:
        extras = [graph[i] for i in node.inputs[2:]]
    out = node.shape
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    extra_shapes = [tuple(e.shape) for e in extras]
    if not norm and not ta:
        out, a_shape, b_shape, extra_shapes = _fold_batch(out, a_shape, b_shape, extra_shapes)
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
    prologue = ""
    act = "x"
    if norm:
        names, types = ["a_in", "w_in", "b_in"], ["f32"] * 3
        prologue = " * w_in[ka]"
        epi += ["    var ss = 0.0;",
                "    for (var k = 0u; k < K; k = k + 1u) {",
                "        let xv = a_in[a0 + row * sam + k * sak];",
                "        ss = ss + xv * xv;",
                "    }",
                "    v = v * inverseSqrt(ss / f32(K) + mf(4u));"]
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
        return _vector_kernel(graph, node, names, types, meta, m_, n_, max(nbatch, 1), words_b, vector, norm=norm)
    variant = "simple" if norm else matmul_variant(m_, n_, max(nbatch, 1), k_, ta, caps)
    tile_m, tile_n = _tile_of(variant)
    gx, gy = -(-n_ // tile_n), -(-m_ // tile_m)
    if max(gx, gy, nbatch) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: matmul grid {gx} x {gy} x {nbatch} exceeds "
                          f"{MAX_WORKGROUPS} workgroups per dimension")
    if variant == "simple":
        k = _finish(f"matmul:{node.op}", "matmul", "matmul.wgsl", names, types, "f32", meta,
                    (gx, gy, max(nbatch, 1)), A_PROLOGUE=prologue, **common)
        k.notes["variant"] = f"{TILE}x{TILE} tile"
        return k
    # outer axis first: A's is m, B's is n
    fetch_a = operand_fetch(words_a, m_, k_)
    fetch_b = operand_fetch(words_b[:-2] + [words_b[-1], words_b[-2]], n_, k_)
    types[0] = "vec4<f32>" if fetch_a.endswith("vec4") else "f32"
    types[1] = "vec4<f32>" if fetch_b.endswith("vec4") else "f32"
    scaled = _scaled_operands(graph, node, variant, node.inputs[0], node.inputs[1])
    note = f"{_tile_note(variant, scaled)}, A {fetch_a}, B {fetch_b}"
    subs = _tile_subs(variant, fetch_a, fetch_b, mnk=(m_, n_, k_), scaled=scaled)
    if residual is not None:
        line, words, operand = residual
        if variant in COOP and act == "x" and br == 0 and words == [n_, 1] and not any(scaled):
            subs["RESIDUAL_INIT"] = _residual_init(variant, line, operand)
    # A cooperative tile's epilogue runs in turns over its subgroups' results (CoopPreset.scratch):
    # an activation's gradient there (erfc and a load an element) made whisper-tiny's f16
    # step 0.8 ms slower than the same in a second dispatch, which runs at the bandwidth.
    apart = variant in COOP and attrs.get("gradient_of", "none") != "none"
    return _tiled_kernel(f"matmul:{node.op}", "matmul", names, types, meta, (gx, gy, max(nbatch, 1)), k_, note,
                         common, subs, caps, extras=len(extras), epilogue_apart=apart)


def _residual_init(variant: str, line: str, operand: int) -> dict:
    """A cooperative product whose epilogue adds a row-major residual after no activation
    starts its whole tiles' accumulators from the residual (``subgroupMatrixLoad`` of
    result fragments: exact f32, read in fragments rather than element by element after
    the products), and its epilogue skips the residual there. Edge tiles keep it in the
    epilogue. The epilogues of whisper-tiny's out projections and fc2 (bias and residual)
    cost 90 us a layer at batch 8 (run 32)."""
    c, f = COOP[variant], COOP_FRAGMENT
    init = ["    let whole_tile = row0 + BM <= M && col0 + BN <= N;", "    residual_in_acc = whole_tile;",
            "    if (whole_tile) {"]
    init += [f"        acc{i}_{j} = subgroupMatrixLoad<subgroup_matrix_result<f32, {f}, {f}>>(&residual_in, "
             f"boff(b, {operand}u) + (row0 + wrow + {i * f}u) * N + col0 + wcol + {j * f}u, false, N);"
             for i in range(c.bm // c.wm // f) for j in range(c.bn // c.wn // f)]
    init.append("    }")
    return dict(line=line, guarded=f"    if (!residual_in_acc) {{\n    {line}\n    }}", init="\n".join(init),
                decl="var<private> residual_in_acc: bool;   // the residual started the accumulators")


VECTOR_ROWS = 8        # outputs of at most this many rows take the vector kernel
VECTOR_THREADS = 256
VECTOR_UNROLL = 8      # K steps a thread loads at once (16 measured the same on the H100)
VECTOR_COLUMNS = 8     # output columns of a workgroup


def vector_rows(m_: int, transpose_a: bool, caps: Capabilities) -> bool:
    """Whether an output of ``m_`` rows (batch folded in) takes matmul_vector.wgsl: a
    generation step's one token would waste all but one row of every tile of the tiled
    kernels (and split K in a second dispatch to fill the GPU). Not for a transposed A
    (weight gradients), nor where ``MEGANEURA_MATMUL`` forces a kernel."""
    return m_ <= VECTOR_ROWS and not transpose_a and caps.knobs.matmul == "auto"


_ONE_B = dict(COLUMNS="    let N = m(1u);\n    let wsel = 0u;\n    let wx = wg.x;", OUT_AT="(b * M + row) * N + col",
              LOAD_B="b_in[{}]")


def _vector_kernel(graph: Graph, node: Node, names, types, meta, m_: int, n_: int, nbatch: int, words_b,
                   common: dict, norm: bool = False, second: bool = False, columns: dict = _ONE_B,
                   workgroups: int = 0) -> Kernel:
    """matmul_vector.wgsl for ``m_`` rows: 256 threads as 8 columns x 32 K slices, lanes
    along B's contiguous axis (its columns, or K where B is stored transposed). Few
    columns a workgroup make many workgroups, and many loads in flight: 32 columns x 8
    slices gave a 576 x 576 weight 18 workgroups and 100 GB/s on the H100. ``norm``: A is
    RMS-normalised (weight ``w_in``, eps in meta word 4), the norm applied to the sums
    before ``common``'s epilogue; ``second``: a second B ``u_in`` (operand 2) accumulates
    into ``v2`` beside ``v``; ``columns``: the template's COLUMNS and OUT_AT and how B is
    loaded (``_ONE_B``, or norm_matmuls' several Bs over ``workgroups`` workgroups)."""
    columns_contiguous = words_b[-1] == 1
    cols = VECTOR_COLUMNS
    slices = VECTOR_THREADS // cols
    grid = (workgroups or -(-n_ // cols), 1, nbatch)
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: matmul grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension")
    unroll = VECTOR_UNROLL
    extra = _vector_extras(m_, norm, second)
    common = dict(common, EPILOGUE=extra.pop("NORM_EPILOGUE") + common["EPILOGUE"])
    k = _finish(f"matmul:{node.op}", "matmul", "matmul_vector.wgsl", names, types, "f32", meta, grid,
                ROWS=m_, COLS=cols, SLICES=slices, THREADS=VECTOR_THREADS, PARTIAL=m_ * VECTOR_THREADS,
                COL_OF="t % COLS" if columns_contiguous else "t / SLICES",
                SLICE_OF="t / COLS" if columns_contiguous else "t % SLICES", UNROLL=unroll,
                ACCUMULATE=_vector_steps(m_, ["ka"], norm, second, columns["LOAD_B"]),
                ACCUMULATE_UNROLLED=_vector_steps(m_, [f"(ka + {u}u * SLICES)" for u in range(unroll)], norm, second,
                                                  columns["LOAD_B"]),
                COLUMNS=columns["COLUMNS"], OUT_AT=columns["OUT_AT"], **extra, **common)
    k.notes["variant"] = f"{m_}-row vector kernel, {cols} columns x {slices} K slices"
    return k


def _vector_steps(rows: int, ks: list[str], norm: bool, second: bool, load_b: str = "b_in[{}]") -> str:
    """The vector kernel's loads and sums for K steps ``ks``: their loads first, all
    independent, then the sums (each A value once, squared too for a norm)."""
    lines = []
    for u, k in enumerate(ks):
        lines.append(f"let bv{u} = {load_b.format(f'b0 + {k} * sbk + col_b * sbn')};")
        if second:
            lines.append(f"let uv{u} = u_in[u0 + {k} * suk + col_b * sun];")
        for r in range(rows):
            lines.append(f"let a{r}_{u} = a_in[a0 + {r}u * sam + {k} * sak];")
    for r in range(rows):
        xs = [f"a{r}_{u} * w_in[{k}]" if norm else f"a{r}_{u}" for u, k in enumerate(ks)]
        lines.append(f"acc[{r}u] = acc[{r}u] + " + " + ".join(f"{x} * bv{u}" for u, x in enumerate(xs)) + ";")
        if second:
            lines.append(f"acc2[{r}u] = acc2[{r}u] + " + " + ".join(f"{x} * uv{u}" for u, x in enumerate(xs)) + ";")
        if norm:
            lines.append(f"ssq[{r}u] = ssq[{r}u] + " + " + ".join(f"a{r}_{u} * a{r}_{u}" for u in range(len(ks))) + ";")
    return "\n".join("            " + line for line in lines)


def _vector_extras(rows: int, norm: bool, second: bool) -> dict[str, str]:
    """The EXTRA slots of matmul_vector.wgsl (and the norm's epilogue lines)."""
    decl, setup, store, total, epilogue = [], [], [], [], []
    if second:
        decl.append(f"var<workgroup> part2: array<f32, {rows * VECTOR_THREADS}>;")
        setup += ["let u0 = boff(b, 2u);", "let suk = srow(2u);", "let sun = scol(2u);", "var acc2: array<f32, ROWS>;"]
        store.append("for (var r = 0u; r < ROWS; r = r + 1u) { part2[(r * COLS + c) * SLICES + s] = acc2[r]; }")
        total += ["    var v2 = 0.0;", "    for (var j = 0u; j < SLICES; j = j + 1u) { v2 = v2 + part2[o * SLICES + j]; }"]
    if norm:   # each column's SLICES threads see all of K once: column 0's sums of squares suffice
        decl.append(f"var<workgroup> part_ss: array<f32, {rows * VECTOR_THREADS // VECTOR_COLUMNS}>;")
        setup.append("var ssq: array<f32, ROWS>;")
        store.append("if (c == 0u) { for (var r = 0u; r < ROWS; r = r + 1u) { part_ss[r * SLICES + s] = ssq[r]; } }")
        total += ["    var ss = 0.0;", "    for (var j = 0u; j < SLICES; j = j + 1u) { ss = ss + part_ss[row * SLICES + j]; }"]
        epilogue += ["        let norm = inverseSqrt(ss / f32(K) + mf(4u));", "        v = v * norm;"]
        if second:
            epilogue.append("        v2 = v2 * norm;")
    indent = lambda lines, n: "\n".join(" " * n + line for line in lines)  # noqa: E731
    return {"EXTRA_DECL": "\n".join(decl), "EXTRA_SETUP": indent(setup, 4), "EXTRA_STORE": indent(store, 4),
            "EXTRA_SUM": indent(total, 4), "NORM_EPILOGUE": "\n".join(epilogue) + ("\n" if epilogue else "")}


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
                          norm=norm, second=True)


def _norm_matmuls(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """rms_norm(x) @ w_i for each weight in one dispatch of the vector kernel, each product
    into its place in the packed result (norm_matmuls_layout): a decode step's q, k and v
    projections, which were three dispatches each taking the norm again. Workgroup x
    belongs to one weight (the first ceil(N_0 / COLS) to w_0, and so on), so a
    workgroup's loads all come from one binding."""
    x, _, *weights = (graph[i] for i in node.inputs)
    tb = node.attrs["transpose_b"]
    rows, k_ = math.prod(x.shape[:-1]), x.shape[-1]
    if not vector_rows(rows, False, caps):
        raise UnsupportedOpError(f"{graph.format_node(node)}: norm_matmuls runs on the few-row kernel only "
                                 f"({rows} rows, at most {VECTOR_ROWS}, and no MEGANEURA_MATMUL forced)")
    shapes, offsets, _ = norm_matmuls_layout(x.shape, [w.shape for w in weights], tb)
    widths = [shape[-1] for shape in shapes]
    blocks = [-(-n // VECTOR_COLUMNS) for n in widths]
    words = [[1, k_] if tb else [n, 1] for n in widths]    # each weight's strides of (k, n)
    meta = [rows, sum(widths), k_, 1, f32_bits(node.attrs["eps"]), k_, 1] + [w for pair in words for w in pair]
    bs = ["b_in"] + [f"b{i}_in" for i in range(1, len(weights))]
    select = ["    var wsel = 0u;", "    var wx = wg.x;", f"    var N = {widths[0]}u;", "    var out0 = 0u;"]
    select += [f"    if (wsel == {i - 1}u && wx >= {blocks[i - 1]}u) {{ wsel = {i}u; wx = wx - {blocks[i - 1]}u; "
               f"N = {widths[i]}u; out0 = {offsets[i]}u; }}" for i in range(1, len(weights))]
    cases = "\n".join(f"        case {i}u: {{ return {b}[at]; }}" for i, b in enumerate(bs) if i)
    common = dict(BR=0, OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x") +
                  f"\n\nfn weight(w: u32, at: u32) -> f32 {{\n    switch w {{\n{cases}\n"
                  f"        default: {{ return b_in[at]; }}\n    }}\n}}", EPILOGUE="")
    columns = dict(COLUMNS="\n".join(select), OUT_AT="out0 + row * N + col", LOAD_B="weight(wsel, {})")
    kernel = _vector_kernel(graph, node, ["a_in", "w_in", *bs], ["f32"] * (2 + len(bs)), meta, rows, sum(widths), 1,
                            words[0], common, norm=True, columns=columns, workgroups=sum(blocks))
    kernel.notes["variant"] += f", {len(weights)} weights ({' + '.join(map(str, widths))} columns)"
    return kernel


def _scaled_operands(graph: Graph, node: Node, variant: str, a: int, b: int) -> tuple[bool, bool]:
    """Which of a cooperative product's operands (A from node ``a``, B from ``b``) are
    gradients, scaled into f16's range before they are rounded (``_coop_scales``): those
    outside ``forward_nodes``, in a product outside them. Gradients leave f16's range
    where activations do not: audio-align's first gradient norm is 7.8e21, and its
    training on unscaled f16 gradients stopped at step 0 with an infinite norm (run 18)."""
    if variant not in COOP:
        return False, False
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
        return (f"{tile_m}x{tile_n} tile, cooperative f16 {COOP_FRAGMENT}x{COOP_FRAGMENT}x{COOP_FRAGMENT} -> f32, "
                f"{c.wm * c.wn} subgroups, BK {c.bk}" + (f", {which} scaled" if which else ""))
    tm, tn, bk, unroll, ty = TILED[variant]
    return (f"{tile_m}x{tile_n} tile, {tm}x{tn}/thread{'' if ty == 16 else f', {16 * ty} threads'}, BK {bk}"
            f"{', unrolled' if unroll else ''}")


OUT_AT = "    let at = (z * M + row) * N + col;"   # matmul_tiled.wgsl: where result (z, row, col) goes
# matmul_tiled.wgsl's writes (store, store4): 4 columns as one vec4 where ``out`` is bound as
# vec4s, else one scalar at a time (where OUT_AT maps columns elsewhere, or N % 4 != 0)
STORE_VEC4 = dict(STORE_ONE="", STORE_FOUR="""    let M = m(0u);
    let N = m(1u);
    if (row >= M || col >= N) { return; }
    out[((z * M + row) * N + col) / 4u] = vec4<f32>(epilogue(b, row, col, acc.x), epilogue(b, row, col + 1u, acc.y),
                                                   epilogue(b, row, col + 2u, acc.z), epilogue(b, row, col + 3u, acc.w));""")
STORE_SCALAR = dict(STORE_ONE="    out[at] = epilogue(b, row, col, acc);",
                    STORE_FOUR="\n".join(f"    store(b, z, row, col + {j}u, acc.{x});" for j, x in enumerate("xyzw")))


def _tiled_kernel(name, archetype, names, types, meta, grid, k_, note, common, subs, caps: Capabilities,
                  extras=0, epilogue_apart=False) -> Kernel:
    """A matmul_tiled.wgsl kernel over ``grid`` (column tiles, row tiles, batch); where
    its tiles are too few to fill the GPU (``matmul_splits``), the first stage of a split-K
    node: its K slices write raw sums to partials (the epilogue left out) and a second
    dispatch (matmul_splits.wgsl; bindings: the partials, the last ``extras`` operands,
    the output) adds them and applies the epilogue. ``epilogue_apart``: that second
    dispatch applies the epilogue even where K is not split."""
    subs = dict(subs)
    enables = subs.pop("ENABLES", ())
    state = subs.pop("STATE", False)
    splits = matmul_splits(grid[0] * grid[1] * grid[2], k_, subs["BK"], caps.knobs, caps.tuning)
    if grid[2] * splits > MAX_WORKGROUPS or "OUT_AT" in common:   # results mapped elsewhere: never split
        splits = 1
    apart = splits > 1 or (epilogue_apart and "OUT_AT" not in common)
    first = dict(common, EPILOGUE="", OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x")) if apart else common
    residual = subs.pop("RESIDUAL_INIT", None)
    if residual is not None and not apart:   # split-K's slices write raw sums: the finish adds the residual
        first = dict(first, EPILOGUE=first["EPILOGUE"].replace(residual["line"], residual["guarded"]))
        subs.update(ACC_DECL=subs["ACC_DECL"] + "\n" + residual["init"], SMEM=subs["SMEM"] + "\n" + residual["decl"])
    if state:   # _coop_scales' guesses, a binding after the output
        subs["SMEM"] += (f"\n@group(0) @binding({len(names) + 2}) "
                         "var<storage, read_write> scale_state: array<u32>;")
    vec4 = "OUT_AT" not in common and meta[1] % 4 == 0
    k = _finish(name, archetype, "matmul_tiled.wgsl", names, types, "vec4<f32>" if vec4 else "f32", meta,
                (grid[0], grid[1], grid[2] * splits), enables=enables,
                **{"THREAD_XY": _thread_xy("rows", caps.knobs), "OUT_AT": OUT_AT, **first, **subs,
                   **(STORE_VEC4 if vec4 else STORE_SCALAR)})
    k.notes["variant"] = note
    k.guarded = True
    k.state_words = 2 * grid[0] * grid[1] * grid[2] * splits if state else 0
    if apart:
        total = meta[0] * meta[1] * grid[2]
        k.partials = splits * total
        operands = len(names) - extras
        k.finish = _finish(f"{name}:splits", archetype, "matmul_splits.wgsl", ["partials", *names[operands:]],
                           ["f32"] * (1 + extras), "f32", [*meta, splits], grid_1d(-(-total // WG)),
                           SPLITS_WORD=len(meta), **common)
        k.finish.guarded = True
        k.finish_operands = tuple(range(operands, len(names)))
        k.notes["variant"] += f", K split {splits} ways" if splits > 1 else ", epilogue in a second dispatch"
    return k


# Split-K (docs/benchmarks.md, run 15); how many workgroups fill the GPU is the adapter's
# ``Tuning.matmul_resident`` (engine/codegen/tuning.py).
MATMUL_MIN_SLICE = 256      # K a slice keeps at least: K = 384 lost at every split
MATMUL_MAX_SPLITS = 16


def matmul_splits(tiles: int, k: int, bk: int, knobs: Knobs = Knobs(), tuning: Tuning = Tuning()) -> int:
    """How many K slices a tiled matmul (or convolution) with ``tiles`` workgroups,
    reduction length ``k`` and K step ``bk`` is cut into (``split_rule``).
    ``knobs.matmul_splits`` (``MEGANEURA_MATMUL_SPLITS``) forces N (benchmarks and tests)."""
    if knobs.matmul_splits:
        return max(1, min(knobs.matmul_splits, -(-k // bk)))
    return split_rule(tiles, k, tuning)


def split_rule(tiles: int, k: int, tuning: Tuning = Tuning()) -> int:
    """Where at least 3 slices would fit the GPU's resident workgroups in one wave
    (``tuning.matmul_resident``), as many as fit, each at least ``MATMUL_MIN_SLICE``
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
    resident = tuning.matmul_resident
    if tiles > resident // 3:
        return 1
    return max(1, min(resident // max(tiles, 1), k // MATMUL_MIN_SLICE, MATMUL_MAX_SPLITS))


def _tile_of(variant: str) -> tuple[int, int]:
    """(rows, columns) of the output tile of a matmul kernel variant."""
    if variant == "simple":
        return TILE, TILE
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
    the 16 x 16 kernel unless K is long enough to split (run 15: 32 x 4096 x 4096 in
    0.206 ms on it, 0.115 ms on the 64 tile with K in 4 slices).
    With ``caps.matmul_f16`` every product of at least 16 x 16 x 16 takes a
    cooperative-matrix kernel (``coop_variant``).
    ``caps.knobs.matmul`` (``MEGANEURA_MATMUL``) forces one of ``MATMUL_KERNELS``
    (benchmarks and tests; a cooperative one only where ``caps`` allow it)."""
    caps = caps or PLAIN
    forced = caps.knobs.matmul
    if forced != "auto" and forced not in MATMUL_KERNELS:
        raise DeviceError(f"MEGANEURA_MATMUL={forced!r} is not one of auto, {', '.join(MATMUL_KERNELS)}")
    if forced in MATMUL_KERNELS and (forced not in COOP or caps.matmul_f16):
        return forced
    if caps.matmul_f16 and min(m_, n_, k_) >= COOP_FRAGMENT:
        for variant in (coop_variant(m_, n_, nbatch, caps.tuning, k_), "c128l", "c64l"):
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
    lost or tied at 1536 and 4096: the default 1024."""
    tiles = -(-m_ // 128) * -(-n_ // 128) * nbatch
    wide = tiles >= tuning.matmul_resident // 4 or fills_in_slices(tiles, k_, tuning)
    if not wide:
        tiles = -(-m_ // 64) * -(-n_ // 64) * nbatch
    lean = k_ // split_rule(tiles, k_, tuning) <= tuning.lean_k
    if wide and not lean and n_ % COOP["c96"].bn == 0 and narrow_tiles_fill_better(m_, n_, nbatch, tuning):
        return "c96"
    return {(True, True): "c128l", (True, False): "c128", (False, True): "c64l", (False, False): "c64"}[wide, lean]


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


def fills_in_slices(tiles: int, k: int, tuning: Tuning = Tuning()) -> bool:
    """Whether ``tiles`` 128 x 128 tiles cut into K slices (``split_rule``) of at least
    ``LONG_SLICE`` make half of ``tuning.matmul_resident`` workgroups. Whisper's weight
    gradients at batch 8 (K = 12000 in 14 slices) ran faster so (run 31); gpt-tiny's
    (K = 2048 in 8 slices of 256) ran 5% slower than on 64 x 64 tiles in 3 slices."""
    splits = split_rule(tiles, k, tuning)
    return splits > 1 and k // splits >= LONG_SLICE and tiles * splits >= tuning.matmul_resident // 2


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


class CoopPreset(NamedTuple):
    """A cooperative-matrix kernel: a ``bm`` x ``bn`` output tile, K steps of ``bk``, and
    ``wm`` x ``wn`` subgroups of 32 threads, each owning a (bm / wm) x (bn / wn) block of
    16 x 16 f32 accumulator fragments. The results leave through a 16 x 16 f32 scratch a
    subgroup, for at most ``scratch`` subgroups at a time. ``buffers``: workgroup
    buffers of each operand tile; with 2 the next step's operands are stored while this
    step's are multiplied, with 1 the memory halves for a second barrier a step."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    buffers: int = 2
    scratch: int = 8

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn


# Measured on the H100 through Dawn (docs/benchmarks.md, runs 18 and 33). At 4096^3 (edge
# tiles still checked) the 128 x 128 tile on 8 subgroups of 64 x 32 ran 111 TFLOP/s, on 4
# of 64 x 64 91 (more registers a thread), with BK 16 67; 128 x 64 on 4 subgroups 61,
# 64 x 64 73, on 2 subgroups 59. On the models' shapes the 64 x 64 tile won or tied
# wherever 128 x 128 tiles make less than a wave, and 128 x 64 never won. Run 33: the
# 128 x 128 tile on 16 subgroups of 32 x 32 (512 threads) ran 1-6% faster than on 8 of
# 64 x 32 on every shape where that tile is chosen (whisper's step -0.5 ms in f16);
# 256 x 128 and 128 x 256 tiles (BK 16, to fit 48 KiB) ran slower on the models' shapes.
# Run 38, the lean tiles (one buffer an operand, a second barrier a K step): 128 x 128 on 8
# subgroups of 32 x 64 with K steps of 16 ("c128l", 20 KiB: two share an SM where the
# 512-thread tile of 48 KiB has one to itself) ran whisper's b8 fc1 (K = 384) 10% faster,
# its qkv 9%, gpt-tiny's fc1 27%, whisper's weight gradients in slices of 857 16%, its
# products over K = 1536 0-25% slower and 4096^3 the same; 64 x 64 ("c64l", 14 KiB) the
# Llama's q/k/v (K = 576) 18% and its up projection 27% faster, products in slices of 512
# 4-7% slower, and its training step 6% faster (``coop_variant``). Run 39, 128 x 96 on 12
# subgroups of 32 x 32 (384 threads) with K steps of 48 through one buffer and a scratch for
# all 12 (36 KiB; "c96"): whisper's N = 384 products over K >= 1152 15-21% faster than on
# 128 x 128, where those leave a wave mostly idle (``narrow_tiles_fill_better``); with K
# steps of 32 (8 subgroups, so that B's 24 vec4 columns do not divide the threads and its
# fetches are checked) 20% slower; two buffers do not fit 48 KiB. Run 40: NVIDIA's Vulkan
# driver gives a pipeline about 48 KiB of workgroup memory an SM (16 KiB: three workgroups
# an SM, 24 KiB two, 28 KiB or more one; Dawn and wgpu-native alike), so the tiles of 36
# and 46 KiB run alone; fitting 24 KiB by giving the results' scratch to 2 or 4 subgroups
# at a time (128 x 96; 128 x 128 with two buffers of K steps of 16) ran 15-160% slower,
# the scratch's turns costing more than a second workgroup an SM gains.
COOP = {"c128": CoopPreset(128, 128, 32, 4, 4), "c128l": CoopPreset(128, 128, 16, 4, 2, buffers=1),
        "c64": CoopPreset(64, 64, 32, 2, 2), "c64l": CoopPreset(64, 64, 32, 2, 2, buffers=1),
        "c96": CoopPreset(128, 96, 48, 4, 3, buffers=1, scratch=12)}
COOP_FRAGMENT = 16   # the subgroup-matrix shape used: f16 16 x 16 x 16 -> f32
COOP_ENABLES = ("f16", "chromium_experimental_subgroup_matrix")

TILED = {"64": TilePreset(4, 4, 16, False), "64u": TilePreset(4, 4, 16, True),
         "128x64": TilePreset(8, 4, 16, False), "128x64u": TilePreset(8, 4, 16, True),
         "128": TilePreset(8, 8, 16, False), "128u": TilePreset(8, 8, 16, True),
         "128k8": TilePreset(8, 8, 8, False), "128k8u": TilePreset(8, 8, 8, True),
         "64t128": TilePreset(8, 4, 16, False, ty=8), "64t128u": TilePreset(8, 4, 16, True, ty=8)}
MATMUL_KERNELS = ("simple", *TILED, *COOP)

# The two tiled operands as one description each: A's tile runs along m ("outer") and k,
# B's along n and k; both are stored k-major in workgroup memory.
_TILE_OPERANDS = {
    "a": dict(src="a_in", base="a0", s_outer="sam", s_k="sak", extent="M", origin="row0", smem="As",
              slots="AS"),
    "b": dict(src="b_in", base="b0", s_outer="sbn", s_k="sbk", extent="N", origin="col0", smem="Bs",
              slots="BS"),
}

def operand_fetch(strides, outer_extent: int, k_extent: int) -> str:
    """How the tiled kernel fetches an operand whose ``strides`` are its batch strides,
    then the strides of its outer axis (m for A, n for B) and of k: "outer-vec4" / "k-vec4" (vec4 loads
    along the contiguous axis: it has stride 1, its extent and every other stride are
    multiples of 4), else "outer-scalar" / "k-scalar" (scalar loads, threads
    consecutive along the axis with the smaller stride)."""
    s_outer, s_k = strides[-2], strides[-1]
    others_aligned = all(s % 4 == 0 for s in strides[:-2])
    if s_outer == 1 and s_k % 4 == 0 and outer_extent % 4 == 0 and others_aligned:
        return "outer-vec4"
    if s_k == 1 and s_outer % 4 == 0 and k_extent % 4 == 0 and others_aligned:
        return "k-vec4"
    return "outer-scalar" if s_outer <= s_k else "k-scalar"


def _fetch_operand(name: str, fetch: str, tile: int, bk: int, gather=None, threads: int = 256,
                   edges: str = "checked"):
    """WGSL that fetches one operand's tile of ``tile`` x ``bk`` elements (``threads`` threads):
    (per-thread index constants, register declarations, loads of step ``kb`` into the
    registers, the registers as (name, outer index, k index)). A vec4 register holds 4
    elements consecutive along the axis ``fetch`` names. ``gather(go, gk)`` (scalar
    fetches only) replaces the strided address by (setup lines, validity, address) of
    the element at outer index ``go``, k index ``gk``: an implicit-GEMM convolution
    reads its im2col matrix this way, straight from the tensor.

    ``edges`` says how a thread's fetches are checked against the operand's bounds:
    "checked", each element (the only way with a gather); "none", the operand's extent
    and K are multiples of the tile, so no fetch is ever outside; "clamp", K is a
    multiple of the step and outer coordinates past the operand are clamped to its last
    row or column (``_strided_loads``); "tiles", a tile that
    lies wholly inside the operand (a workgroup-uniform test, so no divergence) loads
    unchecked and only edge tiles check each element. Unchecked fetches address each
    register at a fixed distance from the first (``_strided_loads``). On the H100 the
    cooperative kernel ran 82 TFLOP/s at 4096^3 checked, 111 with "tiles" and 151 with
    "none": an edge path costs registers even where it never runs (run 18)."""
    p = _TILE_OPERANDS[name]
    vec = fetch.endswith("vec4")
    along_outer = fetch.startswith("outer")
    count = tile * bk // threads // (4 if vec else 1)
    width = (tile if along_outer else bk) // (4 if vec else 1)  # threads along the fast axis
    consts, decl, edge, regs = [], [], [], []
    zero = "vec4<f32>(0.0)" if vec else "0.0"
    for i in range(count):
        e, r = f"(tid + {threads * i}u)", f"{name}r{i}"
        fast, slow = f"{e} % {width}u", f"{e} / {width}u"
        o, kk = (fast, slow) if along_outer else (slow, fast)
        if vec and along_outer:
            o = f"4u * ({o})"
        if vec and not along_outer:
            kk = f"4u * ({kk})"
        consts.append(f"    let {name}o{i} = {o};")
        consts.append(f"    let {name}k{i} = {kk};")
        go, gk = f"{p['origin']} + {name}o{i}", f"kb + {name}k{i}"
        addr = f"{p['base']} + ({go}) * {p['s_outer']} + ({gk}) * {p['s_k']}"
        decl.append(f"    var {r} = {zero};")
        edge.append(f"        {r} = {zero};")
        if gather is not None:
            setup, valid, where = gather("go", "gk")
            edge.append(f"        {{ let go = {go}; let gk = kb + {name}k{i};")
            edge += [f"          {line}" for line in setup]
            edge.append(f"          if ({valid}) {{ {r} = {p['src']}[{where}]; }} }}")
        else:
            edge.append(f"        if ({go} < {p['extent']} && {gk} < K) "
                        f"{{ {r} = {p['src']}[{'(' + addr + ') >> 2u' if vec else addr}]; }}")
        regs.append((r, f"{name}o{i}", f"{name}k{i}"))
    if gather is not None or threads % width or edges == "checked":
        return consts, decl, edge, regs
    first, addresses = _strided_loads(name, fetch, threads // width, count, edges == "clamp")
    consts += first
    loads = [f"{r} = {p['src']}[{a}];" for (r, _, _), a in zip(regs, addresses)]
    if edges in ("none", "clamp"):
        return consts, decl, [f"        {line}" for line in loads], regs
    inside = f"{p['origin']} + {tile}u <= {p['extent']} && kb + {bk}u <= K"
    load = [f"        if ({inside}) {{", *(f"            {line}" for line in loads),
            "        } else {", *(f"    {line}" for line in edge), "        }"]
    return consts, decl, load, regs


def _strided_loads(name: str, fetch: str, rows: int, count: int, clamp: bool) -> tuple[list[str], list[str]]:
    """The addresses of a thread's ``count`` fetches of one operand at step ``kb``:
    register i sits ``rows`` rows of the slow axis after register i - 1, so one base
    (``{name}p``, at k = 0) and one step (``{name}q``) address them all. A vec4 fetch
    is addressed in vec4s: its strides other than the unit one, its batch offset and its
    coordinates along the unit axis are multiples of 4 (``operand_fetch``). ``clamp``:
    the outer coordinate is clamped to the operand's last row (column), so a tile that
    hangs over the operand's end reads rows it has instead of past its buffer; what it
    computes there, store() drops. Where the outer axis is the slow one that gives each
    register a base of its own. Returns (lines before the loop, the addresses)."""
    p = _TILE_OPERANDS[name]
    base, origin, s_o, s_k, ext = p["base"], p["origin"], p["s_outer"], p["s_k"], p["extent"]
    vec = fetch.endswith("vec4")
    slow_outer = fetch.startswith("k")   # k-vec4, k-scalar: registers step along the outer axis
    div = (lambda x: f"({x} >> 2u)" if x.isidentifier() else f"(({x}) >> 2u)") if vec else (lambda x: x)
    k_part = {"k-vec4": ("(kb >> 2u)", f"({name}k0 >> 2u)"), "outer-vec4": (f"kb * ({s_k} >> 2u)", None)}
    kb_term, k0_term = k_part.get(fetch, (f"kb * {s_k}", None))
    k0_term = k0_term or f"{name}k0 * {div(s_k)}"
    if slow_outer and clamp:
        first = [f"    let {name}p{i} = {div(base)} + min({origin} + {name}o{i}, {ext} - 1u) * {div(s_o)} + {k0_term};"
                 for i in range(count)]
        return first, [f"{name}p{i} + {kb_term}" for i in range(count)]
    if slow_outer:
        outer = f"({origin} + {name}o0) * {div(s_o)}"
        step = div(s_o)
    else:
        row = f"min({origin} + {name}o0, {ext} - {4 if vec else 1}u)" if clamp else f"{origin} + {name}o0"
        outer = div(row) if vec else f"({row}) * {s_o}"
        step = div(s_k)
    first = [f"    let {name}p = {div(base)} + {outer} + {k0_term};", f"    let {name}q = {rows}u * {step};"]
    return first, [f"{name}p + {kb_term} + {i}u * {name}q" for i in range(count)]


def _store_tiled(name: str, fetch: str, regs) -> list[str]:
    """Stores of the fetched registers into buffer ``buf`` of the f32 kernel's k-major
    vec4 tile."""
    p = _TILE_OPERANDS[name]
    slot = lambda k: f"{p['smem']}[buf * {p['slots']} * BK + ({k}) * {p['slots']}"
    out = []
    for r, o, k in regs:
        if fetch == "outer-vec4":
            out.append(f"        {slot(k)} + {o} / 4u] = {r};")
        elif fetch == "k-vec4":
            out += [f"        {slot(f'{k} + {j}u')} + {o} / 4u][{o} % 4u] = {r}.{c};" for j, c in enumerate("xyzw")]
        else:
            out.append(f"        {slot(k)} + {o} / 4u][{o} % 4u] = {r};")
    return out


def _coop_layout(fetch: str) -> str:
    """How the cooperative kernel lays an operand's f16 tile out: along the axis it is
    fetched along, so that a thread's 4 fetched elements land side by side ("k-major":
    element (o, k) at k * slots + o; "outer-major": at o * slots + k)."""
    return "k-major" if fetch.startswith("outer") else "outer-major"


def _absmax(fetch: str, regs) -> list[str]:
    """The largest |value| of each fetched register (a vec4's or a scalar's)."""
    return [f"max(max(abs({r}).x, abs({r}).y), max(abs({r}).z, abs({r}).w))" if fetch.endswith("vec4")
            else f"abs({r})" for r, _, _ in regs]


def _store_coop(name: str, fetch: str, regs, scale: str = "") -> list[str]:
    """Stores of the fetched registers, times ``scale`` (a WGSL expression) if given and
    rounded to f16, into buffer ``buf`` of the cooperative kernel's f16 tile
    (``_coop_layout``); a scaled operand's registers also raise ``amax_{name}``."""
    times = f" * {scale}" if scale else ""
    p = _TILE_OPERANDS[name]
    tile, slots = f"{p['smem'][0]}h", p["slots"]
    one = "ABUF" if name == "a" else "BBUF"
    if _coop_layout(fetch) == "k-major":
        at = lambda k, o: f"{tile}[buf * {one} + ({k}) * {slots} + {o}]"
    else:
        at = lambda k, o: f"{tile}[buf * {one} + ({o}) * {slots} + {k}]"
    out = []
    for r, o, k in regs:
        if fetch.endswith("vec4"):
            place = (lambda j: (k, f"{o} + {j}u")) if fetch.startswith("outer") else (lambda j: (f"{k} + {j}u", o))
            out.append(f"        {{ let h = vec4<f16>({r}{times}); " +
                       " ".join(f"{at(*place(j))} = h.{c};" for j, c in enumerate("xyzw")) + " }")
        else:
            out.append(f"        {at(k, o)} = f16({r}{times});")
    if scale:
        out += [f"        amax_{name} = max(amax_{name}, {m});" for m in _absmax(fetch, regs)]
    return out


SCALE_BUCKET = 4.0   # exponents a scale covers: a range's exponent picks 2^(11 - 4 floor(e / 4))
SCALE_TOP = 15.0 - SCALE_BUCKET   # so the largest |value| lands in [2^11, 2^15), inside f16's 65504


def _coop_scales(names, accumulators, warps: int) -> dict[str, str]:
    """Scales of the named (gradient) operands into f16's range, without a pass of their
    own: a power of two per operand and workgroup, ``scale_{name}`` = 2^(SCALE_TOP - q)
    for q the operand's largest exponent over the workgroup's K range rounded down to a
    multiple of SCALE_BUCKET, which puts its largest |value| in [2^11, 2^15) (f16's
    range, 65504, and its precision both fit a gradient of any magnitude, and the scale
    is exact to undo). q is not known before the K loop, so the loop runs with the q this
    workgroup found at the previous step (kept in ``scale_state``, the kernel's state
    buffer; none at the first step), raising ``amax_{name}`` as it rounds the operand;
    where the q it then finds differs, the loop runs again with it (the accumulators
    restarted). The results therefore always come from the q of the operand itself, so
    they do not depend on the previous step, and a run resumed from a checkpoint computes
    what an uninterrupted one does. A scan of the operand before the loop cost 1.2 ms of
    whisper's 21.4 ms f16 step (run 32). The subgroups' maxima, the new q and the
    decision to run again meet in the results' scratch (``Cs``, free until the results
    leave). Returns the template's KEPT_SCALES, ATTEMPT_BEGIN and ATTEMPT_END, and the
    exponent the results are multiplied back by."""
    slot = "((wg.z * nwg.y + wg.y) * nwg.x + wg.x) * 2u"
    pre = [line for i, n in enumerate(names) for line in (
        f"    let kept_{n} = scale_state[{slot} + {i}u];",   # 0: none yet, else q + 512
        f"    var q_{n} = select(0.0, f32(i32(kept_{n}) - 512), kept_{n} != 0u);", f"    var used_{n} = q_{n};")]
    begin = ["    for (var attempt = 0u; attempt < 2u; attempt = attempt + 1u) {"]
    begin += [line for n in names for line in (f"    used_{n} = q_{n};", f"    let scale_{n} = exp2({SCALE_TOP} - q_{n});",
                                                f"    var amax_{n} = 0.0;")]
    begin += [f"    {acc} = subgroup_matrix_result<f32, {COOP_FRAGMENT}, {COOP_FRAGMENT}>();" for acc in accumulators]
    end = [f"    {{ let top = subgroupMax(amax_{n}); if (lane == 0u) {{ Cs[sg * 2u + {i}u] = top; }} }}"
           for i, n in enumerate(names)]
    # after the subgroups' maxima in Cs: each operand's q, then whether to run again (1.0)
    q_at, retry_at = lambda i: f"Cs[{2 * warps + i}u]", f"Cs[{2 * warps + 2}u]"
    end += ["    workgroupBarrier();", "    if (tid == 0u) {", f"        {retry_at} = 0.0;"]
    for i, n in enumerate(names):
        end += ["        {", "        var wmax = 0.0;",
                f"        for (var w = 0u; w < {warps}u; w = w + 1u) {{ wmax = max(wmax, Cs[w * 2u + {i}u]); }}",
                "        let e = select(0.0, floor(log2(wmax)), wmax > 0.0);",
                f"        {q_at(i)} = clamp(floor(e / {SCALE_BUCKET}) * {SCALE_BUCKET}, -100.0, 100.0);",
                f"        if ({q_at(i)} != q_{n}) {{ {retry_at} = 1.0; }}", "        }"]
    end += ["    }", f"    let retry = workgroupUniformLoad(&{retry_at});",
            *(f"    q_{n} = workgroupUniformLoad(&{q_at(i)});" for i, n in enumerate(names)),
            "    if (retry == 0.0) { break; }", "    }",
            "    if (tid == 0u) {",
            *(f"        scale_state[{slot} + {i}u] = u32(i32(q_{n}) + 512);" for i, n in enumerate(names)), "    }"]
    back = " + ".join(f"(used_{n} - {SCALE_TOP})" for n in names)
    return dict(KEPT_SCALES="\n".join(pre), ATTEMPT_BEGIN="\n".join(begin), ATTEMPT_END="\n".join(end), back=back)


def _coop_fragment(name: str, fetch: str, outer: str, kk: int) -> str:
    """subgroupMatrixLoad of one 16 x 16 f16 fragment: A's (left, rows m) or B's
    (right, columns n) at outer offset ``outer`` and k step ``kk`` of the current buffer."""
    f = COOP_FRAGMENT
    kind, tile, base, slots = (("left", "Ah", "ab", "AS") if name == "a" else ("right", "Bh", "bb", "BS"))
    if _coop_layout(fetch) == "k-major":
        offset, along_k = f"{base} + {kk * f}u * {slots} + {outer}", name == "a"
    else:
        offset, along_k = f"{base} + ({outer}) * {slots} + {kk * f}u", name == "b"
    return (f"subgroupMatrixLoad<subgroup_matrix_{kind}<f16, {f}, {f}>>(&{tile}, {offset}, "
            f"{'true' if along_k else 'false'}, {slots})")


def _coop_subs(preset: str, fetch_a: str, fetch_b: str, gather_a=None, gather_b=None, lets=(),
               edges=(None, None), scaled=(False, False)) -> dict:
    """matmul_tiled.wgsl's generated parts for a ``COOP`` preset: the operands are fetched
    as for the f32 kernel (``_fetch_operand``), rounded to f16 into tiles laid out along
    their fetch (``_coop_layout``), and each subgroup multiplies its fragments with
    subgroupMatrixMultiplyAccumulate (each fragment loaded column- or row-major to
    match its tile). The accumulators leave one fragment at a time through the
    subgroup's 16 x 16 f32 scratch, each lane passing its share to store4() 4 columns at
    a time (epilogue, bounds); past the preset's ``scratch`` subgroups, they take turns
    with the scratch.
    ``edges``: how A's and B's fetches meet their bounds (``_fetch_operand``; None: only
    edge tiles check each element). ``scaled``: which operands are scaled by
    a power of two into f16's range first (``_coop_scales``; gradients), the results
    scaled back in f32."""
    c = COOP[preset]
    f = COOP_FRAGMENT
    fm, fn = c.bm // c.wm // f, c.bn // c.wn // f
    frags = [(i, j) for i in range(fm) for j in range(fn)]
    decl = [f"    var acc{i}_{j} = subgroup_matrix_result<f32, {f}, {f}>();" for i, j in frags]
    decl += [f"    let wrow = sg / {c.wn}u * {c.bm // c.wm}u;", f"    let wcol = sg % {c.wn}u * {c.bn // c.wn}u;"]
    comp = []
    for kk in range(c.bk // f):
        comp += [f"        let l{kk}_{i} = {_coop_fragment('a', fetch_a, f'wrow + {i * f}u', kk)};" for i in range(fm)]
        comp += [f"        let r{kk}_{j} = {_coop_fragment('b', fetch_b, f'wcol + {j * f}u', kk)};" for j in range(fn)]
        comp += [f"        acc{i}_{j} = subgroupMatrixMultiplyAccumulate(l{kk}_{i}, r{kk}_{j}, acc{i}_{j});"
                 for i, j in frags]
    edges = [mode or "tiles" for mode in edges]
    ca, da, la, ra = _fetch_operand("a", fetch_a, c.bm, c.bk, gather_a, c.threads, edges[0])
    cb, db, lb, rb = _fetch_operand("b", fetch_b, c.bn, c.bk, gather_b, c.threads, edges[1])
    picked = [n for n, on in zip("ab", scaled) if on]
    scales = (_coop_scales(picked, [f"acc{i}_{j}" for i, j in frags], c.threads // 32) if picked
              else dict(KEPT_SCALES="", ATTEMPT_BEGIN="", ATTEMPT_END="", back=""))
    back = f" * exp2({scales.pop('back')})" if picked else ""
    subgroups = c.threads // 32
    scratch, rounds = min(subgroups, c.scratch), -(-subgroups // c.scratch)
    store = []
    for (i, j), turn in ((frag, turn) for frag in frags for turn in range(rounds)):
        mine = f"if (sg / {scratch}u == {turn}u) " if rounds > 1 else ""
        at = f"sg % {scratch}u * {f * f}u" if rounds > 1 else f"sg * {f * f}u"
        store += [f"    {mine}{{ subgroupMatrixStore(&Cs, {at}, acc{i}_{j}, false, {f}u); }}",
                  "    workgroupBarrier();",
                  f"    {mine}{{ for (var q = lane; q < {f * f // 4}u; q = q + sg_size) {{",
                  f"        let o = {at} + q * 4u;",
                  f"        store4(b, wg.z, row0 + wrow + {i * f}u + q / {f // 4}u, col0 + wcol + {j * f}u + q % {f // 4}u * 4u,"
                  f" vec4<f32>(Cs[o], Cs[o + 1u], Cs[o + 2u], Cs[o + 3u]){back});",
                  "    } }",
                  "    workgroupBarrier();"]
    # f16 slots per row of each tile, padded by 8 against bank conflicts (rows stay 16-byte aligned)
    (a_slots, a_buf), (b_slots, b_buf) = (_coop_tile(fetch, tile, c.bk) for fetch, tile in ((fetch_a, c.bm),
                                                                                           (fetch_b, c.bn)))
    smem = (f"var<workgroup> Ah: array<f16, {c.buffers * a_buf}>;\n"
            f"var<workgroup> Bh: array<f16, {c.buffers * b_buf}>;\n"
            f"var<workgroup> Cs: array<f32, {scratch * f * f}>;")
    one = c.buffers == 1   # buffer 1 is buffer 0: the products must be done before the next step is stored
    args = (",\n        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,"
            " @builtin(subgroup_size) sg_size: u32")
    # subgroups take turns with the scratch: a branch on subgroup_id, uniform in each subgroup only
    main_attrs = " @diagnostic(off, chromium.subgroup_matrix_uniformity)" if rounds > 1 else ""
    return dict(BM=c.bm, BN=c.bn, BK=c.bk, TM=f, TN=f, AS=a_slots, BS=b_slots, ABUF=0 if one else a_buf,
                BBUF=0 if one else b_buf, RESTAGE="        workgroupBarrier();" if one else "", THREADS=c.threads,
                SMEM=smem, ARGS=args, MAIN_ATTRS=main_attrs, THREAD_XY="", STATE=bool(picked),
                **scales,
                ENABLES=COOP_ENABLES + (("subgroups",) if picked else ()),
                ACC_DECL="\n".join(decl), COMPUTE="\n".join(comp), STORE_OUT="\n".join(store),
                LOAD_DECL="\n".join([*lets, *ca, *cb, *da, *db]), LOAD="\n".join(la + lb),
                STORE="\n".join(_store_coop("a", fetch_a, ra, "scale_a" if scaled[0] else "")
                                + _store_coop("b", fetch_b, rb, "scale_b" if scaled[1] else "")))


def _coop_tile(fetch: str, tile: int, bk: int) -> tuple[int, int]:
    """(f16 slots a row, f16 elements a buffer) of one operand's tile."""
    slots = (tile if _coop_layout(fetch) == "k-major" else bk) + 8
    return slots, slots * (bk if _coop_layout(fetch) == "k-major" else tile)


def coop_workgroup_bytes(preset: str) -> int:
    """Workgroup memory of a cooperative kernel at most (the larger tile layout): the f16
    buffers of each operand tile and the subgroups' f32 scratch."""
    c = COOP[preset]
    buf = lambda tile: max(_coop_tile(fetch, tile, c.bk)[1] for fetch in ("outer-vec4", "k-vec4"))
    return 2 * c.buffers * (buf(c.bm) + buf(c.bn)) + 4 * min(c.threads // 32, c.scratch) * COOP_FRAGMENT ** 2


def _tile_subs(variant: str, fetch_a: str, fetch_b: str, gather_a=None, gather_b=None, lets=(),
               mnk=(0, 0, 0), scaled=(False, False)) -> dict:
    """matmul_tiled.wgsl's generated parts for any tiled variant, f32 or cooperative, for
    an m x n x k product (which operand tiles always lie inside their operand); a
    cooperative kernel scales the ``scaled`` operands into f16's range."""
    make = _coop_subs if variant in COOP else _tiled_subs
    (bm, bn), bk = _tile_of(variant), (COOP[variant].bk if variant in COOP else TILED[variant].bk)
    m_, n_, k_ = mnk
    edges = [_edges(extent, tile, k_, bk) for extent, tile in ((m_, bm), (n_, bn))]
    return make(variant, fetch_a, fetch_b, gather_a, gather_b, lets, edges, scaled)


def _edges(extent: int, tile: int, k_: int, bk: int) -> str:
    """How an operand of ``extent`` rows (columns) and reduction ``k_`` is fetched in tiles
    of ``tile`` x ``bk`` without per-element checks where it can be (``_fetch_operand``):
    "none" when both divide, "clamp" when only K does, else None (the kernel's choice)."""
    if extent <= 0 or k_ <= 0 or k_ % bk:
        return None
    return "none" if extent % tile == 0 else "clamp"


def _tiled_subs(preset: str, fetch_a: str, fetch_b: str, gather_a=None, gather_b=None, lets=(),
                edges=(None, None), scaled=(False, False)) -> dict:
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
    cb, db, lb, rb = _fetch_operand("b", fetch_b, bn, bk, gather_b, threads, edges[1])
    sa, sb = _store_tiled("a", fetch_a, ra), _store_tiled("b", fetch_b, rb)
    smem = (f"var<workgroup> As: array<vec4<f32>, {2 * bk * (bm // 4 + 1)}>;\n"
            f"var<workgroup> Bs: array<vec4<f32>, {2 * bk * (bn // 4 + 1)}>;")
    return dict(BM=bm, BN=bn, BK=bk, TM=tm, TN=tn, AS=bm // 4 + 1, BS=bn // 4 + 1, THREADS=threads,
                ABUF=bk * (bm // 4 + 1), BBUF=bk * (bn // 4 + 1), RESTAGE="", SMEM=smem, ARGS="", MAIN_ATTRS="",
                KEPT_SCALES="", ATTEMPT_BEGIN="", ATTEMPT_END="", STATE=False,
                ACC_DECL=decl, COMPUTE="\n".join(comp), STORE_OUT="\n".join(store),
                LOAD_DECL="\n".join([*lets, *ca, *cb, *da, *db]), LOAD="\n".join(la + lb),
                STORE="\n".join(sa + sb))
