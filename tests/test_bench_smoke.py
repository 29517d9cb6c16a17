"""bench/bench_vs_torch.py --quick runs and prints every row with finite numbers
(keeps the benchmark from rotting; no timing is asserted)."""

import math
import os
import subprocess
import sys
from pathlib import Path


from engine import codegen

ROOT = Path(__file__).resolve().parent.parent
ROWS = ["matmul 64x64x64", "matmul 128x128x128", "matmul 8x128x128", "train mlp", "train whisper-tiny",
        "memory whisper-tiny train", "train gpt-tiny", "train whisper-tiny b8", "audio-align smoke 2 steps",
        "infer whisper-tiny", "host record/dispatch", "steps/s mlp"]


def test_bench_vs_torch_quick():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_vs_torch.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("| ") and not line.startswith("| workload"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells
    assert set(ROWS) <= set(rows), f"missing rows: {set(ROWS) - set(rows)}\n{proc.stdout}"
    for name in ROWS:
        ours = float(rows[name][1].split()[0])
        assert math.isfinite(ours) and ours > 0, rows[name]
        if rows[name][2] != "-":
            assert math.isfinite(float(rows[name][2].split()[0])), rows[name]


def test_bench_kernels_quick():
    """bench/bench_kernels.py --quick runs every matmul kernel (whole and with K split), the attention kernels
    (per-query; tiled whole and with its keys split) and the fused backward, and prints
    their rows with finite times and small errors (no timing asserted)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_kernels.py"), "--quick", "--attention",
                           "--attention-backward", "--splits", "1,2", "--variants", "auto,64,128k8",
                           "--matmul-splits", "auto,3", "--independent", "1,3"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| case")]
    matmuls = [r for r in rows if r[2].split(",")[0] in ("auto", "64", "128k8")]
    attention = [r for r in rows if r[2] in ("tiled, splits 1", "tiled, splits 2", "per-query")]
    backward = [r for r in rows if r[2] in ("splits 1", "splits 2")]
    assert len(matmuls) == 24 and len(attention) == 6 and len(backward) == 4, proc.stdout
    independent = [r for r in rows if r[0].endswith("matmuls 64x32x32")]
    assert [r[1] for r in independent] == ["1", "3"], proc.stdout
    long_k = {r[2]: r[-1] for r in matmuls if r[0] == "long k"}
    auto = codegen.split_rule(1, 300)    # codegen's own choice for one 64 x 64 tile, K = 300
    assert "K split 3 ways" in long_k["64, split 3"], long_k
    assert (f"K split {auto} ways" if auto > 1 else "64x64 tile") in long_k["64"], long_k
    cross = {r[2]: r[-1] for r in attention if r[0] == "small cross"}   # 130 keys: 3 blocks, so 2 parts
    assert "keys split 2 ways" in cross["tiled, splits 2"] and "split" not in cross["tiled, splits 1"], cross
    for r in backward:
        assert math.isfinite(float(r[3].split()[0])) and float(r[3].split()[0]) > 0, r
        per_op = dict(part.split() for part in r[-1].removeprefix("ms: ").split(";")[0].split(", "))
        assert set(per_op) == {"lse", "grad_q", "grad_k", "grad_v"} and all(float(v) > 0 for v in per_op.values()), r
    for r in matmuls + attention:
        assert math.isfinite(float(r[3].split()[0])) and float(r[3].split()[0]) > 0, r
        err = float(r[-1].split(";")[0].split()[1])
        assert err < 1e-5, r


def run_quick(script: str) -> tuple[str, dict[str, list[str]]]:
    """``bench/SCRIPT --quick``'s output and its markdown table's rows by first cell."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {cells[0]: cells for line in proc.stdout.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    return proc.stdout, rows


def test_bench_checkpoint_quick():
    """A Llama checkpoint through save_pretrained and our importer, beside transformers."""
    stdout, rows = run_quick("bench_checkpoint.py")
    for name in ("ours (engine, f32)", "transformers fp32", "transformers bf16 autocast"):
        assert float(rows[name][1].split()[0]) > 0 and float(rows[name][3].split()[0]) > 0, rows[name]
    err = float(stdout.split("max |diff| / max |ref| = ")[1].split()[0])
    assert err < 1e-4, stdout


def test_bench_generate_quick():
    """Greedy generation from a Llama checkpoint beside transformers' generate; ids compared."""
    stdout, rows = run_quick("bench_generate.py")
    for name in ("ours (f32)", "transformers fp32", "transformers fp16"):
        assert float(rows[name][1].split()[0]) > 0 and float(rows[name][2]) > 0, rows[name]
    assert "equal transformers' fp32 for the first 8 of 8" in stdout
