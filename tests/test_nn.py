"""The Module API: names by attribute path, init specs, shared parameters across
graphs, captures, and the attention module against PyTorch."""

import math

import numpy as np
import pytest
import torch

import torch_reference as tr
from engine.graph import nn, reference
from engine.errors import MeganeuraError, ShapeError
from engine.graph.ir import Graph


class Block(nn.Module):
    def __init__(self, width):
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width, bias=False, transpose_on_load=False)

    def forward(self, g, x):
        return g.add(x, self.fc2(g, g.relu(self.fc1(g, self.norm(g, x)))))


class Tower(nn.Module):
    def __init__(self, width=8, depth=2):
        self.embed = nn.Embedding(16, width)
        self.layers = [Block(width) for _ in range(depth)]
        self.head = nn.Linear(width, 16)

    def forward(self, g, ids, capture=False):
        x = self.embed(g, ids)
        for layer in self.layers:
            x = layer(g, x)
            if capture:
                nn.capture(g, layer.path, x)
        return self.head(g, x)


def build(model, batch, capture=False):
    g = Graph(f"tower-b{batch}")
    ids = g.input("ids", (batch, 5), "i32")
    g.output("logits", model(g, ids, capture=capture))
    return g


def test_parameter_names_follow_attribute_paths():
    root = nn.Container(encoder=Tower())
    assert list(root.parameter_shapes()) == [
        "encoder.embed.weight",
        "encoder.layers.0.norm.weight", "encoder.layers.0.norm.bias",
        "encoder.layers.0.fc1.weight", "encoder.layers.0.fc1.bias", "encoder.layers.0.fc2.weight",
        "encoder.layers.1.norm.weight", "encoder.layers.1.norm.bias",
        "encoder.layers.1.fc1.weight", "encoder.layers.1.fc1.bias", "encoder.layers.1.fc2.weight",
        "encoder.head.weight", "encoder.head.bias",
    ]
    assert root.encoder.layers[1].fc1.path == "encoder.layers.1.fc1"
    assert len(root.encoder.layers) == 2


def test_graph_parameters_carry_names_specs_and_decay_flags():
    model = Tower()
    g = build(model, 2)
    assert set(g.parameters) == set(model.parameter_shapes())
    meta = g.param_meta
    assert meta["layers.0.fc1.weight"]["decay"] and meta["head.weight"]["decay"]
    for no_decay in ("embed.weight", "layers.0.norm.weight", "layers.0.norm.bias", "head.bias"):
        assert not meta[no_decay]["decay"], no_decay
    assert meta["layers.0.norm.weight"]["init"] == nn.ones()
    assert g.shape(g.parameters["layers.0.fc1.weight"]) == (8, 16)  # [in, out]


def test_two_graphs_share_one_parameter_dict():
    model = Tower()
    train, infer = build(model, 4), build(model, 1)
    assert train.parameters.keys() == infer.parameters.keys()
    params = model.init_params(7)
    ids = np.arange(20, dtype=np.int32).reshape(4, 5) % 16
    batched = reference.run(train, {"ids": ids}, params)["logits"]
    single = reference.run(infer, {"ids": ids[2:3]}, params)["logits"]
    np.testing.assert_allclose(batched[2:3], single, rtol=1e-6, atol=1e-6)


def test_calling_a_module_twice_reuses_its_parameters():
    lin = nn.Container(proj=nn.Linear(4, 4)).proj
    g = Graph()
    x = g.input("x", (2, 4))
    lin(g, lin(g, x))
    assert list(g.parameters) == ["proj.weight", "proj.bias"]
    assert sum(n.op == "parameter" for n in g.nodes) == 2


def test_a_parameter_conflicting_with_the_graph_is_a_shape_error():
    g = Graph()
    g.parameter("proj.weight", (3, 3))
    lin = nn.Container(proj=nn.Linear(4, 4)).proj
    with pytest.raises(ShapeError, match="proj.weight"):
        lin(g, g.input("x", (2, 4)))


def test_tied_parameter_has_one_name():
    root = nn.Container(embed=nn.Embedding(10, 4))
    root.head = nn.Module()
    root.head.weight = root.embed.weight
    assert list(root.parameter_shapes()) == ["embed.weight"]


def test_unattached_parameter_has_no_name():
    with pytest.raises(MeganeuraError, match="not attached"):
        nn.Parameter((2,)).name


def test_weight_transposes_list_linear_weights_loaded_transposed():
    assert Tower().weight_transposes() == {"layers.0.fc1.weight", "layers.1.fc1.weight", "head.weight"}


def test_freeze_marks_parameters_untrainable():
    model = Tower()
    model.layers[0].freeze()
    g = build(model, 1)
    assert not g.param_meta["layers.0.fc1.weight"]["trainable"]
    assert g.param_meta["layers.1.fc1.weight"]["trainable"]


# ---------------------------------------------------------------- init specs

def test_init_is_deterministic_per_seed_and_independent_of_order():
    a, b, c = Tower().init_params(3), Tower().init_params(3), Tower().init_params(4)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == np.float32
    assert not np.array_equal(a["layers.0.fc1.weight"], c["layers.0.fc1.weight"])
    deeper = Tower(depth=3).init_params(3)  # more layers do not shift the others' values
    np.testing.assert_array_equal(a["head.weight"], deeper["head.weight"])
    np.testing.assert_array_equal(Tower().reset(3)["embed.weight"], a["embed.weight"])


@pytest.mark.parametrize("spec, mean, std", [
    (nn.normal(0.02), 0.0, 0.02),
    (nn.normal(0.5, mean=1.0), 1.0, 0.5),
    (nn.uniform(-0.3, 0.9), 0.3, 1.2 / math.sqrt(12)),
    (nn.kaiming(200), 0.0, math.sqrt(2 / 200)),
    (nn.xavier(300, 100), 0.0, math.sqrt(6 / 400) / math.sqrt(3)),
])
def test_random_inits_have_the_right_statistics(spec, mean, std):
    x = nn.initialize(spec, (300, 100), np.random.default_rng(0))
    assert abs(x.mean() - mean) < 0.05 * std + 1e-3
    assert abs(x.std() - std) < 0.03 * std


def test_bounded_and_constant_inits():
    rng = np.random.default_rng(0)
    u = nn.initialize(nn.uniform(-0.3, 0.9), (1000,), rng)
    assert u.min() >= -0.3 and u.max() <= 0.9
    bound = math.sqrt(6 / 40)
    assert np.abs(nn.initialize(nn.xavier(20, 20), (20, 20), rng)).max() <= bound
    np.testing.assert_array_equal(nn.initialize(nn.zeros(), (3,), rng), 0)
    np.testing.assert_array_equal(nn.initialize(nn.ones(), (3,), rng), 1)


def test_sinusoidal_init_is_whisper_position_table():
    table = nn.initialize(nn.sinusoidal(), (50, 8), None)
    np.testing.assert_allclose(table[0], [0, 0, 0, 0, 1, 1, 1, 1], atol=1e-7)
    inv = np.exp(-math.log(10000) / 3 * np.arange(4))
    np.testing.assert_allclose(table[7, :4], np.sin(7 * inv), rtol=1e-6)


def test_unknown_init_kind_is_a_user_error():
    with pytest.raises(MeganeuraError, match="bogus"):
        nn.initialize({"kind": "bogus"}, (2,), np.random.default_rng(0))


def test_graph_param_meta_reproduces_module_init():
    model = Tower()
    from_graph = nn.init_graph_params(build(model, 1), 5)
    for k, v in model.init_params(5).items():
        np.testing.assert_array_equal(from_graph[k], v)


# ---------------------------------------------------------------- captures

def test_captures_read_back_by_name():
    model = Tower()
    g = build(model, 2, capture=True)
    assert nn.capture_names(g) == ["layers.0", "layers.1"]
    ids = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.int32)
    params = model.init_params(0)
    captured = nn.read_captures(reference.run(g, {"ids": ids}, params))
    assert set(captured) == {"layers.0", "layers.1"}
    every = reference.evaluate(g, {"ids": ids}, params, keep="all")
    head_matmul = g[g.outputs["logits"]].inputs[0]  # logits = bias_add(matmul(layers.1 output, w), b)
    layer1_out = g[head_matmul].inputs[0]
    np.testing.assert_array_equal(captured["layers.1"], every[layer1_out])
    assert captured["layers.0"].shape == (2, 5, 8)
    assert not np.allclose(captured["layers.0"], captured["layers.1"])


# ---------------------------------------------------------------- attention against PyTorch

@pytest.mark.parametrize("kv_heads, causal, rope, k_bias", [
    (4, False, False, False),
    (2, True, True, True),
    (1, True, False, True),
])
def test_multi_head_attention_matches_torch(kv_heads, causal, rope, k_bias):
    root = nn.Container(attn=nn.MultiHeadAttention(32, 4, num_kv_heads=kv_heads, k_bias=k_bias,
                                                   causal=causal, rope=rope, init=nn.normal(0.2)))
    g = Graph()
    x = np.random.default_rng(1).normal(size=(2, 6, 32)).astype(np.float32)
    g.output("y", root.attn(g, g.input("x", x.shape)))
    assert ("attn.k_proj.bias" in g.parameters) == k_bias
    params = {k: v + 0.1 for k, v in root.init_params(2).items()}
    found = reference.run(g, {"x": x}, params)["y"]
    file_layout = {k: v.T if k in root.weight_transposes() else v for k, v in params.items()}
    expected = tr.self_attention(torch.from_numpy(x).double(), tr.tensors(file_layout), "attn", 4,
                                 kv_heads=kv_heads, causal=causal, rope=rope, k_bias=k_bias).numpy()
    assert np.abs(found - expected).max() / np.abs(expected).max() < 1e-4


def test_conv_modules_shapes_and_names():
    root = nn.Container(c1=nn.Conv1d(3, 5, 3, stride=2, padding=1), c2=nn.Conv2d(3, 4, (3, 1)))
    g = Graph()
    y1 = root.c1(g, g.input("a", (2, 3, 9)))
    y2 = root.c2(g, g.input("b", (2, 3, 6, 6)))
    assert g.shape(y1) == (2, 5, 5) and g.shape(y2) == (2, 4, 4, 6)
    assert root.parameter_shapes() == {"c1.weight": (5, 3, 3), "c1.bias": (5,), "c2.weight": (4, 3, 3, 1),
                                       "c2.bias": (4,)}
    assert root.weight_transposes() == set()
