"""Attention with online softmax: the per-query and tiled (flash) forward, split
streams and their combine, the log-sum-exp and the backward kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Knobs
from ..errors import DeviceError
from ..graph.ir import Graph, Node
from ..graph.ops import attention_grad_kv_layout, attention_stats_layout, tiled_attention_head_dim
from .common import (MAX_WORKGROUPS, PLAIN, WG, Capabilities, Kernel, UnsupportedOpError, _finish, _render,
                     _template, _thread_xy, f32_bits, grid_1d)
from .copies import rope_frequencies
from .tuning import Tuning


def attention_variant(head_dim: int, knobs: Knobs = Knobs()) -> str:
    """Which attention kernel a head dim gets: ``"tiled"`` (flash attention, blocks of
    queries and keys in workgroup memory, a vec4 of output columns per thread) where D is a multiple of 4 up
    to 64, else ``"per-query"`` (one thread per query streaming over the keys).
    ``knobs.attention`` (``MEGANEURA_ATTENTION=per-query``) forces the latter (benchmarks and tests)."""
    if knobs.attention == "per-query":
        return "per-query"
    return "tiled" if tiled_attention_head_dim(head_dim) else "per-query"


def _attention_dims(node: Node, q: Node, k: Node):
    """(batch, T, S, H, HKV, D, causal, scale) of an attention op's node."""
    a = node.attrs
    h = a["num_heads"]
    hkv = a.get("num_kv_heads") or h
    bsz, t, w = q.shape
    d = w // h
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return bsz, t, k.shape[1], h, hkv, d, int(bool(a.get("causal"))), scale


def attention_stats_at(graph: Graph, node: Node) -> int:
    """Where an ``attention_stats`` node's log-sum-exp starts in its packed result (0 for
    ``attention``, which keeps none)."""
    if node.op != "attention_stats":
        return 0
    return attention_stats_layout(graph[node.inputs[0]].shape, node.attrs["num_heads"])[0][1]


def _attention(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """attention, and attention_stats (the tiled kernel writing its rows' log-sum-exp too),
    on the f32 kernels."""
    bsz, t, s, h, hkv, d, causal, scale = _attention_dims(node, graph[node.inputs[0]], graph[node.inputs[1]])
    lse_at = attention_stats_at(graph, node)
    if lse_at and not tiled_attention_head_dim(d):
        raise UnsupportedOpError(f"{graph.format_node(node)}: no attention_stats kernel for head dim {d} (it takes "
                                 f"multiples of 4 up to 64)")
    if lse_at or attention_variant(d, caps.knobs) == "tiled":
        return _attention_tiled(graph, node, bsz, t, s, h, hkv, d, causal, scale, caps, lse_at)
    return _attention_per_query(graph, node, bsz, t, s, h, hkv, d, causal, scale)


def _attention_per_query(graph, node, bsz, t, s, h, hkv, d, causal, scale) -> Kernel:
    total = bsz * h * t
    meta = [total, t, s, h, hkv, causal, f32_bits(scale)]
    kernel = _finish("attention", "attention", "attention.wgsl", ["q", "k", "v"], ["f32"] * 3, "f32",
                     meta, grid_1d(-(-total // 64)), D=d,
                     SCORE=" + ".join(f"qv[{i}] * k[kb + {i}u]" for i in range(d)),
                     ACCUMULATE="\n".join(f"        acc[{i}] = acc[{i}] * corr + p * v[kb + {i}u];"
                                           for i in range(d)))
    kernel.notes["variant"] = "one thread per query"
    return kernel


def _cached_attention(graph: Graph, node: Node, caps: Capabilities = PLAIN, write: Node | None = None) -> Kernel:
    """A generation step's attention over the KV cache (attention_cached.wgsl): a
    workgroup of 256 threads per query and head. At batch 1 a decode step has only H
    queries: one thread each (the per-query kernel) took 74 us a layer on the H100 for
    576 keys, each thread alone walking its keys' rows; here four groups of 64 threads
    take blocks of 64 keys, one key (score) or output dimension (update) a thread.
    ``write``: the ``cache_write`` of this step's keys and values that the attention reads
    through (``cached_attention_writing``), done by this kernel first: its inputs
    ``k_new`` and ``v_new`` follow ``positions``, and the cache's two planes are bound
    read-write after the output, as ``k`` and ``v``."""
    q, k = graph[node.inputs[0]], graph[node.inputs[1]]
    bsz, t, s, h, hkv, d, _, scale = _attention_dims(node, q, k)
    splits = cached_attention_splits(bsz * t * h, s)
    grid = (t * splits, h, bsz)
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: cached attention grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension")
    width = 4 if d % 4 == 0 else 1
    ktype = "vec4<f32>" if width == 4 else "f32"
    rope = node.attrs.get("rope", False)

    qval = (lambda e: _head_value("q", "qb", e, 5)) if rope else (lambda e: f"q[qb + {e}]")
    load_q = "    " + _head_loop(lambda i: f"qs[{i}]", lambda e: f"{qval(e)} * scale", width)
    if width == 4:
        score = " + ".join(f"dot(qs[{i}], k[kb + {i}u])" for i in range(d // 4))
    else:
        score = " + ".join(f"qs[{i}] * k[kb + {i}u]" for i in range(d))
    meta = [t, s, h, hkv, f32_bits(scale)] + (rope_frequencies(d, node.attrs["rope_base"], node.attrs["rope_scaling"])
                                                 if rope else [])
    names, types = ["q", "k", "v", "positions"], ["f32", ktype, "f32", "i32"]
    subs = dict(WRITE_BINDINGS="", WRITE_ROW="")
    if write is not None:
        names, types = ["q", "positions", "k_new", "v_new"], ["f32", "i32", "f32", "f32"]
        subs = _cache_row_write(write, meta, d, width, ktype, len(names) + 2)
    kernel = _finish("cached_attention", "attention", "attention_cached.wgsl", names, types, "f32", meta, grid,
                     ROPE_FN=_template("rope_fn.wgsl") if rope or (write is not None and write.attrs["rope_heads"]) else "",
                     D=d, R=-(-d // 64), KTYPE=ktype, KWIDTH=width, QWORDS=d // width, LOAD_Q=load_q, SCORE=score,
                     SPLITS=splits, **subs,
                     BLOCK_MAX="\n".join(f"        top = max(top, ps[g][{j}]);" for j in range(64)),
                     BLOCK_SUM="\n".join(f"        total = total + ps[g][{j}];" for j in range(64)),
                     V_SUM="\n".join(f"                sum = sum + ps[g][{j}] * v[vb + min(first + {j}u, last) * stride];"
                                      for j in range(64)))
    kernel.notes["variant"] = "a workgroup per query and head, 4 x 64 threads over blocks of 64 keys"
    if write is not None:
        kernel.notes["variant"] += ", writing the step's keys and values into the cache first"
    if splits > 1:
        rows = bsz * t * h
        kernel.partials = rows * splits * (d + 2)
        kernel.finish = _finish("cached_attention:combine", "attention", "attention_cached_combine.wgsl",
                                ["partials"], ["f32"], "f32", [rows * d, splits, d], grid_1d(-(-rows * d // WG)))
        kernel.notes["variant"] += f", the cache's keys split {splits} ways"
    return kernel


def _cache_row_write(write: Node, meta: list[int], d: int, width: int, ktype: str, binding: int) -> dict[str, str]:
    """The template slots of a cached attention that writes its step's key and value rows
    (``write``, a ``cache_write`` of both) into the cache first: the cache's planes as
    read-write bindings, and the rows, the key rotated by the write's RoPE (its inverse
    frequencies appended to ``meta``) exactly as cache_write.wgsl rotates it; ``binding``:
    the first plane's binding number."""
    heads = write.attrs.get("rope_heads", 0)
    freq0 = len(meta)
    if heads:
        meta += rope_frequencies(d, write.attrs["rope_base"], write.attrs["rope_scaling"])

    key = (lambda e: _head_value("k_new", "xb", e, freq0)) if heads else (lambda e: f"k_new[xb + {e}]")
    keys = "        " + _head_loop(lambda i: f"k[cb / 4u + {i}]" if width == 4 else f"k[cb + {i}]", key, width)
    return dict(WRITE_BINDINGS="\n".join([
        f"@group(0) @binding({binding}) var<storage, read_write> k: array<{ktype}>;",
        f"@group(0) @binding({binding + 1}) var<storage, read_write> v: array<f32>;"]),
        WRITE_ROW="\n".join([
            "    if (pos < S && pos >= keys_lo && pos < keys_hi) {",
            "        let xb = (b * T + t) * HKV * D + hk * D;",
            "        let cb = (b * S + pos) * HKV * D + hk * D;",
            keys,
            "        for (var i = tid; i < D; i = i + 256u) { v[cb + i] = v_new[xb + i]; }",
            "    }",
            "    storageBarrier();"]))


def _head_value(array: str, base: str, e: str, freq0: int) -> str:
    """Element ``e`` of the head at ``array[base]`` rotated by RoPE at ``pos`` (rope_fn.wgsl),
    its inverse frequencies from meta word ``freq0`` on."""
    half = f"({e}) % (D / 2u)"
    return f"rope_({array}[{base} + {half}], {array}[{base} + {half} + D / 2u], {e}, D, pos, {freq0}u, false)"


def _head_loop(store, value, width: int) -> str:
    """The workgroup's 256 threads over a head's D elements, ``width`` (4 or 1) at a time:
    ``store(i)`` (the i-th vec4 or element) = ``value(e)`` of its elements."""
    if width == 4:
        parts = ", ".join(value(f"4u * i + {c}u") for c in range(4))
        return f"for (var i = tid; i < D / 4u; i = i + 256u) {{ {store('i')} = vec4<f32>({parts}); }}"
    return f"for (var i = tid; i < D; i = i + 256u) {{ {store('i')} = {value('i')}; }}"


def cached_attention_writing(graph: Graph, attention: Node, write: Node, caps: Capabilities = PLAIN) -> Kernel | None:
    """The kernel of ``attention``, a one-token cached attention, that also does ``write``,
    the ``cache_write`` of this step's keys and values into the cache it reads (both planes,
    as whole views, at the same positions), or None where it does not apply. Each workgroup
    whose keys include the step's position writes its kv head's two rows there before it
    reads any (the q heads sharing a kv head write the same values), so no other reads
    them in that dispatch; a decode step loses a dispatch and its wait a layer."""
    q, keys = graph[attention.inputs[0]], graph[attention.inputs[1]]
    xs = write.inputs[1:-1]
    if (attention.op != "cached_attention" or write.op != "cache_write" or len(xs) != 2 or q.shape[1] != 1
            or write.inputs[-1] != attention.inputs[3] or graph[xs[0]].shape[1] != 1):
        return None
    _, _, _, _, hkv, d, _, _ = _attention_dims(attention, q, keys)
    if graph[xs[0]].shape[-1] != hkv * d or write.attrs.get("rope_heads", 0) not in (0, hkv):
        return None
    return _cached_attention(graph, attention, caps, write=write)


def cached_attention_parts(graph: Graph, node: Node) -> tuple[int, int]:
    """(parts, head dim) of a cached attention's kernel: the parts it splits each query
    and head's keys into (1: its output whole), each [maximum, sum, D unnormalised sums]."""
    bsz, t, s, h, _, d, _, _ = _attention_dims(node, graph[node.inputs[0]], graph[node.inputs[1]])
    return cached_attention_splits(bsz * t * h, s), d


def combined_parts_prologue(values: int, parts: int, head_dim: int, threads: int) -> tuple[str, str]:
    """(declaration, first lines) of a kernel that reads a split cached attention's
    ``parts`` (heads of ``head_dim``) as its binding ``a_in`` and combines them into
    workgroup memory first, ``a_sh``, ``values`` (a multiple of 4) as vec4s, over ``threads``
    threads: the layout and arithmetic of attention_cached_combine.wgsl, whose dispatch and
    wait a decode step thus loses a layer (matmul's vector kernel, a decode step's o
    projection: every workgroup combines all of its A, 2048 values of 4 parts, from the L2)."""
    stride = head_dim + 2
    setup = [f"for (var j = 0u; j < {-(-values // threads)}u; j = j + 1u) {{   // a constant count: unrolled",
             f"    let i = t + j * {threads}u;",
             *([f"    if (i >= {values}u) {{ break; }}"] if values % threads else []),
             f"    let base = i / {head_dim}u * {parts * stride}u;",
             "    var top = a_in[base];",
             f"    for (var p = 1u; p < {parts}u; p = p + 1u) {{ top = max(top, a_in[base + p * {stride}u]); }}",
             "    var num = 0.0;",
             "    var den = 0.0;",
             f"    for (var p = 0u; p < {parts}u; p = p + 1u) {{",
             f"        let at = base + p * {stride}u;",
             "        let e = exp(a_in[at] - top);",
             "        den = den + e * a_in[at + 1u];",
             f"        num = num + e * a_in[at + 2u + i % {head_dim}u];",
             "    }",
             "    a_sh[i / 4u][i % 4u] = num / den;",
             "}",
             "workgroupBarrier();"]
    return (f"var<workgroup> a_sh: array<vec4<f32>, {values // 4}>;",
            "\n".join("    " + line for line in setup))


CACHED_SPLIT_KEYS = 256        # keys a workgroup of a split cached attention takes (one round)
CACHED_SPLIT_QUERIES = 64      # query-head rows below which the cache is split
CACHED_MAX_SPLITS = 16


def cached_attention_splits(rows: int, capacity: int) -> int:
    """Parts a cached attention over ``capacity`` keys splits each query-head row into: with
    few rows (a decode step at batch 1 has one per head) each workgroup would walk the whole
    cache alone, round after round of 256 keys (25 us for ~600 keys on the H100);
    split, a workgroup takes one round and a second dispatch combines the parts."""
    if rows >= CACHED_SPLIT_QUERIES:
        return 1
    return max(1, min(CACHED_MAX_SPLITS, -(-capacity // CACHED_SPLIT_KEYS)))


# An attention grid of fewer workgroups than the adapter's ``Tuning.attention_fill``
# splits its streamed side (below; docs/benchmarks.md, run 12).
ATTENTION_MIN_PART = 8     # streamed blocks a part keeps at least
ATTENTION_MAX_SPLITS = 16


def attention_splits(grid: int, streamed_blocks: int, knobs: Knobs = Knobs(), tuning: Tuning = Tuning()) -> int:
    """How many parts an attention kernel with ``grid`` workgroups (blocks of fixed rows x
    heads x batch) splits each workgroup's ``streamed_blocks`` blocks into. Whisper's
    encoder at batch 1 has 47 x 6 blocks of 32 queries, 282 workgroups of 128 threads:
    two an SM, too few to hide memory latency; splitting the keys three ways took its
    forward from 0.378 to 0.324 ms and its backward from 1.82 to 1.62 ms on the H100 (run
    12, 32-row blocks), at the price of partial results and a second dispatch that
    combines them; there six workgroups an SM, 792, filled it (``tuning.attention_fill``).
    Short streams lose: gpt-tiny's 256 causal keys ran 20% slower split in two.
    ``knobs.attention_splits`` (``MEGANEURA_ATTENTION_SPLITS``) forces N (benchmarks and tests)."""
    if knobs.attention_splits:
        return max(1, min(knobs.attention_splits, streamed_blocks))
    fill = tuning.attention_fill
    if grid >= fill:
        return 1
    return max(1, min(-(-fill // grid), streamed_blocks // ATTENTION_MIN_PART, ATTENTION_MAX_SPLITS))


def _split_grid(graph: Graph, node: Node, blocks: int, heads: int, bsz: int, splits: int):
    grid = (blocks, heads, bsz * splits)
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: attention grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension")
    return grid


_SPLIT_MODES = {"softmax": 0, "sum": 1, "logsumexp": 2}


_STORE_LSE = """    if (i < m(0u) && i % m(5u) == 0u) {{
        let e = {at}u + i / m(5u);
        out[e / 4u][e % 4u] = row_lse(i / m(5u));
    }}"""


def _split_combine(kernel: Kernel, mode: str, splits: int, n: int, partials: int, dims=(0, 0, 0, 0),
                   streamed: str = "keys", lse_at: int = 0) -> Kernel:
    """Make ``kernel`` (whose output binding now receives ``partials`` floats from
    ``splits`` parts) the first stage of a two-dispatch node whose second stage combines
    the parts into the ``n`` outputs (vec4s for ``softmax``): attention_splits.wgsl. With
    ``lse_at`` (softmax), the rows' log-sum-exp go to out from that element on."""
    bsz, t, h, d4 = dims
    typ = "vec4<f32>" if mode == "softmax" else "f32"
    zero = "vec4<f32>(0.0)" if mode == "softmax" else "0.0"
    kernel.partials = partials
    kernel.finish = _finish(f"{kernel.name}:combine", "reduction", "attention_splits.wgsl", ["partials"], [typ],
                            typ, [n, splits, bsz, t, h, d4, -(-t // 4)], grid_1d(-(-n // WG)),
                            MODE=_SPLIT_MODES[mode], OUT_TYPE=typ, ZERO=zero,
                            STAT="partials[at][t % 4u]" if mode == "softmax" else "0.0",
                            STORE_LSE=_STORE_LSE.format(at=lse_at) if lse_at else "")
    kernel.finish.guarded = True
    kernel.notes["variant"] += f", {streamed} split {splits} ways"
    return kernel


def _combine_forward_splits(kernel: Kernel, splits: int, bsz: int, t: int, h: int, d: int,
                            lse_at: int = 0) -> Kernel:
    """A forward kernel whose keys are split ``splits`` ways (1: not split) writes each
    part's unnormalised rows and their statistics (vec4s of 4 queries' maximum and sum,
    attention_tiled.wgsl's layout); attention_splits.wgsl combines them."""
    if splits > 1:
        rows = bsz * t * h
        stats = splits * bsz * h * -(-t // 4) * 8
        _split_combine(kernel, "softmax", splits, rows * d // 4, splits * rows * d + stats, (bsz, t, h, d // 4),
                       lse_at=lse_at)
    return kernel


ATTENTION_KEYS = 64   # keys per block of attention_tiled.wgsl (16 threads x 4)


def _p_row(j: int) -> int:
    """The row of Ps that holds streamed row (key) j of a block of 64: thread tx writes
    rows 4tx..4tx+3 at tx, 16 + tx, 32 + tx, 48 + tx, so a row's 16 threads hit 16 banks."""
    return 16 * (j % 4) + j // 4


def attention_workgroup_bytes(queries: int, head_dim: int) -> int:
    """Workgroup memory of attention_tiled.wgsl with blocks of ``queries`` queries: Qs, the
    K/V block (K's d-rows, the larger, padded by one), Ps and the row partials (vec4s; Ps
    and red rows padded by one)."""
    qv = queries // 4
    return 16 * (head_dim * qv + head_dim * (ATTENTION_KEYS // 4 + 1) + (ATTENTION_KEYS + 16) * (qv + 1))


def attention_queries(head_dim: int, caps: Capabilities) -> int:
    """Queries a workgroup of the tiled forward owns: 32 where the device's workgroup
    memory holds that block (37 KiB at D = 64: NVIDIA's 48 KiB does, lavapipe's 32 KiB
    from D = 56 on does not), else 16."""
    return 32 if attention_workgroup_bytes(32, head_dim) <= caps.workgroup_storage else 16


def attention_prefetch(knobs: Knobs = Knobs()) -> int:
    """How far ahead the attention kernels fetch their staged blocks:
    ``knobs.attention_prefetch`` (``MEGANEURA_ATTENTION_PREFETCH``) 0 (each block where it
    is stored), 1 (a block's second operand at the block's start) or 2, the default (the
    forward also fetches the next block's keys before P . V; the backward as 1)."""
    return knobs.attention_prefetch


def _per_element(template: str, threads: int, steps: int, indent: int = 8) -> str:
    """The attention kernels' unrolled staging: ``template`` once per element a thread
    stages, ``{e}`` the element (tid + n * threads) and ``{n}`` its step."""
    return "\n".join(" " * indent + template.format(n=n, e=f"tid + {n * threads}u") for n in range(steps))


def _forward_staging(threads: int, steps: int, knobs: Knobs) -> dict:
    """The staging lines of attention_tiled.wgsl's loop, element tid + n * threads each:
    with prefetch, V's registers vpre<n> are fetched before the scores and stored after
    them, and the next block's K (kpre<n>) before P . V, stored at the next block's
    start."""
    level = attention_prefetch(knobs)
    lines = lambda template, indent=8: _per_element(template, threads, steps, indent)  # noqa: E731

    stage_k = lines("put_k_element({e}, fetch_k({e}, b, hk, k0));")
    stage_v = lines("put_v_element({e}, fetch_v({e}, b, hk, k0));")
    staging = dict(FIRST_K="", STAGE_K=stage_k, FETCH_V="", STAGE_V=stage_v, FETCH_K="")
    if level >= 1:
        staging.update(FETCH_V=lines("let vpre{n} = fetch_v({e}, b, hk, k0);"),
                       STAGE_V=lines("put_v_element({e}, vpre{n});"))
    if level >= 2:
        staging.update(FIRST_K=lines("var kpre{n} = fetch_k({e}, b, hk, part * per_part * BKV);", 4),
                       STAGE_K=lines("put_k_element({e}, kpre{n});"),
                       FETCH_K=lines("kpre{n} = fetch_k({e}, b, hk, k0 + BKV);"))
    return staging


def _attention_tiled(graph, node, bsz, t, s, h, hkv, d, causal, scale, caps: Capabilities = PLAIN,
                     lse_at: int = 0) -> Kernel:
    bq = attention_queries(d, caps)
    blocks = -(-t // bq)
    splits = attention_splits(blocks * h * bsz, -(-s // ATTENTION_KEYS), caps.knobs, caps.tuning)
    grid = _split_grid(graph, node, blocks, h, bsz, splits)
    meta = [t, s, h, hkv, causal, f32_bits(scale * math.log2(math.e)), splits, bsz]
    vec4 = "vec4<f32>"
    threads = 4 * bq
    stage = -(-ATTENTION_KEYS * d // 4 // threads)
    kernel = _finish("attention", "attention", "attention_tiled.wgsl", ["q", "k", "v"], [vec4] * 3, vec4,
                     meta, grid, D=d, BQ=bq, THREADS=threads, THREAD_XY=_thread_xy("warp", caps.knobs),
                     ROWS=_render("attention_rows.wgsl", PARTIALS="red", STRIDE="PS"),
                     SPLIT="true" if splits > 1 else "false", LSE_AT=lse_at,
                     **_forward_staging(threads, stage, caps.knobs),
                     SCORES="\n".join(f"        s = outer_step(s, Qs[{i}u * QV + ty], KVs[{i}u * KR + tx]);"
                                       for i in range(d)),
                     ACCUMULATE="\n".join(f"            o = outer_step(o, KVs[{j}u * D4 + tx], "
                                           f"Ps[{_p_row(j)}u * PS + ty]);" for j in range(ATTENTION_KEYS)))
    kernel.notes["variant"] = (f"tiled (flash) {bq} queries x {ATTENTION_KEYS} keys, "
                               f"4x4 scores and 4x4 outputs/thread" + (", its rows' log-sum-exp kept" if lse_at else ""))
    kernel.guarded = True
    return _combine_forward_splits(kernel, splits, bsz, t, h, d, lse_at)


@dataclass(frozen=True)
class _BackwardMode:
    """One kernel of attention_backward.wgsl: its MODE (the template's MODE_LSE, MODE_DQ,
    MODE_DKDV), the node's operand names and the operands playing the roles A, B (fixed
    side: scores, dP) and X, Y (streamed side)."""

    index: int
    operands: tuple[str, ...]
    roles: tuple[str, str, str, str]

    @property
    def fixed_queries(self) -> bool:
        """lse and dq own blocks of queries; dkdv blocks of keys."""
        return self.index <= 1

    @property
    def has_dp(self) -> bool:
        """dq and dkdv need dP = dO vᵀ (and so the B operand and Delta)."""
        return self.index > 0

    @property
    def pair(self) -> bool:
        """dkdv writes two results, dk and dv, packed (attention_grad_kv_layout)."""
        return self.index == 2

    @property
    def accumulates(self) -> bool:
        """All but lse sum a block's P or dS times a streamed operand into their output."""
        return self.index > 0


_GRAD_OPERANDS = ("q", "k", "v", "dout", "lse", "delta")
ATTENTION_BACKWARD = {
    "attention_lse": _BackwardMode(0, ("q", "k"), ("q", "q", "k", "k")),
    "attention_grad_q": _BackwardMode(1, _GRAD_OPERANDS, ("q", "dout", "k", "v")),
    "attention_grad_kv": _BackwardMode(2, _GRAD_OPERANDS, ("k", "v", "q", "dout")),
}
ATTENTION_STREAMED = 64   # streamed rows per block of attention_backward.wgsl (16 threads x 4)


def attention_backward_bytes(rows: int, head_dim: int, has_dp: bool, accumulates: bool = True) -> int:
    """Workgroup memory of an attention_backward.wgsl kernel owning ``rows`` fixed rows:
    As (and Bs where it computes dP), Ss (d-rows rounded up to 16, padded by a vec4) and
    Ps (padded rows: a block's, or lse's 16 partials), in vec4s."""
    rv = rows // 4
    ps_rows = ATTENTION_STREAMED if accumulates else 16
    return 16 * (head_dim * rv + (head_dim * rv if has_dp else 1)
                 + 16 * -(-head_dim // 16) * (ATTENTION_STREAMED // 4 + 1) + ps_rows * (rv + 1))


def attention_backward_rows(head_dim: int, mode: "_BackwardMode", caps: Capabilities) -> int:
    """Fixed rows a workgroup of an attention backward kernel owns: the most (64, 32 or
    16) the device's workgroup memory holds. Each block of streamed rows staged serves
    that many fixed rows, and the kernels are bound by that staging (on the H100, 16 rows
    took twice as long as 32); only lse, which keeps no block of P, fits 64 at D = 64 in
    NVIDIA's 48 KiB. ``caps.knobs.attention_backward_rows`` (``MEGANEURA_ATTENTION_BACKWARD_ROWS``)
    forces it (benchmarks)."""
    if caps.knobs.attention_backward_rows:
        return caps.knobs.attention_backward_rows
    fits = [r for r in (64, 32) if attention_backward_bytes(r, head_dim, mode.has_dp, mode.accumulates)
            <= caps.workgroup_storage]
    return fits[0] if fits else 16


def _score_lines(fixed: str, acc: str, d: int, indent: int) -> str:
    """acc (4 fixed rows x streamed rows 4tx..4tx+3) += fixed . Ss over d, unrolled."""
    return "\n".join(f"{' ' * indent}{acc} = score_step({acc}, {fixed}[{i}u * RV + ty], Ss[{i}u * CV + tx]);"
                     for i in range(d))


def _accumulate_lines(groups: int, acc: str = "o", indent: int = 12) -> str:
    """acc += Ps . Ss over the block's streamed rows, 4 at a time, unrolled: column r of acc
    is output column tx + 16 r (r < groups), read from d-row tx + 16 r of Ss as a vec4 over 4
    streamed rows."""
    lines = []
    for jj in range(ATTENTION_STREAMED // 4):
        loads = " ".join(f"let x{r} = Ss[xc + {16 * r}u * CV + {jj}u];" for r in range(groups))
        lines.append(f"{' ' * indent}{{ {loads}")
        for c in "xyzw":
            j = 4 * jj + "xyzw".index(c)
            x = ", ".join(f"x{r}.{c}" if r < groups else "0.0" for r in range(4))
            lines.append(f"{' ' * (indent + 2)}{acc} = accumulate_step({acc}, Ps[{_p_row(j)}u * PR + ty], "
                         f"vec4<f32>({x}));")
        lines[-1] += " }"
    return "\n".join(lines)


def _staging(mode: _BackwardMode, threads: int, steps: int, knobs: Knobs) -> dict:
    """The staging lines of attention_backward.wgsl's loop. A block's X is fetched into
    registers pre0.. at its start and put into Ss after dP; Y (dq: V, dkdv: dO) is fetched
    there too, into ypre0.., before X, and dkdv puts it into Ss twice, for dP and for P Y:
    on the H100 at whisper-tiny's batch 8, dkdv took 3.40 ms a layer so, 3.85 fetching Y from
    memory again for P Y and 4.10 fetching it into registers again before dS X; dq took 3.07
    ms with Y fetched ahead, 3.13 staging it from memory. lse, with one operand, stages X directly;
    ``MEGANEURA_ATTENTION_PREFETCH=0`` stages all directly (benchmarks; see attention_prefetch)."""
    direct = {role: f"stage_stream({role}, tid, b, stream_head, c0);" for role in ("ROLE_X", "ROLE_Y")}
    if mode.index == 0 or attention_prefetch(knobs) == 0:
        return dict(PREFETCH="", STAGE_Y=" " * 12 + direct["ROLE_Y"], STAGE_X=" " * 8 + direct["ROLE_X"],
                    RESTAGE_Y=" " * 16 + direct["ROLE_Y"] if mode.pair else "")
    fetch = lambda role, name: _per_element(  # noqa: E731
        f"let {name}{{n}} = fetch_element({role}, {{e}}, b, stream_head, c0);", threads, steps)
    put = lambda name, indent: _per_element(f"put_element({{e}}, {name}{{n}});", threads, steps, indent)  # noqa: E731
    return dict(PREFETCH=(fetch("ROLE_Y", "ypre") + "\n" if mode.has_dp else "") + fetch("ROLE_X", "pre"),
                STAGE_Y=put("ypre", 12) if mode.has_dp else " " * 12 + direct["ROLE_Y"], STAGE_X=put("pre", 8),
                RESTAGE_Y=put("ypre", 16) if mode.pair else "")


def _attention_backward(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    mode = ATTENTION_BACKWARD[node.op]
    q, k = graph[node.inputs[0]], graph[node.inputs[1]]
    bsz, t, s, h, hkv, d, causal, scale = _attention_dims(node, q, k)
    if not tiled_attention_head_dim(d):
        raise UnsupportedOpError(f"{graph.format_node(node)}: no {node.op} kernel for head dim {d} (it takes "
                                 f"multiples of 4 up to 64); differentiate attention with such heads "
                                 f"by decomposition")
    rows = attention_backward_rows(d, mode, caps)
    threads = 4 * rows
    fixed, streamed = (t, s) if mode.fixed_queries else (s, t * (h // hkv))
    blocks, heads = -(-fixed // rows), h if mode.fixed_queries else hkv
    splits = attention_splits(blocks * heads * bsz, -(-streamed // ATTENTION_STREAMED), caps.knobs, caps.tuning)
    grid = _split_grid(graph, node, blocks, heads, bsz, splits)
    dv_at = attention_grad_kv_layout(k.shape)[0][1] if mode.pair else 0
    meta = [t, s, h, hkv, causal, f32_bits(scale * math.log2(math.e)), f32_bits(scale), splits, node.size, dv_at]
    groups = -(-d // 16)
    stage_steps = -(-ATTENTION_STREAMED * d // 4 // threads)
    types = ["f32" if n in ("lse", "delta") else "vec4<f32>" for n in mode.operands]
    a, b, x, y = mode.roles
    kernel = _finish(node.op, "attention", "attention_backward.wgsl", list(mode.operands), types, "f32", meta,
                     grid, D=d, R=rows, THREADS=threads, MODE=mode.index, THREAD_XY=_thread_xy("warp", caps.knobs),
                     ROWS=_render("attention_rows.wgsl", PARTIALS="Ps", STRIDE="PR"), A=a, B=b, X=x, Y=y,
                     LSE_AT="lse[i] * LOG2E" if "lse" in mode.operands else "0.0",
                     DELTA_AT="delta[i]" if "delta" in mode.operands else "0.0",
                     BS_LEN="D * RV" if mode.has_dp else "1u", SS_ROWS=16 * groups,
                     PS_ROWS="C" if mode.accumulates else "16u",
                     STAGE=_per_element("stage_element(role, {e}, b, head, c0);", threads, stage_steps, 4),
                     **_staging(mode, threads, stage_steps, caps.knobs),
                     SCORES=_score_lines("As", "s", d, 8),
                     DP=_score_lines("Bs", "dp", d, 12) if mode.has_dp else "",
                     ACCUMULATE=_accumulate_lines(groups) if mode.accumulates else "",
                     ACCUMULATE_V=_accumulate_lines(groups, "ov", 16) if mode.pair else "")
    fixed, streamed = ("queries", "keys") if mode.fixed_queries else ("keys", "queries")
    kernel.notes["variant"] = (f"tiled backward: {rows} {fixed} a workgroup, {streamed} streamed "
                               f"{ATTENTION_STREAMED} at a time, 4x4 scores and 4x{groups} outputs/thread")
    kernel.guarded = True
    if splits > 1:
        _split_combine(kernel, "logsumexp" if mode.index == 0 else "sum", splits, node.size, splits * node.size,
                       streamed=streamed)
    return kernel
