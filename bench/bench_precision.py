"""Is training on the cooperative-matrix path (f16 operands, f32 accumulation) sound?

Trains each model with ``meganeura train`` on the GPU, in f32 and in f16 precision
(``MEGANEURA_PRECISION``), from the same weights and data (seeds 0 and 1), and prints
one table: the loss over the last 10 steps (mean) of each run, the difference between
the f16 and f32 runs of one seed, and the noise to compare it with: the difference
between the f32 runs of the two seeds (different initial weights and data order), all
on that mean (a single step's loss jumps with its batch). Also the wall time of each
run. The f16 path exists only on Dawn with subgroup matrices (the H100 through
``MEGANEURA_WGPU=dawn``); elsewhere both columns run the f32 kernels.

    MEGANEURA_WGPU=dawn python3 bench/bench_precision.py [--steps 100] [--models mlp,gpt-tiny]
    .venv/bin/python bench/bench_precision.py --quick     # lavapipe: tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FULL = {"mlp": [], "gpt-tiny": ["batch=8", "seq=256"], "whisper-tiny": ["batch=1", "mel_len=3000"],
        "audio-align": ["mel_len=500"]}
QUICK = {"mlp": ["batch=8"], "gpt-tiny": ["batch=1", "seq=8"]}


def train(model: str, settings: list[str], steps: int, seed: int, precision: str) -> tuple[list[float], float]:
    """(losses, seconds) of one ``meganeura train`` run."""
    cmd = [sys.executable, "-m", "engine", "train", model, "--steps", str(steps), "--seed", str(seed), "--json"]
    for s in settings:
        cmd += ["--set", s]
    env = {**os.environ, "MEGANEURA_PRECISION": precision, "PYTHONPATH": f"{ROOT}{os.pathsep}"
           + os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)["losses"], time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--models", default="", help="comma-separated subset of the models")
    p.add_argument("--quick", action="store_true", help="tiny sizes (lavapipe)")
    args = p.parse_args()
    table = QUICK if args.quick else FULL
    steps = 3 if args.quick else args.steps
    chosen = [m for m in (args.models.split(",") if args.models else table)]
    rows = ["| model | steps | f32, last 10 (seed 0 / 1) | f16, last 10 (seed 0 / 1) | f16 - f32, same seed (0 / 1) "
            "| noise: f32 seed 0 - seed 1 | seconds f32 / f16 (seed 0) |",
            "|---|---|---|---|---|---|---|"]
    for model in chosen:
        runs = {(prec, seed): train(model, table[model], steps, seed, prec)
                for prec in ("f32", "f16") for seed in (0, 1)}
        tail = {k: sum(v[0][-10:]) / len(v[0][-10:]) for k, v in runs.items()}
        rows.append(f"| {model} {' '.join(table[model])} | {steps} "
                    f"| {tail[('f32', 0)]:.4f} / {tail[('f32', 1)]:.4f} "
                    f"| {tail[('f16', 0)]:.4f} / {tail[('f16', 1)]:.4f} "
                    f"| {tail[('f16', 0)] - tail[('f32', 0)]:+.4f} / {tail[('f16', 1)] - tail[('f32', 1)]:+.4f} "
                    f"| {tail[('f32', 0)] - tail[('f32', 1)]:+.4f} "
                    f"| {runs[('f32', 0)][1]:.1f} / {runs[('f16', 0)][1]:.1f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
