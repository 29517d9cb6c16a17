"""An activation's gradient applied by the product computing the gradient that arrives at
it (engine.optimize.activation_grad): the same values as autodiff's gradient op, on the
reference and on the GPU, for each activation with a gradient op, and every GELU MLP of
whisper folds it."""

import numpy as np
import pytest

from engine import Graph, codegen, models
from engine.autodiff.gradients import differentiate
from engine.compile.cache import cached_training_graph
from engine.optimize import optimize
from engine.optimize.activation_grad import fold_activation_gradients
from engine.runtime.device import device_capabilities, get_device

from test_coop_matmul import COOP_CAPS
from test_runtime import TOL, check, check_rewrite
from tint_check import tint_check

GRADIENT_OPS = {"relu": "relu_grad", "gelu": "gelu_grad", "gelu_tanh": "gelu_grad"}


def mlp_training_graph(activation: str) -> Graph:
    """x -> act(x @ w1 + b1) @ w2 -> loss (the MLP block), and a second activation whose
    product is another output (left alone), differentiated and optimized."""
    g = Graph("mlp")
    x = g.parameter("x", (2, 9, 12))
    w1, b1, w2 = g.parameter("w1", (12, 20)), g.parameter("b1", (20,)), g.parameter("w2", (20, 7))
    act = {"relu": g.relu, "gelu": g.gelu, "gelu_tanh": lambda v: g.apply("gelu", v, approximate="tanh")}[activation]
    y = g.matmul(act(g.add(g.matmul(x, w1), b1)), w2)
    g.output("loss", g.mean(g.mul(y, y)))
    train, _ = differentiate(optimize(g)[0], "loss")
    return optimize(train)[0]


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_the_gradient_is_folded_with_the_same_values(activation):
    g = mlp_training_graph(activation)
    op = GRADIENT_OPS[activation]
    out, count, _ = fold_activation_gradients(g)
    folded = [n for n in out.nodes if n.op == "fused_matmul" and n.attrs["gradient_of"] == activation]
    assert count == len(folded) == 1 and not any(n.op == op for n in out.nodes) and any(n.op == op for n in g.nodes)
    assert len(out) == len(g) - 1   # the product and its gradient op are one node
    rng = np.random.default_rng(1)
    params = {name: rng.standard_normal(g[i].shape) for name, i in g.parameters.items()}
    check_rewrite(g, out, params)
    assert fold_activation_gradients(out)[:2] == (out, 0)


def test_a_product_read_twice_or_an_output_is_left_alone():
    g = Graph("left-alone")
    a, b, h = g.input("a", (4, 8)), g.input("b", (8, 6)), g.input("h", (4, 6))
    twice = g.matmul(a, b)
    g.output("twice", g.add(g.apply("gelu_grad", twice, h), twice))
    shown = g.output("shown", g.matmul(b, g.input("c", (6, 6))))
    g.output("of_output", g.apply("relu_grad", shown, g.input("h2", (8, 6))))
    assert fold_activation_gradients(g)[1] == 0


@pytest.mark.parametrize("gradient", ["relu", "gelu", "gelu_tanh"])
def test_the_epilogue_on_the_gpu(gradient):
    """The fused kernels against the reference: a tiled product, a transposed one with a
    bias, an activation and a residual before the gradient, one of few rows (the vector
    kernel) and one split along K. Where products take f16 operands (Dawn with subgroup
    matrices), their rounding (3-4e-4 of the largest value on the H100) sets the tolerance."""
    g = Graph("gradient-epilogue")
    a, w = g.input("a", [2, 33, 20]), g.parameter("w", [20, 37])
    h = g.input("h", [2, 33, 37])
    g.output("plain", g.apply("fused_matmul", a, w, h, gradient_of=gradient))
    wt, bias, res = g.parameter("wt", [37, 20]), g.parameter("bias", [37]), g.input("res", [2, 33, 37])
    g.output("epilogue", g.apply("fused_matmul", a, wt, bias, res, h, transpose_b=True, activation="silu",
                                 has_add=True, has_residual=True, gradient_of=gradient))
    row, h_row = g.input("row", [1, 20]), g.input("h_row", [1, 37])
    g.output("few_rows", g.apply("fused_matmul", row, w, h_row, gradient_of=gradient))
    long, w_long, h_long = g.input("long", [64, 2048]), g.parameter("w_long", [2048, 40]), g.input("h_long", [64, 40])
    g.output("split", g.apply("fused_matmul", long, w_long, h_long, gradient_of=gradient))
    f16 = device_capabilities(get_device()).matmul_f16   # cooperative products round their operands
    s = check(g, tol=2e-3 if f16 else TOL)
    assert any("K split" in d.variant for d in s.plan.dispatches)   # the second dispatch applies the epilogue


def test_whisper_training_folds_each_mlp_gelu():
    model = models.create("whisper-tiny", ["mel_len=64", "batch=2"])
    train, _, _, report = cached_training_graph(model.build(train=True), "loss")
    folded = [n for n in train.nodes if n.op == "fused_matmul" and n.attrs["gradient_of"] == "gelu"]
    assert len(folded) == 4 == report.passes["activation_grad"]   # fc2's input gradient, a layer
    assert all(train[n.inputs[-1]].shape[-1] == 1536 for n in folded)


def coop_gradient_product():
    g = Graph("coop-gradient")
    x, w, h = g.input("x", [512, 384]), g.input("w", [384, 1536]), g.input("h", [512, 1536])
    return g, g[g.output("dz", g.apply("fused_matmul", x, w, h, gradient_of="gelu"))]


def test_cooperative_products_apply_the_gradient_in_a_second_dispatch():
    """A cooperative tile's epilogue runs in turns over its subgroups: the gradient (erfc
    and a load an element) goes to the finishing dispatch (Tint compiles both), which the
    f32 tiles do without."""
    g, node = coop_gradient_product()
    coop = codegen.kernel_for(g, node, COOP_CAPS)
    assert "subgroupMatrix" in coop.source and "gelu_grad_(v, " not in coop.source
    assert coop.finish is not None and "gelu_grad_(v, " in coop.finish.source and coop.partials == 512 * 1536
    assert "epilogue in a second dispatch" in coop.notes["variant"]
    tiled = codegen.kernel_for(g, node, codegen.Capabilities(subgroups=True))
    assert tiled.finish is None and "gelu_grad_(v, " in tiled.source
    assert tint_check("""
        from test_activation_grad import coop_gradient_product
        from test_coop_matmul import COOP_CAPS
        g, node = coop_gradient_product()
        kernel = codegen.kernel_for(g, node, COOP_CAPS)
        check("product", kernel)
        check("finish", kernel.finish)
        """) == (2, 1)
