"""Optimizers, schedules, clipping, data loading and the Trainer, against PyTorch."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.errors import TrainingError
from engine.graph.ir import Graph
from engine.train.data import DataLoader
from engine.train.optimizers import Optimizer, adam_update, sgd_update
from engine.train.config import TrainConfig, clip_by_global_norm, learning_rate
from engine.train.trainer import Trainer

IN, HIDDEN, OUT, BATCH = 20, 32, 5, 16


def mlp_graph() -> Graph:
    g = Graph("mlp")
    x, labels = g.input("x", (BATCH, IN)), g.input("labels", (BATCH,), "i32")
    h = g.relu(g.linear(x, g.parameter("w1", (IN, HIDDEN)), g.parameter("b1", (HIDDEN,))))
    logits = g.linear(h, g.parameter("w2", (HIDDEN, OUT)), g.parameter("b2", (OUT,)))
    g.output("loss", g.cross_entropy_loss(logits, labels))
    return g


def mlp_params(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((IN, HIDDEN)) / math.sqrt(IN)).astype(np.float32),
            "b1": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
            "w2": (rng.standard_normal((HIDDEN, OUT)) / math.sqrt(HIDDEN)).astype(np.float32),
            "b2": (0.1 * rng.standard_normal(OUT)).astype(np.float32)}


def teacher_dataset(n=64, seed=1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, IN)).astype(np.float32)
    labels = (x @ rng.standard_normal((IN, OUT))).argmax(-1).astype(np.int32)
    return {"x": x, "labels": labels}


def fixed_batches(steps: int) -> list[dict[str, np.ndarray]]:
    loader = DataLoader(teacher_dataset(), BATCH, shuffle=True, seed=3, drop_last=True)
    out = []
    while len(out) < steps:
        out.extend(loader)
    return out[:steps]


def torch_losses(params, batches, make_optimizer, make_schedule=None, clip_norm=None) -> list[float]:
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = make_optimizer(p)
    sched = make_schedule(opt) if make_schedule else None
    losses = []
    for b in batches:
        x, labels = torch.tensor(b["x"]), torch.tensor(b["labels"]).long()
        loss = F.cross_entropy(F.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], labels)
        opt.zero_grad()
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(p.values()), clip_norm)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses


STEPS = 200


def test_sgd_momentum_follows_torch_loss_curve():
    batches, params = fixed_batches(STEPS), mlp_params()
    config = TrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, steps=STEPS)
    history = Trainer(mlp_graph(), params, config).fit(batches)
    want = torch_losses(params, batches, lambda p: torch.optim.SGD(p.values(), lr=0.05, momentum=0.9))
    assert len(history.losses) == STEPS
    assert np.max(np.abs(np.array(history.losses) - want)) < 1e-3
    assert history.losses[-1] < 0.5 * history.losses[0]  # it actually learns


def test_adamw_with_decay_flags_cosine_and_clipping_follows_torch_loss_curve():
    batches, params = fixed_batches(STEPS), mlp_params()
    config = TrainConfig(optimizer="adamw", lr=0.01, weight_decay=0.1, schedule="cosine", steps=STEPS,
                         clip_norm=1.0)
    history = Trainer(mlp_graph(), params, config).fit(batches)

    def adamw(p):  # biases are rank 1: no decay by default (Graph.parameter)
        return torch.optim.AdamW([{"params": [p["w1"], p["w2"]], "weight_decay": 0.1},
                                  {"params": [p["b1"], p["b2"]], "weight_decay": 0.0}], lr=0.01)
    want = torch_losses(params, batches, adamw,
                        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS), clip_norm=1.0)
    assert np.max(np.abs(np.array(history.losses) - want)) < 1e-3
    assert history.grad_norms[0] > 1.0  # clipping was active at least once


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_update_rules_match_torch_step_by_step(kind):
    rng = np.random.default_rng(4)
    p0 = rng.standard_normal((3, 4)).astype(np.float32)
    grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(5)]
    t = torch.tensor(p0, requires_grad=True)
    opt = {"sgd": lambda: torch.optim.SGD([t], lr=0.1, momentum=0.8, weight_decay=0.05),
           "adam": lambda: torch.optim.Adam([t], lr=0.1, betas=(0.8, 0.9), weight_decay=0.05),
           "adamw": lambda: torch.optim.AdamW([t], lr=0.1, betas=(0.8, 0.9), weight_decay=0.05)}[kind]()
    p, state = p0, {}
    for g in grads:
        t.grad = torch.tensor(g)
        opt.step()
        if kind == "sgd":
            p, state = sgd_update(p, g, state, 0.1, momentum=0.8, weight_decay=0.05)
        else:
            p, state = adam_update(p, g, state, 0.1, (0.8, 0.9), 1e-8, 0.05, decoupled=kind == "adamw")
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, t.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_cosine_schedule_matches_torch():
    config = TrainConfig(lr=0.3, schedule="cosine", total_steps=40)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
    for step in range(40):
        assert learning_rate(config, step) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
        opt.step()
        sched.step()


def test_warmup_is_linear_then_constant_or_cosine():
    warm = TrainConfig(lr=1.0, schedule="warmup", warmup_steps=4)
    assert [learning_rate(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = TrainConfig(lr=1.0, schedule="cosine", warmup_steps=4, total_steps=14)
    assert learning_rate(cos, 3) == 1.0
    assert learning_rate(cos, 4) == 1.0
    assert learning_rate(cos, 9) == pytest.approx(0.5)
    assert learning_rate(cos, 14) == pytest.approx(0.0)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_by_global_norm_matches_torch(max_norm):
    rng = np.random.default_rng(5)
    grads = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    ts = [torch.zeros(g.shape, requires_grad=True) for g in grads.values()]
    for t, g in zip(ts, grads.values()):
        t.grad = torch.tensor(g)
    want_norm = torch.nn.utils.clip_grad_norm_(ts, max_norm).item()
    clipped, norm = clip_by_global_norm(grads, max_norm)
    assert norm == pytest.approx(want_norm, rel=1e-6)
    for t, g in zip(ts, clipped.values()):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-6)


def test_frozen_parameters_stay_bit_identical_and_cost_no_gradient():
    g = mlp_graph()
    g.param_meta["b2"]["trainable"] = False
    params = mlp_params()
    config = TrainConfig(optimizer="adamw", lr=0.01, weight_decay=0.1, steps=20, lr_multipliers={"w1": 0.0})
    trainer = Trainer(g, params, config)
    assert [p for p, _ in trainer.pairs] == ["b1", "w2"]
    trainer.fit(fixed_batches(20))
    for frozen in ("w1", "b2"):
        assert trainer.params[frozen].tobytes() == params[frozen].tobytes()
    assert not np.array_equal(trainer.params["w2"], params["w2"])
    assert "w1" not in trainer.optimizer.state


def test_half_multiplier_halves_the_sgd_step():
    opt = Optimizer("sgd", lr=1.0, multipliers={"a": 0.5})
    params = {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)}
    opt.step(params, {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)}, lr=0.2)
    np.testing.assert_allclose(params["a"], 0.9)
    np.testing.assert_allclose(params["b"], 0.8)


def test_nan_loss_stops_training_naming_the_step():
    batches = fixed_batches(6)
    batches[4] = {"x": np.full_like(batches[4]["x"], np.nan), "labels": batches[4]["labels"]}
    seen = []
    trainer = Trainer(mlp_graph(), mlp_params(), TrainConfig(optimizer="sgd", lr=0.01, steps=6),
                      on_step=lambda step, loss: seen.append(step))
    with pytest.raises(TrainingError, match="loss became nan at step 5;"):
        trainer.fit(batches)
    assert seen == [0, 1, 2, 3]


def test_cancellation_by_event_and_callable():
    stop = threading.Event()
    trainer = Trainer(mlp_graph(), mlp_params(), TrainConfig(optimizer="sgd", lr=0.01, steps=50),
                      on_step=lambda step, loss: stop.set() if step == 2 else None, should_stop=stop)
    history = trainer.fit(fixed_batches(50))
    assert len(history.losses) == 3 and history.stopped
    trainer = Trainer(mlp_graph(), mlp_params(), TrainConfig(optimizer="sgd", lr=0.01, steps=50),
                      should_stop=lambda: len(trainer.history) >= 4)
    assert len(trainer.fit(fixed_batches(50)).losses) == 4


def test_epochs_callbacks_and_history_export(tmp_path):
    epochs = []
    config = TrainConfig(optimizer="adam", lr=0.01, epochs=3, batch_size=BATCH, seed=7)
    trainer = Trainer(mlp_graph(), mlp_params(), config, on_epoch=lambda e, h: epochs.append((e, len(h))))
    history = trainer.fit(teacher_dataset(n=70))  # 4 full batches per epoch, the rest dropped
    assert epochs == [(0, 4), (1, 8), (2, 12)]
    assert history.epochs == [0] * 4 + [1] * 4 + [2] * 4
    assert history.epoch_losses[0] == pytest.approx(np.mean(history.losses[:4]))
    text = history.to_csv(tmp_path / "h.csv")
    rows = (tmp_path / "h.csv").read_text().splitlines()
    assert text.splitlines() == rows and rows[0] == "step,epoch,loss,lr,grad_norm,seconds" and len(rows) == 13
    assert float(rows[5].split(",")[2]) == history.losses[4]
    assert history.to_dict()["losses"] == history.losses


def test_dataloader_seeded_shuffle_and_drop_last():
    data = {"x": np.arange(10) * 10, "y": np.arange(10)}
    a, b = DataLoader(data, 4, seed=1), DataLoader(data, 4, seed=1)
    first, again = list(a), list(b)
    assert len(first) == 3 and [len(bt["y"]) for bt in first] == [4, 4, 2]
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x["y"], y["y"])
        np.testing.assert_array_equal(x["x"], 10 * x["y"])  # rows stay aligned across arrays
    assert sorted(np.concatenate([bt["y"] for bt in first])) == list(range(10))
    second_epoch = np.concatenate([bt["y"] for bt in a])
    assert not np.array_equal(second_epoch, np.concatenate([bt["y"] for bt in first]))
    assert [len(bt["y"]) for bt in DataLoader(data, 4, drop_last=True)] == [4, 4]
    assert [list(bt["y"]) for bt in DataLoader(data, 5, shuffle=False)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(TrainingError, match="equally long"):
        DataLoader({"x": np.zeros(3), "y": np.zeros(4)}, 2)


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(TrainingError, match="unknown optimizer 'rmsprop'"):
        TrainConfig(optimizer="rmsprop")
    with pytest.raises(TrainingError, match="cosine schedule needs total_steps"):
        TrainConfig(schedule="cosine")
