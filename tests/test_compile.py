"""ExecutionPlan: buffer reuse must never hand out memory that still holds a live value."""

import json
import warnings

import numpy as np
import pytest

from engine import Graph, reference
from engine.compile import ExecutionPlan, cached_plan, compile_plan
from engine.ops import OPS


def run_plan_in_numpy(graph, plan, inputs, params):
    """Execute the plan's dispatches with one numpy array per *buffer*: if reuse let
    two live values share a buffer, the later write clobbers the earlier and the
    outputs come out wrong."""
    store = {}
    for name, b in plan.inputs.items():
        store[b] = np.asarray(inputs[name], dtype=np.float64)
    for name, b in plan.parameters.items():
        store[b] = np.asarray(params[name], dtype=np.float64)
    for i, c in graph.constants.items():
        store[plan.node_buffer[i]] = c.astype(np.float64)

    def value(node_id):
        node = graph[node_id]
        if OPS[node.op].archetype == "view":
            return value(node.inputs[0]).reshape(node.shape)
        return store[plan.node_buffer[node_id]]

    for d in plan.dispatches:
        (nid,) = d.nodes
        node = graph[nid]
        args = [value(i) for i in node.inputs]
        store[d.writes[0]] = OPS[node.op].ref(*args, **node.attrs)
    return {k: value(v) for k, v in graph.outputs.items()}


def branchy_graph():
    """Residual MLP with side branches: lifetimes overlap in non-trivial ways."""
    g = Graph("branchy")
    x = g.input("x", [16, 24])
    h = x
    for i in range(5):
        w = g.parameter(f"w{i}", [24, 24])
        b = g.parameter(f"b{i}", [24])
        y = g.gelu(g.bias_add(g.matmul(h, w), b))
        side = g.tanh(g.scale(h, 0.5))
        h = g.add(g.add(y, side), h)
    g.output("y", g.reshape(h, [24, 16]))
    g.output("loss", g.mean(g.mul(h, h)))
    return g


def random_feeds(g, seed=0):
    rng = np.random.default_rng(seed)
    inputs = {k: rng.standard_normal(g[v].shape) for k, v in g.inputs.items()}
    params = {k: rng.standard_normal(g[v].shape) * 0.2 for k, v in g.parameters.items()}
    return inputs, params


def test_plan_executes_to_reference_outputs_with_reuse():
    g = branchy_graph()
    plan = compile_plan(g)
    inputs, params = random_feeds(g)
    expected = reference.run(g, inputs, params, dtype=np.float64)
    got = run_plan_in_numpy(g, plan, inputs, params)
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-12, atol=1e-12)
    assert plan.peak_bytes < plan.peak_bytes_without_reuse
    intermediates = [b for b in plan.buffers if b.kind == "intermediate"]
    assert len(intermediates) < sum(1 for d in plan.dispatches if d.writes[0] in {b.id for b in intermediates})


def test_plan_reuses_memory_on_a_long_chain():
    g = Graph("chain")
    h = g.input("x", [128, 128])
    for _ in range(50):
        h = g.tanh(h)
    g.output("y", h)
    plan = compile_plan(g, loss=None)
    assert len(plan.dispatches) == 50
    # input, output and two ping-pong intermediates
    assert len(plan.buffers) == 4
    assert plan.peak_bytes * 10 < plan.peak_bytes_without_reuse


def test_pinned_buffers_are_never_reused():
    g = branchy_graph()
    plan = compile_plan(g)
    pinned = set(plan.inputs.values()) | set(plan.parameters.values()) | set(plan.outputs.values())
    for d in plan.dispatches:
        for w in d.writes:
            if w in pinned:
                assert w in set(plan.outputs.values())
    assert plan.loss_buffer == plan.outputs["loss"]


def test_plan_json_round_trip():
    plan = compile_plan(branchy_graph())
    again = ExecutionPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    assert "dispatches" in str(plan)


def test_plan_cache_hits_and_survives_corruption(tmp_path):
    g = branchy_graph()
    first = cached_plan(g, cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    assert cached_plan(g, cache_dir=tmp_path) == first
    files[0].write_text("{ not json")
    with pytest.warns(UserWarning, match="unreadable"):
        rebuilt = cached_plan(g, cache_dir=tmp_path)
    assert rebuilt == first
    assert json.loads(files[0].read_text())["graph_hash"] == g.structural_hash()


def test_stale_cache_entry_is_rebuilt(tmp_path):
    g = branchy_graph()
    cached_plan(g, cache_dir=tmp_path)
    (path,) = tmp_path.iterdir()
    d = json.loads(path.read_text())
    d["graph_hash"] = "0" * 64
    path.write_text(json.dumps(d))
    with pytest.warns(UserWarning, match="stale"):
        plan = cached_plan(g, cache_dir=tmp_path)
    assert plan.graph_hash == g.structural_hash()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached_plan(g, cache_dir=tmp_path)
