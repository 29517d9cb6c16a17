"""A model file is what users open: every command takes a checkpoint folder (or an .onnx
file) where it takes a built-in name, and works on the file alone."""

import json

import numpy as np
import pytest
import torch
import transformers

from engine.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("smol")
    hf.save_pretrained(path)
    return hf, path


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_lists_inputs_outputs_parameters_and_ops(checkpoint, capsys):
    hf, path = checkpoint
    code, out, _ = cli(capsys, "inspect", path, "--set", "batch=2", "--set", "seq=8", "--json")
    s = json.loads(out)
    assert code == 0 and s["model_type"] == "llama"
    assert s["inputs"] == [{"name": "input_ids", "shape": [2, 8], "dtype": "i32"}]
    assert s["outputs"] == [{"name": "logits", "shape": [2, 8, 96], "dtype": "f32"}]
    assert s["parameters"] == sum(p.numel() for p in hf.parameters())
    assert s["ops"]["attention"] == 2 and s["ops"]["rms_norm"] == 5
    code, out, _ = cli(capsys, "inspect", path, "--set", "seq=8")
    assert code == 0 and "input_ids" in out and f"{s['parameters']:,}" in out


def test_run_on_a_checkpoint_writes_transformers_logits(checkpoint, capsys, tmp_path):
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, 96, (1, 8))
    np.save(tmp_path / "ids.npy", ids)
    for backend in ("reference", "gpu"):
        out_file = tmp_path / f"{backend}.npz"
        code, _, err = cli(capsys, "run", path, "--set", "seq=8", "--input", f"input_ids={tmp_path / 'ids.npy'}",
                           "--backend", backend, "--output", out_file)
        assert code == 0, err
        with torch.no_grad():
            ref = hf(torch.from_numpy(ids)).logits.numpy()
        got = np.load(out_file)["logits"]
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4, backend


def test_optimize_train_and_profile_work_on_the_file_alone(checkpoint, capsys):
    _, path = checkpoint
    code, out, _ = cli(capsys, "optimize", path, "--set", "seq=8", "--json")
    report = json.loads(out)
    assert code == 0 and report["nodes_after"] < report["nodes_before"]
    code, out, err = cli(capsys, "train", path, "--set", "seq=8", "--set", "batch=2", "--steps", "3",
                         "--backend", "reference", "--json")
    losses = json.loads(out)["losses"]
    assert code == 0 and len(losses) == 3 and all(np.isfinite(losses)), err
    assert abs(losses[0] - np.log(96)) < 1.0          # random weights: about uniform over the vocabulary
    code, out, err = cli(capsys, "profile", path, "--set", "seq=8", "--steps", "1", "--json")
    assert code == 0, err
    assert any(d["kernel"].startswith("model.layers.0.self_attn:attention") for d in json.loads(out)["dispatches"])


def test_a_path_that_is_no_model_is_one_line(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    for source in (tmp_path / "notes.txt", tmp_path / "missing.onnx", tmp_path):
        code, out, err = cli(capsys, "inspect", source)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert str(source) in err


def test_an_onnx_file_trains_and_profiles_with_a_loss_on_one_of_its_outputs(capsys, tmp_path):
    """A fixed-batch ONNX MLP (no `batch` setting): --loss/--target make it trainable, the
    step's batch is its input's leading dimension; without them train says what to give."""
    import warnings
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    path = tmp_path / "mlp.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(8, 12),), str(path), dynamo=True, verbose=False,
                          input_names=["x"], output_names=["y"])
    capsys.readouterr()
    code, out, err = cli(capsys, "train", path, "--steps", "2")
    assert code == 2 and "--loss mse|cross-entropy --target OUTPUT" in err and "y" in err
    code, out, err = cli(capsys, "train", path, "--steps", "20", "--loss", "mse", "--target", "y",
                         "--backend", "reference", "--json")
    losses = json.loads(out)["losses"]
    assert code == 0 and len(losses) == 20 and losses[-1] < losses[0], err
    code, out, err = cli(capsys, "profile", path, "--train", "--loss", "mse", "--target", "y", "--steps", "1", "--json")
    assert code == 0 and any(d["kernel"].startswith("train:") for d in json.loads(out)["dispatches"]), err
    code, out, err = cli(capsys, "optimize", path, "--train")   # the flags its message names exist here too
    assert code == 2 and "--loss mse|cross-entropy --target OUTPUT" in err
    code, out, err = cli(capsys, "optimize", path, "--train", "--loss", "mse", "--target", "y", "--json")
    assert code == 0 and json.loads(out)["train"] is True, err
    code, out, _ = cli(capsys, "inspect", path, "--json")
    s = json.loads(out)
    assert s["name"] == "mlp" and s["inputs"] == [{"name": "x", "shape": [8, 12], "dtype": "f32"}]


def test_a_checkpoints_weights_are_followed_on_a_terminal_only(monkeypatch):
    """On a terminal the command follows a checkpoint's weights as they are read, on one
    line of stderr; piped (logs, tests), it prints nothing for them."""
    import io
    import sys
    from engine.cli.commands import weights_progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stderr", Terminal())
    show = weights_progress("/models/llama-1b/")
    show(1 << 29, 1 << 30)
    show(1 << 30, 1 << 30)
    assert sys.stderr.getvalue() == ("\rreading the weights of llama-1b: 0.50 of 1.00 GiB"
                                     "\rreading the weights of llama-1b: 1.00 of 1.00 GiB\n")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert weights_progress("/models/llama-1b") is None
