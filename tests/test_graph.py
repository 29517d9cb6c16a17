"""The graph IR (shape errors, passes, printer, hash, JSON) and the reference
executor's handling of what users pass it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.graph import reference
from engine.errors import GraphError, ShapeError
from engine.graph.ir import Graph, Node

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- shape errors

def _f32_input(g, name, *shape):
    return g.input(name, shape)


SHAPE_ERRORS = {  # id: (graph -> thunk making the bad node, op named, shapes named)
    "matmul inner": (lambda g: lambda: g.matmul(_f32_input(g, "a", 2, 3), _f32_input(g, "b", 4, 5)), "matmul", ["[2, 3]", "[4, 5]"]),
    "matmul transposed inner": (lambda g: lambda: g.matmul(_f32_input(g, "a", 2, 3), _f32_input(g, "b", 4, 3), transpose_b=False),
                                "matmul", ["[2, 3]", "[4, 3]"]),
    "matmul batch": (lambda g: lambda: g.matmul(_f32_input(g, "a", 2, 2, 3), _f32_input(g, "b", 3, 3, 4)), "matmul", ["[2]", "[3]"]),
    "bias length": (lambda g: lambda: g.bias_add(_f32_input(g, "x", 2, 3), _f32_input(g, "b", 4)), "bias_add", ["[2, 3]", "[4]"]),
    "linear bias": (lambda g: lambda: g.linear(_f32_input(g, "x", 2, 3), g.parameter("w", (3, 5)), g.parameter("b", (3,))),
                    "bias_add", ["[2, 5]", "[3]"]),
    "broadcast": (lambda g: lambda: g.add(_f32_input(g, "x", 2, 3), _f32_input(g, "y", 4)), "add", ["[2, 3]", "[4]"]),
    "reshape size": (lambda g: lambda: g.reshape(_f32_input(g, "x", 2, 3), (4, 2)), "reshape", ["[2, 3]", "[4, 2]"]),
    "reshape -1": (lambda g: lambda: g.reshape(_f32_input(g, "x", 2, 3), (4, -1)), "reshape", ["[2, 3]", "[4, -1]"]),
    "conv does not fit": (lambda g: lambda: g.conv1d(_f32_input(g, "x", 1, 2, 3), g.parameter("w", (4, 2, 5))),
                          "conv1d", ["[3]", "[5]"]),
    "conv channels": (lambda g: lambda: g.conv2d(_f32_input(g, "x", 1, 3, 8, 8), g.parameter("w", (4, 2, 3, 3))),
                      "conv2d", ["[1, 3, 8, 8]", "[4, 2, 3, 3]"]),
    "conv bias": (lambda g: lambda: g.conv1d(_f32_input(g, "x", 1, 2, 9), g.parameter("w", (4, 2, 3)), g.parameter("b", (3,))),
                  "conv1d", ["[3]", "[4]"]),
    "conv stride 0": (lambda g: lambda: g.conv1d(_f32_input(g, "x", 1, 2, 9), g.parameter("w", (4, 2, 3)), stride=0),
                      "conv1d", ["[0]"]),
    "conv negative padding": (lambda g: lambda: g.conv2d(_f32_input(g, "x", 1, 2, 9, 9), g.parameter("w", (4, 2, 3, 3)), padding=-1),
                              "conv2d", ["[-1, -1]"]),
    "attention heads": (lambda g: lambda: g.attention(*[_f32_input(g, n, 1, 4, 6) for n in "qkv"], num_heads=4),
                        "attention", ["6", "4 heads"]),
    "attention kv groups": (lambda g: lambda: g.attention(_f32_input(g, "q", 1, 4, 8), _f32_input(g, "k", 1, 4, 6), _f32_input(g, "v", 1, 4, 6),
                                                          num_heads=4, num_kv_heads=3), "attention", ["4", "3"]),
    "attention zero heads": (lambda g: lambda: g.attention(*[_f32_input(g, n, 1, 4, 6) for n in "qkv"], num_heads=0),
                             "attention", ["num_heads=0"]),
    "attention kv width": (lambda g: lambda: g.attention(_f32_input(g, "q", 1, 4, 8), _f32_input(g, "k", 1, 4, 6), _f32_input(g, "v", 1, 4, 6),
                                                         num_heads=2), "attention", ["[1, 4, 6]"]),
    "rope odd head dim": (lambda g: lambda: g.rope(_f32_input(g, "x", 1, 4, 6), num_heads=2), "rope", ["[1, 4, 6]", "2 heads"]),
    "rope zero heads": (lambda g: lambda: g.rope(_f32_input(g, "x", 1, 4, 6), num_heads=0), "rope", ["[1, 4, 6]"]),
    "soft ce shape": (lambda g: lambda: g.cross_entropy_loss(_f32_input(g, "logits", 2, 5), _f32_input(g, "labels", 2, 4)),
                      "soft_cross_entropy", ["[2, 5]", "[2, 4]"]),
    "int ce shape": (lambda g: lambda: g.cross_entropy_loss(_f32_input(g, "logits", 2, 5), g.input("labels", (3,), "i32")),
                     "cross_entropy", ["[2, 5]", "[3]"]),
    "mse shape": (lambda g: lambda: g.mse_loss(_f32_input(g, "p", 2, 5), _f32_input(g, "t", 5, 2)), "mse_loss", ["[2, 5]", "[5, 2]"]),
    "embedding float ids": (lambda g: lambda: g.embedding(g.parameter("t", (9, 4)), _f32_input(g, "ids", 3)), "embedding", ["f32"]),
    "layer_norm weight": (lambda g: lambda: g.layer_norm(_f32_input(g, "x", 2, 6), g.parameter("w", (5,)), g.parameter("b", (6,))),
                          "layer_norm", ["[5]", "[6]"]),
    "group_norm groups": (lambda g: lambda: g.group_norm(_f32_input(g, "x", 2, 6, 4), g.parameter("w", (6,)), g.parameter("b", (6,)), 4),
                          "group_norm", ["6 channels", "4 groups"]),
    "reduce axis 0": (lambda g: lambda: g.sum(_f32_input(g, "x", 2, 6), axis=0), "sum", ["[2, 6]", "axis 0"]),
    "concat": (lambda g: lambda: g.concat([_f32_input(g, "a", 2, 3), _f32_input(g, "b", 3, 4)], axis=0), "concat", ["[2, 3]", "[3, 4]"]),
    "slice range": (lambda g: lambda: g.slice(_f32_input(g, "x", 2, 6), 1, 4, 8), "slice", ["[4:8]", "6"]),
    "slice axis": (lambda g: lambda: g.slice(_f32_input(g, "x", 2, 6), 2, 0, 1), "slice", ["axis 2", "rank 2"]),
    "transpose perm": (lambda g: lambda: g.permute(_f32_input(g, "x", 2, 6, 3), (0, 0, 1)), "transpose", ["[0, 0, 1]", "[2, 6, 3]"]),
    "i32 arithmetic": (lambda g: lambda: g.mul(g.input("i", (3,), "i32"), _f32_input(g, "x", 3)), "mul", ["i32"]),
    "broadcast_to": (lambda g: lambda: g.apply("broadcast_to", _f32_input(g, "x", 3, 2), shape=(3, 4)), "broadcast_to",
                     ["[3, 2]", "[3, 4]"]),
    "sum_to": (lambda g: lambda: g.apply("sum_to", _f32_input(g, "x", 3, 2), shape=(4,)), "sum_to", ["[3, 2]", "[4]"]),
}


@pytest.mark.parametrize("case", SHAPE_ERRORS, ids=str)
def test_shape_error_names_op_node_and_shapes(case):
    make, op, fragments = SHAPE_ERRORS[case]
    g = Graph("bad")
    bad = make(g)
    with pytest.raises(ShapeError) as info:
        bad()
    message = str(info.value)
    assert message.startswith(f"{op} (node %"), message
    failing_node = int(re.search(r"node %(\d+)", message).group(1))
    assert failing_node == len(g), "the error names the node being built; it is not added"
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_shape_error_names_the_node_and_its_operands():
    g = Graph()
    x = g.input("x", (2, 3))
    w = g.parameter("w", (4, 5))
    with pytest.raises(ShapeError) as info:
        g.matmul(x, w, name="logits")
    assert "node %2 'logits'" in str(info.value)
    assert "%0 'x' [2, 3] f32" in str(info.value) and "%1 'w' [4, 5] f32" in str(info.value)
    assert len(g) == 2, "a failed build adds no node"


def test_shape_inference_on_success():
    g = Graph()
    x = g.input("x", (2, 7, 3))
    w = g.parameter("w", (3, 5))
    assert g.shape(g.matmul(x, w)) == (2, 7, 5)
    assert g.shape(g.matmul(x, x, transpose_a=True)) == (2, 3, 3)
    assert g.shape(g.reshape(x, (-1, 3))) == (14, 3)
    assert g.shape(g.sum(x, axis=-1, keepdims=True)) == (2, 7, 1)
    assert g.shape(g.mean(x)) == ()
    assert g.shape(g.conv1d(g.input("a", (1, 3, 10)), g.parameter("k", (4, 3, 3)), stride=2, padding=1)) == (1, 4, 5)
    ids = g.input("ids", (2, 7), "i32")
    assert g[g.embedding(g.parameter("t", (9, 4)), ids)].shape == (2, 7, 4)
    assert g[g.reshape(ids, (14,))].dtype == "i32"
    assert g[g.cross_entropy_loss(g.input("l", (2, 7, 9)), ids)].op == "cross_entropy"
    assert g[g.cross_entropy_loss(g.input("l2", (2, 9)), g.input("soft", (2, 9)))].op == "soft_cross_entropy"


# ---------------------------------------------------------------- graph errors

def test_unknown_op_and_attribute_are_graph_errors():
    g = Graph("g")
    x = g.input("x", (2, 3))
    with pytest.raises(GraphError, match="unknown op 'frobnicate'"):
        g.apply("frobnicate", x)
    with pytest.raises(GraphError, match=r"add: unknown attribute\(s\) \['axis'\]"):
        g.apply("add", x, x, axis=1)
    with pytest.raises(GraphError, match="operand 7 is not an earlier node"):
        g.add(x, 7)
    with pytest.raises(GraphError, match="approximate"):
        g.gelu(x, approximate="fast")
    with pytest.raises(GraphError, match="already has 'x'"):
        g.input("x", (1,))
    with pytest.raises(GraphError, match="dtype"):
        g.input("y", (1,), "f16")
    with pytest.raises(GraphError, match="output 'y'.*not a node"):
        g.output("y", 99)
    assert len(g) == 1


def test_toposort_orders_operands_first():
    g = sample_graph()
    order = g.toposort()
    assert sorted(order) == list(range(len(g)))
    position = {n: i for i, n in enumerate(order)}
    assert all(position[i] < position[n.id] for n in g.nodes for i in n.inputs)


def _hand_built(edges: dict[int, tuple[int, ...]]) -> Graph:
    """Nodes appended directly, bypassing the builder's only-earlier-operands rule."""
    g = Graph("hand")
    g.input("x", (3,))
    for nid, inputs in edges.items():
        g.nodes.append(Node(nid, "add", inputs, (3,)))
    return g


def test_toposort_of_out_of_order_nodes_and_cycles():
    acyclic = _hand_built({1: (2, 0), 2: (0, 0)})  # node 1 reads the later node 2
    assert acyclic.toposort() == [0, 2, 1]
    cyclic = _hand_built({1: (0, 2), 2: (1, 0)})
    with pytest.raises(GraphError, match="cycle"):
        cyclic.toposort()


@pytest.mark.parametrize("later", [0, 1], ids=["self reference", "forward reference"])
def test_from_dict_rejects_references_to_later_nodes(later):
    g = sample_graph()
    d = g.to_dict()
    matmul = next(n.id for n in g.nodes if n.op == "matmul")
    d["nodes"][matmul]["inputs"] = [0, matmul + later]
    with pytest.raises(GraphError, match=f"node %{matmul}.*operand {matmul + later}"):
        Graph.from_dict(d)


# ---------------------------------------------------------------- sample graph

def sample_graph(hidden: int = 8, approximate: str = "tanh") -> Graph:
    """A graph touching tuple attributes, a pointwise program (with an infinite
    constant), None attributes, float and int constants and parameter metadata.
    Also imported by a subprocess in the hash test."""
    g = Graph("sample")
    x = g.input("x", (2, 3, 8))
    ids = g.input("ids", (2, 3), "i32")
    table = g.parameter("table", (11, hidden), init={"kind": "normal", "std": 0.02}, trainable=False)
    w = g.parameter("w", (8, hidden), init={"kind": "uniform", "bound": 0.5})
    b = g.parameter("b", (hidden,), decay=True)
    conv_w = g.parameter("conv_w", (hidden, 3, 3))
    h = g.add(g.linear(x, w, b), g.embedding(table, ids), name="h")
    h = g.gelu(h, approximate=approximate)
    h = g.attention(h, h, h, num_heads=2, causal=True)
    h = g.rope(h, num_heads=2, offset=1)
    program = (("tanh", (("in", 0),), ()), ("div", (("in", 0), ("c", float("inf"))), ()),
               ("add", (("t", 0), ("t", 1)), ()))
    h = g.apply("pointwise", h, program=program)
    c = g.conv1d(h, conv_w, stride=2, padding=1)
    g.output("conv", g.mul(c, g.constant(np.linspace(-1.0, 2.0, hidden).reshape(hidden, 1), name="scale")))
    g.output("y", g.mul(g.sum(h, axis=-1), g.constant(np.float32(0.25))))
    g.output("pick", g.slice(g.constant(np.arange(6), name="steps"), 0, 1, 4))
    g.exp(x, name="dead")  # read by nothing
    return g


def sample_values(g: Graph, seed=0):
    rng = np.random.default_rng(seed)
    inputs = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32),
              "ids": rng.integers(0, 11, (2, 3)).astype(np.int32)}
    params = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.parameters.items()}
    return inputs, params


# ---------------------------------------------------------------- passes

def test_prune_removes_dead_nodes_and_keeps_the_interface():
    g = sample_graph()
    g.parameter("unused", (3,))
    g.input("unused_in", (4,))
    g.constant(np.ones(3), name="unused_const")
    pruned, remap = g.prune()
    ops = [n.op for n in pruned.nodes]
    dead = [n for n in g.nodes if n.name in ("dead", "unused_const")]
    assert dead and all(n.id not in remap for n in dead)
    assert len(pruned) == len(g) - 2 and "exp" not in ops
    assert list(pruned.inputs) == list(g.inputs) and list(pruned.parameters) == list(g.parameters)
    assert list(pruned.outputs) == list(g.outputs)
    assert pruned.param_meta == g.param_meta
    assert all(pruned[remap[i]].op == "constant" for i in g.constants if i in remap)
    inputs, params = sample_values(g)
    inputs["unused_in"], params["unused"] = np.zeros(4, np.float32), np.zeros(3, np.float32)
    before, after = reference.run(g, inputs, params), reference.run(pruned, inputs, params)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


def test_prune_keeps_a_graph_without_dead_nodes_unchanged():
    g = sample_graph()
    once, _ = g.prune()
    twice, remap = once.prune()
    assert remap == {i: i for i in range(len(once))}
    assert twice.to_json() == once.to_json()


def test_printer_shows_ops_shapes_names_and_outputs():
    text = str(sample_graph())
    assert text.startswith("graph sample (")
    assert "%0 = input() : [2, 3, 8] f32  # x" in text
    assert "%1 = input() : [2, 3] i32  # ids" in text
    assert re.search(r"= matmul\(%0, %3\) : \[2, 3, 8\] f32 \{transpose_a=False, transpose_b=False\}", text)
    assert re.search(r"= add\(%\d+, %\d+\) : \[2, 3, 8\] f32  # h", text)
    assert "program=tanh ; div ; add" in text
    assert "stride=(2,), padding=(1,)" in text
    assert "%16 = mul(%14, %15) : [2, 8, 4] f32  -> output 'conv'" in text
    assert "%21 = slice(%20) : [3] i32 {axis=0, start=1, stop=4}  -> output 'pick'" in text
    assert "%22 = exp(%0) : [2, 3, 8] f32  # dead" in text


# ---------------------------------------------------------------- hashing and JSON

def test_structural_hash_is_stable_and_ignores_the_graph_name():
    a, b = sample_graph(), sample_graph()
    b.name = "another name"
    assert a.structural_hash() == b.structural_hash()
    assert re.fullmatch(r"[0-9a-f]{64}", a.structural_hash())


def test_structural_hash_is_stable_across_processes():
    code = "import sys; sys.path.insert(0, 'tests'); from test_graph import sample_graph; print(sample_graph().structural_hash())"
    hashes = {subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert hashes == {sample_graph().structural_hash()}


def test_structural_hash_changes_with_attrs_shapes_and_constants():
    base = sample_graph().structural_hash()
    assert sample_graph(approximate="none").structural_hash() != base  # an attribute
    assert sample_graph(hidden=12).structural_hash() != base            # shapes
    g = sample_graph()
    first = next(iter(g.constants))
    g.constants[first] = g.constants[first] + np.float32(1.0)
    assert g.structural_hash() != base                                 # a constant's value


def test_json_round_trip_is_exact():
    g = sample_graph()
    text = g.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = Graph.from_json(text)
    assert back.nodes == g.nodes  # id, op, inputs, shape, dtype, name
    for old, new in zip(g.nodes, back.nodes):
        assert new.attrs == old.attrs and repr(new.attrs) == repr(old.attrs), old.id  # tuples stay tuples
    assert (back.name, back.inputs, back.parameters, back.outputs) == (g.name, g.inputs, g.parameters, g.outputs)
    assert back.param_meta == g.param_meta
    assert back.constants.keys() == g.constants.keys()
    for i, c in g.constants.items():
        assert back.constants[i].dtype == c.dtype
        np.testing.assert_array_equal(back.constants[i], c)
    assert back.to_json() == text and back.structural_hash() == g.structural_hash()
    inputs, params = sample_values(g)
    ours, theirs = reference.run(g, inputs, params), reference.run(back, inputs, params)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])


def test_tampered_json_names_the_node():
    g = sample_graph()
    d = json.loads(g.to_json())
    matmul = next(n.id for n in g.nodes if n.op == "matmul")
    d["nodes"][matmul]["shape"] = [2, 3, 7]
    with pytest.raises(GraphError, match=rf"node %{matmul} \(matmul\): stored shape \[2, 3, 7\]"):
        Graph.from_dict(d)

    d = json.loads(g.to_json())
    d["nodes"][0]["shape"] = [2, 3, 9]  # the input: its user's shape rule fails
    with pytest.raises(GraphError, match=rf"matmul \(node %{matmul}\).*\[2, 3, 9\]"):
        Graph.from_dict(d)


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 99}), json.dumps({"format": 1, "name": "x"}),
                                  json.dumps({"format": 1, "name": "x", "nodes": [{"op": "input"}], "constants": {},
                                              "inputs": {}, "parameters": {}, "outputs": {}, "param_meta": {}})])
def test_malformed_json_is_a_graph_error(text):
    with pytest.raises(GraphError):
        Graph.from_json(text)


# ---------------------------------------------------------------- the reference executor

def test_missing_values_are_named():
    g = sample_graph()
    inputs, params = sample_values(g)
    del inputs["ids"], params["w"], params["conv_w"]
    with pytest.raises(GraphError, match="no value given for conv_w, ids, w"):
        reference.run(g, inputs, params)


@pytest.mark.parametrize("kind, name, value, fragment", [
    ("input", "x", np.zeros((2, 3, 7), np.float32), "expected shape [2, 3, 8], found [2, 3, 7]"),
    ("param", "b", np.zeros((8, 1), np.float32), "expected shape [8], found [8, 1]"),
    ("input", "ids", np.zeros((2, 3), np.float32), "expected integers (i32), found float32"),
])
def test_wrong_values_are_shape_errors(kind, name, value, fragment):
    g = sample_graph()
    inputs, params = sample_values(g)
    (inputs if kind == "input" else params)[name] = value
    with pytest.raises(ShapeError) as info:
        reference.run(g, inputs, params)
    assert f"'{name}'" in str(info.value) and fragment in str(info.value)


def test_float64_mode_and_float32_mode():
    g = sample_graph()
    inputs, params = sample_values(g)
    out64 = reference.run(g, inputs, params, dtype=np.float64)
    out32 = reference.run(g, inputs, params, dtype=np.float32)
    assert out64["y"].dtype == out64["conv"].dtype == np.float64
    assert out32["y"].dtype == out32["conv"].dtype == np.float32
    assert out64["pick"].dtype == out32["pick"].dtype == np.int32
    np.testing.assert_array_equal(out64["pick"], [1, 2, 3])
    np.testing.assert_allclose(out32["conv"], out64["conv"], rtol=1e-4, atol=1e-5)


def test_evaluate_keeps_what_is_asked():
    g = sample_graph()
    inputs, params = sample_values(g)
    dead = next(n.id for n in g.nodes if n.name == "dead")
    assert dead not in reference.evaluate(g, inputs, params)
    everything = reference.evaluate(g, inputs, params, keep="all")
    assert set(everything) == set(range(len(g)))
    np.testing.assert_allclose(everything[dead], np.exp(inputs["x"]), rtol=1e-6)


def _gather_graph(vocab=5):
    g = Graph()
    ids = g.input("ids", (4,), "i32")
    g.output("rows", g.embedding(g.parameter("table", (vocab, 2)), ids))
    g.output("loss", g.cross_entropy_loss(g.input("logits", (4, vocab)), ids, ignore_index=-100))
    return g


@pytest.mark.parametrize("ids", [[0, 1, 5, 2], [0, -1, 2, 3]], ids=["too large", "negative"])
def test_out_of_range_ids_raise(ids):
    g = _gather_graph()
    inputs = {"ids": np.array(ids, np.int32), "logits": np.zeros((4, 5), np.float32)}
    with pytest.raises(IndexError, match=r"embedding ids must lie in \[0, 5\)"):
        reference.run(g, inputs, {"table": np.zeros((5, 2), np.float32)})


@pytest.mark.parametrize("labels", [[0, 1, 5, -100], [0, -1, -100, 3]], ids=["too large", "negative"])
def test_out_of_range_labels_raise(labels):
    g = Graph()
    g.output("loss", g.cross_entropy_loss(g.input("logits", (4, 5)), g.input("labels", (4,), "i32")))
    with pytest.raises(IndexError, match=r"cross_entropy labels .* must lie in \[0, 5\)"):
        reference.run(g, {"logits": np.zeros((4, 5), np.float32), "labels": np.array(labels, np.int32)}, {})


def test_cross_entropy_with_every_position_ignored_is_zero():
    g = Graph()
    g.output("loss", g.cross_entropy_loss(g.input("logits", (3, 5)), g.input("labels", (3,), "i32"), ignore_index=2))
    logits = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    assert reference.run(g, {"logits": logits, "labels": np.full(3, 2, np.int32)}, {})["loss"] == 0.0
    loss = reference.run(g, {"logits": logits, "labels": np.array([2, 4, 2], np.int32)}, {})["loss"]
    expected = -(logits[1, 4] - np.log(np.exp(logits[1]).sum()))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)



@pytest.mark.parametrize("model", ["mlp", "gpt-tiny", "audio-align"])
def test_builtin_training_graphs_round_trip_through_json(model):
    from engine import models

    g = models.create(model).build(train=True)
    back = Graph.from_json(g.to_json())
    assert back.nodes == g.nodes and [n.attrs for n in back.nodes] == [n.attrs for n in g.nodes]
    assert back.param_meta == g.param_meta and back.outputs == g.outputs
    assert back.structural_hash() == g.structural_hash()
