"""Run directories (issue 19): what a run writes, resuming it (10 steps + 10 resumed = 20
uninterrupted, on the reference backend and the GPU path), Ctrl-C and a non-finite loss
ending with a checkpoint of the last good step, atomic checkpoints, and a Hugging Face
model's checkpoint that transformers' from_pretrained and ``meganeura run`` open."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
import transformers

from engine import models
from engine.cli import main
from engine.importers import load_model
from engine.train import run_dir as run_dir_module
from engine.train.config import TrainConfig
from engine.train.data import DataLoader
from engine.train.run import RunOptions, TrainingRun, evaluation_batches
from engine.train.run_dir import RunDirectory
from engine.train.trainer import Trainer

MLP = ["mlp", "--set", "batch=8", "--set", "samples=64"]
RECIPE = ["--schedule", "warmup", "--warmup", "5", "--clip", "1.0", "--weight-decay", "0.1", "--lr", "0.01",
          "--eval-every", "5", "--val-fraction", "0.05", "--json"]


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.startswith("{") else out), err


def metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["reference", "gpu"])
def test_ten_steps_and_ten_resumed_equal_twenty(tmp_path, capsys, backend):
    a, b = tmp_path / "a", tmp_path / "b"
    common = [*RECIPE, "--backend", backend]
    code, first, err = cli(capsys, "train", *MLP, "--steps", 10, "--run-dir", a, *common)
    assert code == 0, err
    code, second, err = cli(capsys, "train", "--resume", a, "--steps", 20, "--json")
    assert code == 0, err
    code, whole, err = cli(capsys, "train", *MLP, "--steps", 20, "--run-dir", b, *common)
    assert code == 0, err
    assert second["first_step"] == 10 and second["backend"] == backend and len(second["losses"]) == 10
    resumed = first["losses"] + second["losses"]
    np.testing.assert_allclose(resumed, whole["losses"], rtol=0, atol=0 if backend == "reference" else 1e-6)
    rows = metrics(a)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert [r["loss"] for r in rows] == resumed
    assert all(set(r) >= {"step", "loss", "lr", "grad_norm", "seconds"} for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 10, 15, 20]
    np.testing.assert_allclose([r["val_loss"] for r in rows if "val_loss" in r],
                               [r["val_loss"] for r in metrics(b) if "val_loss" in r], rtol=1e-6)
    assert sorted(p.name for p in a.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-10", "checkpoint-20"]
    status = json.loads((a / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 20 and "T" in status["updated"]
    config = json.loads((a / "config.json").read_text())
    assert config["model"]["source"] == "mlp" and config["model"]["settings"]["batch"] == 8
    assert config["train"]["steps"] == 20 and config["seed"] == 0 and config["versions"]["numpy"]
    assert [r["from_step"] for r in config["resumes"]] == [10]
    assert config["data"]["val_examples"] == 3 and config["data"]["train_examples"] == 61    # round(0.05 * 64)
    state = json.loads((a / "checkpoint-10" / "state.json").read_text())     # 7 batches of 8 an epoch
    assert state["step"] == 10 and state["data"] == {"epoch": 1, "batch": 3, "batch_size": 8, "examples": 61,
                                                      "seed": 0}


def test_gpu_evaluation_sees_the_updated_parameters_and_matches_the_reference():
    """Validation on the GPU runs an inference session sharing the training session's
    parameters: after two updates it gives the reference's loss on those parameters
    (20 examples in batches of 8: the last batch wraps around to the first four)."""
    model = models.create("mlp", ["batch=8", "samples=28"])
    data = model.dataset(0)
    train = {k: v[:8] for k, v in data.items()}
    val = evaluation_batches({k: v[8:] for k, v in data.items()}, 8)
    assert len(val) == 3 and np.array_equal(val[2]["labels"][4:], data["labels"][8:12])
    gpu = Trainer(model.build(train=True), model.init_params(0), TrainConfig(lr=0.01, batch_size=8), backend="gpu")
    gpu.step(train)
    gpu.step(train)
    reference = Trainer(model.build(train=True), gpu.params, TrainConfig(batch_size=8), backend="reference")
    assert gpu.evaluate(val) == pytest.approx(reference.evaluate(val), rel=1e-5)
    assert reference.evaluate(val) != pytest.approx(Trainer(model.build(train=True), model.init_params(0),
                                                            TrainConfig(batch_size=8)).evaluate(val), rel=1e-3)


def test_ctrl_c_ends_with_a_checkpoint_and_the_resumed_run_matches(tmp_path):
    """SIGINT in the middle of update 5 of a 12-step cosine run: the step completes with
    its metrics line, a checkpoint of it is written, status stopped; resuming gives the
    uninterrupted run's losses. Python's own SIGINT handler is installed for the test, as
    in a terminal: a suite started in the background by a shell without job control
    inherits SIGINT ignored, which a run rightly respects (it then finished, 2026-11-28)."""
    model = models.create("mlp", ["batch=8", "samples=40"])
    config = TrainConfig(optimizer="adam", lr=0.01, schedule="cosine", steps=12, batch_size=8, seed=3)
    options = RunOptions(source="mlp", settings=dict(model.settings), val_fraction=0.0)
    run = TrainingRun.start(model, model.init_params(3), config, options, tmp_path / "a")
    update = run.trainer._update

    def interrupted_update(batch, step, lr):
        if step == 4:
            signal.raise_signal(signal.SIGINT)
        return update(batch, step, lr)

    run.trainer._update = interrupted_update
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run.run() == "stopped"
    finally:
        signal.signal(signal.SIGINT, previous)
    directory = RunDirectory.open(tmp_path / "a")
    assert directory.status()["status"] == "stopped" and directory.latest_checkpoint()[0] == 5
    assert [r["step"] for r in directory.metrics()] == [1, 2, 3, 4, 5]
    resumed = TrainingRun.resume(directory, models.create("mlp", ["batch=8", "samples=40"]))
    assert resumed.run() == "finished"
    whole = TrainingRun.start(model, model.init_params(3), config, options, tmp_path / "b")
    whole.run()
    assert [r["loss"] for r in directory.metrics()] == whole.trainer.history.losses
    assert [r["lr"] for r in directory.metrics()] == whole.trainer.history.lrs


def test_a_non_finite_loss_keeps_the_last_good_step(tmp_path, capsys):
    """NaN inputs in exactly the batch of step 4 (metrics.jsonl's numbering, from 1): three
    good updates, then the run ends "diverged" with checkpoint-3, one error line and exit
    status 2."""
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(32, 784)).astype(np.float32), "labels": rng.integers(0, 10, 32)}
    bad_rows = DataLoader(data, 8, seed=0, drop_last=True).order(0)[24:32]
    data["x"][bad_rows] = np.nan
    np.savez(tmp_path / "d.npz", **data)
    code, _, err = cli(capsys, "train", *MLP, "--data", tmp_path / "d.npz", "--val-fraction", 0, "--steps", 6,
                       "--backend", "reference", "--run-dir", tmp_path / "run")
    assert code == 2
    assert "loss became nan at step 4" in err and "checkpoint-3" in err, err
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "diverged" and status["step"] == 3
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    assert RunDirectory(tmp_path / "run").latest_checkpoint()[0] == 3


def test_checkpoints_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    model = models.create("mlp", ["batch=4"])
    params = model.init_params(0)
    run = RunDirectory.create(tmp_path / "run", {"model": {"source": "mlp"}})
    good = run.save_checkpoint(2, model, params, {}, {"seconds": 1.0})
    assert sorted(p.name for p in good.iterdir()) == ["model.safetensors", "optimizer.safetensors", "state.json"]

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(run_dir_module, "save_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        run.save_checkpoint(4, model, params, {}, {})
    assert sorted(p.name for p in run.path.iterdir()) == ["checkpoint-2", "config.json", "metrics.jsonl",
                                                          "status.json"]
    # what a crash could leave: a temp folder, a checkpoint folder without its state.json
    (run.path / ".checkpoint-6.x1.tmp").mkdir()
    (run.path / "checkpoint-8").mkdir()
    assert run.latest_checkpoint() == (2, good)
    # a metrics line cut short by a crash is skipped, and dropped when a resume rewrites the file
    run.append_metrics({"step": 1, "loss": 1.0})
    run.append_metrics({"step": 2, "loss": 0.5})
    with open(run.path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    assert [r["step"] for r in run.metrics()] == [1, 2]
    run.keep_metrics_through(1)
    assert (run.path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert not [p for p in run.path.iterdir() if p.suffix == ".tmp" and p.is_file()]


def test_a_llama_checkpoint_opens_in_transformers_with_our_logits(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    code, out, err = cli(capsys, "train", tmp_path / "llama", "--set", "seq=8", "--set", "batch=2", "--steps", 3,
                         "--lr", "0.01", "--backend", "reference", "--run-dir", tmp_path / "run", "--json")
    assert code == 0, err
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "config.json").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
    original = load_model(str(tmp_path / "llama"), ["seq=8", "batch=2"])
    ours = load_model(str(checkpoint), ["seq=8", "batch=2"])   # what `meganeura run CHECKPOINT` opens
    assert not np.allclose(ours.init_params()["model.embed_tokens.weight"],
                           original.init_params()["model.embed_tokens.weight"])       # it was trained
    ids = np.random.default_rng(1).integers(0, 120, (2, 8)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    logits = ours.run({"input_ids": ids}, backend="reference")["logits"]   # the GPU's: tests/test_hf_import.py
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4
    code, out, err = cli(capsys, "run", checkpoint, "--set", "seq=8", "--set", "batch=2", "--backend", "reference",
                         "--json")
    assert code == 0 and out["outputs"]["logits"]["shape"] == [2, 8, 120], err
