"""`meganeura train` QA bugs: every numeric training option checked in one place (TrainConfig,
which the Studio builds too), --seed refused alike by train, generate and profile, step
numbers that agree with metrics.jsonl everywhere, default run directories that two runs
started in the same second never share, and status.json "failed" when the final
checkpoint cannot be written."""

from __future__ import annotations

import errno
import json
import types

import numpy as np
import pytest

from engine import models
from engine.cli import main
from engine.errors import TrainingError
from engine.train import run_dir as run_dir_module
from engine.train.config import TrainConfig
from engine.train.run_dir import RunDirectory

MLP = ["mlp", "--set", "batch=8", "--set", "samples=64", "--backend", "reference"]


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The one error line (progress lines may come before it), and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("meganeura: error: ")]
    assert len(lines) == 1 and "Traceback" not in err and err.rstrip().endswith(lines[0]), err
    return lines[0]


def metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- 1. option ranges

@pytest.mark.parametrize("options, named", [
    (["--clip", "-1"], "--clip"), (["--clip", "0"], "--clip"), (["--clip", "inf"], "--clip"),
    (["--warmup", "-1"], "--warmup"), (["--weight-decay", "-1"], "--weight-decay"),
    (["--optimizer", "sgd", "--momentum", "2"], "--momentum"), (["--momentum", "-0.5"], "--momentum"),
    (["--lr", "0"], "--lr"), (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"),
    (["--steps", "0"], "--steps"), (["--steps", "-3"], "--steps"), (["--val-fraction", "2"], "--val-fraction"),
])
def test_an_out_of_range_training_option_is_one_line_naming_it(capsys, tmp_path, options, named):
    code, _, err = cli(capsys, "train", *MLP, "--steps", 2, "--run-dir", tmp_path / "run", *options)
    assert code == 2 and named in one_error_line(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fields", [{"clip_norm": 0.0}, {"clip_norm": -1.0}, {"momentum": 1.0},
                                    {"weight_decay": -0.1}, {"warmup_steps": -1}, {"lr": 0.0}, {"steps": 0},
                                    {"batch_size": 0}, {"epochs": 0}, {"seed": -1}, {"betas": (0.9, 1.0)},
                                    {"eps": 0.0}, {"lr_multipliers": {"fc1.*": -1.0}}])
def test_train_config_is_the_single_check(fields):
    """The Studio's training form builds a TrainConfig: it meets the same checks."""
    with pytest.raises(TrainingError, match="must be"):
        TrainConfig(**fields)


def test_clip_off_turns_clipping_off(capsys, tmp_path):
    code, _, err = cli(capsys, "train", *MLP, "--steps", 1, "--clip", "off", "--run-dir", tmp_path / "run")
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["clip_norm"] is None


# ---------------------------------------------------------------- 2. --seed

@pytest.mark.parametrize("argv", [["train", *MLP, "--steps", 1], ["profile", "mlp", "--steps", 1],
                                  ["generate", "gpt-tiny", "--prompt-ids", "1", "--backend", "reference"]])
def test_a_negative_seed_is_one_line_in_every_command(capsys, argv):
    code, _, err = cli(capsys, *argv, "--seed", -1)
    assert code == 2 and "--seed" in one_error_line(err) and ">= 0" in err


# ---------------------------------------------------------------- 3. step numbers

def test_the_nan_message_names_metrics_step_and_the_last_good_checkpoint(capsys, tmp_path):
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", *MLP, "--steps", 20, "--lr", "1e30", "--run-dir", run)
    rows = metrics(run)
    assert code == 2 and [r["step"] for r in rows] == [1] and np.isfinite(rows[0]["loss"])
    line = one_error_line(err)
    assert "loss became nan at step 2" in line and f"{run / 'checkpoint-1'}" in line, line
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "diverged" and status["step"] == 1 and "at step 2" in status["error"]


def test_nan_weights_fail_at_step_1(capsys, tmp_path):
    model = models.create("mlp", ["batch=8", "samples=64"])
    params = model.init_params(0)
    params["fc1.weight"][:] = np.nan
    model.save_weights(params, tmp_path / "nan.safetensors")
    code, _, err = cli(capsys, "train", *MLP, "--weights", tmp_path / "nan.safetensors", "--steps", 3,
                       "--run-dir", tmp_path / "run")
    line = one_error_line(err)
    assert code == 2 and "loss is nan at step 1, before any update" in line and "learning rate is not" in line, err


def test_the_divergence_warning_uses_metrics_steps(capsys, tmp_path):
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", *MLP, "--steps", 4, "--optimizer", "sgd", "--lr", 3, "--run-dir", run)
    warning = next(line for line in err.splitlines() if "meganeura: warning:" in line)
    rows = {r["step"]: r["loss"] for r in metrics(run)}
    first = next(s for s, loss in rows.items() if loss > 100 * rows[1])
    assert code == 0 and "(step 1)" in warning and f"(step {first})" in warning, (warning, rows)


def test_the_loss_csv_numbers_steps_as_metrics_and_goes_on_after_a_resume(capsys, tmp_path):
    run, a, b = tmp_path / "run", tmp_path / "a.csv", tmp_path / "b.csv"
    code, _, err = cli(capsys, "train", *MLP, "--steps", 3, "--run-dir", run, "--loss-csv", a)
    assert code == 0, err
    code, _, err = cli(capsys, "train", "--resume", run, "--steps", 5, "--loss-csv", b)
    assert code == 0, err
    steps = [int(line.split(",")[0]) for f in (a, b) for line in f.read_text().splitlines()[1:]]
    assert steps == [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]


def test_a_resume_names_the_options_it_ignores_as_they_were_written(capsys, tmp_path):
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", *MLP, "--steps", 2, "--run-dir", run)
    assert code == 0, err
    code, _, err = cli(capsys, "train", "mlp", "--set", "batch=4", "--lr", 0.5, "--resume", run, "--steps", 3)
    note = next(line for line in err.splitlines() if "meganeura: note:" in line)
    assert code == 0 and note.endswith("ignoring SOURCE, --set, --lr"), note


# ---------------------------------------------------------------- 4. default run directories

def test_default_run_paths_of_the_same_second_differ(tmp_path, monkeypatch):
    """Two runs started in the same second: each call claims its own folder."""
    monkeypatch.setattr(run_dir_module, "time", types.SimpleNamespace(strftime=lambda fmt: "20260101-000000"))
    first, second = (run_dir_module.new_run_path("mlp", tmp_path) for _ in range(2))
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == first.name + "-2"


def test_a_run_that_never_starts_leaves_no_default_folder(capsys, tmp_path, configure):
    configure(runs_dir=str(tmp_path / "runs"))
    code, _, err = cli(capsys, "train", *MLP, "--steps", 1, "--data", tmp_path / "missing.npz")
    runs = tmp_path / "runs"
    assert code == 2 and not (runs.exists() and any(runs.iterdir())), err


# ---------------------------------------------------------------- 5. the final checkpoint fails

def test_a_failed_final_checkpoint_leaves_status_failed(capsys, tmp_path, monkeypatch):
    def disk_full(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / f"checkpoint-{step}"))

    monkeypatch.setattr(RunDirectory, "save_checkpoint", disk_full)
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", *MLP, "--steps", 2, "--save-every", 0, "--run-dir", run)
    assert code == 2 and "No space left" in one_error_line(err)
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 2 and "No space left" in status["error"]
