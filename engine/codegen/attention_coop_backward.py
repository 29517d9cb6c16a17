"""The attention backward on cooperative matrices (attention_coop_backward.wgsl):
attention_grad_q and attention_grad_kv with f16 operands on 16 x 16 fragments accumulating
in f32, taken where the forward takes its cooperative kernel; the f32 kernels
(attention_backward.wgsl) stay for every other device, head dim and setting.
"""

from __future__ import annotations

import math

from ..graph.ir import Graph, Node
from ..graph.ops import attention_grad_kv_layout, tiled_attention_head_dim
from .attention import _attention_backward, _attention_dims, _split_grid
from .attention_coop import (_HALF_PAD, _fragment, _fragment_rounds, _result, coop_attention_supported, entry_point,
                             fragment_product, lane_column, put_tiles, scratch_row, split_products, split_store,
                             staged_in_rounds, staged_in_two_tiles, workgroup_top)
from .common import Capabilities, Kernel, _finish, _template, f32_bits
from .matmul_coop import COOP_ENABLES, COOP_FRAGMENT, hi_part

COOP_BACKWARD_FIXED = 64      # fixed rows a workgroup owns: 16 for each of its 4 subgroups
COOP_BACKWARD_STREAMED = (32, 64)   # streamed rows a block: see backward_streamed
SPLIT_STREAMED = 16           # split products' streamed rows a block where each thread stages whole vec4s
COOP_BACKWARD_SUBGROUPS = 4
COOP_BACKWARD_MODES = {"attention_grad_q": 0, "attention_grad_kv": 1}


def coop_backward_bytes(head_dim: int, streamed: int = COOP_BACKWARD_STREAMED[0], split: bool = False) -> int:
    """Workgroup memory of attention_coop_backward.wgsl in blocks of ``streamed`` rows: the
    f16 X and Y blocks (padded rows; the fixed rows are staged through them), each
    subgroup's f16 P / dS rows and f32 scratch of 16 x ``streamed``, a block's L and Delta
    (dkdv) and the subgroups' largest |dO|; ``split``: the lo parts of X, Y and P too, and
    the subgroups' largest |A| or |X|."""
    parts = 2 if split else 1
    xy = parts * 2 * 2 * streamed * (head_dim + _HALF_PAD)
    p = parts * 2 * COOP_BACKWARD_SUBGROUPS * 16 * (streamed + _HALF_PAD)
    scratch = 4 * COOP_BACKWARD_SUBGROUPS * 16 * scratch_row(streamed)
    return xy + p + scratch + 4 * (2 * streamed + parts * COOP_BACKWARD_SUBGROUPS)


def backward_streamed(workgroups: int, head_dim: int, caps: Capabilities, dq_keys: int | None = None) -> int:
    """Streamed rows a block: 32, so that the workgroup's memory stays under 24 KiB and two
    share an SM (on the H100 one of 28 KiB or more has it alone), where the grid has at
    least one workgroup an SM (``tuning.attention_fill`` / 6: the tuning's full grid is
    six an SM) and, for dq (``dq_keys`` given), the keys are at least
    ``tuning.dq_long_stream`` (512 on the H100, ``meganeura tune`` measures it);
    else 64 (46 KiB) where they fit: twice the work a barrier. Run 37, fastest calls of
    the kernels summed over layers, blocks of 64 -> 32: whisper-tiny at batch 8 (1,152
    workgroups, 1,500 keys) dk/dv 2,965 -> 2,515 us, dq 2,282 -> 2,008; gpt-tiny (192
    workgroups, 256 causal keys) dk/dv 305 -> 257, dq 226 -> 282; the SmolLM2-shaped
    Llama's dq (144 workgroups, 256 causal keys) 1,067 -> 1,389, its dk/dv (48
    workgroups) 10% slower. ``caps.knobs.attention_backward_block``
    (``MEGANEURA_ATTENTION_BACKWARD_BLOCK``) forces 32 or 64 (tests, benchmarks) where
    64 fits. Split products (f32) take ``SPLIT_STREAMED`` (16) rows where each thread
    stages whole vec4s (D = 32, 64), else 32: at D = 64 blocks of 32 take 37.3 KiB (one
    workgroup an SM), of 16 20.1 KiB (two); whisper-tiny's b8 step on the H100 (run 47):
    dk/dv 6.43 -> 5.22-5.27 ms, the step 24.70-24.72 -> 23.26-23.33 ms."""
    if split_products(caps):
        return SPLIT_STREAMED if head_dim * SPLIT_STREAMED % (4 * 32 * COOP_BACKWARD_SUBGROUPS) == 0 else \
            COOP_BACKWARD_STREAMED[0]
    wide = COOP_BACKWARD_STREAMED[1]
    if coop_backward_bytes(head_dim, wide) > caps.workgroup_storage:
        return COOP_BACKWARD_STREAMED[0]
    if caps.knobs.attention_backward_block:
        return caps.knobs.attention_backward_block
    fills = workgroups >= caps.tuning.attention_fill // 6
    long = dq_keys is None or dq_keys >= caps.tuning.dq_long_stream
    return COOP_BACKWARD_STREAMED[0] if fills and long else wide


def coop_backward_supported(head_dim: int, caps: Capabilities) -> bool:
    """Whether attention_grad_q and attention_grad_kv of this head dim run on cooperative
    matrices: where the forward does (``coop_attention_supported``), at head dims up to 64
    (``tiled_attention_head_dim``: beyond it autodiff decomposes attention), and their blocks fit
    the device's workgroup memory (23.3 KiB at D = 64 in blocks of 32; split products
    37.3, 20.1 in blocks of 16), unless ``MEGANEURA_ATTENTION_BACKWARD=f32`` keeps the f32 kernels (benchmarks)."""
    return (caps.knobs.attention_backward != "f32" and coop_attention_supported(head_dim, caps)
            and tiled_attention_head_dim(head_dim)
            and coop_backward_bytes(head_dim, split=split_products(caps)) <= caps.workgroup_storage)


def attention_backward(graph: Graph, node: Node, caps: Capabilities) -> Kernel:
    """The kernel of an attention backward node: attention_grad_q and attention_grad_kv on
    cooperative matrices where ``coop_backward_supported``, else (and attention_lse) the
    f32 kernels (``_attention_backward``)."""
    if node.op in COOP_BACKWARD_MODES:
        dims = _attention_dims(node, graph[node.inputs[0]], graph[node.inputs[1]])
        if coop_backward_supported(dims[5], caps):
            return coop_attention_backward(graph, node, *dims, caps)
    return _attention_backward(graph, node, caps)


def _subs(d: int, mode: int, streamed: int, scores: bool = False, split: bool = False) -> dict:
    """attention_coop_backward.wgsl's unrolled parts for head dim ``d``, ``mode`` (0: dq,
    1: dkdv) and blocks of ``streamed`` rows: the staging (unrolled, as the forward's: loops
    of global loads ran 2.1x slower there; the 64 fixed rows of A, then of B, go through
    the two tiles, so that with blocks of 32 subgroups 0 and 1 load their fragments from Xh
    and 2 and 3 from Yh), the fragment products, and the lanes' lines over their
    ``streamed / 2`` rows (``key``) in the forward's rotated order. The results (dq or dk,
    and dv) accumulate in result fragments across blocks, rescaled by
    ``subgroupMatrixScalarMultiply`` where a block's scale changes: no round trip through
    the scratch per block; at the end they leave through it two fragments at a time.
    ``scores`` (dkdv): each block's dS also goes to the scores binding (``scores_pair``).
    ``split`` (``split_products``): every operand as hi and lo parts, each product three,
    all four operands scaled (the template's SPLIT)."""
    f, dk, rows = COOP_FRAGMENT, d // COOP_FRAGMENT, streamed // 2
    kv = mode == 1
    ind = " " * 8
    key = lambda c: lane_column(c, streamed)  # noqa: E731
    threads = 32 * COOP_BACKWARD_SUBGROUPS
    fixed_steps = range(COOP_BACKWARD_FIXED * d // 4 // threads)
    steps = range(streamed * d // 4 // threads)
    e = lambda n: f"tid + {n * threads}u"  # noqa: E731
    a, bop, x, y = (1, 2, 0, 3) if kv else (0, 3, 1, 2)   # operands: 0 q, 1 k, 2 v, 3 dout
    parts = "hl" if split else "h"

    fetch_fixed = [f"    let a{n} = fetch_rows({e(n)}, b, head, f0, NF, HF, {a}u); "
                   f"let b{n} = fetch_rows({e(n)}, b, head, f0, NF, HF, {bop}u);" for n in fixed_steps]
    fixed_max = [] if kv and not split else [f"    top_y = max(top_y, amax4(b{n}));" for n in fixed_steps]
    if split:
        fixed_max += workgroup_top("top_a", [f"amax4(a{n})" for n in fixed_steps], 4, "    ")

    def fixed_rows(name: str, times: str) -> tuple[list[str], list[str]]:
        """(staging, loads) of the fixed rows ``name``0.. (times ``times``): in blocks of 64
        all through X (each subgroup loading its 16 rows), else through X and Y
        (``staged_in_rounds``: at once in blocks of 32, in two rounds in blocks of 16)."""
        frags = [(f"{name}f", "h"), (f"{name}l", "l")][:len(parts)]
        value = lambda first: lambda n: f"{name}{n + first * d // 4 // threads}{times}"  # noqa: E731
        if streamed >= COOP_BACKWARD_FIXED:
            return (staged_in_two_tiles(("put_x", "put_y"), value(0), len(fixed_steps), streamed * d // 4, threads),
                    [f"    let {frag}{kk} = {_fragment('left', 'X' + part, f'sg * 16u * KS + {f * kk}u', False, 'KS')};"
                     for frag, part in frags for kk in range(dk)])
        return staged_in_rounds(("put_x", "put_y"), value, [(frag, ("X" + part, "Y" + part)) for frag, part in frags],
                                d, streamed, threads)

    fetch_stream = [f"{ind}let x{n} = fetch_rows({e(n)}, b, sh, c0, NS, HS, {x}u); "
                    f"let y{n} = fetch_rows({e(n)}, b, sh, c0, NS, HS, {y}u);" for n in steps]
    stream_max = ([f"{ind}top_y = max(top_y, amax4(y{n}));" for n in steps]
                  + [f"{ind}{{ let top = subgroupMax(top_y); if (lane == 0u) {{ red[sg] = top; }} }}"]
                  if kv or split else [])
    if split:
        stream_max += workgroup_top("top_x", [f"amax4(x{n})" for n in steps], 4, ind)
    times_x, times_y = (" * s_x", " * s_y") if split else ("", " * s_y" if kv else "")
    put_stream = [f"{ind}put_x({e(n)}, x{n}{times_x}); put_y({e(n)}, y{n}{times_y});" for n in steps]

    def right(tile: str, n: int, kk: int, transposed: bool):
        at = f"{f * n}u * KS + {f * kk}u" if transposed else f"{f * kk}u * KS + {f * n}u"
        return lambda part: _fragment("right", tile + part, at, transposed, "KS")

    def multiply(left: str, kk: int, right_of, acc: str) -> list[str]:
        """``acc`` plus left fragment ``left``f{kk} (and its lo twin ``left``l{kk}) times ``right_of``'s."""
        return fragment_product((f"{left}f{kk}", f"{left}l{kk}"), right_of, acc, ind, split)

    def products(name: str, left: str, tile: str, transposed: bool, outs: int, inner: int) -> list[str]:
        """``outs`` fresh result fragments name0.. = sum over ``inner`` of left fragments
        times ``tile``'s (transposed: the column-major view of its rows), stored to Sc."""
        lines = []
        for n in range(outs):
            lines.append(ind + _result(f"{name}{n}"))
            for kk in range(inner):
                lines += multiply(left, kk, right(tile, n, kk, transposed), f"{name}{n}")
            lines.append(f"{ind}subgroupMatrixStore(&Sc, sb + {f * n}u, {name}{n}, false, SS);")
        return lines

    def accumulate(name: str, left: str, tile: str, ratio: str) -> list[str]:
        """The D / 16 accumulated fragments name0.. times ``ratio``, plus the subgroup's
        16 x ``streamed`` left fragments times ``tile``'s rows."""
        lines = []
        for n in range(dk):
            lines.append(f"{ind}{name}{n} = subgroupMatrixScalarMultiply({name}{n}, {ratio});")
            for kk in range(streamed // f):
                lines += multiply(left, kk, right(tile, n, kk, False), f"{name}{n}")
        return lines

    def p_frags(name: str) -> list[str]:
        """The subgroup's P or dS rows (16 x ``streamed`` in Ph, and Pl) as left fragments
        {name}f0.. (and {name}l0..)."""
        return [f"{ind}let {name}{part.replace('h', 'f')}{kk} = {_fragment('left', 'P' + part, f'pb + {f * kk}u', False, 'PS')};"
                for part in parts for kk in range(streamed // f)]

    def put_p(value: str, c: int) -> str:
        """Row r's streamed row ``key(c)`` of the subgroup's Ph (and Pl) from f32 ``value``."""
        at = f"pb + r * PS + {key(c)}"
        return f"{ind}{split_store(value, at)}" if split else f"{ind}Ph[{at}] = f16({value});"

    def store(name: str, factor: str, base: str) -> list[str]:
        """Fragments name0.. times ``factor`` through the subgroup's scratch to ``out``, two
        at a time, one in blocks of 16 (the scratch's columns; each round ends with a
        barrier: the scratch is free again)."""
        lines = []
        for frags in _fragment_rounds(d, min(2, streamed // f)):
            width = f * len(frags)
            lines += [f"    subgroupMatrixStore(&Sc, sb + {f * i}u, subgroupMatrixScalarMultiply({name}{n}, {factor}), "
                      f"false, SS);" for i, n in enumerate(frags)]
            lines += ["    workgroupBarrier();",
                      f"    for (var e = lane; e < {16 * width}u; e = e + 32u) {{",
                      f"        let row = f0 + 16u * sg + e / {width}u;",
                      "        if (row < NF) {",
                      f"            out[{base}((b * NF + row) * HF + head) * D + {f * frags[0]}u + e % {width}u] = "
                      f"Sc[sb + e / {width}u * SS + e % {width}u];",
                      "        }", "    }", "    workgroupBarrier();"]
        return lines

    lse = (lambda c: f"Ls[{key(c)}]") if kv else (lambda c: "row_lse")  # noqa: E731
    delta = (lambda c: f"Ds[{key(c)}]") if kv else (lambda c: "row_delta")  # noqa: E731
    score_scale = "ss" if split else "sl2"
    probabilities = [f"{ind}{{ let j = c0 + {key(c)}; p[{c}] = select(0.0, exp2(Sc[sb + r * SS + {key(c)}] * "
                     f"{score_scale} - {lse(c)}), j >= lo && j < hi); }}" for c in range(rows)]
    if kv:
        pv = ([put_p(f"p[{c}]", c) for c in range(rows)]
              + [f"{ind}workgroupBarrier();         // P is written and S read"] + p_frags("p")
              + accumulate("dvf", "p", "Y", "ratio_y"))
    else:
        pv = [f"{ind}workgroupBarrier();         // S is read"]
    ds = [f"{ind}{{ let g = p[{c}] * (Sc[sb + r * SS + {key(c)}] * inv_y - {delta(c)}); p[{c}] = g; "
          f"top = max(top, abs(g)); }}" for c in range(rows)]
    results = ["    " + _result(f"{name}{n}") for name in ("gf", "dvf")[:1 + kv] for n in range(dk)]
    out = store("gf", "scale / s_g", "")
    if kv:
        out += store("dvf", "1.0 / s_v", "m(7u) + ")
    if split:
        # dS X's fragments hold s2 times X's scale: s2 keeps their product only ever lowered
        ds_scale = [f"{ind}let s2 = min(s_g / s_x, exp2(14.0 - exponent_of(subgroupMax(top))));",
                    f"{ind}let ratio_g = s2 * s_x / s_g;", f"{ind}s_g = s2 * s_x;"]
        stream_scales = [f"{ind}let ex_x = exponent_of(red_top(4u));", f"{ind}let s_x = exp2(14.0 - ex_x);",
                         f"{ind}let ss = sl2 * exp2(ex_a + ex_x - 28.0);",
                         f"{ind}if (dq) {{ s_y = exp2(14.0 - exponent_of(red_top(0u))); }}",
                         f"{ind}inv_y = exp2(ex_fixed - 14.0) / s_y;"]
        put_a = ["    let ex_a = exponent_of(red_top(4u));", "    let s_a = exp2(14.0 - ex_a);"]
        decls = "\n".join(["var<workgroup> Xl: array<f16, BS * KS>;", "var<workgroup> Yl: array<f16, BS * KS>;",
                           "var<workgroup> Pl: array<f16, 4u * 16u * PS>;"])
    else:
        ds_scale = [f"{ind}let s2 = min(s_g, exp2(14.0 - exponent_of(subgroupMax(top))));",
                    f"{ind}let ratio_g = s2 / s_g;", f"{ind}s_g = s2;"]
        stream_scales, put_a, decls = [], [], ""
    stage_a, loads_a = fixed_rows("a", " * s_a" if split else "")
    stage_b, loads_b = fixed_rows("b", " * s_fixed" if split or not kv else "")
    return dict(MODE=mode, D=d, BS=streamed, LANE_ROWS=rows, PAD=_HALF_PAD, SPLIT=str(split).lower(),
                RED=8 if split else 4, SPLIT_DECLS=decls,
                SS=scratch_row(streamed), PUT_TILES=put_tiles(("x", "Xh"), ("y", "Yh"), split=split),
                TILE_SCALES=_template("tile_scales.wgsl"),
                FETCH_FIXED="\n".join(fetch_fixed), FIXED_MAX="\n".join(fixed_max),
                PUT_FIXED="\n".join(put_a + stage_a),
                LOAD_FIXED="\n".join(loads_a + ["    workgroupBarrier();"] + stage_b + ["    workgroupBarrier();"] + loads_b),
                RESULTS="\n".join(results), FETCH_STREAM="\n".join(fetch_stream),
                STREAM_MAX="\n".join(stream_max), PUT_STREAM="\n".join(put_stream),
                STREAM_SCALES="\n".join(stream_scales), DS_SCALE="\n".join(ds_scale),
                SCORES="\n".join(products("sf", "a", "X", True, streamed // f, dk)),
                PROBABILITIES="\n".join(probabilities), PV="\n".join(pv),
                DP="\n".join(products("dpf", "b", "Y", True, streamed // f, dk)),
                DS="\n".join(ds),
                PUT_DS="\n".join(put_p(f"p[{c}] * s2", c) for c in range(rows)),
                GRAD="\n".join(p_frags("d") + accumulate("gf", "d", "X", "ratio_g")),
                STORE="\n".join(out), **_scores_subs(scores, streamed, split))


def _scores_subs(scores: bool, streamed: int, split: bool = False) -> dict:
    """The dkdv kernel's scores binding and the lines that copy a block's dS (each
    subgroup its 16 keys, as f16 pairs, a vec4 a lane at a time) and its scale s2 there:
    attention_coop_dq.wgsl reads them. ``split``: Pl's lo parts too, in a second region as
    large as the first (``scores_layout``), which ends halfway to the scales."""
    if not scores:
        return dict(SCORES_BINDING="", SCORES_OUT="")
    ind, qg = " " * 8, scale_queries(split)
    pairs = lambda tile: ", ".join(f"bitcast<u32>(vec2<f16>({tile}[at + {2 * i}u], {tile}[at + {2 * i + 1}u]))"  # noqa: E731
                                   for i in range(4))
    at = f"(bh * S + key0 + row) * ((T + 63u) / 64u * 8u) + c0 / 8u + e % {streamed // 8}u"
    writes = [f"{ind}            scores[{at}] = vec4<u32>({pairs('Ph')});"]
    if split:
        writes.append(f"{ind}            scores[m(8u) / 2u + {at}] = vec4<u32>({pairs('Pl')});")
    out = [f"{ind}{{   // this block's dS as Ph holds it (times s2), and s2, for attention_grad_q's product",
           f"{ind}    let bh = b * H + sh;",
           f"{ind}    let key0 = f0 + 16u * sg;",
           f"{ind}    for (var e = lane; e < {16 * streamed // 8}u; e = e + 32u) {{",
           f"{ind}        let row = e / {streamed // 8}u;",
           f"{ind}        let at = pb + row * PS + e % {streamed // 8}u * 8u;",
           f"{ind}        if (key0 + row < S) {{",
           *writes,
           f"{ind}        }}",
           f"{ind}    }}",
           f"{ind}    if (lane < {streamed // qg}u && key0 < S) {{",
           f"{ind}        scores[m(8u) + (bh * ((S + 15u) / 16u) + key0 / 16u) * ((T + 63u) / 64u * {64 // qg}u) + c0 / {qg}u + lane] = "
           f"vec4<u32>(bitcast<u32>(s2), 0u, 0u, 0u);",
           f"{ind}    }}",
           f"{ind}}}"]
    binding = "@group(0) @binding(8) var<storage, read_write> scores: array<vec4<u32>>;"
    return dict(SCORES_BINDING=binding, SCORES_OUT="\n".join(out))


def coop_attention_backward(graph: Graph, node: Node, bsz, t, s, h, hkv, d, causal, scale,
                            caps: Capabilities, scores_at: int | None = None) -> Kernel:
    """The cooperative-matrix kernel of ``node`` (attention_grad_q or attention_grad_kv;
    dims as ``_attention_dims``): a workgroup per 64 fixed rows, head and batch. Its
    streamed side is never split among workgroups: whisper-tiny's training at batch 8
    gives 24 x 6 x 8 workgroups, enough to fill the GPU. ``scores_at`` (dkdv, from
    ``scores_pair``): it also writes dS to a scores binding whose scales begin at that vec4."""
    mode = COOP_BACKWARD_MODES[node.op]
    fixed, heads = (t, h) if mode == 0 else (s, hkv)
    grid = _split_grid(graph, node, -(-fixed // COOP_BACKWARD_FIXED), heads, bsz, 1)
    block = backward_streamed(math.prod(grid), d, caps, dq_keys=s if mode == 0 else None)
    dv_at = attention_grad_kv_layout(graph[node.inputs[1]].shape)[0][1] if mode == 1 else 0
    meta = [t, s, h, hkv, causal, f32_bits(scale * math.log2(math.e)), f32_bits(scale), dv_at]
    meta += [] if scores_at is None else [scores_at]
    names = ("q", "k", "v", "dout", "lse", "delta")
    types = ["f32" if n in ("lse", "delta") else "vec4<f32>" for n in names]
    kernel = _finish(node.op, "attention", "attention_coop_backward.wgsl", list(names), types, "f32", meta, grid,
                     caps, enables=COOP_ENABLES + ("subgroups",), ENTRY=entry_point(32 * COOP_BACKWARD_SUBGROUPS),
                     **_subs(d, mode, block, scores_at is not None, split_products(caps)))
    f = COOP_FRAGMENT
    fixed_rows, streamed = ("queries", "keys") if mode == 0 else ("keys", "queries")
    kernel.notes["variant"] = (f"cooperative backward: {COOP_BACKWARD_FIXED} {fixed_rows} a workgroup, {streamed} "
                               f"streamed {block} at a time, "
                               + (f"f32 as hi and lo f16 parts, three {f}x{f}x{f} products, {COOP_BACKWARD_SUBGROUPS} "
                                  "subgroups, every operand scaled" if split_products(caps) else
                                  f"f16 {f}x{f}x{f} -> f32, {COOP_BACKWARD_SUBGROUPS} subgroups, dO and dS scaled")
                               + ("; writes dS for dq's product" if scores_at is not None else ""))
    kernel.guarded = True
    return kernel


SCORES_MAX_BYTES = 1 << 30   # the most memory the scores of one dkdv -> dq pair may take


def scores_layout(bsz: int, t: int, s: int, h: int, split: bool = False) -> tuple[int, int]:
    """(the vec4 where the scales begin, vec4s in all) of the scores a dkdv kernel writes
    for dq's product: dS^T as f16 pairs, for each batch, query head and key a row of
    ceil(T / 64) blocks of 64 queries (8 vec4s each), then a vec4 for each 16 keys and
    32 queries (``scale_queries``) whose x is the power of two those dS were multiplied
    by (f32 bits). ``split``: the lo parts of dS after the hi parts, in the same layout,
    and a scale for each 16 keys and 16 queries."""
    blocks = -(-t // 64)
    at = bsz * h * s * blocks * 8 * (2 if split else 1)
    return at, at + bsz * h * -(-s // 16) * blocks * (64 // scale_queries(split))


def scores_pair(graph: Graph, kv: Node, q: Node, caps: Capabilities) -> tuple[Kernel, Kernel, int] | None:
    """(kv's kernel, q's kernel, bytes of the scores between them) where dq is a product of
    the dS that attention_grad_kv ``kv``'s cooperative kernel writes (attention_coop_dq.wgsl)
    instead of a kernel of its own computing the scores, P and dP again: where both run on
    cooperative matrices, on the same operands and attributes, and the scores fit the
    device's largest binding and ``SCORES_MAX_BYTES`` (whisper-tiny at batch 8: 225 MB),
    unless ``caps.knobs.attention_dq`` ("kernel", ``MEGANEURA_ATTENTION_DQ``) keeps the dq
    kernel. Else None."""
    if caps.knobs.attention_dq == "kernel" or kv.inputs != q.inputs or kv.attrs != q.attrs:
        return None
    dims = _attention_dims(q, graph[q.inputs[0]], graph[q.inputs[1]])
    if not coop_backward_supported(dims[5], caps):
        return None
    at, total = scores_layout(*dims[:4], split_products(caps))
    if 16 * total > min(caps.storage_binding, SCORES_MAX_BYTES):
        return None
    return (coop_attention_backward(graph, kv, *dims, caps, scores_at=at),
            coop_dq_from_scores(graph, q, *dims, at, caps), 16 * total)


DQ_QUERIES = COOP_BACKWARD_FIXED   # queries a workgroup of the dq product, 16 a subgroup: dkdv's keys
                                   # a workgroup, so that under causality every dS it reads was written
DQ_KEYS = 32                       # keys a block it streams
DQ_PREFETCH = (1, 4)               # the blocks ahead it may fetch (``tuning.dq_prefetch``, clamped)
DQ_FACTORS = 512                   # most slots of its factors tile (2 KiB): key groups x query blocks


def scale_queries(split: bool) -> int:
    """Queries each of dS's scales in the scores covers: dkdv's blocks of 32 streamed
    queries, 16 for split products (whose dkdv streams 16 where its head dim allows:
    ``backward_streamed``)."""
    return 16 if split else 32


def dq_factors(keys: int, threads: int, split: bool = False) -> int:
    """Slots of attention_coop_dq.wgsl's factors tile for ``keys`` keys: a factor for each
    16 keys and each of the workgroup's 32-query blocks, padded to whole rounds of its
    ``threads`` (so that no lane branches filling it); 0 (the factors read as the elements
    are staged) where that passes ``DQ_FACTORS``."""
    slots = -(-keys // 16) * (DQ_QUERIES // scale_queries(split))
    slots = -(-slots // threads) * threads
    return slots if slots <= DQ_FACTORS else 0


def _dq_factor_subs(factors: int) -> dict:
    """attention_coop_dq.wgsl's factors: a tile filled once (``factors`` slots), or read
    from the scales with each staged element (0)."""
    if not factors:
        return dict(FACTORS_TILE="", FACTORS_PUT="",
                    FACTOR="    return select(0.0, cs[qb * (QG / 16u)] / scale_of(bh, key / 16u, qb, q0, T, S, ex), ok);")
    fill = ["    {   // each key group's factor c / s for each query block, for every block's staging",
            "        let groups = (end + 15u) / 16u;",
            "        for (var i0 = 0u; i0 < FACTORS; i0 = i0 + 32u * SUBGROUPS) {"
            "   // no branch on the lane: see fetch_k",
            "            let i = i0 + tid;",
            "            let g = i / QB;",
            "            let qb = i % QB;",
            "            let s = scale_of(bh, g, qb, q0, T, S, ex);",
            "            fs[i] = select(0.0, cs[qb * (QG / 16u)] / s, g < groups && q0 + qb * QG < T);",
            "        }",
            "    }",
            "    workgroupBarrier();"]
    return dict(FACTORS_TILE="var<workgroup> fs: array<f32, FACTORS>;   // each key group's factor, QB a group",
                FACTORS_PUT="\n".join(fill),
                FACTOR="    return select(0.0, fs[min(key / 16u * QB + qb, FACTORS - 1u)], ok);")


def coop_dq_from_scores(graph: Graph, node: Node, bsz, t, s, h, hkv, d, causal, scale, scales_at: int,
                        caps: Capabilities) -> Kernel:
    """attention_grad_q ``node`` as the product of dkdv's dS and K (attention_coop_dq.wgsl):
    a workgroup per 64 queries, head and batch, streaming keys 32 at a time; bindings k,
    the scores, dq. Each block's K and dS are fetched into registers ``tuning.dq_prefetch``
    blocks ahead (``meganeura tune`` measures it), a set of registers each (the loop
    unrolled that many times): the kernel waits on the scores' reads from memory, not on
    its products. Run 42, whisper-tiny at batch 8 on the H100, a layer's dq: 331 us one
    block ahead, 261 two (the default), 394 three, 344 four (the registers spill). Its
    step: 128 queries a workgroup (which would also need dS that dkdv skips under
    causality) 0.15 ms slower, blocks of 64 keys 1.5 ms slower; storing the results
    straight to dq where a tile's rows all lie below T ran even with the scratch. Run 44:
    each staged element's factor read from the scales (a load and a division each) took
    262 us a layer there, worked out once into a tile (``dq_factors``) 228."""
    queries, keys = DQ_QUERIES, DQ_KEYS
    f, dk, threads = COOP_FRAGMENT, d // COOP_FRAGMENT, 32 * (queries // 16)
    split = split_products(caps)
    factors = dq_factors(s, threads, split)
    k_steps = [f"tid + {n * threads}u" for n in range(keys * d // 4 // threads)]
    s_steps = [f"tid + {n * threads}u" for n in range(keys * queries // 8 // threads)]

    def fetch(declare: str, k0: str, at: str) -> list[str]:
        lo = [f"{declare}sl{at}{n} = fetch_s({e}, bh, {k0}, q0, T, S, ex / 2u);" for n, e in enumerate(s_steps)]
        return ([f"{declare}kr{at}{n} = fetch_k({e}, b, hk, {k0}, S, HKV);" for n, e in enumerate(k_steps)]
                + [f"{declare}sr{at}{n} = fetch_s({e}, bh, {k0}, q0, T, S, 0u); {declare}sf{at}{n} = factor_s({e}, bh, "
                   f"{k0}, q0, T, S, ex);" for n, e in enumerate(s_steps)] + (lo if split else []))

    def block(at: str, next_block: str, ind: str) -> list[str]:
        """One block from registers set ``at``: staged, then the block ``next_block``
        fetched into them during its products. ``split``: K's scale lowered to the
        block's where that is lower, the result fragments multiplied by the ratio."""
        k_top = workgroup_top("top_k", [f"amax4(kr{at}{n})" for n in range(len(k_steps))], 0, "") if split else []
        lines = k_top + ["workgroupBarrier();         // the previous block's tiles are read"]
        if split:
            lines += ["let s_block = min(s_k, exp2(14.0 - exponent_of(red_top(0u))));",
                      *(f"gf{n} = subgroupMatrixScalarMultiply(gf{n}, s_block / s_k);" for n in range(dk)),
                      "s_k = s_block;"]
        lines += [f"put_k({e}, kr{at}{n}{' * s_k' if split else ''});" for n, e in enumerate(k_steps)]
        lines += [f"put_s({e}, sr{at}{n}, {f'sl{at}{n}, ' if split else ''}sf{at}{n});" for n, e in enumerate(s_steps)]
        lines += ["workgroupBarrier();"] + fetch("", f"({next_block}) * BK", at)
        lines += [f"let a{part}{kk} = {_fragment('left', 'S' + part, f'{f * kk}u * QS + sg * 16u', True, 'QS')};"
                  for part in ("hl" if split else "h") for kk in range(keys // f)]
        for n in range(dk):
            for kk in range(keys // f):
                right = lambda part: _fragment("right", "K" + part, f"{f * kk}u * KS + {f * n}u", False, "KS")  # noqa: E731
                lines += fragment_product((f"ah{kk}", f"al{kk}"), right, f"gf{n}", "", split)
        return [ind + line for line in lines]

    sets = "abcd"[:min(max(caps.tuning.dq_prefetch, DQ_PREFETCH[0]), DQ_PREFETCH[1])]
    loop = ["    var s_k = exp2(114.0);         // K's scale: only ever lowered"] if split else []
    loop += [f"    {line}" for ahead, at in enumerate(sets) for line in fetch("var ", f"{ahead}u * BK", at)]
    loop.append(f"    for (var blk = 0u; blk < blocks; blk = blk + {len(sets)}u) {{")
    loop += block("a", f"blk + {len(sets)}u", " " * 8)
    for ahead, at in enumerate(sets[1:], 1):   # further sets of registers, blocks further ahead
        loop += ([f"        if (blk + {ahead}u < blocks) {{"] + block(at, f"blk + {ahead + len(sets)}u", " " * 12)
                 + ["        }"])
    loop.append("    }")
    row = "q0 + 16u * sg + e / 16u"
    store = []
    for n in range(dk):   # a fragment of each subgroup at a time through the scratch, to dq's rows below T
        store += [f"    subgroupMatrixStore(&Sc, sg * 256u, gf{n}, false, 16u);", "    workgroupBarrier();",
                  "    for (var e = lane; e < 256u; e = e + 32u) {",
                  f"        if ({row} < T) {{ out[((b * T + {row}) * H + h) * D + {f * n}u + e % 16u] = "
                  f"Sc[sg * 256u + e] * factor; }}",
                  "    }", "    workgroupBarrier();"]
    grid = _split_grid(graph, node, -(-t // queries), h, bsz, 1)
    meta = [t, s, h, hkv, causal, f32_bits(scale), scales_at]
    kernel = _finish(node.op, "attention", "attention_coop_dq.wgsl", ["k", "scores"], ["vec4<f32>", "vec4<u32>"],
                     "f32", meta, grid, caps, enables=COOP_ENABLES + ("subgroups",), D=d, PAD=_HALF_PAD,
                     BQ=queries, BK=keys, THREADS=threads, ENTRY=entry_point(threads),
                     PUT_TILES=put_tiles(("k", "Kh"), split=split),
                     RESULTS="\n".join("    " + _result(f"gf{n}") for n in range(dk)),
                     LOOP="\n".join(loop), STORE="\n".join(store), SCRATCH=256 * queries // 16,
                     FACTORS=factors, QG=scale_queries(split), **_dq_factor_subs(factors), **_dq_split_subs(split))
    kernel.notes["variant"] = (f"cooperative dq as the product dS K: {queries} queries a workgroup, keys streamed "
                               f"{keys} at a time, K and dS fetched {len(sets)} block{'s' * (len(sets) > 1)} ahead, "
                               f"dS from attention_grad_kv{', its factors staged once' if factors else ''}, "
                               + (f"f32 as hi and lo f16 parts, three {f}x{f}x{f} products" if split
                                  else f"f16 {f}x{f}x{f} -> f32"))
    kernel.guarded = True
    return kernel


def _dq_split_subs(split: bool) -> dict:
    """attention_coop_dq.wgsl's parts that differ for split products: put_s (the staged
    dS, times its factor, into Sh; ``split``: the sum of its hi and lo parts, times the
    factor, split again into Sh and Sl), the lo tiles and K's scale."""
    if not split:
        put_s = """// Staged element e of fetch_s times its factor f, rounded to f16 into Sh (zeros where f is:
// the words past T may be anything).
fn put_s(e: u32, w: vec4<u32>, f: f32) {
    let at = e / (BQ / 8u) * QS + e % (BQ / 8u) * 8u;
    for (var i = 0u; i < 4u; i = i + 1u) {
        let x = select(vec2<f16>(0.0), vec2<f16>(unpack2x16float(w[i]) * f), f > 0.0);
        Sh[at + 2u * i] = x.x;
        Sh[at + 2u * i + 1u] = x.y;
    }
}"""
        return dict(PUT_S=put_s, SPLIT_DECLS="", K_UNSCALE="")
    put_s = f"""// Staged element e of fetch_s (hi parts w, lo parts wl) times its factor f, split into
// Sh and Sl (zeros where f is: the words past T may be anything).
fn put_s(e: u32, w: vec4<u32>, wl: vec4<u32>, f: f32) {{
    let at = e / (BQ / 8u) * QS + e % (BQ / 8u) * 8u;
    for (var i = 0u; i < 4u; i = i + 1u) {{
        let x = select(vec2<f32>(0.0), (unpack2x16float(w[i]) + unpack2x16float(wl[i])) * f, f > 0.0);
        let t = vec2<f32>({hi_part('x.x', False)}, {hi_part('x.y', False)});
        Sh[at + 2u * i] = f16(t.x);
        Sh[at + 2u * i + 1u] = f16(t.y);
        Sl[at + 2u * i] = f16(x.x - t.x);
        Sl[at + 2u * i + 1u] = f16(x.y - t.y);
    }}
}}"""
    decls = "\n".join(["var<workgroup> Kl: array<f16, BK * KS>;", "var<workgroup> Sl: array<f16, BK * QS>;",
                       "var<workgroup> red: array<f32, SUBGROUPS>;   // the subgroups' largest |K|",
                       _template("tile_scales.wgsl")])
    return dict(PUT_S=put_s, SPLIT_DECLS=decls, K_UNSCALE=" / s_k")

