"""Our engine against PyTorch on the same work, in one process: one table with both
times, the ratio (ours / torch: under 1 means we are faster) and TFLOP/s where it applies.

    .venv/bin/python bench/bench_vs_torch.py            # full sizes (meant for a real GPU)
    .venv/bin/python bench/bench_vs_torch.py --quick    # tiny sizes: runs on lavapipe in seconds

Rows:
- matmul MxNxK (f32): ours is a one-node graph session timed with GPU timestamps
  (engine.runtime.profiler, median over steps); torch is CUDA fp32 with TF32 off (timed with
  CUDA events, median), TF32 on as an extra column. The max relative error of ours
  against numpy float64 is printed too.
- train <model>: one full training step (forward, backward, AdamW update, loss read
  back) in wall time per step, median over steps after warm-up; torch does the same
  (``loss.item()`` every step).
- train whisper-tiny b8: the same at batch 8.
- audio-align smoke: the whole ``meganeura train audio-align`` recipe for 50 steps, wall
  time end to end (session build included), against the same recipe in PyTorch.
- infer whisper-tiny: one forward pass; ours = run() back to back, synchronised by a
  4-byte read at the end, wall time / runs; torch under no_grad, CUDA events.
- host: CPU microseconds to record one dispatch (Session.record of a many-dispatch
  graph into an encoder, no wait); torch: CPU µs to launch one small op (no sync).
- steps/s mlp: training steps per second (the inverse of the mlp row, listed for the issue).
- memory: our plan's peak bytes (and all our buffers, optimizer state included) of a
  whisper-tiny training step against torch.cuda.max_memory_allocated over one step.
``--profile-gpt`` adds the profiler's per-archetype and per-kernel tables of one gpt-tiny
training step. Without CUDA, torch runs on the CPU and the table says so.
"""

from __future__ import annotations

import argparse
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
    "audio-align": ["mel_len=500"], "smoke_steps": 50,
    "steps": 20, "mm_steps": 20, "warmup": 2,
}
QUICK = {
    "matmul": [(64, 64, 64), (128, 128, 128), (8, 128, 128)],
    "mlp": ["batch=8"],
    "whisper-tiny": ["batch=1", "mel_len=16"],
    "gpt-tiny": ["batch=1", "seq=8"],
    "whisper-tiny b8": ["batch=2", "mel_len=16"],
    "audio-align": ["mel_len=16", "seq=4", "batch=2"], "smoke_steps": 2,
    "steps": 1, "mm_steps": 2, "warmup": 0,
}

ROW_NAMES = ["matmul", "train mlp", "train whisper-tiny", "train gpt-tiny", "infer whisper-tiny",
             "host record/dispatch", "steps/s mlp", "memory whisper-tiny train"]


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
    model = models.create(name, overrides)
    g, inputs = model_inputs(name, model, True, rng)
    params = model.init_params(0)
    t = time.perf_counter()
    s = build_session(g, TrainConfig(optimizer="adamw", lr=1e-4), params)
    build_s = time.perf_counter() - t
    s.set_inputs(inputs)
    for _ in range(warmup):
        s.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss, _ = s.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, loss, s, model, params, inputs, build_s


def ours_infer(name, overrides, steps, rng):
    model = models.create(name, overrides)
    g, inputs = model_inputs(name, model, False, rng)
    params = model.init_params(0)
    s = build_inference_session(g)
    s.set_parameters(params)
    s.set_inputs(inputs)
    return back_to_back_run_ms(s, next(iter(g.outputs)), steps), s, model, params, inputs


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


def audio_align_smoke(overrides, steps, timer) -> dict:
    """audio-align's training smoke (the recipe of ``meganeura train audio-align``):
    ``steps`` steps end to end, wall time from nothing built to the last loss, ours on
    the GPU against the same recipe, weights and batches in PyTorch."""
    from engine.train.data import DataLoader
    from engine.train.trainer import Trainer
    log(f"audio-align smoke {' '.join(overrides)} x {steps} steps")
    model = models.create("audio-align", overrides)
    config = TrainConfig(**model.TRAIN_DEFAULTS, steps=steps, batch_size=model.settings["batch"], seed=0)
    params = model.init_params(0)
    loader = DataLoader(model.dataset(0), config.batch_size, shuffle=True, seed=0, drop_last=True)
    batches = [b for epoch in range(steps) for b in loader.batches(epoch)][:steps]
    t = time.perf_counter()
    trainer = Trainer(model.build(train=True), params, config, backend="gpu")
    built = time.perf_counter()
    ours = trainer.fit(batches).losses
    ours_s, build_s = time.perf_counter() - t, built - t
    timer.sync()
    t = time.perf_counter()
    theirs = tr.audio_align_training_losses(model, params, batches, config, device=timer.device)
    timer.sync()
    torch_s = time.perf_counter() - t
    return {"name": f"audio-align smoke {steps} steps", "ours": ours_s, "torch": torch_s, "unit": "s",
            "note": f"{' '.join(overrides)}; wall time incl. build (ours: build {build_s:.2f} s, of which "
                    f"pipelines {_span_s(trainer.session, 'create pipelines'):.2f} s; steps "
                    f"{ours_s - build_s:.2f} s); loss {ours[0]:.3f} -> {ours[-1]:.3f} vs {theirs[0]:.3f} -> {theirs[-1]:.3f}"}


# ------------------------------------------------------------------ torch

def torch_train(name, model, params, inputs, steps, timer, warmup=2):
    frozen = {"model.encoder.embed_positions.weight"} if name == "whisper-tiny" else set()
    w = torch_models.to_torch(model.to_file_layout(params), timer.device, frozen)
    x = {k: torch.tensor(v, device=timer.device) for k, v in inputs.items()}
    opt = torch.optim.AdamW([t for k, t in w.items() if t.requires_grad], lr=1e-4, weight_decay=0.0)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch_models.loss_fn(name, w, x)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    if timer.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if timer.cuda else None
    return statistics.median(times) * 1e3, loss, peak


def torch_infer(name, model, params, inputs, steps, timer):
    w = torch_models.to_torch(model.to_file_layout(params), timer.device, frozen=set(model.to_file_layout(params)))
    x = {k: torch.tensor(v, device=timer.device) for k, v in inputs.items()}
    with torch.no_grad():
        return timer.median_ms(lambda: torch_models.whisper_encoder(x["mel"], w), steps)


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


def print_table(rows, torch_desc, adapter):
    cols = ["workload", "ours", "torch", "ours/torch", "ours TFLOP/s", "torch TFLOP/s", "torch tf32", "note"]
    data = []
    for r in rows:
        ratio = r["ours"] / r["torch"] if r.get("torch") else None
        data.append([r["name"], fmt(r["ours"], " " + r["unit"]), fmt(r.get("torch"), " " + r["unit"]),
                     fmt(ratio), fmt(r.get("ours_tf")), fmt(r.get("torch_tf")), fmt(r.get("tf32")),
                     r.get("note", "")])
    print(f"ours: {adapter}")
    print(f"torch: {torch_desc}")
    print(markdown_table(cols, data))
    sys.stdout.flush()


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (for lavapipe and the smoke test)")
    p.add_argument("--profile-gpt", action="store_true", help="print the profiler tables of a gpt-tiny step")
    p.add_argument("--only", default="", help="comma-separated row prefixes to run (default: all)")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    rng = np.random.default_rng(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = TorchTimer(dev)
    if dev.type == "cuda":
        torch_desc = f"{torch.__version__} on {torch.cuda.get_device_name()} (CUDA, fp32; tf32 column with TF32 on)"
    else:
        torch_desc = f"{torch.__version__} on CPU (no CUDA here: torch times are CPU times)"
    only = [s for s in args.only.split(",") if s]
    want = lambda name: not only or any(name.startswith(o) for o in only)
    rows = []
    steps = cfg["steps"]

    if want("matmul"):
        for m, n, k in cfg["matmul"]:
            log(f"matmul {m}x{n}x{k}")
            flops = 2.0 * m * n * k
            ours_ms, err, kernel = ours_matmul(m, n, k, cfg["mm_steps"], rng)
            a = torch.randn(m, k, device=dev)
            b = torch.randn(k, n, device=dev)
            torch.backends.cuda.matmul.allow_tf32 = False
            t32 = timer.median_ms(lambda: a @ b, max(cfg["mm_steps"], 10))
            tf32 = None
            if timer.cuda:
                torch.backends.cuda.matmul.allow_tf32 = True
                t_tf = timer.median_ms(lambda: a @ b, max(cfg["mm_steps"], 10))
                torch.backends.cuda.matmul.allow_tf32 = False
                tf32 = flops / t_tf / 1e9
            rows.append({"name": f"matmul {m}x{n}x{k}", "ours": ours_ms, "torch": t32, "unit": "ms",
                         "ours_tf": flops / ours_ms / 1e9, "torch_tf": flops / t32 / 1e9, "tf32": tf32,
                         "note": f"rel err {err:.1e}; {kernel}"})

    mlp_ms = mlp_torch = None
    for row in ("mlp", "whisper-tiny", "gpt-tiny", "whisper-tiny b8"):
        name = row.split()[0]
        if not want("train " + row) and not (row == "mlp" and want("steps/s")) \
                and not (row == "whisper-tiny" and want("memory")):
            continue
        log(f"train {row} {' '.join(cfg[row])}")
        ours_ms, loss, s, model, params, inputs, build_s = ours_train(name, cfg[row], steps, rng, cfg["warmup"])
        t_ms, t_loss, peak = torch_train(name, model, params, inputs, steps, timer, cfg["warmup"])
        rows.append({"name": f"train {row}", "ours": ours_ms, "torch": t_ms, "unit": "ms",
                     "note": f"{' '.join(cfg[row])}; {len(s._steps)} dispatches; "
                             f"loss {loss:.4g} vs {t_loss:.4g}; build {build_s:.1f} s"})
        if row == "mlp":
            mlp_ms, mlp_torch = ours_ms, t_ms
        if row == "whisper-tiny" and want("memory"):
            ours_all = sum(int(b.size) for b in s.buffers)
            rows.append({"name": "memory whisper-tiny train", "ours": s.plan.peak_bytes / 2**20,
                         "torch": peak / 2**20 if peak else None, "unit": "MiB",
                         "note": f"ours: plan peak; all our buffers incl. AdamW state {ours_all / 2**20:.0f} MiB; "
                                 f"torch: max_memory_allocated over {steps} steps"
                                 + ("" if peak else " (no CUDA: not measured)")})
        if row == "gpt-tiny" and args.profile_gpt:
            rep = s.profile(steps=3, train=True, measure_overhead=False, include_build_spans=False)
            print("\n== profiler: one gpt-tiny training step, by archetype ==")
            print(rep.format_table(top=12, by="archetype"))
            print("\n== profiler: one gpt-tiny training step, by kernel ==")
            print(rep.format_table(top=20, by="kernel"))
            print()
        del s

    if want("smoke"):
        rows.append(audio_align_smoke(cfg["audio-align"], cfg["smoke_steps"], timer))

    if want("infer") or want("host"):
        log("infer whisper-tiny")
        name, ov = "whisper-tiny", cfg["whisper-tiny"]
        ours_ms, s, model, params, inputs = ours_infer(name, ov, steps, rng)
        if want("infer"):
            t_ms = torch_infer(name, model, params, inputs, steps, timer)
            rows.append({"name": "infer whisper-tiny", "ours": ours_ms, "torch": t_ms, "unit": "ms",
                         "note": f"{' '.join(ov)}; {len(s._steps)} dispatches"})
        if want("host"):
            us, nd = ours_record_us(s)
            rows.append({"name": "host record/dispatch", "ours": us, "torch": torch_launch_us(timer), "unit": "us",
                         "note": f"ours: record {nd} dispatches of whisper-tiny infer into one pass; "
                                 f"torch: launch one small op, no sync"})
    if mlp_ms is not None and want("steps/s"):
        rows.append({"name": "steps/s mlp", "ours": 1e3 / mlp_ms, "torch": 1e3 / mlp_torch, "unit": "/s",
                     "note": "higher is better (ratio > 1 = we are faster)"})

    print_table(rows, torch_desc, adapter_desc())
    return 0


if __name__ == "__main__":
    sys.exit(main())
