"""Per-dispatch GPU profiling and trace export.

``profile_session(session, steps)`` (also ``Session.profile(steps)``) runs ``steps``
steps of a session with a GPU timestamp before and after every dispatch and returns a
``ProfileReport``: for each dispatch its step, index, kernel, archetype, graph nodes,
workgroups, bytes moved, estimated FLOPs and GPU nanoseconds; totals per kernel and per
archetype; per step the GPU time against the CPU's record / submit / wait time; nested
CPU spans; and the overhead of the timestamps themselves (the same steps run again
without them).

Timing modes (``ProfileReport.mode``):

- ``inside-passes``: the adapter offers ``timestamp-query-inside-passes``; every
  dispatch stays in the step's one compute pass with a timestamp written before and
  after it (wgpu-native's ``write_timestamp`` extra).
- ``per-pass``: ``timestamp-query`` only; each dispatch gets a compute pass of its
  own whose ``timestamp_writes`` mark its beginning and end.
- ``cpu-wall-per-submission``: no ``timestamp-query``; each dispatch is submitted on
  its own and timed on the CPU from submit to the end of the wait. The report and the
  trace say so (``timestamps`` is false).

GPU ticks become nanoseconds with the queue's timestamp period. GPU times are put on
the CPU clock (``time.perf_counter_ns``): where the GPU already counts on that clock
(lavapipe does: its timestamps fall between the step's record and the end of its
wait) they are kept; otherwise each step's first GPU timestamp is anchored to the CPU
time of its submit (``clock_alignment`` says which).

Export: ``write_perfetto(report, path)`` (Perfetto protobuf, built with the perfetto
package's ``TraceProtoBuilder``) and ``write_chrome_trace(report, path)`` (Chrome trace
JSON). Setting ``MEGANEURA_TRACE=out.pftrace`` (or ``out.json``) makes any process that
profiled write the last profile there at exit.

Training sessions plug in through the same protocol an inference session offers:
``record(encoder, timestamps=None, dispatches=None)`` records one whole step;
``_steps`` / ``step_dispatches`` (positions of the plan's dispatches; the optimizer
step's are in the plan too, reported by group, e.g. ``train:adamw`` with the group's
parameters as its nodes), or ``profile_dispatches()`` returning one ``DispatchInfo``
per recorded dispatch; an optional ``prepare_step()`` (CPU-side uploads before each
step) and ``is_training = True``.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .codegen import norm_partials
from .errors import MeganeuraError
from .ops import OPS

MAX_QUERIES = 4096  # wgpu's limit on the size of one query set

MODE_INSIDE = "inside-passes"
MODE_PER_PASS = "per-pass"
MODE_CPU = "cpu-wall-per-submission"

FALLBACK_NOTE = ("the adapter lacks timestamp-query: GPU times are CPU wall time per "
                 "submission (one submission and wait per dispatch), which includes "
                 "submission and synchronisation overhead")


# ---------------------------------------------------------------- CPU spans

@dataclass
class Span:
    """A CPU interval on ``time.perf_counter_ns``; ``depth`` 0 is outermost."""

    name: str
    start_ns: int
    end_ns: int
    depth: int
    args: dict = field(default_factory=dict)

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


class SpanRecorder:
    """Collects properly nested CPU spans: ``with rec.span("compile"): ...``."""

    def __init__(self):
        self.spans: list[Span] = []
        self._depth = 0

    @contextmanager
    def span(self, name: str, **args):
        s = Span(name, time.perf_counter_ns(), 0, self._depth, dict(args))
        self.spans.append(s)
        self._depth += 1
        try:
            yield s
        finally:
            self._depth -= 1
            s.end_ns = time.perf_counter_ns()

    def add(self, name: str, start_ns: int, end_ns: int, depth: int | None = None, **args) -> Span:
        """A span measured elsewhere, as a child of the innermost open span (or at ``depth``)."""
        s = Span(name, int(start_ns), int(end_ns), self._depth if depth is None else depth, dict(args))
        self.spans.append(s)
        return s


def add_build_spans(rec: SpanRecorder, session, name: str = "build session") -> None:
    """The session's own build phases (codegen, buffers, pipelines) under one span."""
    spans = list(getattr(session, "build_spans", []) or [])
    if not spans:
        return
    parent = rec.add(name, spans[0][1], spans[-1][2])
    for n, a, b in spans:
        rec.add(n, a, b, depth=parent.depth + 1)


# ---------------------------------------------------------------- dispatch descriptions

@dataclass
class DispatchInfo:
    """What one recorded dispatch runs (independent of timing)."""

    kernel: str
    archetype: str
    nodes: list[str]
    ops: list[str]
    shapes: dict
    workgroups: tuple
    bytes: int
    flops: int
    plan_index: int | None = None
    output_buffer: int | None = None


def _node_name(node) -> str:
    return node.name or f"%{node.id}"


# Matmul-shaped passes over the T x S scores of each attention op (2 flops per score and
# head dim each): the forward's q kᵀ and P v; lse's q kᵀ; dq's q kᵀ, dO vᵀ and dS k; dk's
# the same with dSᵀ q; dv's q kᵀ and Pᵀ dO.
ATTENTION_PASSES = {"attention": 2, "attention_lse": 1, "attention_grad_q": 3, "attention_grad_k": 3,
                    "attention_grad_v": 2}


def estimate_flops(graph, node) -> int:
    """Floating-point operations of one node: exact for matmuls (2·M·N·K plus the
    epilogue) and attention (its matmul-shaped passes plus the softmax), estimates elsewhere
    (pointwise: ops per element; reductions: a few per input element; data movement: 0)."""
    ins = [graph[i] for i in node.inputs]
    op, a, size = node.op, node.attrs, node.size
    arch = OPS[node.op].archetype
    if arch == "matmul":
        x = ins[0]
        if op == "norm_matmul":
            k = x.shape[-1]
            return 2 * size * k + 4 * x.size
        k = x.shape[-2] if a.get("transpose_a") else x.shape[-1]
        extra = size * (int(a.get("has_add", False)) + int(a.get("has_residual", False))
                        + int(a.get("activation", "none") != "none"))
        return 2 * size * k + extra
    if arch == "attention":
        q, kk = ins[0], ins[1]
        b, s, w = q.shape
        t = kk.shape[1]
        h = a.get("num_heads", 1)
        pairs = b * h * s * t
        if a.get("causal"):
            pairs //= 2
        return 2 * ATTENTION_PASSES[op] * pairs * (w // h) + 5 * pairs
    if arch == "conv":
        # Each of the three is the same implicit GEMM: 2 flops for every element of the
        # forward's output (dout for the gradients) times every weight of one filter.
        if op in ("conv1d", "conv2d"):
            return 2 * size * math.prod(ins[1].shape[1:]) + (size if len(ins) > 2 else 0)
        if op == "conv_input_grad":   # (dout, w)
            return 2 * ins[0].size * math.prod(ins[1].shape[1:])
        return 2 * ins[1].size * math.prod(node.shape[1:])   # conv_weight_grad (x, dout) -> w
    if arch == "pointwise":
        prog = a.get("program") or a.get("ops") or a.get("body")
        per = len(prog) if isinstance(prog, (list, tuple)) and prog else 1
        if op in ("gelu", "silu", "sigmoid", "tanh", "exp", "log", "swiglu", "rope"):
            per = max(per, 4)
        return per * size
    if arch == "reduction":
        per = {"softmax": 5, "log_softmax": 5, "layer_norm": 8, "rms_norm": 6, "group_norm": 8,
               "cross_entropy": 5, "soft_cross_entropy": 5, "cross_entropy_grad": 5}.get(op, 1)
        return per * max((t.size for t in ins), default=size)
    return 0


def session_dispatches(session) -> list[DispatchInfo]:
    """One ``DispatchInfo`` per dispatch the session records in a step, in order."""
    custom = getattr(session, "profile_dispatches", None)
    if callable(custom):
        return list(custom())
    plan = session.plan
    return [_graph_dispatch(session.graph, plan.dispatches[j]) if plan.dispatches[j].nodes
            else _step_dispatch(plan, plan.dispatches[j]) for j in session.step_dispatches]


def _graph_dispatch(graph, d) -> DispatchInfo:
    """A dispatch running graph nodes: bytes of its operands and outputs, estimated FLOPs.
    The second stage of a two-dispatch node (``:total``: a loss's total, split attention's
    combine, a split-K matmul's sum and epilogue) reads the first stage's partials (and
    the epilogue's operands) and does about one FLOP for each partial."""
    nodes = [graph[n] for n in d.nodes]
    ins = [graph[i] for n in nodes for i in n.inputs]
    nbytes = sum(t.nbytes for t in ins) + sum(n.nbytes for n in nodes)
    flops = sum(estimate_flops(graph, n) for n in nodes)
    if d.kernel.endswith(":total"):
        partial_bytes = d.bindings[0].size
        nbytes = sum(b.size for b in d.bindings[:-1]) + sum(n.nbytes for n in nodes)
        flops = partial_bytes // 4
    return DispatchInfo(
        kernel=d.kernel, archetype=d.archetype,
        nodes=[_node_name(n) for n in nodes], ops=[n.op for n in nodes],
        shapes={"inputs": [list(t.shape) for t in ins], "output": [list(n.shape) for n in nodes]},
        workgroups=tuple(int(w) for w in d.workgroups), bytes=int(nbytes), flops=int(flops),
        plan_index=d.index, output_buffer=d.writes[0] if d.writes else None)


# FLOPs per element of the optimizer step's kernels (the update's by rule).
_UPDATE_FLOPS = {"sgd": 2, "adam": 14, "adamw": 16}


def _step_dispatch(plan, d) -> DispatchInfo:
    """A dispatch of the optimizer step (a gradient copy, a norm partial sum, the norm's
    total, a group's update), named by the tensors it covers: bytes read and written
    over its elements, FLOPs per element of its rule."""
    n = d.elements
    role = d.kernel.split(":", 1)[1]
    if role == "norm_total":   # n partials, two floats each (scale, scaled sum of squares)
        nbytes, flops = 8 * n + 4, 3 * n
    elif role == "sum_squares":  # two passes over the gradient (its max, then the scaled squares)
        nbytes, flops = 8 * n + 8 * norm_partials(n), 3 * n
    elif role == "gradient":  # copy:gradient
        nbytes, flops = 8 * n, 0
    else:
        states = len(plan.groups[d.group].state_buffers)
        momentum = role == "sgd" and bool((plan.optimizer or {}).get("momentum"))
        nbytes = 4 * n * (3 + 2 * states)  # gradient; parameter and each state read and written
        flops = (_UPDATE_FLOPS.get(role, 4) + 2 * momentum) * n
    return DispatchInfo(
        kernel=d.kernel, archetype=d.archetype, nodes=list(d.names), ops=[role],
        shapes={"inputs": [[n]], "output": [[n]]}, workgroups=tuple(int(w) for w in d.workgroups),
        bytes=int(nbytes), flops=int(flops), plan_index=d.index,
        output_buffer=d.writes[0] if d.writes else None)


# ---------------------------------------------------------------- timestamps on the GPU

def timestamp_support(device) -> str | None:
    """The best timing mode the device allows: ``inside-passes``, ``per-pass`` or
    None (no timestamp-query). Tests monkeypatch this to simulate an adapter without it."""
    from .device import INSIDE_PASSES, native_extras
    feats = {str(f) for f in device.features}
    if "timestamp-query" not in feats:
        return None
    if feats & set(INSIDE_PASSES):
        try:
            if hasattr(native_extras(), "write_timestamp"):
                return MODE_INSIDE
        except Exception:
            pass
    return MODE_PER_PASS


def timestamp_period(device) -> float:
    """Nanoseconds per timestamp tick (wgpu-native's ``wgpuQueueGetTimestampPeriod``;
    wgpu-py 0.32 does not wrap it). 1.0 where it cannot be asked, and on Dawn, which
    resolves timestamps in nanoseconds itself."""
    from .device import backend, native_api
    if backend() == "dawn":
        return 1.0
    try:
        lib = native_api().lib
        period = float(lib.wgpuQueueGetTimestampPeriod(device.queue._internal))
        return period if period > 0 and math.isfinite(period) else 1.0
    except Exception:
        return 1.0


class DispatchTimestamps:
    """Query sets for a begin and an end timestamp around each of ``n`` dispatches.
    Passed to ``Session.record(encoder, timestamps=...)``."""

    def __init__(self, device, n: int, inside_passes: bool):
        from .device import native_extras, wgpu_module
        wgpu = wgpu_module()

        self.device = device
        self.n = n
        self.inside_passes = inside_passes
        self.per_set = MAX_QUERIES // 2  # dispatches per query set
        self.sets = []
        for first in range(0, n, self.per_set):
            count = 2 * min(self.per_set, n - first)
            qs = device.create_query_set(label="dispatch timestamps", type=wgpu.QueryType.timestamp, count=count)
            buf = device.create_buffer(label="timestamps", size=8 * count,
                                       usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            self.sets.append((qs, buf, count))
        if inside_passes:
            self._write = native_extras().write_timestamp
        self.nbytes = sum(8 * c for _, _, c in self.sets)

    def _slot(self, i: int, which: int):
        qs, _, _ = self.sets[i // self.per_set]
        return qs, 2 * (i % self.per_set) + which

    def write(self, compute_pass, i: int, which: int) -> None:
        """Timestamp ``which`` (0 begin, 1 end) of dispatch ``i`` inside a pass."""
        qs, idx = self._slot(i, which)
        self._write(compute_pass, qs, idx)

    def pass_writes(self, i: int) -> dict:
        """``timestamp_writes`` of the compute pass holding only dispatch ``i``."""
        qs, idx = self._slot(i, 0)
        return {"query_set": qs, "beginning_of_pass_write_index": idx, "end_of_pass_write_index": idx + 1}

    def resolve(self, encoder) -> None:
        for qs, buf, count in self.sets:
            encoder.resolve_query_set(qs, 0, count, buf, 0)

    def read(self):
        """All 2·n ticks (waits for the GPU)."""
        import numpy as np
        parts = [np.frombuffer(self.device.queue.read_buffer(buf, 0, 8 * count), dtype=np.uint64)
                 for _, buf, count in self.sets]
        return np.concatenate(parts).astype(np.int64)


# ---------------------------------------------------------------- the report

@dataclass
class DispatchRecord:
    step: int
    index: int
    kernel: str
    archetype: str
    nodes: list[str]
    ops: list[str]
    shapes: dict
    workgroups: list[int]
    bytes: int
    flops: int
    gpu_ns: int
    begin_ns: int       # on the CPU clock (time.perf_counter_ns), see clock_alignment
    end_ns: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.gpu_ns if self.gpu_ns > 0 else 0.0

    @property
    def tflop_per_s(self) -> float:
        return self.flops / self.gpu_ns / 1e3 if self.gpu_ns > 0 else 0.0


@dataclass
class StepRecord:
    step: int
    start_ns: int            # CPU: the step's recording began
    record_ns: int           # CPU time creating the encoder and recording the dispatches
    submit_ns: int           # CPU time in queue.submit
    wait_ns: int             # CPU time waiting for the GPU (reading timestamps / a word back)
    wall_ns: int             # record + submit + wait (+ loss read)
    submit_start_ns: int
    submit_end_ns: int
    gpu_ns: int              # first dispatch's begin to last dispatch's end
    gpu_dispatch_sum_ns: int  # sum of the dispatches' own times
    loss: float | None = None


@dataclass
class ProfileReport:
    model: str
    adapter: dict
    mode: str
    timestamps: bool
    steps: int
    train: bool
    dispatches: list[DispatchRecord]
    step_records: list[StepRecord]
    spans: list[Span]
    overhead: dict
    memory: dict
    timestamp_period: float = 1.0
    clock_alignment: str = "none"
    note: str = ""
    trace: str | None = None

    # ---------------------------------------------------------- aggregates

    @property
    def gpu_step_ns(self) -> list[int]:
        return [s.gpu_ns for s in self.step_records]

    @property
    def dispatches_per_step(self) -> int:
        return len(self.dispatches) // self.steps if self.steps else 0

    def _group(self, key: Callable[[DispatchRecord], str]) -> list[dict]:
        groups: dict[str, list[DispatchRecord]] = {}
        for d in self.dispatches:
            groups.setdefault(key(d), []).append(d)
        total = sum(d.gpu_ns for d in self.dispatches) or 1
        rows = []
        for name, ds in groups.items():
            t = sum(d.gpu_ns for d in ds)
            b = sum(d.bytes for d in ds)
            f = sum(d.flops for d in ds)
            rows.append({"name": name, "archetype": ds[0].archetype, "calls": len(ds),
                         "gpu_ns": t, "percent": 100.0 * t / total,
                         "avg_ns": t / len(ds), "min_ns": min(d.gpu_ns for d in ds),
                         "max_ns": max(d.gpu_ns for d in ds), "bytes": b, "flops": f,
                         "gb_per_s": b / t if t else 0.0, "tflop_per_s": f / t / 1e3 if t else 0.0})
        rows.sort(key=lambda r: -r["gpu_ns"])
        return rows

    def per_kernel(self) -> list[dict]:
        return self._group(lambda d: d.kernel)

    def per_archetype(self) -> list[dict]:
        return self._group(lambda d: d.archetype)

    def achieved(self) -> dict:
        t = sum(d.gpu_ns for d in self.dispatches)
        b = sum(d.bytes for d in self.dispatches)
        f = sum(d.flops for d in self.dispatches)
        return {"gpu_ns": t, "bytes": b, "flops": f,
                "gb_per_s": b / t if t else 0.0, "tflop_per_s": f / t / 1e3 if t else 0.0}

    # ---------------------------------------------------------- output

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "adapter": self.adapter,
            "steps": self.steps,
            "train": self.train,
            "timestamps": self.timestamps,
            "mode": self.mode,
            "note": self.note,
            "timestamp_period": self.timestamp_period,
            "clock_alignment": self.clock_alignment,
            "dispatches_per_step": self.dispatches_per_step,
            "dispatches": [{"step": d.step, "index": d.index, "kernel": d.kernel, "archetype": d.archetype,
                            "nodes": d.nodes, "ops": d.ops, "workgroups": list(d.workgroups),
                            "gpu_ns": d.gpu_ns, "bytes": d.bytes, "flops": d.flops,
                            "begin_ns": d.begin_ns} for d in self.dispatches],
            "gpu_step_ns": self.gpu_step_ns,
            "step_details": [asdict(s) for s in self.step_records],
            "per_kernel": self.per_kernel(),
            "per_archetype": self.per_archetype(),
            "achieved": self.achieved(),
            "overhead": self.overhead,
            "memory": self.memory,
            "cpu_spans": [{"name": s.name, "depth": s.depth, "start_ns": s.start_ns, "dur_ns": s.dur_ns}
                          for s in self.spans],
            "trace": self.trace,
        }

    def format_table(self, top: int = 15, by: str = "kernel") -> str:
        """The ``top`` kernels (or archetypes) by total GPU time, like torch.profiler's
        ``key_averages().table()``."""
        rows = self.per_kernel() if by == "kernel" else self.per_archetype()
        shown = rows[:top]
        name_w = max([len("Name")] + [len(_short_kernel(r["name"])) for r in shown])
        name_w = min(name_w, 60)
        head = (f"{'Name':<{name_w}}  {'Archetype':<10}  {'GPU total %':>11}  {'GPU total':>10}  "
                f"{'GPU avg':>10}  {'GPU min':>10}  {'GPU max':>10}  {'# Calls':>7}  {'GB/s':>8}  {'TFLOP/s':>8}")
        rule = "-" * len(head)
        lines = [rule, head, rule]
        for r in shown:
            r = dict(r, name=_short_kernel(r["name"]))
            name = r["name"] if len(r["name"]) <= name_w else r["name"][:name_w - 3] + "..."
            lines.append(
                f"{name:<{name_w}}  {r['archetype']:<10}  {r['percent']:>10.2f}%  {_fmt_ns(r['gpu_ns']):>10}  "
                f"{_fmt_ns(r['avg_ns']):>10}  {_fmt_ns(r['min_ns']):>10}  {_fmt_ns(r['max_ns']):>10}  "
                f"{r['calls']:>7}  {r['gb_per_s']:>8.2f}  {r['tflop_per_s']:>8.4f}")
        lines.append(rule)
        a = self.achieved()
        steps = self.step_records
        med = lambda xs: statistics.median(xs) if xs else 0
        lines.append(f"Self GPU time total: {_fmt_ns(a['gpu_ns'])} over {self.steps} steps of "
                     f"{self.dispatches_per_step} dispatches ({self.mode}"
                     f"{'' if self.timestamps else ': NO GPU TIMESTAMPS'})")
        if steps:
            lines.append(f"Per step (median): GPU {_fmt_ns(med([s.gpu_ns for s in steps]))}, CPU record "
                         f"{_fmt_ns(med([s.record_ns for s in steps]))}, submit {_fmt_ns(med([s.submit_ns for s in steps]))}, "
                         f"wait {_fmt_ns(med([s.wait_ns for s in steps]))}, wall {_fmt_ns(med([s.wall_ns for s in steps]))}")
        lines.append(f"Achieved: {a['gb_per_s']:.2f} GB/s, {a['tflop_per_s']:.4f} TFLOP/s (FLOPs estimated per archetype)")
        o = self.overhead
        if o.get("per_step_ns") is not None:
            lines.append(f"Profiling overhead: {_fmt_ns(o['per_step_ns'])} per step "
                         f"({_fmt_ns(o['per_dispatch_ns'])} per dispatch; step wall {_fmt_ns(o['step_wall_ns_with'])} "
                         f"with timestamps, {_fmt_ns(o['step_wall_ns_without'])} without)")
        if self.note:
            lines.append(f"Note: {self.note}")
        if len(rows) > top:
            lines.append(f"({len(rows) - top} more kernels not shown)")
        return "\n".join(lines)

    def write_perfetto(self, path) -> Path:
        return write_perfetto(self, path)

    def write_chrome_trace(self, path) -> Path:
        return write_chrome_trace(self, path)


def _short_kernel(name: str) -> str:
    """A kernel name without its default attributes (``transpose_a=False``, ``activation=none``)."""
    parts = name.split(":")
    return ":".join([parts[0]] + [p for p in parts[1:] if not p.endswith(("=False", "=none"))])


def _fmt_ns(ns: float) -> str:
    ns = float(ns)
    if ns >= 1e9:
        return f"{ns / 1e9:.3f}s"
    if ns >= 1e6:
        return f"{ns / 1e6:.3f}ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.3f}us"
    return f"{ns:.0f}ns"


# ---------------------------------------------------------------- running the steps

def _wait_buffer(session, infos: list[DispatchInfo]):
    """A small buffer whose read-back waits for everything submitted before it."""
    for info in reversed(infos):
        if info.output_buffer is not None:
            return session.buffers[info.output_buffer]
    return session.buffers[0]


def _has_loss(session) -> bool:
    plan = session.plan
    return plan.loss_buffer is not None or "loss" in session.graph.outputs


def _live_bytes(session) -> list[int]:
    """Bytes of the plan's tensors alive while each plan dispatch runs (pinned buffers
    always; an intermediate from its first writer to its last reader)."""
    plan = session.plan
    first, last = {}, {}
    for d in plan.dispatches:
        for b in list(d.reads) + list(d.writes):
            first.setdefault(b, d.index)
            last[b] = d.index
    pinned = sum(b.nbytes for b in plan.buffers if b.kind != "intermediate")
    live = []
    for d in plan.dispatches:
        n = pinned
        for b in plan.buffers:
            if b.kind == "intermediate" and b.id in first and first[b.id] <= d.index <= last[b.id]:
                n += b.nbytes
        live.append(n)
    return live


def _memory(session, stamps: DispatchTimestamps | None, infos: list[DispatchInfo]) -> dict:
    seen, allocated = set(), 0
    for b in session.buffers:
        if id(b) not in seen:
            seen.add(id(b))
            allocated += int(b.size)
    plan_live = _live_bytes(session)
    everything = sum(b.nbytes for b in session.plan.buffers)
    live = [plan_live[i.plan_index] if i.plan_index is not None else everything for i in infos]
    meta = int(getattr(getattr(session, "meta_buffer", None), "size", 0) or 0)
    plan = session.plan
    return {"allocated_bytes": allocated + meta + (stamps.nbytes if stamps else 0),
            "tensor_bytes": allocated, "timestamp_bytes": stamps.nbytes if stamps else 0,
            "peak_bytes": plan.peak_bytes, "peak_bytes_without_reuse": plan.peak_bytes_without_reuse,
            "live_bytes": live}


def _adapter() -> dict:
    try:
        from .runtime import adapter_summary
        return adapter_summary()
    except Exception as e:  # the session exists, so this should not happen
        return {"name": f"unknown ({e})", "backend": "unknown", "software": None}


def _check_train(session, train: bool) -> bool:
    """Whether the profiled steps are training steps (a TrainingSession's always are)."""
    if getattr(session, "is_training", False):
        return True
    if not train:
        return False
    raise MeganeuraError("this is an inference session; build a training session with "
                         "engine.build_session(graph) to profile training steps")


def profile_session(session, steps: int = 10, *, train: bool = False, model: str | None = None,
                    mode: str | None = None, warmup: int = 1, measure_overhead: bool = True,
                    spans: SpanRecorder | None = None, include_build_spans: bool = True,
                    progress: Callable[[str], None] | None = None) -> ProfileReport:
    """Run ``steps`` profiled steps of ``session`` (after ``warmup`` untimed ones) and
    return a ``ProfileReport``. ``mode`` forces a timing mode (``inside-passes``,
    ``per-pass`` or ``cpu-wall-per-submission``); by default the best the device offers.
    ``spans`` collects the CPU spans (pass one to nest the caller's own spans, e.g.
    graph build and compile, with these)."""
    if steps < 1:
        raise MeganeuraError(f"steps must be at least 1, found {steps}")
    train = _check_train(session, train)
    device = session.device
    supported = timestamp_support(device)
    if mode is None:
        mode = supported or MODE_CPU
    elif mode not in (MODE_INSIDE, MODE_PER_PASS, MODE_CPU):
        raise MeganeuraError(f"unknown timing mode {mode!r}; use {MODE_INSIDE}, {MODE_PER_PASS} or {MODE_CPU}")
    elif mode != MODE_CPU and (supported is None or (mode == MODE_INSIDE and supported != MODE_INSIDE)):
        raise MeganeuraError(f"timing mode {mode} needs a device feature this adapter lacks "
                             f"(best available: {supported or MODE_CPU})")
    rec = spans if spans is not None else SpanRecorder()
    if include_build_spans:
        add_build_spans(rec, session)
    infos = session_dispatches(session)
    n = len(infos)
    queue = device.queue
    wait_buf = _wait_buffer(session, infos)
    with_loss = _has_loss(session)
    prepare = getattr(session, "prepare_step", None)
    finish = getattr(session, "finish_step", None)
    timestamps = mode != MODE_CPU
    stamps = DispatchTimestamps(device, n, mode == MODE_INSIDE) if timestamps and n else None
    period = timestamp_period(device) if timestamps else 1.0
    name = model or session.graph.name

    def plain_step() -> int | None:
        """One step without timestamps; returns its CPU recording time where known."""
        if train and hasattr(session, "step"):
            session.step()
            return None
        if prepare:
            prepare()
        t0 = time.perf_counter_ns()
        enc = device.create_command_encoder(label="step")
        session.record(enc)
        cmd = enc.finish()
        t1 = time.perf_counter_ns()
        queue.submit([cmd])
        queue.read_buffer(wait_buf, 0, 4)
        return t1 - t0

    records: list[DispatchRecord] = []
    step_records: list[StepRecord] = []
    alignments = set()
    with rec.span("profile", model=name, mode=mode, steps=steps):
        if warmup:
            with rec.span("warmup", steps=warmup):
                for _ in range(warmup):
                    plain_step()
        baseline_walls, baseline_records = [], []
        for step in range(steps):
            with rec.span(f"step {step}", step=step) as sp:
                if prepare:
                    with rec.span("prepare"):
                        prepare()
                if mode == MODE_CPU:
                    sr, drs = _cpu_timed_step(session, rec, step, infos, wait_buf)
                else:
                    sr, drs, how = _gpu_timed_step(session, rec, step, infos, stamps, period)
                    alignments.add(how)
                if finish is not None:
                    with rec.span("read loss"):
                        sr.loss = float(finish()[0])
                elif with_loss:
                    with rec.span("read loss"):
                        sr.loss = float(session.read_loss())
            sr.wall_ns = sp.end_ns - sp.start_ns
            step_records.append(sr)
            records.extend(drs)
            if measure_overhead and timestamps:
                # The same step without timestamps, interleaved so both see the same load.
                with rec.span(f"step {step} without timestamps", step=step, baseline=True) as bp:
                    baseline_records.append(plain_step())
                    if with_loss and not train:
                        session.read_loss()
                baseline_walls.append(bp.end_ns - bp.start_ns)
            if progress:
                progress(f"profile step {step + 1}/{steps}: GPU {_fmt_ns(sr.gpu_ns)}, "
                         f"wall {_fmt_ns(sr.wall_ns)}" + (f", loss {sr.loss:.4f}" if sr.loss is not None else ""))
        overhead = {"per_step_ns": None, "per_dispatch_ns": None, "step_wall_ns_with": None,
                    "step_wall_ns_without": None, "record_ns_with": None, "record_ns_without": None}
        if baseline_walls:
            w_with = statistics.median(s.wall_ns for s in step_records)
            w_without = statistics.median(baseline_walls)
            overhead = {"per_step_ns": w_with - w_without,
                        "per_dispatch_ns": (w_with - w_without) / n if n else 0.0,
                        "step_wall_ns_with": w_with, "step_wall_ns_without": w_without,
                        "record_ns_with": statistics.median(s.record_ns for s in step_records),
                        "record_ns_without": (statistics.median(r for r in baseline_records if r is not None)
                                              if any(r is not None for r in baseline_records) else None)}

    alignment = ("cpu wall time" if mode == MODE_CPU else
                 "gpu clock is the cpu clock" if alignments == {"identity"} else
                 "first gpu timestamp of each step anchored to its submit")
    report = ProfileReport(
        model=name, adapter=_adapter(), mode=mode, timestamps=timestamps, steps=steps, train=train,
        dispatches=records, step_records=step_records, spans=list(rec.spans), overhead=overhead,
        memory=_memory(session, stamps, infos), timestamp_period=period, clock_alignment=alignment,
        note=FALLBACK_NOTE if mode == MODE_CPU else "")
    _remember(report)
    return report


def _record_of(info: DispatchInfo, step: int, index: int, begin: int, end: int) -> DispatchRecord:
    return DispatchRecord(step=step, index=index, kernel=info.kernel, archetype=info.archetype,
                          nodes=list(info.nodes), ops=list(info.ops), shapes=info.shapes,
                          workgroups=list(info.workgroups), bytes=info.bytes, flops=info.flops,
                          gpu_ns=max(0, end - begin), begin_ns=begin, end_ns=max(begin, end))


def _gpu_timed_step(session, rec, step, infos, stamps, period):
    device = session.device
    with rec.span("record") as r:
        enc = device.create_command_encoder(label=f"profiled step {step}")
        if stamps is not None:
            session.record(enc, timestamps=stamps)
            stamps.resolve(enc)
        else:
            session.record(enc)
        cmd = enc.finish()
    with rec.span("submit", step=step) as s:
        device.queue.submit([cmd])
    with rec.span("wait") as w:
        ticks = stamps.read() if stamps is not None else []
    n = len(infos)
    ns = [int(round(float(t) * period)) for t in ticks]
    if not ns:
        sr = StepRecord(step, r.start_ns, r.dur_ns, s.dur_ns, w.dur_ns, 0, s.start_ns, s.end_ns, 0, 0)
        return sr, [], "identity"
    g0, g1 = ns[0], ns[2 * n - 1]
    if r.start_ns <= g0 and g1 <= w.end_ns:
        offset, how = 0, "identity"
    else:
        offset, how = s.start_ns - g0, "anchored"
        if g1 + offset > w.end_ns:
            offset = w.end_ns - g1
    drs = [_record_of(info, step, i, ns[2 * i] + offset, ns[2 * i + 1] + offset) for i, info in enumerate(infos)]
    sr = StepRecord(step=step, start_ns=r.start_ns, record_ns=r.dur_ns, submit_ns=s.dur_ns, wait_ns=w.dur_ns,
                    wall_ns=0, submit_start_ns=s.start_ns, submit_end_ns=s.end_ns,
                    gpu_ns=max(0, g1 - g0), gpu_dispatch_sum_ns=sum(d.gpu_ns for d in drs))
    return sr, drs, how


def _cpu_timed_step(session, rec, step, infos, wait_buf):
    """No timestamp-query: one submission (and wait) per dispatch, timed on the CPU."""
    device = session.device
    drs = []
    record_ns = submit_ns = wait_ns = 0
    first_submit = last_submit_end = None
    start = time.perf_counter_ns()
    for i, info in enumerate(infos):
        with rec.span(f"dispatch {i}: {info.kernel}"):
            with rec.span("record") as r:
                enc = device.create_command_encoder(label=f"step {step} dispatch {i}")
                session.record(enc, dispatches=[i])
                cmd = enc.finish()
            with rec.span("submit", step=step, dispatch=i) as s:
                device.queue.submit([cmd])
            with rec.span("wait") as w:
                buf = session.buffers[info.output_buffer] if info.output_buffer is not None else wait_buf
                device.queue.read_buffer(buf, 0, 4)
        record_ns += r.dur_ns
        submit_ns += s.dur_ns
        wait_ns += w.dur_ns
        first_submit = s.start_ns if first_submit is None else first_submit
        last_submit_end = s.end_ns
        drs.append(_record_of(info, step, i, s.start_ns, w.end_ns))
    gpu = drs[-1].end_ns - drs[0].begin_ns if drs else 0
    sr = StepRecord(step=step, start_ns=start, record_ns=record_ns, submit_ns=submit_ns, wait_ns=wait_ns,
                    wall_ns=0, submit_start_ns=first_submit or start, submit_end_ns=last_submit_end or start,
                    gpu_ns=gpu, gpu_dispatch_sum_ns=sum(d.gpu_ns for d in drs))
    return sr, drs


# ---------------------------------------------------------------- MEGANEURA_TRACE

_LAST: list[ProfileReport] = []
_ATEXIT = False


def _remember(report: ProfileReport) -> None:
    global _ATEXIT
    _LAST[:] = [report]
    if os.environ.get("MEGANEURA_TRACE") and not _ATEXIT:
        atexit.register(_write_env_trace)
        _ATEXIT = True


def _write_env_trace() -> None:
    path = os.environ.get("MEGANEURA_TRACE")
    if not path or not _LAST:
        return
    try:
        write_trace(_LAST[-1], path)
    except Exception as e:  # at exit: say what went wrong, never raise
        import sys
        print(f"meganeura: could not write MEGANEURA_TRACE={path}: {e}", file=sys.stderr)


def write_trace(report: ProfileReport, path) -> Path:
    """Perfetto protobuf, or Chrome trace JSON when ``path`` ends in ``.json``."""
    return (write_chrome_trace if str(path).endswith(".json") else write_perfetto)(report, path)


# ---------------------------------------------------------------- export

def _atomic_write(path, data: bytes) -> Path:
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise MeganeuraError(f"cannot write trace {path}: {e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a trace is for sharing
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _nest(spans: Iterable[Span]) -> list[tuple[int, str, Span]]:
    """Begin/end events of properly nested spans, in order: [(ts, 'B'|'E', span)]."""
    out, stack = [], []
    for s in sorted(spans, key=lambda s: (s.start_ns, s.depth)):
        while stack and (stack[-1].end_ns <= s.start_ns or stack[-1].depth >= s.depth):
            top = stack.pop()
            out.append((top.end_ns, "E", top))
        out.append((s.start_ns, "B", s))
        stack.append(s)
    while stack:
        top = stack.pop()
        out.append((top.end_ns, "E", top))
    return out


def _gpu_slices(report: ProfileReport) -> list[tuple[DispatchRecord, int, int]]:
    """(dispatch, begin, end) with begins clipped so slices on the GPU track never overlap."""
    out, prev_end = [], None
    for d in report.dispatches:
        b, e = d.begin_ns, d.end_ns
        if prev_end is not None and b < prev_end:
            b = prev_end
        e = max(e, b + 1)
        out.append((d, b, e))
        prev_end = e
    return out


def _submit_spans(report: ProfileReport) -> dict[int, list[Span]]:
    """The 'submit' spans of each profiled step, in order."""
    out: dict[int, list[Span]] = {}
    for s in report.spans:
        if s.name == "submit" and "step" in s.args:
            out.setdefault(s.args["step"], []).append(s)
    return out


def _flow_source(report: ProfileReport, submits, d: DispatchRecord) -> Span | None:
    spans = submits.get(d.step, [])
    if not spans:
        return None
    if report.mode == MODE_CPU:
        return next((s for s in spans if s.args.get("dispatch") == d.index), spans[0])
    return spans[0]


def _trace_title(report: ProfileReport) -> str:
    a = report.adapter
    return f"meganeura profile {report.model} on {a.get('name')} ({a.get('backend')})"


def _gpu_track_name(report: ProfileReport) -> str:
    if report.timestamps:
        return f"GPU queue: {report.adapter.get('name')} (timestamps {report.mode})"
    return f"GPU queue: {report.adapter.get('name')} (NO timestamp-query: CPU wall time per submission)"


def _live_series(report: ProfileReport) -> list[tuple[int, int]]:
    live = report.memory.get("live_bytes") or []
    n = report.dispatches_per_step
    out = []
    for d in report.dispatches:
        if len(live) == n and d.index < n:
            out.append((d.begin_ns, live[d.index]))
    return out


def write_perfetto(report: ProfileReport, path) -> Path:
    """Write ``report`` as a Perfetto protobuf trace (open it at ui.perfetto.dev)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
    from perfetto.trace_builder.proto_builder import TraceProtoBuilder

    SEQ = 0x6D6E  # our one packet sequence
    builder = TraceProtoBuilder()
    pid, tid = os.getpid(), 1
    P, T, G, MEM, LIVE, LOSS = 0x100, 0x101, 0x102, 0x103, 0x104, 0x105
    first = [True]

    def packet(ts=None):
        p = builder.add_packet()
        p.trusted_packet_sequence_id = SEQ
        if first[0]:
            p.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            first[0] = False
        if ts is not None:
            p.timestamp = int(ts)
        return p

    def track(uuid, name=None, parent=None, unit=None):
        p = packet()
        td = p.track_descriptor
        td.uuid = uuid
        if parent is not None:
            td.parent_uuid = parent
        if name is not None:
            td.name = name
        if unit is not None:
            td.counter.unit = unit
        return td

    def annotate(ev, key, value):
        a = ev.debug_annotations.add()
        a.name = key
        if isinstance(value, bool):
            a.bool_value = value
        elif isinstance(value, int):
            a.int_value = value
        elif isinstance(value, float):
            a.double_value = value
        else:
            a.string_value = value if isinstance(value, str) else json.dumps(value)

    td = track(P)
    td.process.pid = pid
    td.process.process_name = _trace_title(report)
    td = track(T, parent=P)
    td.thread.pid = pid
    td.thread.tid = tid
    td.thread.thread_name = "CPU (host thread)"
    track(G, _gpu_track_name(report), parent=P)
    track(MEM, "GPU memory allocated (bytes)", parent=P, unit=pb.CounterDescriptor.UNIT_SIZE_BYTES)
    track(LIVE, "live tensors (bytes)", parent=P, unit=pb.CounterDescriptor.UNIT_SIZE_BYTES)
    losses = [s for s in report.step_records if s.loss is not None]
    if losses:
        track(LOSS, "loss", parent=P)

    t_first = min([s.start_ns for s in report.spans] + [d.begin_ns for d in report.dispatches] or [0])

    # Metadata: an instant on the GPU track with the adapter and the timing mode.
    p = packet(t_first)
    ev = p.track_event
    ev.type = pb.TrackEvent.TYPE_INSTANT
    ev.track_uuid = G
    ev.name = "profile metadata"
    for k, v in (("model", report.model), ("adapter", report.adapter.get("name", "")),
                 ("backend", report.adapter.get("backend", "")), ("software", bool(report.adapter.get("software"))),
                 ("timestamps", report.timestamps), ("mode", report.mode),
                 ("timestamp_period_ns", float(report.timestamp_period)),
                 ("clock_alignment", report.clock_alignment), ("steps", report.steps),
                 ("dispatches_per_step", report.dispatches_per_step)):
        annotate(ev, k, v)
    if report.note:
        annotate(ev, "note", report.note)

    # Flow ids: one per dispatch, from its step's submit to its GPU slice.
    submits = _submit_spans(report)
    flows: dict[int, list[int]] = {}   # id(submit span) -> flow ids
    flow_of: dict[int, int] = {}       # dispatch position -> flow id
    for k, d in enumerate(report.dispatches):
        src = _flow_source(report, submits, d)
        if src is not None:
            fid = 1000 + k
            flows.setdefault(id(src), []).append(fid)
            flow_of[k] = fid

    for ts, kind, s in _nest(report.spans):
        p = packet(ts)
        ev = p.track_event
        ev.track_uuid = T
        if kind == "B":
            ev.type = pb.TrackEvent.TYPE_SLICE_BEGIN
            ev.name = s.name
            ev.categories.append("cpu")
            for k, v in s.args.items():
                annotate(ev, k, v)
            ev.flow_ids.extend(flows.get(id(s), []))
        else:
            ev.type = pb.TrackEvent.TYPE_SLICE_END

    for k, (d, b, e) in enumerate(_gpu_slices(report)):
        p = packet(b)
        ev = p.track_event
        ev.type = pb.TrackEvent.TYPE_SLICE_BEGIN
        ev.track_uuid = G
        ev.name = d.kernel
        ev.categories.append("gpu")
        for key, v in (("step", d.step), ("index", d.index), ("archetype", d.archetype),
                       ("nodes", ", ".join(d.nodes)), ("ops", ", ".join(d.ops)),
                       ("shapes", json.dumps(d.shapes)), ("workgroups", "x".join(str(w) for w in d.workgroups)),
                       ("bytes", d.bytes), ("flops", d.flops), ("gpu_ns", d.gpu_ns),
                       ("gb_per_s", float(d.gb_per_s)), ("tflop_per_s", float(d.tflop_per_s))):
            annotate(ev, key, v)
        if k in flow_of:
            ev.terminating_flow_ids.append(flow_of[k])
        p = packet(e)
        ev = p.track_event
        ev.type = pb.TrackEvent.TYPE_SLICE_END
        ev.track_uuid = G

    def counter(uuid, ts, value):
        p = packet(ts)
        ev = p.track_event
        ev.type = pb.TrackEvent.TYPE_COUNTER
        ev.track_uuid = uuid
        if isinstance(value, float):
            ev.double_counter_value = value
        else:
            ev.counter_value = int(value)

    counter(MEM, t_first, report.memory.get("allocated_bytes", 0))
    for s in report.step_records:
        counter(MEM, s.start_ns, report.memory.get("allocated_bytes", 0))
    for ts, v in _live_series(report):
        counter(LIVE, ts, v)
    for s in losses:
        counter(LOSS, s.submit_end_ns, float(s.loss))

    out = _atomic_write(path, builder.serialize())
    report.trace = str(path)
    return out


def chrome_trace(report: ProfileReport) -> dict:
    """The report as a Chrome trace-event JSON object (chrome://tracing, Perfetto UI)."""
    pid, cpu, gpu = os.getpid(), 1, 2
    us = lambda ns: ns / 1e3
    ev = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": _trace_title(report)}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": cpu, "args": {"name": "CPU (host thread)"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": gpu, "args": {"name": _gpu_track_name(report)}},
    ]
    for s in sorted(report.spans, key=lambda s: (s.start_ns, s.depth)):
        ev.append({"ph": "X", "cat": "cpu", "name": s.name, "pid": pid, "tid": cpu, "ts": us(s.start_ns),
                   "dur": us(s.dur_ns), "args": dict(s.args)})
    submits = _submit_spans(report)
    for k, (d, b, e) in enumerate(_gpu_slices(report)):
        ev.append({"ph": "X", "cat": "gpu", "name": d.kernel, "pid": pid, "tid": gpu, "ts": us(b), "dur": us(e - b),
                   "args": {"step": d.step, "index": d.index, "archetype": d.archetype, "nodes": d.nodes,
                            "ops": d.ops, "shapes": d.shapes, "workgroups": list(d.workgroups),
                            "bytes": d.bytes, "flops": d.flops, "gpu_ns": d.gpu_ns}})
        src = _flow_source(report, submits, d)
        if src is not None:
            ev.append({"ph": "s", "cat": "submit", "name": "submit", "id": k + 1, "pid": pid, "tid": cpu,
                       "ts": us(src.start_ns)})
            ev.append({"ph": "f", "bp": "e", "cat": "submit", "name": "submit", "id": k + 1, "pid": pid,
                       "tid": gpu, "ts": us(b)})
    for s in report.step_records:
        ev.append({"ph": "C", "name": "GPU memory allocated", "pid": pid, "ts": us(s.start_ns),
                   "args": {"bytes": report.memory.get("allocated_bytes", 0)}})
        if s.loss is not None:
            ev.append({"ph": "C", "name": "loss", "pid": pid, "ts": us(s.submit_end_ns), "args": {"loss": s.loss}})
    for ts, v in _live_series(report):
        ev.append({"ph": "C", "name": "live tensors", "pid": pid, "ts": us(ts), "args": {"bytes": v}})
    meta = {"model": report.model, "adapter": report.adapter, "timestamps": report.timestamps,
            "mode": report.mode, "clock_alignment": report.clock_alignment, "note": report.note}
    return {"traceEvents": ev, "displayTimeUnit": "ns", "otherData": meta}


def write_chrome_trace(report: ProfileReport, path) -> Path:
    """Write ``report`` as Chrome trace-event JSON."""
    out = _atomic_write(path, json.dumps(chrome_trace(report), default=float).encode())
    report.trace = str(path)
    return out
