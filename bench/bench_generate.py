"""Greedy generation with the KV cache, ours against transformers' ``generate`` on the same
GPU in one process: a SmolLM2-135M-shaped Llama (random weights from its config, written
with ``save_pretrained`` and opened from the folder; ``--shape`` picks another family's
shape) and the built-in gpt-tiny. The checkpoint is stored in bf16, as most on the Hub
are (``--weights f32``: in f32); we keep such weights in bf16 for generation, exactly,
and transformers reads them as the dtype of its row.

    python3 bench/bench_generate.py            # the SmolLM2-135M shape (meant for a real GPU)
    python3 bench/bench_generate.py --shape qwen2.5-0.5b
    python3 bench/bench_generate.py --quick    # a tiny Llama only: runs on lavapipe in seconds

Rows: prefill of a ``--prompt``-token prompt (wall time from the ids to the first new
token on the host, median of the timed calls after one that builds the sessions) and
decode tokens/s (decode steps over their wall time, the median of the timed calls; ``--new``
tokens a call, EOS ignored; greedy decoding reads ids back 8 steps at a time, so a single
step's time is not observable).
transformers: ``generate(do_sample=False, min_new_tokens=N)`` timed whole in fp32, fp16
and bf16, tokens/s = N / (time - the prefill's time, a ``max_new_tokens=1`` call); and
"fp32 compiled": transformers' own recipe for a compiled decode, a static KV cache
(``cache_implementation="static"``), with which ``generate`` compiles the decoding forward
itself (``CompileConfig``'s default, mode "reduce-overhead": CUDA graphs). The cache is
sized once (``max_cache_len`` = prompt + ``--new``) so every call reuses one compiled
graph instead of recompiling per length; the warm-up call compiles. Left out under
``--quick`` unless ``--compile`` (on a CPU it takes a C compiler and tens of seconds).
Also: how many of our greedy ids equal transformers' fp32 ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import transformers  # noqa: E402

from bench_checkpoint import SHAPES, random_checkpoint  # noqa: E402
from bench_vs_torch import adapter_desc, fmt, log, markdown_table, ours_record_us  # noqa: E402
from engine import models  # noqa: E402
from engine.importers import load_model  # noqa: E402
from engine.train.generation import Sampling  # noqa: E402


PROFILE = False
SAMPLED = {"T=0.8": Sampling(temperature=0.8),   # `meganeura generate --temperature 0.8`: all the vocabulary
           "T=0.8, top-k 50": Sampling(temperature=0.8, top_k=50),
           "T=0.7, top-p 0.9": Sampling(temperature=0.7, top_p=0.9)}


def ours(model, prompt, new, calls):
    """(prefill ms, decode tokens/s, ids, decode dispatches, build s, sampled decode tokens/s) of our
    generator, median over ``calls``; the last for each way of ``SAMPLED`` (the logits read
    back every step, where greedy decoding runs ahead on the GPU)."""
    gen = model.generator(backend="gpu")
    build_s = gen.generate(prompt, new, Sampling()).build_seconds
    steps = gen.steps(gen.check(prompt, new))
    widens = sum(n.op == "widen" for n in steps.session(len(prompt), prefill=True).graph.nodes)
    log(f"weights kept in bf16: {len(steps.bf16)} of {len(steps.decode.graph.parameters)}; "
        f"the prefill reads {widens} through a widen")
    prefills, rates, ids = [], [], None
    for _ in range(calls):
        r = gen.generate(prompt, new, Sampling())
        prefills.append(1e3 * r.prefill_seconds)
        rates.append(r.decode_tokens_per_second)
        ids = r.tokens
    decode = gen.steps(gen.check(prompt, new)).decode
    if PROFILE:
        from engine.cli.profile import profile_generation
        report = profile_generation(model, gen.params, 5, prompt=prompt)
        print(report.format_table(top=30, by="archetype"))
        print(_by_op(report))
        per, count = ours_record_us(decode)
        print(f"host: recording a decode step takes {per * count / 1e3:.2f} ms ({per:.2f} us x {count} dispatches)")
    log(f"decode tokens/s of each call: {', '.join(f'{r:.0f}' for r in rates)}")
    sampled = {label: statistics.median(gen.generate(prompt, new, replace(how, seed=i)).decode_tokens_per_second
                                        for i in range(calls)) for label, how in SAMPLED.items()}
    log("sampled decode tokens/s: " + ", ".join(f"{label} {rate:.0f}" for label, rate in sampled.items()))
    return statistics.median(prefills), statistics.median(rates), ids, len(decode.plan.dispatches), build_s, sampled


def _by_op(report) -> str:
    """GPU time per phase and kernel name without its module prefix, the largest first."""
    totals, calls = {}, {}
    for d in report.dispatches:
        key = (d.phase, d.kernel.split(":", 1)[1] if d.module and d.kernel.startswith(d.module + ":") else d.kernel)
        totals[key] = totals.get(key, 0) + d.gpu_ns
        calls[key] = calls.get(key, 0) + 1
    steps = {"prefill": 1, "decode": report.steps - 1}
    rows = sorted(totals.items(), key=lambda kv: -kv[1])[:24]
    return "\n".join(f"{phase:<8} {name:<40} {t / steps[phase] / 1e3:9.1f} us/step  {calls[(phase, name)]:5d} calls"
                     for (phase, name), t in rows)


def compiled_generate(prompt_len: int, new: int, device) -> dict:
    """``generate`` keywords for transformers' compiled decode: a static cache of one size
    (so one compiled graph serves every call); off CUDA, compiling must be asked for."""
    compile_config = transformers.CompileConfig()
    if device.type != "cuda":
        compile_config._compile_all_devices = True
    return dict(cache_implementation="static", max_cache_len=prompt_len + new, compile_config=compile_config)


def theirs(hf, prompt, new, calls, device, dtype, generate_kwargs=None):
    """(prefill ms, decode tokens/s, ids) of transformers' greedy generate in ``dtype``."""
    net = hf.to(device=device, dtype=dtype)
    x = torch.tensor([prompt], dtype=torch.long, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(n):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = net.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                               **(generate_kwargs or {}))
        sync()
        return 1e3 * (time.perf_counter() - t), out[0, len(prompt):].tolist()

    run(2)
    first = statistics.median(run(1)[0] for _ in range(calls))
    whole = [run(new) for _ in range(calls)]
    total = statistics.median(ms for ms, _ in whole)
    return first, (new - 1) / max(total - first, 1e-9) * 1e3, whole[-1][1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny Llama at tiny sizes (lavapipe)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the checkpoint's config")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--new", type=int, default=128, help="new tokens a call (default 128)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also print the top kernels of a decode step")
    p.add_argument("--no-peers", action="store_true", help="leave transformers out (quick iterations)")
    p.add_argument("--compile", action="store_true", help="time transformers' compiled decode under --quick too")
    p.add_argument("--no-compile", action="store_true", help="leave transformers' compiled decode out")
    p.add_argument("--weights", choices=("bf16", "f32"), default="bf16",
                   help="how the checkpoint stores its weights (default bf16, as most on the Hub; we keep them so)")
    args = p.parse_args(argv)
    global PROFILE
    PROFILE = args.profile
    prompt_len, new, calls = (16, 8, 1) if args.quick else (args.prompt, args.new, args.calls)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf, folder, cfg, title = random_checkpoint(args.shape, args.quick, args.weights)
    prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], prompt_len).tolist()

    rows, failed = [], []
    log(f"ours: {title}, prompt {prompt_len}, {new} new tokens")
    t = time.perf_counter()
    model = load_model(str(folder))
    open_s = time.perf_counter() - t
    o_prefill, o_rate, o_ids, dispatches, build_s, o_sampled = ours(model, prompt, new, calls)
    compiled = (args.compile or not args.quick) and not args.no_compile
    peers = () if args.no_peers else (  # fp32 first: the later ones cast the weights
        ("fp32", torch.float32, None),
        *((("fp32 compiled", torch.float32, compiled_generate(prompt_len, new, device)),) if compiled else ()),
        ("fp16", torch.float16, None), ("bf16", torch.bfloat16, None))
    for label, dtype, kwargs in peers:
        log(f"transformers {label}")
        try:
            rows.append((f"transformers {label}", *theirs(hf, prompt, new, calls, device, dtype, kwargs)))
        except Exception as exc:  # a peer that fails is a finding, not a crash
            log(f"transformers {label} failed: {type(exc).__name__}: {str(exc)[:300]}")
            failed.append(f"transformers {label}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
    fp32 = next((r for r in rows if r[0] == "transformers fp32"), None)
    base = fp32[2] if fp32 else o_rate
    match = next((i for i, (a, b) in enumerate(zip(o_ids, fp32[3])) if a != b), len(o_ids)) if fp32 else 0
    from engine import config
    ours_label = f"ours ({config.current().precision}, {args.weights} checkpoint)"
    table = [[ours_label, fmt(o_prefill, " ms"), fmt(o_rate), fmt(o_rate / base)],
             *([f"ours, sampled ({label})", "", fmt(rate), fmt(rate / base)] for label, rate in o_sampled.items())]
    table += [[label, fmt(pre, " ms"), fmt(rate), fmt(rate / base)] for label, pre, rate, _ in rows]

    if not args.quick:   # lavapipe: the Llama's rows are enough to keep the script working
        log("ours: gpt-tiny")
        tiny = models.create("gpt-tiny")
        t_prefill, t_rate, _, t_dispatches, _, _ = ours(tiny, [256] * min(prompt_len, 64), new, calls)

    print(title)
    print(f"ours on {adapter_desc()}; torch {torch.__version__} on {device}, transformers {transformers.__version__}")
    print(markdown_table(["", f"prefill {prompt_len} tokens", "decode tokens/s", "ratio to transformers fp32"], table))
    for line in failed:
        print(f"- failed: {line}")
    print(f"\nour greedy ids equal transformers' fp32 for the first {match} of {len(o_ids)}; decode step "
          f"{dispatches} dispatches; checkpoint opened in {open_s:.2f} s, sessions built in {build_s:.2f} s "
          f"(first call)")
    if not args.quick:
        print(f"gpt-tiny: prefill {min(prompt_len, 64)} tokens {t_prefill:.2f} ms, decode {t_rate:.1f} tokens/s "
              f"({t_dispatches} dispatches a step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
