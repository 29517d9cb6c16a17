"""The attention forward on cooperative matrices (attention_coop.wgsl): Q K^T and P V on
f16 16 x 16 fragments accumulating in f32, the online softmax in f32 by the subgroups'
lanes. Taken where the matmul takes its cooperative kernels (``caps.matmul_f16``), and in
f32 where it takes its split ones (``caps.matmul_split``): then each operand is two f16
parts and each product three.
"""

from __future__ import annotations

import math

from ..graph.ir import Graph, Node
from .attention import (_attention, _attention_dims, _combine_forward_splits, _split_grid, attention_splits,
                        attention_stats_at)
from .common import Capabilities, Kernel, _finish, _render, _template, f32_bits
from .matmul_coop import COOP_ENABLES, COOP_FRAGMENT, hi_part

COOP_QUERIES = 64      # queries a workgroup owns: 16 for each of its 4 subgroups
COOP_KEYS = 16         # keys a block: 12.3 KiB of workgroup memory, so that three workgroups share an SM
                       # of the H100 (run 43); its Vulkan driver gives a pipeline about 48 KiB an SM (run 40)
COOP_KEYS_WIDE = 32    # head dims whose 16-key blocks are no whole number of vec4s a thread (16, 48)
COOP_SUBGROUPS = 4
COOP_MAX_HEAD_DIM = 128   # Qwen3's, Llama 3 8B's, Mistral 7B's heads: O's 8 result fragments a subgroup
_HALF_PAD = 8          # halves a row of the f16 tiles is padded by (rows stay 16-byte aligned)


def scratch_row(width: int) -> int:
    """Floats a row of a subgroup's f32 scratch holding ``width`` columns (16, 32 or 64), rows
    ``width / 8`` banks apart: a 16 x 16 result fragment is stored in the fewest passes
    (8 of its 256 floats a bank) and the lanes' rotated reads of a row (lane: row
    lane % 16, column 2 ((c + row) % (width / 2)) + lane / 16) hit 32 banks. At 64 floats
    for 64 columns every row began on bank 0 and a fragment took twice the passes: the
    attention kernels ran 7-10% slower (run 37). At 16 columns (18 floats) the lanes read
    in order (``lane_column``)."""
    return width + width // 8


def forward_keys(head_dim: int) -> int:
    """Keys a block of the forward: ``COOP_KEYS`` where a block's K (and V) rows are a
    whole number of vec4s for each of the workgroup's threads, else ``COOP_KEYS_WIDE``.
    Blocks of 16 keys (12.3 KiB at D = 64, three workgroups an SM) took whisper-tiny's
    encoder attention at batch 8 from 1600-1610 to 1267-1269 us a step, the encoder from
    3.76-3.82 to 3.39-3.41 ms, its b8 training step from 13.17-13.32 to 12.91-12.94 ms,
    gpt-tiny's step even (run 43): three barriers a block of half the products, but a
    third more warps an SM and whisper's 1,152 workgroups in three full waves, not four
    and a third."""
    return COOP_KEYS if COOP_KEYS * head_dim // 4 % (32 * COOP_SUBGROUPS) == 0 else COOP_KEYS_WIDE


def lane_column(c: int, width: int) -> str:
    """The scratch column (WGSL) a lane takes at step ``c`` of its row (row r = lane % 16,
    parity half = lane / 16) of ``width`` columns, ``scratch_row`` floats apart: rotated
    by the row where rows are width / 8 banks apart (32 and 64 columns), so that the 32
    lanes hit 32 banks; in order for rows of 18 floats (16 columns), whose 16 rows begin
    on the 16 even banks once each, where the rotation put two lanes on each bank."""
    if width > 16:
        return f"({c}u + r) % {width // 2}u * 2u + half"
    return f"{c}u * 2u + half"


def coop_attention_bytes(head_dim: int, split: bool = False) -> int:
    """Workgroup memory of attention_coop.wgsl: the f16 K and V blocks (padded rows; Q is
    staged through both), each subgroup's f16 P rows and f32 scratch of 16 x the block's
    keys, the rows' flags and factors; ``split``: the lo parts of K, V and P too, and the
    subgroups' largest values."""
    keys = forward_keys(head_dim)
    parts = 2 if split else 1
    kv = parts * 2 * 2 * keys * (head_dim + _HALF_PAD)
    p = parts * 2 * COOP_SUBGROUPS * 16 * (keys + _HALF_PAD)
    return (kv + p + 4 * COOP_SUBGROUPS * 16 * scratch_row(keys) + 4 * (COOP_SUBGROUPS + COOP_QUERIES)
            + (4 * 2 * COOP_SUBGROUPS if split else 0))


def coop_attention_supported(head_dim: int, caps: Capabilities) -> bool:
    """Whether an attention of this head dim runs on cooperative matrices: where the matmul
    does (``caps.matmul_f16``, or in f32 ``caps.matmul_split``: ``split_products``), for
    head dims of whole fragments up to ``COOP_MAX_HEAD_DIM`` whose blocks fit the device's
    workgroup memory, unless ``MEGANEURA_ATTENTION`` forces the SIMT kernels (``tiled``:
    the flash ones, ``per-query``). The backward's kernels stop at 64
    (``coop_backward_supported``), as the f32 ones do."""
    return ((caps.matmul_f16 or caps.matmul_split) and caps.knobs.attention == "auto"
            and head_dim % COOP_FRAGMENT == 0 and 0 < head_dim <= COOP_MAX_HEAD_DIM
            and coop_attention_bytes(head_dim, split_products(caps)) <= caps.workgroup_storage)


def _fragment(kind: str, tile: str, offset: str, col_major: bool, stride: str) -> str:
    f = COOP_FRAGMENT
    return (f"subgroupMatrixLoad<subgroup_matrix_{kind}<f16, {f}, {f}>>(&{tile}, {offset}, "
            f"{'true' if col_major else 'false'}, {stride})")


def entry_point(threads: int) -> str:
    """The cooperative attention kernels' ``{{ENTRY}}`` (attention_coop_entry.wgsl, its
    comment left out): ``main``'s signature for ``threads`` a workgroup and the meta words
    all three begin with."""
    text = _render("attention_coop_entry.wgsl", THREADS=threads)
    return "\n".join(line for line in text.splitlines() if not line.startswith("//"))


def put_tiles(*names: tuple[str, str], split: bool = False) -> str:
    """The put_NAME functions (f16_tile_put.wgsl) that round staged vec4s into each
    (NAME, tile) of a cooperative attention kernel; ``split``: the hi part (``hi_part``)
    into the tile and the lo part into its twin (Kh's: Kl)."""
    def parts(tile: str) -> str:
        stores = lambda t, v: " ".join(f"{t}[at{f' + {i}u' if i else ''}] = {v}.{c};"  # noqa: E731
                                       for i, c in enumerate("xyzw"))
        if not split:
            return f"    let h = vec4<f16>(x);\n    {stores(tile, 'h')}"
        return (f"    let t = {hi_part('x', True)};\n    let h = vec4<f16>(t);\n    let l = vec4<f16>(x - t);\n"
                f"    {stores(tile, 'h')}\n    {stores(lo_tile(tile), 'l')}")
    return "\n\n".join(_render("f16_tile_put.wgsl", NAME=name, TILES=tile + (f" and {lo_tile(tile)}" if split else ""),
                                 PARTS=parts(tile)) for name, tile in names)


def lo_tile(tile: str) -> str:
    """The workgroup tile holding the lo parts of split tile ``tile`` (Kh: Kl)."""
    return tile[:-1] + "l"


def staged_in_two_tiles(puts: tuple[str, str], value, count: int, in_first: int, threads: int) -> list[str]:
    """The staging of a 64-row operand whose first rows go to one 32-row tile and the rest
    to another: each thread's ``count`` vec4s (``value(n)``, the WGSL of the n-th, element
    tid + n ``threads``) through ``puts`` (the two tiles' put functions), the first
    ``in_first`` elements into the first."""
    first, second = puts
    return [f"    {first}(tid + {n * threads}u, {value(n)});" if n * threads < in_first else
            f"    {second}(tid + {n * threads - in_first}u, {value(n)});" for n in range(count)]


def fragments_of_two_tiles(name: str, tiles: tuple[str, str], dk: int) -> list[str]:
    """WGSL declaring a subgroup's ``dk`` left fragments ``name``0.. of its 16 rows of a
    64-row operand staged by ``staged_in_two_tiles``: subgroups 0 and 1 load theirs from
    the first tile, 2 and 3 from the second (a branch uniform in each subgroup)."""
    f = COOP_FRAGMENT
    lines = [f"    var {name}{kk}: subgroup_matrix_left<f16, {f}, {f}>;" for kk in range(dk)]
    for test, tile, row in (("if (sg < 2u) {", tiles[0], "sg"), ("} else {", tiles[1], "(sg - 2u)")):
        lines.append("    " + test)
        lines += [f"        {name}{kk} = {_fragment('left', tile, f'{row} * 16u * KS + {f * kk}u', False, 'KS')};"
                  for kk in range(dk)]
    return lines + ["    }"]


def _result(name: str) -> str:
    return f"var {name} = subgroup_matrix_result<f32, {COOP_FRAGMENT}, {COOP_FRAGMENT}>();"


def _fragment_rounds(d: int, per: int = 2) -> list[list[int]]:
    """O's result fragments as they go through a subgroup's scratch: ``per`` at a time (two
    for a scratch of 32 columns)."""
    frags = list(range(d // COOP_FRAGMENT))
    return [frags[i:i + per] for i in range(0, len(frags), per)]


def _staged_q(d: int, tile_rows: int, threads: int, split: bool = False) -> tuple[list[str], list[str]]:
    """(STAGE_Q, LOAD_Q) of the forward: Q's 64 rows (rounded to f16) staged through the K
    and V tiles of ``tile_rows`` rows, each subgroup loading its 16 rows as D / 16 left
    fragments. Tiles of 32 rows hold them at once (``fragments_of_two_tiles``); smaller
    ones in rounds of 2 ``tile_rows``, a barrier before and after each round's loads.
    ``split``: Q's rows are fetched first and scaled by the power of two that puts their
    largest |value| in [2^14, 2^15) (``ex_q``), their lo parts staged through Kl and Vl
    and loaded as fragments ql0.."""
    steps = COOP_QUERIES * d // 4 // threads
    parts = (("qf", ("Kh", "Vh")), ("ql", ("Kl", "Vl"))) if split else (("qf", ("Kh", "Vh")),)
    if split:
        fetched = [f"    let qr{n} = fetch_rows(tid + {n * threads}u, b, h, q0, T, H, 0u);" for n in range(steps)]
        stage = fetched + workgroup_top("top_q", [f"amax4(qr{n})" for n in range(steps)], 0, "    ")
        stage += ["    workgroupBarrier();", "    let ex_q = exponent_of(red_top(0u));", "    let s_q = exp2(14.0 - ex_q);"]
        value = lambda first: lambda n: f"qr{n + first * d // 4 // threads} * s_q"  # noqa: E731
    else:
        stage = []
        value = lambda first: lambda n: f"fetch_rows(tid + {n * threads}u, b, h, q0 + {first}u, T, H, 0u)"  # noqa: E731
    more, loads = staged_in_rounds(("put_k", "put_v"), value, parts, d, tile_rows, threads)
    return stage + more, loads


def staged_in_rounds(puts: tuple[str, str], value, parts, d: int, tile_rows: int,
                     threads: int) -> tuple[list[str], list[str]]:
    """(staging, last loads) of 64 rows through two tiles of ``tile_rows`` rows (``puts``:
    their put functions; ``value(first)(n)``: the WGSL of element tid + n ``threads`` of
    the rows from ``first`` on), each subgroup loading its 16 rows as left fragments
    ``name``0.. from each (name, tiles) of ``parts``. Tiles of 32 rows hold them at once
    (``fragments_of_two_tiles``); smaller ones in rounds of 2 ``tile_rows``, a barrier
    before and after each round's loads. A barrier goes between the staging and the
    last loads."""
    f, dk = COOP_FRAGMENT, d // COOP_FRAGMENT
    per_round = 2 * tile_rows
    if per_round >= COOP_QUERIES:
        stage = staged_in_two_tiles(puts, value(0), COOP_QUERIES * d // 4 // threads, tile_rows * d // 4, threads)
        return stage, [line for name, tiles in parts for line in fragments_of_two_tiles(name, tiles, dk)]
    stage = [f"    var {name}{kk}: subgroup_matrix_left<f16, {f}, {f}>;" for name, _ in parts for kk in range(dk)]
    loads = []
    for start in range(0, COOP_QUERIES, per_round):
        if start:
            stage += ["    workgroupBarrier();", *loads, "    workgroupBarrier();"]
        stage += staged_in_two_tiles(puts, value(start), per_round * d // 4 // threads, tile_rows * d // 4, threads)
        loads = []
        for sg in range(start // 16, (start + per_round) // 16):
            which, row = (sg * 16 - start) // tile_rows, (sg * 16 - start) % tile_rows
            loads += [f"    if (sg == {sg}u) {{"] + [
                f"        {name}{kk} = {_fragment('left', tiles[which], f'{row}u * KS + {f * kk}u', False, 'KS')};"
                for name, tiles in parts for kk in range(dk)] + ["    }"]
    return stage, loads


def workgroup_top(var: str, terms: list[str], at: int, ind: str) -> list[str]:
    """WGSL that puts each subgroup's largest of ``terms`` (its threads' f32 expressions)
    in ``red[at + sg]``, for ``red_top(at)`` to read after a barrier."""
    return ([f"{ind}var {var} = 0.0;"] + [f"{ind}{var} = max({var}, {t});" for t in terms]
            + [f"{ind}{{ let top = subgroupMax({var}); if (lane == 0u) {{ red[{at}u + sg] = top; }} }}"])


def split_products(caps: Capabilities) -> bool:
    """Whether the cooperative attention kernels multiply f32 operands as hi and lo f16
    parts, three products each (``caps.matmul_split``, where f16 is not asked for)."""
    return caps.matmul_split and not caps.matmul_f16


def split_store(value: str, at: str) -> str:
    """A WGSL block storing f32 ``value`` (an expression) at ``at`` of a subgroup's P rows:
    its hi part (``hi_part``) into Ph, the rest into Pl."""
    return f"{{ let x = {value}; let t = {hi_part('x', False)}; Ph[{at}] = f16(t); Pl[{at}] = f16(x - t); }}"


def fragment_product(left: tuple[str, str], right, acc: str, ind: str, split: bool) -> list[str]:
    """``acc`` plus the product of left fragment ``left[0]`` and ``right("h")``'s fragment;
    ``split``: of the split operands (hi ``left[0]``, lo ``left[1]``; ``right(part)``
    with part "h" or "l"), three products, the small terms (hi lo, lo hi) first."""
    pairs = ((left[1], "h"), (left[0], "l"), (left[0], "h")) if split else ((left[0], "h"),)
    return [f"{ind}{acc} = subgroupMatrixMultiplyAccumulate({x}, {right(y)}, {acc});" for x, y in pairs]


def _coop_subs(d: int, split: bool = False) -> dict:
    """attention_coop.wgsl's unrolled parts for head dim ``d``: Q's fragments (row-major,
    staged through Kh and Vh: ``_staged_q``), S = Q K^T (K^T a column-major view of key-major Kh), the
    staging of Q and of the key blocks (unrolled: as a loop, each thread's global loads went
    one after another and the kernel took 2.1x as long on the H100; K fetched a block ahead
    and V at the top of its block, each stored once the products that hide its loads are
    done), the lanes' softmax over their half of a row's keys (``lane_column``), P V (P
    row-major in Ph, V row-major in Vh) accumulated on O's result fragments, their rare
    rescaling and the output, both through the scratch as many fragments at a time as it
    has columns (a block's keys: ``forward_keys``).
    ``split`` (``split_products``): Q, K, V and P as hi and lo parts (Kl, Vl, Pl beside
    Kh, Vh, Ph), each product three; Q scaled once (``_staged_q``), each block's K and V by
    the power of two of its largest |value| (met in ``red`` at the barriers the block
    already has: K's at the previous block's end, V's before its scores are read), the
    scores multiplied back in f32 and O's fragments multiplied by the ratio where a block
    lowers V's scale (only ever lowered, as the backward's dO), divided by it at the end."""
    f, dk, block = COOP_FRAGMENT, d // COOP_FRAGMENT, forward_keys(d)
    keys = block // 2
    ind = " " * 8
    key = lambda c: lane_column(c, block)  # noqa: E731
    threads = 32 * COOP_SUBGROUPS
    elements = [f"tid + {n * threads}u" for n in range(block * d // 4 // threads)]
    stage_q, load_q = _staged_q(d, block, threads, split)
    fetch_first = [f"    var kr{n} = fetch_rows({e}, b, hk, part * per_part * BKV, S, HKV, 1u);"
                   for n, e in enumerate(elements)]
    k_terms = [f"amax4(kr{n})" for n in range(len(elements))]
    k_top = workgroup_top("top_k", k_terms, 0, ind)
    times_k, times_v = (" * s_k", " * s_v") if split else ("", "")
    stage = ([f"{ind}let s_k = exp2(14.0 - ex_k);", f"{ind}let ss = scale * exp2(ex_q + ex_k - 28.0);"] if split else [])
    stage += ([f"{ind}put_k({e}, kr{n}{times_k});" for n, e in enumerate(elements)]
              + [f"{ind}let vr{n} = fetch_rows({e}, b, hk, k0, S, HKV, 2u);" for n, e in enumerate(elements)])
    fetch_next = [f"{ind}kr{n} = fetch_rows({e}, b, hk, k0 + BKV, S, HKV, 1u);" for n, e in enumerate(elements)]
    put_v = [f"{ind}put_v({e}, vr{n}{times_v});" for n, e in enumerate(elements)]
    kh = lambda n, kk: lambda part: _fragment("right", "K" + part, f"{f * n}u * KS + {f * kk}u", True, "KS")  # noqa: E731
    vh = lambda n, kk: lambda part: _fragment("right", "V" + part, f"{f * kk}u * KS + {f * n}u", False, "KS")  # noqa: E731
    scores = []
    for n in range(block // f):
        scores.append(ind + _result(f"s{n}"))
        for kk in range(dk):
            scores += fragment_product((f"qf{kk}", f"ql{kk}"), kh(n, kk), f"s{n}", ind, split)
        scores.append(f"{ind}subgroupMatrixStore(&Sc, sb + {f * n}u, s{n}, false, SS);")
    score_scale = "ss" if split else "scale"
    read = [f"{ind}sv[{c}] = select(NEG, Sc[sb + r * SS + {key(c)}] * {score_scale}, k0 + {key(c)} < key_end);"
            for c in range(keys)]
    if split:
        fetch_next += workgroup_top("top_v", [f"amax4(vr{n})" for n in range(len(elements))], 4, ind)
        read = [f"{ind}let s_vb = min(s_v, exp2(14.0 - exponent_of(red_top(4u))));",
                f"{ind}let ratio_v = s_vb / s_v;", f"{ind}s_v = s_vb;"] + read
        probabilities = [f"{ind}{{ let p = select(0.0, exp2(sv[{c}] - mx_new), sv[{c}] > NEG); "
                         f"{split_store('p', f'pb + r * PS + {key(c)}')} sum = sum + p; }}" for c in range(keys)]
    else:
        probabilities = [f"{ind}{{ let p = f16(select(0.0, exp2(sv[{c}] - mx_new), sv[{c}] > NEG)); "
                         f"Ph[pb + r * PS + {key(c)}] = p; sum = sum + f32(p); }}" for c in range(keys)]
    pv = [f"{ind}let p{part}{kk} = {_fragment('left', 'P' + part, f'pb + {f * kk}u', False, 'PS')};"
          for part in ("hl" if split else "h") for kk in range(block // f)]
    pv += [f"{ind}of{n} = subgroupMatrixScalarMultiply(of{n}, ratio_v);" for n in range(dk)] if split else []
    for n in range(dk):
        for kk in range(block // f):
            pv += fragment_product((f"ph{kk}", f"pl{kk}"), vh(n, kk), f"of{n}", ind, split)
    store = lambda frags, pre: [f"{pre}subgroupMatrixStore(&Sc, sb + {f * i}u, of{n}, false, SS);"  # noqa: E731
                                for i, n in enumerate(frags)]
    rescale, write_o = [], []
    for frags in _fragment_rounds(d, block // f):
        width = f * len(frags)
        rescale += (store(frags, ind + "    ") + [f"{ind}    workgroupBarrier();"]
                    + [f"{ind}    Sc[sb + r * SS + {lane_column(c, width)}] = Sc[sb + r * SS + "
                       f"{lane_column(c, width)}] * corr;"
                       for c in range(width // 2)]
                    + [f"{ind}    workgroupBarrier();"]
                    + [f"{ind}    of{n} = subgroupMatrixLoad<subgroup_matrix_result<f32, {f}, {f}>>(&Sc, sb + {f * i}u, "
                       f"false, SS);" for i, n in enumerate(frags)]
                    + [f"{ind}    workgroupBarrier();"])
        write_o += (store(frags, "    ") + ["    workgroupBarrier();",
                    f"    for (var e = lane; e < {16 * width}u; e = e + 32u) {{",
                    f"        let row = q0 + 16u * sg + e / {width}u;",
                    "        if (row < T) {",
                    f"            out[base + ((b * T + row) * H + h) * D + {f * frags[0]}u + e % {width}u] = "
                    f"Sc[sb + e / {width}u * SS + e % {width}u] * Inv[16u * sg + e / {width}u];",
                    "        }", "    }", "    workgroupBarrier();"])
    split_subs = dict(SPLIT_DECLS="", FIRST_K_SCALE="", NEXT_K_TOP="", NEXT_K_SCALE="", UNSCALE_O="")
    if split:
        split_subs = dict(
            SPLIT_DECLS="\n".join(["var<workgroup> Kl: array<f16, BKV * KS>;", "var<workgroup> Vl: array<f16, BKV * KS>;",
                                   "var<workgroup> Pl: array<f16, 4u * 16u * PS>;",
                                   "var<workgroup> red: array<f32, 8>;    // the subgroups' largest |Q| or |K|, |V|",
                                   "", _template("tile_scales.wgsl")]),
            FIRST_K_SCALE="\n".join([*workgroup_top("top_k", k_terms, 0, "    "), "    workgroupBarrier();",
                                     "    var ex_k = exponent_of(red_top(0u));", "    var s_v = exp2(114.0);"]),
            NEXT_K_TOP="\n".join(k_top), NEXT_K_SCALE=f"{ind}ex_k = exponent_of(red_top(0u));",
            UNSCALE_O="    inv = inv / s_v;")
    return dict(D=d, BKV=block, LANE_KEYS=keys, PAD=_HALF_PAD, SS=scratch_row(block),
                PUT_TILES=put_tiles(("k", "Kh"), ("v", "Vh"), split=split),
                LOAD_Q="\n".join(load_q), STAGE_Q="\n".join(stage_q),
                RESULTS="\n".join("    " + _result(f"of{n}") for n in range(dk)),
                STAGE="\n".join(stage), FETCH_FIRST="\n".join(fetch_first), FETCH_NEXT="\n".join(fetch_next),
                PUT_V="\n".join(put_v),
                SCORES="\n".join(scores), READ_SCORES="\n".join(read),
                ROW_MAX="\n".join(f"{ind}top = max(top, sv[{c}]);" for c in range(keys)),
                PROBABILITIES="\n".join(probabilities),
                RESCALE="\n".join(rescale), PV="\n".join(pv), WRITE_O="\n".join(write_o), **split_subs)


def attention_forward(graph: Graph, node: Node, caps: Capabilities) -> Kernel:
    """The kernel of an ``attention`` or ``attention_stats`` node: on cooperative matrices
    where ``coop_attention_supported``, else the f32 kernels (``_attention``)."""
    dims = _attention_dims(node, graph[node.inputs[0]], graph[node.inputs[1]])
    if coop_attention_supported(dims[5], caps):
        return coop_attention(graph, node, *dims, caps, attention_stats_at(graph, node))
    return _attention(graph, node, caps)


def coop_attention(graph: Graph, node: Node, bsz, t, s, h, hkv, d, causal, scale, caps: Capabilities,
                   lse_at: int = 0) -> Kernel:
    """The cooperative-matrix attention forward of ``node`` (dims as ``_attention_dims``),
    its keys split among workgroups where the grid is too small to fill the GPU
    (``attention_splits``; the parts combined by attention_splits.wgsl, as the SIMT
    kernel's); with ``lse_at`` (attention_stats) its rows' log-sum-exp from there on."""
    blocks = -(-t // COOP_QUERIES)
    splits = attention_splits(blocks * h * bsz, -(-s // forward_keys(d)), caps.knobs, caps.tuning)
    grid = _split_grid(graph, node, blocks, h, bsz, splits)
    meta = [t, s, h, hkv, causal, f32_bits(scale * math.log2(math.e)), splits, bsz]
    kernel = _finish("attention", "attention", "attention_coop.wgsl", ["q", "k", "v"], ["vec4<f32>"] * 3, "f32",
                     meta, grid, caps, enables=COOP_ENABLES + ("subgroups",),
                     ENTRY=entry_point(32 * COOP_SUBGROUPS),
                     SPLIT="true" if splits > 1 else "false", LSE_AT=lse_at, **_coop_subs(d, split_products(caps)))
    f = COOP_FRAGMENT
    kernel.notes["variant"] = (f"cooperative flash {COOP_QUERIES} queries x {forward_keys(d)} keys, "
                               + (f"f32 as hi and lo f16 parts, three {f}x{f}x{f} products" if split_products(caps)
                                  else f"f16 {f}x{f}x{f} -> f32") + f", {COOP_SUBGROUPS} subgroups"
                               + (", its rows' log-sum-exp kept" if lse_at else ""))
    kernel.guarded = True
    return _combine_forward_splits(kernel, splits, bsz, t, h, d, lse_at)
