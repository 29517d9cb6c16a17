"""Products of one input by weights of one shape run as one batched product
(engine.optimize.stacked_products): what it stacks and what it leaves, the same values as
the products it replaces (reference and lavapipe), and whisper's q, k and v."""

import numpy as np

from engine import Graph, models
from engine.compile.cache import cached_training_graph
from engine.graph import reference
from engine.optimize.schedule import _terminal
from engine.optimize.stacked_products import stack_products
from engine.runtime.session import Session


def projections() -> Graph:
    """x [2, 40, 8] by q, k, v weights [8, 8] (q and v with biases), a wider weight and a
    product whose right side is not a weight: only q, k and v stack."""
    g = Graph("projections")
    x = g.input("x", (2, 40, 8))
    other = g.input("other", (8, 8))
    for name, bias in (("q", True), ("k", False), ("v", True)):
        w = g.parameter(f"{name}.w", (8, 8))
        g.output(name, g.apply("fused_matmul", x, w, g.parameter(f"{name}.b", (8,)), has_add=True) if bias
                 else g.matmul(x, w))
    g.output("wide", g.matmul(x, g.parameter("wide.w", (8, 16))))
    g.output("not a weight", g.matmul(x, other))
    return g


def feeds(g: Graph, rng):
    inputs = {k: rng.standard_normal(g[i].shape).astype(np.float32) for k, i in g.inputs.items()}
    params = {k: rng.standard_normal(g[i].shape).astype(np.float32) for k, i in g.parameters.items()}
    return inputs, params


def test_q_k_v_stack_into_one_product_with_the_same_values():
    g = projections()
    out, count, _ = stack_products(g)
    assert count == 3
    products = [n for n in out.nodes if n.op in ("matmul", "fused_matmul")]
    stacked = [n for n in products if n.shape == (3, 80, 8)]
    assert len(stacked) == 1 and stacked[0].op == "fused_matmul" and len(products) == 3
    assert sum(n.op == "part" for n in out.nodes) == 3 and set(out.outputs) == set(g.outputs)
    inputs, params = feeds(g, np.random.default_rng(0))
    want = reference.run(g, inputs, params, np.float64)
    np.testing.assert_equal(reference.run(out, inputs, params, np.float64), want)
    session = Session(out)
    session.set_inputs(inputs)
    session.set_parameters(params)
    session.run()
    for name, value in want.items():
        np.testing.assert_allclose(session.read_output(name), value, rtol=1e-5, atol=1e-5, err_msg=name)
    assert stack_products(out)[:2] == (out, 0)


def test_few_rows_are_left_to_the_vector_kernels():
    g = Graph("one token")
    x = g.input("x", (1, 1, 8))
    for name in "qkv":
        g.output(name, g.matmul(x, g.parameter(name, (8, 8))))
    assert stack_products(g)[:2] == (g, 0)


def test_whisper_training_stacks_each_layers_projections_and_keeps_its_values():
    """The training pipeline's graph against the same without this pass: the loss and every
    gradient equal in float64. The backward's input gradient of q, k and v (three products
    summed) becomes one product over the three gradients side by side."""
    from engine.autodiff.gradients import differentiate
    from engine.optimize import optimize
    from engine.optimize.attention_stats import share_attention_statistics
    from engine.optimize.preactivation import reuse_preactivations
    model = models.create("whisper-tiny", ["mel_len=64", "batch=2"])
    train, *_ = cached_training_graph(model.build(train=True), "loss")
    stacks = [n for n in train.nodes if n.op in ("matmul", "fused_matmul") and len(n.shape) == 3 and n.shape[0] == 3]
    assert len(stacks) == 4 and all(n.shape[-1] == 384 for n in stacks)   # q, k and v of 4 layers
    plain, _ = differentiate(optimize(model.build(train=True))[0], "loss")
    plain = reuse_preactivations(share_attention_statistics(optimize(plain)[0])[0])[0]
    # and the backward's sums of their input gradients, their 12 weight gradients and q's
    # and v's bias gradients (one sum of the three gradients side by side; k has no bias)
    assert stack_products(plain)[1] == 44
    sums = [n for n in train.nodes if n.op == "matmul" and train[n.inputs[0]].op == "concat"]
    assert len(sums) == 4 and all(train[n.inputs[0]].shape[-1] == 3 * 384 and n.shape[-1] == 384 for n in sums)
    weights = [n for n in train.nodes if n.op == "matmul" and n.shape == (3 * 384, 384)]
    assert len(weights) == 4 and all(n.attrs["transpose_a"] and train[train[n.inputs[0]].inputs[0]].op == "concat"
                                     for n in weights)
    terminal = _terminal(train)
    for dx, dw in zip(sums, weights):   # right after the input gradient: the concat dies as early as before
        between = range(dx.id + 1, dw.id)   # other outputs' nodes (the norm's parameter gradients) and views
        assert all(i in terminal or train[i].op in ("reshape", "part") for i in between), [train[i] for i in between]
        assert train[train[dw.inputs[0]].inputs[0]].id == dx.inputs[0]
    assert sum(n.op == "transpose" and n.shape == (3, 384, 384) for n in train.nodes) == 4   # weights [in, out]
    bias_sums = [n for n in train.nodes if n.op == "sum_to" and n.shape == (3 * 384,)]
    assert len(bias_sums) == 4 and all(train[n.inputs[0]].op == "concat" for n in bias_sums)
    assert sorted(n.attrs["offset"] for n in train.nodes if n.op == "part" and n.inputs[0] in
                  {b.id for b in bias_sums}) == [0, 0, 0, 0, 768, 768, 768, 768]   # q's and v's
    params = {k: v.astype(np.float64) for k, v in model.init_params(0).items()}
    inputs = model.example_inputs(train=True)
    want, got = reference.run(plain, inputs, params, np.float64), reference.run(train, inputs, params, np.float64)
    assert set(got) == set(want) and any(k.startswith("grad:") for k in got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_pooled_buffers_hold_one_live_value_at_a_time():
    """A node reading two parts of one stacked result at their last use gives the storage
    back once: freed twice, it went to two later tensors alive at the same time (a
    gelu_grad bound its input's buffer read-only and read-write, which WebGPU refuses)."""
    from engine.compile.plan import compile_plan, storage_roots
    for name, settings in (("whisper-tiny", ["mel_len=64", "batch=2"]), ("audio-align", [])):
        model = models.create(name, settings)
        train, pairs, *_ = cached_training_graph(model.build(train=True), "loss")
        plan = compile_plan(train, dict(pairs), "loss")
        pooled = {b.id for b in plan.buffers if b.kind == "intermediate"}
        root = storage_roots(train)
        spans: dict[int, list[int]] = {}   # storage root -> [first, last] dispatch
        for d in plan.dispatches:
            assert not set(d.reads) & set(d.writes), (name, d.name)
            for nid in d.nodes:
                for r in [root[nid]] + [root[i] for i in train[nid].inputs]:
                    if r in plan.node_buffer and plan.node_buffer[r] in pooled:
                        span = spans.setdefault(r, [d.index, d.index])
                        span[1] = d.index
        by_buffer: dict[int, list[tuple[int, int, int]]] = {}
        for r, (first, last) in spans.items():
            buffer, offset = plan.place(r)
            by_buffer.setdefault(buffer, []).append((first, last, r))
        for buffer, held in by_buffer.items():
            held.sort()
            for (_, last, a), (first, _, b) in zip(held, held[1:]):
                assert last <= first, f"{name}: buffer {buffer} holds {a} and {b} at once"


def test_the_input_gradient_sum_of_transposed_weights_is_one_product():
    """Weights stored [out, in] (transformers' layout, transpose_b): the backward's
    x-gradient, dq @ wq + dk @ wk + dv @ wv, is one product over [dq | dk | dv] and the
    weights stacked along K, and the weights' gradients one product [dq | dk | dv]ᵀ x whose
    row blocks they are (no transpose); the loss and gradients as without the pass, also
    on lavapipe."""
    from engine.autodiff.gradients import differentiate
    from engine.optimize import optimize
    g = Graph("qkv")
    x = g.parameter("x", (2, 40, 8))
    q, k, v = (g.matmul(x, g.parameter(f"{p}.w", (8, 8)), transpose_b=True) for p in "qkv")
    g.output("loss", g.sum(g.mul(g.mul(q, g.tanh(k)), v)))
    train, pairs = differentiate(optimize(g)[0], "loss")
    train = optimize(train)[0]
    out, count, _ = stack_products(train)
    assert count == 9
    (total,) = [n for n in out.nodes if n.op == "matmul" and out[n.inputs[0]].shape == (2, 40, 24)]
    assert out[total.inputs[1]].shape == (24, 8) and not total.attrs["transpose_b"]
    (weights,) = [n for n in out.nodes if n.op == "matmul" and n.shape == (24, 8)]
    assert weights.attrs["transpose_a"] and not any(n.op == "transpose" for n in out.nodes)
    _, params = feeds(train, np.random.default_rng(3))
    want = reference.run(train, {}, params, np.float64)
    got = reference.run(out, {}, params, np.float64)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=name)
    session = Session(out)
    session.set_parameters(params)
    session.run()
    for name in ("grad:x", "grad:q.w", "grad:k.w", "grad:v.w"):
        np.testing.assert_allclose(session.read_output(name), want[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_cli_optimize_reports_the_graph_passes(capsys):
    import json
    from engine.cli import main
    assert main(["optimize", "whisper-tiny", "--set", "mel_len=64", "--set", "batch=8", "--train", "--json"]) == 0
    passes = json.loads(capsys.readouterr().out)["passes"]
    assert passes["applied"] == {"attention_stats": 4, "preactivation": 4, "norm_residual": 8,
                                 "stacked_products": 44, "activation_grad": 4, "outputs_early": 97}
    assert passes["dispatches_after"] > 0
    assert main(["optimize", "whisper-tiny", "--set", "mel_len=64", "--set", "batch=8"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("stacked_products (pass)"))
    assert row.split()[2] == "12"


def test_merged_gradients_are_computed_where_the_optimizer_reads_them(configure):
    """q, k and v with biases: their weight gradients one product, their bias gradients
    one sum, each placed over the three parameters' gradient slots (side by side in the
    arena), so the step copies none of them, and the forward reads the three weights
    stacked where they lie in theirs; an SGD step on lavapipe moves every
    parameter by -lr times its float64 gradient (in f32: the placement is under test)."""
    from engine.train.config import TrainConfig
    from engine.train.session import TrainingSession
    configure(precision="f32")
    g = Graph("qkv-biases")
    x = g.parameter("x", (2, 40, 64))
    q, k, v = (g.apply("fused_matmul", x, g.parameter(f"{p}.w", (64, 64)), g.parameter(f"{p}.b", (64,)),
                       has_add=True) for p in "qkv")
    g.output("loss", g.mean(g.mul(g.mul(q, g.tanh(k)), v)))
    session = TrainingSession(g, TrainConfig(optimizer="sgd", lr=0.5))
    train = session.graph
    assert sum(n.op == "sum_to" and n.shape == (3 * 64,) for n in train.nodes) == 1
    assert sum(n.op == "matmul" and n.shape == (3 * 64, 64) for n in train.nodes) == 1
    copied = {name for d in session.plan.dispatches if d.kernel == "copy:gradient" for name in d.names}
    assert not copied & {f"grad:{p}.{w}" for p in "qkv" for w in "wb"}, copied
    # the forward's stack of the weights is read where they lie, side by side in their arena too
    stack = next(n for n in train.nodes if n.op == "concat" and n.shape == (3, 64, 64))
    assert not any(stack.id in d.nodes for d in session.plan.dispatches)
    assert session.plan.place(stack.id) == min(session.plan.place(train.parameters[f"{p}.w"]) for p in "qkv")
    _, params = feeds(g, np.random.default_rng(5))
    session.set_parameters(params)
    session.step()
    want = reference.run(train, {}, {k: v.astype(np.float64) for k, v in params.items()}, np.float64)
    got = session.get_parameters()
    for name, value in params.items():
        np.testing.assert_allclose(got[name], value - 0.5 * want[f"grad:{name}"], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def aligned_projections() -> Graph:
    """q, k and v of one input, weights [64, 64] and q's and v's biases [64]: whole
    256-byte slots, so that an inference plan packs the stacks' parameters (and k's zero
    bias, a constant) side by side."""
    g = Graph("aligned projections")
    x = g.input("x", (2, 40, 64))
    for name, bias in (("q", True), ("k", False), ("v", True)):
        w = g.parameter(f"{name}.w", (64, 64))
        y = g.apply("fused_matmul", x, w, g.parameter(f"{name}.b", (64,)), has_add=True) if bias else g.matmul(x, w)
        g.output(name, g.apply("relu", y))
    return g


def test_an_inference_plan_reads_its_stacked_parameters_where_they_lie():
    """The stacks of weights and biases are views of parameters (and a zero constant)
    packed side by side, not concats copied each call: four dispatches fewer here, the
    same values on lavapipe before and after a parameter changes, and each parameter
    reads back as set. Unpacked (a session sharing another's parameters) they copy."""
    from engine.compile.plan import compile_plan
    stacked, count, _ = stack_products(aligned_projections())
    assert count == 3
    plans = {pack: compile_plan(stacked, loss=None, pack_parameters=pack) for pack in (False, True)}
    copies = {pack: [d.kernel for d in plan.dispatches if d.archetype == "copy"] for pack, plan in plans.items()}
    assert len(copies[False]) == 2 and copies[True] == []
    assert len(plans[True].dispatches) == len(plans[False].dispatches) - 2
    packs = [b for b in plans[True].buffers if b.kind == "parameter" and len(b.names) == 3]
    assert sorted(len(b.names) for b in packs) == [3, 3] and any(n.startswith("const%") for b in packs for n in b.names)
    rng = np.random.default_rng(1)
    inputs, params = feeds(stacked, rng)
    for pack, plan in plans.items():
        session = Session(stacked, plan)
        session.set_inputs(inputs)
        session.set_parameters(params)
        for turn in range(2):
            session.run()
            want = reference.run(stacked, inputs, params, np.float64)
            for name, value in want.items():
                np.testing.assert_allclose(session.read_output(name), value, rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name}, packed {pack}, turn {turn}")
            for name, value in params.items():
                np.testing.assert_array_equal(session.get_parameter(name), value)
            params = {**params, "k.w": -params["k.w"], "v.b": params["v.b"] + 1}
            session.set_parameters(params)


def test_a_packed_plan_refuses_parameters_shared_with_another_session(f32_kernels):
    """Another session's parameters cannot stand for a pack that holds a constant: its
    upload would land in the other's buffer. The session says so and how to compile."""
    import pytest
    from engine.compile.plan import compile_plan
    from engine.errors import ShapeError
    stacked, _, _ = stack_products(aligned_projections())
    owner = Session(stacked, compile_plan(stacked, loss=None, pack_parameters=True))
    with pytest.raises(ShapeError, match="pack_parameters=False"):
        Session(stacked, compile_plan(stacked, loss=None, pack_parameters=True),
                parameter_buffers=owner.parameter_buffers())
    shared = Session(stacked, parameter_buffers=owner.parameter_buffers())   # compiled unpacked
    inputs, params = feeds(stacked, np.random.default_rng(2))
    owner.set_parameters(params)
    shared.set_inputs(inputs)
    shared.run()
    want = reference.run(stacked, inputs, params, np.float64)
    np.testing.assert_allclose(shared.read_output("v"), want["v"], rtol=1e-5, atol=1e-5)
