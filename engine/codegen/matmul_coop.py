"""The cooperative-matrix (f16 subgroup matrices, f32 accumulation) variants of the tiled
matmul: the presets and what each was measured to do, and their parts of
matmul_tiled.wgsl (operand tiles rounded to f16, the products on 16 x 16 fragments,
gradient operands scaled into f16's range, results leaving through a scratch).
engine/codegen/matmul.py chooses among them and the f32 tiles.
"""

from __future__ import annotations

from typing import NamedTuple

from .tile_operands import _TILE_OPERANDS, _fetch_operand


class CoopPreset(NamedTuple):
    """A cooperative-matrix kernel: a ``bm`` x ``bn`` output tile, K steps of ``bk``, and
    ``wm`` x ``wn`` subgroups of 32 threads, each owning a (bm / wm) x (bn / wn) block of
    16 x 16 f32 accumulator fragments. The results leave through a 16 x 16 f32 scratch a
    subgroup, for at most ``scratch`` subgroups at a time. ``buffers``: workgroup
    buffers of each operand tile; with 2 the next step's operands are stored while this
    step's are multiplied, with 1 the memory halves for a second barrier a step.
    ``split``: each f32 operand is kept as two f16 tiles, hi (x rounded to f16's 10
    mantissa bits on its bits: on the H100, lo = x - f32(f16(x)) came out 0, f16's error)
    and lo = x - hi, and multiplied three times (hi hi + hi lo + lo hi: about 21 of f32's
    24 bits, lo lo's 2^-22 left out), so that f32 products run on the f16 units, as torch's
    "fp32" attention runs three TF32 products; twice the workgroup memory. Both operands
    are scaled by a power of two a workgroup (``_coop_scales``), so that hi stays inside
    f16's range and lo above its subnormals."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    buffers: int = 2
    scratch: int = 8
    split: bool = False

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
# fetches are checked) 20% slower; two buffers do not fit 48 KiB. Run 40: the driver gives
# a pipeline about 48 KiB an SM (24 KiB: two workgroups, 28 or more: one); tiles fitted to
# 24 KiB by a scratch for 2 or 4 subgroups at a time ran 15-160% slower (its turns).
COOP = {"c128": CoopPreset(128, 128, 32, 4, 4), "c128l": CoopPreset(128, 128, 16, 4, 2, buffers=1),
        "c64": CoopPreset(64, 64, 32, 2, 2), "c64l": CoopPreset(64, 64, 32, 2, 2, buffers=1),
        "c96": CoopPreset(128, 96, 48, 4, 3, buffers=1, scratch=12),
        "c128x3": CoopPreset(128, 128, 16, 4, 2, buffers=1, split=True),
        "c64x3": CoopPreset(64, 64, 32, 2, 2, buffers=1, split=True)}
COOP_FRAGMENT = 16   # the subgroup-matrix shape used: f16 16 x 16 x 16 -> f32
COOP_ENABLES = ("f16", "chromium_experimental_subgroup_matrix")


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


def _coop_layout(fetch: str) -> str:
    """How the cooperative kernel lays an operand's f16 tile out: along the axis it is
    fetched along, so that a thread's 4 fetched elements land side by side ("k-major":
    element (o, k) at k * slots + o; "outer-major": at o * slots + k)."""
    return "k-major" if fetch.startswith("outer") else "outer-major"


def _absmax(fetch: str, regs) -> list[str]:
    """The largest |value| of each fetched register (a vec4's or a scalar's)."""
    return [f"max(max(abs({r}).x, abs({r}).y), max(abs({r}).z, abs({r}).w))" if fetch.endswith("vec4")
            else f"abs({r})" for r, _, _ in regs]


def hi_part(x: str, vec4: bool) -> str:
    """WGSL of f32 ``x`` (a vec4 where ``vec4``) rounded to f16's 10 mantissa bits on its
    bits, as an f32: a split operand's hi part, exact in f16 where x is in its range, and
    x minus it (the lo part) exact in f32 (``CoopPreset.split``)."""
    if vec4:
        return f"bitcast<vec4<f32>>((bitcast<vec4<u32>>({x}) + vec4<u32>(0x1000u)) & vec4<u32>(0xffffe000u))"
    return f"bitcast<f32>((bitcast<u32>({x}) + 0x1000u) & 0xffffe000u)"


def _store_coop(name: str, fetch: str, regs, scale: str = "", split: bool = False) -> list[str]:
    """Stores of the fetched registers, times ``scale`` (a WGSL expression) if given and
    rounded to f16, into buffer ``buf`` of the cooperative kernel's f16 tile
    (``_coop_layout``); a scaled operand's registers also raise ``amax_{name}``. ``split``:
    what rounding left out goes to the lo tile (``CoopPreset.split``)."""
    times = f" * {scale}" if scale else ""
    p = _TILE_OPERANDS[name]
    slots, one = p["slots"], "ABUF" if name == "a" else "BBUF"
    if _coop_layout(fetch) == "k-major":
        at = lambda part, k, o: f"{p['smem'][0]}{part}[buf * {one} + ({k}) * {slots} + {o}]"
    else:
        at = lambda part, k, o: f"{p['smem'][0]}{part}[buf * {one} + ({o}) * {slots} + {k}]"
    parts = "hl" if split else "h"
    out = []
    for r, o, k in regs:
        if fetch.endswith("vec4"):
            place = (lambda j: (k, f"{o} + {j}u")) if fetch.startswith("outer") else (lambda j: (f"{k} + {j}u", o))
            hi = f" let t = {hi_part('x', True)}; let h = vec4<f16>(t); let l = vec4<f16>(x - t);" if split \
                else " let h = vec4<f16>(x);"
            out.append(f"        {{ let x = {r}{times};{hi} " +
                       " ".join(f"{at(v, *place(j))} = {v}.{c};" for v in parts for j, c in enumerate("xyzw"))
                       + " }")
        else:
            hi = (f" let t = {hi_part('x', False)}; let h = f16(t); let l = f16(x - t);" if split
                  else " let h = f16(x);")
            out.append(f"        {{ let x = {r}{times};{hi} " +
                       " ".join(f"{at(v, k, o)} = {v};" for v in parts) + " }")
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


def _coop_fragment(name: str, fetch: str, outer: str, kk: int, part: str = "h") -> str:
    """subgroupMatrixLoad of one 16 x 16 f16 fragment: A's (left, rows m) or B's
    (right, columns n) at outer offset ``outer`` and k step ``kk`` of the current buffer,
    from its hi tile (``part`` "h") or a split operand's lo tile ("l")."""
    f = COOP_FRAGMENT
    kind, tile, base, slots = (("left", "A", "ab", "AS") if name == "a" else ("right", "B", "bb", "BS"))
    tile += part
    if _coop_layout(fetch) == "k-major":
        offset, along_k = f"{base} + {kk * f}u * {slots} + {outer}", name == "a"
    else:
        offset, along_k = f"{base} + ({outer}) * {slots} + {kk * f}u", name == "b"
    return (f"subgroupMatrixLoad<subgroup_matrix_{kind}<f16, {f}, {f}>>(&{tile}, {offset}, "
            f"{'true' if along_k else 'false'}, {slots})")


def _coop_subs(preset: str, fetch_a: str, fetch_b: str, gather_a=None, gather_b=None, lets=(),
               edges=(None, None), scaled=(False, False), stored_b: str = "f32") -> dict:
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
        for part in "hl" if c.split else "h":
            comp += [f"        let l{part}{kk}_{i} = {_coop_fragment('a', fetch_a, f'wrow + {i * f}u', kk, part)};"
                     for i in range(fm)]
            comp += [f"        let r{part}{kk}_{j} = {_coop_fragment('b', fetch_b, f'wcol + {j * f}u', kk, part)};"
                     for j in range(fn)]
        # a split operand's small terms first (hi lo, lo hi), then hi hi
        terms = ("hl", "lh", "hh") if c.split else ("hh",)
        comp += [f"        acc{i}_{j} = subgroupMatrixMultiplyAccumulate(l{x}{kk}_{i}, r{y}{kk}_{j}, acc{i}_{j});"
                 for x, y in terms for i, j in frags]
    edges = [mode or "tiles" for mode in edges]
    ca, da, la, ra = _fetch_operand("a", fetch_a, c.bm, c.bk, gather_a, c.threads, edges[0])
    cb, db, lb, rb = _fetch_operand("b", fetch_b, c.bn, c.bk, gather_b, c.threads, edges[1], stored_b)
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
    smem = "".join(f"var<workgroup> A{part}: array<f16, {c.buffers * a_buf}>;\n"
                   f"var<workgroup> B{part}: array<f16, {c.buffers * b_buf}>;\n" for part in ("hl" if c.split else "h"))
    smem += f"var<workgroup> Cs: array<f32, {scratch * f * f}>;"
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
                STORE="\n".join(_store_coop("a", fetch_a, ra, "scale_a" if scaled[0] else "", c.split)
                                + _store_coop("b", fetch_b, rb, "scale_b" if scaled[1] else "", c.split)))


def _coop_tile(fetch: str, tile: int, bk: int) -> tuple[int, int]:
    """(f16 slots a row, f16 elements a buffer) of one operand's tile."""
    slots = (tile if _coop_layout(fetch) == "k-major" else bk) + 8
    return slots, slots * (bk if _coop_layout(fetch) == "k-major" else tile)


def coop_scratch_floats(preset: str) -> int:
    """Floats of a cooperative kernel's results scratch (``Cs``): a fragment for each of
    the subgroups that use it at once."""
    c = COOP[preset]
    return min(c.threads // 32, c.scratch) * COOP_FRAGMENT ** 2


def coop_workgroup_bytes(preset: str) -> int:
    """Workgroup memory of a cooperative kernel at most (the larger tile layout): the f16
    buffers of each operand tile and the subgroups' f32 scratch."""
    c = COOP[preset]
    buf = lambda tile: max(_coop_tile(fetch, tile, c.bk)[1] for fetch in ("outer-vec4", "k-vec4"))
    return 2 * c.buffers * (buf(c.bm) + buf(c.bn)) * (2 if c.split else 1) + 4 * coop_scratch_floats(preset)
