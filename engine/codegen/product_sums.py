"""A weight gradient's product that also adds up one of its operands: a linear layer's
bias gradient is its output gradient summed over the rows, and the weight gradient's
product (dᵀ x, or xᵀ d) fetches every element of that gradient tile by tile anyway. So
each thread of matmul_tiled.wgsl adds up the registers it fetches of that operand, and
the workgroups of one tile column (A's rows) or tile row (B's columns) add their
threads' sums into the operand's sums over their K range. On the H100 (run 41) the 20
bias sums (``sum_to``) of whisper-tiny's f16 step at batch 8 took 0.52 ms of its 14.6
(the step with them launched empty); with the sums in the products the step went from
14.67-14.72 to 14.21-14.47 ms, each product 6-7 us slower (5%; 15% where the adds came
right after the loads, waiting for them: they come where the registers are stored).

The summed operand must be fetched as vec4s along its outer axis with every thread's
registers on one outer position (``operand_fetch``'s "outer-vec4", threads a multiple of
the tile's vec4 columns): a row-major gradient [rows, N] is, as A of dᵀ x or B of xᵀ d.
The sums are exact f32 additions of the values fetched, before any rounding to f16.
"""

from __future__ import annotations

SUM_OPERANDS = ("a", "b")   # "a": the sums of A's rows (m), "b": of B's columns (n)


def sums_fit(operand: str, fetch: str, tile: int, threads: int, extent: int) -> bool:
    """Whether a tiled kernel whose ``operand`` is fetched as ``fetch`` in tiles of
    ``tile`` along an outer axis of ``extent`` can add that operand up (module doc)."""
    return (operand in SUM_OPERANDS and fetch == "outer-vec4" and threads % (tile // 4) == 0
            and extent % 4 == 0)


def sums_subs(operand: str, registers: list[str], tile: int, threads: int, scratch: str, split: bool,
              out_vec4: bool) -> dict[str, str]:
    """matmul_tiled.wgsl's SUMS_* parts and the ``sums`` accumulator's declaration
    (``SUMS_DECL``). ``registers``: the operand's fetch registers (one outer position
    a thread); ``scratch``: "vec4" to reduce through the f32 kernel's operand tile (As or
    Bs, vec4s), "f32" through the cooperative kernel's result scratch (Cs); ``split``:
    the sums go after all the K slices' results in the partials (``out``, bound as vec4s
    where ``out_vec4``), else to ``sums_out``."""
    width = tile // 4                      # threads along the outer axis; thread t holds 4 of them
    rows = threads // width                # threads on each outer position
    mine = "wg.x == 0u" if operand == "a" else "wg.y == 0u"
    origin, extent = ("row0", "M") if operand == "a" else ("col0", "N")
    tile_name = "As" if operand == "a" else "Bs"
    if scratch == "vec4":
        put, add = f"{tile_name}[tid] = sums;", f"v = v + {tile_name}[r * {width}u + tid];"
    else:
        put = "let o = tid * 4u; Cs[o] = sums.x; Cs[o + 1u] = sums.y; Cs[o + 2u] = sums.z; Cs[o + 3u] = sums.w;"
        add = f"let o = (r * {width}u + tid) * 4u; v = v + vec4<f32>(Cs[o], Cs[o + 1u], Cs[o + 2u], Cs[o + 3u]);"
    if split:   # after the nwg.z slices' M x N results, slice `part`'s sums
        at = f"nwg.z * M * N + part * {extent} + at"
        write = f"out[({at}) / 4u] = v;" if out_vec4 else \
            " ".join(f"out[{at} + {j}u] = v.{c};" for j, c in enumerate("xyzw"))
    else:
        write = " ".join(f"sums_out[at + {j}u] = v.{c};" for j, c in enumerate("xyzw"))
    out = [
        "    workgroupBarrier();",
        f"    if ({mine}) {{ {put} }}",
        "    workgroupBarrier();",
        f"    if ({mine} && tid < {width}u) {{",
        "        var v = vec4<f32>(0.0);",
        f"        for (var r = 0u; r < {rows}u; r = r + 1u) {{ {add} }}",
        f"        let at = {origin} + tid * 4u;",
        f"        if (at < {extent}) {{ {write} }}",
        "    }",
        "    workgroupBarrier();",
    ]
    return dict(SUMS_DECL="    var sums = vec4<f32>(0.0);", SUMS_RESET="    sums = vec4<f32>(0.0);",
                SUMS_ADD=f"        sums = sums + {' + '.join(registers)};", SUMS_OUT="\n".join(out))


NO_SUMS = dict(SUMS_RESET="", SUMS_ADD="", SUMS_OUT="")


def sums_binding(binding: int) -> str:
    """The declaration of the sums' own output binding."""
    return f"@group(0) @binding({binding}) var<storage, read_write> sums_out: array<f32>;"


def sums_finish(operand: str) -> str:
    """matmul_splits.wgsl's SUMS_FINISH: threads past the results add the slices' sums."""
    extent = "M" if operand == "a" else "N"
    return "\n".join([
        "    if (i >= total) {",
        "        let j = i - total;",
        f"        if (j >= {extent}) {{ return; }}",
        "        var v = partials[splits * total + j];",
        f"        for (var p = 1u; p < splits; p = p + 1u) {{ v = v + partials[splits * total + p * {extent} + j]; }}",
        "        sums_out[j] = v;",
        "        return;",
        "    }"])
