"""A training graph's attention forward keeps its rows' log-sum-exp for the backward
(engine.optimize.attention_stats): the pass, the attention_stats kernel on lavapipe
against numpy float64 (whole and split, causal and grouped-query), and the training
pipeline using it."""

import numpy as np
import pytest

from engine import Graph, models
from engine.autodiff.gradients import differentiate
from engine.errors import GraphError
from engine.graph import reference
from engine.optimize.attention_stats import share_attention_statistics
from engine.runtime.session import build_inference_session
from engine.train.config import TrainConfig
from engine.train.session import build_session

CASES = {   # batch, T, S, heads, kv heads, head dim, causal
    "gqa-causal": (2, 70, 70, 4, 2, 16, True),
    "cross-d36": (1, 33, 130, 2, 2, 36, False),
}


def with_lse(g: Graph) -> Graph:
    """``g`` (one attention, as test_attention_kernel's attention_graph builds) with two
    attention_lse nodes of the same q, k (both to read the one result) as outputs."""
    (node,) = [n for n in g.nodes if n.op == "attention"]
    for name in ("lse", "lse_again"):
        g.output(name, g.apply("attention_lse", *node.inputs[:2], **node.attrs))
    return g


def _graph(b, t, s, h, hkv, d, causal, lse=True):
    g = Graph("stats")
    q, k, v = g.input("q", [b, t, h * d]), g.input("k", [b, s, hkv * d]), g.input("v", [b, s, hkv * d])
    g.output("o", g.apply("relu", g.apply("attention", q, k, v, num_heads=h, num_kv_heads=hkv, causal=causal)))
    return with_lse(g) if lse else g


def _feeds(g, rng):
    return {name: rng.standard_normal(g[i].shape).astype(np.float32) for name, i in g.inputs.items()}


def test_the_pass_packs_attention_with_its_log_sum_exp_and_keeps_the_values():
    g = _graph(*CASES["gqa-causal"])
    out, count, _ = share_attention_statistics(g)
    assert count == 1
    assert [n.op for n in out.nodes].count("attention_stats") == 1
    assert not any(n.op in ("attention", "attention_lse") for n in out.nodes)
    assert set(out.outputs) == set(g.outputs)
    feeds = _feeds(g, np.random.default_rng(0))
    want, got = reference.run(g, feeds, {}, np.float64), reference.run(out, feeds, {}, np.float64)
    for name in g.outputs:
        np.testing.assert_array_equal(got[name], want[name])
    other = _graph(*CASES["gqa-causal"], lse=False)
    assert share_attention_statistics(other)[:2] == (other, 0)
    trained = Graph("after")
    w = trained.parameter("w", [1, 4, 8])
    trained.output("loss", trained.sum(trained.apply("attention_stats", w, w, w, num_heads=2)))
    with pytest.raises(GraphError, match="attention_stats is made by engine.optimize.attention_stats"):
        differentiate(trained, "loss")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_stats_kernel_matches_numpy(case, splits, configure):
    """The forward's result and the log-sum-exp it writes beside it; with the keys split
    split (three ways, or as many as there are key blocks) the combine writes it instead."""
    configure(attention_splits=splits)
    g = _graph(*CASES[case])
    packed, _, _ = share_attention_statistics(g)
    feeds = _feeds(g, np.random.default_rng(1))
    want = reference.run(g, feeds, {}, np.float64)
    session = build_inference_session(packed, optimize=False)
    variant = next(d.variant for d in session.plan.dispatches if "log-sum-exp" in d.variant)
    assert ("ways" in variant) == (splits > 1), variant
    session.set_inputs(feeds)
    session.run()
    got = session.read_outputs()
    # f16 q, k, v and P where MEGANEURA_PRECISION=f16 takes the cooperative kernel (3.6e-4
    # measured on the H100; test_attention_coop holds it to the f16-rounded reference)
    tol = 1e-3 if session.capabilities.matmul_f16 else 2e-6
    for name in ("o", "lse", "lse_again"):
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err < tol, (name, err)


def test_training_graphs_take_the_statistics_from_the_forward():
    """gpt-tiny's training session has no attention_lse node left, one attention_stats a
    layer (six), and trains (its losses against torch are checked in test_reference_vs_torch)."""
    model = models.create("gpt-tiny", ["batch=2", "seq=16"])
    session = build_session(model.build(train=True), TrainConfig(optimizer="adamw", lr=1e-3),
                            model.init_params(0))
    ops = [n.op for n in session.graph.nodes]
    assert ops.count("attention_stats") == 6 and "attention_lse" not in ops and "attention" not in ops
