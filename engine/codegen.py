"""WGSL for one dispatch: kernel archetypes as templates in ``shaders/``.

There is no shader per op. Each archetype (pointwise DAG, tiled matmul with epilogue,
row reduction, scalar loss, sum_to, copy, gather) is one template; ``kernel_for`` fills
it in for a node and returns a ``Kernel``: the WGSL source, the binding layout, the
per-dispatch parameter words ("meta": shapes, strides, eps... as u32, floats as their
bits) and the workgroup counts. Shapes live in meta, not in the source, so nodes of
the same kind share one compiled pipeline (the runtime caches pipelines by source).

Binding layout of every kernel: 0 = meta (uniform), 1..k = the node's operands in
order (read-only storage), k+1 = the output (read-write storage).
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .errors import DeviceError
from .graph import Graph, Node
from .ops import OPS, tiled_attention_head_dim
from .paths import shader_dir

# Environment variables that force a kernel variant or plan layout (benchmarks and tests;
# compile's plan cache keys on them).
KNOBS = ("MEGANEURA_MATMUL", "MEGANEURA_MATMUL_SPLITS", "MEGANEURA_ATTENTION", "MEGANEURA_ATTENTION_SPLITS",
         "MEGANEURA_ATTENTION_BACKWARD_ROWS", "MEGANEURA_ATTENTION_PREFETCH", "MEGANEURA_POOL", "MEGANEURA_THREAD_LAYOUT")

MAX_WORKGROUPS = 65535
WG = 256          # threads per workgroup of the 1-D archetypes
TILE = 16         # matmul tile


class UnsupportedOpError(DeviceError):
    """The graph uses an op that has no GPU kernel yet."""


@dataclass(frozen=True)
class Capabilities:
    """What generated kernels may use beyond core WGSL, and which compiler reads them.

    Kernels take a faster path where the device offers a feature (subgroup reductions,
    cooperative matrices) and the plain path otherwise; the choice is made here, from
    plain data, so a plan can be compiled without a GPU and says which path each
    dispatch took. ``dialect`` is the WGSL compiler's: naga (wgpu-native) takes subgroup
    built-ins without an ``enable`` and rejects ``enable subgroups;``, Tint (Dawn)
    requires it. ``matmul_f16``: matmuls and convolutions multiply f16 copies of their
    operands on the cooperative-matrix units, accumulating in f32 (Dawn's subgroup
    matrices; wgpu-native cannot enable them); asked for with ``MEGANEURA_PRECISION=f16``
    where the device offers them (``engine.runtime.device_capabilities``).
    """

    subgroups: bool = False
    workgroup_storage: int = 32768   # bytes of workgroup memory a kernel may use (lavapipe: 32 KiB)
    dialect: str = field(default_factory=lambda: default_dialect())   # "naga" or "tint"
    matmul_f16: bool = False

    @classmethod
    def from_features(cls, features, workgroup_storage: int | None = None, dialect: str | None = None,
                      precision: str = "f32", fragments: bool = True) -> "Capabilities":
        """The capabilities a device with these wgpu feature names (and this much
        workgroup memory, default 32 KiB) gives, for kernels compiled by ``dialect``'s
        compiler; ``precision`` "f16" takes the cooperative-matrix matmul where offered
        and ``fragments``: the device has the fragments the kernels are written for
        (f16 x f16 -> f32, 16 x 16 x 16, on subgroups of 32: ``COOP_FRAGMENT``)."""
        names = {str(f) for f in features}
        dialect = dialect or default_dialect()
        coop = (SUBGROUP_MATRIX_FEATURE in names and "shader-f16" in names and dialect == "tint"
                and fragments)
        return cls(subgroups=bool(names & {"subgroup", "subgroups"}),
                   workgroup_storage=int(workgroup_storage or cls.workgroup_storage),
                   dialect=dialect, matmul_f16=coop and precision == "f16")

    def describe(self) -> dict:
        """Which path each archetype takes (``meganeura doctor`` and the plan show it)."""
        q = attention_queries(64, self)
        return {"reductions": "subgroup" if self.subgroups else "workgroup memory",
                "matmul": ("cooperative matrices: f16 operands (gradients scaled into f16's range), f32 "
                           "accumulation, for products of at least 16 x 16 x 16; the rest register-blocked f32"
                           if self.matmul_f16 else
                           "register-blocked f32 (vec4 loads where the layout allows)"),
                "attention": f"flash, {q} queries x {ATTENTION_KEYS} keys a workgroup at head dim 64 "
                             f"({self.workgroup_storage // 1024} KiB of workgroup memory)"}


SUBGROUP_MATRIX_FEATURE = "chromium-experimental-subgroup-matrix"
PRECISIONS = ("f32", "f16")


def default_dialect() -> str:
    """The WGSL dialect of the process's wgpu backend (``MEGANEURA_WGPU``): Tint's for
    Dawn, naga's otherwise; what capabilities written without one compile for."""
    return "tint" if os.environ.get("MEGANEURA_WGPU") == "dawn" else "naga"


def precision() -> str:
    """The matmul precision asked for: ``MEGANEURA_PRECISION`` ("f32", the default, or
    "f16": f16 operands on the cooperative-matrix units where the device has them)."""
    value = os.environ.get("MEGANEURA_PRECISION") or "f32"
    if value not in PRECISIONS:
        raise DeviceError(f"MEGANEURA_PRECISION={value!r} is not one of {', '.join(PRECISIONS)}")
    return value


PLAIN = Capabilities()


@dataclass
class Kernel:
    name: str
    archetype: str
    source: str
    meta: list[int]
    workgroups: tuple[int, int, int]
    meta_vec4: int = 1
    notes: dict = field(default_factory=dict)
    guarded: bool = False  # every memory access is bounds-checked by the kernel itself
    # A node in two dispatches (a reduction, a split attention or matmul): this kernel
    # writes ``partials`` floats into a scratch buffer (its last binding) and ``finish``
    # (bindings: the scratch, ``finish_operands``, the output) combines them, so the first
    # stage can spread over many workgroups.
    partials: int = 0
    finish: "Kernel | None" = None
    finish_operands: tuple[int, ...] = ()   # the node's inputs the finish also binds, after the scratch


# ---------------------------------------------------------------- helpers

@functools.lru_cache(maxsize=None)
def _template(name: str) -> str:
    return (shader_dir() / name).read_text()


def _render(name: str, **subs) -> str:
    text = _template(name)
    for k, v in subs.items():
        text = text.replace("{{" + k + "}}", str(v))
    return text


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(v)))[0]


def i32_bits(v: int) -> int:
    return int(v) & 0xFFFFFFFF


def contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def broadcast_strides(shape, out_shape) -> list[int]:
    """Strides that read an operand of ``shape`` at each index of ``out_shape``."""
    r = len(out_shape)
    padded = (1,) * (r - len(shape)) + tuple(shape)
    strides = contiguous_strides(padded)
    return [0 if padded[d] == 1 and out_shape[d] != 1 else strides[d] for d in range(r)]


def grid_1d(groups: int) -> tuple[int, int, int]:
    """A 1-D count of workgroups folded into x and y (each at most 65535)."""
    groups = max(1, groups)
    if groups <= MAX_WORKGROUPS:
        return (groups, 1, 1)
    y = -(-groups // MAX_WORKGROUPS)
    if y > MAX_WORKGROUPS:
        raise DeviceError(f"{groups} workgroups do not fit a 65535 x 65535 grid")
    return (-(-groups // y), y, 1)


def _wgsl_type(dtype: str) -> str:
    return "i32" if dtype == "i32" else "f32"


def _bindings(names: list[str], types: list[str], out_type: str) -> str:
    lines = [f"@group(0) @binding({i + 1}) var<storage, read> {n}: array<{t}>;"
             for i, (n, t) in enumerate(zip(names, types))]
    lines.append(f"@group(0) @binding({len(names) + 1}) var<storage, read_write> out: array<{out_type}>;")
    return "\n".join(lines)


# Entry-point arguments and first lines that the subgroup reductions need; templates
# that include {{WG_REDUCE}} put {{SG_ARGS}} after main's last argument and {{SG_INIT}}
# first in its body.
_SG_ARGS = (",\n        @builtin(subgroup_invocation_id) sg_lane: u32, @builtin(subgroup_id) sg_id: u32,"
            "\n        @builtin(num_subgroups) sg_count: u32, @builtin(subgroup_size) sg_size: u32")
_SG_INIT = "    sg_lane_ = sg_lane; sg_id_ = sg_id; sg_count_ = sg_count; sg_size_ = sg_size;"


THREAD_LAYOUTS = {
    "rows": "    let tx = tid % 16u;\n    let ty = tid / 16u;",
    "warp": "    let tx = tid / 32u % 2u * 8u + tid % 8u;\n    let ty = tid / 64u * 4u + tid % 32u / 8u;",
}


def _thread_xy(default: str) -> str:
    """How a register-blocked kernel numbers its 16 x n thread grid (tx, ty): "rows" puts
    a warp's 32 threads on 16 x 2 of it, "warp" on 8 x 4, so that a warp's vec4 reads of
    its two workgroup-memory tiles touch 8 + 4 distinct vec4s instead of 16 + 2. The
    attention kernels take "warp" (5-11% faster on the H100, run 17); the matmul keeps
    "rows" (no difference beyond noise there). ``MEGANEURA_THREAD_LAYOUT`` forces one for
    every kernel (benchmarks)."""
    layout = os.environ.get("MEGANEURA_THREAD_LAYOUT") or default
    if layout not in THREAD_LAYOUTS:
        raise DeviceError(f"MEGANEURA_THREAD_LAYOUT={layout!r} is not one of {', '.join(THREAD_LAYOUTS)}")
    return THREAD_LAYOUTS[layout]


def _finish(name, archetype, template, operand_names, operand_types, out_type, meta, workgroups,
            caps: Capabilities = PLAIN, enables=(), **subs):
    meta = list(meta) or [0]
    n4 = 1
    while n4 * 4 < len(meta):
        n4 *= 2
    prelude = _render("common.wgsl", META_N=n4)
    text = _template(template)
    reduce, sg = "wg_reduce.wgsl", {"SG_ARGS": "", "SG_INIT": ""}
    enables = list(enables)
    if caps.subgroups and "{{WG_REDUCE}}" in text:
        reduce, sg = "wg_reduce_subgroup.wgsl", {"SG_ARGS": _SG_ARGS, "SG_INIT": _SG_INIT}
        if caps.dialect == "tint":
            enables.append("subgroups")
    if "{{THREAD_XY}}" in text:
        subs.setdefault("THREAD_XY", _thread_xy("warp" if archetype == "attention" else "rows"))
    source = _render(template, PRELUDE=prelude, WG_REDUCE=_template(reduce),
                     BINDINGS=_bindings(operand_names, operand_types, out_type), **sg, **subs)
    if enables:
        source = "".join(f"enable {e};\n" for e in dict.fromkeys(enables)) + source
    return Kernel(name, archetype, source, meta, workgroups, n4)


# ---------------------------------------------------------------- pointwise

# One WGSL expression per elementwise op; {0}, {1} are the operands.
POINTWISE_EXPR = {
    "neg": "(-{0})",
    "exp": "exp({0})",
    "log": "log({0})",
    "sqrt": "sqrt({0})",
    "rsqrt": "(1.0 / sqrt({0}))",
    "reciprocal": "(1.0 / {0})",
    "abs": "abs({0})",
    "relu": "relu_({0})",  # keeps NaN, as numpy and torch do
    "sigmoid": "sigmoid_({0})",
    "tanh": "tanh_({0})",
    "silu": "({0} * sigmoid_({0}))",
    "stop_gradient": "{0}",
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "bias_add": "({0} + {1})",
    "swiglu": "({0} * sigmoid_({0}) * {1})",
    "relu_grad": "select(0.0, {0}, {1} > 0.0)",
    "abs_grad": "({0} * sign({1}))",
}

ACTIVATION_EXPR = {"none": "x", "relu": "relu_(x)", "silu": "x * sigmoid_(x)",
                   "gelu": "gelu_(x)", "gelu_tanh": "gelu_tanh_(x)"}


def _expr(op: str, args: list[str], attrs: dict, consts: list[float]) -> str:
    if op in ("gelu", "gelu_grad"):
        fn = op.replace("gelu", "gelu_tanh" if attrs.get("approximate") == "tanh" else "gelu")
        return f"{fn}_({', '.join(args)})"
    if op == "pow":
        e = float(attrs["exponent"])
        if e == 1.0:
            return args[0]
        if e == 2.0:
            return f"({args[0]} * {args[0]})"
        consts.append(e)
        c = f"c{len(consts) - 1}"
        if e == int(e):
            return f"pow_int_({args[0]}, {c})"
        return f"pow({args[0]}, {c})"
    if op not in POINTWISE_EXPR:
        raise UnsupportedOpError(f"no GPU kernel for op {op!r} inside a pointwise program yet")
    return POINTWISE_EXPR[op].format(*args)


def _pointwise(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    if node.op == "pointwise":
        program = node.attrs["program"]
    else:
        attrs = tuple((k, v) for k, v in node.attrs.items())
        program = ((node.op, tuple(("in", i) for i in range(len(node.inputs))), attrs),)
    out_shape = node.shape
    rank = len(out_shape)
    operands = [graph[i] for i in node.inputs]
    meta = [node.size] + list(out_shape)
    offsets, loads = [], []
    need_coords = False
    for k, x in enumerate(operands):
        if x.shape == out_shape:
            loads.append(f"    let a{k} = in{k}[idx];")
            meta += [0] * rank
        else:
            need_coords = True
            meta += broadcast_strides(x.shape, out_shape)
            offsets.append(k)
            loads.append(f"    let a{k} = in{k}[o{k}];")
    off_lines = []
    if need_coords:
        off_lines += [f"    var o{k} = 0u;" for k in offsets]
        off_lines.append("    var rem = idx;")
        off_lines.append("    for (var d = i32(RANK) - 1; d >= 0; d = d - 1) {")
        off_lines.append("        let n = m(1u + u32(d));")
        off_lines.append("        let c = rem % n;")
        off_lines.append("        rem = rem / n;")
        for k in offsets:
            off_lines.append(f"        o{k} = o{k} + c * m({1 + rank * (k + 1)}u + u32(d));")
        off_lines.append("    }")
    consts: list[float] = []
    body = []
    for j, (op, args, attrs) in enumerate(program):
        vals = []
        for kind, v in args:
            if kind == "in":
                vals.append(f"a{v}")
            elif kind == "t":
                vals.append(f"t{v}")
            else:
                consts.append(float(v))
                vals.append(f"c{len(consts) - 1}")
        body.append(f"    let t{j}: f32 = {_expr(op, vals, dict(attrs), consts)};")
    cbase = len(meta)
    const_lines = [f"    let c{i} = mf({cbase + i}u);" for i in range(len(consts))]
    meta += [f32_bits(c) for c in consts]
    names = [f"in{k}" for k in range(len(operands))]
    return _finish(f"pointwise:{node.op}", "pointwise", "pointwise.wgsl", names,
                   ["f32"] * len(operands), "f32", meta, grid_1d(-(-node.size // WG)),
                   RANK=rank, OFFSETS="\n".join(off_lines), LOADS="\n".join(const_lines + loads),
                   BODY="\n".join(body), RESULT=f"t{len(program) - 1}")


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
    for shape in extra_shapes:
        meta += op_words(shape, 0, 1)

    names, types = ["a_in", "b_in"], ["f32", "f32"]
    epi = []
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
    variant = "simple" if norm else matmul_variant(m_, n_, max(nbatch, 1), k_, ta, caps)
    tile_m, tile_n = _tile_of(variant)
    gx, gy = -(-n_ // tile_n), -(-m_ // tile_m)
    if max(gx, gy, nbatch) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: matmul grid {gx} x {gy} x {nbatch} exceeds "
                          f"{MAX_WORKGROUPS} workgroups per dimension")
    common = dict(BR=br, OPERANDS=_render("matmul_operands.wgsl", ACTIVATION=act), EPILOGUE="\n".join(epi))
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
    return _tiled_kernel(f"matmul:{node.op}", "matmul", names, types, meta, (gx, gy, max(nbatch, 1)), k_, note,
                         common, _tile_subs(variant, fetch_a, fetch_b, mnk=(m_, n_, k_), scaled=scaled),
                         extras=len(extras))


def _scaled_operands(graph: Graph, node: Node, variant: str, a: int, b: int) -> tuple[bool, bool]:
    """Which of a cooperative product's operands (A from node ``a``, B from ``b``) are
    gradients, scaled into f16's range before they are rounded (``_coop_prescan``): those
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


def _tiled_kernel(name, archetype, names, types, meta, grid, k_, note, common, subs, extras=0) -> Kernel:
    """A matmul_tiled.wgsl kernel over ``grid`` (column tiles, row tiles, batch); where
    its tiles are too few to fill the GPU (``matmul_splits``), the first stage of a split-K
    node: its K slices write raw sums to partials (the epilogue left out) and a second
    dispatch (matmul_splits.wgsl; bindings: the partials, the last ``extras`` operands,
    the output) adds them and applies the epilogue."""
    subs = dict(subs)
    enables = subs.pop("ENABLES", ())
    splits = matmul_splits(grid[0] * grid[1] * grid[2], k_, subs["BK"])
    if grid[2] * splits > MAX_WORKGROUPS:
        splits = 1
    first = common if splits == 1 else dict(common, EPILOGUE="",
                                            OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x"))
    k = _finish(name, archetype, "matmul_tiled.wgsl", names, types, "f32", meta,
                (grid[0], grid[1], grid[2] * splits), enables=enables, **first, **subs)
    k.notes["variant"] = note
    k.guarded = True
    if splits > 1:
        total = meta[0] * meta[1] * grid[2]
        k.partials = splits * total
        operands = len(names) - extras
        k.finish = _finish(f"{name}:splits", archetype, "matmul_splits.wgsl", ["partials", *names[operands:]],
                           ["f32"] * (1 + extras), "f32", [*meta, splits], grid_1d(-(-total // WG)),
                           SPLITS_WORD=len(meta), **common)
        k.finish.guarded = True
        k.finish_operands = tuple(range(operands, len(names)))
        k.notes["variant"] += f", K split {splits} ways"
    return k


# Split-K, measured on the H100 (docs/benchmarks.md, run 15).
MATMUL_RESIDENT = 4 * 132   # a wave: four 64 x 64 workgroups of 256 threads on each of 132 SMs
                            # (run 15; not re-tuned for run 17's 128-thread workgroups)
MATMUL_MIN_SLICE = 256      # K a slice keeps at least: K = 384 lost at every split
MATMUL_MAX_SPLITS = 16


def matmul_splits(tiles: int, k: int, bk: int) -> int:
    """How many K slices a tiled matmul (or convolution) with ``tiles`` workgroups,
    reduction length ``k`` and K step ``bk`` is cut into (``split_rule``).
    ``MEGANEURA_MATMUL_SPLITS=N`` forces N (benchmarks and tests)."""
    forced = os.environ.get("MEGANEURA_MATMUL_SPLITS")
    if forced:
        return max(1, min(int(forced), -(-k // bk)))
    return split_rule(tiles, k)


def split_rule(tiles: int, k: int) -> int:
    """Where at least 3 slices would fit the GPU's resident workgroups in one wave, as
    many as fit, each at least ``MATMUL_MIN_SLICE`` long; else 1. On the H100 whisper's
    fc2 ([1500, 384] out of K = 1536, 144 tiles) went from 0.127 to 0.100 ms in 3
    slices, gpt-tiny's weight gradient (K = 2048) from 0.163 to 0.128 ms, and a 32 x 4096
    x 4096 from 0.206 to 0.115 ms in 4; 2 slices gained nothing there, and no split of
    K = 384 did, the partials and the second dispatch (about 10 us with the barrier
    before it) costing what the slices saved. Whisper's weight gradients (36 tiles,
    K = 1500) take 5 slices of 300; at batch 8 (K = 12000) 14, which took them from
    0.27 ms (4 slices, the cap until run 17) to 0.14-0.18 ms. Outputs of more tiles
    than a third of the resident workgroups are left whole: 1024^3 (256 tiles) ran
    0.086 ms whole and 0.105 ms in 2 slices."""
    if tiles > MATMUL_RESIDENT // 3:
        return 1
    return max(1, min(MATMUL_RESIDENT // max(tiles, 1), k // MATMUL_MIN_SLICE, MATMUL_MAX_SPLITS))


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
    fastest once it makes at least two waves of workgroups (33 TFLOP/s at 4096^3; with
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
    ``MEGANEURA_MATMUL`` forces one of ``MATMUL_KERNELS`` (benchmarks and tests; a
    cooperative one only where ``caps`` allow it)."""
    caps = caps or PLAIN
    forced = os.environ.get("MEGANEURA_MATMUL", "auto")
    if forced in MATMUL_KERNELS and (forced not in COOP or caps.matmul_f16):
        return forced
    if caps.matmul_f16 and min(m_, n_, k_) >= COOP_FRAGMENT:
        for variant in (coop_variant(m_, n_, nbatch), "c64"):
            if coop_workgroup_bytes(variant) <= caps.workgroup_storage:
                return variant
    tiles = lambda t: -(-m_ // t) * -(-n_ // t) * nbatch
    if tiles(128) >= 264:
        return "128k8u"
    if (tiles(64) >= 64 and min(m_, n_) >= 64) or split_rule(tiles(64), k_) > 1:
        return "64t128" if transpose_a else "64"
    return "simple"


def coop_variant(m_: int, n_: int, nbatch: int) -> str:
    """The cooperative-matrix tile for an m x n output: 128 x 128 where that still makes a
    wave of workgroups on the H100's 132 SMs, else 64 x 64 (split-K then fills the GPU
    where K is long)."""
    return "c128" if -(-m_ // 128) * -(-n_ // 128) * nbatch >= 132 else "c64"


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
    16 x 16 f32 accumulator fragments."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn


# Measured on the H100 through Dawn (docs/benchmarks.md, run 18). At 4096^3 (edge tiles
# still checked) the 128 x 128 tile on 8 subgroups of 64 x 32 ran 111 TFLOP/s, on 4 of
# 64 x 64 91 (more registers a thread), with BK 16 67; 128 x 64 on 4 subgroups 61,
# 64 x 64 73, on 2 subgroups 59. On the models' shapes the 64 x 64 tile won or tied
# wherever 128 x 128 tiles make less than a wave, and 128 x 64 never won.
COOP = {"c128": CoopPreset(128, 128, 32, 2, 4), "c64": CoopPreset(64, 64, 32, 2, 2)}
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


def _store_coop(name: str, fetch: str, regs, scale: str = "") -> list[str]:
    """Stores of the fetched registers, times ``scale`` (a WGSL expression) if given and
    rounded to f16, into buffer ``buf`` of the cooperative kernel's f16 tile
    (``_coop_layout``)."""
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
    return out


def _coop_prescan(names, loads, regs, fetches, warps: int) -> tuple[list[str], str]:
    """Lines that find, before the main loop, the largest |value| of each named operand
    over the workgroup's whole K range (its own fetches, a first pass), and from it a
    power of two ``scale_{name}`` that puts that value in [2^14, 2^15): f16's range
    (65504) and its precision both fit a gradient of any magnitude, and the scale is
    exact to undo. The subgroups' maxima meet in the results' scratch (``Cs``, free until
    the results leave). Returns (the lines, the exponents' sum the results are scaled by)."""
    lines = []
    for name, load, reg, fetch in zip(names, loads, regs, fetches):
        absmax = [f"max(max(abs({r}).x, abs({r}).y), max(abs({r}).z, abs({r}).w))" if fetch.endswith("vec4")
                  else f"abs({r})" for r, _, _ in reg]
        lines += [f"    var amax_{name} = 0.0;",
                  "    for (var kb = kbeg; kb < kend; kb = kb + BK) {", *load,
                  *(f"        amax_{name} = max(amax_{name}, {m});" for m in absmax), "    }"]
    for i, name in enumerate(names):
        lines += [f"    {{ let top = subgroupMax(amax_{name}); if (lane == 0u) {{ Cs[sg * 2u + {i}u] = top; }} }}"]
    lines.append("    workgroupBarrier();")
    for i, name in enumerate(names):
        lines += [f"    var wmax_{name} = 0.0;",
                  f"    for (var w = 0u; w < {warps}u; w = w + 1u) {{ wmax_{name} = max(wmax_{name}, Cs[w * 2u + {i}u]); }}",
                  f"    let ex_{name} = clamp(select(0.0, floor(log2(wmax_{name})), wmax_{name} > 0.0), -100.0, 100.0);",
                  f"    let scale_{name} = exp2(14.0 - ex_{name});"]
    return lines, " + ".join(f"(ex_{name} - 14.0)" for name in names)


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
    subgroup's 16 x 16 f32 scratch, each lane passing its share to store() (epilogue,
    bounds). ``edges``: how A's and B's fetches meet their bounds (``_fetch_operand``;
    None: only edge tiles check each element). ``scaled``: which operands are scaled by
    a power of two into f16's range first (``_coop_prescan``; gradients), the results
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
    picked = [(n, ld, rg, fe) for n, ld, rg, fe, on in (("a", la, ra, fetch_a, scaled[0]),
                                                       ("b", lb, rb, fetch_b, scaled[1])) if on]
    prescan, exponents = _coop_prescan(*zip(*picked), warps=c.threads // 32) if picked else ([], "")
    back = f" * exp2({exponents})" if picked else ""
    store = []
    for i, j in frags:
        store += [f"    subgroupMatrixStore(&Cs, sg * {f * f}u, acc{i}_{j}, false, {f}u);",
                  "    workgroupBarrier();",
                  f"    for (var q = lane; q < {f * f}u; q = q + sg_size) {{",
                  f"        store(b, wg.z, row0 + wrow + {i * f}u + q / {f}u, col0 + wcol + {j * f}u + q % {f}u,"
                  f" Cs[sg * {f * f}u + q]{back});",
                  "    }",
                  "    workgroupBarrier();"]
    # f16 slots per row of each tile, padded by 8 against bank conflicts (rows stay 16-byte aligned)
    (a_slots, a_buf), (b_slots, b_buf) = (_coop_tile(fetch, tile, c.bk) for fetch, tile in ((fetch_a, c.bm),
                                                                                           (fetch_b, c.bn)))
    smem = (f"var<workgroup> Ah: array<f16, {2 * a_buf}>;\n"
            f"var<workgroup> Bh: array<f16, {2 * b_buf}>;\n"
            f"var<workgroup> Cs: array<f32, {c.threads // 32 * f * f}>;")
    args = (",\n        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,"
            " @builtin(subgroup_size) sg_size: u32")
    return dict(BM=c.bm, BN=c.bn, BK=c.bk, TM=f, TN=f, AS=a_slots, BS=b_slots, ABUF=a_buf, BBUF=b_buf,
                THREADS=c.threads, SMEM=smem, ARGS=args, THREAD_XY="", PRESCAN="\n".join(prescan),
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
    """Workgroup memory of a cooperative kernel at most (the larger tile layout): two f16
    buffers of each operand tile and the subgroups' f32 scratch."""
    c = COOP[preset]
    buf = lambda tile: max(_coop_tile(fetch, tile, c.bk)[1] for fetch in ("outer-vec4", "k-vec4"))
    return 2 * 2 * (buf(c.bm) + buf(c.bn)) + 4 * c.threads // 32 * COOP_FRAGMENT ** 2


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
            for h in hs:
                for j, x in enumerate("xyzw"):
                    store.append(f"    store(b, wg.z, r{g}{i}, col0 + {64 * h + j}u + tx * 4u, c{g}{i}_{h}.{x});")
    threads = TILED[preset].threads
    edges = [mode or "checked" for mode in edges]
    ca, da, la, ra = _fetch_operand("a", fetch_a, bm, bk, gather_a, threads, edges[0])
    cb, db, lb, rb = _fetch_operand("b", fetch_b, bn, bk, gather_b, threads, edges[1])
    sa, sb = _store_tiled("a", fetch_a, ra), _store_tiled("b", fetch_b, rb)
    smem = (f"var<workgroup> As: array<vec4<f32>, {2 * bk * (bm // 4 + 1)}>;\n"
            f"var<workgroup> Bs: array<vec4<f32>, {2 * bk * (bn // 4 + 1)}>;")
    return dict(BM=bm, BN=bn, BK=bk, TM=tm, TN=tn, AS=bm // 4 + 1, BS=bn // 4 + 1, THREADS=threads,
                ABUF=bk * (bm // 4 + 1), BBUF=bk * (bn // 4 + 1), SMEM=smem, ARGS="", PRESCAN="",
                ACC_DECL=decl, COMPUTE="\n".join(comp), STORE_OUT="\n".join(store),
                LOAD_DECL="\n".join([*lets, *ca, *cb, *da, *db]), LOAD="\n".join(la + lb),
                STORE="\n".join(sa + sb))


# ---------------------------------------------------------------- reductions

_ROW_MODES = {
    "sum": """    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + x[base + i]; }
    s = wg_sum(s, t);
    if (t == 0u) { out[row] = s; }""",
    "mean": """    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + x[base + i]; }
    s = wg_sum(s, t);
    if (t == 0u) { out[row] = s / f32(N); }""",
    "max": """    var s = -3.4028234e38;
    for (var i = t; i < N; i = i + 256u) { s = max(s, x[base + i]); }
    s = wg_max(s, t);
    if (t == 0u) { out[row] = s; }""",
    "softmax": """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + 256u) { mx = max(mx, x[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + exp(x[base + i] - mx); }
    s = wg_sum(s, t);
    let inv = 1.0 / s;
    for (var i = t; i < N; i = i + 256u) { out[base + i] = exp(x[base + i] - mx) * inv; }""",
    "log_softmax": """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + 256u) { mx = max(mx, x[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + exp(x[base + i] - mx); }
    s = wg_sum(s, t);
    let lse = mx + log(s);
    for (var i = t; i < N; i = i + 256u) { out[base + i] = x[base + i] - lse; }""",
    "layer_norm": """    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + x[base + i]; }
    let mu = wg_sum(s, t) / f32(N);
    var q = 0.0;
    for (var i = t; i < N; i = i + 256u) { let d = x[base + i] - mu; q = q + d * d; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var i = t; i < N; i = i + 256u) { out[base + i] = (x[base + i] - mu) * r * w[i] + bias[i]; }""",
    "rms_norm": """    var q = 0.0;
    for (var i = t; i < N; i = i + 256u) { let v = x[base + i]; q = q + v * v; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var i = t; i < N; i = i + 256u) { out[base + i] = x[base + i] * r * w[i]; }""",
}

_ROW_OPERANDS = {"layer_norm": ["x", "w", "bias"], "rms_norm": ["x", "w"]}


def _row_reduce(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    x = graph[node.inputs[0]]
    if node.op in ("sum", "mean", "max") and node.attrs.get("axis") is None:
        rows, n = 1, x.size
    else:
        n = x.shape[-1] if x.shape else 1
        rows = x.size // max(n, 1)
    eps = node.attrs.get("eps", 0.0)
    names = _ROW_OPERANDS.get(node.op, ["x"])
    return _finish(f"reduce:{node.op}", "reduction", "reduce_row.wgsl", names, ["f32"] * len(names),
                   "f32", [rows, n, f32_bits(eps)], grid_1d(rows), caps, MODE=_ROW_MODES[node.op])


# Losses reduce a whole tensor to one number. One workgroup doing it all was latency
# bound (gpt-tiny's cross_entropy over 2048 x 257 logits: 0.27 ms; whisper's mse_loss
# over 576k elements: 0.26 ms), so a loss runs in two dispatches: a row kernel
# (reduce_row.wgsl: a workgroup per row of logits, or per chunk of elements) leaves a
# pair (sum, count) per row in a scratch buffer, and loss_total.wgsl divides the sum of
# the sums by the sum of the counts (at least 1: an all-ignored batch gives 0).
LOSS_CHUNK = 4096  # elements per workgroup of the elementwise losses

_LOSS_ROWS = {
    "cross_entropy": """    let label = labels[row];
    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + 256u) { mx = max(mx, logits[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + exp(logits[base + i] - mx); }
    s = wg_sum(s, t);
    if (t == 0u) {
        let kept = label != mi(3u);
        let li = u32(clamp(label, 0, i32(N) - 1));
        out[2u * row] = select(0.0, mx + log(s) - logits[base + li], kept);
        out[2u * row + 1u] = select(0.0, 1.0, kept);
    }""",
    "soft_cross_entropy": """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + 256u) { mx = max(mx, logits[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    var ts = 0.0;
    var tl = 0.0;
    for (var i = t; i < N; i = i + 256u) {
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
    for (var i = base + t; i < end; i = i + 256u) {{ s = s + {term}; }}
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
                caps, MODE=mode)
    k.partials = 2 * rows
    k.finish = _finish("loss:total", "reduction", "loss_total.wgsl", ["partials"], ["f32"], "f32", [rows],
                       (1, 1, 1), caps)
    return k


SUM_TO_WORKGROUPS = 132  # enough to fill an H100's SMs once


def _sum_to(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    x = graph[node.inputs[0]]
    r = len(x.shape)
    out_p = (1,) * (r - len(node.shape)) + tuple(node.shape)
    if r > 1 and out_p == tuple(x.shape[:-1]) + (1,) and x.shape[-1] > 1:
        # only the last axis summed (layer-norm gradients): a row reduction reads it coalesced
        n = x.shape[-1]
        return _finish("sum_to", "reduction", "reduce_row.wgsl", ["x"], ["f32"], "f32", [x.size // n, n, 0],
                       grid_1d(x.size // n), caps, MODE=_ROW_MODES["sum"])
    xs = contiguous_strides(x.shape)
    kept = [xs[d] if out_p[d] == x.shape[d] else 0 for d in range(r)]
    red = [x.shape[d] if out_p[d] != x.shape[d] else 1 for d in range(r)]
    meta = [node.size, math.prod(red)] + list(out_p) + kept
    # Long reductions get more lanes per output, 64 when 16 would leave the GPU mostly
    # idle (a bias gradient: 384 outputs made 24 workgroups); a short one keeps one lane
    # per output.
    count = math.prod(red)
    outs = 256 if count <= 4 else 64 if count <= 64 else 16 if node.size >= 16 * SUM_TO_WORKGROUPS else 4
    return _finish("sum_to", "reduction", "sum_to.wgsl", ["x"], ["f32"], "f32", meta,
                   grid_1d(-(-node.size // outs)), RANK=r, OUTS=outs, REDUCED_OFFSET=_reduced_offset(red, xs))


def _reduced_offset(extents, strides) -> str:
    """WGSL adding to ``off`` the input offset of reduced element ``r`` (row-major over the
    reduced axes' ``extents``), with every extent and stride a constant."""
    axes = [d for d in range(len(extents)) if extents[d] > 1]
    lines = []
    for i, d in enumerate(reversed(axes)):
        last = i == len(axes) - 1
        index = "r" if last else f"r % {extents[d]}u"
        lines.append(f"            off = off + ({index}) * {strides[d]}u;")
        if not last:
            lines.append(f"            r = r / {extents[d]}u;")
    return "\n".join(lines)


# ---------------------------------------------------------------- copies

def _copy(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
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
        lines.append(f"    if (c >= {start}u && c < {start + ln}u) "
                     f"{{ out[idx] = in{k}[piece_offset({k}u, idx)]; return; }}")
    t = _wgsl_type(node.dtype)
    names = [f"in{k}" for k in range(len(operands))]
    return _finish(f"copy:{node.op}", "copy", "copy.wgsl", names,
                   [_wgsl_type(x.dtype) for x in operands], t, meta, grid_1d(-(-node.size // WG)),
                   RANK=r, AXIS=axis, PIECES="\n".join(lines), ZERO=f"{t}(0)")


def _embedding(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    table = graph[node.inputs[0]]
    meta = [node.size, table.shape[1], table.shape[0]]
    return _finish("gather:embedding", "gather", "embedding.wgsl", ["table", "ids"], ["f32", "i32"],
                   "f32", meta, grid_1d(-(-node.size // WG)))


# ---------------------------------------------------------------- rope, conv, attention

def _rope(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    b, t, w = node.shape
    a = node.attrs
    d = w // a["num_heads"]
    inv = 1.0 / float(a["base"]) ** (np.arange(0, d, 2, dtype=np.float64) / d)
    meta = [node.size, t, w, d, int(a["offset"]), int(bool(a.get("inverse", False)))]
    meta += [f32_bits(v) for v in inv]
    return _finish("rope", "pointwise", "rope.wgsl", ["x"], ["f32"], "f32", meta,
                   grid_1d(-(-node.size // WG)))


# ---------------------------------------------------------------- convolution as implicit GEMM
# Every convolution kernel is the tiled matmul with one or both operands gathered (the
# im2col matrix is read straight from the tensor, zero where the window leaves it):
#   conv:              out[n] (O x OH*OW)  = w (O x C*KH*KW)          @ im2col(x[n])
#   conv_input_grad:   dx[n]  (C x H*W)    = w as (C x O*KH*KW)       @ windows of dout[n]
#   conv_weight_grad:  dw     (O x C*KH*KW) = dout as (O x N*OH*OW)   @ im2col(x) over the batch
# (1-d convolutions are 2-d ones of height 1). The direct kernels (one thread per output,
# summing its window) ran at 0.2-1.9 TFLOP/s on the H100: whisper-tiny's conv2 input
# gradient alone took 6.9 ms of a 25 ms training step. The geometry (_CONV_WORDS) is
# written into each kernel as constants, not meta words: every gathered element divides
# by it, and a division by a constant compiles to a multiply and a shift.

_CONV_WORDS = ("C", "O", "H", "W", "KH", "KW", "OH", "OW", "SH", "SW", "PH", "PW")


def _conv_geometry(graph: Graph, node: Node) -> dict:
    """The convolution's sizes (``_CONV_WORDS`` and the batch N), whichever op it is."""
    a = node.attrs
    if node.op in ("conv1d", "conv2d"):
        x, w, out = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape, node.shape
    elif node.op == "conv_input_grad":
        dout, w = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape
        x, out = tuple(a["input_shape"]), dout
    else:
        x, dout = graph[node.inputs[0]].shape, graph[node.inputs[1]].shape
        w, out = (dout[1], x[1], *a["kernel"]), dout
    one_d = len(x) == 3
    lift = (lambda t, height=1: (height, *t)) if one_d else (lambda t, height=1: tuple(t))
    (h, wd), (kh, kw), (oh, ow) = lift(x[2:]), lift(w[2:]), lift(out[2:])
    (sh, sw), (ph, pw) = lift(a["stride"]), lift(a["padding"], height=0)
    return dict(N=x[0], C=x[1], O=w[0], H=h, W=wd, KH=kh, KW=kw, OH=oh, OW=ow, SH=sh, SW=sw, PH=ph, PW=pw)


def _window(go_pos: str, r: str) -> tuple[str, str]:
    """(input row, input column) as i32 of output position ``go_pos`` and kernel tap ``r``."""
    return (f"i32(({go_pos} / cv_OW) * cv_SH + {r} / cv_KW) - i32(cv_PH)",
            f"i32(({go_pos} % cv_OW) * cv_SW + {r} % cv_KW) - i32(cv_PW)")


def _inside(iy: str, ix: str) -> str:
    return f"{iy} >= 0 && {iy} < i32(cv_H) && {ix} >= 0 && {ix} < i32(cv_W)"


def _im2col_forward(go, gk):
    """B of the forward conv: k = (c, ky, kx), outer = output position of batch b."""
    iy, ix = _window(go, f"{gk} % (cv_KH * cv_KW)")
    return ([f"let iy = {iy};", f"let ix = {ix};"],
            f"{go} < N && {gk} < K && {_inside('iy', 'ix')}",
            f"b0 + ({gk} / (cv_KH * cv_KW) * cv_H + u32(iy)) * cv_W + u32(ix)")


def _weights_by_channel(go, gk):
    """A of the input gradient: w[o, c, ky, kx] at row c, k = (o, ky, kx)."""
    return ([], f"{go} < M && {gk} < K",
            f"({gk} / (cv_KH * cv_KW) * cv_C + {go}) * cv_KH * cv_KW + {gk} % (cv_KH * cv_KW)")


def _dout_windows(go, gk):
    """B of the input gradient: the dout element that tap (o, ky, kx) of input position
    ``go`` received, where the stride lets one."""
    return ([f"let r = {gk} % (cv_KH * cv_KW);",
             f"let ty = i32({go} / cv_W + cv_PH) - i32(r / cv_KW);",
             f"let tx = i32({go} % cv_W + cv_PW) - i32(r % cv_KW);"],
            f"{go} < N && {gk} < K && ty >= 0 && tx >= 0 && u32(ty) % cv_SH == 0u && u32(tx) % cv_SW == 0u "
            f"&& u32(ty) / cv_SH < cv_OH && u32(tx) / cv_SW < cv_OW",
            f"b0 + ({gk} / (cv_KH * cv_KW) * cv_OH + u32(ty) / cv_SH) * cv_OW + u32(tx) / cv_SW")


def _dout_rows(go, gk):
    """A of the weight gradient: dout[n, o, oy, ox] at row o, k = (n, oy, ox)."""
    return ([], f"{go} < M && {gk} < K",
            f"({gk} / (cv_OH * cv_OW) * cv_O + {go}) * cv_OH * cv_OW + {gk} % (cv_OH * cv_OW)")


def _im2col_batch(go, gk):
    """B of the weight gradient: k = (n, oy, ox), outer = (c, ky, kx)."""
    iy, ix = _window(f"({gk} % (cv_OH * cv_OW))", f"({go} % (cv_KH * cv_KW))")
    return ([f"let iy = {iy};", f"let ix = {ix};"],
            f"{go} < N && {gk} < K && {_inside('iy', 'ix')}",
            f"(({gk} / (cv_OH * cv_OW) * cv_C + {go} / (cv_KH * cv_KW)) * cv_H + u32(iy)) * cv_W + u32(ix)")


def _conv(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """Any convolution op as an implicit GEMM on the tiled matmul kernel."""
    g = _conv_geometry(graph, node)
    taps, spatial_in, spatial_out = g["KH"] * g["KW"], g["H"] * g["W"], g["OH"] * g["OW"]
    words = lambda batch_stride, s_row, s_col: [batch_stride, s_row, s_col]   # BR = 1: one batch stride
    if node.op == "conv_input_grad":
        m_, n_, k_, nbatch = g["C"], spatial_in, g["O"] * taps, g["N"]
        ops = words(0, 0, 0) + words(g["O"] * spatial_out, 0, 0)
        fetch_a, gather_a, fetch_b, gather_b = "k-scalar", _weights_by_channel, "outer-scalar", _dout_windows
    elif node.op == "conv_weight_grad":
        m_, n_, k_, nbatch = g["O"], g["C"] * taps, g["N"] * spatial_out, 1
        ops = words(0, 0, 0) + words(0, 0, 0)
        fetch_a, gather_a, fetch_b, gather_b = "k-scalar", _dout_rows, "outer-scalar", _im2col_batch
    else:
        m_, n_, k_, nbatch = g["O"], spatial_out, g["C"] * taps, g["N"]
        ops = words(0, k_, 1) + words(g["C"] * spatial_in, 0, 0)
        fetch_a, gather_a = operand_fetch([0, k_, 1], m_, k_), None
        fetch_b, gather_b = "outer-scalar", _im2col_forward
    has_bias = node.op in ("conv1d", "conv2d") and len(node.inputs) == 3
    epilogue = ["    v = v + add_in[row];"] if has_bias else []
    meta = [m_, n_, k_, nbatch, 0, nbatch] + ops
    lets = [f"    const cv_{w} = {g[w]}u;" for w in _CONV_WORDS]
    # bindings follow the node's inputs: B (x or dout) comes first in all three ops
    names = ["b_in", "a_in"] + (["add_in"] if has_bias else [])
    types = ["f32", "vec4<f32>" if fetch_a.endswith("vec4") else "f32"] + (["f32"] if has_bias else [])
    preset = matmul_variant(m_, n_, nbatch, k_, caps=caps)
    preset = "64" if preset == "simple" else preset
    tile_m, tile_n = _tile_of(preset)
    grid = (-(-n_ // tile_n), -(-m_ // tile_m), nbatch)
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: convolution grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension")
    common = dict(BR=1, OPERANDS=_render("matmul_operands.wgsl", ACTIVATION="x"), EPILOGUE="\n".join(epilogue))
    scaled = _scaled_operands(graph, node, preset, node.inputs[1], node.inputs[0])   # A, B as bound
    return _tiled_kernel(f"conv:{node.op}", "conv", names, types, meta, grid, k_,
                         f"implicit GEMM {m_}x{n_}x{k_}, {_tile_note(preset, scaled)}", common,
                         _tile_subs(preset, fetch_a, fetch_b, gather_a, gather_b, lets, (m_, n_, k_), scaled),
                         extras=int(has_bias))


def attention_variant(head_dim: int) -> str:
    """Which attention kernel a head dim gets: ``"tiled"`` (flash attention, blocks of
    queries and keys in workgroup memory, a vec4 of output columns per thread) where D is a multiple of 4 up
    to 64, else ``"per-query"`` (one thread per query streaming over the keys).
    ``MEGANEURA_ATTENTION=per-query`` forces the latter (benchmarks and tests)."""
    if os.environ.get("MEGANEURA_ATTENTION") == "per-query":
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


def _attention(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    bsz, t, s, h, hkv, d, causal, scale = _attention_dims(node, graph[node.inputs[0]], graph[node.inputs[1]])
    if attention_variant(d) == "tiled":
        return _attention_tiled(graph, node, bsz, t, s, h, hkv, d, causal, scale, caps)
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


# An attention grid of fewer workgroups than this splits its streamed side (below);
# measured on the H100 (docs/benchmarks.md, run 12).
ATTENTION_FILL = 6 * 132   # six workgroups on each of an H100's 132 SMs
ATTENTION_MIN_PART = 8     # streamed blocks a part keeps at least
ATTENTION_MAX_SPLITS = 16


def attention_splits(grid: int, streamed_blocks: int) -> int:
    """How many parts an attention kernel with ``grid`` workgroups (blocks of fixed rows x
    heads x batch) splits each workgroup's ``streamed_blocks`` blocks into. Whisper's
    encoder at batch 1 has 47 x 6 blocks of 32 queries, 282 workgroups of 128 threads:
    two an SM, too few to hide memory latency; splitting the keys three ways took its
    forward from 0.378 to 0.324 ms and its backward from 1.82 to 1.62 ms on the H100 (run
    12, 32-row blocks), at the price of partial results and a second dispatch that
    combines them. Short streams lose: gpt-tiny's 256 causal keys ran 20% slower split
    in two.
    ``MEGANEURA_ATTENTION_SPLITS=N`` forces N (benchmarks and tests)."""
    forced = os.environ.get("MEGANEURA_ATTENTION_SPLITS")
    if forced:
        return max(1, min(int(forced), streamed_blocks))
    if grid >= ATTENTION_FILL:
        return 1
    return max(1, min(-(-ATTENTION_FILL // grid), streamed_blocks // ATTENTION_MIN_PART, ATTENTION_MAX_SPLITS))


def _split_grid(graph: Graph, node: Node, blocks: int, heads: int, bsz: int, splits: int):
    grid = (blocks, heads, bsz * splits)
    if max(grid) > MAX_WORKGROUPS:
        raise DeviceError(f"{graph.format_node(node)}: attention grid {grid} exceeds {MAX_WORKGROUPS} "
                          f"workgroups per dimension")
    return grid


_SPLIT_MODES = {"softmax": 0, "sum": 1, "logsumexp": 2}


def _split_combine(kernel: Kernel, mode: str, splits: int, n: int, partials: int, dims=(0, 0, 0, 0),
                   streamed: str = "keys") -> Kernel:
    """Make ``kernel`` (whose output binding now receives ``partials`` floats from
    ``splits`` parts) the first stage of a two-dispatch node whose second stage combines
    the parts into the ``n`` outputs (vec4s for ``softmax``): attention_splits.wgsl."""
    bsz, t, h, d4 = dims
    typ = "vec4<f32>" if mode == "softmax" else "f32"
    zero = "vec4<f32>(0.0)" if mode == "softmax" else "0.0"
    kernel.partials = partials
    kernel.finish = _finish(f"{kernel.name}:combine", "reduction", "attention_splits.wgsl", ["partials"], [typ],
                            typ, [n, splits, bsz, t, h, d4, -(-t // 4)], grid_1d(-(-n // WG)),
                            MODE=_SPLIT_MODES[mode], OUT_TYPE=typ, ZERO=zero,
                            STAT="partials[at][t % 4u]" if mode == "softmax" else "0.0")
    kernel.finish.guarded = True
    kernel.notes["variant"] += f", {streamed} split {splits} ways"
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


def attention_prefetch() -> int:
    """How far ahead the attention kernels fetch their staged blocks:
    ``MEGANEURA_ATTENTION_PREFETCH`` 0 (each block where it is stored), 1 (a block's
    second operand at the block's start) or 2, the default (the forward also fetches the
    next block's keys before P . V; the backward as 1)."""
    level = os.environ.get("MEGANEURA_ATTENTION_PREFETCH") or "2"
    if level not in ("0", "1", "2"):
        raise DeviceError(f"MEGANEURA_ATTENTION_PREFETCH={level!r} is not 0, 1 or 2")
    return int(level)


def _per_element(template: str, threads: int, steps: int, indent: int = 8) -> str:
    """The attention kernels' unrolled staging: ``template`` once per element a thread
    stages, ``{e}`` the element (tid + n * threads) and ``{n}`` its step."""
    return "\n".join(" " * indent + template.format(n=n, e=f"tid + {n * threads}u") for n in range(steps))


def _forward_staging(threads: int, steps: int) -> dict:
    """The staging lines of attention_tiled.wgsl's loop, element tid + n * threads each:
    with prefetch, V's registers vpre<n> are fetched before the scores and stored after
    them, and the next block's K (kpre<n>) before P . V, stored at the next block's
    start."""
    level = attention_prefetch()
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


def _attention_tiled(graph, node, bsz, t, s, h, hkv, d, causal, scale, caps: Capabilities = PLAIN) -> Kernel:
    bq = attention_queries(d, caps)
    blocks = -(-t // bq)
    splits = attention_splits(blocks * h * bsz, -(-s // ATTENTION_KEYS))
    grid = _split_grid(graph, node, blocks, h, bsz, splits)
    meta = [t, s, h, hkv, causal, f32_bits(scale * math.log2(math.e)), splits, bsz]
    vec4 = "vec4<f32>"
    threads = 4 * bq
    stage = -(-ATTENTION_KEYS * d // 4 // threads)
    kernel = _finish("attention", "attention", "attention_tiled.wgsl", ["q", "k", "v"], [vec4] * 3, vec4,
                     meta, grid, D=d, BQ=bq, THREADS=threads,
                     ROWS=_render("attention_rows.wgsl", PARTIALS="red", STRIDE="PS"),
                     SPLIT="true" if splits > 1 else "false", **_forward_staging(threads, stage),
                     SCORES="\n".join(f"        s = outer_step(s, Qs[{i}u * QV + ty], KVs[{i}u * KR + tx]);"
                                       for i in range(d)),
                     ACCUMULATE="\n".join(f"            o = outer_step(o, KVs[{j}u * D4 + tx], "
                                           f"Ps[{_p_row(j)}u * PS + ty]);" for j in range(ATTENTION_KEYS)))
    kernel.notes["variant"] = (f"tiled (flash) {bq} queries x {ATTENTION_KEYS} keys, "
                               f"4x4 scores and 4x4 outputs/thread")
    kernel.guarded = True
    if splits > 1:
        rows = bsz * t * h
        stats = splits * bsz * h * -(-t // 4) * 8
        _split_combine(kernel, "softmax", splits, rows * d // 4, splits * rows * d + stats, (bsz, t, h, d // 4))
    return kernel


@dataclass(frozen=True)
class _BackwardMode:
    """One kernel of attention_backward.wgsl: its MODE (the template's MODE_LSE, MODE_DQ,
    MODE_DK, MODE_DV), the node's operand names and the operands playing the roles A, B
    (fixed side: scores, dP) and X, Y (streamed side)."""

    index: int
    operands: tuple[str, ...]
    roles: tuple[str, str, str, str]

    @property
    def fixed_queries(self) -> bool:
        """lse and dq own blocks of queries; dk and dv blocks of keys."""
        return self.index <= 1

    @property
    def has_dp(self) -> bool:
        """dq and dk need dP = dO vᵀ (and so the B operand and Delta)."""
        return self.index in (1, 2)

    @property
    def accumulates(self) -> bool:
        """All but lse sum a block's P or dS times a streamed operand into their output."""
        return self.index > 0


_GRAD_OPERANDS = ("q", "k", "v", "dout", "lse", "delta")
ATTENTION_BACKWARD = {
    "attention_lse": _BackwardMode(0, ("q", "k"), ("q", "q", "k", "k")),
    "attention_grad_q": _BackwardMode(1, _GRAD_OPERANDS, ("q", "dout", "k", "v")),
    "attention_grad_k": _BackwardMode(2, _GRAD_OPERANDS, ("k", "v", "q", "dout")),
    "attention_grad_v": _BackwardMode(3, ("q", "k", "dout", "lse"), ("k", "k", "q", "dout")),
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
    NVIDIA's 48 KiB. ``MEGANEURA_ATTENTION_BACKWARD_ROWS=16|32|64`` forces it (benchmarks)."""
    forced = os.environ.get("MEGANEURA_ATTENTION_BACKWARD_ROWS")
    if forced in ("16", "32", "64"):
        return int(forced)
    fits = [r for r in (64, 32) if attention_backward_bytes(r, head_dim, mode.has_dp, mode.accumulates)
            <= caps.workgroup_storage]
    return fits[0] if fits else 16


def _score_lines(fixed: str, acc: str, d: int, indent: int) -> str:
    """acc (4 fixed rows x streamed rows 4tx..4tx+3) += fixed . Ss over d, unrolled."""
    return "\n".join(f"{' ' * indent}{acc} = score_step({acc}, {fixed}[{i}u * RV + ty], Ss[{i}u * CV + tx]);"
                     for i in range(d))


def _accumulate_lines(groups: int) -> str:
    """o += Ps . Ss over the block's streamed rows, 4 at a time, unrolled: column r of o is
    output column tx + 16 r (r < groups), read from d-row tx + 16 r of Ss as a vec4 over 4
    streamed rows."""
    lines = []
    for jj in range(ATTENTION_STREAMED // 4):
        loads = " ".join(f"let x{r} = Ss[xc + {16 * r}u * CV + {jj}u];" for r in range(groups))
        lines.append(f"{' ' * 12}{{ {loads}")
        for c in "xyzw":
            j = 4 * jj + "xyzw".index(c)
            x = ", ".join(f"x{r}.{c}" if r < groups else "0.0" for r in range(4))
            lines.append(f"{' ' * 14}o = accumulate_step(o, Ps[{_p_row(j)}u * PR + ty], vec4<f32>({x}));")
        lines[-1] += " }"
    return "\n".join(lines)


def _staging(mode: _BackwardMode, threads: int, steps: int) -> dict:
    """The staging lines of attention_backward.wgsl's loop: the second operand of a block
    (dq, dk: X; dv: Y) fetched into registers pre0.. at its start and put into Ss where it
    is needed; lse, with one operand, stages X directly. ``MEGANEURA_ATTENTION_PREFETCH=0``
    stages both directly (benchmarks; see attention_prefetch)."""
    direct = {role: f"        stage_stream({role}, tid, b, stream_head, c0);" for role in ("ROLE_X", "ROLE_Y")}
    if mode.index == 0 or attention_prefetch() == 0:
        return dict(PREFETCH="", STAGE_X=direct["ROLE_X"], STAGE_Y=direct["ROLE_Y"])
    fetch = _per_element("let pre{n} = fetch_element(second, {e}, b, stream_head, c0);", threads, steps)
    put = _per_element("put_element({e}, pre{n});", threads, steps)
    dv = mode.index == 3
    return dict(PREFETCH=fetch, STAGE_X=direct["ROLE_X"] if dv else put, STAGE_Y=put if dv else direct["ROLE_Y"])


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
    splits = attention_splits(blocks * heads * bsz, -(-streamed // ATTENTION_STREAMED))
    grid = _split_grid(graph, node, blocks, heads, bsz, splits)
    meta = [t, s, h, hkv, causal, f32_bits(scale * math.log2(math.e)), f32_bits(scale), splits, node.size]
    groups = -(-d // 16)
    stage_steps = -(-ATTENTION_STREAMED * d // 4 // threads)
    types = ["f32" if n in ("lse", "delta") else "vec4<f32>" for n in mode.operands]
    a, b, x, y = mode.roles
    kernel = _finish(node.op, "attention", "attention_backward.wgsl", list(mode.operands), types, "f32", meta,
                     grid, D=d, R=rows, THREADS=threads, MODE=mode.index,
                     ROWS=_render("attention_rows.wgsl", PARTIALS="Ps", STRIDE="PR"), A=a, B=b, X=x, Y=y,
                     LSE_AT="lse[i] * LOG2E" if "lse" in mode.operands else "0.0",
                     DELTA_AT="delta[i]" if "delta" in mode.operands else "0.0",
                     BS_LEN="D * RV" if mode.has_dp else "1u", SS_ROWS=16 * groups,
                     PS_ROWS="C" if mode.accumulates else "16u",
                     STAGE=_per_element("stage_element(role, {e}, b, head, c0);", threads, stage_steps, 4),
                     **_staging(mode, threads, stage_steps),
                     SCORES=_score_lines("As", "s", d, 8),
                     DP=_score_lines("Bs", "dp", d, 12) if mode.has_dp else "",
                     ACCUMULATE=_accumulate_lines(groups) if mode.accumulates else "")
    fixed, streamed = ("queries", "keys") if mode.fixed_queries else ("keys", "queries")
    kernel.notes["variant"] = (f"tiled backward: {rows} {fixed} a workgroup, {streamed} streamed "
                               f"{ATTENTION_STREAMED} at a time, 4x4 scores and 4x{groups} outputs/thread")
    kernel.guarded = True
    if splits > 1:
        _split_combine(kernel, "logsumexp" if mode.index == 0 else "sum", splits, node.size, splits * node.size,
                       streamed=streamed)
    return kernel


# ---------------------------------------------------------------- row kernels with their own operands
# Same template as the row reductions (one workgroup per row, tree reductions in
# workgroup memory); meta words from 3 on are the op's own.

# A norm's backward kernels start from the row's statistics: its mean (0 for an RMS
# norm) and r = 1 / sqrt(variance + eps).
_NORM_STATS = """    var s = 0.0;
    if ({{CENTER}}) {
        for (var i = t; i < N; i = i + 256u) { s = s + x[base + i]; }
        s = wg_sum(s, t);
    }
    let mu = s / f32(N);
    var q = 0.0;
    for (var i = t; i < N; i = i + 256u) { let c = x[base + i] - mu; q = q + c * c; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);"""

_ROW_KERNELS = {
    "group_norm": (["x", "w", "bias"], """    let S = m(3u);
    let cpg = m(4u);
    let G = m(5u);
    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + x[base + i]; }
    let mu = wg_sum(s, t) / f32(N);
    var q = 0.0;
    for (var i = t; i < N; i = i + 256u) { let d = x[base + i] - mu; q = q + d * d; }
    let r = inverseSqrt(wg_sum(q, t) / f32(N) + eps);
    for (var i = t; i < N; i = i + 256u) {
        let c = (row % G) * cpg + i / S;
        let y = (x[base + i] - mu) * r * w[c] + bias[c];
        out[base + i] = {{GN_ACT}};
    }"""),
    "norm_grad": (["dout", "x", "w"], _NORM_STATS + """
    var sg = 0.0;
    var sgx = 0.0;
    for (var i = t; i < N; i = i + 256u) {
        let g = dout[base + i] * w[i];
        sg = sg + g;
        sgx = sgx + g * (x[base + i] - mu) * r;
    }
    let mean_g = select(0.0, wg_sum(sg, t) / f32(N), {{CENTER}});
    let mean_gx = wg_sum(sgx, t) / f32(N);
    for (var i = t; i < N; i = i + 256u) {
        out[base + i] = r * (dout[base + i] * w[i] - mean_g - (x[base + i] - mu) * r * mean_gx);
    }"""),
    "norm_grad_w": (["dout", "x"], _NORM_STATS + """
    for (var i = t; i < N; i = i + 256u) { out[base + i] = dout[base + i] * (x[base + i] - mu) * r; }"""),
    "max_grad": (["dout", "x"], """    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + 256u) { mx = max(mx, x[base + i]); }
    mx = wg_max(mx, t);
    var ties = 0.0;
    for (var i = t; i < N; i = i + 256u) { ties = ties + select(0.0, 1.0, x[base + i] == mx); }
    let share = dout[row] / wg_sum(ties, t);
    for (var i = t; i < N; i = i + 256u) { out[base + i] = select(0.0, share, x[base + i] == mx); }"""),
    "cross_entropy_grad": (["logits", "labels", "dout"], """    let ignore = mi(3u);
    var kept = 0.0;
    for (var r = t; r < rows; r = r + 256u) { kept = kept + select(1.0, 0.0, labels[r] == ignore); }
    kept = wg_sum(kept, t);
    let label = labels[row];
    var mx = -3.4028234e38;
    for (var i = t; i < N; i = i + 256u) { mx = max(mx, logits[base + i]); }
    mx = wg_max(mx, t);
    var s = 0.0;
    for (var i = t; i < N; i = i + 256u) { s = s + exp(logits[base + i] - mx); }
    let scale = select(dout[0] / max(kept, 1.0), 0.0, label == ignore);
    let inv = 1.0 / wg_sum(s, t);
    for (var i = t; i < N; i = i + 256u) {
        let onehot = select(0.0, 1.0, i32(i) == label);
        out[base + i] = (exp(logits[base + i] - mx) * inv - onehot) * scale;
    }"""),
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
    return _finish(f"reduce:{node.op}", "reduction", "reduce_row.wgsl", names, types, "f32", meta,
                   grid_1d(rows), caps,
                   MODE=mode.replace("{{GN_ACT}}", act).replace("{{CENTER}}", str(a.get("center", True)).lower()))


def _embedding_grad(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    dout = graph[node.inputs[0]]
    dim = node.shape[1]
    meta = [node.size, dim, dout.size // dim]
    return _finish("gather:embedding_grad", "gather", "scatter.wgsl", ["dout", "ids"], ["f32", "i32"],
                   "f32", meta, grid_1d(-(-node.size // WG)))


# ---------------------------------------------------------------- dispatch table

_BUILDERS = {}
for _op in list(POINTWISE_EXPR) + ["gelu", "gelu_grad", "pow", "pointwise"]:
    _BUILDERS[_op] = _pointwise
for _op in ("matmul", "fused_matmul", "norm_matmul"):
    _BUILDERS[_op] = _matmul
for _op in _ROW_MODES:
    _BUILDERS[_op] = _row_reduce
for _op in (*_LOSS_ROWS, *_LOSS_TERMS):
    _BUILDERS[_op] = _loss
_BUILDERS["sum_to"] = _sum_to
for _op in ("transpose", "broadcast_to", "slice", "pad", "concat"):
    _BUILDERS[_op] = _copy
_BUILDERS["embedding"] = _embedding
_BUILDERS["rope"] = _rope
_BUILDERS["conv1d"] = _BUILDERS["conv2d"] = _conv
_BUILDERS["attention"] = _attention
for _op in ATTENTION_BACKWARD:
    _BUILDERS[_op] = _attention_backward
for _op in _ROW_KERNELS:
    _BUILDERS[_op] = _row_kernel
_BUILDERS["embedding_grad"] = _embedding_grad
_BUILDERS["conv_input_grad"] = _BUILDERS["conv_weight_grad"] = _conv


def supported_ops() -> list[str]:
    return sorted(_BUILDERS)


def unsupported_ops() -> list[str]:
    return sorted(n for n, d in OPS.items() if n not in _BUILDERS and d.archetype not in ("source", "view"))


_FORWARD: dict[int, tuple[Graph, tuple, frozenset]] = {}


def forward_nodes(graph: Graph) -> frozenset:
    """The nodes of ``graph`` that compute forward values: the ancestors of its outputs
    other than the gradients (``grad:`` outputs, ``engine.autodiff.differentiate``), so
    in a graph with none, every node. The others compute gradients, whose operands the
    cooperative kernels scale (``_scaled_operands``)."""
    key = (len(graph.nodes), tuple(sorted(graph.outputs.items())))
    hit = _FORWARD.get(id(graph))
    if hit is not None and hit[0] is graph and hit[1] == key:
        return hit[2]
    found = graph.live_nodes(i for name, i in graph.outputs.items() if not name.startswith("grad:"))
    if len(_FORWARD) > 64:
        _FORWARD.clear()
    _FORWARD[id(graph)] = (graph, key, frozenset(found))
    return _FORWARD[id(graph)][2]


def kernel_for(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    """The kernel that runs ``node`` (one dispatch) on a device with ``caps``."""
    builder = _BUILDERS.get(node.op)
    if builder is None:
        raise UnsupportedOpError(
            f"no GPU kernel for op {node.op!r} yet ({graph.format_node(node)}); "
            f"run it with the reference backend (--backend reference)")
    if node.op == "pointwise":
        for op, _, _ in node.attrs["program"]:
            if op not in POINTWISE_EXPR and op not in ("gelu", "pow"):
                raise UnsupportedOpError(f"no GPU kernel for op {op!r} inside the pointwise program "
                                         f"of {graph.format_node(node)} yet")
    return builder(graph, node, caps)


# ---------------------------------------------------------------- training-step kernels
# Not graph nodes: the optimizer update and the gradient-norm partial sums that a GPU
# training step appends after the backward pass (engine/training_session.py).

OPTIMIZER_KINDS = {"sgd": 0, "adam": 1, "adamw": 2}


NORM_CHUNK = 4096  # gradient elements per workgroup of the norm partial sums


def norm_partials(n: int) -> int:
    """How many partials (each two stats slots: scale, scaled sum of squares) a gradient
    of n elements writes."""
    return max(1, -(-n // NORM_CHUNK))


def sum_squares_kernel(n: int, first_slot: int) -> Kernel:
    """stats[first_slot + 2w ..] = (max |g|, sum of (g / max)^2) of chunk w of the
    gradient; bindings: grad (read), stats (read_write)."""
    return _finish("train:sum_squares", "reduction", "sum_squares.wgsl", ["grad"], ["f32"], "f32",
                   [n, first_slot], grid_1d(norm_partials(n)), CHUNK=NORM_CHUNK)


def norm_total_kernel(count: int) -> Kernel:
    """stats[1] = the gradient norm from ``count`` partials at stats[2:]; binding: stats
    (read_write)."""
    return _finish("train:norm_total", "reduction", "norm_total.wgsl", [], [], "f32", [count], (1, 1, 1))


def optimizer_kernel(n: int, kind: str, lr_multiplier: float, weight_decay: float,
                     momentum: float, betas, eps: float, clip_norm: float | None) -> Kernel:
    """In-place update of one parameter; bindings: grad, stats, step (read), p, s1, s2 (read_write)."""
    meta = [n, 0, OPTIMIZER_KINDS[kind], f32_bits(lr_multiplier), f32_bits(weight_decay),
            f32_bits(momentum), f32_bits(betas[0]), f32_bits(betas[1]), f32_bits(eps),
            f32_bits(clip_norm or 0.0)]
    return _finish(f"train:{kind}", "optimizer", "optimizer.wgsl", ["grad", "stats", "step"],
                   ["f32"] * 3, "f32", meta, grid_1d(-(-n // WG)))


def gradient_copy_kernel(n: int) -> Kernel:
    """out[i] = in0[i] for i < n, on the copy template: a gradient whose node cannot be
    computed in its arena slot (it is an input, a parameter, a constant, another
    output's node, or shared by two parameters) is copied there. Bindings: in0 (read),
    out (read_write). The size is in meta, so every such copy shares one pipeline."""
    return _finish("copy:gradient", "copy", "copy.wgsl", ["in0"], ["f32"], "f32", [n, n],
                   grid_1d(-(-n // WG)), RANK=1, AXIS=0,
                   PIECES="    if (c < m(1u)) { out[idx] = in0[idx]; return; }", ZERO="f32(0)")
