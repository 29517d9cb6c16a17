"""Module names (issue 20, item 3): graph nodes remember the module they came from -
a Hugging Face checkpoint's tensor paths, a torch ONNX export's name scopes, a built-in
model's attribute paths - and fusion, autodiff, the plan, the plan cache, kernel names,
profiles and their per-module totals keep them."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch
from llama_checkpoint import save_llama
from onnx import TensorProto, helper

from engine import models
from engine.autodiff.gradients import differentiate
from engine.cli import main
from engine.compile.cache import cached_plan
from engine.compile.plan import compile_plan
from engine.graph.ir import Graph, common_module
from engine.graph.modules import OPTIMIZER_STEP, TOP_LEVEL, block_of, containers, describe
from engine.importers import load_model
from engine.optimize import optimize


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gpt_tiny():
    model = models.create("gpt-tiny", seq=8, batch=1)
    forward, _ = optimize(model.build(train=True))
    train, pairs = differentiate(forward)
    return model, forward, train, pairs


def modules_of(g: Graph, op: str) -> list[tuple[str, ...]]:
    return [n.modules for n in g.nodes if n.op == op]


# ---------------------------------------------------------------- where names come from

def test_checkpoint_nodes_carry_the_checkpoint_module_paths(llama_folder):
    g = load_model(str(llama_folder), ["seq=8"]).build(train=True)
    assert modules_of(g, "attention") == [("model.layers.0.self_attn",), ("model.layers.1.self_attn",)]
    params = {n.name: n.module for n in g.nodes if n.op == "parameter"}
    # every weight sits in the module its checkpoint name says
    assert all(m == name.rpartition(".")[0] for name, m in params.items()), params
    rope = [n.module for n in g.nodes if n.op == "rope"]
    assert rope == ["model.layers.0.self_attn"] * 2 + ["model.layers.1.self_attn"] * 2
    head = [n for n in g.nodes if n.op == "matmul" and n.attrs["transpose_b"]]
    assert [n.module for n in head] == ["lm_head"]        # tied: the embedding's table, the head's module
    assert {g[i].module for i in g.inputs.values()} == {""} and g[g.outputs["loss"]].module == ""


def test_onnx_export_from_torch_names_nodes_by_module(tmp_path):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.norm = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x + self.fc2(torch.relu(self.fc1(x))))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    net = Net().eval()
    for layer in net.layers:            # distinct norm weights: the exporter shares equal initializers
        torch.nn.init.uniform_(layer.norm.weight)
    path = tmp_path / "net.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 8),), str(path), dynamo=True, verbose=False)
    g = load_model(str(path), []).build()
    assert modules_of(g, "layer_norm") == [("layers.0.norm",), ("layers.1.norm",)]
    assert modules_of(g, "relu") == [("layers.0",), ("layers.1",)]
    assert [n.module for n in g.nodes if n.op == "matmul"] == [
        "layers.0.fc1", "layers.0.fc2", "layers.1.fc1", "layers.1.fc2", "head"]
    assert g[g.parameters["layers.1.fc2.weight"]].module == "layers.1.fc2"


def test_onnx_without_metadata_takes_the_path_in_the_node_name(tmp_path):
    """TorchScript-era exports name nodes ``/encoder/layer.0/MatMul`` and carry no scopes."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="/encoder/layer.0/MatMul"),
             helper.make_node("Relu", ["h"], ["y"], name="relu_top")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    path = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    g = load_model(str(path), []).build()
    assert modules_of(g, "matmul") == [("encoder.layer.0",)] and modules_of(g, "relu") == [()]
    assert g[g.parameters["w"]].module == "encoder.layer.0"          # no module in its name: its reader's


def test_builtin_model_nodes_carry_attribute_paths(gpt_tiny):
    model, *_ = gpt_tiny
    g = model.build()
    assert [n.module for n in g.nodes if n.op == "attention"] == [f"layers.{i}.attn" for i in range(6)]
    assert g[g.parameters["layers.2.mlp.fc1.weight"]].module == "layers.2.mlp.fc1"
    assert [n.module for n in g.nodes if n.op == "embedding"] == ["embed"]


def test_graph_scope_stamps_and_json_keeps_modules_out_of_the_structural_hash():
    g = Graph("g")
    x = g.input("x", (2, 3))
    with g.scope("blocks.0"):
        y = g.relu(x)
        with g.scope("blocks.0.inner"):
            z = g.exp(y)
        w = g.neg(z)
    out = g.output("y", g.add(w, x))
    assert [g[i].modules for i in (x, y, z, w, out)] == [(), ("blocks.0",), ("blocks.0.inner",), ("blocks.0",), ()]
    back = Graph.from_json(g.to_json())
    assert [n.modules for n in back.nodes] == [n.modules for n in g.nodes]
    plain = Graph.from_dict({**g.to_dict(), "nodes": [{k: v for k, v in nd.items() if k != "modules"}
                                                      for nd in g.to_dict()["nodes"]]})
    assert plain.structural_hash() == g.structural_hash() and not any(n.modules for n in plain.nodes)
    assert common_module(["a.b.c", "a.b.cd", "a.b"]) == "a.b" and common_module([]) == ""


# ---------------------------------------------------------------- kept through the pipeline

def test_fusion_keeps_the_modules_of_what_it_merges(gpt_tiny):
    model, *_ = gpt_tiny
    original = model.build(train=True)
    fused, report = optimize(original)
    for nid, origins in report.origins.items():
        assert set(fused[nid].modules) == {m for o in origins for m in original[o].modules}
    # the MLP's second matmul takes the block's residual add: both modules, the block as its module
    residual = [n for n in fused.nodes if n.op == "fused_matmul" and n.attrs["has_add"]]
    assert [n.modules for n in residual] == [(f"layers.{i}", f"layers.{i}.{inner}") for i in range(6)
                                             for inner in ("attn.out_proj", "mlp.fc2")]
    assert {n.module for n in residual} == {f"layers.{i}" for i in range(6)}
    assert report.rule_modules["matmul_activation"] == {f"layers.{i}.mlp": 1 for i in range(6)}
    assert "layers.* ×" in describe(report.rule_modules["matmul_add"])


def test_backward_nodes_carry_their_forward_nodes_modules(gpt_tiny):
    _, forward, train, _ = gpt_tiny
    grads = [n for n in train.nodes if n.op in ("attention_grad_q", "attention_grad_kv")
             or (n.op == "part" and train[n.inputs[0]].op == "attention_grad_kv")]   # dk and dv
    assert len(grads) == 24 and {n.modules for n in grads} == {(f"layers.{i}.attn",) for i in range(6)}
    backward = train.nodes[len(forward.nodes):]
    scoped = [n for n in backward if n.modules]
    assert len(scoped) > 0.95 * len(backward)       # all but the loss's own gradient and a few shared constants
    fused, _ = optimize(train)
    for op in ("attention_grad_q", "attention_grad_kv"):
        assert {n.modules for n in fused.nodes if n.op == op} == {(f"layers.{i}.attn",) for i in range(6)}


def test_kernel_names_carry_the_common_module_prefix(gpt_tiny):
    _, forward, train, pairs = gpt_tiny
    plan = compile_plan(forward)
    by_op = {}
    for d in plan.dispatches:
        by_op.setdefault(forward[d.nodes[0]].op, []).append(d)
    assert [d.name for d in by_op["attention"]] == [f"layers.{i}.attn:attention:causal=True" for i in range(6)]
    for d in plan.dispatches:
        assert d.module == common_module(m for i in d.nodes for m in forward[i].modules)
        assert d.name == (f"{d.module}:{d.kernel}" if d.module else d.kernel)
    text = str(plan)
    assert "layers.0.attn:attention:causal=True" in text


def test_plan_cache_keys_on_module_names(tmp_path):
    def graph(scoped: bool) -> Graph:
        g = Graph("g")
        x = g.input("x", (4, 8))
        with g.scope("enc.fc" if scoped else ""):
            w = g.parameter("w", (8, 8))
            g.output("y", g.relu(g.matmul(x, w)))
        return g

    plain, named = graph(False), graph(True)
    assert plain.structural_hash() == named.structural_hash()
    first = cached_plan(plain, loss=None, cache_dir=tmp_path)
    second = cached_plan(named, loss=None, cache_dir=tmp_path)
    assert {d.module for d in first.dispatches} == {""}
    assert {d.module for d in second.dispatches} == {"enc.fc"} and len(list(tmp_path.iterdir())) == 2
    again = cached_plan(named, loss=None, cache_dir=tmp_path)
    assert [d.name for d in again.dispatches] == [d.name for d in second.dispatches]


# ---------------------------------------------------------------- blocks and per-module totals

def test_blocks_are_the_layers_and_what_sits_beside_them():
    paths = ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp", "model.norm",
             "lm_head", "", "enc.layers.3.experts.5.fc"]
    opened = containers(paths)
    assert opened == {"", "model", "model.layers", "enc", "enc.layers"}
    assert [block_of(p, opened) for p in paths] == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head", "", "enc.layers.3"]


def test_profile_groups_by_module_and_the_groups_sum_to_the_total(llama_folder, capsys):
    code = main(["profile", str(llama_folder), "--set", "seq=8", "--steps", "2", "--train", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {r["name"]: r for r in out["modules"]}
    assert list(rows)[:3] == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert {TOP_LEVEL, OPTIMIZER_STEP} <= set(rows)     # the final norm fuses into the tied head: top level
    total = sum(d["gpu_ns"] for d in out["dispatches"])
    assert sum(r["gpu_ns"] for r in rows.values()) == total > 0
    assert sum(r["calls"] for r in rows.values()) == len(out["dispatches"])
    per_step = {}
    for d in out["dispatches"]:
        per_step[d["step"]] = per_step.get(d["step"], 0) + d["gpu_ns"]
    assert sum(r["gpu_ns_per_step"] for r in rows.values()) == pytest.approx(sum(per_step.values()) / 2)
    layer1 = sum(d["gpu_ns"] for d in out["dispatches"] if d["module"].startswith("model.layers.1"))
    assert rows["model.layers.1"]["gpu_ns"] == layer1
    assert any(d["kernel"] == "model.layers.0.self_attn:attention_stats:causal=True" for d in out["dispatches"])
    assert all(d["kernel"].startswith(d["module"] + ":") for d in out["dispatches"]
               if d["module"] not in ("", OPTIMIZER_STEP))

    code = main(["profile", str(llama_folder), "--set", "seq=8", "--steps", "1", "--group-by", "module"])
    text = capsys.readouterr().out
    assert code == 0 and "Module" in text and "model.layers.1" in text and "Self GPU time total" in text
