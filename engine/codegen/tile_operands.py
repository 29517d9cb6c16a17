"""How a tiled kernel's two operand tiles are fetched from memory into registers (vec4 or
scalar loads along the contiguous axis, checked, clamped or unchecked at the edges,
gathered for a convolution's im2col) and stored into the f32 kernel's tiles: shared by
the f32 and cooperative matmuls (engine/codegen/matmul.py, matmul_coop.py) and the
convolutions.
"""

from __future__ import annotations

from .common import stored_load, stored_load4


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
                   edges: str = "checked", stored: str = "f32"):
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
    "none": an edge path costs registers even where it never runs (run 18). ``stored``: the
    operand's dtype; a bf16 weight is read in words and widened as it is fetched, exactly."""
    p = _TILE_OPERANDS[name]
    if gather is not None and stored != "f32":
        raise ValueError(f"a gathered operand is read as f32, not {stored}")
    vec = fetch.endswith("vec4")
    along_outer = fetch.startswith("outer")
    count = tile * bk // threads // (4 if vec else 1)
    width = (tile if along_outer else bk) // (4 if vec else 1)  # threads along the fast axis
    consts, decl, edge, regs = [], [], [], []
    zero = "vec4<f32>(0.0)" if vec else "0.0"
    read = (lambda at: stored_load4(p["src"], at, stored)) if vec else (lambda at: stored_load(p["src"], at, stored))
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
                        f"{{ {r} = {read('(' + addr + ') >> 2u' if vec else addr)}; }}")
        regs.append((r, f"{name}o{i}", f"{name}k{i}"))
    if gather is not None or threads % width or edges == "checked":
        return consts, decl, edge, regs
    first, addresses = _strided_loads(name, fetch, threads // width, count, edges == "clamp")
    consts += first
    loads = [f"{r} = {read(a)};" for (r, _, _), a in zip(regs, addresses)]
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
