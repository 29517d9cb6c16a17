"""Training on the GPU (lavapipe here) against the reference trainer."""

import numpy as np
import pytest

from engine import Graph, models, reference
from engine.errors import TrainingError
from engine.runtime import build_inference_session
from engine.train import DataLoader, TrainConfig, Trainer
from engine.training_session import build_session


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
    with pytest.raises(TrainingError, match="at step 2"):
        trainer.step(batches[2])
    after = trainer.params
    for k in kept:
        assert np.array_equal(after[k], kept[k]), k


SMALL = {"mlp": ["batch=4"], "whisper-tiny": ["mel_len=16", "batch=1"], "gpt-tiny": ["seq=8", "batch=1"],
         "audio-align": ["mel_len=16", "seq=6", "batch=2"]}


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


def test_sessions_reuse_the_plan_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGANEURA_CACHE", str(tmp_path))
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
