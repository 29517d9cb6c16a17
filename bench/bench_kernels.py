"""Kernel variants side by side on the GPU, against PyTorch on the same shapes in one run.

    .venv/bin/python bench/bench_kernels.py                 # full sizes (meant for a real GPU)
    .venv/bin/python bench/bench_kernels.py --quick         # tiny sizes: runs on lavapipe
    .venv/bin/python bench/bench_kernels.py --checks checked,no-loop-bounding,unchecked

Each row is one kernel (a one-node graph session) with a forced variant: its GPU time
(steps recorded back to back into one command buffer, ``back_to_back_ms``; the
profiler's timestamped time is in the note), TFLOP/s, and its error against numpy float64
(relative Frobenius norm), next to torch's time for the same op (CUDA events, median;
fp32 with TF32 off, and the TF32 and fp16 rates as extra columns: what tensor cores
give, which WGSL cannot reach here; the attention rows: scaled_dot_product_attention in
fp32 and in bf16). ``--checks`` runs the
matmul rows once per naga runtime-check mode (MEGANEURA_SHADER_CHECKS), each in a
process of its own since the mode is read when pipelines are built.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from bench_vs_torch import TorchTimer, adapter_desc, fmt, log, markdown_table  # noqa: E402
from engine import codegen, config  # noqa: E402
from engine.runtime.device import adapter_info, get_device, shader_checks  # noqa: E402
from engine.graph import reference  # noqa: E402
from engine.graph.ir import Graph  # noqa: E402
from engine.graph.ops import attention_grad_kv_layout  # noqa: E402
from engine.runtime.session import Session  # noqa: E402
from engine.runtime.device import device_capabilities  # noqa: E402

# (label, m, n, k, transpose_a, transpose_b, batch)
MATMULS_FULL = [
    ("square", 1024, 1024, 1024, False, False, ()),
    ("square", 4096, 4096, 4096, False, False, ()),
    ("skinny", 32, 4096, 4096, False, False, ()),
    ("gpt fwd x@W", 2048, 1536, 384, False, False, ()),
    ("gpt dX=dY@W^T", 2048, 384, 1536, False, True, ()),
    ("gpt dW=X^T@dY", 384, 1536, 2048, True, False, ()),
    ("whisper fwd", 1500, 1536, 384, False, False, ()),
    ("whisper qkv", 1500, 384, 384, False, False, ()),
    ("whisper fc2", 1500, 384, 1536, False, False, ()),
    ("whisper dX fc1", 1500, 384, 1536, False, True, ()),
    ("whisper dW", 384, 384, 1500, True, False, ()),
    ("whisper dW fc1", 384, 1536, 1500, True, False, ()),
    ("whisper b8 dW", 384, 384, 12000, True, False, ()),
    ("whisper b8 dW fc1", 384, 1536, 12000, True, False, ()),
    ("llama qkv", 1024, 576, 576, False, True, ()),
    ("llama up", 1024, 1536, 576, False, True, ()),
    ("llama down", 1024, 576, 1536, False, True, ()),
    ("llama dW", 576, 1536, 1024, True, False, ()),
    ("whisper b8 fc1", 12000, 1536, 384, False, True, ()),
    ("whisper b8 qkv", 12000, 1152, 384, False, True, ()),
    ("whisper b8 fc2", 12000, 384, 1536, False, True, ()),
    ("whisper b8 out", 12000, 384, 384, False, True, ()),
    ("whisper b8 dX fc1", 12000, 384, 1536, False, False, ()),
    ("attn scores", 256, 256, 64, False, True, (48,)),
    ("decode up", 1, 8192, 2048, False, False, ()),     # Llama-3.2-1B's decode products (run 50): the vector kernel
    ("decode down", 1, 2048, 8192, False, False, ()),
    ("decode lm head", 1, 128256, 2048, False, False, ()),
]
MATMULS_QUICK = [
    ("square", 128, 128, 128, False, False, ()),
    ("ragged", 130, 70, 36, True, False, ()),
    ("weight grad", 64, 96, 128, True, False, ()),
    ("long k", 40, 36, 300, False, True, ()),
    ("decode", 1, 70, 1300, False, False, ()),
]
F32_VARIANTS = ["auto", *codegen.TILED, "simple"]


def matmul_graph(m, n, k, ta, tb, batch):
    g = Graph(f"matmul-{m}x{n}x{k}")
    a = g.input("a", batch + ((k, m) if ta else (m, k)))
    b = g.input("b", (n, k) if tb else (k, n))
    g.output("c", g.matmul(a, b, transpose_a=ta, transpose_b=tb))
    return g


def back_to_back_ms(sess, gpu_ms: float, least: int = 10, trials: int = 3) -> float:
    """GPU ms of one step of ``sess`` run back to back: ``r`` and ``2 r`` steps recorded
    into one command buffer each, timed from submit to a 4-byte read, and the difference
    divided by ``r`` (so submit and read cancel out). It includes the barriers between
    dispatches and leaves out the timestamps, which add about 8 us to every dispatch on
    the H100 (a split kernel's second dispatch would pay it); ``gpu_ms`` (the
    timestamped time) sizes ``r`` to about 10 ms of work, at least ``least`` steps (fewer
    under --quick, where lavapipe takes tens of ms a kernel), and is the answer where the
    difference is lost in the host's noise (tiny kernels on lavapipe)."""
    q = sess.device.queue
    sync = sess.buffers[sess.plan.outputs[next(iter(sess.graph.outputs))]]
    reps = int(min(400, max(least, 10.0 / max(gpu_ms, 1e-3))))

    def wall(n):
        enc = sess.device.create_command_encoder()
        for _ in range(n):
            sess.record(enc)
        t = time.perf_counter()
        q.submit([enc.finish()])
        q.read_buffer(sync, 0, 4)
        return time.perf_counter() - t

    wall(reps)
    best = min(wall(2 * reps) - wall(reps) for _ in range(trials))
    return best * 1e3 / reps if best > 0 else gpu_ms


def time_ours(g, inputs, caps, steps):
    """(GPU ms back to back, relative error vs float64, variant, timestamped GPU ms) of a
    one-node graph."""
    s = Session(g, capabilities=caps)
    s.set_inputs(inputs)
    s.run()
    out = s.read_output("c")
    a, b = (inputs[k].astype(np.float64) for k in ("a", "b"))
    node = g[g.outputs["c"]]
    if node.attrs.get("transpose_a"):
        a = np.swapaxes(a, -1, -2)
    if node.attrs.get("transpose_b"):
        b = np.swapaxes(b, -1, -2)
    ref = a @ b
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    rep = s.profile(steps=steps, measure_overhead=False, include_build_spans=False)
    stamped = statistics.median(rep.gpu_step_ns) / 1e6
    return back_to_back_ms(s, stamped, least=min(steps, 10)), err, s.plan.dispatches[0].variant, stamped


def time_torch(inputs, ta, tb, timer, steps):
    """torch ms for fp32 (TF32 off), TF32 and fp16 on the same operands."""
    a = torch.tensor(inputs["a"], device=timer.device)
    b = torch.tensor(inputs["b"], device=timer.device)
    a = a.transpose(-1, -2) if ta else a
    b = b.transpose(-1, -2) if tb else b
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"fp32": timer.median_ms(lambda: a @ b, steps)}
    if timer.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        out["tf32"] = timer.median_ms(lambda: a @ b, steps)
        torch.backends.cuda.matmul.allow_tf32 = False
        a16, b16 = a.half(), b.half()
        out["fp16"] = timer.median_ms(lambda: a16 @ b16, steps)
    return out


def matmul_rows(cases, steps, rng, timer, variants, splits=("auto",)):
    """One row per case, kernel variant (knob ``matmul``, MEGANEURA_MATMUL) and K split
    (``matmul_splits``; "auto": codegen's choice)."""
    caps = device_capabilities()
    rows = []
    for label, m, n, k, ta, tb, batch in cases:
        g = matmul_graph(m, n, k, ta, tb, batch)
        inputs = {nm: rng.standard_normal(g[i].shape, dtype=np.float32) for nm, i in g.inputs.items()}
        flops = 2.0 * m * n * k * int(np.prod(batch or (1,)))
        t = time_torch(inputs, ta, tb, timer, max(steps, 10))
        shape = f"{'x'.join(map(str, batch))}{'x' if batch else ''}{m}x{n}x{k}{' tA' if ta else ''}{' tB' if tb else ''}"
        for v in variants:
            for split in splits:
                knobs = dataclasses.replace(caps.knobs, matmul=v, matmul_splits=0 if split == "auto" else int(split))
                name = v if split == "auto" else f"{v}, split {split}"
                log(f"matmul {label} {shape} {name}")
                try:
                    ms, err, variant, stamped = time_ours(g, inputs, dataclasses.replace(caps, knobs=knobs), steps)
                except Exception as exc:  # a variant that fails to build is a finding, not a crash
                    rows.append([label, shape, name, "-", "-", "-", "-", "-", "-", f"FAILED: {str(exc)[:300]}"])
                    continue
                rows.append([label, shape, name, fmt(ms, " ms"), fmt(flops / ms / 1e9),
                             fmt(flops / t["fp32"] / 1e9), fmt(ms / t["fp32"]),
                             fmt(flops / t["tf32"] / 1e9) if "tf32" in t else "-",
                             fmt(flops / t["fp16"] / 1e9) if "fp16" in t else "-",
                             f"err {err:.1e}; timestamped {stamped:.3g} ms; {variant}"])
    return rows


# (label, batch, T, S, heads, kv heads, head dim, causal)
ATTENTION_FULL = [("whisper encoder", 1, 1500, 1500, 6, 6, 64, False),
                  ("whisper encoder b8", 8, 1500, 1500, 6, 6, 64, False),
                  ("gpt-tiny causal", 8, 256, 256, 6, 6, 64, True)]
ATTENTION_QUICK = [("small causal", 1, 40, 40, 2, 1, 16, True), ("small cross", 1, 40, 130, 2, 1, 16, False)]


ATTENTION_BACKWARD_OPS = {"attention_lse": 1, "attention_grad_q": 3,
                          "attention_grad_kv": 4}   # op: its passes over the scores


def _attention_variants(splits: str) -> list[tuple[str, dict]]:
    """(label, knobs) of each forward variant to time: the per-query kernel, and the
    tiled one with each forced key split ("auto": codegen's choice)."""
    out = [("per-query", {"attention": "per-query"})]
    for n in splits.split(","):
        out.append((f"tiled, splits {n}", {} if n == "auto" else {"attention_splits": int(n)}))
    return out


def _timed_session(g, inputs, knobs, steps):
    """(session, GPU ms back to back, profile) of graph ``g`` built with ``knobs`` forced."""
    saved = config.use(config.current().with_knobs(**knobs))
    try:
        sess = Session(g)
    finally:
        config.use(saved)
    sess.set_inputs(inputs)
    sess.run()
    rep = sess.profile(steps=steps, measure_overhead=False, include_build_spans=False)
    return sess, back_to_back_ms(sess, statistics.median(rep.gpu_step_ns) / 1e6, least=min(steps, 10)), rep


def _torch_heads(timer, inputs, b, d, h, hkv):
    heads = lambda x, n: torch.tensor(x, device=timer.device).view(b, -1, n, d).transpose(1, 2)
    tq, tk, tv = heads(inputs["q"], h), heads(inputs["k"], hkv), heads(inputs["v"], hkv)
    if hkv != h:
        tk, tv = tk.repeat_interleave(h // hkv, 1), tv.repeat_interleave(h // hkv, 1)
    return tq, tk, tv


def attention_rows(cases, steps, rng, timer, splits="auto"):
    """The attention kernels (one thread per query; tiled flash with each key split)
    against torch's scaled_dot_product_attention on the same tensors, in fp32 and with
    them cast to bf16 (what autocast runs; the flash kernel on CUDA)."""
    import torch.nn.functional as F
    rows = []
    for label, b, t, s_, h, hkv, d, causal in cases:
        g = Graph(f"attention-{label}")
        q, k, v = g.input("q", (b, t, h * d)), g.input("k", (b, s_, hkv * d)), g.input("v", (b, s_, hkv * d))
        g.output("c", g.attention(q, k, v, num_heads=h, num_kv_heads=hkv, causal=causal))
        inputs = {nm: rng.standard_normal(g[i].shape, dtype=np.float32) for nm, i in g.inputs.items()}
        flops = 4.0 * b * h * t * s_ * d * (0.5 if causal else 1.0)
        ref = reference.run(g, inputs, {}, np.float64)["c"]
        tq, tk, tv = _torch_heads(timer, inputs, b, d, h, hkv)
        t_ms = timer.median_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal), max(steps, 10))
        bq, bk, bv = (x.bfloat16() for x in (tq, tk, tv))
        b_ms = timer.median_ms(lambda: F.scaled_dot_product_attention(bq, bk, bv, is_causal=causal), max(steps, 10))
        for variant, knobs in _attention_variants(splits):
            log(f"attention {label} {variant}")
            sess, ms, _ = _timed_session(g, inputs, knobs, steps)
            err = float(np.linalg.norm(sess.read_output("c") - ref) / np.linalg.norm(ref))
            rows.append([label, f"{b}x{t}x{s_} h{h}/{hkv} d{d}", variant, fmt(ms, " ms"), fmt(flops / ms / 1e9),
                         fmt(t_ms, " ms"), fmt(ms / t_ms), fmt(b_ms, " ms"), fmt(ms / b_ms),
                         f"err {err:.1e}; {sess.plan.dispatches[0].variant}"])
    return rows


def attention_backward_rows(cases, steps, rng, timer, splits="auto"):
    """The fused backward ops (lse, dq, dk with dv) as one graph per case and key split,
    each op's GPU time, against torch's backward of scaled_dot_product_attention (fp32,
    autograd through the efficient kernel) on the same tensors."""
    import torch.nn.functional as F
    rows = []
    for label, b, t, s_, h, hkv, d, causal in cases:
        g = Graph(f"attention-backward-{label}")
        q, k, v = g.input("q", (b, t, h * d)), g.input("k", (b, s_, hkv * d)), g.input("v", (b, s_, hkv * d))
        dout, lse, delta = g.input("dout", (b, t, h * d)), g.input("lse", (b, t, h)), g.input("delta", (b, t, h))
        attrs = dict(num_heads=h, num_kv_heads=hkv, causal=causal)
        g.output("lse_out", g.apply("attention_lse", q, k, **attrs))
        g.output("dq", g.apply("attention_grad_q", q, k, v, dout, lse, delta, **attrs))
        kv = g.apply("attention_grad_kv", q, k, v, dout, lse, delta, **attrs)
        for name, at in zip(("dk", "dv"), attention_grad_kv_layout(g.shape(k))[0]):
            g.output(name, g.apply("part", kv, offset=at, shape=g.shape(k)))
        inputs = {nm: rng.standard_normal(g[i].shape, dtype=np.float32) for nm, i in g.inputs.items()}
        inputs["lse"] = np.abs(inputs["lse"]) + np.log(s_)
        pairs = b * h * t * s_ * (0.5 if causal else 1.0)
        tq, tk, tv = (x.requires_grad_() for x in _torch_heads(timer, inputs, b, d, h, hkv))
        o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        grad = torch.randn_like(o)
        t_ms = timer.median_ms(lambda: torch.autograd.grad(o, (tq, tk, tv), grad, retain_graph=True), max(steps, 10))
        for n in splits.split(","):
            knobs = {} if n == "auto" else {"attention_splits": int(n)}
            log(f"attention backward {label} splits {n}")
            sess, ms, rep = _timed_session(g, inputs, knobs, steps)
            per_op = {}
            for r in rep.dispatches:
                op = r.ops[0] if r.ops else r.kernel
                per_op[op] = per_op.get(op, 0) + r.gpu_ns / 1e6 / rep.steps
            flops = 2.0 * pairs * d * sum(ATTENTION_BACKWARD_OPS.values())
            note = ", ".join(f"{op.removeprefix('attention_')} {per_op.get(op, 0):.3f}" for op in ATTENTION_BACKWARD_OPS)
            rows.append([label, f"{b}x{t}x{s_} h{h}/{hkv} d{d}", f"splits {n}", fmt(ms, " ms"),
                         fmt(flops / ms / 1e9), fmt(t_ms, " ms"), fmt(ms / t_ms),
                         f"ms: {note}; {sess.plan.dispatches[0].variant}"])
    return rows


def independent_rows(counts, rng, quick):
    """Whether dispatches with no dependence between them overlap on the GPU: n matmuls
    of whisper's q/k/v shape ([1500, 384] x [384, 384]) reading one input, back to back,
    against n times one of them. Every dispatch is followed by a barrier if the time
    grows n-fold."""
    m, k = (64, 32) if quick else (1500, 384)
    rows, single = [], None
    for n in counts:
        g = Graph(f"independent-{n}")
        x = g.input("x", (m, k))
        for i in range(n):
            g.output(f"y{i}", g.matmul(x, g.input(f"w{i}", (k, k))))
        sess = Session(g)
        sess.set_inputs({nm: rng.standard_normal(g[j].shape, dtype=np.float32) for nm, j in g.inputs.items()})
        sess.run()
        rep = sess.profile(steps=3, measure_overhead=False, include_build_spans=False)
        ms = back_to_back_ms(sess, statistics.median(rep.gpu_step_ns) / 1e6, least=3 if quick else 10)
        single = single or ms / n
        rows.append([f"{n} matmuls {m}x{k}x{k}", str(len(sess.plan.dispatches)), fmt(ms, " ms"),
                     fmt(ms / n * 1e3, " us"), fmt(ms / (n * single))])
    return rows


def print_rows(title, cols, rows):
    print(f"\n{title}")
    print(markdown_table(cols, rows))
    sys.stdout.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (lavapipe)")
    p.add_argument("--checks", default="", help="comma-separated MEGANEURA_SHADER_CHECKS modes to run the "
                                                "matmul rows under, each in its own process")
    p.add_argument("--variants", default=",".join(F32_VARIANTS),
                   help=f"matmul variants: {', '.join(F32_VARIANTS)}")
    p.add_argument("--attention", action="store_true", help="also time the attention kernels")
    p.add_argument("--attention-backward", action="store_true", help="also time the fused attention backward")
    p.add_argument("--splits", default="auto", help="attention key splits to time, e.g. 1,2,4,auto "
                                                    "(MEGANEURA_ATTENTION_SPLITS)")
    p.add_argument("--no-matmul", action="store_true", help="skip the matmul rows")
    p.add_argument("--independent", default="", help="time n independent matmuls in one step, e.g. 1,3,6: "
                                                     "do dispatches without dependences overlap?")
    p.add_argument("--cases", default="", help="only the matmul cases whose label contains one of these "
                                               "comma-separated words")
    p.add_argument("--matmul-splits", default="auto", help="matmul K splits to time, e.g. 1,2,4,auto "
                                                           "(MEGANEURA_MATMUL_SPLITS)")
    args = p.parse_args(argv)
    if args.checks:
        for mode in args.checks.split(","):
            env = dict(os.environ, MEGANEURA_SHADER_CHECKS=mode, PYTHONUNBUFFERED="1")
            cmd = [sys.executable, __file__, "--variants", args.variants] + (["--quick"] if args.quick else []) \
                + (["--attention"] if args.attention else [])
            rc = subprocess.call(cmd, env=env)
            if rc:
                return rc
        return 0
    rng = np.random.default_rng(0)
    timer = TorchTimer(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    info = adapter_info()
    print(f"ours: {adapter_desc()}; adapter features: {', '.join(info['features'])}; device features: "
          f"{', '.join(sorted(str(f) for f in get_device().features))}")
    print(f"torch: {torch.__version__} on {torch.cuda.get_device_name() if timer.cuda else 'CPU'}")
    steps = 3 if args.quick else 20
    cases = MATMULS_QUICK if args.quick else MATMULS_FULL
    if args.cases:
        cases = [c for c in cases if any(w in c[0] for w in args.cases.split(","))]
    if not args.no_matmul:
        rows = matmul_rows(cases, steps, rng, timer, [v for v in args.variants.split(",") if v],
                           [v for v in args.matmul_splits.split(",") if v])
        print_rows(f"matmul (shader checks: {shader_checks(True)} for matmuls)",
                   ["case", "shape", "variant", "ours", "ours TFLOP/s", "torch fp32 TFLOP/s", "ours/torch",
                    "torch tf32", "torch fp16", "note"], rows)
    if args.independent:
        rows = independent_rows([int(n) for n in args.independent.split(",")], rng, args.quick)
        print_rows("independent dispatches back to back (time per matmul against one alone)",
                   ["case", "dispatches", "ours", "per matmul", "vs one alone"], rows)
    attention_cases = ATTENTION_QUICK if args.quick else ATTENTION_FULL
    if args.attention:
        rows = attention_rows(attention_cases, steps, rng, timer, args.splits)
        print_rows("attention (torch: scaled_dot_product_attention, fp32 and bf16)",
                   ["case", "shape", "variant", "ours", "ours TFLOP/s", "torch", "ours/torch", "torch bf16",
                    "ours/bf16", "note"], rows)
    if args.attention_backward:
        rows = attention_backward_rows(attention_cases, steps, rng, timer, args.splits)
        print_rows("attention backward: lse + dq + dk + dv (torch: autograd of scaled_dot_product_attention, fp32)",
                   ["case", "shape", "variant", "ours", "ours TFLOP/s", "torch", "ours/torch", "note"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
