"""What every kernel archetype shares: ``Capabilities`` (what a device lets kernels use),
``Kernel`` (one dispatch's WGSL, meta words and workgroups), template rendering, strides,
grids and ``_finish``, which fills a template's bindings.

Binding layout of every kernel: 0 = meta (uniform), 1..k = the node's operands in
order (read-only storage), k+1 = the output (read-write storage). Shapes live in meta,
not in the source, so nodes of the same kind share one compiled pipeline.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field

from ..config import Knobs, current
from ..errors import DeviceError
from ..graph.ir import Graph
from ..paths import shader_dir
from .tuning import Tuning


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
    where the device offers them (``engine.runtime.device_capabilities``). ``matmul_split``:
    in f32 on such a device, matmuls multiply each f32 operand as two f16 parts on those
    units, three products accumulating in f32 (``CoopPreset.split``: about 21 bits, where
    torch's fp32 attention runs three TF32 products and its convolutions one). ``tuning``:
    how many workgroups fill the adapter (``meganeura tune``'s, or the defaults).
    """

    subgroups: bool = False
    workgroup_storage: int = 32768   # bytes of workgroup memory a kernel may use (lavapipe: 32 KiB)
    invocations: int = 256           # threads a workgroup may have (WebGPU's least; the H100 offers 1024)
    storage_binding: int = 1 << 27   # bytes one storage binding may span (WebGPU's least)
    dialect: str = field(default_factory=lambda: default_dialect())   # "naga" or "tint"
    matmul_f16: bool = False
    matmul_split: bool = False
    knobs: Knobs = field(default_factory=Knobs)   # choices forced for benchmarks and tests (engine.config)
    tuning: Tuning = field(default_factory=Tuning)

    @classmethod
    def from_features(cls, features, workgroup_storage: int | None = None, dialect: str | None = None,
                      precision: str = "f32", fragments: bool = True, knobs: Knobs | None = None,
                      tuning: Tuning | None = None, invocations: int | None = None,
                      storage_binding: int | None = None) -> "Capabilities":
        """The capabilities a device with these wgpu feature names (this much workgroup
        memory, default 32 KiB, this many threads a workgroup, default 256, and bindings
        up to this many bytes, default 128 MiB) gives, for kernels compiled by
        ``dialect``'s compiler; ``precision`` "f16" takes the
        cooperative-matrix matmul where offered and ``fragments``: the device has the
        fragments the kernels are written for (f16 x f16 -> f32, 16 x 16 x 16, on
        subgroups of 32: ``COOP_FRAGMENT``)."""
        names = {str(f) for f in features}
        dialect = dialect or default_dialect()
        coop = (SUBGROUP_MATRIX_FEATURE in names and "shader-f16" in names and dialect == "tint"
                and fragments)
        return cls(subgroups=bool(names & {"subgroup", "subgroups"}),
                   workgroup_storage=int(workgroup_storage or cls.workgroup_storage),
                   invocations=int(invocations or cls.invocations),
                   storage_binding=int(storage_binding or cls.storage_binding), dialect=dialect,
                   matmul_f16=coop and precision == "f16", matmul_split=coop and precision == "f32",
                   knobs=knobs or Knobs(), tuning=tuning or Tuning())


SUBGROUP_MATRIX_FEATURE = "chromium-experimental-subgroup-matrix"


def default_dialect() -> str:
    """The WGSL dialect of the process's wgpu backend (``MEGANEURA_WGPU``): Tint's for
    Dawn, naga's otherwise; what capabilities written without one compile for."""
    return "tint" if current().wgpu == "dawn" else "naga"


def precision() -> str:
    """The matmul precision asked for: ``MEGANEURA_PRECISION`` ("f32", the default, or
    "f16": f16 operands on the cooperative-matrix units where the device has them)."""
    return current().precision


PLAIN = Capabilities(dialect="naga")   # no subgroups, so nothing dialect-specific; made on import, before the environment is read


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
    # u32 words the kernel keeps from one step to the next in a buffer of its own (its
    # last binding, after the output): a cooperative product's guesses of its scales
    state_words: int = 0
    # "a" or "b": the kernel also adds up that operand's rows (columns) into a binding
    # after its output (the finish's, where split): engine/codegen/product_sums.py
    sums: str = ""


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
    """The WGSL element type of a binding holding a tensor of ``dtype`` (bf16: two to a u32)."""
    return {"i32": "i32", "bf16": "u32"}.get(dtype, "f32")


def stored_load(binding: str, at: str, dtype: str) -> str:
    """WGSL reading element ``at`` of ``binding``, a tensor of ``dtype``, as a number: a bf16
    weight's element through its word (common.wgsl's ``bf16_``)."""
    return f"bf16_({binding}[({at}) >> 1u], {at})" if dtype == "bf16" else f"{binding}[{at}]"


def stored_load4(binding: str, at4: str, dtype: str) -> str:
    """WGSL reading elements 4 at4 .. 4 at4 + 3 of ``binding`` as a vec4<f32>: a binding of
    vec4s, or of a bf16 tensor two words at a time (``stored_type``, common.wgsl's ``bf16x4_``)."""
    return f"bf16x4_({binding}[{at4}])" if dtype == "bf16" else f"{binding}[{at4}]"


def stored_type(wgsl: str, dtype: str) -> str:
    """The binding element type that holds a tensor of ``dtype`` read as ``wgsl`` elements
    ("f32" or "vec4<f32>"): a bf16 tensor's two elements a u32, four a vec2<u32>."""
    if dtype != "bf16":
        return wgsl
    return "vec2<u32>" if wgsl == "vec4<f32>" else "u32"


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


def _thread_xy(default: str, knobs: Knobs) -> str:
    """How a register-blocked kernel numbers its 16 x n thread grid (tx, ty): "rows" puts
    a warp's 32 threads on 16 x 2 of it, "warp" on 8 x 4, so that a warp's vec4 reads of
    its two workgroup-memory tiles touch 8 + 4 distinct vec4s instead of 16 + 2. The
    attention kernels take "warp" (5-11% faster on the H100, run 17); the matmul keeps
    "rows" (no difference beyond noise there). ``knobs.thread_layout``
    (``MEGANEURA_THREAD_LAYOUT``) forces one for every kernel (benchmarks)."""
    layout = knobs.thread_layout or default
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
        subs.setdefault("THREAD_XY", _thread_xy("warp" if archetype == "attention" else "rows", caps.knobs))
    source = _render(template, PRELUDE=prelude, WG_REDUCE=_template(reduce),
                     BINDINGS=_bindings(operand_names, operand_types, out_type), **sg, **subs)
    if enables:
        source = "".join(f"enable {e};\n" for e in dict.fromkeys(enables)) + source
    return Kernel(name, archetype, source, meta, workgroups, n4)


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
