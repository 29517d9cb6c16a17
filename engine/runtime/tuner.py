"""``meganeura tune``: time the kernels each tuning number steers, at several values, on
this adapter, and cache the winners (engine/runtime/tuning.py reads them back).

Each field of ``Tuning`` (how many workgroups fill the GPU for a kernel family) has a
few workloads shaped like the models' (whisper's weight gradients and fc2, a thin
matmul with a long K, attention at batch 1, bias gradients) and a ladder of values.
Every value's plans are compiled with only that field changed; values that give the
same dispatches are timed once. The workloads' summed time picks the winner, which
must beat the default by ``MARGIN`` to replace it, so noise does not move a number.
A plan is timed the way ``meganeura profile`` times a model: GPU timestamps around each
dispatch inside one compute pass, the median step of ``STEPS`` (CPU wall time per
submission where the adapter has no timestamps). Two other clocks misled on the H100:
a pass per dispatch (needed without timestamps inside passes) made split kernels look
2-4x slower on wgpu-native than they run inside a model, and wall time from submit to
read-back moved by milliseconds on Dawn, whose read-back polls. A software adapter
(lavapipe) gets tiny workloads: there it checks the machinery, not speed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Callable

import numpy as np

from ..codegen import Capabilities, Tuning
from ..compile.plan import compile_plan
from ..graph.ir import Graph
from .device import adapter_info, device_capabilities, get_device
from .profiler import timestamp_support
from .session import Session
from .tuning import tuning_key, write_tuning

MARGIN = 0.03   # a value must be this much faster than the default to replace it
STEPS = 7


@dataclass(frozen=True)
class Workload:
    """One graph timed per value: ``build(graph)`` adds its inputs and output."""

    name: str
    build: Callable[[Graph], None]


def _matmul(m: int, n: int, k: int, transpose_a: bool = False) -> Workload:
    def build(g):
        a = g.input("a", (k, m) if transpose_a else (m, k))
        g.output("c", g.matmul(a, g.input("b", (k, n)), transpose_a=transpose_a))
    return Workload(f"matmul {m}x{n}x{k}{' (Aᵀ)' if transpose_a else ''}", build)


def _column_sum(rows: int, cols: int) -> Workload:
    def build(g):
        g.output("s", g.apply("sum_to", g.input("x", (rows, cols)), shape=(cols,)))
    return Workload(f"sum {rows}x{cols} over rows", build)


def _attention(batch: int, seq: int, heads: int, head_dim: int) -> Workload:
    def build(g):
        q, k, v = (g.input(n, (batch, seq, heads * head_dim)) for n in "qkv")
        g.output("o", g.attention(q, k, v, num_heads=heads))
    return Workload(f"attention b{batch} {seq}x{seq} {heads}x{head_dim}", build)


# field -> (values tried, workloads on a GPU, workloads on a software adapter)
LADDERS: dict[str, tuple[tuple[int, ...], list[Workload], list[Workload]]] = {
    "matmul_resident": ((64, 128, 256, 512, 1024, 2048),
                        [_matmul(384, 384, 12000, True), _matmul(1500, 384, 1536), _matmul(32, 4096, 4096),
                         _matmul(384, 1536, 2048, True)],
                        [_matmul(192, 192, 2048, True)]),
    "attention_fill": ((96, 192, 384, 768, 1536, 3072),
                       [_attention(1, 1500, 6, 64), _attention(2, 1500, 6, 64), _attention(1, 512, 9, 64)],
                       [_attention(1, 1024, 1, 16)]),
    "sum_workgroups": ((16, 32, 64, 128, 256, 512),
                       [_column_sum(12000, 384), _column_sum(3000, 1536), _column_sum(1024, 49152)],
                       [_column_sum(256, 2048)]),
}


def _plan_signature(plan) -> tuple:
    """What makes two plans time the same: their kernels, workgroups and meta words."""
    return tuple((d.key, tuple(d.workgroups), tuple(d.meta)) for d in plan.dispatches)


def _graph(workload: Workload) -> Graph:
    g = Graph(f"tune: {workload.name}")
    workload.build(g)
    return g


def _time_ms(device, graph: Graph, plan, rng) -> float:
    """The median profiled step of ``plan`` (of ``graph``) on random inputs, in ms."""
    session = Session(graph, plan, device)
    for name, node in graph.inputs.items():
        session.set_input(name, rng.standard_normal(graph[node].shape).astype(np.float32))
    session.run()
    report = session.profile(steps=STEPS, measure_overhead=False, include_build_spans=False)
    return statistics.median(report.gpu_step_ns) / 1e6


def tune_field(device, field: str, base: Capabilities, workloads: list[Workload], values, rng,
               progress=None) -> tuple[int, list[dict]]:
    """Time ``workloads`` at each of ``values`` of ``field`` (the rest of ``base.tuning``
    kept); returns the winner and one row per value: its summed ms and per-workload ms."""
    default = getattr(Tuning(), field)
    values = sorted(set(values) | {default, getattr(base.tuning, field)})
    graphs = [_graph(w) for w in workloads]
    seen: dict[tuple, float] = {}
    rows = []
    for value in values:
        caps = replace(base, tuning=replace(base.tuning, **{field: value}))
        times = []
        for w, g in zip(workloads, graphs):
            plan = compile_plan(g, loss=None, capabilities=caps)
            plan_key = (w.name, _plan_signature(plan))
            if plan_key not in seen:
                seen[plan_key] = _time_ms(device, g, plan, rng)
            times.append(seen[plan_key])
        rows.append({"value": value, "ms": float(sum(times)),
                     "workloads": {w.name: t for w, t in zip(workloads, times)}})
        if progress:
            progress(f"  {field} = {value}: {sum(times):.3f} ms")
    return pick_winner(rows, default), rows


def pick_winner(rows: list[dict], default: int) -> int:
    """The fastest value, unless it beats ``default``'s time by less than ``MARGIN``."""
    best = min(rows, key=lambda r: (r["ms"], r["value"] != default))
    baseline = next(r["ms"] for r in rows if r["value"] == default)
    return best["value"] if best["ms"] < baseline * (1 - MARGIN) else default


def measure_tuning(device=None, software: bool | None = None, fields=None, progress=None) -> dict:
    """Tune ``fields`` (default: all) on the process's adapter; returns the winners
    (``tuning``), every value's time (``measurements``), how it was timed, when and how long."""
    device = device if device is not None else get_device()
    software = adapter_info()["software"] if software is None else software
    base = replace(device_capabilities(device), tuning=Tuning())
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    measurements = {}
    for field in fields or LADDERS:
        values, gpu_work, software_work = LADDERS[field]
        if progress:
            progress(f"tuning {field}")
        winner, rows = tune_field(device, field, base, software_work if software else gpu_work, values, rng, progress)
        base = replace(base, tuning=replace(base.tuning, **{field: winner}))
        measurements[field] = rows
    tuned = replace(base.tuning, source="tuned")
    return {"tuning": asdict(tuned), "defaults": asdict(Tuning()), "measurements": measurements,
            "timing": f"gpu timestamps ({timestamp_support(device)})" if timestamp_support(device)
            else "cpu wall time per submission",
            "seconds": time.perf_counter() - start,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def tune(cache_dir=None, progress=None, fields=None) -> dict:
    """Measure the adapter's tuning now and cache it (later plans read it); returns the
    measurement with ``key`` and ``path`` (where it was written)."""
    key = tuning_key(adapter_info())
    result = measure_tuning(fields=fields, progress=progress)
    path = write_tuning(key, result, cache_dir)
    return {**result, "key": key, "path": str(path)}
