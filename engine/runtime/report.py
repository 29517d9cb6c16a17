"""What a profile is: CPU spans, per-dispatch and per-step records, and the
``ProfileReport`` with its per-kernel and per-archetype totals and JSON form.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from .roofline import kernel_roofline


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
    module: str = ""    # the module its nodes came from (engine.graph.modules)
    phase: str = ""     # of a generation profile: "prefill" or "decode" (combine_phases)

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
    peaks: dict | None = None   # the adapter's roofs (engine.runtime.peaks), for the roofline
    build_seconds: float | None = None   # building the session profiled (optimize, compile, pipelines)

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
        """Per kernel name, with its roofline ``bound``, ``percent_of_peak`` and
        ``intensity`` (engine.runtime.roofline; bound and percent None without peaks)."""
        precision = self.adapter.get("matmul_precision", "f32")
        return [{**r, **kernel_roofline(r, self.peaks, precision)}
                for r in self._group(lambda d: _phased(d, d.kernel))]

    def per_archetype(self) -> list[dict]:
        return self._group(lambda d: _phased(d, d.archetype))

    def per_module(self) -> list[dict]:
        """Per block of the model (its layers and the modules beside them), in model order."""
        from .module_totals import module_rows
        return module_rows(self.dispatches, self.steps)

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
            "phases": list(dict.fromkeys(d.phase for d in self.dispatches if d.phase)),
            "dispatches": [{"step": d.step, "index": d.index, "kernel": d.kernel, "module": d.module, "phase": d.phase,
                            "archetype": d.archetype, "nodes": d.nodes, "ops": d.ops, "workgroups": list(d.workgroups),
                            "gpu_ns": d.gpu_ns, "bytes": d.bytes, "flops": d.flops,
                            "begin_ns": d.begin_ns} for d in self.dispatches],
            "gpu_step_ns": self.gpu_step_ns,
            "step_details": [asdict(s) for s in self.step_records],
            "per_kernel": self.per_kernel(),
            "per_archetype": self.per_archetype(),
            "modules": self.per_module(),
            "achieved": self.achieved(),
            "overhead": self.overhead,
            "memory": self.memory,
            "peaks": self.peaks,
            "build_seconds": self.build_seconds,
            "cpu_spans": [{"name": s.name, "depth": s.depth, "start_ns": s.start_ns, "dur_ns": s.dur_ns}
                          for s in self.spans],
            "trace": self.trace,
        }

    def format_table(self, top: int = 15, by: str = "kernel") -> str:
        """The ``top`` kernels (or archetypes) by total GPU time, like torch.profiler's
        ``key_averages().table()``; ``by="module"``: every block of the model, in model order."""
        if by == "module":
            from .module_totals import format_module_table
            total = sum(d.gpu_ns for d in self.dispatches)
            return "\n".join(format_module_table(self.per_module(), _fmt_ns) + [
                f"Self GPU time total: {_fmt_ns(total)} over {self.steps} steps ({self.mode})"])
        rows = self.per_kernel() if by == "kernel" else self.per_archetype()
        shown = rows[:top]
        name_w = max([len("Name")] + [len(short_kernel(r["name"])) for r in shown])
        name_w = min(name_w, 60)
        head = (f"{'Name':<{name_w}}  {'Archetype':<10}  {'GPU total %':>11}  {'GPU total':>10}  "
                f"{'GPU avg':>10}  {'GPU min':>10}  {'GPU max':>10}  {'# Calls':>7}  {'GB/s':>8}  {'TFLOP/s':>8}  "
                f"{'Bound':>7}  {'% peak':>6}")
        rule = "-" * len(head)
        lines = [rule, head, rule]
        for r in shown:
            r = dict(r, name=short_kernel(r["name"]))
            name = r["name"] if len(r["name"]) <= name_w else r["name"][:name_w - 3] + "..."
            lines.append(
                f"{name:<{name_w}}  {r['archetype']:<10}  {r['percent']:>10.2f}%  {_fmt_ns(r['gpu_ns']):>10}  "
                f"{_fmt_ns(r['avg_ns']):>10}  {_fmt_ns(r['min_ns']):>10}  {_fmt_ns(r['max_ns']):>10}  "
                f"{r['calls']:>7}  {r['gb_per_s']:>8.2f}  {r['tflop_per_s']:>8.4f}  {r.get('bound') or '-':>7}  "
                f"{_percent(r.get('percent_of_peak')):>6}")
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
        if self.peaks:
            p = self.peaks
            f16 = f", {p['flop_per_s_f16'] / 1e12:.4g} f16 (cooperative matmul)" if p.get("flop_per_s_f16") else ""
            lines.append(f"Roofs of this adapter: {p['flop_per_s_f32'] / 1e12:.4g} TFLOP/s f32{f16}, "
                         f"{p['bytes_per_s'] / 1e9:.4g} GB/s (Bound and % peak: docs/cli.md, roofline)")
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



def _phased(d: DispatchRecord, name: str) -> str:
    """A table row's name: a generation profile's rows are per phase (``decode:matmul``)."""
    return f"{d.phase}:{name}" if d.phase else name


def combine_phases(phases: list[tuple[str, "ProfileReport"]]) -> "ProfileReport":
    """One report of several profiles of one model (a generation's prefill and its decode
    steps): dispatches and steps in order, steps renumbered, each dispatch tagged with
    its phase, so tables group per phase and traces put each phase on a track of its own.
    Spans, memory, overhead and peaks are the last report's (pass all of them one
    SpanRecorder to keep every span)."""
    dispatches, steps, offset = [], [], 0
    for phase, report in phases:
        for d in report.dispatches:
            dispatches.append(replace(d, step=d.step + offset, phase=phase))
        steps += [replace(s, step=s.step + offset) for s in report.step_records]
        offset += report.steps
    last = phases[-1][1]
    return replace(last, steps=offset, dispatches=dispatches, step_records=steps)


def _percent(p: float | None) -> str:
    return "-" if p is None else f"{p:.1f}" if p < 99.95 else f"{p:.0f}"


def short_kernel(name: str) -> str:
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
