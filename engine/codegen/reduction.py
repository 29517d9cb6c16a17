"""Row reductions with a prologue/epilogue: reductions, softmax, norms, losses, sum_to
and the row kernels of the backward pass (norm gradients, cross-entropy gradient).
"""

from __future__ import annotations

import math

from ..graph.ir import Graph, Node
from .common import Capabilities, Kernel, PLAIN, _finish, _template, contiguous_strides, f32_bits, grid_1d, i32_bits


# ---------------------------------------------------------------- reductions

def row_threads(n: int) -> int:
    """Threads of a row kernel's workgroup (reduce_row.wgsl) for rows of ``n``: about 8
    elements a thread, a power of two from 64 to 256. A workgroup of 256 on a row of 384
    (whisper's layer norms) left most threads one element and the GPU few rows in flight
    (the H100 keeps 8 such workgroups an SM, against 32 of 64 threads)."""
    return min(256, max(64, 1 << (-(-n // 8) - 1).bit_length()))


_ROW_MODES = {
    "sum": """    var s = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { s = s + x[base + i]; }
    s = wg_sum(s, t);
    if (t == 0u) { out[row] = s; }""",
    "mean": """    var s = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { s = s + x[base + i]; }
    s = wg_sum(s, t);
    if (t == 0u) { out[row] = s / f32(N); }""",
    "max": """    var s = -3.4028234e38;
    for (var i = t; i < N; i = i + WG_THREADS) { s = max(s, x[base + i]); }
    s = wg_max(s, t);
    if (t == 0u) { out[row] = s; }""",
    "softmax": """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + WG_THREADS) { mx = max(mx, x[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { s = s + exp(x[base + i] - mx); }
    s = wg_sum(s, t);
    let inv = 1.0 / s;
    for (var i = t; i < N; i = i + WG_THREADS) { out[base + i] = exp(x[base + i] - mx) * inv; }""",
    "log_softmax": """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + WG_THREADS) { mx = max(mx, x[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { s = s + exp(x[base + i] - mx); }
    s = wg_sum(s, t);
    let lse = mx + log(s);
    for (var i = t; i < N; i = i + WG_THREADS) { out[base + i] = x[base + i] - lse; }""",
    "layer_norm": """    var s = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { s = s + x[base + i]; }
    let mu = wg_sum(s, t) / f32(N);
    var q = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { let d = x[base + i] - mu; q = q + d * d; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var i = t; i < N; i = i + WG_THREADS) { out[base + i] = (x[base + i] - mu) * r * w[i] + bias[i]; }""",
    "rms_norm": """    var q = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { let v = x[base + i]; q = q + v * v; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var i = t; i < N; i = i + WG_THREADS) { out[base + i] = x[base + i] * r * w[i]; }""",
}

_ROW_OPERANDS = {"layer_norm": ["x", "w", "bias"], "rms_norm": ["x", "w"]}

# Norms over rows a multiple of 4 wide, at most NORM_HELD_VEC4 vec4s a thread: the row is
# read once, as vec4s held in registers for the mean, the variance and the output (the
# scalar modes above read it three times, a float a thread at a time). Whisper's layer
# norms ([12000, 384]) took 24 us each on the H100 that way, 1.5 TB/s.
NORM_HELD_VEC4 = 4
_HELD_NORMS = {
    "layer_norm": """    var s = 0.0;
    for (var j = 0u; j < HELD; j = j + 1u) {
        let i = t + j * WG_THREADS;
        if (i < N4) { v[j] = x[base4 + i]; s = s + v[j].x + v[j].y + v[j].z + v[j].w; }
    }
    let mu = wg_sum(s, t) / f32(N);
    var q = 0.0;
    for (var j = 0u; j < HELD; j = j + 1u) {
        if (t + j * WG_THREADS < N4) { let d = v[j] - vec4<f32>(mu); q = q + dot(d, d); }
    }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var j = 0u; j < HELD; j = j + 1u) {
        let i = t + j * WG_THREADS;
        if (i < N4) { out[base4 + i] = (v[j] - vec4<f32>(mu)) * r * w[i] + bias[i]; }
    }""",
    "rms_norm": """    var q = 0.0;
    for (var j = 0u; j < HELD; j = j + 1u) {
        let i = t + j * WG_THREADS;
        if (i < N4) { v[j] = x[base4 + i]; q = q + dot(v[j], v[j]); }
    }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var j = 0u; j < HELD; j = j + 1u) {
        let i = t + j * WG_THREADS;
        if (i < N4) { out[base4 + i] = v[j] * r * w[i]; }
    }""",
}


def _held_norm(node: Node, rows: int, n: int, eps: float, caps: Capabilities) -> Kernel | None:
    """A layer or RMS norm over rows of ``n`` held in registers as vec4s (``_HELD_NORMS``);
    None where the rows are not a multiple of 4 wide or too long for NORM_HELD_VEC4 vec4s
    a thread."""
    threads = row_threads(n)
    held = -(-n // (4 * threads))
    if node.op not in _HELD_NORMS or n % 4 or held > NORM_HELD_VEC4:
        return None
    names = _ROW_OPERANDS[node.op]
    mode = "\n".join([f"    const HELD = {held}u;", "    let N4 = N / 4u;", "    let base4 = row * N4;",
                      "    var v: array<vec4<f32>, HELD>;", _HELD_NORMS[node.op]])
    kernel = _finish(f"reduce:{node.op}", "reduction", "reduce_row.wgsl", names, ["vec4<f32>"] * len(names),
                     "vec4<f32>", [rows, n, f32_bits(eps)], grid_1d(rows), caps, MODE=mode, THREADS=threads)
    kernel.notes["variant"] = f"rows held as {held} vec4s a thread"
    return kernel


def _row_reduce(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    x = graph[node.inputs[0]]
    if node.op in ("sum", "mean", "max") and node.attrs.get("axis") is None:
        rows, n = 1, x.size
    else:
        n = x.shape[-1] if x.shape else 1
        rows = x.size // max(n, 1)
    eps = node.attrs.get("eps", 0.0)
    if node.op in _SHORT_ROWS and n <= SHORT_ROW:
        init, combine, finish = _SHORT_ROWS[node.op]
        kernel = _finish(f"reduce:{node.op}", "reduction", "reduce_short_rows.wgsl", ["x"], ["f32"], "f32",
                         [rows, n, 0], grid_1d(-(-rows // 256)), INIT=init, COMBINE=combine, FINISH=finish)
        kernel.notes["variant"] = "a thread a row"
        return kernel
    held = _held_norm(node, rows, n, eps, caps)
    if held is not None:
        return held
    names = _ROW_OPERANDS.get(node.op, ["x"])
    return _finish(f"reduce:{node.op}", "reduction", "reduce_row.wgsl", names, ["f32"] * len(names),
                   "f32", [rows, n, f32_bits(eps)], grid_1d(rows), caps, MODE=_ROW_MODES[node.op],
                   THREADS=row_threads(n))


ARGMAX_UNROLL = 16   # loads a thread keeps in flight


def _argmax(graph: Graph, node: Node, caps: Capabilities = PLAIN, partials: int = 0) -> Kernel:
    """argmax.wgsl: a row a workgroup, as many threads as the adapter allows (a power of two,
    at most 1024) where the row fills them, else 256. ``partials``: the one row comes as that
    many (value, index) pairs, a product's workgroups' best (``argmax_of_partials``)."""
    x = graph[node.inputs[0]]
    n = partials or x.shape[-1]
    threads = 256
    while threads * 2 <= min(caps.invocations, 1024) and threads * 2 * ARGMAX_UNROLL <= n:
        threads *= 2
    element = (dict(VALUE="bitcast<f32>(x[2u * (base + j)])", INDEX="x[2u * (base + j) + 1u]") if partials
               else dict(VALUE="x[base + j]", INDEX="j"))
    return _finish("reduce:argmax", "reduction", "argmax.wgsl", ["x"], ["u32" if partials else "f32"], "i32",
                   [1 if partials else x.size // n, n], grid_1d(1 if partials else x.size // n), THREADS=threads,
                   UNROLL=ARGMAX_UNROLL, ORDER=_template("argmax_order.wgsl"), **element)


def argmax_partials_slots(binding: int) -> dict[str, str]:
    """matmul_vector.wgsl's slots with which a one-row product's workgroup also leaves the
    best of its columns' values (argmax_order.wgsl's order) and that column, two words at
    ``best[2 wx]``, its own binding ``binding``, for ``argmax_of_partials``."""
    decl = "\n".join([f"@group(0) @binding({binding}) var<storage, read_write> best: array<u32>;",
                       "var<workgroup> col_v: array<f32, COLS * WIDTH>;", _template("argmax_order.wgsl")])
    after_loop = ["workgroupBarrier();",
                  "if (t == 0u) {",
                  "    var bv = 0.0;",
                  "    var bi = 0xffffffffu;",
                  "    for (var o = 0u; o < COLS * WIDTH; o = o + 1u) {",
                  "        let col = wx * COLS * WIDTH + o;",
                  "        if (col < N && better(col_v[o], col, bv, bi)) { bv = col_v[o]; bi = col; }",
                  "    }",
                  "    best[2u * wx] = bitcast<u32>(bv);",
                  "    best[2u * wx + 1u] = bi;",
                  "}"]
    return {"DECL": decl, "AFTER_OUT": "        col_v[within] = v;",
            "AFTER_LOOP": "\n".join("    " + line for line in after_loop)}


def argmax_of_partials(graph: Graph, node: Node, count: int, caps: Capabilities = PLAIN) -> Kernel:
    """The kernel of argmax ``node`` (of one row) reading the (value, index) pairs that the
    ``count`` workgroups of the product computing its row leave (``product_with_argmax``),
    not the row: a decode step's argmax over 128,256 logits took 47 us on one SM (run 52),
    and its workgroups' best are an eighth as many."""
    kernel = _argmax(graph, node, caps, partials=count)
    kernel.notes["variant"] = f"over {count} workgroups' best values"
    return kernel


SHORT_ROW = 64   # rows this short take a thread each (reduce_short_rows.wgsl), not a workgroup
_SHORT_ROWS = {"sum": ("0.0", "a + b", "s"), "mean": ("0.0", "a + b", "s / f32(N)"),
               "max": ("-3.4028234e38", "max(a, b)", "s")}


# A row's maximum mx and sum s of exp(logit - mx) in one pass over the logits (the online
# softmax: each thread's sum rescaled where its maximum grows, then the threads' sums to
# the row's maximum): SmolLM2's cross-entropy over 1,024 x 49,152 logits read them twice
# for these, its gradient three times.
_ONLINE_SOFTMAX = """    var mx = -3.4028234e38;
    var s = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) {
        let x = logits[base + i];
        let grown = max(mx, x);
        s = s * exp(mx - grown) + exp(x - grown);
        mx = grown;
    }
    let top = wg_max(mx, t);
    s = wg_sum(s * exp(mx - top), t);
    mx = top;"""


# Losses reduce a whole tensor to one number. One workgroup doing it all was latency
# bound (gpt-tiny's cross_entropy over 2048 x 257 logits: 0.27 ms; whisper's mse_loss
# over 576k elements: 0.26 ms), so a loss runs in two dispatches: a row kernel
# (reduce_row.wgsl: a workgroup per row of logits, or per chunk of elements) leaves a
# pair (sum, count) per row in a scratch buffer, and loss_total.wgsl divides the sum of
# the sums by the sum of the counts (at least 1: an all-ignored batch gives 0).
LOSS_CHUNK = 4096  # elements per workgroup of the elementwise losses

_LOSS_ROWS = {
    "cross_entropy": """    let label = labels[row];
{{ONLINE_SOFTMAX}}
    if (t == 0u) {
        let kept = label != mi(3u);
        let li = u32(clamp(label, 0, i32(N) - 1));
        out[2u * row] = select(0.0, mx + log(s) - logits[base + li], kept);
        out[2u * row + 1u] = select(0.0, 1.0, kept);
    }""".replace("{{ONLINE_SOFTMAX}}", _ONLINE_SOFTMAX),
    "soft_cross_entropy": """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + WG_THREADS) { mx = max(mx, logits[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    var ts = 0.0;
    var tl = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) {
        s = s + exp(logits[base + i] - mx);
        ts = ts + tgt[base + i];
        tl = tl + tgt[base + i] * logits[base + i];
    }
    s = wg_sum(s, t);
    ts = wg_sum(ts, t);
    tl = wg_sum(tl, t);
    if (t == 0u) { out[2u * row] = ts * (mx + log(s)) - tl; out[2u * row + 1u] = 1.0; }""",
}

# the elementwise losses: the term of element i, summed over each chunk of LOSS_CHUNK
_LOSS_TERMS = {
    "bce_loss": "max(logits[i], 0.0) - logits[i] * tgt[i] + log(1.0 + exp(-abs(logits[i])))",
    "mse_loss": "(pred[i] - tgt[i]) * (pred[i] - tgt[i])",
}


def _chunk_sum(term: str) -> str:
    return f"""    let total = m(3u);
    let end = min(base + N, total);
    var s = 0.0;
    for (var i = base + t; i < end; i = i + WG_THREADS) {{ s = s + {term}; }}
    s = wg_sum(s, t);
    if (t == 0u) {{ out[2u * row] = s; out[2u * row + 1u] = f32(end - base); }}"""


def _loss(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    x = graph[node.inputs[0]]
    types = ["i32" if graph[i].dtype == "i32" else "f32" for i in node.inputs]
    if node.op in _LOSS_ROWS:
        n = x.shape[-1]
        rows = x.size // n
        names = ["logits", "labels" if node.op == "cross_entropy" else "tgt"]
        meta = [rows, n, 0, i32_bits(node.attrs.get("ignore_index", -100))]
        mode = _LOSS_ROWS[node.op]
    else:
        rows, n = max(1, -(-x.size // LOSS_CHUNK)), LOSS_CHUNK
        names = ["logits", "tgt"] if node.op == "bce_loss" else ["pred", "tgt"]
        meta = [rows, n, 0, x.size]
        mode = _chunk_sum(_LOSS_TERMS[node.op])
    k = _finish(f"loss:{node.op}", "reduction", "reduce_row.wgsl", names, types, "f32", meta, grid_1d(rows),
                caps, MODE=mode, THREADS=row_threads(n))
    k.partials = 2 * rows
    k.finish = _finish("loss:total", "reduction", "loss_total.wgsl", ["partials"], ["f32"], "f32", [rows],
                       (1, 1, 1), caps)
    return k


def _sum_to(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    return sum_to_kernel(graph[node.inputs[0]].shape, node.shape, caps)


def sum_to_kernel(in_shape, out_shape, caps: Capabilities = PLAIN) -> Kernel:
    """A kernel adding a tensor of ``in_shape`` up to ``out_shape`` (its shape with axes
    summed to 1 or dropped in front): ``sum_to``, and the finish of a kernel whose
    workgroups leave partial sums."""
    r = len(in_shape)
    out_p = (1,) * (r - len(out_shape)) + tuple(out_shape)
    size, whole = math.prod(out_shape), math.prod(in_shape)
    if r > 1 and out_p == tuple(in_shape[:-1]) + (1,) and in_shape[-1] > 1:
        # only the last axis summed (layer-norm gradients): a row reduction reads it coalesced
        n = in_shape[-1]
        return _finish("sum_to", "reduction", "reduce_row.wgsl", ["x"], ["f32"], "f32", [whole // n, n, 0],
                       grid_1d(whole // n), caps, MODE=_ROW_MODES["sum"], THREADS=row_threads(n))
    xs = contiguous_strides(in_shape)
    kept = [xs[d] if out_p[d] == in_shape[d] else 0 for d in range(r)]
    red = [in_shape[d] if out_p[d] != in_shape[d] else 1 for d in range(r)]
    meta = [size, math.prod(red)] + list(out_p) + kept
    # Long reductions get more lanes per output, 64 when 16 would leave the GPU mostly
    # idle (a bias gradient: 384 outputs made 24 workgroups; ``tuning.sum_workgroups``
    # fill it); a short one keeps one lane per output. (Splitting a bias gradient's rows
    # among more workgroups, the parts added by a second dispatch, made the kernel faster
    # and the step slower on the H100: benchmarks.md run 29.)
    count = math.prod(red)
    fill = caps.tuning.sum_workgroups
    outs = 256 if count <= 4 else 64 if count <= 64 else 16 if size >= 16 * fill else 4
    return _finish("sum_to", "reduction", "sum_to.wgsl", ["x"], ["f32"], "f32", meta,
                   grid_1d(-(-size // outs)), RANK=r, OUTS=outs, REDUCED_OFFSET=_reduced_offset(red, xs),
                   UNROLL=SUM_TO_UNROLL, LAST=SUM_TO_UNROLL - 1, SUM=_pairwise([f"v{u}" for u in range(SUM_TO_UNROLL)]),
                   LOADS="\n".join(f"            let v{u} = x[base + reduced_offset(k + {u}u * LANES)];"
                                   for u in range(SUM_TO_UNROLL)))


def add_copies(kernel: Kernel, copies: int, size: int, caps: Capabilities, name: str, what: str) -> Kernel:
    """Make ``kernel``, whose output binding now receives ``copies`` partial results of
    ``size`` floats one after another, the first stage of a node whose second dispatch
    (``sum_to_kernel``, named ``name``) adds them; ``what`` names the copies in its variant."""
    kernel.partials = copies * size
    kernel.finish = sum_to_kernel((copies, size), (size,), caps)
    kernel.finish.name = name
    kernel.notes["variant"] += f", {what} added by a second dispatch"
    return kernel


SUM_TO_UNROLL = 8    # elements a thread loads before it adds them


def _pairwise(terms: list[str]) -> str:
    """``terms`` added as a balanced tree (independent adds, and a smaller rounding error)."""
    while len(terms) > 1:
        terms = [f"({a} + {b})" for a, b in zip(terms[::2], terms[1::2])] + (terms[-1:] if len(terms) % 2 else [])
    return terms[0]


def _reduced_offset(extents, strides) -> str:
    """WGSL adding to ``off`` the input offset of reduced element ``r`` (row-major over the
    reduced axes' ``extents``), with every extent and stride a constant."""
    axes = [d for d in range(len(extents)) if extents[d] > 1]
    lines = []
    for i, d in enumerate(reversed(axes)):
        last = i == len(axes) - 1
        index = "r" if last else f"r % {extents[d]}u"
        lines.append(f"    off = off + ({index}) * {strides[d]}u;")
        if not last:
            lines.append(f"    r = r / {extents[d]}u;")
    return "\n".join(lines)


# ---------------------------------------------------------------- row kernels with their own operands
# Same template as the row reductions (one workgroup per row, tree reductions in
# workgroup memory); meta words from 3 on are the op's own.

# A norm's backward kernels start from the row's statistics: its mean (0 for an RMS
# norm) and r = 1 / sqrt(variance + eps).
_NORM_STATS = """    var s = 0.0;
    if ({{CENTER}}) {
        for (var i = t; i < N; i = i + WG_THREADS) { s = s + x[base + i]; }
        s = wg_sum(s, t);
    }
    let mu = s / f32(N);
    var q = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { let c = x[base + i] - mu; q = q + c * c; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);"""

_ROW_KERNELS = {
    "group_norm": (["x", "w", "bias"], """    let S = m(3u);
    let cpg = m(4u);
    let G = m(5u);
    var s = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { s = s + x[base + i]; }
    let mu = wg_sum(s, t) / f32(N);
    var q = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { let d = x[base + i] - mu; q = q + d * d; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var i = t; i < N; i = i + WG_THREADS) {
        let c = (row % G) * cpg + i / S;
        let y = (x[base + i] - mu) * r * w[c] + bias[c];
        out[base + i] = {{GN_ACT}};
    }"""),
    "norm_grad": (["dout", "x", "w"], _NORM_STATS + """
    var sg = 0.0;
    var sgx = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) {
        let g = dout[base + i] * w[i];
        sg = sg + g;
        sgx = sgx + g * (x[base + i] - mu) * r;
    }
    let mean_g = select(0.0, wg_sum(sg, t) / f32(N), {{CENTER}});
    let mean_gx = wg_sum(sgx, t) / f32(N);
    for (var i = t; i < N; i = i + WG_THREADS) {
        out[base + i] = {{RESIDUAL}}r * (dout[base + i] * w[i] - mean_g - (x[base + i] - mu) * r * mean_gx);
    }"""),
    "max_grad": (["dout", "x"], """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + WG_THREADS) { mx = max(mx, x[base + i]); }
    mx = wg_max(mx, t);
    var ties = 0.0;
    for (var i = t; i < N; i = i + WG_THREADS) { ties = ties + select(0.0, 1.0, x[base + i] == mx); }
    let share = dout[row] / wg_sum(ties, t);
    for (var i = t; i < N; i = i + WG_THREADS) { out[base + i] = select(0.0, share, x[base + i] == mx); }"""),
    "cross_entropy_grad": (["logits", "labels", "dout"], """    let ignore = mi(3u);
    var kept = 0.0;
    for (var r = t; r < rows; r = r + WG_THREADS) { kept = kept + select(1.0, 0.0, labels[r] == ignore); }
    kept = wg_sum(kept, t);
    let label = labels[row];
{{ONLINE_SOFTMAX}}
    let scale = select(dout[0] / max(kept, 1.0), 0.0, label == ignore);
    let inv = 1.0 / s;
    for (var i = t; i < N; i = i + WG_THREADS) {
        let onehot = select(0.0, 1.0, i32(i) == label);
        out[base + i] = (exp(logits[base + i] - mx) * inv - onehot) * scale;
    }""".replace("{{ONLINE_SOFTMAX}}", _ONLINE_SOFTMAX)),
}


def _row_kernel(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    names, mode = _ROW_KERNELS[node.op]
    a = node.attrs
    x = graph[node.inputs[1 if node.op == "max_grad" else 0]]
    types = ["i32" if graph[i].dtype == "i32" else "f32" for i in node.inputs]
    extra, act = [], "y"
    if node.op == "group_norm":
        groups = a["num_groups"]
        rows, n = x.shape[0] * groups, x.size // (x.shape[0] * groups)
        spatial = math.prod(x.shape[2:])
        extra = [spatial, x.shape[1] // groups, groups]
        act = "y * sigmoid_(y)" if a.get("activation") == "silu" else "y"
    elif node.op == "max_grad" and a.get("axis") is None:
        rows, n = 1, x.size
    else:
        n = x.shape[-1]
        rows = x.size // n
        if node.op == "cross_entropy_grad":
            extra = [i32_bits(a.get("ignore_index", -100))]
    meta = [rows, n, f32_bits(a.get("eps", 0.0))] + extra
    residual = node.op == "norm_grad" and len(node.inputs) == 4   # engine.optimize.norm_residual
    names = names + ["res"] if residual else names
    return _finish(f"reduce:{node.op}", "reduction", "reduce_row.wgsl", names, types, "f32", meta,
                   grid_1d(rows), caps, THREADS=row_threads(n),
                   MODE=mode.replace("{{GN_ACT}}", act).replace("{{CENTER}}", str(a.get("center", True)).lower())
                   .replace("{{RESIDUAL}}", "res[base + i] + " if residual else ""))


# ---------------------------------------------------------------- a norm's parameter gradients

def _row_vectors(n: int) -> tuple[int, str, str]:
    """How a kernel reads rows of ``n`` (norm_param_grad.wgsl, row_dot.wgsl): (elements a
    load, the WGSL type ``VT`` loaded, ``HSUM``: the sum of a loaded ``v``'s elements);
    vec4s where ``n`` is a multiple of 4."""
    return (4, "vec4<f32>", "dot(v, vec4<f32>(1.0))") if n % 4 == 0 else (1, "f32", "v")


NORM_PARAM_THREADS = 256
# Rows a workgroup of norm_param_grad.wgsl sums at most: its statistics take THREADS /
# CHUNK threads a row, and a chunk's sums are one block of partials that sum_to.wgsl adds
# up. On the H100, whisper's [12000, 384] took 25 us in chunks of 32, 27 in 16, 30 in 64.
NORM_PARAM_CHUNK = 32


def norm_param_chunk(rows: int, fill: int) -> int:
    """Rows a workgroup of norm_param_grad.wgsl sums: NORM_PARAM_CHUNK, halved (to 4 at
    least) while the chunks would make fewer than twice ``fill`` workgroups (the adapter's
    ``tuning.sum_workgroups``): gpt-tiny's [2048, 384] in chunks of 32 made 64 workgroups,
    and the step 0.1 ms slower than the kernels it replaced."""
    chunk = NORM_PARAM_CHUNK
    while chunk > 4 and -(-rows // chunk) < 2 * fill:
        chunk //= 2
    return chunk


_INPUT_GRADIENT = """    {   // the norm's input gradient of this thread's row (norm_grad's, from the same statistics)
        var sg = 0.0;
        var sgx = 0.0;
        if (live) {
            for (var i = g; i < NV; i = i + GROUP) {
                let gv = dout[row * NV + i] * w[i];
                sg = sg + hsum(gv);
                sgx = sgx + hsum(gv * (x[row * NV + i] - VT(mu)) * r);
            }
        }
        let mean_g = select(0.0, group_sum(sg, t) / n, {{CENTER}});
        let mean_gx = group_sum(sgx, t) / n;
        if (live) {
            for (var i = g; i < NV; i = i + GROUP) {
                let at = row * NV + i;
                dx_out[at] = {{RESIDUAL}}r * (dout[at] * w[i] - VT(mean_g) - (x[at] - VT(mu)) * r * VT(mean_gx));
            }
        }
    }"""


def norm_gradients(grad: Node, params: Node) -> bool:
    """Whether ``params`` (a ``norm_param_grad``) and ``grad`` (a ``norm_grad``) are one
    norm's gradients: the same dout and x, eps and centring, so that one kernel computes
    both (``_norm_param_grad`` with ``input_gradient``)."""
    return (grad.op == "norm_grad" and params.op == "norm_param_grad"
            and tuple(grad.inputs[:2]) == tuple(params.inputs) and grad.attrs == params.attrs)


def _norm_param_grad(graph: Graph, node: Node, caps: Capabilities = PLAIN,
                     input_gradient: Node | None = None) -> Kernel:
    """``norm_param_grad`` in two dispatches: norm_param_grad.wgsl sums a chunk of rows a
    workgroup (each row's statistics, then each column's sums), as vec4s where the rows
    are a multiple of 4 wide; ``sum_to_kernel`` adds the chunks' sums (a single chunk
    writes the result itself). With ``input_gradient`` (the same norm's ``norm_grad``:
    ``norm_gradients``) the first dispatch also writes that node's value, bound after the
    sums (the plan's ``_norm_gradient_pairs``): its own row kernel read dout and x again
    (35-39 us a norm of whisper-tiny's [12000, 384] on the H100, beside 23-25 for the
    sums). Run 45, f16 on the H100, the norms' gradients a step: whisper-tiny at batch 8
    643-645 -> 536 us (27 -> 18 dispatches), at batch 1 356-359 -> 250-252, gpt-tiny at
    batch 8 493-494 -> 344 (39 -> 26)."""
    x = graph[node.inputs[1]]
    n, (k, padded) = x.shape[-1], node.shape
    rows = x.size // n
    width, vt, hsum = _row_vectors(n)
    lanes = max(1, NORM_PARAM_THREADS // (padded // width))
    chunk = norm_param_chunk(rows, caps.tuning.sum_workgroups)
    chunks = -(-rows // chunk)
    names, dx = ["dout", "x"], {"DX_BINDING": "", "INPUT_GRADIENT": ""}
    center = str(node.attrs["center"]).lower()
    if input_gradient is not None:
        residual = len(input_gradient.inputs) == 4   # engine.optimize.norm_residual
        names += ["w"] + ["res"] * residual
        dx = {"DX_BINDING": f"@group(0) @binding({len(names) + 2}) var<storage, read_write> dx_out: array<{vt}>;",
              "INPUT_GRADIENT": _INPUT_GRADIENT.replace("{{CENTER}}", center)
              .replace("{{RESIDUAL}}", "res[at] + " if residual else "")}
    kernel = _finish("reduce:norm_param_grad", "reduction", "norm_param_grad.wgsl", names, [vt] * len(names), vt,
                     [rows, n // width, f32_bits(node.attrs["eps"]), n, padded // width], grid_1d(chunks), caps,
                     THREADS=NORM_PARAM_THREADS, CHUNK=chunk, LANES=lanes, K=k, VT=vt, HSUM=hsum,
                     CENTER=center, COLUMNS=_NORM_PARAM_COLUMNS[lanes > 1], **dx)
    kernel.guarded = True
    kernel.notes["variant"] = (f"{chunk} rows a workgroup, {'vec4s' if width == 4 else 'floats'}"
                               + (", and the input gradient" if input_gradient is not None else ""))
    if chunks > 1:
        add_copies(kernel, chunks, k * padded, caps, "reduce:norm_param_grad:chunks", f"{chunks} chunks")
    return kernel


def norm_gradients_kernel(graph: Graph, grad: Node, params: Node, caps: Capabilities = PLAIN) -> Kernel:
    """One norm's ``norm_grad`` and ``norm_param_grad`` (``norm_gradients``) in one kernel:
    the parameter gradients' kernel, also writing the input gradient."""
    return _norm_param_grad(graph, params, caps, input_gradient=grad)


# The column sums of norm_param_grad.wgsl: rows at least THREADS / 2 vectors wide take a
# thread a column at a time; narrower ones LANES threads a column (a share of the rows
# each), added in workgroup memory.
_NORM_PARAM_COLUMNS = {
    False: """    for (var c = t; c < NP; c = c + THREADS) {
        var sums = column_sums(c, 0u, 1u, held, first, NV);
        out[chunk * K * NP + c] = sums[0];
        if (K == 2u) { out[(chunk * K + 1u) * NP + c] = sums[1]; }
    }""",
    True: """    let c = t % NP;
    let lane = t / NP;
    var sums = array<VT, 2>(VT(0.0), VT(0.0));
    if (lane < LANES) { sums = column_sums(c, lane, LANES, held, first, NV); }
    lane_sums[t] = sums;
    workgroupBarrier();
    if (lane == 0u) {
        for (var j = 1u; j < LANES; j = j + 1u) {
            sums[0] = sums[0] + lane_sums[t + j * NP][0];
            sums[1] = sums[1] + lane_sums[t + j * NP][1];
        }
        out[chunk * K * NP + c] = sums[0];
        if (K == 2u) { out[(chunk * K + 1u) * NP + c] = sums[1]; }
    }""",
}


# ---------------------------------------------------------------- dot products of rows

ROW_DOT_THREADS = 256


def _row_dot(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """``row_dot`` (row_dot.wgsl): a group of threads a row, each a vec4 at a time where
    the rows are a multiple of 4 wide, so that a warp reads whole rows. Attention's Delta
    (rows of the head dimension, 64) was a product written in full (23 us a layer at
    whisper-tiny's batch 8 on the H100) and a sum of a thread a row (35 us, a warp's loads
    on 32 rows)."""
    a = graph[node.inputs[0]]
    n = a.shape[-1]
    rows = a.size // n
    width, vt, hsum = _row_vectors(n)
    vectors = n // width
    group = min(64, 1 << (vectors - 1).bit_length())
    kernel = _finish("reduce:row_dot", "reduction", "row_dot.wgsl", ["a", "b"], [vt, vt], "f32",
                     [rows, vectors], grid_1d(-(-rows * group // ROW_DOT_THREADS)), caps,
                     THREADS=ROW_DOT_THREADS, GROUP=group, VT=vt, HSUM=hsum)
    kernel.guarded = True
    kernel.notes["variant"] = f"{group} thread{'s' if group > 1 else ''} a row, {'vec4s' if width == 4 else 'floats'}"
    return kernel
