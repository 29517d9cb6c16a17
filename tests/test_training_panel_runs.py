"""The Training panel's Data… picker and run directories (issue 19): a run started in the
Studio on the user's data writes the run directory ``meganeura train`` writes,
``resume_run`` goes on from its checkpoint to the losses of an uninterrupted run, Pause
holds the run and Stop leaves a checkpoint of the last step."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QFileDialog, QMessageBox

from app.state import StudioState
from app.training_panel import TrainingPanel, time_ago
from engine.cli import main
from engine.train.run_dir import RunDirectory


@pytest.fixture
def panel(qtbot, tmp_path):
    qs = QSettings(str(tmp_path / "studio.ini"), QSettings.Format.IniFormat)
    qs.setValue("runs/folder", str(tmp_path / "runs"))       # the Runs panel's folder
    state = StudioState()
    p = TrainingPanel(state, qs)
    qtbot.addWidget(p)
    state.load_model("mlp", {"batch": 8})      # the panel takes its batch from the model
    p.set_backend("reference")
    p.lr.setValue(0.01)
    return p


def data_file(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.normal(size=(48, 784)).astype(np.float32), labels=rng.integers(0, 10, 48))
    return path


def finish(qtbot, panel, start):
    with qtbot.waitSignal(panel.runFinished, timeout=60000) as blocker:
        assert start() is not None
    return blocker.args[0]


def test_data_picker_run_directory_and_resume(panel, qtbot, tmp_path, monkeypatch):
    path = data_file(tmp_path)
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(path), ""))
    file_action = panel.data_button.menu().actions()[0]
    file_action.trigger()
    assert panel.data_path == str(path) and panel.data_label.text() == "mine.npz"

    panel.steps.setValue(4)
    assert panel.batch.value() == 8
    assert finish(qtbot, panel, panel.start) == "finished"
    run = panel.run_dir
    assert run is not None and run.parent == tmp_path / "runs" and run.name.startswith("mlp-")
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["train"] == str(path) and config["data"]["train_examples"] == 46   # 2 held out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (run / "checkpoint-4" / "optimizer.safetensors").is_file()

    panel.steps.setValue(7)
    assert finish(qtbot, panel, lambda: panel.resume_run(str(run))) == "finished"
    assert panel.last_trainer.step_count == 7 and panel.plotted_points() == 7 and panel.progress.value() == 7
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert json.loads((run / "status.json").read_text())["status"] == "finished"

    # the same run from the command line, uninterrupted: the same losses
    code = main(["train", "mlp", "--set", "batch=8", "--data", str(path), "--lr", "0.01", "--steps", "7",
                 "--backend", "reference", "--run-dir", str(tmp_path / "cli")])
    assert code == 0
    cli_rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [r["loss"] for r in cli_rows]


def test_resume_of_a_folder_that_is_no_run_is_an_error(panel, qtbot, tmp_path):
    with qtbot.waitSignal(panel.failed, timeout=5000) as blocker:
        assert panel.resume_run(str(tmp_path)) is None
    title, exc = blocker.args
    assert title == "Cannot resume the run" and "not a run directory" in str(exc)
    assert panel.worker is None and panel.start_button.isEnabled()


def test_pause_holds_and_stop_leaves_a_checkpoint(panel, qtbot):
    panel.steps.setValue(100000)
    panel.start()
    qtbot.waitUntil(lambda: len(panel.holder["points"]) >= 2, timeout=30000)
    panel.toggle_pause()
    assert panel.pause_button.text() == "Resume"
    qtbot.wait(300)                                  # the step in flight, if any, completes
    held = len(panel.holder["points"])
    qtbot.wait(300)
    assert len(panel.holder["points"]) == held
    panel.toggle_pause()
    qtbot.waitUntil(lambda: len(panel.holder["points"]) > held, timeout=10000)
    with qtbot.waitSignal(panel.runFinished, timeout=30000) as blocker:
        panel.stop()
    assert blocker.args == ["stopped"]
    run = RunDirectory.open(panel.run_dir)
    done = panel.last_trainer.step_count
    assert run.status()["status"] == "stopped" and run.status()["step"] == done
    assert run.latest_checkpoint()[0] == done and run.metrics()[-1]["step"] == done


def cli_run(path, steps=2):
    """A finished mlp run directory with ``checkpoint-STEPS``, written by ``meganeura train``."""
    assert main(["train", "mlp", "--set", "batch=8", "--steps", str(steps), "--lr", "0.01", "--backend", "reference",
                 "--run-dir", str(path)]) == 0
    return path


def failures(panel):
    seen = []
    panel.failed.connect(lambda title, exc: seen.append((title, str(exc))))
    return seen


@pytest.mark.parametrize("damage", ["junk", "another model's weights"])
def test_a_checkpoint_that_cannot_be_read_leaves_the_open_model_open(panel, qtbot, tmp_path, damage):
    run = cli_run(tmp_path / "runs" / "mlp-run")
    state = panel.state
    state.load_model("gpt-tiny", {"seq": 16, "batch": 2})
    weights = run / "checkpoint-2" / "model.safetensors"
    if damage == "junk":
        weights.write_bytes(b"junk!")
    else:
        state.model.save_weights(state.params, weights)
    model, params = state.model, state.params
    status = (run / "status.json").read_text()
    seen = failures(panel)
    panel.steps.setValue(4)
    assert finish(qtbot, panel, lambda: panel.resume_run(str(run))) == "failed"
    assert len(seen) == 1 and "model.safetensors" in seen[0][1]
    assert state.model is model and state.params is params and state.model_name == "gpt-tiny"
    assert (run / "status.json").read_text() == status


def test_resume_opens_the_runs_model_once_its_checkpoint_is_read(panel, qtbot, tmp_path):
    run = cli_run(tmp_path / "runs" / "mlp-run")
    panel.state.load_model("gpt-tiny", {"seq": 16, "batch": 2})
    panel.steps.setValue(4)
    assert finish(qtbot, panel, lambda: panel.resume_run(str(run))) == "finished"
    assert panel.state.model_name == "mlp" and panel.last_trainer.step_count == 4
    assert set(panel.state.params) == set(panel.last_trainer.params)


def test_a_run_whose_status_says_running_is_resumed_after_asking(panel, qtbot, tmp_path, monkeypatch):
    """A process that died leaves status.json "running"; ``meganeura train --resume``
    goes on with such a run, and so does the Studio once the user says yes."""
    run = cli_run(tmp_path / "runs" / "mlp-run")
    status = {"status": "running", "step": 2, "updated": "2020-01-01T00:00:00+00:00"}
    (run / "status.json").write_text(json.dumps(status))
    asked, answers = [], [QMessageBox.StandardButton.No, QMessageBox.StandardButton.Yes]
    monkeypatch.setattr(QMessageBox, "question", lambda parent, title, text, *a, **k: asked.append(text)
                        or answers.pop(0))
    panel.steps.setValue(4)
    assert panel.resume_run(str(run)) is None and panel.worker is None            # no: nothing happens
    assert "running" in asked[0] and "days ago" in asked[0] and "interleave" in asked[0]
    assert json.loads((run / "status.json").read_text()) == status
    assert finish(qtbot, panel, lambda: panel.resume_run(str(run))) == "finished"
    assert len(asked) == 2 and RunDirectory.open(run).status()["status"] == "finished"
    assert [r["step"] for r in RunDirectory.open(run).metrics()] == [1, 2, 3, 4]


def test_the_training_path_is_the_run_being_written(panel, qtbot):
    panel.steps.setValue(100000)
    panel.start()
    qtbot.waitUntil(lambda: len(panel.holder["points"]) >= 1, timeout=30000)
    assert panel.training_path() is not None and panel.training_path().parent == panel.runs_folder()
    with qtbot.waitSignal(panel.runFinished, timeout=30000):
        panel.stop()
    assert panel.training_path() is None


@pytest.mark.parametrize("problem", ["batch", "missing data", "bad data"])
def test_a_failed_start_leaves_no_empty_run_directory(panel, qtbot, tmp_path, problem):
    if problem == "batch":
        panel.batch.setValue(100000)                   # more than the dataset's examples
    elif problem == "missing data":
        panel.set_data(str(tmp_path / "missing.npz"))
    else:
        (tmp_path / "bad.npz").write_bytes(b"not an npz")
        panel.set_data(str(tmp_path / "bad.npz"))
    seen = failures(panel)
    panel.steps.setValue(3)
    assert finish(qtbot, panel, panel.start) == "failed"
    assert seen and seen[0][0] == "Cannot start training"
    assert list((tmp_path / "runs").iterdir()) == []


def test_time_ago_says_how_stale_a_status_is():
    from datetime import datetime, timedelta, timezone
    now = datetime.now(timezone.utc)
    assert time_ago((now - timedelta(seconds=5)).isoformat()) in ("5 s ago", "6 s ago")
    assert time_ago((now - timedelta(minutes=7, seconds=3)).isoformat()) == "7 min ago"
    assert time_ago((now - timedelta(hours=3)).isoformat()) == "3 h ago"
    assert time_ago((now - timedelta(days=2)).isoformat()) == "2 days ago"
    assert time_ago(None) == time_ago("yesterday") == "at an unknown time"
