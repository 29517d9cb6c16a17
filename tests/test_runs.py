"""Reading run directories (engine.train.runs) and ``meganeura runs``, on run folders
written here the way ``train --run-dir`` writes them."""

import json
import math

import numpy as np
import pytest

from engine.cli import main
from engine.train.run_dir import RunDirectory
from engine.train.runs import RunMetrics, debiased_ema, list_runs, read_metrics


def write_run(folder, name, losses, *, val_every=0, status="finished", checkpoints=(), model="mlp",
              created="2026-11-26T10:00:00", steps=None, seconds=0.25):
    """A run directory written with the writer's RunDirectory: config.json in its layout,
    a metrics line per loss (steps from 1; val_loss every ``val_every`` steps),
    status.json (removed when ``status`` is None), and checkpoint folders with their
    state.json (the weights are not read here)."""
    config = {"created": created, "model": {"source": model, "name": model, "settings": {}},
              "train": {"steps": steps or len(losses), "optimizer": "adamw", "lr": 1e-3, "batch_size": 8},
              "data": {"train": None}, "seed": 0, "versions": {}, "adapter": None}
    run = RunDirectory.create(folder / name, config)
    for i, loss in enumerate(losses, start=1):
        row = {"step": i, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "seconds": seconds}
        if val_every and i % val_every == 0:
            row["val_loss"] = loss + 0.1
        run.append_metrics(row)
    if status is None:
        (run.path / "status.json").unlink()
    else:
        run.write_status(status, len(losses))
    for step in checkpoints:
        (run.path / f"checkpoint-{step}").mkdir()
        (run.path / f"checkpoint-{step}" / "state.json").write_text(json.dumps({"step": step}))
    return run.path


def tensorboard_smoothing(values, weight):
    """TensorBoard's resmoothDataset (vz_line_chart2/line-chart.ts), written out loop by loop."""
    last, count, out = 0.0, 0, []
    constant = all(v == values[0] for v in values)
    for v in values:
        if constant or not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        count += 1
        out.append(last / (1 - weight ** count))
    return out


# ---------------------------------------------------------------- smoothing

def test_debiased_ema_by_hand():
    # weight 0.5 on [4, 2, 3]: EMA from 0 is 2, 2, 2.5; debiased by 1 - 0.5**n = 0.5, 0.75, 0.875
    np.testing.assert_allclose(debiased_ema([4.0, 2.0, 3.0], 0.5), [4.0, 2.0 / 0.75, 2.5 / 0.875], rtol=1e-12)


@pytest.mark.parametrize("weight", [0.0, 0.3, 0.6, 0.9, 0.999])
def test_debiased_ema_matches_tensorboard(weight):
    values = list(np.random.default_rng(3).standard_normal(50) * 0.3 + np.linspace(3, 1, 50))
    values[7], values[20] = math.nan, math.inf       # passed through, not counted
    smoothed = debiased_ema(values, weight)
    np.testing.assert_allclose(smoothed, tensorboard_smoothing(values, weight), rtol=1e-12, equal_nan=True)
    assert smoothed[0] == values[0]
    assert np.isnan(smoothed[7]) and smoothed[20] == math.inf


@pytest.mark.parametrize("weight", [1e-12, 0.003, 0.5, 0.99, 0.9999])
def test_debiased_ema_over_many_blocks_matches_tensorboard(weight):
    """Series longer than the blocks the EMA is computed in, for weights whose powers
    shrink fast (short blocks) or slowly: TensorBoard's loop, to the scale of the values."""
    values = np.random.default_rng(5).standard_normal(3000) * 2 + np.linspace(8, 1, 3000)
    want = np.asarray(tensorboard_smoothing(list(values), weight))
    assert np.max(np.abs(debiased_ema(values, weight) - want)) < 1e-12 * np.max(np.abs(want))


def test_smoothing_does_not_import_scipy_signal():
    """The Studio smooths its loss plot on the UI thread: importing scipy.signal there
    stalled it for 0.7 s at the first plotted step."""
    import subprocess
    import sys
    code = ("import sys; from engine.train.runs import debiased_ema; debiased_ema([3.0, 1.0, 2.0], 0.6); "
            "print('scipy.signal' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


def test_debiased_ema_properties():
    constant = debiased_ema([0.7] * 30, 0.95)
    assert np.all(constant == 0.7)
    noisy = np.random.default_rng(0).standard_normal(200) + 5
    assert debiased_ema(noisy, 0.9)[0] == noisy[0]
    np.testing.assert_array_equal(debiased_ema(noisy, 0.0), noisy)            # weight 0: no smoothing
    assert np.std(np.diff(debiased_ema(noisy, 0.9))) < 0.3 * np.std(np.diff(noisy))
    assert debiased_ema([], 0.5).size == 0
    with pytest.raises(ValueError):
        debiased_ema([1.0], 1.0)


# ---------------------------------------------------------------- metrics.jsonl

def test_read_metrics_ignores_a_partial_last_line_and_reads_incrementally(tmp_path):
    run = write_run(tmp_path, "r", [3.0, 2.5, 2.0], val_every=2)
    path = run / "metrics.jsonl"
    rows, offset = read_metrics(run)
    assert [r["loss"] for r in rows] == [3.0, 2.5, 2.0] and offset == path.stat().st_size
    assert rows[1]["val_loss"] == 2.6 and "val_loss" not in rows[0]
    with open(path, "a") as f:
        f.write('{"step": 4, "loss": 1.8, "seconds": 0.2')       # the writer is mid-line
    rows, offset2 = read_metrics(run, offset)
    assert rows == [] and offset2 == offset
    with open(path, "a") as f:
        f.write(', "lr": 0.001}\n{"step": 5, "lo')
    rows, offset3 = read_metrics(run, offset2)
    assert [r["step"] for r in rows] == [4] and rows[0]["lr"] == 0.001
    assert path.read_bytes()[offset3:] == b'{"step": 5, "lo'
    assert read_metrics(tmp_path / "missing") == ([], 0)


def test_run_metrics_update_reads_only_new_rows_and_a_resume_replaces_repeated_steps(tmp_path):
    run = write_run(tmp_path, "r", [3.0, 2.5, 2.0, 1.9], val_every=2, seconds=0.5)
    metrics = RunMetrics(run)
    assert metrics.update() == 4 and metrics.update() == 0
    cols = metrics.columns()
    np.testing.assert_array_equal(cols["step"], [1, 2, 3, 4])
    np.testing.assert_array_equal(cols["wall"], [0.5, 1.0, 1.5, 2.0])
    np.testing.assert_array_equal(cols["val_step"], [2, 4])
    np.testing.assert_allclose(cols["val_loss"], [2.6, 2.0])
    # resumed from a checkpoint at step 2: steps 3 and 4 come again, then step 5
    with open(run / "metrics.jsonl", "a") as f:
        for step, loss in ((3, 2.1), (4, 1.95), (5, 1.7)):
            f.write(json.dumps({"step": step, "loss": loss, "seconds": 0.5}) + "\n")
    assert metrics.update() == 3
    cols = metrics.columns()
    np.testing.assert_array_equal(cols["step"], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(cols["loss"], [3.0, 2.5, 2.1, 1.95, 1.7])
    np.testing.assert_array_equal(cols["val_step"], [2])
    # an evaluation written on a line of its own joins its step; a NaN loss stays a point
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "val_loss": 1.8}) + "\n" + '{"step": 6, "loss": NaN, "seconds": 0.5}\n')
    assert metrics.update() == 2 and len(metrics) == 6
    cols = metrics.columns()
    np.testing.assert_array_equal(cols["step"], [1, 2, 3, 4, 5, 6])
    assert np.isnan(cols["loss"][-1])
    np.testing.assert_array_equal(cols["val_step"], [2, 5])
    np.testing.assert_array_equal(cols["val_wall"], [1.0, 2.5])


def test_run_metrics_skip_rows_without_a_whole_step(tmp_path):
    """A row without a step (or a step that is not a whole number) is no point: the
    Studio's read-out turned its NaN step into an int on every mouse move."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"loss": 1.0}\n{"step": 2.5, "loss": 1.2}\n'
                                       '{"step": true, "loss": 1.1}\n{"step": 3, "loss": 1.5}\n')
    metrics = RunMetrics(run)
    assert metrics.update() == 2
    np.testing.assert_array_equal(metrics.columns()["step"], [1, 3])
    assert [r["step"] for r in RunDirectory(run).metrics()] == [1, 3]   # as the command line reads it


def test_run_metrics_reads_a_rewritten_file_from_the_start(tmp_path):
    run = write_run(tmp_path, "r", [3.0, 2.5, 2.0, 1.9])
    metrics = RunMetrics(run)
    metrics.update()
    directory = RunDirectory.open(run)
    directory.keep_metrics_through(2)          # what a resume does: a new file, then longer than the old one
    for step, loss in ((3, 2.2), (4, 2.1), (5, 1.6), (6, 1.5)):
        directory.append_metrics({"step": step, "loss": loss, "seconds": 0.25})
    metrics.update()
    np.testing.assert_array_equal(metrics.columns()["loss"], [3.0, 2.5, 2.2, 2.1, 1.6, 1.5])
    assert metrics.rewrites == 1


# ---------------------------------------------------------------- list_runs

def test_list_runs_summarizes_each_run(tmp_path):
    write_run(tmp_path, "b-run", [2.0, 1.5, 1.0, 0.9], val_every=2, status="running", checkpoints=(2,),
              created="2026-11-26T11:00:00", steps=10)
    write_run(tmp_path, "a-run", [4.0, 3.0, math.nan], status="diverged", model="gpt-tiny",
              created="2026-11-26T12:00:00")
    write_run(tmp_path, "c-run", [1.0, 0.5], status=None, checkpoints=(1, 2), created="2026-11-25T09:00:00")
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "b-run" / "checkpoint-4").mkdir()          # no state.json: not (yet) a checkpoint
    RunDirectory.open(tmp_path / "c-run").update_config(model={"source": "/ckpt/tiny-llama/"})
    runs = list_runs(tmp_path)
    assert [r.name for r in runs] == ["c-run", "b-run", "a-run"]          # oldest first
    c, b, a = runs
    assert (b.model, b.last_step, b.last_loss, b.best_val_loss, b.status, b.checkpoints, b.steps) == \
        ("mlp", 4, 0.9, pytest.approx(1.0), "running", [2], 10)
    assert a.status == "diverged" and math.isnan(a.last_loss) and a.best_val_loss is None
    assert a.to_dict()["last_loss"] is None                                # JSON has no NaN
    assert c.status == "unknown" and c.checkpoints == [1, 2] and c.created == "2026-11-25T09:00:00"
    assert (c.model, c.model_name, a.model, a.model_name) == ("/ckpt/tiny-llama/", "tiny-llama", "gpt-tiny", "gpt-tiny")
    assert list_runs(tmp_path / "b-run")[0].name == "b-run"                # a run folder itself
    assert list_runs(tmp_path / "missing") == []


# ---------------------------------------------------------------- the command

def test_cli_runs_table_and_json(tmp_path, capsys):
    write_run(tmp_path, "mlp-1", [2.3, 2.0, 1.75], val_every=3, status="finished", checkpoints=(3,))
    write_run(tmp_path, "mlp-2", [2.4, 2.2], status="stopped", created="2026-11-26T13:00:00", steps=50)
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["run", "model", "step", "last", "loss", "best", "val", "loss", "status"]
    assert out[1].split() == ["mlp-1", "mlp", "3/3", "1.75", "1.85", "finished"]
    assert out[2].split() == ["mlp-2", "mlp", "2/50", "2.2", "-", "stopped"]
    assert main(["runs", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    first = report["runs"][0]
    assert set(first) >= {"name", "path", "model", "last_step", "last_loss", "best_val_loss", "status", "created",
                          "checkpoints"}
    assert (first["name"], first["last_step"], first["last_loss"], first["best_val_loss"], first["checkpoints"]) == \
        ("mlp-1", 3, 1.75, pytest.approx(1.85), [3])


def test_cli_runs_missing_folder_is_one_line_and_status_2(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err and "no such folder" in err
