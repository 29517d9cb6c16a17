"""Scheduling a graph into an ``ExecutionPlan``: the whole step, as plain data.

The plan lists every buffer and, per dispatch, its kernel (the WGSL source is stored
once per distinct source in ``kernels``, keyed by a short hash of it), the path the
kernel took on the given ``Capabilities``, its parameter words (``meta``), workgroup
counts and bindings (plan buffer, byte offset, byte size, access). The runtime only
executes it; it serialises to JSON, prints, and is cached on disk. Compiling needs no
GPU: codegen works from the graph and the capabilities alone.

Intermediates whose last reader has run give their memory back to a pool, and later
intermediates of a fitting size take it, so the peak memory of a step is far below the
sum of all its tensors. Both numbers are reported.

A training plan (``optimizer`` given) also holds the optimizer step. Trainable
parameters that share their hyperparameters (LR multiplier, weight decay) form a group:
its parameters live in one arena buffer, each at an ``ALIGN``-aligned offset; their
gradients in a second arena of the same layout, and each optimizer state (momentum,
Adam's m and v) in arenas of that layout too, so one update dispatch covers the group.
Padding between slots is zero and stays zero under every update rule. After the graph:
one dispatch of scaled sum-of-squares partials per gradient arena and one that combines
them into the global gradient norm (for clipping; scaled so it cannot overflow), the
loss copied next to it, then the updates.
"""

from __future__ import annotations
import hashlib
import math
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from .. import codegen
from . import decode_folds
from ..version import __version__
from ..graph.ir import Graph, common_module
from ..graph.ops import OPS, SOURCE, VIEW


PLAN_FORMAT = 3
ALIGN = 256  # storage-buffer offset alignment: a multiple of every adapter's minimum
ARENA_BYTES = 2**27  # WebGPU's default max_storage_buffer_binding_size: any adapter binds an arena this big
READ, READ_WRITE = "read", "read_write"
STATE_NAMES = {"sgd": ("momentum",), "adam": ("m", "v"), "adamw": ("m", "v")}


@dataclass
class Buffer:
    """A device allocation. ``kind`` says who owns it: inputs, parameters, outputs,
    gradients, optimizer state and the training step's stats are pinned for the whole
    step; intermediates are pooled and reused."""

    id: int
    nbytes: int
    kind: str
    names: list[str] = field(default_factory=list)


@dataclass
class Binding:
    """One storage binding of a dispatch (bindings 1.. after the meta uniform): a byte
    range of a plan buffer, read-only or read-write."""

    buffer: int
    offset: int
    size: int
    access: str


@dataclass
class Dispatch:
    """One kernel launch: the graph nodes it runs (none for the optimizer step's
    dispatches, which name their ``group`` and tensors in ``names`` instead), the
    buffers it reads and writes, and everything the runtime needs to launch it.
    ``kernel`` says what it computes, ``module`` where its nodes came from (their
    common module path); ``name`` joins them, as profiles and traces show it."""

    index: int
    kernel: str
    archetype: str
    nodes: list[int]
    elements: int
    key: str = ""
    variant: str = ""
    meta: list[int] = field(default_factory=list)
    workgroups: list[int] = field(default_factory=lambda: [1, 1, 1])
    bindings: list[Binding] = field(default_factory=list)
    group: int | None = None
    names: list[str] = field(default_factory=list)
    module: str = ""

    @property
    def name(self) -> str:
        """``model.layers.3.self_attn:attention``; the bare kernel where there is no module."""
        return qualified_kernel(self.module, self.kernel)

    @property
    def reads(self) -> list[int]:
        """The buffers it binds read-only."""
        return [b.buffer for b in self.bindings if b.access == READ]

    @property
    def writes(self) -> list[int]:
        """The buffers it binds read-write."""
        return [b.buffer for b in self.bindings if b.access == READ_WRITE]


@dataclass
class KernelSource:
    """A distinct kernel of the plan: its WGSL and binding layout (``bindings``: the
    access of each storage binding after the meta uniform of ``meta_bytes``);
    ``guarded`` kernels bounds-check every access themselves (built without naga's checks)."""

    name: str
    archetype: str
    source: str
    bindings: list[str]
    meta_bytes: int
    guarded: bool = False


@dataclass
class ParameterGroup:
    """Parameters updated by one dispatch: same LR multiplier and weight decay. Every
    arena of the group (parameters, gradients, each optimizer state) has the same
    layout: parameter ``parameters[i]`` at byte ``offsets[i]``; ``elements`` f32 in all."""

    parameters: list[str]
    offsets: list[int]
    elements: int
    lr_multiplier: float
    weight_decay: float
    parameter_buffer: int
    gradient_buffer: int
    state_buffers: list[int]

    def offset_of(self, name: str) -> int:
        return self.offsets[self.parameters.index(name)]


@dataclass
class Transfer:
    """A buffer-to-buffer copy recorded right after dispatch ``after``, between compute
    passes (the loss copied next to the gradient norm, where the updates read both)."""

    after: int
    src: int
    src_offset: int
    dst: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class OptimizerSpec:
    """The update rule a training plan compiles in: optimizer kind and shared
    hyperparameters, and per trainable parameter its (LR multiplier, weight decay).
    The learning rate and bias corrections of a step are not here: they change every
    step and are uploaded to the plan's step buffer."""

    kind: str
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_norm: float | None = None
    per_parameter: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config, graph: Graph, names) -> "OptimizerSpec":
        """From an ``engine.train.TrainConfig``; weight decay applies to the parameters
        of ``graph`` whose ``param_meta`` says ``decay``."""
        def decay(name):
            return config.weight_decay if graph.param_meta.get(name, {}).get("decay", False) else 0.0
        return cls(config.optimizer, float(config.momentum), tuple(float(b) for b in config.betas),
                   float(config.eps), config.clip_norm,
                   {n: (config.multiplier(n), float(decay(n))) for n in names})

    def to_dict(self) -> dict:
        return {"kind": self.kind, "momentum": self.momentum, "betas": list(self.betas), "eps": self.eps,
                "clip_norm": self.clip_norm,
                "per_parameter": {k: list(v) for k, v in sorted(self.per_parameter.items())}}


@dataclass
class ExecutionPlan:
    """A graph's step as data. Buffers and dispatches (each with its kernel ``key`` into
    ``kernels``, meta words, workgroups and bindings); where each node's value lives
    (``node_buffer``, ``node_offset``) and the named inputs, parameters, outputs,
    gradients (the buffer the optimizer reads each from) and loss; the capabilities the
    kernels were generated for; for training, the optimizer, its parameter groups, the
    stats and step buffers and the copies between compute passes."""

    graph_hash: str
    engine_version: str
    buffers: list[Buffer]
    dispatches: list[Dispatch]
    node_buffer: dict[int, int]
    inputs: dict[str, int]
    parameters: dict[str, int]
    outputs: dict[str, int]
    gradients: dict[str, int]
    loss_buffer: int | None
    peak_bytes: int
    peak_bytes_without_reuse: int
    node_offset: dict[int, int] = field(default_factory=dict)  # byte offset in its buffer, where not 0
    loss: str | None = None
    kernels: dict[str, KernelSource] = field(default_factory=dict)
    capabilities: dict = field(default_factory=dict)
    optimizer: dict | None = None
    groups: list[ParameterGroup] = field(default_factory=list)
    stats_buffer: int | None = None  # f32: loss, gradient norm, the norm's partials (scale, scaled sum)
    step_buffer: int | None = None   # f32: lr, 1 - b1^t, sqrt(1 - b2^t), first step
    transfers: list[Transfer] = field(default_factory=list)
    format: int = PLAN_FORMAT

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ExecutionPlan":
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {d.get('format')!r} is not {PLAN_FORMAT}")
        d = dict(d)
        d["buffers"] = [Buffer(**b) for b in d["buffers"]]
        d["dispatches"] = [Dispatch(**dict(x, bindings=[Binding(**b) for b in x["bindings"]]))
                           for x in d["dispatches"]]
        d["node_buffer"] = {int(k): v for k, v in d["node_buffer"].items()}
        d["node_offset"] = {int(k): v for k, v in d["node_offset"].items()}
        d["kernels"] = {k: KernelSource(**v) for k, v in d["kernels"].items()}
        d["groups"] = [ParameterGroup(**g) for g in d["groups"]]
        d["transfers"] = [Transfer(**t) for t in d["transfers"]]
        return cls(**d)

    def place(self, node_id: int) -> tuple[int, int]:
        """(buffer, byte offset) of a node's value."""
        return self.node_buffer[node_id], self.node_offset.get(node_id, 0)

    def summary(self) -> str:
        mib = lambda n: f"{n / 2**20:.2f} MiB"
        groups = f", {len(self.groups)} parameter groups" if self.optimizer else ""
        return (f"{len(self.dispatches)} dispatches of {len(self.kernels)} kernels, {len(self.buffers)} buffers"
                f"{groups}, peak {mib(self.peak_bytes)} with reuse ({mib(self.peak_bytes_without_reuse)} without)")

    def describe_dispatch(self, d: Dispatch) -> str:
        """One line: kernel, variant, workgroups, then what it runs and touches."""
        variant = f" ({d.variant})" if d.variant else ""
        if d.nodes:
            what = f"nodes {d.nodes}"
        elif d.group is not None:
            what = f"group {d.group}: {', '.join(d.names)}"
        else:
            what = ", ".join(d.names)
        return (f"#{d.index} {d.name} [{d.archetype}]{variant} wg {'x'.join(map(str, d.workgroups))} "
                f"{what} reads {d.reads} writes {d.writes}")

    def __str__(self) -> str:
        lines = [f"plan {self.graph_hash[:12]}: {self.summary()}"]
        if self.capabilities:
            paths = self.capabilities.get("paths", {})
            lines.append("  paths: " + "; ".join(f"{k} {v}" for k, v in paths.items()))
        lines += ["  " + self.describe_dispatch(d) for d in self.dispatches]
        return "\n".join(lines)


def _aligned(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def _kernel_name(graph: Graph, node) -> str:
    key = [node.op] + [f"{k}={v}" for k, v in sorted(node.attrs.items())
                       if k in ("transpose_a", "transpose_b", "activation", "causal", "approximate")]
    return ":".join(str(k) for k in key)


def qualified_kernel(module: str, kernel: str) -> str:
    """A kernel's name prefixed with the module its nodes came from."""
    return f"{module}:{kernel}" if module else kernel


def kernel_key(source: str) -> str:
    """A short hash of a kernel's WGSL: dispatches with the same source share a pipeline."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def kernel_variant(kernel: codegen.Kernel) -> str:
    """The path a kernel took: codegen's note (matmul tiles, ...), else for kernels built
    on the workgroup reduction helpers which reduction they got (codegen picks it in
    the generated source, from the capabilities)."""
    if kernel.notes.get("variant"):
        return str(kernel.notes["variant"])
    if "fn wg_sum" in kernel.source:
        return "subgroup reduction" if "subgroupAdd" in kernel.source else "workgroup-memory reduction"
    return ""


def capabilities_dict(caps: codegen.Capabilities) -> dict:
    return {**asdict(caps), "paths": codegen.describe_paths(caps)}


def storage_roots(graph: Graph) -> dict[int, int]:
    """A view (reshape, part) and an in-place op (``cache_write``) share their first
    operand's storage: each node's storage root."""
    root = {}
    for n in graph.nodes:
        root[n.id] = root[n.inputs[0]] if OPS[n.op].archetype == VIEW or OPS[n.op].inplace else n.id
    return root


def part_offsets(graph: Graph) -> dict[int, int]:
    """The nodes whose value is a part of their storage root's (a ``part`` of a packed
    result, and views of one), with the element offset where it starts there."""
    within: dict[int, int] = {}
    for n in graph.nodes:
        if n.op == "part":
            within[n.id] = within.get(n.inputs[0], 0) + n.attrs["offset"]
        elif OPS[n.op].archetype == VIEW and n.inputs[0] in within:
            within[n.id] = within[n.inputs[0]]
    return within


# ---------------------------------------------------------------- the builder

class _PlanBuilder:
    """Buffers, placements and dispatches of a plan being compiled. ``storage`` maps a
    storage root to (buffer, byte offset, byte extent); ``within`` a part of one to its
    element offset there."""

    def __init__(self, graph: Graph, caps: codegen.Capabilities):
        self.graph, self.caps = graph, caps
        self.root = storage_roots(graph)
        self.within = part_offsets(graph)
        self.buffers: list[Buffer] = []
        self.storage: dict[int, tuple[int, int, int]] = {}
        self.dispatches: list[Dispatch] = []
        self.kernels: dict[str, KernelSource] = {}

    def new_buffer(self, nbytes: int, kind: str, names=()) -> int:
        self.buffers.append(Buffer(len(self.buffers), _aligned(nbytes), kind, list(names)))
        return self.buffers[-1].id

    def whole(self, buffer: int) -> tuple[int, int, int]:
        return buffer, 0, self.buffers[buffer].nbytes

    def place(self, node_id: int, buffer: int, offset: int = 0, extent: int | None = None) -> None:
        self.storage[self.root[node_id]] = (buffer, offset, self.buffers[buffer].nbytes if extent is None else extent)

    def slot_of(self, node_id: int) -> tuple[int, int, int]:
        """(buffer, byte offset, byte extent) of a node's value: its root's slot, or for a
        part the bytes of the part."""
        buffer, offset, extent = self.storage[self.root[node_id]]
        if node_id in self.within:
            return buffer, offset + 4 * self.within[node_id], self.graph[node_id].nbytes
        return buffer, offset, extent

    def dispatch(self, kernel: codegen.Kernel, name: str, bindings: list[tuple[int, int, int]], access: list[str],
                 elements: int, nodes=(), group: int | None = None, names=()) -> Dispatch:
        """Add a dispatch of ``kernel`` over ``bindings`` (buffer, offset, size), each
        read-only or read-write as ``access`` says."""
        key = kernel_key(kernel.source)
        self.kernels.setdefault(key, KernelSource(kernel.name, kernel.archetype, kernel.source, list(access),
                                                  kernel.meta_vec4 * 16, kernel.guarded))
        binds = [Binding(b, off, size, a) for (b, off, size), a in zip(bindings, access)]
        module = common_module(m for i in nodes for m in self.graph[i].modules)
        d = Dispatch(len(self.dispatches), name, kernel.archetype, list(nodes), int(elements), key,
                     kernel_variant(kernel), [int(w) & 0xFFFFFFFF for w in kernel.meta],
                     [int(w) for w in kernel.workgroups], binds, group, list(names), module)
        self.dispatches.append(d)
        return d


# ---------------------------------------------------------------- parameter groups

def _slot_bytes(graph: Graph, parameter: str) -> int:
    """The bytes a parameter's slot takes in each arena of its group."""
    return _aligned(graph[graph.parameters[parameter]].nbytes)


def _group_parameters(graph: Graph, spec: OptimizerSpec, names: list[str]) -> list[list[str]]:
    """Parameters with the same (LR multiplier, weight decay), in ``names`` order; a
    group whose arena would pass ``ARENA_BYTES`` continues in another."""
    by_hyper: dict[tuple, list[list[str]]] = {}
    for name in names:
        chunks = by_hyper.setdefault(tuple(spec.per_parameter[name]), [[]])
        used = sum(_slot_bytes(graph, p) for p in chunks[-1])
        if chunks[-1] and used + _slot_bytes(graph, name) > ARENA_BYTES:
            chunks.append([])
        chunks[-1].append(name)
    return [chunk for chunks in by_hyper.values() for chunk in chunks]


def _direct_gradients(b: _PlanBuilder, gradients: dict[str, str], arena_of: dict[str, int]) -> set[str]:
    """The parameters whose gradient node can be computed right in its arena slot: a
    node the step computes (not a source), the gradient of that parameter only and of
    no other output, whose kernel reads nothing in the same gradient arena (one
    dispatch cannot bind a buffer both read-only and read-write). The others get a copy."""
    g, root = b.graph, b.root
    grad_root = {p: root[g.outputs[o]] for p, o in gradients.items()}
    owners = Counter(grad_root.values())
    gradient_names = set(gradients.values())
    other_outputs = {root[i] for name, i in g.outputs.items() if name not in gradient_names}
    placed: dict[int, int] = {}  # storage root -> gradient arena it was computed in
    direct = set()
    for p in sorted(arena_of, key=lambda p: grad_root[p]):  # node order: inputs are decided first
        r = grad_root[p]
        node = g[r]
        if OPS[node.op].archetype == SOURCE or owners[r] > 1 or r in other_outputs:
            continue
        grad = g[g.outputs[gradients[p]]]
        if b.within.get(grad.id, 0) or grad.size != node.size:   # a part of a packed result that holds more
            continue
        if any(placed.get(root[i]) == arena_of[p] for i in node.inputs):
            continue
        placed[r] = arena_of[p]
        direct.add(p)
    return direct


def _place_groups(b: _PlanBuilder, spec: OptimizerSpec, gradients: dict[str, str]) -> list[ParameterGroup]:
    """Arenas for each group's parameters, gradients and optimizer state; each
    parameter, and each gradient computed in place, is placed at its slot."""
    g = b.graph
    groups = []
    packs = _packed_gradients(b, gradients)
    for names in _group_parameters(g, spec, _arena_order(list(gradients), packs)):
        offsets, total = [], 0
        for name in names:
            offsets.append(total)
            total += _slot_bytes(g, name)
        params = b.new_buffer(total, "parameter", names)
        grads = b.new_buffer(total, "gradient", [gradients[n] for n in names])
        states = [b.new_buffer(total, "optimizer_state", [f"{n}:{s}" for n in names])
                  for s in STATE_NAMES[spec.kind] if spec.kind != "sgd" or spec.momentum]
        mult, decay = spec.per_parameter[names[0]]
        groups.append(ParameterGroup(list(names), offsets, total // 4, float(mult), float(decay), params, grads, states))
        for name, off in zip(names, offsets):
            b.place(g.parameters[name], params, off, _slot_bytes(g, name))
    group_of = {n: grp for grp in groups for n in grp.parameters}
    for p in _direct_gradients(b, gradients, {n: grp.gradient_buffer for n, grp in group_of.items()}):
        grp = group_of[p]
        b.place(g.outputs[gradients[p]], grp.gradient_buffer, grp.offset_of(p), _slot_bytes(g, p))
    for pack in packs:
        grp = group_of[pack[0]]
        start = grp.offset_of(pack[0])
        r = b.root[g.outputs[gradients[pack[0]]]]
        if all(group_of[p] is grp and grp.offset_of(p) == start + 4 * b.within[g.outputs[gradients[p]]]
               for p in pack) and not any(b.storage.get(b.root[i], (None,))[0] == grp.gradient_buffer
                                          for i in g[r].inputs):
            b.place(r, grp.gradient_buffer, start, g[r].nbytes)
    return groups


def _packed_gradients(b: _PlanBuilder, gradients: dict[str, str]) -> list[list[str]]:
    """Parameters whose gradients are parts of one result that they fill exactly, in
    part order, each a whole slot (``engine.optimize.stacked_products`` computes q's, k's
    and v's weight gradients as one product): placed side by side in their group's
    gradient arena, that result is computed right there instead of copied part by part.
    A result that is also another output, or holds more than those gradients, is left out."""
    g, root = b.graph, b.root
    gradient_names = set(gradients.values())
    other_outputs = {root[i] for name, i in g.outputs.items() if name not in gradient_names}
    by_root: dict[int, list[tuple[int, str]]] = {}
    for p, o in gradients.items():
        if g.outputs[o] in b.within:
            by_root.setdefault(root[g.outputs[o]], []).append((b.within[g.outputs[o]], p))
    packs = []
    for r, parts in by_root.items():
        parts.sort()
        at = 0
        for offset, p in parts:
            if 4 * offset != at or _slot_bytes(g, p) != g[g.parameters[p]].nbytes:
                break
            at += _slot_bytes(g, p)
        else:
            if at == g[r].nbytes and len(parts) > 1 and r not in other_outputs:
                packs.append([p for _, p in parts])
    return packs


def _arena_order(names: list[str], packs: list[list[str]]) -> list[str]:
    """``names`` with each pack's parameters together, in part order, where its first came."""
    pack_of = {p: pack for pack in packs for p in pack}
    out, seen = [], set()
    for n in names:
        for p in pack_of.get(n, [n]):
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


# ---------------------------------------------------------------- pinned tensors and the graph

def _pinned(graph: Graph) -> dict[int, tuple[str, str]]:
    """Nodes that live for the whole step, with their kind and name."""
    pinned: dict[int, tuple[str, str]] = {}
    for name, i in graph.inputs.items():
        pinned[i] = ("input", name)
    for name, i in graph.parameters.items():
        pinned[i] = ("parameter", name)
    for name, i in graph.outputs.items():
        pinned.setdefault(i, ("output", name))
    for i in graph.constants:
        pinned.setdefault(i, ("constant", f"const%{i}"))
    return pinned


def _place_pinned(b: _PlanBuilder, pinned: dict[int, tuple[str, str]]) -> None:
    """Own buffers for the pinned nodes that have no place yet; a node sharing storage
    with a placed one (a view, the same node under two names) adds its name there."""
    for i, (kind, name) in pinned.items():
        if b.root[i] in b.storage:
            names = b.buffers[b.storage[b.root[i]][0]].names
            if name not in names:
                names.append(name)
        else:
            b.place(i, b.new_buffer(b.graph[b.root[i]].nbytes, kind, [name]))


def _first_axis_concat(g, n) -> bool:
    """A concat along its first axis (every axis before the joined one of extent 1) of
    operands of its own dtype (not bf16 weights it widens): its operands' bytes lie one
    after the other in its result."""
    return (n.op == "concat" and math.prod(n.shape[:n.attrs["axis"] % len(n.shape)]) == 1
            and all(g[i].dtype == n.dtype for i in n.inputs))


def _pack_concatenated(b: _PlanBuilder, pinned: dict[int, tuple[str, str]]) -> None:
    """Parameters and constants that a first-axis concat joins whole, placed side by side
    in one buffer in its order, so that the concat is a view of them
    (``_concats_in_place``) instead of a copy a call: an inference graph's stacked q/k/v
    weights and biases (engine.optimize.stacked_products; a training plan's parameters
    lie in its groups' arenas already). Each but the last must fill whole ``ALIGN``
    slots, and none may have a place yet (a parameter in two such concats joins the
    first)."""
    g, root = b.graph, b.root
    for n in (n for n in g.nodes if _first_axis_concat(g, n)):
        roots = [root[i] for i in n.inputs]
        whole = all(r in pinned and pinned[r][0] in ("parameter", "constant") and g[i].size == g[r].size
                    and i not in b.within for i, r in zip(n.inputs, roots))
        if (not whole or len(set(roots)) != len(roots) or any(r in b.storage for r in roots)
                or any(g[r].nbytes % ALIGN for r in roots[:-1])):
            continue
        buffer = b.new_buffer(sum(g[r].nbytes for r in roots), "parameter", [pinned[r][1] for r in roots])
        offset = 0
        for r in roots:
            b.place(r, buffer, offset, g[r].nbytes)
            offset += g[r].nbytes


def _schedule_graph(b: _PlanBuilder, pinned_roots: set[int], overlap: bool = False) -> int:
    """One dispatch per computed node, in order, each intermediate taking a free pooled
    buffer that fits; returns the bytes the intermediates would take without reuse.

    With ``overlap``, a dispatch that reads nothing its predecessor wrote gets buffers
    of its own instead: it could run beside its predecessor, but writing a buffer used
    earlier in the step needs a barrier, which waits for all work before it (run 16:
    whisper-tiny inference 2.81 -> 2.67 ms with no reuse at all and 2.68 ms with this
    rule, for 63 -> 74 MiB; training 2% faster for 27% more memory, so only inference
    plans take it)."""
    g, root = b.graph, b.root
    live = g.live_nodes() | set(g.inputs.values()) | set(g.parameters.values())
    order = [n for n in g.nodes if n.id in live and OPS[n.op].archetype not in (SOURCE, VIEW)]
    position = {n.id: i for i, n in enumerate(order)}
    first_reader = _first_readers(g, position, len(order))
    summed = _products_with_sums(b, order, position, first_reader)
    paired = _norm_gradient_pairs(b, order, position, first_reader)
    scored, order = _dq_from_scores(b, order)
    writing = decode_folds.cache_writes_in_attention(g, b.caps, order)
    combining = decode_folds.combines_in_products(g, b.caps, order)
    products = {p: kernel for p, kernel in combining.values()}
    best = {a: f for a, f in decode_folds.argmax_from_products(g, b.caps, order).items() if f[0] not in products}
    leaving = {p: (kernel, a) for a, (p, kernel, _) in best.items()}   # the products that leave an argmax their best
    parts: dict[int, tuple[int, int, int]] = {}   # product (argmax) -> the scratch of its attention's parts (best)
    held: dict[int, tuple[int, int, int]] = {}   # attention_grad_q -> the scores its dkdv wrote
    in_place = _concats_in_place(b, order)
    pinned_roots = pinned_roots | in_place   # they lie over parameters: never the pool's
    # no dispatch of their own
    computed_beside = (in_place | {s for s, _ in summed.values()} | {p for p, _ in paired.values()}
                       | {w for w, _ in writing.values()})
    order = [n for n in order if n.id not in computed_beside]
    last_use: dict[int, int] = {}
    for step, n in enumerate(order):
        for i in (*n.inputs, *(g[writing[n.id][0]].inputs if n.id in writing else ())):
            last_use[root[i]] = step
    free: list[int] = []
    without_reuse = 0
    for step, n in enumerate(order):
        fresh = overlap and step > 0 and root[order[step - 1].id] not in {root[i] for i in n.inputs}
        beside = summed.get(n.id) or paired.get(n.id)
        for m in [n] + ([g[beside[0]]] if beside else []):
            if root[m.id] not in b.storage and m.id not in combining:   # a combined attention's value is never stored
                size = _aligned(m.nbytes)
                without_reuse += size
                b.place(m.id, _pooled_buffer(b, free, size, fresh))
        if n.id in scored:
            _dispatch_scored(b, n, scored[n.id], free, held)
        elif n.id in paired:
            _dispatch_norm_pair(b, n, paired[n.id], free, fresh)
        elif n.id in combining:
            parts[combining[n.id][0]] = _dispatch_attention_parts(b, n, writing.get(n.id), free, fresh)
        elif n.id in products:
            scratch = parts.pop(n.id)
            _dispatch_node(b, n, free, fresh, kernel=products[n.id], a_slot=scratch)
            free.append(scratch[0])
        elif n.id in leaving:
            kernel, a = leaving[n.id]
            parts[a] = (_pooled_buffer(b, free, _aligned(8 * kernel.workgroups[0]), fresh), 0, 8 * kernel.workgroups[0])
            _dispatch_node(b, n, free, fresh, kernel=kernel, after=parts[a])
        elif n.id in best:
            _dispatch_node(b, n, free, fresh, kernel=best[n.id][2], a_slot=parts[n.id])
            free.append(parts.pop(n.id)[0])
        elif n.id in writing:
            _dispatch_attention_writing(b, n, writing[n.id], free, fresh)
        else:
            _dispatch_node(b, n, free, fresh, summed.get(n.id))
        for r in {root[i] for i in n.inputs}:   # two views of one storage (parts of a packed result) free it once
            if r not in pinned_roots and last_use.get(r) == step and r in b.storage:
                free.append(b.storage[r][0])
        if root[n.id] == n.id and n.id not in pinned_roots and n.id not in last_use:
            free.append(b.storage[n.id][0])
    return without_reuse


def _pooled_buffer(b: _PlanBuilder, free: list[int], size: int, fresh: bool = False) -> int:
    """The smallest free pooled buffer of at least ``size`` bytes (taken from ``free``);
    where none is that large, the largest free one grown to ``size`` (sizes are only
    fixed when the plan is done, and the tensors it held before still fit), so a larger
    tensor does not leave a smaller free buffer idle beside a new one; with none free,
    or ``fresh`` (a buffer untouched so far in the step), a new buffer.
    ``knobs.pool`` off (``MEGANEURA_POOL=0``) gives every tensor a buffer of its own (an
    experiment: does reuse put barriers between dispatches that could overlap?)."""
    if fresh or not free or not b.caps.knobs.pool:
        return b.new_buffer(size, "intermediate")
    fits = [buf for buf in free if b.buffers[buf].nbytes >= size]
    size_of = lambda buf: b.buffers[buf].nbytes  # noqa: E731
    best = min(fits, key=size_of) if fits else max(free, key=size_of)
    b.buffers[best].nbytes = max(b.buffers[best].nbytes, _aligned(size))
    free.remove(best)
    return best


def _dispatch_node(b: _PlanBuilder, n, free: list[int], fresh: bool = False, sums=None,
                   kernel: codegen.Kernel | None = None, a_slot: tuple[int, int, int] | None = None,
                   after: tuple[int, int, int] | None = None) -> None:
    """The dispatch that computes node ``n``; for a kernel with a finishing stage (a
    reduction or an attention split over many workgroups), two: into a scratch buffer
    from the pool (a new one if ``fresh``), then from it (the scratch goes back to the
    pool). ``sums`` (``_products_with_sums``): the node whose value n's kernel also
    computes, and that kernel; its binding follows the output. ``kernel`` and ``a_slot``
    (``decode_folds.combines_in_products``): n's kernel, bound to that slot in its first operand's place;
    ``after``: a slot it also writes, bound after the output (``decode_folds.argmax_from_products``)."""
    kernel = kernel or (codegen.kernel_for(b.graph, n, b.caps) if sums is None else sums[1])
    beside = [] if sums is None else [b.slot_of(sums[0])]
    nodes = [n.id] + ([] if sums is None else [sums[0]])
    operands = n.inputs[1:] if OPS[n.op].inplace else n.inputs  # an in-place op's first is its output
    name = _kernel_name(b.graph, n)
    inputs = [a_slot if j == 0 and a_slot else b.slot_of(i) for j, i in enumerate(operands)]
    reads = [READ] * len(inputs)
    # state the kernel keeps across steps (a cooperative product's scales): its own buffer, never pooled
    state = [b.whole(b.new_buffer(4 * kernel.state_words, "kernel_state", [f"{name}: f16 scales"]))
             ] if kernel.state_words else []
    if kernel.finish is None:
        outs = [b.slot_of(n.id)] + beside + ([after] if after else []) + state
        b.dispatch(kernel, name, inputs + outs, reads + [READ_WRITE] * len(outs), n.size, nodes=nodes)
        return
    buffer = _pooled_buffer(b, free, _aligned(4 * kernel.partials), fresh)
    scratch = (buffer, 0, 4 * kernel.partials)
    b.dispatch(kernel, name, inputs + [scratch] + state, reads + [READ_WRITE] * (1 + len(state)), kernel.partials,
               nodes=nodes)
    extra = [inputs[i] for i in kernel.finish_operands]
    b.dispatch(kernel.finish, f"{name}:total", [scratch, *extra, b.slot_of(n.id), *beside],
               [READ] * (1 + len(extra)) + [READ_WRITE] * (1 + len(beside)), n.size, nodes=nodes)
    free.append(buffer)


def _norm_gradient_pairs(b: _PlanBuilder, order: list, position: dict[int, int],
                         first_reader) -> dict[int, tuple[int, codegen.Kernel]]:
    """One norm's input gradient and parameter gradients (codegen's ``norm_gradients``)
    from one kernel, dispatched where the ``norm_grad`` is, where nothing reads the
    ``norm_param_grad`` before (``first_reader``: ``_first_readers`` of ``order``'s
    ``position``s). Returns norm_grad -> (its norm_param_grad, the kernel)."""
    g = b.graph
    grads = {tuple(n.inputs[:2]): n for n in order if n.op == "norm_grad"}
    found = {}
    for p in order:
        q = grads.get(tuple(p.inputs)) if p.op == "norm_param_grad" else None
        if q is not None and q.id not in found and codegen.norm_gradients(q, p) and first_reader(p.id) > position[q.id]:
            found[q.id] = (p.id, codegen.norm_gradients_kernel(g, q, p, b.caps))
    return found


def _first_readers(g: Graph, position: dict[int, int], end: int):
    """first_reader(i): the position of the first dispatch reading node i (through views;
    ``end`` where none does)."""
    users = g.users()

    def first_reader(i: int) -> int:
        return min((first_reader(u) if OPS[g[u].op].archetype == VIEW else position.get(u, end)
                    for u in users[i]), default=end)
    return first_reader


def _dispatch_norm_pair(b: _PlanBuilder, n, pair: tuple[int, codegen.Kernel], free: list[int], fresh: bool) -> None:
    """A ``_norm_gradient_pairs`` dispatch: norm_grad ``n``'s operands, the parameter
    gradients' sums (their slot, or a pooled scratch of the chunks' partials that a second
    dispatch adds up into it) and n's value."""
    params, kernel = pair
    name, nodes = _kernel_name(b.graph, n), [n.id, params]
    inputs = [b.slot_of(i) for i in n.inputs]
    reads = [READ] * len(inputs)
    if kernel.finish is None:
        b.dispatch(kernel, name, inputs + [b.slot_of(params), b.slot_of(n.id)], reads + [READ_WRITE] * 2,
                   n.size, nodes=nodes)
        return
    buffer = _pooled_buffer(b, free, _aligned(4 * kernel.partials), fresh)
    scratch = (buffer, 0, 4 * kernel.partials)
    b.dispatch(kernel, name, inputs + [scratch, b.slot_of(n.id)], reads + [READ_WRITE] * 2, kernel.partials,
               nodes=nodes)
    b.dispatch(kernel.finish, f"{name}:total", [scratch, b.slot_of(params)], [READ, READ_WRITE],
               b.graph[params].size, nodes=[params])
    free.append(buffer)


def _dq_from_scores(b: _PlanBuilder, order: list) -> tuple[dict[int, tuple[int, codegen.Kernel, int]], list]:
    """attention_grad_kv and attention_grad_q pairs of the same operands where kv's kernel
    also writes dS and dq is a product of it (codegen's scores_pair); a dq before its kv,
    with nothing between them reading it, moves to just after the kv. Returns each of the
    two -> (its partner, its kernel, the scores' bytes), and the order."""
    g = b.graph
    found: dict[int, tuple[int, codegen.Kernel, int]] = {}
    by_op = {op: {n.inputs: n for n in order if n.op == op} for op in ("attention_grad_kv", "attention_grad_q")}
    for operands, kv in by_op["attention_grad_kv"].items():
        q = by_op["attention_grad_q"].get(operands)
        pair = None if q is None else codegen.scores_pair(g, kv, q, b.caps)
        if pair is None:
            continue
        at_q, at_kv = order.index(q), order.index(kv)
        if at_q < at_kv:
            readers = g.live_nodes([n.id for n in order[at_q + 1:at_kv + 1]])   # what they read, through views
            if q.id in readers:
                continue
            order = order[:at_q] + order[at_q + 1:at_kv + 1] + [q] + order[at_kv + 1:]
        found[kv.id], found[q.id] = (q.id, pair[0], pair[2]), (kv.id, pair[1], pair[2])
    return found, order


def _dispatch_scored(b: _PlanBuilder, n, pair: tuple[int, codegen.Kernel, int], free: list[int],
                     held: dict[int, tuple[int, int, int]]) -> None:
    """A ``_dq_from_scores`` node's dispatch: the kv's binds its operands, its output and
    a pooled scratch for the scores (held for the dq); the dq's binds k, the scores (then
    back to the pool) and its output."""
    partner, kernel, nbytes = pair
    name = _kernel_name(b.graph, n)
    if n.op == "attention_grad_kv":
        held[partner] = scores = (_pooled_buffer(b, free, nbytes), 0, nbytes)
        b.dispatch(kernel, name, [b.slot_of(i) for i in n.inputs] + [b.slot_of(n.id), scores],
                   [READ] * len(n.inputs) + [READ_WRITE] * 2, n.size, nodes=[n.id])
        return
    scores = held.pop(n.id)
    b.dispatch(kernel, name, [b.slot_of(n.inputs[1]), scores, b.slot_of(n.id)], [READ, READ, READ_WRITE], n.size,
               nodes=[n.id])
    free.append(scores[0])


def _attention_operands(b: _PlanBuilder, n, write: int | None):
    """(read slots, the cache planes it writes, nodes) of cached attention ``n``'s dispatch,
    which does ``write`` (a cache_write, ``decode_folds.cache_writes_in_attention``) where one is given:
    q, the positions, the step's keys and values, then the cache's two planes read-write."""
    if write is None:
        return [b.slot_of(i) for i in n.inputs], [], [n.id]
    reads = [b.slot_of(i) for i in (n.inputs[0], n.inputs[3], *b.graph[write].inputs[1:3])]
    return reads, [b.slot_of(i) for i in n.inputs[1:3]], [n.id, write]


def _dispatch_attention_parts(b: _PlanBuilder, n, pair: tuple[int, codegen.Kernel] | None, free: list[int],
                              fresh: bool) -> tuple[int, int, int]:
    """The first stage of split cached attention ``n`` (doing ``pair``'s cache write where
    given), into a pooled scratch of its parts; returns the scratch."""
    write, kernel = pair if pair else (None, codegen.kernel_for(b.graph, n, b.caps))
    buffer = _pooled_buffer(b, free, _aligned(4 * kernel.partials), fresh)
    scratch = (buffer, 0, 4 * kernel.partials)
    _dispatch_attention(b, n, write, kernel, scratch, kernel.partials)
    return scratch


def _dispatch_attention(b: _PlanBuilder, n, write: int | None, kernel: codegen.Kernel,
                        out: tuple[int, int, int], elements: int) -> None:
    """Cached attention ``n``'s (first) dispatch of ``kernel`` into ``out`` (``_attention_operands``)."""
    reads, planes, nodes = _attention_operands(b, n, write)
    b.dispatch(kernel, _kernel_name(b.graph, n), reads + [out] + planes,
               [READ] * len(reads) + [READ_WRITE] * (1 + len(planes)), elements, nodes=nodes)


def _dispatch_attention_writing(b: _PlanBuilder, n, pair: tuple[int, codegen.Kernel], free: list[int],
                                fresh: bool) -> None:
    """A ``decode_folds.cache_writes_in_attention`` dispatch: the attention's operands and value and
    the cache's two planes (``_attention_operands``); where it splits, its parts into a
    pooled scratch that a second dispatch combines into the value."""
    write, kernel = pair
    if kernel.finish is None:
        _dispatch_attention(b, n, write, kernel, b.slot_of(n.id), n.size)
        return
    scratch = _dispatch_attention_parts(b, n, pair, free, fresh)
    b.dispatch(kernel.finish, f"{_kernel_name(b.graph, n)}:total", [scratch, b.slot_of(n.id)], [READ, READ_WRITE],
               n.size, nodes=[n.id, write])
    free.append(scratch[0])


def _concats_in_place(b: _PlanBuilder, order: list) -> set[int]:
    """Concats that need no copy: along their first axis (``_first_axis_concat``), of
    parameters whose slots lie one after the other in one arena, as a
    group's do where their gradients are parts of one result (the stacked q/k/v weights,
    engine.optimize.stacked_products), or as ``_pack_concatenated`` places parameters and
    constants. Each is placed over those slots; returns them."""
    g, root = b.graph, b.root
    params = set(g.parameters.values()) | set(g.constants)
    found = set()
    for n in (n for n in order if _first_axis_concat(g, n)):
        slots = [b.storage.get(root[i]) if root[i] in params and g[i].size == g[root[i]].size
                 and not b.within.get(i) else None for i in n.inputs]
        if None in slots or len({buf for buf, _, _ in slots}) != 1:
            continue
        ends = [off + g[i].nbytes for (_, off, _), i in zip(slots, n.inputs)]
        if all(end == nxt for end, (_, nxt, _) in zip(ends, slots[1:])):
            b.place(n.id, slots[0][0], slots[0][1], n.nbytes)
            found.add(n.id)
    return found


def _products_with_sums(b: _PlanBuilder, order: list, position: dict[int, int],
                        first_reader) -> dict[int, tuple[int, codegen.Kernel]]:
    """Bias gradients computed by their weight gradient's product: a ``sum_to`` of a
    tensor over all its leading axes, where a transposed-A product (dᵀ x or xᵀ d) reads
    that same tensor whole as an operand, and nothing reads the sum before the product
    runs. Its kernel adds the operand up as it fetches it (engine/codegen/product_sums.py)
    where it can (``first_reader`` as for ``_norm_gradient_pairs``). Returns product ->
    (sum node, the product's kernel)."""
    g, within = b.graph, b.within

    def value(i: int) -> int:   # the node whose value i views
        while OPS[g[i].op].archetype == VIEW:
            i = g[i].inputs[0]
        return i

    whole = lambda i: within.get(i, 0) == 0 and g[i].size == g[value(i)].size   # noqa: E731
    sums_of: dict[int, list[int]] = {}
    for n in order:
        x = n.inputs[0] if n.op == "sum_to" else None
        if x is not None and n.shape == g.shape(x)[-1:] and len(g.shape(x)) >= 2 and whole(x):
            sums_of.setdefault(value(x), []).append(n.id)
    found: dict[int, tuple[int, codegen.Kernel]] = {}
    taken: set[int] = set()
    for p in order:
        if p.op != "matmul" or not p.attrs["transpose_a"] or p.attrs["transpose_b"] or len(p.shape) != 2:
            continue
        for operand, i in zip("ab", p.inputs[:2]):
            for s in sums_of.get(value(i), []) if whole(i) else []:
                if s in taken or g[s].size != g.shape(i)[-1] or first_reader(s) <= position[p.id]:
                    continue
                kernel = codegen.kernel_for(g, p, b.caps, sums=operand)
                if kernel.sums:
                    found[p.id] = (s, kernel)
                    taken.add(s)
                    break
            if p.id in found:
                break
    return found


# ---------------------------------------------------------------- the optimizer step

def _gradient_copies(b: _PlanBuilder, gradients: dict[str, str], groups: list[ParameterGroup]) -> None:
    """A copy into its slot for each gradient not computed there."""
    g = b.graph
    for gi, grp in enumerate(groups):
        for name, off in zip(grp.parameters, grp.offsets):
            node = g[g.outputs[gradients[name]]]
            source, slot = b.slot_of(node.id), (grp.gradient_buffer, off, _slot_bytes(g, name))
            if source[:2] != slot[:2]:
                b.dispatch(codegen.gradient_copy_kernel(node.size), "copy:gradient", [source, slot],
                           [READ, READ_WRITE], node.size, group=gi, names=[gradients[name]])


def _gradient_norm(b: _PlanBuilder, groups: list[ParameterGroup]) -> tuple[int, Dispatch]:
    """Norm partials (two slots each) of each gradient arena into a new stats buffer
    (after its loss and norm slots), then the norm; returns (stats buffer, the norm's dispatch)."""
    partials = [codegen.norm_partials(grp.elements) for grp in groups]
    stats = b.new_buffer(4 * (2 + 2 * sum(partials)), "stats", ["loss, gradient norm"])
    slot = 2
    for gi, (grp, count) in enumerate(zip(groups, partials)):
        b.dispatch(codegen.sum_squares_kernel(grp.elements, slot), "train:sum_squares",
                   [b.whole(grp.gradient_buffer), b.whole(stats)], [READ, READ_WRITE], grp.elements,
                   group=gi, names=grp.parameters)
        slot += 2 * count
    total = b.dispatch(codegen.norm_total_kernel(sum(partials)), "train:norm_total", [b.whole(stats)],
                       [READ_WRITE], sum(partials), names=["gradient norm"])
    return stats, total


def _updates(b: _PlanBuilder, spec: OptimizerSpec, groups: list[ParameterGroup], stats: int) -> int:
    """One in-place update per group (a rule with fewer than two states binds unused
    buffers in their place, one each: WebGPU forbids two writable bindings of one range,
    and Dawn checks it); returns the step buffer they read the step's values from."""
    step = b.new_buffer(16, "step", ["lr, bias corrections"])
    missing = 2 - min((len(grp.state_buffers) for grp in groups), default=2)
    unused = [b.new_buffer(16, "unused", ["optimizer state of a rule without one"]) for _ in range(missing)]
    for gi, grp in enumerate(groups):
        states = grp.state_buffers + unused[:2 - len(grp.state_buffers)]
        kernel = codegen.optimizer_kernel(grp.elements, spec.kind, grp.lr_multiplier, grp.weight_decay,
                                          spec.momentum, spec.betas, spec.eps, spec.clip_norm)
        reads = [grp.gradient_buffer, stats, step]
        writes = [grp.parameter_buffer, *states]
        b.dispatch(kernel, f"train:{spec.kind}", [b.whole(x) for x in reads + writes],
                   [READ] * len(reads) + [READ_WRITE] * len(writes), grp.elements, group=gi, names=grp.parameters)
    return step


def _optimizer_step(b: _PlanBuilder, spec: OptimizerSpec, gradients: dict[str, str], groups: list[ParameterGroup],
                    loss_node: int | None) -> tuple[int, int, list[Transfer]]:
    """Gradient copies, the gradient norm, the loss copied next to it, the updates;
    returns (stats buffer, step buffer, transfers)."""
    _gradient_copies(b, gradients, groups)
    stats, total = _gradient_norm(b, groups)
    transfers = []
    if loss_node is not None:
        src, offset, _ = b.slot_of(loss_node)
        transfers.append(Transfer(total.index, src, offset, stats, 0, 4))
    return stats, _updates(b, spec, groups, stats), transfers


def compile_plan(graph: Graph, gradients: dict[str, str] | None = None, loss: str | None = "loss",
                 capabilities: codegen.Capabilities = codegen.PLAIN,
                 optimizer: OptimizerSpec | None = None, pack_parameters: bool = True) -> ExecutionPlan:
    """Schedule ``graph`` (forward, or forward and backward) into an ExecutionPlan whose
    kernels take the paths ``capabilities`` allows.

    ``gradients`` maps parameter name -> the output that holds its gradient (as
    returned by ``differentiate``); with ``optimizer`` the plan also holds the
    optimizer step for those parameters. ``pack_parameters``: parameters that a concat
    joins share a buffer (``_pack_concatenated``); off for a session that takes its
    parameters from another's buffers, laid out as that one's plan put them. Needs no GPU.
    """
    b = _PlanBuilder(graph, capabilities)
    gradients = dict(gradients or {})
    groups = _place_groups(b, optimizer, gradients) if optimizer is not None else []
    pinned = _pinned(graph)
    if pack_parameters:
        _pack_concatenated(b, pinned)
    _place_pinned(b, pinned)
    pinned_roots = {b.root[i] for i in pinned}
    without_reuse = sum(buf.nbytes for buf in b.buffers) + _schedule_graph(b, pinned_roots,
                                                                            overlap=not gradients)
    loss_node = graph.outputs.get(loss) if loss else None
    stats = step = None
    transfers: list[Transfer] = []
    if optimizer is not None:
        before = sum(buf.nbytes for buf in b.buffers)
        stats, step, transfers = _optimizer_step(b, optimizer, gradients, groups, loss_node)
        without_reuse += sum(buf.nbytes for buf in b.buffers) - before

    slots = {n.id: b.slot_of(n.id) for n in graph.nodes if b.root[n.id] in b.storage}
    node_buffer = {i: slot[0] for i, slot in slots.items()}
    node_offset = {i: slot[1] for i, slot in slots.items() if slot[1]}
    outputs = {k: node_buffer[v] for k, v in graph.outputs.items()}
    slot_buffer = {p: grp.gradient_buffer for grp in groups for p in grp.parameters}
    return ExecutionPlan(
        graph_hash=graph.structural_hash(),
        engine_version=__version__,
        buffers=b.buffers,
        dispatches=b.dispatches,
        node_buffer=node_buffer,
        inputs={k: node_buffer[v] for k, v in graph.inputs.items()},
        parameters={k: node_buffer[v] for k, v in graph.parameters.items()},
        outputs=outputs,
        gradients={p: slot_buffer.get(p, outputs[o]) for p, o in gradients.items()},
        loss_buffer=outputs.get(loss) if loss else None,
        peak_bytes=sum(buf.nbytes for buf in b.buffers),
        peak_bytes_without_reuse=without_reuse,
        node_offset=node_offset,
        loss=loss if loss in graph.outputs else None,
        kernels=b.kernels,
        capabilities=capabilities_dict(capabilities),
        optimizer=optimizer.to_dict() if optimizer is not None else None,
        groups=groups,
        stats_buffer=stats,
        step_buffer=step,
        transfers=transfers,
    )
