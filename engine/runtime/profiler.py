"""Per-dispatch GPU profiling: ``profile_session(session, steps)`` (also
``Session.profile``) runs steps with a GPU timestamp around every dispatch and returns a
``ProfileReport``.

Timing modes (``ProfileReport.mode``): ``inside-passes`` (timestamps inside the step's
one compute pass), ``per-pass`` (a compute pass per dispatch with ``timestamp_writes``),
``cpu-wall-per-submission`` (no ``timestamp-query``: each dispatch submitted alone and
timed on the CPU; the report says so). GPU times are put on the CPU clock
(``clock_alignment`` says how). Setting ``MEGANEURA_TRACE=out.pftrace`` (or ``.json``)
makes any process that profiled write its last profile there at exit.

Training sessions plug in through the protocol an inference session offers:
``record(encoder, timestamps=None, dispatches=None)``, ``_steps`` / ``step_dispatches``
or ``profile_dispatches()``, an optional ``prepare_step()`` and ``is_training = True``.
"""

from __future__ import annotations

import atexit
import math
import statistics
import time
from pathlib import Path
from typing import Callable

from ..config import current
from ..errors import MeganeuraError
from ..files import json_text, write_atomically
from .dispatches import DispatchInfo, session_dispatches
from .report import DispatchRecord, FALLBACK_NOTE, MAX_QUERIES, MODE_CPU, MODE_INSIDE, MODE_PER_PASS, ProfileReport, SpanRecorder, StepRecord, _fmt_ns, add_build_spans
from .trace import write_chrome_trace, write_perfetto


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


def _memory(session, stamps: DispatchTimestamps | None, infos: list[DispatchInfo]) -> dict:
    """What the session allocated, and the plan's memory timeline (engine.compile.memory)
    over the recorded dispatches of a step (``peak_dispatch`` is a position among them)."""
    from ..compile.memory import memory_timeline
    seen, allocated = set(), 0
    for b in session.buffers:
        if id(b) not in seen:
            seen.add(id(b))
            allocated += int(b.size)
    meta = int(getattr(getattr(session, "meta_buffer", None), "size", 0) or 0)
    recorded = [i.plan_index for i in infos if i.plan_index is not None]
    timeline = memory_timeline(session.plan, session.graph, recorded)
    timestamp_bytes = stamps.nbytes if stamps else 0
    return {"allocated_bytes": allocated + meta + timestamp_bytes, "tensor_bytes": allocated,
            "timestamp_bytes": timestamp_bytes, "plan_bytes": timeline.allocated_bytes,
            "unshared_bytes": timeline.unshared_bytes, "saved_bytes": timeline.saved_bytes,
            "pinned_bytes": timeline.pinned_bytes, "live_bytes": timeline.live_bytes,
            "peak_bytes": timeline.peak_bytes, "peak_dispatch": timeline.peak_dispatch,
            "peak_buffers": timeline.peak_buffers}


def _adapter() -> dict:
    try:
        from .device import adapter_summary
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
                          gpu_ns=max(0, end - begin), begin_ns=begin, end_ns=max(begin, end), module=info.module)


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
    if current().trace and not _ATEXIT:
        atexit.register(_write_env_trace)
        _ATEXIT = True


def _write_env_trace() -> None:
    path = current().trace
    if not path or not _LAST:
        return
    try:
        write_trace(_LAST[-1], path)
    except Exception as e:  # at exit: say what went wrong, never raise
        import sys
        print(f"meganeura: could not write MEGANEURA_TRACE={path}: {e}", file=sys.stderr)


def write_profile_json(report: ProfileReport, path) -> Path:
    """The report as ``profile --json`` prints it (what ``meganeura compare`` reads)."""
    return write_atomically(path, json_text(report.to_dict()), make_parents=True)


def write_trace(report: ProfileReport, path) -> Path:
    """Perfetto protobuf, or Chrome trace JSON when ``path`` ends in ``.json``."""
    return (write_chrome_trace if str(path).endswith(".json") else write_perfetto)(report, path)
