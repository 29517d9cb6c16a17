"""A training graph computes an activated product once (engine.optimize.preactivation):
the forward's fused activation and autodiff's copy of the product for the activation's
gradient become one product and a pointwise activation, with the same values."""

import numpy as np

from engine import Graph, models
from engine.autodiff.gradients import differentiate
from engine.compile.cache import cached_training_graph
from engine.graph import reference
from engine.optimize import optimize
from engine.optimize.preactivation import reuse_preactivations

PRODUCTS = ("matmul", "fused_matmul")


def mlp_training_graph(bias: bool, activation: str):
    """x -> act(x @ w1 [+ b1]) @ w2 -> loss, differentiated and optimized (the pass's input)."""
    g = Graph("mlp")
    x = g.input("x", (6, 5))
    w1, w2 = g.parameter("w1", (5, 7)), g.parameter("w2", (7, 3))
    h = g.matmul(x, w1)
    if bias:
        h = g.add(h, g.parameter("b1", (7,)))
    a = g.apply(activation, h)
    g.output("loss", g.mean(g.mul(g.matmul(a, w2), g.matmul(a, w2))))
    fused, _ = optimize(g)
    train, _ = differentiate(fused, "loss")
    return optimize(train)[0]


def test_the_product_is_computed_once_with_the_same_values():
    rng = np.random.default_rng(0)
    for bias, activation in ((True, "gelu"), (False, "silu"), (True, "relu")):
        g = mlp_training_graph(bias, activation)
        out, count, _ = reuse_preactivations(g)
        products = lambda graph: sum(n.op in PRODUCTS for n in graph.nodes)
        assert count == 1 and products(out) == products(g) - 1
        assert any(n.op == activation for n in out.nodes)
        assert not any(n.op == "fused_matmul" and n.attrs["activation"] != "none" for n in out.nodes)
        params = {name: rng.standard_normal(g[i].shape) for name, i in g.parameters.items()}
        feeds = {"x": rng.standard_normal((6, 5))}
        want, got = reference.run(g, feeds, params, np.float64), reference.run(out, feeds, params, np.float64)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)
        assert reuse_preactivations(out)[:2] == (out, 0)


def test_whisper_and_gpt_training_compute_each_fc1_once():
    for name, settings in (("whisper-tiny", ["mel_len=64", "batch=2"]), ("gpt-tiny", ["seq=16", "batch=2"])):
        model = models.create(name, settings)
        train, *_ = cached_training_graph(model.build(train=True), "loss")
        activated = [n for n in train.nodes if n.op == "fused_matmul" and n.attrs["activation"] != "none"]
        assert not activated, name
        assert sum(n.op == "gelu" for n in train.nodes) >= 2, name
