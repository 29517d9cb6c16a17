"""The bench scripts' --quick paths run and print every row with finite numbers
(keeps the benchmarks from rotting; no timing is asserted)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import codegen

ROOT = Path(__file__).resolve().parent.parent
# "train whisper-tiny b8" is left out: under --quick it runs the code of "train whisper-tiny".
QUICK = {"bench_vs_torch": ["--quick", "--skip", "train whisper-tiny b8"], "bench_checkpoint": ["--quick"],
         "bench_generate": ["--quick"]}
ONE_PROCESS = ("import importlib, json, sys\n"
               "sys.path.insert(0, sys.argv[1])\n"
               "for script, argv in json.loads(sys.argv[2]).items():\n"
               "    print('== ' + script, flush=True)\n"
               "    if importlib.import_module(script).main(argv):\n"
               "        sys.exit(1)\n")
ROWS = ["matmul 64x64x64", "matmul 128x128x128", "matmul 8x128x128", "train mlp", "train whisper-tiny",
        "memory whisper-tiny train", "train gpt-tiny", "audio-align smoke 1 step",
        "audio-align smoke 1 step, warm cache", "infer whisper-tiny", "host record/dispatch", "infer whisper-tiny b8",
        "steps/s mlp"]
BF16_ROWS = ["matmul 64x64x64", "train mlp", "train whisper-tiny", "train gpt-tiny", "audio-align smoke 1 step",
             "infer whisper-tiny", "infer whisper-tiny b8", "steps/s mlp"]


@pytest.fixture(scope="module")
def quick_output() -> dict[str, str]:
    """Each script's --quick output, all from one process: torch, transformers and the GPU
    device start once instead of three times. In f32 (the tolerances below are f32's),
    also where the suite runs with MEGANEURA_PRECISION=f16."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGANEURA_PRECISION="f32")
    proc = subprocess.run([sys.executable, "-c", ONE_PROCESS, str(ROOT / "bench"), json.dumps(QUICK)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = re.split(r"^== (\w+)$", proc.stdout, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def table_rows(text: str) -> dict[str, list[str]]:
    """A markdown table's rows (its header's too) by first cell."""
    return {cells[0]: cells for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def number(cell: str) -> float:
    value = float(cell.split()[0])
    assert math.isfinite(value) and value > 0, cell
    return value


def test_bench_vs_torch_quick(quick_output):
    """Every row, our time and each torch column that runs under --quick (eager fp32 and
    bf16 autocast; transformers' encoder in fp32 and fp16), compile left out with a note."""
    stdout = quick_output["bench_vs_torch"]
    rows = table_rows(stdout)
    header = rows["workload"]
    assert set(ROWS) <= set(rows), f"missing rows: {set(ROWS) - set(rows)}\n{stdout}"
    rows = {name: dict(zip(header, cells)) for name, cells in rows.items()}
    for name in ROWS:
        number(rows[name]["ours"])
        if rows[name]["eager fp32"] != "-":
            number(rows[name]["eager fp32"])
    for name in BF16_ROWS:
        for column in ("eager bf16", "ours/eager bf16"):
            number(rows[name][column])
        assert rows[name]["compile fp32"] == rows[name]["compile bf16"] == "-", rows[name]
    b8 = rows["infer whisper-tiny b8"]
    for column in ("hf fp32", "ours/hf fp32", "hf fp16", "ours/hf fp16"):
        number(b8[column])
    err = float(re.search(r"largest difference / largest value ([^ ;]+)", b8["note"]).group(1))
    assert err < 1e-4, b8   # transformers' encoder holds our weights
    for name in ("train mlp", "train whisper-tiny", "train gpt-tiny", "infer whisper-tiny b8"):
        assert "; rounds: ours " in rows[name]["note"] and " eager bf16 " in rows[name]["note"], rows[name]
    left_out = r"^- compile fp32, compile bf16 in train mlp, .*: compile: left out in --quick"
    assert re.search(left_out, stdout, re.M), stdout


def test_training_rows_take_turns_and_a_failing_side_says_why(monkeypatch):
    """bench_vs_torch's rows run their sides in turns, round after round (a training side:
    its steps), each side's times kept per round; a side that raises stops with one line
    and keeps no times."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_vs_torch as bench
    order = []

    def side(name, fail_at=None):
        def step():
            order.append(name)
            if order.count(name) == fail_at:
                raise RuntimeError("out of memory\nsecond line\nthird line")
            return float(len(order)), "extra"
        return step

    sides = {"ours": side("ours"), "a": side("a"), "b": side("b", fail_at=3)}
    times, losses, why = bench.interleaved_rounds({k: bench.steps_of(v, 2) for k, v in sides.items()}, rounds=3)
    assert order == ["ours", "ours", "a", "a", "b", "b", "ours", "ours", "a", "a", "b", "ours", "ours", "a", "a"]
    assert [len(times[k]["all"]) for k in ("ours", "a")] == [6, 6] and times["b"] is None
    assert [len(times[k]["rounds"]) for k in ("ours", "a")] == [3, 3]
    assert why == {"b": "RuntimeError: out of memory second line"}
    assert losses["ours"] == 13.0 and losses["a"] == 15.0
    note = bench.rounds_note(times)
    assert note.startswith("; rounds: ours ") and " a " in note and " b " not in note, note


def test_bench_kernels_quick():
    """bench/bench_kernels.py --quick runs every matmul kernel (whole and with K split), the attention kernels
    (per-query; tiled whole and with its keys split) and the fused backward, and prints
    their rows with finite times and small errors (no timing asserted; f32's errors, also
    where the suite runs with MEGANEURA_PRECISION=f16)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGANEURA_PRECISION="f32")
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
    assert len(matmuls) == 30 and len(attention) == 6 and len(backward) == 4, proc.stdout
    independent = [r for r in rows if r[0].endswith("matmuls 64x32x32")]
    assert [r[1] for r in independent] == ["1", "3"], proc.stdout
    long_k = {r[2]: r[-1] for r in matmuls if r[0] == "long k"}
    auto = codegen.split_rule(1, 300)    # codegen's own choice for one 64 x 64 tile, K = 300
    assert "K split 3 ways" in long_k["64, split 3"], long_k
    assert (f"K split {auto} ways" if auto > 1 else "64x64 tile") in long_k["64"], long_k
    decode = {r[2]: r[-1] for r in matmuls if r[0] == "decode"}   # one row: the vector kernel, its K split too
    assert "1-row vector kernel" in decode["auto"] and "K split 3 ways" in decode["auto, split 3"], decode
    cross = {r[2]: r[-1] for r in attention if r[0] == "small cross"}   # 130 keys: 3 blocks, so 2 parts
    assert "keys split 2 ways" in cross["tiled, splits 2"] and "split" not in cross["tiled, splits 1"], cross
    for r in backward:
        assert math.isfinite(float(r[3].split()[0])) and float(r[3].split()[0]) > 0, r
        per_op = dict(part.split() for part in r[-1].removeprefix("ms: ").split(";")[0].split(", "))
        assert set(per_op) == {"lse", "grad_q", "grad_kv"} and all(float(v) > 0 for v in per_op.values()), r
    for r in matmuls + attention:
        assert math.isfinite(float(r[3].split()[0])) and float(r[3].split()[0]) > 0, r
        err = float(r[-1].split(";")[0].split()[1])
        assert err < 1e-5, r


def test_bench_checkpoint_quick(quick_output):
    """A Llama checkpoint through save_pretrained and our importer, beside transformers."""
    stdout = quick_output["bench_checkpoint"]
    rows = table_rows(stdout)
    for name in ("ours (engine, f32)", "transformers fp32", "transformers bf16 autocast"):
        assert float(rows[name][1].split()[0]) > 0 and float(rows[name][3].split()[0]) > 0, rows[name]
    err = float(stdout.split("max |diff| / max |ref| = ")[1].split()[0])
    assert err < 1e-4, stdout


def test_bench_generate_quick(quick_output):
    """Greedy generation from a Llama checkpoint beside transformers' generate; ids compared."""
    stdout = quick_output["bench_generate"]
    rows = table_rows(stdout)
    for name in ("ours (f32, bf16 checkpoint)", "transformers fp32", "transformers fp16", "transformers bf16"):
        assert float(rows[name][1].split()[0]) > 0 and float(rows[name][2]) > 0, rows[name]
    assert "equal transformers' fp32 for the first 8 of 8" in stdout
