"""ONNX import: torch-exported models vs onnxruntime, refusals, symbolic dimensions, training."""

import warnings

import numpy as np
import onnx
import pytest
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from engine.errors import MeganeuraError, ModelImportError
from engine.importers import load_model
from engine.importers.onnx import load_onnx

nn = torch.nn


def _export(model, args, path, **kw):
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), dynamo=True, verbose=False, **kw)
    return path


def _ort(path, inputs):
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, inputs)))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        y = torch.nn.functional.avg_pool2d(torch.relu(self.c2(y)), 2)
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("onnx")
    mlp = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 4))
    cnn = CNN()
    with torch.no_grad():  # non-trivial running statistics
        cnn.bn.running_mean.uniform_(-0.5, 0.5)
        cnn.bn.running_var.uniform_(0.5, 2.0)
    block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    return {
        "mlp": _export(mlp, (torch.randn(3, 12),), d / "mlp.onnx"),
        "cnn": _export(cnn, (torch.randn(2, 3, 16, 16),), d / "cnn.onnx"),
        "block": _export(block, (torch.randn(2, 5, 16),), d / "block.onnx"),
    }


@pytest.mark.parametrize("which", ["mlp", "cnn", "block"])
def test_torch_export_matches_onnxruntime(exported, which):
    model = load_model(exported[which])
    inputs = model.example_inputs()
    want = _ort(exported[which], inputs)
    got = model.run(inputs, backend="reference")
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5 * np.abs(want[k]).max())
    s = model.summary()
    assert s["parameters"] == sum(v.size for v in model.init_params().values()) > 0
    assert s["parameter_bytes"] == 4 * s["parameters"]
    assert [o["name"] for o in s["outputs"]] == list(want)
    assert sum(s["ops"].values()) == len(onnx.load(exported[which]).graph.node)


@pytest.mark.parametrize("which", ["mlp", "cnn", "block"])
def test_torch_exports_on_the_gpu_match_onnxruntime(exported, which):
    """The GPU path, fused: grouped convolution, batch norm, both pools, the transformer
    block's attention and layer norms."""
    model = load_model(exported[which])
    inputs = model.example_inputs()
    want = _ort(exported[which], inputs)
    got = model.run(inputs, backend="gpu")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want[k]).max()))


def test_training_graph_needs_loss_and_target(exported):
    model = load_onnx(exported["mlp"], {})
    with pytest.raises(MeganeuraError, match="--loss mse|cross-entropy --target OUTPUT"):
        model.build(train=True)
    out = next(iter(model.build().outputs))
    for loss, dtype, shape in (("mse", "f32", (3, 4)), ("cross-entropy", "i32", (3,))):
        m = load_onnx(exported["mlp"], {}, loss=loss, target=out)
        g = m.build(train=True)
        t = g[g.inputs["targets"]]
        assert (t.dtype, t.shape) == (dtype, shape) and g.shape(g.outputs["loss"]) == ()
        from engine.graph import reference
        inputs = m.example_inputs(train=True)
        loss_value = reference.run(g, inputs, m.init_params())["loss"]
        assert np.isfinite(loss_value) and loss_value > 0


def _save(tmp_path, nodes, inputs, outputs, name="m.onnx", opset=17, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / name
    onnx.save(model, path)
    return path


def test_not_onnx_and_truncated(tmp_path, exported):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n" * 20)
    with pytest.raises(ModelImportError, match="notes.onnx"):
        load_model(text)
    data = exported["cnn"].read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelImportError, match="cut.onnx"):
        load_model(cut)


def test_unsupported_ops_listed_in_one_error(tmp_path):
    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, [2, 4])
    y = helper.make_tensor_value_info("y", f, [2, 4])
    nodes = [helper.make_node("LpNormalization", ["x"], ["a"], name="lp1"),
             helper.make_node("Relu", ["a"], ["b"], name="ok"),
             helper.make_node("LpNormalization", ["b"], ["c"], name="lp2"),
             helper.make_node("Hardmax", ["c"], ["y"], name="hm")]
    path = _save(tmp_path, nodes, [x], [y])
    with pytest.raises(ModelImportError) as e:
        load_onnx(path, {})
    msg = str(e.value)
    assert "2 ONNX ops this importer does not handle" in msg
    assert "LpNormalization (2 nodes: lp1, lp2)" in msg and "Hardmax (1 node: hm)" in msg
    assert "Relu" not in msg and "\n" not in msg


def test_old_opset_refused(tmp_path):
    f = TensorProto.FLOAT
    path = _save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])],
                 [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])],
                 opset=11)
    with pytest.raises(ModelImportError, match="opset 11"):
        load_onnx(path, {})


def test_symbolic_dimensions_and_external_data(tmp_path):
    f = TensorProto.FLOAT
    w = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    table = np.random.default_rng(1).standard_normal((7, 8)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["h"], name="lookup"),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="proj")]
    inits = [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(table, "emb")]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", f, ["batch", "seq", 3])
    graph = helper.make_graph(nodes, "g", [ids], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "ext.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.bin",
              size_threshold=0)
    assert (tmp_path / "ext.bin").exists()
    with pytest.raises(ModelImportError, match="batch, seq.*--set batch=VALUE --set seq=VALUE"):
        load_onnx(path, {})
    with pytest.raises(ModelImportError, match="--set seq=VALUE"):
        load_onnx(path, {"batch": "2"})
    model = load_model(path, ["batch=2", "seq=5"])
    assert set(model.describe_settings()) == {"batch", "seq"}
    assert model.parameter_shapes() == {"w": (8, 3), "emb": (7, 8)}
    inputs = model.example_inputs()
    assert inputs["ids"].shape == (2, 5) and 0 <= inputs["ids"].min() and inputs["ids"].max() < 7
    got = model.run(inputs, backend="reference")["y"]
    np.testing.assert_allclose(got, table[inputs["ids"]] @ w, rtol=1e-5, atol=1e-6)
    assert model.summary()["inputs"] == [{"name": "ids", "shape": [2, 5], "dtype": "i32"}]
