"""ExecutionPlan: buffer reuse must never hand out memory that still holds a live value."""

import json
import warnings

import numpy as np
import pytest

from engine import Graph
from engine.graph import reference
from engine.compile import plan as compile_mod
from engine.compile.plan import ExecutionPlan, compile_plan
from engine.compile.cache import cached_plan
from engine.graph.ops import OPS


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


def _projections():
    """x -> a few layers whose buffers are free again -> three projections of the last:
    the second and third projection read nothing their predecessor wrote."""
    g = Graph("projections")
    h = g.input("x", [64, 32])
    for _ in range(3):
        h = g.add(g.tanh(h), g.sigmoid(h))
    outs = [g.matmul(h, g.parameter(f"w{i}", [32, 32])) for i in range(3)]
    total = g.add(g.add(g.tanh(outs[0]), g.tanh(outs[1])), g.tanh(outs[2]))
    g.output("y", g.tanh(total))
    g.output("loss", g.mean(total))
    return g


def test_inference_plans_give_independent_dispatches_buffers_untouched_in_the_step():
    """A dispatch independent of its predecessor writes a buffer no earlier dispatch of
    the step used (no barrier: the GPU may overlap them); a training plan pools them."""
    g = _projections()
    plan = compile_plan(g, loss=None)
    matmuls = [d for d in plan.dispatches if d.kernel.startswith("matmul")]
    assert len(matmuls) == 3
    for d in matmuls[1:]:
        earlier = {b.buffer for e in plan.dispatches[:d.index] for b in e.bindings}
        assert d.writes[0] not in earlier, (d.index, d.writes)
    inputs, params = random_feeds(g)
    expected = reference.run(g, inputs, params, dtype=np.float64)
    got = run_plan_in_numpy(g, plan, inputs, params)
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-12, atol=1e-12)
    train, pairs = differentiate(g)
    pooled = compile_plan(train, dict(pairs))
    intermediates = [b for b in pooled.buffers if b.kind == "intermediate"]
    assert len(intermediates) < sum(1 for d in pooled.dispatches if d.writes and d.writes[0] in
                                    {b.id for b in intermediates})


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


# ---------------------------------------------------------------- the whole step as data

from engine import codegen, differentiate  # noqa: E402
from engine.compile.plan import ALIGN, OptimizerSpec  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402


def mlp_training_graph():
    """A two-layer MLP; weights decay, biases do not (the default for rank-1 parameters)."""
    g = Graph("mlp")
    x = g.input("x", [8, 20])
    labels = g.input("labels", [8], "i32")
    w1, b1 = g.parameter("fc1.weight", [20, 32]), g.parameter("fc1.bias", [32])
    w2, b2 = g.parameter("fc2.weight", [32, 5]), g.parameter("fc2.bias", [5])
    logits = g.output("logits", g.linear(g.relu(g.linear(x, w1, b1)), w2, b2))
    g.output("loss", g.cross_entropy_loss(logits, labels))
    return g


def training_plan(g, config, capabilities=codegen.PLAIN, train_graph=None, pairs=None):
    if train_graph is None:
        train_graph, pairs = differentiate(g)
    spec = OptimizerSpec.from_config(config, g, [p for p, _ in pairs])
    return train_graph, pairs, compile_plan(train_graph, dict(pairs), "loss", capabilities, spec)


def check_bindings(plan):
    """Every binding is a 256-aligned range inside its buffer, and no dispatch binds a
    buffer both read-only and read-write (wgpu rejects that)."""
    for d in plan.dispatches:
        assert not set(d.reads) & set(d.writes), plan.describe_dispatch(d)
        assert len(d.bindings) == len(plan.kernels[d.key].bindings)
        for b in d.bindings:
            assert b.offset % ALIGN == 0 and b.offset + b.size <= plan.buffers[b.buffer].nbytes
            assert b.access in ("read", "read_write")


def test_training_plan_round_trips_with_kernels_groups_and_capabilities():
    caps = codegen.Capabilities(subgroups=True)
    _, _, plan = training_plan(mlp_training_graph(), TrainConfig(optimizer="adamw", weight_decay=0.1), caps)
    again = ExecutionPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    assert plan.capabilities["subgroups"] is True and plan.capabilities["paths"] == codegen.describe_paths(caps)
    assert plan.optimizer["kind"] == "adamw" and plan.transfers and plan.groups
    for d in plan.dispatches:
        kernel = plan.kernels[d.key]
        assert d.key == compile_mod.kernel_key(kernel.source) and len(d.workgroups) == 3 and d.meta
        assert 4 * len(d.meta) <= kernel.meta_bytes
    reductions = [d for d in plan.dispatches if d.kernel == "cross_entropy"]
    assert reductions and reductions[0].variant == "subgroup reduction"
    assert len(plan.kernels) < len(plan.dispatches)  # each distinct source once
    text = str(plan)
    assert "train:adamw" in text and "(subgroup reduction)" in text and " wg 1x1x1 " in text
    assert "reductions subgroup" in text


def test_one_update_per_parameter_group_in_aligned_arenas():
    g = mlp_training_graph()
    train_graph, pairs, plan = training_plan(g, TrainConfig(optimizer="sgd", momentum=0.9, weight_decay=0.1))
    assert [grp.parameters for grp in plan.groups] == [["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]]
    assert [grp.weight_decay for grp in plan.groups] == pytest.approx([0.1, 0.0])
    updates = [d for d in plan.dispatches if d.kernel == "train:sgd"]
    norms = [d for d in plan.dispatches if d.kernel == "train:sum_squares"]
    assert [d.names for d in updates] == [d.names for d in norms] == [grp.parameters for grp in plan.groups]
    (total,) = [d for d in plan.dispatches if d.kernel == "train:norm_total"]
    assert norms[-1].index < total.index < updates[0].index
    assert plan.transfers[0].after == total.index and plan.transfers[0].dst == plan.stats_buffer
    for gi, grp in enumerate(plan.groups):
        arenas = [grp.parameter_buffer, grp.gradient_buffer, *grp.state_buffers]
        assert len(grp.state_buffers) == 1  # momentum
        assert {plan.buffers[b].nbytes for b in arenas} == {4 * grp.elements}
        assert all(off % ALIGN == 0 for off in grp.offsets) and grp.offsets == sorted(set(grp.offsets))
        for name, off in zip(grp.parameters, grp.offsets):
            assert plan.place(train_graph.parameters[name]) == (grp.parameter_buffer, off)
            assert plan.gradients[name] == grp.gradient_buffer
            # every gradient here is computed in its slot: no copy
            assert plan.place(train_graph.outputs["grad:" + name]) == (grp.gradient_buffer, off)
        (update,) = [d for d in updates if d.group == gi]
        assert update.reads[0] == grp.gradient_buffer and update.writes[:2] == arenas[:1] + grp.state_buffers
    assert not [d for d in plan.dispatches if d.kernel == "copy:gradient"]
    check_bindings(plan)


def test_norm_parameter_gradients_are_computed_in_their_slots():
    """A layer norm's weight and bias gradients are the two rows of one norm_param_grad
    (parts of it, placed side by side in the arena), an RMS norm's its one row (a part
    that is the whole result, computed in the slot); where the rows are a multiple of
    PART_ALIGN wide, no gradient is copied."""
    g = Graph("norms")
    x = g.input("x", [4, 5, 64])
    ln = g.layer_norm(x, g.parameter("ln.weight", [64]), g.parameter("ln.bias", [64]))
    y = g.rms_norm(g.tanh(ln), g.parameter("rms.weight", [64]))
    g.output("loss", g.mean(g.mul(y, y)))
    train_graph, pairs, plan = training_plan(g, TrainConfig(optimizer="sgd"))
    assert sum(n.op == "norm_param_grad" for n in train_graph.nodes) == 2
    assert not [d for d in plan.dispatches if d.kernel == "copy:gradient"]
    (grp,) = plan.groups
    for name, off in zip(grp.parameters, grp.offsets):
        assert plan.place(train_graph.outputs["grad:" + name]) == (grp.gradient_buffer, off)
    check_bindings(plan)


def test_every_gradient_gets_its_own_slot_whatever_its_node_is():
    """Gradient outputs that are an input, a parameter, a constant, another output's
    node, a view, or one node for two parameters: copies fill the slots they cannot
    be computed in."""
    g = awkward_training_graph()
    pairs = [(p, "grad:" + p) for p in ("pa", "pb", "pc", "pd", "pe", "pf")]
    _, _, plan = training_plan(g, TrainConfig(optimizer="sgd"), train_graph=g, pairs=pairs)
    (grp,) = plan.groups
    assert grp.parameters == [p for p, _ in pairs] and len(set(grp.offsets)) == 6
    copies = {d.names[0]: d for d in plan.dispatches if d.kernel == "copy:gradient"}
    assert set(copies) == {"grad:pa", "grad:pb", "grad:pc", "grad:pd", "grad:pf"}
    for name, off in zip(grp.parameters, grp.offsets):
        if "grad:" + name in copies:
            assert copies["grad:" + name].bindings[1].offset == off
        else:  # the view's storage root is computed right in its slot
            assert plan.place(g.outputs["grad:" + name]) == (grp.gradient_buffer, off)
    check_bindings(plan)


def awkward_training_graph():
    """A graph whose 'gradient' outputs are whatever a plan finds hardest to place."""
    g = Graph("awkward")
    x = g.input("x", [2, 3])
    c = g.constant(np.arange(6, dtype=np.float32).reshape(2, 3) / 10)
    pa, pb, pc, pd = (g.parameter(n, [2, 3]) for n in ("pa", "pb", "pc", "pd"))
    pe, pf = g.parameter("pe", [6]), g.parameter("pf", [2, 3])
    other = g.output("other", g.tanh(g.mul(x, pd)))
    m = g.mul(g.add(x, g.reshape(pe, [2, 3])), pf)
    g.output("loss", g.mean(g.add(g.mul(m, pa), g.add(pb, pc))))
    g.output("grad:pa", x)                                 # an input
    g.output("grad:pb", pa)                                # a parameter
    g.output("grad:pc", c)                                 # a constant
    g.output("grad:pd", other)                             # another output's node
    g.output("grad:pe", g.reshape(g.sub(m, x), [6]))       # a view
    g.output("grad:pf", other)                             # the node of another gradient
    return g


def test_plan_for_subgroups_is_not_served_for_plain(tmp_path):
    g = mlp_training_graph()
    plain = cached_plan(g, cache_dir=tmp_path)
    subgroups = cached_plan(g, cache_dir=tmp_path, capabilities=codegen.Capabilities(subgroups=True))
    assert len(list(tmp_path.iterdir())) == 2
    assert plain.capabilities["subgroups"] is False and subgroups.capabilities["subgroups"] is True
    sources = lambda p: "".join(k.source for k in p.kernels.values())  # noqa: E731
    assert "subgroupAdd" in sources(subgroups) and "subgroupAdd" not in sources(plain)
    assert cached_plan(g, cache_dir=tmp_path) == plain


def test_compile_plan_needs_no_gpu():
    """The same training plan, compiled in a process where wgpu cannot be imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys; sys.modules['wgpu'] = None\n"
            "import test_compile as t\n"
            "from engine.train import TrainConfig\n"
            "print(t.training_plan(t.mlp_training_graph(), TrainConfig(optimizer='adam'))[2].to_json())\n")
    tests = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", code], cwd=tests.parent, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests),
                                                                           os.environ.get("PYTHONPATH", "")])},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    here = training_plan(mlp_training_graph(), TrainConfig(optimizer="adam"))[2]
    assert ExecutionPlan.from_dict(json.loads(out.stdout)) == here
