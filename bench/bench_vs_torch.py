"""Our engine against PyTorch on the same work, in one process: one table with our time,
torch's in each way users run it and the ratio to each (ours / torch: under 1 means we
are faster), and TFLOP/s where it applies.

    .venv/bin/python bench/bench_vs_torch.py            # full sizes (meant for a real GPU)
    .venv/bin/python bench/bench_vs_torch.py --quick    # tiny sizes: runs on lavapipe in seconds

Torch columns, each timed the same way as the row's eager fp32 one:
- eager fp32; eager bf16 (``torch.autocast`` around the forward and the loss, bf16 on
  CUDA, the CPU autocast without it); compile fp32 (``torch.compile``, default mode, of
  the forward and loss function, so the backward is compiled too; the optimizer step
  stays eager); compile bf16 (both). Each compiled cell starts from a cleared dynamo
  cache and gets at least one warm-up call, which compiles.
- infer whisper-tiny b8 also has hf fp32 and hf fp16: transformers' WhisperEncoder
  (whisper-tiny config, holding our model's weights) under ``no_grad``, fp32 and under
  fp16 autocast.
A cell that cannot run (torch.compile raising, no bf16, no transformers, ...) shows "-"
and the lines under the table say why. ``--quick`` leaves torch.compile out (on the
CPU it needs a C compiler and minutes); ``--compile`` puts it back, ``--no-compile``
leaves it out of a full run.

Rows:
- matmul MxNxK (f32): ours is a one-node graph session timed with GPU timestamps
  (engine.runtime.profiler, median over steps); torch is CUDA fp32 with TF32 off (timed
  with CUDA events, median) and bf16 operands (the eager bf16 column), with TF32 on as
  an extra TFLOP/s column; compile is not timed (one matmul is the same library call).
  The max relative error of ours against numpy float64 is printed too.
- train <model>: one full training step (forward, backward, AdamW update, loss read
  back) in wall time per step; torch does the same (``loss.item()`` every step). After
  warm-up, ours and each torch variant take turns: 3 rounds of 20 steps each side, so
  that a drift of the GPU's clocks or the host during the row reaches all sides alike;
  a cell is the median of its 60 steps, and the note gives each side's range of round
  medians.
- train whisper-tiny b8: the same at batch 8.
- audio-align smoke: the whole ``meganeura train audio-align`` recipe for 50 steps, wall
  time end to end (session build included; torch.compile's compilation likewise),
  against the same recipe in PyTorch; ours first with empty build caches, then again
  with the caches the first run filled (the row "..., warm cache"). Both GPU runtimes
  (CUDA context, our WebGPU device) are opened before the first row; torch's kernels
  load lazily, so its cells are slower when the smoke runs first.
- infer whisper-tiny: one forward pass; ours = run() back to back, synchronised by a
  4-byte read at the end, wall time / runs; torch under no_grad, CUDA events.
- infer whisper-tiny b8: the same at batch 8, with the transformers columns; its sides
  take turns like the training rows' (3 rounds, a cell the median of its rounds).
- host: CPU microseconds to record one dispatch (Session.record of a many-dispatch
  graph into an encoder, no wait); torch: CPU µs to launch one small op (no sync).
- steps/s mlp: training steps per second (the inverse of the mlp row, listed for the issue).
- memory: our plan's peak bytes (and all our buffers, optimizer state included) of a
  whisper-tiny training step against torch.cuda.max_memory_allocated over one eager fp32 step.
``--profile-gpt`` adds the profiler's per-archetype and per-kernel tables of one gpt-tiny
training step. ``--only`` and ``--skip`` pick rows by name prefix. Without CUDA, torch
runs on the CPU and the table says so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import torch_models  # noqa: E402
from torch_models import tr  # noqa: E402
from engine import models  # noqa: E402
from engine.graph.ir import Graph  # noqa: E402
from engine.runtime.session import build_inference_session  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402
from engine.train.session import build_session  # noqa: E402

FULL = {
    "matmul": [(1024, 1024, 1024), (4096, 4096, 4096), (32, 4096, 4096)],
    "mlp": ["batch=32"],
    "whisper-tiny": ["batch=1", "mel_len=3000"],
    "gpt-tiny": ["batch=8", "seq=256"],
    "whisper-tiny b8": ["batch=8", "mel_len=3000"],
    "infer whisper-tiny b8": ["batch=8", "mel_len=3000"],
    "audio-align": ["mel_len=500"], "smoke_steps": 50,
    "steps": 20, "mm_steps": 20, "warmup": 2, "rounds": 3,
}
QUICK = {
    "matmul": [(64, 64, 64), (128, 128, 128), (8, 128, 128)],
    "mlp": ["batch=8"],
    "whisper-tiny": ["batch=1", "mel_len=16"],
    "gpt-tiny": ["batch=1", "seq=8", "depth=2"],
    "whisper-tiny b8": ["batch=2", "mel_len=16"],
    "infer whisper-tiny b8": ["batch=2", "mel_len=16"],
    "audio-align": ["mel_len=16", "seq=4", "batch=2", "depth=2"], "smoke_steps": 1,
    "steps": 1, "mm_steps": 2, "warmup": 0, "rounds": 2,
}

ROW_NAMES = ["matmul", "train mlp", "train whisper-tiny", "train gpt-tiny", "train whisper-tiny b8",
             "audio-align smoke", "infer whisper-tiny", "infer whisper-tiny b8", "host record/dispatch",
             "steps/s mlp", "memory whisper-tiny train"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ torch timing

class TorchTimer:
    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def open_runtimes(self):
        """Open both sides' GPU before any row: torch's CUDA context and cuBLAS handle,
        our WebGPU device, so that neither device's start-up is charged to the first row
        (torch's kernels still load lazily, inside the first row that uses them: the
        smoke's eager fp32 cell is 1.0-1.2 s after other rows, 4.7-5.7 s as the first)."""
        from engine.runtime.device import get_device
        get_device()
        x = torch.ones(64, 64, device=self.device)
        (x @ x).sum().item()
        self.sync()

    def median_ms(self, fn, reps, warmup=3):
        """Median device time of fn() in ms (CUDA events; perf_counter on CPU)."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class TorchVariant:
    """One way users run the torch side: eager or ``torch.compile`` (default mode), in
    fp32 or with the forward under autocast to ``autocast``."""
    label: str
    compiled: bool = False
    autocast: torch.dtype | None = None

    def context(self, device):
        """The autocast region of the forward (and loss); a no-op in fp32."""
        return torch.autocast(device.type, dtype=self.autocast, enabled=self.autocast is not None)

    def prepare(self, fn):
        """``fn``, or ``torch.compile(fn)`` from a cleared dynamo cache, so that no other
        row's shapes turn this one's into dynamic-shape kernels."""
        if not self.compiled:
            return fn
        torch._dynamo.reset()
        return torch.compile(fn)

    def warmup(self, warmup: int) -> int:
        """Warm-up calls: at least one where the first call compiles."""
        return max(warmup, 1) if self.compiled else warmup


EAGER_FP32 = TorchVariant("eager fp32")
TORCH_VARIANTS = (EAGER_FP32, TorchVariant("eager bf16", autocast=torch.bfloat16),
                  TorchVariant("compile fp32", compiled=True),
                  TorchVariant("compile bf16", compiled=True, autocast=torch.bfloat16))
HF_VARIANTS = (TorchVariant("hf fp32"), TorchVariant("hf fp16", autocast=torch.float16))
COLUMNS = [v.label for v in TORCH_VARIANTS + HF_VARIANTS]


def one_line(exc: BaseException) -> str:
    """An exception as one short line: its type and the first two lines of its message
    (inductor puts the cause on the second)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()][:2]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:200]


class TorchColumns:
    """Runs one row's torch side in each variant. A variant that is left out or raises
    gives None and one line saying why; it never stops the run."""

    def __init__(self, device, compile_off: str | None = None):
        self.device = device
        self.compile_off = compile_off    # why torch.compile is left out, or None

    def left_out(self, variant: TorchVariant) -> str | None:
        if variant.compiled and self.compile_off:
            return self.compile_off
        if variant.autocast == torch.bfloat16 and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return "no bf16 on this GPU"
        return None

    def prepare(self, variants, make) -> tuple[dict, dict]:
        """({label: make(variant)} of the variants that run, {label: why not} of the others)."""
        made, why = self.run(variants, make)
        return {k: v for k, v in made.items() if v is not None}, why

    def run(self, variants, measure) -> tuple[dict, dict]:
        """({label: measure(variant) or None}, {label: why it is None})."""
        values, why = {}, {}
        for v in variants:
            values[v.label] = None
            reason = self.left_out(v)
            if reason is None:
                log(f"  torch {v.label}")
                try:
                    values[v.label] = measure(v)
                    continue
                except Exception as exc:  # a variant that fails is a finding, not a crash
                    reason = one_line(exc)
                    log(f"  torch {v.label} failed: {reason}")
            why[v.label] = reason
        return values, why


# ------------------------------------------------------------------ ours

def ours_matmul(m, n, k, steps, rng):
    g = Graph(f"matmul-{m}x{n}x{k}")
    a = g.input("a", (m, k))
    b = g.input("b", (k, n))
    g.output("c", g.matmul(a, b))
    s = build_inference_session(g, optimize=False)
    av = rng.standard_normal((m, k), dtype=np.float32)
    bv = rng.standard_normal((k, n), dtype=np.float32)
    s.set_inputs({"a": av, "b": bv})
    s.run()
    c = s.read_output("c")
    ref = av.astype(np.float64) @ bv.astype(np.float64)
    err = float(np.linalg.norm(c - ref) / np.linalg.norm(ref))
    rep = s.profile(steps=steps, measure_overhead=False, include_build_spans=False)
    ns = statistics.median(rep.gpu_step_ns)
    first = s.plan.dispatches[0]
    kernel = first.variant or first.kernel
    return ns / 1e6, err, kernel


def model_inputs(name, model, train, rng):
    g = model.build(train=train)
    out = {}
    for nm, nid in g.inputs.items():
        node = g[nid]
        if node.dtype == "i32":
            hi = 10 if name == "mlp" else 257
            out[nm] = rng.integers(0, hi, node.shape).astype(np.int32)
        else:
            out[nm] = rng.standard_normal(node.shape).astype(np.float32)
    return g, out


def ours_train(name, overrides, steps, rng, warmup=2):
    """(median ms per step, last loss, session, model, params, inputs, build seconds) of
    our training step: ``steps`` timed steps after ``warmup``."""
    s, model, params, inputs, build_s = ours_train_session(name, overrides, rng)
    for _ in range(warmup):
        s.step()
    times, loss = timed_steps(s.step, steps)
    return statistics.median(times), loss, s, model, params, inputs, build_s


def ours_train_session(name, overrides, rng):
    """(session, model, params, inputs, build seconds) of our training step on ``name``."""
    model = models.create(name, overrides)
    g, inputs = model_inputs(name, model, True, rng)
    params = model.init_params(0)
    t = time.perf_counter()
    s = build_session(g, TrainConfig(optimizer="adamw", lr=1e-4), params)
    build_s = time.perf_counter() - t
    s.set_inputs(inputs)
    return s, model, params, inputs, build_s


def timed_steps(step, steps: int) -> tuple[list[float], float]:
    """(wall ms of each of ``steps`` calls of ``step``, the last call's loss); ``step``
    returns the loss (or (loss, ...)) read back to the host, which ends each step."""
    times, loss = [], None
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        times.append((time.perf_counter() - t) * 1e3)
    return times, loss[0] if isinstance(loss, tuple) else loss


def ours_infer(name, overrides, steps, rng):
    s, model, params, inputs = ours_infer_session(name, overrides, rng)
    return back_to_back_run_ms(s, next(iter(s.graph.outputs)), steps), s, model, params, inputs


def ours_infer_session(name, overrides, rng):
    """(inference session, model, params, inputs) of ``name``'s forward."""
    model = models.create(name, overrides)
    g, inputs = model_inputs(name, model, False, rng)
    params = model.init_params(0)
    s = build_inference_session(g)
    s.set_parameters(params)
    s.set_inputs(inputs)
    return s, model, params, inputs


def back_to_back_run_ms(session, output: str, steps: int, warmup: int = 2) -> float:
    """Wall ms per ``run()`` of runs back to back, closed by one 4-byte read of ``output``."""
    sync_buf = session.buffers[session.plan.outputs[output]]
    q = session.device.queue
    for _ in range(warmup):
        session.run()
    q.read_buffer(sync_buf, 0, 4)
    t = time.perf_counter()
    for _ in range(steps):
        session.run()
    q.read_buffer(sync_buf, 0, 4)
    return (time.perf_counter() - t) * 1e3 / steps


def ours_record_us(session, reps=20):
    """CPU µs per dispatch to record ``session``'s dispatches into an encoder (no submit)."""
    dev = session.device
    per = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        enc = dev.create_command_encoder(label="bench")
        session.record(enc)
        enc.finish()
        per.append((time.perf_counter_ns() - t) / 1e3 / len(session._steps))
    return statistics.median(per), len(session._steps)


def _span_s(session, prefix: str) -> float:
    """Seconds of the session's build span whose name starts with ``prefix``."""
    return sum(end - start for name, start, end in session.build_spans if name.startswith(prefix)) / 1e9


def ours_smoke(model, params, config, batches) -> dict:
    """One run of our side of the smoke: the session built from nothing in this process
    (the on-disk caches of ``MEGANEURA_CACHE`` as they are), then the steps."""
    from engine.train.trainer import Trainer
    t = time.perf_counter()
    trainer = Trainer(model.build(train=True), params, config, backend="gpu")
    built = time.perf_counter()
    losses = trainer.fit(batches).losses
    end = time.perf_counter()
    return {"s": end - t, "build": built - t, "steps": end - built, "losses": losses,
            "pipelines": _span_s(trainer.session, "create pipelines")}


def audio_align_smoke(overrides, steps, timer, columns) -> list[dict]:
    """audio-align's training smoke (the recipe of ``meganeura train audio-align``):
    ``steps`` steps end to end, wall time from nothing built to the last loss, ours on
    the GPU against the same recipe, weights and batches in PyTorch (each variant; a
    compiled one's compilation counts, as our session build does). Ours runs twice: with
    empty build caches (a fresh ``MEGANEURA_CACHE``: a first run), then with the caches
    that run filled (every later ``meganeura train`` of the model); two rows."""
    import tempfile
    from engine import config as engine_config
    from engine.train.data import DataLoader
    log(f"audio-align smoke {' '.join(overrides)} x {steps} steps")
    model = models.create("audio-align", overrides)
    config = TrainConfig(**model.TRAIN_DEFAULTS, steps=steps, batch_size=model.settings["batch"], seed=0)
    params = model.init_params(0)
    loader = DataLoader(model.dataset(0), config.batch_size, shuffle=True, seed=0, drop_last=True)
    batches = [b for epoch in range(steps) for b in loader.batches(epoch)][:steps]
    with tempfile.TemporaryDirectory(prefix="meganeura-smoke-cache-") as cache:
        previous = engine_config.use(dataclasses.replace(engine_config.current(), cache_dir=cache))
        try:
            runs = [ours_smoke(model, params, config, batches) for _ in ("cold", "warm")]
        finally:
            engine_config.use(previous)
    losses = {}

    def recipe(variant):
        if variant.compiled:
            torch._dynamo.reset()
        timer.sync()
        t = time.perf_counter()
        losses[variant.label] = tr.audio_align_training_losses(model, params, batches, config, device=timer.device,
                                                               autocast=variant.autocast, compiled=variant.compiled)
        timer.sync()
        return time.perf_counter() - t

    torch_s, why = columns.run(TORCH_VARIANTS, recipe)
    theirs = losses.get(EAGER_FP32.label)
    versus = f" vs eager fp32's {theirs[0]:.3f} -> {theirs[-1]:.3f}" if theirs else ""
    name = f"audio-align smoke {steps} step{'s' if steps != 1 else ''}"
    return [{"name": name + suffix, "ours": run["s"], "torch": torch_s, "why": why, "unit": "s",
             "note": f"{' '.join(overrides)}; wall time incl. build ({caches}: build {run['build']:.2f} s, of which "
                     f"pipelines {run['pipelines']:.2f} s; steps {run['steps']:.2f} s); "
                     f"loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}{versus}"}
            for run, suffix, caches in zip(runs, ("", ", warm cache"),
                                           ("empty caches", "the first run's graph and plan caches"))]


# ------------------------------------------------------------------ torch

def torch_train(name, model, params, inputs, timer, warmup=2, variant=EAGER_FP32):
    """(the training step in ``variant`` from fresh weights and optimizer, warmed up: a
    function returning the loss, read back; ``torch.cuda.max_memory_allocated``, its
    peak reset before the warm-up, or None without CUDA)."""
    frozen = {"model.encoder.embed_positions.weight"} if name == "whisper-tiny" else set()
    w = torch_models.to_torch(model.to_file_layout(params), timer.device, frozen)
    x = {k: torch.tensor(v, device=timer.device) for k, v in inputs.items()}
    opt = torch.optim.AdamW([t for k, t in w.items() if t.requires_grad], lr=1e-4, weight_decay=0.0)
    loss_of = variant.prepare(lambda w, x: torch_models.loss_fn(name, w, x))

    def step():
        opt.zero_grad(set_to_none=True)
        with variant.context(timer.device):
            loss = loss_of(w, x)
        loss.backward()
        opt.step()
        return loss.item()

    if timer.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(variant.warmup(warmup)):
        step()
    return step, (torch.cuda.max_memory_allocated if timer.cuda else None)


def torch_infer(model, params, inputs, steps, timer, variant=EAGER_FP32):
    """ms of one whisper encoder forward (the tests' torch implementation) in ``variant``."""
    return timer.median_ms(torch_encoder_call(model, params, inputs, timer, variant), steps)


def torch_encoder_call(model, params, inputs, timer, variant):
    """One whisper encoder forward (the tests' torch implementation) in ``variant``: a function."""
    w = torch_models.to_torch(model.to_file_layout(params), timer.device, frozen=set(model.to_file_layout(params)))
    mel = torch.tensor(inputs["mel"], device=timer.device)
    return forward_call(variant.prepare(torch_models.whisper_encoder), (mel, w), timer, variant)


def forward_call(forward, args, timer, variant):
    """``forward(*args)`` under ``no_grad`` and ``variant``'s autocast: a function."""
    def call():
        with torch.no_grad(), variant.context(timer.device):
            forward(*args)
    return call


def hf_whisper_encoder(model, params, device):
    """transformers' WhisperEncoder holding our whisper-tiny's weights (the names are
    Hugging Face's already). WhisperConfig's defaults are whisper-tiny's sizes; it insists
    on exactly 2 * max_source_positions mel frames, so that is sized to ours."""
    import transformers
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    frames = model.settings["mel_len"] // 2
    encoder = WhisperEncoder(transformers.WhisperConfig(max_source_positions=frames))
    state = {k.removeprefix("model.encoder."): torch.tensor(v) for k, v in model.to_file_layout(params).items()}
    state["embed_positions.weight"] = state["embed_positions.weight"][:frames]
    encoder.load_state_dict(state, strict=True)
    return encoder.to(device).eval()


def torch_matmul(a, b, timer, steps, variant) -> float:
    """ms of ``a @ b``: fp32 with TF32 off, or with the operands in ``variant``'s autocast dtype."""
    if variant.autocast is not None:
        a, b = a.to(variant.autocast), b.to(variant.autocast)
    return timer.median_ms(lambda: a @ b, steps)


def torch_launch_us(timer, n=2000):
    x = torch.zeros(16, device=timer.device)
    timer.sync()
    for _ in range(50):
        x.add_(1.0)
    timer.sync()
    t = time.perf_counter_ns()
    for _ in range(n):
        x.add_(1.0)
    dt = (time.perf_counter_ns() - t) / 1e3 / n
    timer.sync()
    return dt


# ------------------------------------------------------------------ table

def fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v == 0 or not math.isfinite(v):
        return f"{v}{unit}"
    if abs(v) >= 100:
        return f"{v:.0f}{unit}"
    if abs(v) >= 10:
        return f"{v:.1f}{unit}"
    if abs(v) >= 1:
        return f"{v:.2f}{unit}"
    return f"{v:.3g}{unit}"


TFLOPS_COLUMNS = ("ours", "fp32", "tf32", "bf16")


def print_table(rows, torch_desc, adapter):
    """One line per row: ours, then each torch column that any row has (its time and
    ours / it), TFLOP/s where a row has them, the note; then why each "-" is one."""
    labels = [c for c in COLUMNS if any(c in r["torch"] for r in rows)]
    tflops = any("tflops" in r for r in rows)
    cols = ["workload", "ours"] + [c for label in labels for c in (label, f"ours/{label}")] \
        + ([f"{c} TFLOP/s" for c in TFLOPS_COLUMNS] if tflops else []) + ["note"]
    data = []
    for r in rows:
        unit = " " + r["unit"]
        cells = [r["name"], fmt(r["ours"], unit)]
        for label in labels:
            theirs = r["torch"].get(label)
            cells += [fmt(theirs, unit), fmt(r["ours"] / theirs if theirs else None)]
        if tflops:
            cells += [fmt(r.get("tflops", {}).get(c)) for c in TFLOPS_COLUMNS]
        data.append(cells + [r.get("note", "")])
    print(f"ours: {adapter}")
    print(f"torch: {torch_desc}")
    print(markdown_table(cols, data))
    for line in failure_notes(rows):
        print(line)
    sys.stdout.flush()


def failure_notes(rows) -> list[str]:
    """One line per reason a torch cell shows "-": the columns and rows it hit, and why."""
    rows_hit: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        for label, why in r.get("why", {}).items():
            rows_hit.setdefault(why, {}).setdefault(label, []).append(r["name"])
    lines = []
    for why, by_label in rows_hit.items():
        labels_hit: dict[tuple, list[str]] = {}
        for label, names in by_label.items():
            labels_hit.setdefault(tuple(names), []).append(label)
        where = "; ".join(f"{', '.join(labels)} in {', '.join(names)}" for names, labels in labels_hit.items())
        lines.append(f"- {where}: {why}")
    return lines


def markdown_table(cols, rows) -> str:
    """A Markdown table with padded columns (the form docs/benchmarks.md keeps)."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def adapter_desc():
    from engine.runtime.device import get_device
    dev = get_device()
    try:
        info = dev.adapter.info
        return f"{info.get('device', '?')} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')})"
    except Exception:
        return "wgpu adapter"


@contextlib.contextmanager
def without_tf32():
    """torch's fp32 products and convolutions in fp32: on a GPU both default to TF32 (cuDNN's
    convolutions always, cuBLAS's matmuls where asked), whose 10-bit mantissas are no
    reference for ours."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def matmul_rows(shapes, mm_steps, rng, timer, columns) -> list[dict]:
    """Ours (timestamped) against torch fp32 (TF32 off) and bf16, TF32 as TFLOP/s only."""
    rows = []
    reps = max(mm_steps, 10)
    for m, n, k in shapes:
        log(f"matmul {m}x{n}x{k}")
        flops = 2.0 * m * n * k
        ours_ms, err, kernel = ours_matmul(m, n, k, mm_steps, rng)
        a = torch.randn(m, k, device=timer.device)
        b = torch.randn(k, n, device=timer.device)
        torch.backends.cuda.matmul.allow_tf32 = False
        times, why = columns.run([v for v in TORCH_VARIANTS if not v.compiled],
                                 lambda v: torch_matmul(a, b, timer, reps, v))
        for v in TORCH_VARIANTS:
            if v.compiled:
                times[v.label], why[v.label] = None, "not timed: compiled, one matmul is the same library call"
        tf32 = None
        if timer.cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            tf32 = flops / timer.median_ms(lambda: a @ b, reps) / 1e9
            torch.backends.cuda.matmul.allow_tf32 = False
        rate = lambda ms: flops / ms / 1e9 if ms else None
        rows.append({"name": f"matmul {m}x{n}x{k}", "ours": ours_ms, "torch": times, "why": why, "unit": "ms",
                     "tflops": {"ours": rate(ours_ms), "fp32": rate(times["eager fp32"]), "tf32": tf32,
                                "bf16": rate(times["eager bf16"])},
                     "note": f"rel err {err:.1e}; {kernel}"})
    return rows


def train_row(row, cfg, steps, rng, timer, columns):
    """(the row of one model's training step in each torch variant, our session, the
    eager fp32 peak CUDA bytes or None). Ours and each torch variant take turns for
    ``cfg["rounds"]`` rounds of ``steps`` steps (``interleaved_rounds``); each cell is the
    median of all its steps, and the note gives each side's range of round medians."""
    name = row.split()[0]
    log(f"train {row} {' '.join(cfg[row])}")
    s, model, params, inputs, build_s = ours_train_session(name, cfg[row], rng)
    for _ in range(cfg["warmup"]):
        s.step()
    peak = {}

    def prepare(variant):
        step, max_bytes = torch_train(name, model, params, inputs, timer, cfg["warmup"], variant)
        if variant is EAGER_FP32 and max_bytes is not None:   # built first: no other variant's memory yet
            step()
            peak["eager"] = max_bytes()
        return step

    sides, why = columns.prepare(TORCH_VARIANTS, prepare)
    times, losses, why_more = interleaved_rounds({k: steps_of(step, steps) for k, step in
                                                  {"ours": s.step, **sides}.items()}, cfg["rounds"])
    why.update(why_more)
    median = medians(times)
    eager = losses.get(EAGER_FP32.label)
    versus = f" vs {eager:.4g}" if eager is not None else ""
    return ({"name": f"train {row}", "ours": median["ours"],
             "torch": {v.label: median.get(v.label) for v in TORCH_VARIANTS},
             "why": why, "unit": "ms",
             "note": f"{' '.join(cfg[row])}; {len(s._steps)} dispatches; loss {losses['ours']:.4g}{versus}; "
                     f"build {build_s:.1f} s{rounds_note(times)}"},
            s, peak.get("eager"))


def interleaved_rounds(sides: dict, rounds: int) -> tuple[dict, dict, dict]:
    """Each side's times in ms: ``rounds`` rounds in which every side (name -> a function
    timing one round: (times in ms, the last loss or None)) runs in turn, so that a
    drift of the GPU's clocks or of the host during the row reaches every side alike
    (run 40 saw one kernel's time change 2-4x between machines and minutes). Returns
    ({name: {"all": times, "rounds": [median of each round]}}, {name: last loss},
    {name: why it stopped}); a side that raises keeps no times and says why in one line."""
    times = {name: {"all": [], "rounds": []} for name in sides}
    losses, why = {}, {}
    for _ in range(rounds):
        for name, sample in sides.items():
            if name in why:
                continue
            try:
                got, losses[name] = sample()
            except Exception as exc:  # a side that fails is a finding, not a crash
                why[name] = one_line(exc)
                log(f"  {name} failed: {why[name]}")
                times[name] = None
                continue
            times[name]["all"] += got
            times[name]["rounds"].append(statistics.median(got))
    return times, losses, why


def steps_of(step, steps: int):
    """A training side of ``interleaved_rounds``: ``steps`` timed steps of ``step``."""
    return lambda: timed_steps(step, steps)


def medians(times: dict) -> dict:
    """Each side's median over all its rounds (None for a side that stopped)."""
    return {k: statistics.median(v["all"]) if v else None for k, v in times.items()}


def rounds_note(times: dict) -> str:
    """"; rounds: ours 15.1-15.3 ms, eager bf16 12.0-13.9 ms, ..." where there was more
    than one round."""
    spans = [(k, v["rounds"]) for k, v in times.items() if v and len(v["rounds"]) > 1]
    if not spans:
        return ""
    return "; rounds: " + ", ".join(f"{k} {min(r):.4g}-{max(r):.4g} ms" for k, r in spans)


def infer_b8_row(overrides, steps, rng, timer, columns, rounds=1) -> dict:
    """The whisper-tiny encoder forward at batch 8 against the tests' torch encoder in each
    variant and transformers' WhisperEncoder (our weights) in fp32 and fp16 autocast, all
    sides taking turns for ``rounds`` rounds (``interleaved_rounds``): a cell is the median
    of its rounds' times, the note gives each side's range."""
    log(f"infer whisper-tiny b8 {' '.join(overrides)}")
    s, model, params, inputs = ours_infer_session("whisper-tiny", overrides, rng)
    mel = torch.tensor(inputs["mel"], device=timer.device)
    load = functools.cache(lambda: hf_whisper_encoder(model, params, timer.device))
    agreement = {}

    def timed(call):
        return lambda: ([timer.median_ms(call, steps)], None)

    def theirs(variant):
        return timed(torch_encoder_call(model, params, inputs, timer, variant))

    def hf(variant):
        encoder = load()
        if variant.autocast is None:
            with torch.no_grad(), without_tf32():
                reference = encoder(mel).last_hidden_state.cpu().numpy()
            s.run()
            ours = s.read_output("hidden")
            agreement["err"] = float(np.abs(ours - reference).max() / np.abs(reference).max())
        return timed(forward_call(encoder, (mel,), timer, variant))

    torch_sides, why = columns.prepare(TORCH_VARIANTS, theirs)
    hf_sides, hf_why = columns.prepare(HF_VARIANTS, hf)
    ours = lambda: ([back_to_back_run_ms(s, "hidden", steps)], None)  # noqa: E731
    times, _, why_more = interleaved_rounds({"ours": ours, **torch_sides, **hf_sides}, rounds)
    median = medians(times)
    err = f"; ours vs hf fp32: largest difference / largest value {agreement['err']:.1e}" if "err" in agreement else ""
    return {"name": "infer whisper-tiny b8", "ours": median["ours"],
            "torch": {v.label: median.get(v.label) for v in TORCH_VARIANTS + HF_VARIANTS},
            "why": {**why, **hf_why, **why_more}, "unit": "ms",
            "note": f"{' '.join(overrides)}; {len(s._steps)} dispatches{err}{rounds_note(times)}"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (for lavapipe and the smoke test)")
    p.add_argument("--compile", action="store_true", help="time torch.compile under --quick too (slow on a CPU)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out (16 compilations in a full run)")
    p.add_argument("--profile-gpt", action="store_true", help="print the profiler tables of a gpt-tiny step")
    p.add_argument("--only", default="", help="comma-separated row prefixes to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated row prefixes to leave out")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    rng = np.random.default_rng(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = TorchTimer(dev)
    timer.open_runtimes()
    columns = TorchColumns(dev, "compile: left out (--no-compile)" if args.no_compile else
                           "compile: left out in --quick (--compile forces it)" if args.quick and not args.compile
                           else None)
    if dev.type == "cuda":
        torch_desc = f"{torch.__version__} on {torch.cuda.get_device_name()} (CUDA; fp32 with TF32 off for matmuls)"
    else:
        torch_desc = f"{torch.__version__} on CPU (no CUDA here: torch times are CPU times)"
    only = [s for s in args.only.split(",") if s]
    skip = [s for s in args.skip.split(",") if s]
    hit = lambda names, prefixes: any(n.startswith(o) for n in names for o in prefixes)
    want = lambda *names: (not only or hit(names, only)) and not hit(names, skip)   # a row's name and aliases
    rows = []
    steps = cfg["steps"]

    if want("matmul"):
        rows += matmul_rows(cfg["matmul"], cfg["mm_steps"], rng, timer, columns)

    mlp = None
    for row in ("mlp", "whisper-tiny", "gpt-tiny", "whisper-tiny b8"):
        if not want("train " + row) and not (row == "mlp" and want("steps/s")) \
                and not (row == "whisper-tiny" and want("memory")):
            continue
        r, s, peak = train_row(row, cfg, steps, rng, timer, columns)
        rows.append(r)
        if row == "mlp":
            mlp = r
        if row == "whisper-tiny" and want("memory"):
            ours_all = sum(int(b.size) for b in s.buffers)
            rows.append({"name": "memory whisper-tiny train", "ours": s.plan.peak_bytes / 2**20,
                         "torch": {EAGER_FP32.label: peak / 2**20 if peak else None}, "unit": "MiB",
                         "note": f"ours: plan peak; all our buffers incl. AdamW state {ours_all / 2**20:.0f} MiB; "
                                 f"torch: max_memory_allocated over the eager fp32 warm-up and one more step"
                                 + ("" if peak else " (no CUDA: not measured)")})
        if row == "gpt-tiny" and args.profile_gpt:
            rep = s.profile(steps=3, train=True, measure_overhead=False, include_build_spans=False)
            print("\n== profiler: one gpt-tiny training step, by archetype ==")
            print(rep.format_table(top=12, by="archetype"))
            print("\n== profiler: one gpt-tiny training step, by kernel ==")
            print(rep.format_table(top=20, by="kernel"))
            print()
        del s

    if want("audio-align smoke", "smoke"):
        rows += audio_align_smoke(cfg["audio-align"], cfg["smoke_steps"], timer, columns)

    if want("infer whisper-tiny") or want("host"):
        log("infer whisper-tiny")
        ov = cfg["whisper-tiny"]
        ours_ms, s, model, params, inputs = ours_infer("whisper-tiny", ov, steps, rng)
        if want("infer whisper-tiny"):
            times, why = columns.run(TORCH_VARIANTS, lambda v: torch_infer(model, params, inputs, steps, timer, v))
            rows.append({"name": "infer whisper-tiny", "ours": ours_ms, "torch": times, "why": why, "unit": "ms",
                         "note": f"{' '.join(ov)}; {len(s._steps)} dispatches"})
        if want("host"):
            us, nd = ours_record_us(s)
            rows.append({"name": "host record/dispatch", "ours": us, "unit": "us",
                         "torch": {EAGER_FP32.label: torch_launch_us(timer)},
                         "note": f"ours: record {nd} dispatches of whisper-tiny infer into one pass; "
                                 f"torch: launch one small op, no sync"})
        del s
    if want("infer whisper-tiny b8"):
        rows.append(infer_b8_row(cfg["infer whisper-tiny b8"], steps, rng, timer, columns, cfg["rounds"]))
    if mlp is not None and want("steps/s"):
        rows.append({"name": "steps/s mlp", "ours": 1e3 / mlp["ours"], "why": mlp["why"], "unit": "/s",
                     "torch": {k: 1e3 / v if v else None for k, v in mlp["torch"].items()},
                     "note": "higher is better (ratio > 1 = we are faster)"})

    print_table(rows, torch_desc, adapter_desc())
    return 0

if __name__ == "__main__":
    sys.exit(main())
