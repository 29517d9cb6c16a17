"""A convolution's activation applied by the convolution's kernel (engine.optimize.conv_activation):
what the inference pass folds and leaves, the same values as the unfolded graph (float64
reference, lavapipe), and its gradient by decomposition."""

import numpy as np
import pytest

from engine import Graph, models
from engine.autodiff.gradients import differentiate
from engine.codegen import kernel_for
from engine.graph import reference
from engine.graph.ops import ACTIVATION_OPS, entry_of
from engine.optimize.conv_activation import fold_conv_activations
from engine.optimize.passes import optimize_inference
from engine.runtime.session import Session

ACTIVATIONS = [("relu", {}), ("silu", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"})]


def conv_then(op: str, attrs: dict, two_d: bool = False, also_read: bool = False, channels=(3, 5)) -> Graph:
    """x -> conv (with bias) -> activation; ``also_read``: the convolution is an output too;
    ``channels``: in and out (16 and 32 make a GEMM of whole 16 x 16 x 16 fragments, so
    that the cooperative kernels apply it where the precision is f16)."""
    c, o = channels
    g = Graph("conv then activation")
    x = g.input("x", (2, c, 9, 10) if two_d else (2, c, 40))
    w = g.parameter("w", (o, c, 3, 3) if two_d else (o, c, 3))
    conv = g.apply("conv2d" if two_d else "conv1d", x, w, g.parameter("b", (o,)),
                   stride=(2, 1) if two_d else (2,), padding=(1, 1) if two_d else (1,))
    g.output("y", g.apply(op, conv, **attrs))
    if also_read:
        g.output("conv", conv)
    return g


def feeds(g: Graph, seed: int = 0):
    rng = np.random.default_rng(seed)
    inputs = {k: rng.standard_normal(g[i].shape) for k, i in g.inputs.items()}
    params = {k: rng.standard_normal(g[i].shape) for k, i in g.parameters.items()}
    return inputs, params


@pytest.mark.parametrize("op,attrs", ACTIVATIONS)
@pytest.mark.parametrize("two_d,channels", [(False, (3, 5)), (True, (3, 5)), (False, (16, 32))])
def test_an_activation_after_a_convolution_is_its_epilogue(op, attrs, two_d, channels):
    g = conv_then(op, attrs, two_d, channels=channels)
    out, count, _ = fold_conv_activations(g)
    name = entry_of(ACTIVATION_OPS, g[g.outputs["y"]])
    assert count == 1 and name == {"gelu": "gelu_tanh" if attrs else "gelu"}.get(op, op)
    conv = out[out.outputs["y"]]
    assert conv.op == ("conv2d" if two_d else "conv1d") and conv.attrs["activation"] == name
    assert not any(n.op == op for n in out.nodes)
    inputs, params = feeds(g)
    want = reference.run(g, inputs, params, np.float64)["y"]
    np.testing.assert_array_equal(reference.run(out, inputs, params, np.float64)["y"], want)
    assert "v = act(v);" in kernel_for(out, conv).source
    session = Session(out)
    session.set_inputs({k: v.astype(np.float32) for k, v in inputs.items()})
    session.set_parameters({k: v.astype(np.float32) for k, v in params.items()})
    session.run()
    cooperative = any("cooperative" in d.variant for d in session.plan.dispatches)   # Dawn, f16 operands
    tol = 5e-3 if cooperative else 1e-5
    got = session.read_output("y")
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want), np.abs(got - want).max()


def test_a_convolution_read_elsewhere_keeps_its_activation_apart():
    g = conv_then("relu", {}, also_read=True)
    assert fold_conv_activations(g)[1] == 0
    g = Graph("two readers")
    x = g.input("x", (1, 2, 8))
    conv = g.apply("conv1d", x, g.parameter("w", (2, 2, 3)), padding=(1,))
    g.output("y", g.add(g.relu(conv), conv))
    assert fold_conv_activations(g)[1] == 0
    g = Graph("not an activation")
    conv = g.apply("conv1d", g.input("x", (1, 2, 8)), g.parameter("w", (2, 2, 3)), padding=(1,))
    g.output("y", g.apply("exp", conv))
    assert fold_conv_activations(g)[1] == 0


def test_whisper_inference_applies_its_convolutions_gelu_in_their_kernels():
    model = models.create("whisper-tiny", ["mel_len=64", "batch=2"])
    g = model.build(train=False)
    out, report = optimize_inference(g)
    convs = [n for n in out.nodes if n.op == "conv1d"]
    assert [n.attrs["activation"] for n in convs] == ["gelu", "gelu"]
    assert report.passes["conv_activation"] == 2 and report.pass_dispatches_saved["conv_activation"] == 2
    users = out.users()
    assert not any(out[u].op == "gelu" for n in convs for u in users[n.id])
    params = {k: v.astype(np.float64) for k, v in model.init_params(0).items()}
    inputs = model.example_inputs(train=False)
    want, got = reference.run(g, inputs, params, np.float64), reference.run(out, inputs, params, np.float64)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("op,attrs", ACTIVATIONS)
def test_a_folded_convolution_differentiates_like_the_two_ops(op, attrs):
    """Its gradients (decomposed) equal the unfolded graph's in float64, and finite
    differences of the loss."""
    g = conv_then(op, attrs)
    y = g.outputs["y"]
    g.output("loss", g.apply("mse_loss", y, g.input("target", g[y].shape)))
    folded, count, _ = fold_conv_activations(g)
    assert count == 1
    inputs, params = feeds(g, 1)
    grads = {}
    for which, graph in (("two ops", g), ("folded", folded)):
        train, pairs = differentiate(graph, "loss")
        values = reference.run(train, inputs, params, np.float64)
        grads[which] = {p: values[o] for p, o in pairs}
    for p in params:
        np.testing.assert_allclose(grads["folded"][p], grads["two ops"][p], rtol=1e-12, atol=1e-14, err_msg=p)
    loss = lambda ps: float(reference.run(folded, inputs, ps, np.float64)["loss"])  # noqa: E731
    step = 1e-6
    for i in range(3):
        nudged = [params["w"].copy() for _ in (0, 1)]
        nudged[0].flat[i] += step
        nudged[1].flat[i] -= step
        numeric = (loss({**params, "w": nudged[0]}) - loss({**params, "w": nudged[1]})) / (2 * step)
        assert numeric == pytest.approx(grads["folded"]["w"].flat[i], rel=1e-6, abs=1e-9)
