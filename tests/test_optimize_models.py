"""Fusion must not change what a built-in model computes: reference outputs of the
original and the optimized graph agree in float64, forward and training graphs."""

import numpy as np
import pytest

from engine import differentiate, models
from engine.graph import reference
from engine.optimize import optimize

SMALL = {"mlp": ["batch=4"], "whisper-tiny": ["mel_len=16", "batch=1"], "gpt-tiny": ["seq=8", "batch=1"],
         "audio-align": ["mel_len=16", "seq=6", "batch=2"]}


@pytest.mark.parametrize("train", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("name", list(SMALL))
def test_optimized_builtin_model_computes_the_same(name, train):
    model = models.create(name, SMALL[name])
    graph = model.build(train=train)
    if train:
        graph, _ = differentiate(graph)
    fused, report = optimize(graph)
    assert report.saturated
    assert report.dispatches_after < report.dispatches_before
    assert set(fused.outputs) == set(graph.outputs) and set(fused.parameters) == set(graph.parameters)
    rng = np.random.default_rng(0)
    params = {k: v + 0.02 * rng.standard_normal(v.shape) for k, v in model.init_params(0).items()}
    inputs = model.example_inputs(train=train)
    want = reference.run(graph, inputs, params, np.float64)
    got = reference.run(fused, inputs, params, np.float64)
    for k, v in want.items():
        assert np.abs(got[k] - v).max() <= 1e-10 * max(np.abs(v).max(), 1e-30), k
