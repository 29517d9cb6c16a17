"""`meganeura models` and `meganeura run`, driven through the CLI's main()."""

import json

import numpy as np
import pytest

from engine import models
from engine.graph import reference
from engine.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_models_json_lists_every_builtin_with_settings(capsys):
    code, out, _ = run_cli(capsys, "models", "--json")
    assert code == 0
    listed = json.loads(out)["models"]
    assert set(listed) == set(models.names()) >= {"mlp", "whisper-tiny", "gpt-tiny", "audio-align"}
    assert listed["whisper-tiny"]["settings"]["mel_len"]["default"] == 3000
    assert listed["gpt-tiny"]["settings"]["seq"]["maximum"] == 4096       # what the Studio's editor stops at
    assert "maximum" not in listed["mlp"]["settings"]["batch"]


def test_run_reference_writes_the_reference_outputs(capsys, tmp_path):
    out_file = tmp_path / "out.npz"
    code, out, err = run_cli(capsys, "run", "mlp", "--set", "batch=4", "--backend", "reference",
                             "--output", str(out_file), "--json")
    assert code == 0, err
    assert "reference" in err  # progress on stderr, JSON alone on stdout
    report = json.loads(out)
    assert report["outputs"]["logits"]["shape"] == [4, 10]
    model = models.create("mlp", ["batch=4"])
    expected = reference.run(model.build(), model.example_inputs(), model.init_params(0))["logits"]
    np.testing.assert_array_equal(np.load(out_file)["logits"], expected)


def test_run_with_weights_and_input_files(capsys, tmp_path):
    model = models.create("mlp", ["batch=2"])
    params = model.init_params(seed=7)
    weights = tmp_path / "w.safetensors"
    model.save_weights(params, weights)
    x = np.random.default_rng(1).standard_normal((2, 784)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out_file = tmp_path / "o.npz"
    code, _, err = run_cli(capsys, "run", "mlp", "--set", "batch=2", "--backend", "reference",
                           "--weights", str(weights), "--input", f"x={tmp_path / 'x.npy'}",
                           "--output", str(out_file))
    assert code == 0, err
    expected = reference.run(model.build(), {"x": x}, params)["logits"]
    np.testing.assert_allclose(np.load(out_file)["logits"], expected, rtol=1e-6)


def test_user_errors_exit_2_with_one_clear_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "no-such-model", "--backend", "reference")
    assert code == 2 and "no-such-model" in err and "mlp" in err
    code, _, err = run_cli(capsys, "run", "mlp", "--set", "batch=zero", "--backend", "reference")
    assert code == 2 and "batch" in err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    code, _, err = run_cli(capsys, "run", "mlp", "--weights", str(bad), "--backend", "reference")
    assert code == 2 and "bad.safetensors" in err
    assert len([line for line in err.splitlines() if line.startswith("meganeura: error")]) == 1


@pytest.mark.parametrize("argv, says", [
    (("inspect", ""), "the model is an empty name"),
    (("tune", "--inference"), "--inference says which graph of SOURCE to time; give SOURCE too"),
    (("runs", "{file}"), "is a file; give the folder that holds your run directories"),
    (("inspect", "{no_type}"), "has no model_type, so the architecture is unknown"),
])
def test_what_qa_found_confusing_is_one_clear_line(capsys, tmp_path, argv, says):
    (tmp_path / "notes.txt").write_text("not runs")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    paths = {"file": tmp_path / "notes.txt", "no_type": tmp_path / "ck"}
    code, _, err = run_cli(capsys, *(a.format(**paths) for a in argv))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("meganeura: error: ") and says in lines[0], err


@pytest.mark.parametrize("command", [("profile", "mlp"), ("compare", "a.json", "b.json")])
def test_top_takes_at_least_one_row(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--top", "0"])
    assert exit_.value.code == 2 and "--top: 0 is below 1" in capsys.readouterr().err


@pytest.mark.usefixtures("f32_kernels")   # f32's tolerance
def test_run_gpu_matches_reference(capsys, tmp_path):
    outs = {}
    for backend in ("gpu", "reference"):
        path = tmp_path / f"{backend}.npz"
        code, _, err = run_cli(capsys, "run", "gpt-tiny", "--set", "batch=1", "--set", "seq=8",
                               "--backend", backend, "--output", str(path))
        assert code == 0, err
        outs[backend] = np.load(path)["logits"]
    scale = np.abs(outs["reference"]).max()
    assert np.abs(outs["gpu"] - outs["reference"]).max() / scale < 1e-4


def test_unwritable_output_paths_are_refused_before_any_work(capsys, tmp_path):
    """Every path a command writes is checked first: one line, status 2, nothing run."""
    missing = tmp_path / "no" / "such"
    cases = [("run", "mlp", "--output", str(missing / "out.npz")),
             ("train", "mlp", "--steps", "1", "--save", str(missing / "w.safetensors")),
             ("train", "mlp", "--steps", "1", "--loss-csv", str(tmp_path)),
             ("profile", "mlp", "--steps", "1", "--trace", str(missing / "t.pftrace"))]
    for argv in cases:
        code, out, err = run_cli(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (argv, err)
        assert lines[0].startswith("meganeura: error: --") and str(argv[-1]) in lines[0], lines
        assert out == ""
    assert not any(tmp_path.rglob("*.tmp")) and not missing.exists()


def test_an_input_file_that_is_not_npy_is_named_as_such(capsys, tmp_path):
    """numpy reads other bytes as a pickle and suggests allow_pickle: never that advice."""
    garbage = tmp_path / "x.npy"
    garbage.write_bytes(b"PK\x03\x04" + bytes(range(200)))
    code, _, err = run_cli(capsys, "run", "mlp", "--backend", "reference", "--input", f"x={garbage}")
    assert code == 2 and err.strip().endswith("not an .npy file (one array written by numpy.save)")
    assert "pickle" not in err
