"""A Hugging Face checkpoint opened from its folder, on our engine and on transformers, on
the same GPU in one process: a SmolLM2-135M-shaped Llama (random weights from its config:
hidden 576, 30 layers, 9 heads over 3 kv heads, vocab 49152), or with ``--shape`` a
Qwen2.5-0.5B-, Qwen3-0.6B- or Llama-3.2-1B-shaped one (the last with Llama 3's RoPE
scaling), or one shaped like Granite-3.3-2B, OLMo-2-1B, SmolLM3-3B or Phi-3-mini-4k (their
layer sizes; the multipliers' values do not change the work), written with
``save_pretrained`` and read back by ``engine.load_model``.

    python3 bench/bench_checkpoint.py            # the SmolLM2-135M shape (meant for a real GPU)
    python3 bench/bench_checkpoint.py --shape qwen3-0.6b
    python3 bench/bench_checkpoint.py --quick    # a tiny Llama: runs on lavapipe in seconds

Rows (wall time per call, median after warm-up; ratio = ours / transformers fp32):
- forward BxT: ours = ``run()`` back to back closed by a 4-byte read, / runs;
  transformers under ``no_grad``: eager fp32, bf16 autocast, ``torch.compile`` (default mode).
- train step BxT: forward, next-token cross-entropy, backward, AdamW, loss read back;
  transformers likewise with ``loss.item()`` every step (fused AdamW off), the same three ways.
Also: the import (folder -> model) and session build times, and our logits' largest
difference from transformers' relative to their largest magnitude.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import transformers  # noqa: E402

from bench_vs_torch import adapter_desc, back_to_back_run_ms, fmt, log, markdown_table  # noqa: E402
from engine.importers import load_model  # noqa: E402
from engine.runtime.session import build_inference_session  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402
from engine.train.session import build_session  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=8192))
GRANITE_33_2B = dict(vocab_size=49159, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                     rms_norm_eps=1e-5, rope_theta=10000000.0, tie_word_embeddings=True, embedding_multiplier=12.0,
                     residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0)
OLMO2_1B = dict(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=0)
SMOLLM3_3B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536, rms_norm_eps=1e-6,
                  rope_theta=5000000.0, tie_word_embeddings=True, no_rope_layer_interval=4, pad_token_id=0)
PHI3_MINI = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_theta=10000.0, sliding_window=2047, tie_word_embeddings=False, pad_token_id=0)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0)
# --shape: the checkpoint's family (transformers' config and model classes) and its config's fields.
SHAPES = {
    "smollm2-135m": ("SmolLM2-135M-shaped Llama", "Llama", SMOLLM2_135M),
    "qwen2.5-0.5b": ("Qwen2.5-0.5B-shaped Qwen2", "Qwen2", QWEN25_05B),
    "qwen3-0.6b": ("Qwen3-0.6B-shaped Qwen3", "Qwen3", QWEN3_06B),
    "llama3.2-1b": ("Llama-3.2-1B-shaped Llama", "Llama", LLAMA32_1B),
    "granite-3.3-2b": ("Granite-3.3-2B-shaped Granite", "Granite", GRANITE_33_2B),
    "olmo2-1b": ("OLMo-2-1B-shaped OLMo 2", "Olmo2", OLMO2_1B),
    "smollm3-3b": ("SmolLM3-3B-shaped SmolLM3", "SmolLM3", SMOLLM3_3B),
    "phi3-mini": ("Phi-3-mini-4k-shaped Phi-3", "Phi3", PHI3_MINI),
}


def random_checkpoint(shape: str, quick: bool, weights: str = "f32"):
    """(transformers model, its folder, config fields, title): random weights of ``shape``'s
    config (``--quick``: the family at TINY's sizes) written with save_pretrained, in f32
    or (``weights`` "bf16") rounded to bf16 and stored so, as most checkpoints on the Hub
    are; the model returned holds the same values in f32."""
    title, family, cfg = SHAPES[shape]
    if quick:
        cfg, title = TINY, f"tiny {family} (--quick)"
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**cfg)
    hf = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{family.lower()}-"))
    if weights == "bf16":   # read back as a user would: hf.float() would keep RoPE's inv_freq rounded to bf16
        hf.to(torch.bfloat16).save_pretrained(folder)
        hf = getattr(transformers, f"{family}ForCausalLM").from_pretrained(folder, dtype=torch.float32).eval()
    else:
        hf.save_pretrained(folder)
    n_params = sum(t.numel() for t in hf.parameters())
    return hf, folder, cfg, (title if quick else f"{title} ({n_params / 1e6:.1f} M parameters, random weights") + \
        f"{' (' if quick else ', '}stored in {weights})"


def wall_ms(fn, steps, sync, warmup=2) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def ours_forward(folder, batch, seq, ids, steps):
    t = time.perf_counter()
    model = load_model(str(folder), [f"batch={batch}", f"seq={seq}"])
    params = model.init_params()
    import_s = time.perf_counter() - t
    t = time.perf_counter()
    s = build_inference_session(model.build(train=False))
    s.set_parameters(params)
    build_s = time.perf_counter() - t
    s.set_inputs({"input_ids": ids})
    ms = back_to_back_run_ms(s, "logits", steps)
    return ms, s.read_output("logits"), import_s, build_s, len(s.plan.dispatches)


def ours_train(folder, batch, seq, ids, steps):
    model = load_model(str(folder), [f"batch={batch}", f"seq={seq}"])
    t = time.perf_counter()
    s = build_session(model.build(train=True), TrainConfig(optimizer="adamw", lr=1e-4), model.init_params())
    build_s = time.perf_counter() - t
    s.set_inputs({"input_ids": ids, "labels": ids})
    ms = wall_ms(lambda: s.step(), steps, lambda: None)     # step() reads the loss back: synchronous
    return ms, build_s, len(s.plan.dispatches)


def torch_rows(hf, ids_f, ids_t, steps, device, compile_too):
    """{variant: (forward ms, train ms)} of transformers on ``device``: fp32, bf16 autocast,
    torch.compile; a variant that fails gives its error text."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x_f = torch.tensor(ids_f, dtype=torch.long, device=device)
    x_t = torch.tensor(ids_t, dtype=torch.long, device=device)
    out = {}
    variants = [("transformers fp32", hf, None), ("transformers bf16 autocast", hf, torch.bfloat16)]
    if compile_too:
        variants.append(("transformers torch.compile", torch.compile(hf), None))
    for label, net, autocast in variants:
        log(f"timing {label}")
        ctx = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast else (lambda: _null())
        try:
            def forward():
                with torch.no_grad(), ctx():
                    net(x_f).logits
            fwd = wall_ms(forward, steps, sync)
            opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=False)

            def step():
                opt.zero_grad(set_to_none=True)
                with ctx():
                    loss = net(x_t, labels=x_t).loss
                loss.backward()
                opt.step()
                return loss.item()
            train = wall_ms(step, steps, sync)
            out[label] = (fwd, train)
        except Exception as exc:  # a variant that fails is a finding, not a crash
            out[label] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny Llama at tiny sizes (lavapipe)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the checkpoint's config")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    args = p.parse_args(argv)
    fwd_shape, train_shape = ((1, 16), (2, 16)) if args.quick else ((1, 512), (4, 256))
    steps = 2 if args.quick else args.steps
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf, folder, cfg, title = random_checkpoint(args.shape, args.quick)
    log(f"checkpoint: {title} in {folder}")
    rng = np.random.default_rng(0)
    ids_f = rng.integers(0, cfg["vocab_size"], fwd_shape).astype(np.int32)
    ids_t = rng.integers(0, cfg["vocab_size"], train_shape).astype(np.int32)

    log(f"ours: forward {fwd_shape}")
    fwd_ms, logits, import_s, build_s, fwd_dispatches = ours_forward(folder, *fwd_shape, ids_f, steps)
    log(f"ours: training step {train_shape}")
    train_ms, train_build_s, train_dispatches = ours_train(folder, *train_shape, ids_t, steps)

    hf = hf.to(device)
    with torch.no_grad():
        ref = hf(torch.tensor(ids_f, dtype=torch.long, device=device)).logits.float().cpu().numpy()
    err = float(np.abs(logits - ref).max() / np.abs(ref).max())
    theirs = torch_rows(hf.train(), ids_f, ids_t, steps, device, compile_too=not args.no_compile and not args.quick)

    base = theirs.get("transformers fp32")
    rows = [["ours (engine, f32)", fmt(fwd_ms, " ms"), fmt(fwd_ms / base[0]) if isinstance(base, tuple) else "-",
             fmt(train_ms, " ms"), fmt(train_ms / base[1]) if isinstance(base, tuple) else "-"]]
    for label, v in theirs.items():
        if isinstance(v, tuple):
            rows.append([label, fmt(v[0], " ms"), fmt(v[0] / base[0]), fmt(v[1], " ms"), fmt(v[1] / base[1])])
        else:
            rows.append([label, v, "-", "-", "-"])
    print(title)
    print(f"ours on {adapter_desc()}; torch {torch.__version__} on {device}, transformers {transformers.__version__}")
    print(markdown_table(["", f"forward {fwd_shape[0]}x{fwd_shape[1]}", "ratio",
                          f"train step {train_shape[0]}x{train_shape[1]}", "ratio"], rows))
    print(f"\nimport {import_s:.2f} s; inference session build {build_s:.2f} s ({fwd_dispatches} dispatches); "
          f"training session build {train_build_s:.2f} s ({train_dispatches} dispatches)")
    print(f"our logits vs transformers fp32: max |diff| / max |ref| = {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
