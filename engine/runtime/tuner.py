"""``meganeura tune``: time the kernels each tuning number steers, at several values, on
this adapter, and cache the winners (engine/runtime/tuning.py reads them back).

Each field of ``Tuning`` (how many workgroups fill the GPU for a kernel family, and where
the smaller cooperative kernels win) has workloads shaped like the models' and a ladder
of values: the matmul fields every product of whisper-tiny's (batch 8 and 1), gpt-tiny's
and a SmolLM2-135M-shaped step (``MODEL_PRODUCTS``), the few-row products' decode steps'
MLPs (``DECODE_PRODUCTS``), the others attention at batch 1 and 2, bias gradients and
attention's dq.
Every value's plans are compiled with only that field changed; workloads whose plan no
value changes are not timed, and values that give the same dispatches are timed once.
The winner must beat the default by ``MARGIN`` on the mean over models of their
products' time relative to the default's, with no model's products slower by more than
``MARGIN`` (products timed alone: a step can still run slower, run 43),
and again when both are timed a few more times in turn, so noise does not move a number.
The GPU is kept busy first: an idle H100's clocks made the first field's kernels look up
to 4x slower.
A plan is timed as a model's step runs it: its dispatches back to back in one compute
pass, between that pass's two timestamps (``Session.record_bracketed``), the median of
``STEPS`` (CPU wall time per submission where the adapter has no timestamps). Three other
clocks misled on the H100: timestamps around each dispatch (``meganeura profile``'s)
charged a split kernel's second dispatch about 8 us of timer, so the tuner chose fewer
slices than the models run fastest with (run 43: matmul_resident 256 made gpt-tiny's
step 5% slower); a pass per dispatch made split kernels look 2-4x slower on wgpu-native
than they run inside a model; and wall time from submit to read-back moved by
milliseconds on Dawn, whose read-back polls. A software adapter (lavapipe) gets tiny
workloads: there it checks the machinery, not speed.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Callable

import numpy as np

from ..codegen import Capabilities, Tuning
from ..compile.plan import compile_plan
from ..graph.ir import Graph
from .device import adapter_info, device_capabilities, get_device, offered_capabilities
from .profiler import DispatchTimestamps, timestamp_period, timestamp_support
from .session import Session
from .tuning import tuning_key, write_tuning

MARGIN = 0.03   # a value must be this much faster than the default to replace it
STEPS = 7
CONFIRMATIONS = 3
WARM_UP_SECONDS = 1.5
TIMING_WARM_UP_SECONDS = 0.2   # each plan runs this long before it is timed (the clocks fall while plans build)


@dataclass(frozen=True)
class Workload:
    """One graph timed per value: ``build(graph)`` adds its inputs and output. ``group``:
    the model whose step it stands for (a value must not make any group slower)."""

    name: str
    build: Callable[[Graph], None]
    group: str = "other"


def _matmul(m: int, n: int, k: int, transpose_a: bool = False, group: str = "other", transpose_b: bool = False,
            batch: tuple[int, int] = (1, 1)) -> Workload:
    """An m x n product over k; ``batch``: A's and B's leading batch (1: none; a stack of
    B's, one A: q/k/v's weights)."""
    def build(g):
        a = (k, m) if transpose_a else (m, k)
        b = (n, k) if transpose_b else (k, n)
        a, b = ((count, *shape) if count > 1 else shape for count, shape in zip(batch, (a, b)))
        g.output("c", g.matmul(g.input("a", a), g.input("b", b), transpose_a=transpose_a, transpose_b=transpose_b))
    stacked = "x".join(str(c) for c in batch if c > 1)
    marks = "".join(mark for mark, on in ((" (Aᵀ)", transpose_a), (" (Bᵀ)", transpose_b)) if on)
    return Workload(f"matmul {stacked + ' x ' if stacked else ''}{m}x{n}x{k}{marks}", build, group)


def graph_products(graph: Graph, group: str) -> list[Workload]:
    """The distinct products of ``graph`` (its matmul and fused_matmul nodes, rows of a
    batched A flattened where B is shared) as workloads of ``group``: ``meganeura tune
    SOURCE`` adds a user's model to those the matmul fields may not make slower.
    Products of batched A and B beyond one leading axis are left out."""
    seen: dict[tuple, Workload] = {}
    for node in graph.nodes:
        if node.op not in ("matmul", "fused_matmul"):
            continue
        a, b = (tuple(graph[i].shape) for i in node.inputs[:2])
        ta, tb = bool(node.attrs.get("transpose_a")), bool(node.attrs.get("transpose_b"))
        if len(b) == 2 and not ta:
            a = (math.prod(a[:-1]), a[-1])                  # rows of every batch share B
        if len(a) > 3 or len(b) > 3 or (len(a) == 3 and len(b) == 3 and a[0] != b[0]):
            continue
        batch = (a[0] if len(a) == 3 else 1, b[0] if len(b) == 3 else 1)
        (k, m), (n, _) = (a[-2:] if ta else a[-2:][::-1]), (b[-2:] if tb else b[-2:][::-1])
        key = (m, n, k, ta, tb, batch)
        seen.setdefault(key, _matmul(m, n, k, ta, group, tb, batch))
    return list(seen.values())


def model_products(model, group: str, train: bool = True) -> list[Workload]:
    """``graph_products`` of ``model``'s step as a session compiles it: its training step
    (optimized, differentiated and optimized again, through the graph cache) where
    ``train``, else its inference graph."""
    from ..compile.cache import cached_optimize, cached_training_graph
    graph = model.build(train=train)
    graph = cached_training_graph(graph, "loss")[0] if train else cached_optimize(graph)[0]
    return graph_products(graph, group)


def _layer_products(group: str, tokens: int, width: int, qkv: int, ffn: int) -> list[Workload]:
    """The products of a pre-norm transformer layer's training step over ``tokens`` rows:
    the forward's (q/k/v, out projection, fc1, fc2), the input gradients of q/k/v and fc1
    (the others have forward shapes), and the four weight gradients (K = tokens)."""
    shapes = [(tokens, qkv, width), (tokens, width, width), (tokens, ffn, width), (tokens, width, ffn),
              (tokens, width, qkv)]
    products = [_matmul(m, n, k, group=group) for m, n, k in shapes]
    return products + [_matmul(m, n, tokens, True, group) for m, n in ((width, qkv), (width, width), (width, ffn),
                                                                         (ffn, width))]


# The models whose products the matmul fields are tuned on, every product each one's step
# runs: a field's value must not make any of them slower. A ladder of a few chosen products
# missed most of those its values change (run 43: matmul_resident 128 won its ladder by 8%,
# as it took 128 x 96 tiles from whisper's N = 384 products, which the ladder lacked, and
# whisper-tiny's b8 step ran 0.47 ms slower).
MODEL_PRODUCTS = [*_layer_products("whisper-tiny b8", 12000, 384, 1152, 1536),
                  *_layer_products("whisper-tiny b1", 1500, 384, 1152, 1536),
                  *_layer_products("gpt-tiny b8", 2048, 384, 1152, 1536),
                  *_layer_products("SmolLM2-135M 4x256", 1024, 576, 960, 1536)]


def _decode_stack(layers: int, width: int, hidden: int, group: str = "other", out_in: bool = False) -> Workload:
    """A one-token MLP stack: ``layers`` pairs of one-row products, width -> hidden ->
    width, each pair with weights of its own, so that (as in a decode step) they stream
    from memory rather than from the L2: one product alone, timed back to back, would.
    ``out_in``: the weights bf16 parameters kept [out, in], as generation keeps a
    checkpoint's (engine.optimize.bf16_weights)."""
    def weight(g, name: str, k: int, n: int):
        return g.parameter(name, (n, k), dtype="bf16") if out_in else g.input(name, (k, n))

    def build(g):
        x = g.input("x", (1, width))
        for i in range(layers):
            up = g.matmul(x, weight(g, f"up{i}", width, hidden), transpose_b=out_in)
            x = g.matmul(up, weight(g, f"down{i}", hidden, width), transpose_b=out_in)
        g.output("y", x)
    kept = ", weights [out, in]" if out_in else ""
    return Workload(f"decode {layers} x {width}-{hidden}-{width}{kept}", build, group)


# Decode steps' products, which the vector kernel runs (vector_layout): SmolLM2-135M's
# 30 layers of 3.5 MB weights and Llama-3.2-1B's MLP (two 64 MiB weights a layer) and
# attention projections (16 MiB).
DECODE_STACKS = [(30, 576, 1536, "SmolLM2-135M decode"), (4, 2048, 8192, "Llama-3.2-1B decode"),
                 (8, 2048, 2048, "Llama-3.2-1B decode")]
DECODE_PRODUCTS = [_decode_stack(*stack) for stack in DECODE_STACKS]
DECODE_OUT_IN = [_decode_stack(*stack, out_in=True) for stack in DECODE_STACKS]   # generation's layout


def _column_sum(rows: int, cols: int) -> Workload:
    def build(g):
        g.output("s", g.apply("sum_to", g.input("x", (rows, cols)), shape=(cols,)))
    return Workload(f"sum {rows}x{cols} over rows", build)


def _attention(batch: int, seq: int, heads: int, head_dim: int) -> Workload:
    def build(g):
        q, k, v = (g.input(n, (batch, seq, heads * head_dim)) for n in "qkv")
        g.output("o", g.attention(q, k, v, num_heads=heads))
    return Workload(f"attention b{batch} {seq}x{seq} {heads}x{head_dim}", build)


def _attention_grads(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                     dkdv: bool = False) -> Workload:
    """dq of one attention, and with ``dkdv`` its dk and dv too: then, on cooperative
    matrices, dq is the product of the dS that dk/dv's kernel writes."""
    def build(g):
        q, dout = (g.input(n, (batch, seq, heads * head_dim)) for n in ("q", "dout"))
        k, v = (g.input(n, (batch, seq, kv_heads * head_dim)) for n in "kv")
        lse, delta = (g.input(n, (batch, seq, heads)) for n in ("lse", "delta"))
        attrs = dict(num_heads=heads, num_kv_heads=kv_heads, causal=causal)
        if dkdv:
            g.output("kv", g.apply("attention_grad_kv", q, k, v, dout, lse, delta, **attrs))
        g.output("dq", g.apply("attention_grad_q", q, k, v, dout, lse, delta, **attrs))
    what = f"{'backward' if dkdv else 'dq'} b{batch} {seq}{' causal' if causal else ''}"
    return Workload(f"attention {what} {heads}/{kv_heads}x{head_dim}", build)


# field -> (values tried, workloads on a GPU, workloads on a software adapter)
LADDERS: dict[str, tuple[tuple[int, ...], list[Workload], list[Workload]]] = {
    "matmul_resident": ((64, 128, 256, 512, 1024, 2048),
                        [*MODEL_PRODUCTS, *DECODE_PRODUCTS, _matmul(32, 4096, 4096)], [_matmul(192, 192, 2048, True)]),
    "attention_fill": ((96, 192, 384, 768, 1536, 3072),
                       [_attention(1, 1500, 6, 64), _attention(2, 1500, 6, 64), _attention(1, 512, 9, 64)],
                       [_attention(1, 1024, 1, 16)]),
    "sum_workgroups": ((16, 32, 64, 128, 256, 512),
                       [_column_sum(12000, 384), _column_sum(3000, 1536), _column_sum(1024, 49152)],
                       [_column_sum(256, 2048)]),
    "lean_k": ((1, 512, 1024, 2048), MODEL_PRODUCTS, [_matmul(192, 192, 2048, True)]),
    "dq_long_stream": ((128, 256, 512, 1024, 2048),
                       [_attention_grads(8, 256, 6, 6, 64, True), _attention_grads(4, 256, 9, 3, 64, True),
                        _attention_grads(2, 512, 6, 6, 64, True), _attention_grads(1, 1500, 6, 6, 64, False)],
                       [_attention_grads(1, 64, 2, 1, 16, True)]),
    "narrow_columns": ((1, 384, 768, 1536), [*MODEL_PRODUCTS, _matmul(12000, 768, 384)],
                       [_matmul(192, 192, 2048, True)]),
    "wide_fill": ((128, 256, 512, 1024), MODEL_PRODUCTS, [_matmul(192, 192, 2048, True)]),
    "split_small_cost": ((4, 6, 8, 12, 16), MODEL_PRODUCTS, [_matmul(192, 192, 2048, True)]),
    "dq_prefetch": ((1, 2, 3),
                    [_attention_grads(2, 1500, 6, 6, 64, False, dkdv=True),
                     _attention_grads(8, 256, 6, 6, 64, True, dkdv=True)],
                    [_attention_grads(1, 64, 1, 1, 64, True, dkdv=True)]),
    "vector_small_kib": ((1, 1024, 4096, 16384, 65536, 1 << 20), DECODE_PRODUCTS, [_decode_stack(2, 64, 1024)]),
    "vector_deep_columns": ((1, 2, 4), DECODE_OUT_IN, [_decode_stack(2, 64, 1024, out_in=True)]),
}
MATMUL_FIELDS = ("matmul_resident", "lean_k", "narrow_columns", "wide_fill", "split_small_cost")   # on MODEL_PRODUCTS
# fields that steer cooperative-matrix kernels only: tuned with f16 precision asked for, so
# that an adapter offering them times those kernels whatever precision the run asked for
COOPERATIVE_FIELDS = ("lean_k", "dq_long_stream", "narrow_columns", "wide_fill", "dq_prefetch")
# fields that steer the split f32 products only: tuned with f32 on the cooperative units
SPLIT_FIELDS = ("split_small_cost",)


def _plan_signature(plan) -> tuple:
    """What makes two plans time the same: their kernels, workgroups and meta words."""
    return tuple((d.key, tuple(d.workgroups), tuple(d.meta)) for d in plan.dispatches)


def _graph(workload: Workload) -> Graph:
    g = Graph(f"tune: {workload.name}")
    workload.build(g)
    return g


def _session(device, graph: Graph, plan, rng) -> Session:
    """A session of ``plan`` on random inputs, run once (buffers initialised, pipelines warm)."""
    session = Session(graph, plan, device)
    for name, node in graph.inputs.items():
        session.set_input(name, rng.standard_normal(graph[node].shape).astype(np.float32))
    session.run()
    return session


BRACKETED_RUNS = 2   # runs of a plan between one pair of timestamps


def _time_ms(session: Session) -> float:
    """A run of ``session``'s plan, in ms: the median over ``STEPS`` timings of
    ``BRACKETED_RUNS`` runs back to back between a pass's two timestamps; without
    timestamps (or for a plan that copies between dispatches), the median profiled step."""
    device = session.device
    if timestamp_support(device) is not None:
        stamps = DispatchTimestamps(device, 1, inside_passes=False)
        times = []
        try:
            for _ in range(STEPS):
                encoder = device.create_command_encoder(label="tune")
                session.record_bracketed(encoder, stamps.pass_writes(0), BRACKETED_RUNS)
                stamps.resolve(encoder)
                device.queue.submit([encoder.finish()])
                begin, end = stamps.read()
                times.append((end - begin) * timestamp_period(device) / BRACKETED_RUNS / 1e6)
            return statistics.median(times)
        except ValueError:
            pass
    report = session.profile(steps=STEPS, measure_overhead=False, include_build_spans=False)
    return statistics.median(report.gpu_step_ns) / 1e6


WARM_UP_BATCH = 32   # steps recorded into one command buffer while warming up


def _warm_up(session: Session, seconds: float) -> None:
    """Keep the GPU busy for ``seconds`` so its clocks have risen before anything is
    timed (an idle H100 ran the first field's kernels up to 4x slower): ``WARM_UP_BATCH``
    steps a submission, so that a plan of one short dispatch keeps the GPU busy too
    rather than waiting on the host between steps."""
    sync = session.buffers[next(iter(session.plan.outputs.values()))]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        encoder = session.device.create_command_encoder()
        for _ in range(WARM_UP_BATCH):
            session.record(encoder)
        session.device.queue.submit([encoder.finish()])
        session.device.queue.read_buffer(sync, 0, 4)


def tune_field(device, field: str, base: Capabilities, workloads: list[Workload], values, rng,
               progress=None, warm_seconds: float = 0.0) -> tuple[int, list[dict], dict]:
    """Time ``workloads`` at each of ``values`` of ``field`` (the rest of ``base.tuning``
    kept); returns the winner, one row per value (its summed ms and per-workload ms) and
    the confirmation: a winner other than the default is timed again against it,
    ``CONFIRMATIONS`` times each in turn, and kept only if its median still wins. A
    plan's first timing follows ``warm_seconds`` of running it (a confirmation's timings,
    back to back, follow one warm-up): while the host compiled the next plans, an H100's
    clocks fell back, and whole ladders were timed about 4x slow (run 38: whisper's fc1
    at 0.58-0.74 ms where it runs 0.14)."""
    default = getattr(Tuning(), field)
    values = sorted(set(values) | {default, getattr(base.tuning, field)})

    def measure(session: Session) -> float:
        if warm_seconds:
            _warm_up(session, warm_seconds)
        return _time_ms(session)

    graphs = {w.name: _graph(w) for w in workloads}
    plans = {}
    for value in values:
        caps = replace(base, tuning=replace(base.tuning, **{field: value}))
        for w in workloads:
            g = graphs[w.name]
            plans[value, w.name] = (g, compile_plan(g, loss=None, capabilities=caps))
    # a workload whose plan no value changes adds the same time to every value: not timed
    workloads = [w for w in workloads if len({_plan_signature(plans[v, w.name][1]) for v in values}) > 1]
    timed: dict[tuple, float] = {}
    keys_of: dict[int, list[tuple]] = {}
    rows = []
    for value in values:
        keys_of[value] = []
        for w in workloads:
            g, plan = plans[value, w.name]
            key = (w.name, _plan_signature(plan))
            if key not in timed:   # one session at a time: a ladder's would not all fit a small GPU
                timed[key] = measure(_session(device, g, plan, rng))
            keys_of[value].append(key)
        times = [timed[k] for k in keys_of[value]]
        rows.append({"value": value, "ms": float(sum(times)), "groups": _group_ms(workloads, times),
                     "workloads": {w.name: t for w, t in zip(workloads, times)}})
        if progress:
            progress(f"  {field} = {value}: {sum(times):.3f} ms")
    winner = pick_winner(rows, default)
    confirmation = {}
    if winner != default and keys_of[winner] != keys_of[default]:
        again = {winner: [], default: []}   # per workload: its CONFIRMATIONS timings at each value
        for w in workloads:
            pair = {value: _session(device, *plans[value, w.name], rng) for value in again}
            if warm_seconds:   # timed back to back from here on: one warm-up keeps the clocks up
                _warm_up(pair[winner], warm_seconds)
            timings = {value: [] for value in again}
            for _ in range(CONFIRMATIONS):
                for value, session in pair.items():
                    timings[value].append(_time_ms(session))
            for value in again:
                again[value].append(timings[value])
        median = {value: [statistics.median(t) for t in per_workload] for value, per_workload in again.items()}
        confirmation = {"winner": winner, "winner_ms": [float(sum(t)) for t in zip(*again[winner])],
                        "default_ms": [float(sum(t)) for t in zip(*again[default])]}
        if not _beats(_group_ms(workloads, median[winner]), _group_ms(workloads, median[default])):
            winner = default
        confirmation["kept"] = winner != default
        if progress:
            progress(f"  {field}: {confirmation['winner']} timed again against {default}: "
                     f"{'kept' if confirmation['kept'] else 'not kept'}")
    return winner, rows, confirmation


def _group_ms(workloads: list[Workload], times: list[float]) -> dict[str, float]:
    """The summed time of each group's workloads."""
    groups: dict[str, float] = {}
    for w, t in zip(workloads, times):
        groups[w.group] = groups.get(w.group, 0.0) + float(t)
    return groups


def _score(groups: dict[str, float], baseline: dict[str, float]) -> float:
    """The mean over groups of their time relative to ``baseline``'s (each model counts
    alike, however long its products run)."""
    return statistics.mean(groups[g] / baseline[g] if baseline[g] > 0 else 1.0 for g in baseline)


def _beats(groups: dict[str, float], baseline: dict[str, float]) -> bool:
    """Whether ``groups`` are faster than ``baseline`` by ``MARGIN`` on the whole
    (``_score``) with no group slower by more than ``MARGIN``."""
    return _score(groups, baseline) < 1 - MARGIN and all(
        groups[g] <= baseline[g] * (1 + MARGIN) for g in baseline)


def pick_winner(rows: list[dict], default: int) -> int:
    """The value with the best ``_score`` against ``default``'s times (rows without
    ``groups`` count as one group, their ``ms``), unless it does not ``_beat`` them."""
    groups = lambda r: r.get("groups") or {"all": r["ms"]}   # noqa: E731
    baseline = groups(next(r for r in rows if r["value"] == default))
    best = min(rows, key=lambda r: (_score(groups(r), baseline), r["value"] != default))
    return best["value"] if _beats(groups(best), baseline) else default


def measure_tuning(device=None, software: bool | None = None, fields=None, progress=None,
                   products: list[Workload] = ()) -> dict:
    """Tune ``fields`` (default: all) on the process's adapter; returns the winners
    (``tuning``), every value's time (``measurements``), how it was timed, when and how long.
    ``products`` (``graph_products`` of a user's model) join the matmul fields' ladders
    on a GPU (a software adapter times its tiny workloads only)."""
    device = device if device is not None else get_device()
    software = adapter_info()["software"] if software is None else software
    base = replace(device_capabilities(device), tuning=Tuning())
    cooperative = offered_capabilities(device)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    fields = list(fields or LADDERS)
    first = _graph(LADDERS[fields[0]][2 if software else 1][0])
    _warm_up(_session(device, first, compile_plan(first, loss=None, capabilities=base), rng),
             0.0 if software else WARM_UP_SECONDS)
    measurements, confirmations = {}, {}
    if software and products and progress:
        progress("a software adapter times tiny workloads only: the model's products are not timed")
    for field in fields:
        values, gpu_work, software_work = LADDERS[field]
        if progress:
            progress(f"tuning {field}")
        field_base = (replace(cooperative, tuning=base.tuning) if field in COOPERATIVE_FIELDS
                      else replace(cooperative, matmul_f16=False, tuning=base.tuning) if field in SPLIT_FIELDS
                      else base)
        if field in MATMUL_FIELDS:
            gpu_work = [*gpu_work, *products]
        winner, rows, confirmation = tune_field(device, field, field_base, software_work if software else gpu_work,
                                                values, rng, progress, 0.0 if software else TIMING_WARM_UP_SECONDS)
        base = replace(base, tuning=replace(base.tuning, **{field: winner}))
        measurements[field] = rows
        if confirmation:
            confirmations[field] = confirmation
    tuned = replace(base.tuning, source="tuned")
    models = sorted({w.group for w in (*MODEL_PRODUCTS, *DECODE_PRODUCTS, *products)} - {"other"})
    return {"tuning": asdict(tuned), "defaults": asdict(Tuning()), "measurements": measurements,
            "models": [] if software else models,
            "confirmations": confirmations,
            "timing": "gpu timestamps around each plan's pass" if timestamp_support(device)
            else "cpu wall time per submission",
            "seconds": time.perf_counter() - start,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def tune(cache_dir=None, progress=None, fields=None, products: list[Workload] = ()) -> dict:
    """Measure the adapter's tuning now and cache it (later plans read it); returns the
    measurement with ``key`` and ``path`` (where it was written)."""
    key = tuning_key(adapter_info())
    result = measure_tuning(fields=fields, progress=progress, products=products)
    path = write_tuning(key, result, cache_dir)
    return {**result, "key": key, "path": str(path)}
