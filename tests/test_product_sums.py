"""A weight gradient's product that also computes its bias gradient (the sum of the
same output gradient over the rows): engine/codegen/product_sums.py and the plan's
pairing (engine/compile/plan.py, ``_products_with_sums``). The sums are the f32 values
the kernel fetches added up, so they match float64 to f32's precision on every path,
cooperative (f16 products) included."""

import dataclasses

import numpy as np
import pytest

from engine import Graph, codegen
from engine.autodiff.gradients import differentiate
from engine.compile.plan import compile_plan
from engine.config import Knobs
from engine.graph import reference
from engine.runtime.device import device_capabilities
from engine.runtime.session import build_inference_session

from test_coop_matmul import COOP_CAPS
from test_runtime import feeds, rel_err
from tint_check import tint_check


def _products_beside_sums(rows=300, n=72, k=40):
    """Both orientations of a weight gradient beside its bias's sum: dᵀ x (A's rows
    summed) and xᵀ d (B's columns), over rows that end mid-step and outputs that end
    mid-tile."""
    g = Graph("sums")
    d, x = g.input("d", [rows, n]), g.input("x", [rows, k])
    g.output("dw_out_in", g.matmul(d, x, transpose_a=True))       # weights [out, in]: [n, k]
    g.output("db_a", g.apply("sum_to", d, shape=(n,)))
    d2, x2 = g.input("d2", [rows, n + 8]), g.input("x2", [rows, k])
    g.output("dw_in_out", g.matmul(x2, d2, transpose_a=True))     # weights [in, out]: [k, n + 8]
    g.output("db_b", g.apply("sum_to", d2, shape=(n + 8,)))
    return g


def _run(g, configure, **knobs):
    configure(**knobs)
    inputs, params = feeds(g)
    s = build_inference_session(g, optimize=False, capabilities=device_capabilities())
    s.set_inputs(inputs)
    s.set_parameters(params)
    s.run()
    return s, reference.run(g, inputs, params, np.float64)


FORCED = ["64", "128k8u", "64t128", *codegen.COOP]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("variant", FORCED)
def test_products_add_up_their_gradient_operand_on_every_tile(variant, splits, configure):
    """Each tiled kernel, forced, whole and with K split in three: one dispatch (two
    stages where split) computes each product and its sum, the sum to f32's precision and
    the product to its kernel's; no ``sum_to`` runs. Cooperative presets fall back to the
    f32 tiles where the device has no subgroup matrices (lavapipe)."""
    g = _products_beside_sums()
    s, want = _run(g, configure, precision="f16", matmul=variant, matmul_splits=splits)
    if variant not in codegen.COOP or s.capabilities.matmul_f16:
        fused = [d for d in s.plan.dispatches if len(d.nodes) == 2]
        assert not any(d.kernel.startswith("sum_to") for d in s.plan.dispatches)
        assert len(fused) == 2 * (2 if splits > 1 else 1), [d.name for d in s.plan.dispatches]
        notes = sorted(d.variant for d in fused if not d.kernel.endswith(":total"))
        assert "adds up A's rows" in notes[0] + notes[1] and "adds up B's columns" in notes[0] + notes[1], notes
        assert all((f"K split {splits} ways" in v) == (splits > 1) for v in notes), notes
    for name in ("db_a", "db_b"):
        assert rel_err(s.read_output(name), want[name]) < 1e-6, (variant, name)
    tolerance = 5e-3 if s.capabilities.matmul_f16 else 1e-5
    for name in ("dw_out_in", "dw_in_out"):
        assert rel_err(s.read_output(name), want[name]) < tolerance, (variant, name)


def test_a_linear_layers_gradients_come_from_one_dispatch(configure):
    """Training a linear layer with a bias: its weight's and bias's gradients come from
    the weight gradient's product alone, each where the optimizer reads it, and equal
    the float64 reference's."""
    g = Graph("linear")
    x = g.input("x", [4, 50, 24])
    y = g.linear(x, g.parameter("w", [24, 40]), g.parameter("b", [40]))
    g.output("loss", g.mean(g.mul(y, y)))
    train, pairs = differentiate(g, "loss")
    s, want = _run(train, configure, matmul="64")
    fused = [d for d in s.plan.dispatches if len(d.nodes) == 2]
    assert len(fused) == 1 and {train[i].op for i in fused[0].nodes} == {"matmul", "sum_to"}
    assert not any(d.kernel.startswith("sum_to") for d in s.plan.dispatches)
    for name in ("grad:w", "grad:b"):
        assert rel_err(s.read_output(name), want[name]) < 1e-5, name


def test_sums_stay_apart_where_read_before_the_product_or_not_whole():
    """The plan pairs a sum with a product only where the product reads the summed tensor
    whole (not a part of it) and nothing reads the sum before the product runs; else
    the sum keeps its own dispatch."""
    g = Graph("apart")
    d, x = g.input("d", [200, 64]), g.input("x", [200, 32])
    early = g.apply("sum_to", d, shape=(64,))
    g.output("early_user", g.mul(early, early))      # read before the product below
    g.output("dw", g.matmul(d, g.mul(x, g.reshape(g.slice(g.reshape(early, (1, 64)), 1, 0, 32), (1, 32))),
                            transpose_a=True))
    caps = dataclasses.replace(codegen.PLAIN, knobs=Knobs(matmul="64"))
    plan = compile_plan(g, loss=None, capabilities=caps)
    assert sum(d.kernel.startswith("sum_to") for d in plan.dispatches) == 1
    assert not any(len(d.nodes) == 2 for d in plan.dispatches)


def test_whisper_training_plans_have_no_bias_sums_left():
    """whisper-tiny's training plan (f32 tiles and cooperative ones): every linear
    layer's bias gradient comes from its weight gradient's product (q's and v's from the
    stacked q/k/v product, copied out of its sums); only the convolutions' bias sums
    remain."""
    from engine import models
    from engine.compile.cache import cached_training_graph
    model = models.create("whisper-tiny", ["mel_len=3000", "batch=8"])
    train, pairs, *_ = cached_training_graph(model.build(train=True), "loss")
    for caps in (codegen.PLAIN, COOP_CAPS):
        plan = compile_plan(train, dict(pairs), "loss", caps)
        left = [d.name for d in plan.dispatches if d.kernel.startswith("sum_to")]
        assert len(left) == 2 and all("conv" in name for name in left), left
        paired = [d for d in plan.dispatches if len(d.nodes) == 2 and not d.kernel.endswith(":total")]
        products = [d for d in paired if d.archetype == "matmul"]
        assert len(products) == 16, [d.name for d in products]   # out_proj, fc1, fc2 and the stacked q/k/v, 4 layers
        norms = [d for d in paired if d.kernel == "norm_grad"]   # each norm's dx with its parameter gradients
        assert len(norms) == 9 and len(paired) == 25, [d.name for d in paired]


def test_every_preset_adding_up_an_operand_passes_tint():
    """The sums' WGSL in every cooperative preset, whole and split, both operands."""
    kernels, coop = tint_check("""
        import dataclasses
        from engine.config import Knobs
        from test_coop_matmul import COOP_CAPS
        from test_product_sums import _products_beside_sums
        g = _products_beside_sums()
        for variant in codegen.COOP:
            for splits in (1, 3):
                caps = dataclasses.replace(COOP_CAPS, knobs=Knobs(matmul=variant, matmul_splits=splits))
                for name, operand in (("dw_out_in", "a"), ("dw_in_out", "b")):
                    kernel = codegen.kernel_for(g, g[g.outputs[name]], caps, sums=operand)
                    assert kernel.sums == operand, (variant, name)
                    check(f"{variant} {name} {splits}", kernel)
                    check(f"{variant} {name} {splits} finish", kernel.finish)
    """)
    assert coop >= 2 * 2 * len(codegen.COOP), (kernels, coop)
