"""`meganeura optimize` and `meganeura train` through the CLI's main()."""

import json

import numpy as np

from engine import models
from engine.cli import main
from engine.weights import load_safetensors


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_optimize_json_has_the_documented_fields(capsys):
    code, out, _ = run_cli(capsys, "optimize", "gpt-tiny", "--set", "seq=8", "--set", "batch=1", "--json")
    assert code == 0
    r = json.loads(out)
    for key in ("model", "nodes_before", "nodes_after", "dispatches_before", "dispatches_after",
                "bytes_before", "bytes_after", "rules", "saturated", "seconds"):
        assert key in r, key
    assert r["model"] == "gpt-tiny" and r["nodes_after"] < r["nodes_before"]
    assert r["dispatches_after"] < r["dispatches_before"] and r["bytes_after"] < r["bytes_before"]
    assert r["rules"]["matmul_add"] > 0


def test_optimize_training_graph_table(capsys):
    code, out, _ = run_cli(capsys, "optimize", "mlp", "--train")
    assert code == 0
    assert "training graph" in out and "matmul_add" in out and "saturated: yes" in out


def test_train_gpu_lowers_the_loss_saves_weights_and_csv(capsys, tmp_path):
    save, csv = tmp_path / "mlp.safetensors", tmp_path / "loss.csv"
    code, out, err = run_cli(capsys, "train", "mlp", "--set", "batch=16", "--steps", "15", "--json",
                             "--backend", "gpu", "--save", str(save), "--loss-csv", str(csv))
    assert code == 0, err
    r = json.loads(out)
    assert r["backend"] == "gpu" and r["steps"] == 15 and len(r["losses"]) == 15
    assert isinstance(r["build_seconds"], float) and r["build_seconds"] > 0
    assert r["adapter"]["name"] and r["adapter"]["backend"] == "Vulkan"
    assert r["losses"][-1] < 0.5 * r["losses"][0]
    model = models.create("mlp", ["batch=16"])
    trained = model.bind(load_safetensors(save))
    assert not np.array_equal(trained["fc1.weight"], model.init_params(0)["fc1.weight"])
    assert csv.read_text().splitlines()[0].startswith("step,")
    assert len(csv.read_text().splitlines()) == 16


def test_train_reference_and_gpu_agree(capsys):
    losses = {}
    for backend in ("reference", "gpu"):
        code, out, err = run_cli(capsys, "train", "mlp", "--set", "batch=8", "--steps", "5", "--optimizer",
                                 "sgd", "--lr", "0.05", "--backend", backend, "--json")
        assert code == 0, err
        losses[backend] = json.loads(out)["losses"]
    np.testing.assert_allclose(losses["gpu"], losses["reference"], atol=1e-4)


def test_train_user_errors(capsys):
    code, _, err = run_cli(capsys, "train", "mlp", "--steps", "0")
    assert code == 2 and "--steps" in err
    code, _, err = run_cli(capsys, "train", "mlp", "--lr", "-1", "--backend", "reference")
    assert code == 2 and "lr" in err


def test_a_diverging_loss_is_one_warning_and_training_goes_on(capsys):
    code, out, err = run_cli(capsys, "train", "mlp", "--steps", "6", "--lr", "1e9", "--backend", "reference", "--json")
    warnings = [line for line in err.splitlines() if line.startswith("meganeura: warning:")]
    losses = json.loads(out)["losses"]
    assert code == 0 and len(losses) == 6
    assert len(warnings) == 1 and "learning rate (1e+09)" in warnings[0] and "100x" in warnings[0]
    code, out, err = run_cli(capsys, "train", "mlp", "--steps", "6", "--backend", "reference", "--json")
    assert code == 0 and "warning" not in err


def test_the_divergence_warning_names_where_the_loss_grew():
    from engine.train.history import TrainHistory
    h = TrainHistory()
    assert h.record(2.0, 0.1, 1.0, 0.01, 0) is None
    assert h.record(150.0, 0.1, 1.0, 0.01, 0) is None          # 75x: not yet
    first = h.record(250.0, 0.1, 1.0, 0.01, 0)
    assert first and "(step 1)" in first and "(step 3)" in first and h.warning == first
    assert h.record(1e6, 0.1, 1.0, 0.01, 0) is None             # once


def test_auto_backend_takes_the_reference_on_a_software_adapter_and_says_so(capsys):
    """On lavapipe the numpy executor is several times faster than the adapter; --backend
    gpu still forces the adapter (a GPU takes the adapter either way)."""
    from engine.runtime.device import adapter_info
    software = adapter_info()["software"]
    code, out, err = run_cli(capsys, "train", "mlp", "--steps", "2", "--json")
    notes = [line for line in err.splitlines() if line.startswith("meganeura: note:")]
    assert code == 0 and json.loads(out)["backend"] == ("reference" if software else "gpu")
    assert len(notes) == (1 if software else 0)
    if notes:
        assert "software renderer" in notes[0] and "--backend gpu" in notes[0]
    code, out, err = run_cli(capsys, "train", "mlp", "--steps", "2", "--backend", "gpu", "--json")
    assert code == 0 and json.loads(out)["backend"] == "gpu" and "note:" not in err
    code, out, err = run_cli(capsys, "run", "mlp", "--json")
    assert code == 0 and json.loads(out)["backend"] == ("reference" if software else "gpu")
