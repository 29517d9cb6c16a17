"""Training on the GPU (lavapipe here) against the reference trainer."""

import numpy as np
import pytest

from engine import Graph, models
from engine.graph import reference
from engine.errors import TrainingError
from engine.runtime.session import Session, build_inference_session
from engine.train.data import DataLoader
from engine.train.config import TrainConfig
from engine.train.trainer import Trainer
from engine.train.session import build_session


pytestmark = pytest.mark.usefixtures("f32_kernels")   # the reference trainer at f32's tolerances


def small_mlp(batch=16, n_in=20, hidden=32, n_out=5):
    g = Graph("mlp")
    x = g.input("x", [batch, n_in])
    labels = g.input("labels", [batch], "i32")
    w1 = g.parameter("fc1.weight", [n_in, hidden])
    b1 = g.parameter("fc1.bias", [hidden], decay=False)
    w2 = g.parameter("fc2.weight", [hidden, n_out])
    b2 = g.parameter("fc2.bias", [n_out], decay=False)
    logits = g.output("logits", g.linear(g.relu(g.linear(x, w1, b1)), w2, b2))
    g.output("loss", g.cross_entropy_loss(logits, labels))
    return g


def init(g, seed=0):
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(g[v].shape) * 0.3).astype(np.float32) for k, v in g.parameters.items()}


def data(n=64, n_in=20, n_out=5, seed=1):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_out, n).astype(np.int32)
    x = (rng.standard_normal((n_out, n_in))[labels] + 0.5 * rng.standard_normal((n, n_in))).astype(np.float32)
    return {"x": x, "labels": labels}


@pytest.mark.parametrize("config", [
    TrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, steps=200, batch_size=16),
    TrainConfig(optimizer="adamw", lr=3e-3, weight_decay=0.1, schedule="cosine", warmup_steps=10,
                clip_norm=1.0, steps=200, batch_size=16),
], ids=["sgd-momentum", "adamw-cosine-clip"])
def test_gpu_training_follows_the_reference_loss_curve(config):
    g = small_mlp()
    params = init(g)
    loader = lambda: DataLoader(data(), 16, shuffle=True, seed=0, drop_last=True)  # noqa: E731
    ref = Trainer(g, params, config, backend="reference").fit(loader())
    gpu = Trainer(g, params, config, backend="gpu").fit(loader())
    assert len(gpu.losses) == len(ref.losses) == 200
    assert np.max(np.abs(np.array(gpu.losses) - np.array(ref.losses))) < 1e-3
    assert gpu.losses[-1] < 0.5 * gpu.losses[0]
    np.testing.assert_allclose(gpu.grad_norms, ref.grad_norms, rtol=1e-3)


def test_inference_session_sees_every_update_of_the_training_session():
    train_graph = small_mlp(batch=16)
    infer_graph = small_mlp(batch=3)
    session = build_session(train_graph, TrainConfig(optimizer="sgd", lr=0.1), init(train_graph))
    infer = build_inference_session(infer_graph, share_with=session)
    d = data(16)
    session.set_inputs(d)
    x3 = {"x": d["x"][:3], "labels": d["labels"][:3]}
    infer.set_inputs(x3)
    before = None
    for _ in range(3):
        session.step()
        infer.run()
        logits = infer.read_output("logits")
        params = session.get_parameters()
        expected = np.maximum(x3["x"] @ params["fc1.weight"] + params["fc1.bias"], 0) @ params["fc2.weight"] \
            + params["fc2.bias"]
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
        assert before is None or not np.allclose(logits, before)
        before = logits


def test_frozen_parameters_stay_bit_identical_on_the_gpu():
    g = small_mlp()
    params = init(g)
    config = TrainConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1, steps=5, batch_size=16,
                         lr_multipliers={"fc1.*": 0.0})
    trainer = Trainer(g, params, config, backend="gpu")
    trainer.fit(data())
    after = trainer.params
    assert np.array_equal(after["fc1.weight"], params["fc1.weight"])
    assert np.array_equal(after["fc1.bias"], params["fc1.bias"])
    assert not np.array_equal(after["fc2.weight"], params["fc2.weight"])
    assert all(not p.startswith("fc1") for p, _ in trainer.pairs)


def test_nan_loss_stops_at_its_step_and_keeps_the_weights():
    g = small_mlp()
    params = init(g)
    trainer = Trainer(g, params, TrainConfig(optimizer="sgd", lr=0.01, steps=10, batch_size=16), backend="gpu")
    batches = [{k: v[:16] for k, v in data().items()} for _ in range(4)]
    bad = {k: v.copy() for k, v in batches[0].items()}
    bad["x"][0, 0] = np.nan
    batches[2] = bad
    trainer.step(batches[0])
    trainer.step(batches[1])
    kept = trainer.params
    with pytest.raises(TrainingError, match="at step 3"):
        trainer.step(batches[2])
    after = trainer.params
    for k in kept:
        assert np.array_equal(after[k], kept[k]), k


SMALL = {"mlp": ["batch=4"], "whisper-tiny": ["mel_len=16", "batch=1"], "gpt-tiny": ["seq=8", "batch=1", "depth=2"],
         "audio-align": ["mel_len=16", "seq=6", "batch=2", "depth=2"]}


def small_model(name, seed, noise):
    """A built-in model at test size and its initial weights plus a little noise (so
    zero-initialised layers, like audio-align's projector.fc2, carry gradients)."""
    model = models.create(name, SMALL[name])
    rng = np.random.default_rng(seed)
    params = {k: v + (noise * rng.standard_normal(v.shape)).astype(np.float32)
              for k, v in model.init_params(0).items()}
    return model, params


@pytest.mark.parametrize("name", list(SMALL))
def test_one_training_step_of_each_builtin_model_matches_the_reference(name):
    model, params = small_model(name, seed=0, noise=0.01)
    g = model.build(train=True)
    batch = model.example_inputs(train=True)
    config = TrainConfig(optimizer="sgd", lr=0.1, steps=1)
    ref = Trainer(g, params, config, backend="reference")
    gpu = Trainer(g, params, config, backend="gpu")
    ref_loss, gpu_loss = ref.step(batch), gpu.step(batch)
    assert abs(gpu_loss - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
    got, want = gpu.params, ref.params
    for k in want:
        scale = max(np.abs(want[k]).max(), 1e-6)
        assert np.abs(got[k] - want[k]).max() / scale < 1e-4, k


@pytest.mark.parametrize("name", list(SMALL))
def test_fused_inference_of_each_builtin_model_matches_the_reference(name):
    model, params = small_model(name, seed=1, noise=0.02)
    g = model.build(train=False)
    inputs = model.example_inputs(train=False)
    session = build_inference_session(g)
    assert len(session.plan.dispatches) < sum(1 for n in g.nodes if n.op not in ("input", "parameter", "constant"))
    session.set_parameters(params)
    session.set_inputs(inputs)
    session.run()
    want = reference.run(g, inputs, params, np.float64)
    for k, v in want.items():
        got = session.read_output(k)
        assert np.abs(got - v).max() / max(np.abs(v).max(), 1e-6) < 1e-4, k


def test_sessions_reuse_the_plan_cached_on_disk(tmp_path, monkeypatch, configure):
    configure(cache_dir=str(tmp_path))
    g = small_mlp()
    first = build_session(g, TrainConfig(optimizer="sgd", lr=0.1), init(g))
    files = sorted((tmp_path / "plans").iterdir())
    assert len(files) == 1
    files[0].write_text("{ corrupt")
    with pytest.warns(UserWarning, match="unreadable"):
        second = build_session(g, TrainConfig(optimizer="sgd", lr=0.1), init(g))
    assert second.plan == first.plan
    third = build_session(g, TrainConfig(optimizer="sgd", lr=0.1), init(g))
    assert third.plan == first.plan


# ---------------------------------------------------------------- parameter groups and arenas

@pytest.mark.parametrize("config", [
    TrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=0.05, steps=4, batch_size=16),
    TrainConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1, clip_norm=0.5, steps=4, batch_size=16,
                lr_multipliers={"fc2.*": 0.5}),
], ids=["sgd-momentum-decay", "adamw-decay-multipliers"])
def test_parameter_groups_follow_the_reference_trainer(config):
    g = small_mlp()
    params = init(g)
    batches = [{k: v[16 * i:16 * (i + 1)] for k, v in data().items()} for i in range(4)]
    ref = Trainer(g, params, config, backend="reference")
    gpu = Trainer(g, params, config, backend="gpu")
    groups = gpu.session.plan.groups
    # weights decay and biases do not; the multiplier splits each of those again
    assert len(groups) == (2 if config.optimizer == "sgd" else 4)
    assert len([d for d in gpu.session.plan.dispatches if d.kernel == f"train:{config.optimizer}"]) == len(groups)
    for batch in batches:
        assert abs(gpu.step(batch) - ref.step(batch)) < 1e-4
    got, want = gpu.params, ref.params
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-5, err_msg=k)
    np.testing.assert_allclose(gpu.history.grad_norms, ref.history.grad_norms, rtol=1e-4)
    assert_arena_padding_is_zero(gpu.session)


def assert_arena_padding_is_zero(session):
    """The bytes between (and after) the slots of every arena are still zero."""
    plan, graph = session.plan, session.graph
    for grp in plan.groups:
        for b in [grp.parameter_buffer, grp.gradient_buffer, *grp.state_buffers]:
            raw = np.frombuffer(session.device.queue.read_buffer(session.buffers[b]), dtype=np.float32).copy()
            for name, off in zip(grp.parameters, grp.offsets):
                raw[off // 4: off // 4 + graph[graph.parameters[name]].size] = 0.0
            assert not raw.any(), plan.buffers[b].names


def shared_and_view_gradients():
    """p1 and p2 get the same gradient node, p3's gradient is a reshape, b's is the
    loss's seed constant."""
    g = Graph("edge")
    x = g.input("x", [4, 3])
    p1, p2 = g.parameter("p1", [4, 3]), g.parameter("p2", [4, 3])
    p3, b = g.parameter("p3", [12]), g.parameter("b", [])
    h = g.mul(g.add(g.add(x, p1), p2), g.reshape(p3, [4, 3]))
    g.output("loss", g.add(g.mean(g.mul(h, h)), b))
    return g


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_shared_and_view_gradients_train_like_the_reference(optimizer):
    g = shared_and_view_gradients()
    rng = np.random.default_rng(2)
    params = {k: (0.5 * rng.standard_normal(g[v].shape)).astype(np.float32) for k, v in g.parameters.items()}
    config = TrainConfig(optimizer=optimizer, lr=0.05, momentum=0.5, weight_decay=0.1, steps=3)
    ref = Trainer(g, params, config, backend="reference")
    gpu = Trainer(g, params, config, backend="gpu")
    plan, tg = gpu.session.plan, gpu.session.graph
    assert tg.outputs["grad:p1"] == tg.outputs["grad:p2"] and tg[tg.outputs["grad:p3"]].op == "reshape"
    copies = sorted(d.names[0] for d in plan.dispatches if d.kernel == "copy:gradient")
    assert copies == ["grad:b", "grad:p1", "grad:p2"]
    for step in range(3):
        batch = {"x": rng.standard_normal((4, 3)).astype(np.float32)}
        assert abs(gpu.step(batch) - ref.step(batch)) < 1e-5 * max(1.0, abs(ref.history.losses[-1]))
    got, want = gpu.params, ref.params
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert_arena_padding_is_zero(gpu.session)


def test_copied_gradients_reach_the_update_on_the_gpu():
    """A hand-made training graph whose 'gradients' are an input, a parameter, a
    constant, another output's node, a view and a shared node: one SGD step moves each
    parameter by lr times that output's value."""
    from test_compile import awkward_training_graph, training_plan
    g = awkward_training_graph()
    pairs = [(p, "grad:" + p) for p in ("pa", "pb", "pc", "pd", "pe", "pf")]
    _, _, plan = training_plan(g, TrainConfig(optimizer="sgd"), train_graph=g, pairs=pairs)
    session = Session(g, plan)
    rng = np.random.default_rng(3)
    inputs = {"x": rng.standard_normal((2, 3)).astype(np.float32)}
    params = {k: rng.standard_normal(g[v].shape).astype(np.float32) for k, v in g.parameters.items()}
    session.set_inputs(inputs)
    session.set_parameters(params)
    lr = 0.25
    session.device.queue.write_buffer(session.buffers[plan.step_buffer], 0, np.array([lr, 1, 1, 1], np.float32))
    session.run()
    want = reference.run(g, inputs, params, np.float32)
    for p, out in pairs:
        np.testing.assert_allclose(session.get_parameter(p), params[p] - lr * want[out].reshape(params[p].shape),
                                   rtol=1e-5, atol=1e-6, err_msg=p)
    assert session.read_loss() == pytest.approx(float(want["loss"]), rel=1e-5)


def test_a_plan_the_device_cannot_run_is_refused(monkeypatch):
    from engine import codegen
    from engine.runtime import session as runtime
    from engine.compile.plan import compile_plan
    from engine.errors import DeviceError
    g = small_mlp()
    plan = compile_plan(g, capabilities=codegen.Capabilities(subgroups=True))
    monkeypatch.setattr(runtime, "offered_capabilities", lambda device=None: codegen.PLAIN)  # a device without them
    with pytest.raises(DeviceError, match="compiled for subgroups, which this device lacks"):
        Session(g, plan)
    wide = compile_plan(g, capabilities=codegen.Capabilities(invocations=1024))
    with pytest.raises(DeviceError, match=r"compiled for invocations 1024 \(it has 256\), which this device lacks"):
        Session(g, wide)
    monkeypatch.undo()
    real = runtime._limit
    monkeypatch.setattr(runtime, "_limit", lambda limits, name: 512 if name == "min_storage_buffer_offset_alignment"
                        else real(limits, name))
    with pytest.raises(DeviceError, match="offsets aligned to 512 bytes; plans align them to 256"):
        Session(g, compile_plan(g))


def test_gradient_norm_past_the_range_of_its_square():
    """A norm of ~1e22 (audio-align's first step has 7.8e21) has a square past f32's
    3.4e38: summed as plain squares it became inf and every step was skipped. The scaled
    partials give the norm, clipping applies it, and the update matches the reference."""
    g = Graph("huge-gradient")
    x = g.input("x", [4, 300])
    w = g.parameter("w", [300])
    g.output("loss", g.mean(g.mul(g.sum(g.mul(x, w), axis=-1), g.constant(np.float32(1e20)))))
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal(300).astype(np.float32)}
    batch = {"x": rng.standard_normal((4, 300)).astype(np.float32)}
    config = TrainConfig(optimizer="sgd", lr=0.1, clip_norm=1.0, steps=1)
    gpu = Trainer(g, params, config, backend="gpu")
    ref = Trainer(g, params, config, backend="reference")
    gpu.step(batch)
    ref.step(batch)
    want = 1e20 * np.linalg.norm(batch["x"].astype(np.float64).mean(axis=0))
    assert want ** 2 > np.finfo(np.float32).max
    got = gpu.history.grad_norms[0]
    assert abs(got - want) / want < 1e-5, (got, want)
    assert np.allclose(gpu.params["w"], ref.params["w"], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(gpu.params["w"], params["w"])


def test_audio_align_trains_on_the_gpu_like_the_reference():
    """The default model's recipe on the GPU (its zero-initialised projector gives a
    first gradient norm of ~1e21, which takes all 6 decoder layers: each multiplies it by
    about 1e3): the same losses and norms as the reference, at the overflowing step and
    the one after."""
    model = models.create("audio-align", mel_len=16, seq=4, batch=2)
    config = TrainConfig(**model.TRAIN_DEFAULTS, steps=2, batch_size=2, seed=0)
    params = model.init_params(0)
    loader = DataLoader(model.dataset(0), 2, shuffle=True, seed=0, drop_last=True)
    batches = [b for epoch in range(2) for b in loader.batches(epoch)][:2]
    gpu = Trainer(model.build(train=True), params, config, backend="gpu").fit(batches)
    ref = Trainer(model.build(train=True), params, config, backend="reference").fit(batches)
    assert ref.grad_norms[0] > 1e19
    np.testing.assert_allclose(gpu.losses, ref.losses, rtol=1e-4)
    np.testing.assert_allclose(gpu.grad_norms, ref.grad_norms, rtol=1e-4)
