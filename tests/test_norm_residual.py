"""A norm's input gradient and the gradient along the residual are added by the norm's
backward kernel (engine.optimize.norm_residual): the same values as autodiff's add, on
the reference and on the GPU, and every pre-norm block of whisper and gpt folds its add."""

import numpy as np
import pytest

from engine import Graph, models
from engine.autodiff.gradients import differentiate
from engine.compile.cache import cached_training_graph
from engine.optimize import optimize
from engine.optimize.norm_residual import fold_residual_gradients

from test_runtime import check_rewrite


def pre_norm_training_graph(norm: str) -> Graph:
    """x -> x + (norm(x) @ w) -> norm(.) @ w2 -> loss: two norms, each with a residual
    past it (the second's add is read elsewhere too), differentiated and optimized."""
    g = Graph("pre-norm")
    x = g.parameter("x", (6, 8))
    w, w2 = g.parameter("w", (8, 8)), g.parameter("w2", (8, 3))
    gains = [g.parameter(f"g{i}", (8,)) for i in range(2)]
    normed = (lambda v, i: g.layer_norm(v, gains[i], g.parameter(f"b{i}", (8,)))) if norm == "layer_norm" \
        else (lambda v, i: g.rms_norm(v, gains[i]))
    h = g.add(x, g.matmul(normed(x, 0), w))
    y = g.matmul(normed(h, 1), w2)
    g.output("loss", g.mean(g.mul(y, y)))
    train, _ = differentiate(optimize(g)[0], "loss")
    return optimize(train)[0]


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_the_add_is_folded_with_the_same_values(norm):
    g = pre_norm_training_graph(norm)
    out, count, remap = fold_residual_gradients(g)
    adds = lambda graph: sum(n.op == "add" for n in graph.nodes)   # noqa: E731
    folded = [n for n in out.nodes if n.op == "norm_grad" and len(n.inputs) == 4]
    assert count == len(folded) >= 1 and adds(out) == adds(g) - count
    rng = np.random.default_rng(1)
    params = {name: rng.standard_normal(g[i].shape) for name, i in g.parameters.items()}
    check_rewrite(g, out, params)
    assert fold_residual_gradients(out)[:2] == (out, 0)


def test_an_add_that_broadcasts_or_a_gradient_read_twice_is_left_alone():
    g = Graph("left-alone")
    x = g.input("x", (4, 8))
    d = g.input("d", (4, 8))
    grad = g.apply("norm_grad", d, x, g.parameter("w", (8,)))
    g.output("broadcast", g.add(grad, g.input("row", (8,))))
    g.output("twice", g.add(grad, grad))
    assert fold_residual_gradients(g)[1] == 0


def test_whisper_and_gpt_training_fold_every_pre_norm_residual():
    for name, settings, norms in (("whisper-tiny", ["mel_len=64", "batch=2"], 8), ("gpt-tiny", ["seq=16", "batch=2"], 12)):
        model = models.create(name, settings)
        train, _, _, report = cached_training_graph(model.build(train=True), "loss")
        folded = [n for n in train.nodes if n.op == "norm_grad" and len(n.inputs) == 4]
        assert len(folded) == norms == report.passes["norm_residual"], name
