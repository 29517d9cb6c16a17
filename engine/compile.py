"""Scheduling a graph into an ``ExecutionPlan``: buffers, lifetimes and dispatches.

The plan is plain data (serialisable, printable, cacheable on disk by graph hash):
the runtime only executes it. Intermediates whose last reader has run give their
memory back to a pool, and later intermediates of a fitting size take it, so the
peak memory of a step is far below the sum of all its tensors. Both numbers are
reported.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__
from .graph import Graph
from .ops import OPS, SOURCE, VIEW

PLAN_FORMAT = 1
ALIGN = 256  # storage-buffer offset alignment on every adapter we target


@dataclass
class Buffer:
    """A device allocation. ``kind`` says who owns it: inputs, parameters and outputs
    are pinned for the whole step; intermediates are pooled and reused."""

    id: int
    nbytes: int
    kind: str
    names: list[str] = field(default_factory=list)


@dataclass
class Dispatch:
    """One kernel launch: the graph nodes it runs, the buffers it reads and writes."""

    index: int
    kernel: str
    archetype: str
    nodes: list[int]
    reads: list[int]
    writes: list[int]
    elements: int


@dataclass
class ExecutionPlan:
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
        d["dispatches"] = [Dispatch(**x) for x in d["dispatches"]]
        d["node_buffer"] = {int(k): v for k, v in d["node_buffer"].items()}
        return cls(**d)

    def summary(self) -> str:
        mib = lambda n: f"{n / 2**20:.2f} MiB"
        return (f"{len(self.dispatches)} dispatches, {len(self.buffers)} buffers, peak "
                f"{mib(self.peak_bytes)} with reuse ({mib(self.peak_bytes_without_reuse)} without)")

    def __str__(self) -> str:
        lines = [f"plan {self.graph_hash[:12]}: {self.summary()}"]
        for d in self.dispatches:
            lines.append(f"  #{d.index} {d.kernel} [{d.archetype}] nodes {d.nodes} "
                         f"reads {d.reads} writes {d.writes}")
        return "\n".join(lines)


def _aligned(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def _kernel_name(graph: Graph, node) -> str:
    key = [node.op] + [f"{k}={v}" for k, v in sorted(node.attrs.items())
                       if k in ("transpose_a", "transpose_b", "activation", "causal", "approximate")]
    return ":".join(str(k) for k in key)


def compile_plan(graph: Graph, gradients: dict[str, str] | None = None, loss: str | None = "loss") -> ExecutionPlan:
    """Schedule ``graph`` (forward, or forward and backward) into an ExecutionPlan.

    ``gradients`` maps parameter name -> the output that holds its gradient (as
    returned by ``differentiate``). Needs no GPU.
    """
    live = graph.live_nodes() | set(graph.inputs.values()) | set(graph.parameters.values())
    pinned_kind: dict[int, tuple[str, str]] = {}
    for name, i in graph.inputs.items():
        pinned_kind[i] = ("input", name)
    for name, i in graph.parameters.items():
        pinned_kind[i] = ("parameter", name)
    for name, i in graph.outputs.items():
        pinned_kind.setdefault(i, ("output", name))
    for i in graph.constants:
        pinned_kind.setdefault(i, ("constant", f"const%{i}"))

    # A view (reshape) shares its operand's storage: resolve every node to its storage root.
    root = {}
    for n in graph.nodes:
        root[n.id] = root[n.inputs[0]] if OPS[n.op].archetype == VIEW else n.id

    order = [n for n in graph.nodes if n.id in live and OPS[n.op].archetype not in (SOURCE, VIEW)]
    last_use: dict[int, int] = {}
    for step, n in enumerate(order):
        for i in n.inputs:
            last_use[root[i]] = step
    pinned_roots = {root[i] for i in pinned_kind}

    buffers: list[Buffer] = []
    storage: dict[int, int] = {}  # root node -> buffer id

    def new_buffer(nbytes, kind, name):
        buffers.append(Buffer(len(buffers), nbytes, kind, [name] if name else []))
        return buffers[-1].id

    for i, (kind, name) in pinned_kind.items():
        if root[i] in storage:
            buffers[storage[root[i]]].names.append(name)
        else:
            storage[root[i]] = new_buffer(_aligned(graph[root[i]].nbytes), kind, name)

    free: list[int] = []
    total_without_reuse = sum(b.nbytes for b in buffers)
    dispatches: list[Dispatch] = []
    for step, n in enumerate(order):
        if n.id not in storage:
            size = _aligned(n.nbytes)
            total_without_reuse += size
            fits = [b for b in free if buffers[b].nbytes >= size]
            if fits:
                best = min(fits, key=lambda b: buffers[b].nbytes)
                free.remove(best)
                storage[n.id] = best
            else:
                storage[n.id] = new_buffer(size, "intermediate", None)
        reads = [storage[root[i]] for i in n.inputs]
        dispatches.append(Dispatch(len(dispatches), _kernel_name(graph, n), OPS[n.op].archetype,
                                   [n.id], reads, [storage[n.id]], n.size))
        for i in set(n.inputs):
            r = root[i]
            if r not in pinned_roots and last_use.get(r) == step and r in storage:
                free.append(storage[r])
        if n.id not in pinned_roots and n.id not in last_use:
            free.append(storage[n.id])

    node_buffer = {n.id: storage[root[n.id]] for n in graph.nodes if root[n.id] in storage}
    outputs = {k: node_buffer[v] for k, v in graph.outputs.items()}
    return ExecutionPlan(
        graph_hash=graph.structural_hash(),
        engine_version=__version__,
        buffers=buffers,
        dispatches=dispatches,
        node_buffer=node_buffer,
        inputs={k: node_buffer[v] for k, v in graph.inputs.items()},
        parameters={k: node_buffer[v] for k, v in graph.parameters.items()},
        outputs=outputs,
        gradients={p: outputs[o] for p, o in (gradients or {}).items()},
        loss_buffer=outputs.get(loss) if loss else None,
        peak_bytes=sum(b.nbytes for b in buffers),
        peak_bytes_without_reuse=total_without_reuse,
    )


def default_cache_dir() -> Path:
    base = os.environ.get("MEGANEURA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "meganeura")
    return Path(base) / "plans"


def cached_plan(graph: Graph, gradients: dict[str, str] | None = None, loss: str | None = "loss",
                cache_dir: Path | None = None) -> ExecutionPlan:
    """``compile_plan`` through an on-disk cache keyed by graph hash and engine version.
    A stale or unreadable entry is ignored with a warning and rewritten."""
    cache_dir = Path(cache_dir or default_cache_dir())
    key = f"{graph.structural_hash()}-{json.dumps(sorted((gradients or {}).items()))}-{loss}"
    import hashlib
    path = cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}-v{__version__}.json"
    if path.exists():
        try:
            plan = ExecutionPlan.from_dict(json.loads(path.read_text()))
            if plan.graph_hash == graph.structural_hash() and plan.engine_version == __version__:
                return plan
            warnings.warn(f"plan cache {path} is stale; rebuilding it")
        except (ValueError, TypeError, KeyError, OSError) as e:
            warnings.warn(f"plan cache {path} is unreadable ({type(e).__name__}: {e}); rebuilding it")
    plan = compile_plan(graph, gradients, loss)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(plan.to_json())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return plan
