"""Trace export: ``write_perfetto`` (Perfetto protobuf through the perfetto package's
``TraceProtoBuilder``), ``chrome_trace`` / ``write_chrome_trace`` (Chrome trace JSON), and
``write_trace``, which picks by the file's suffix. Files are written atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from ..files import json_text, write_atomically
from .report import DispatchRecord, MODE_CPU, ProfileReport, Span


# ---------------------------------------------------------------- export

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


def _phase_tracks(report: ProfileReport, gpu) -> dict[str, int]:
    """The GPU track of each phase (a generation's prefill and decode): ``gpu`` for
    dispatches without one, then ``gpu + 1``, ``gpu + 2``... in order of appearance
    (Chrome traces: thread ids; Perfetto: track uuids above all others)."""
    phases = dict.fromkeys(d.phase for d in report.dispatches if d.phase)
    return {"": gpu, **{phase: gpu + 0x1000 * (i + 1) for i, phase in enumerate(phases)}}


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
    gpu_tracks = _phase_tracks(report, G)
    for phase, uuid in gpu_tracks.items():
        if phase:
            track(uuid, f"{_gpu_track_name(report)}: {phase}", parent=P)
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
        ev.track_uuid = gpu_tracks[d.phase]
        ev.name = d.kernel
        ev.categories.append("gpu")
        for key, v in (("step", d.step), ("index", d.index), ("module", d.module), ("archetype", d.archetype),
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
        ev.track_uuid = gpu_tracks[d.phase]

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

    out = write_atomically(path, builder.serialize(), make_parents=True)
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
    gpu_tids = _phase_tracks(report, gpu)
    ev += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
            "args": {"name": f"{_gpu_track_name(report)}: {phase}"}} for phase, tid in gpu_tids.items() if phase]
    for s in sorted(report.spans, key=lambda s: (s.start_ns, s.depth)):
        ev.append({"ph": "X", "cat": "cpu", "name": s.name, "pid": pid, "tid": cpu, "ts": us(s.start_ns),
                   "dur": us(s.dur_ns), "args": dict(s.args)})
    submits = _submit_spans(report)
    for k, (d, b, e) in enumerate(_gpu_slices(report)):
        ev.append({"ph": "X", "cat": "gpu", "name": d.kernel, "pid": pid, "tid": gpu_tids[d.phase], "ts": us(b),
                   "dur": us(e - b),
                   "args": {"step": d.step, "index": d.index, "module": d.module, "archetype": d.archetype,
                            "nodes": d.nodes,
                            "ops": d.ops, "shapes": d.shapes, "workgroups": list(d.workgroups),
                            "bytes": d.bytes, "flops": d.flops, "gpu_ns": d.gpu_ns}})
        src = _flow_source(report, submits, d)
        if src is not None:
            ev.append({"ph": "s", "cat": "submit", "name": "submit", "id": k + 1, "pid": pid, "tid": cpu,
                       "ts": us(src.start_ns)})
            ev.append({"ph": "f", "bp": "e", "cat": "submit", "name": "submit", "id": k + 1, "pid": pid,
                       "tid": gpu_tids[d.phase], "ts": us(b)})
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
    out = write_atomically(path, json_text(chrome_trace(report), indent=None), make_parents=True)
    report.trace = str(path)
    return out
