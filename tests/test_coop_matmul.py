"""The cooperative-matrix matmul (f16 operands, f32 accumulation) and the Dawn backend.

CI's lavapipe runs on wgpu-native, which cannot enable cooperative matrices: there
``MEGANEURA_PRECISION=f16`` must fall back to the f32 kernels with unchanged results,
and every generated kernel, the cooperative ones included, must still pass Tint's
front end (Dawn's Null backend, no GPU needed). On a device that has them (the H100
through ``MEGANEURA_WGPU=dawn``) the same tests run the cooperative kernels and check
them against a float64 reference of the f16-rounded operands.
"""

import dataclasses

import numpy as np
import pytest

from engine import Graph, codegen
from engine.codegen.tuning import Tuning
from engine.config import Knobs
from engine.graph import reference
from engine.runtime.session import build_inference_session
from engine.runtime.device import device_capabilities

from test_runtime import feeds, rel_err
from tint_check import tint_check

COOP_CAPS = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=True,
                                 invocations=1024)


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def _matmul_graph():
    """Products that cross tile edges on every operand layout (vec4 and scalar fetches,
    transposes), a batch, a broadcast weight with the fused epilogue, a long K that
    split-K cuts, and a convolution (implicit GEMM)."""
    g = Graph("coop")
    for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
        for m, k, n in [(132, 40, 72), (70, 33, 130)]:
            a = g.input(f"a{ta:d}{tb:d}{m}", [k, m] if ta else [m, k])
            b = g.input(f"b{ta:d}{tb:d}{m}", [n, k] if tb else [k, n])
            g.output(f"c{ta:d}{tb:d}{m}", g.matmul(a, b, transpose_a=ta, transpose_b=tb))
    x = g.input("x", [3, 68, 20])
    w = g.input("w", [20, 36])
    g.output("batched", g.matmul(x, g.input("y", [3, 20, 44])))
    g.output("epilogue", g.apply("fused_matmul", x, w, g.parameter("bias", [36]), g.input("res", [3, 68, 36]),
                                 activation="gelu", has_add=True, has_residual=True))
    g.output("residual", g.apply("fused_matmul", g.input("rx", [2, 80, 32]), g.input("rw", [32, 64]),
                                 g.parameter("rb", [64]), g.input("res2", [2, 80, 64]), has_add=True,
                                 has_residual=True))   # 160 rows: two whole 64-row tiles and an edge one
    g.output("long_k", g.matmul(g.input("p", [48, 3000]), g.input("q", [3000, 40])))
    g.output("aligned", g.matmul(g.input("r", [128, 96]), g.input("t", [96, 64])))      # no edge tiles
    cx = g.input("cx", [2, 20, 150])
    g.output("conv", g.conv1d(cx, g.input("cw", [70, 20, 3]), g.parameter("cb", [70]), stride=2, padding=1))
    return g


def _rounded_reference(g, inputs, params):
    """float64 reference with every matmul and convolution operand rounded to f16 first
    (what the cooperative kernel multiplies); biases and residuals stay f32."""
    f16_names = {n for n in inputs if not n.startswith("res")} | {"cw"}
    inputs = {k: _f16(v) if k in f16_names else v for k, v in inputs.items()}
    return reference.run(g, inputs, params, np.float64)


def _run_on_device(g, monkeypatch, configure, precision="f16"):
    """(session, inputs, params, float64 reference) of ``g`` run once on the device with
    MEGANEURA_PRECISION=``precision`` (f16: cooperative kernels where the device has them)."""
    configure(precision=precision)
    inputs, params = feeds(g)
    s = build_inference_session(g, optimize=False, capabilities=device_capabilities())
    s.set_inputs(inputs)
    s.set_parameters(params)
    s.run()
    return s, inputs, params, reference.run(g, inputs, params, np.float64)


def test_f32_precision_splits_products_onto_the_cooperative_units_where_offered(monkeypatch, configure):
    """MEGANEURA_PRECISION=f32 on a device with subgroup matrices: every product and
    convolution takes a split kernel (each operand as two f16 parts, both scaled, three
    products) and matches the exact reference to f32's order, not f16's (3e-4 here);
    without them (lavapipe) the f32 kernels."""
    g = _matmul_graph()
    s, inputs, params, exact = _run_on_device(g, monkeypatch, configure, precision="f32")
    variants = [d.variant for d in s.plan.dispatches if not d.kernel.endswith(":total")]
    if s.capabilities.matmul_split:
        assert all("f32 as 3 f16 products" in v and "A and B scaled" in v for v in variants), variants
    else:
        assert not any("cooperative" in v for v in variants), variants
    for name in g.outputs:
        assert rel_err(s.read_output(name), exact[name]) < 2e-5, (name, rel_err(s.read_output(name), exact[name]))


def test_f16_precision_runs_cooperative_kernels_where_offered_and_f32_elsewhere(monkeypatch, configure):
    """MEGANEURA_PRECISION=f16: on a device with subgroup matrices every product takes a
    cooperative kernel and matches the f16-rounded reference to f32 accuracy (and the
    exact one to f16's); without them (lavapipe) the plan keeps the f32 kernels and the
    f32 tolerance."""
    g = _matmul_graph()
    s, inputs, params, exact = _run_on_device(g, monkeypatch, configure)
    caps = s.capabilities
    variants = [d.variant for d in s.plan.dispatches if not d.kernel.endswith(":total")]
    if caps.matmul_f16:
        assert all("cooperative" in v for v in variants), variants
        rounded = _rounded_reference(g, inputs, params)
        for name in g.outputs:
            got = s.read_output(name)
            assert rel_err(got, rounded[name]) < 2e-5, (name, rel_err(got, rounded[name]))
            assert rel_err(got, exact[name]) < 5e-3, name
    else:
        assert not any("cooperative" in v for v in variants), variants
        for name in g.outputs:
            assert rel_err(s.read_output(name), exact[name]) < 1e-4, name


@pytest.mark.parametrize("variant", list(codegen.COOP))
def test_every_cooperative_tile_matches_the_rounded_reference(variant, monkeypatch, configure):
    """Each cooperative preset, forced (MEGANEURA_MATMUL), on products that cross tile
    edges on every layout, a batch, an epilogue, a split K and a convolution: the
    presets differ in subgroups, K step, buffers and scratch, and each has its own
    barriers and turns. Where the device lacks subgroup matrices (lavapipe) the force
    falls back to the f32 kernels, with their tolerance."""
    configure(matmul=variant)
    g = _matmul_graph()
    s, inputs, params, exact = _run_on_device(g, monkeypatch, configure)
    forced = [d.variant for d in s.plan.dispatches if not d.kernel.endswith(":total") and "matmul" in d.kernel]
    if s.capabilities.matmul_f16:
        tile = codegen.COOP[variant]
        assert all(v.startswith(f"{tile.bm}x{tile.bn} tile, cooperative") and f"BK {tile.bk}" in v
                   for v in forced), forced
        # a split preset's three products come within f32's reach of the exact ones
        want = exact if tile.split else _rounded_reference(g, inputs, params)
        for name in g.outputs:
            assert rel_err(s.read_output(name), want[name]) < 2e-5, (variant, name)
    else:
        assert not any("cooperative" in v for v in forced), forced
        for name in g.outputs:
            assert rel_err(s.read_output(name), exact[name]) < 1e-4, (variant, name)


def test_one_buffer_tiles_wait_for_the_products_before_restaging():
    """A preset of one buffer an operand has half the tile memory and a barrier between
    a step's last product and the stores of the next step's operands (which overwrite
    what the products read); a preset of two has no barrier there."""
    g = _matmul_graph()
    node = g[g.outputs["aligned"]]
    for variant, tile in codegen.COOP.items():
        source = codegen.kernel_for(g, node, dataclasses.replace(COOP_CAPS, knobs=Knobs(matmul=variant))).source
        loop = source[source.index("for (var k0"):]
        restage = loop.index("buf = buf ^ 1u")
        between = loop[loop.rindex("subgroupMatrixMultiplyAccumulate", 0, restage):restage]
        assert ("workgroupBarrier()" in between) == (tile.buffers == 1), variant
        assert ("const ABUF: u32 = 0u;" in source) == (tile.buffers == 1), variant
    assert {tile.buffers for tile in codegen.COOP.values()} == {1, 2}


def test_whole_tiles_start_from_the_residual():
    """A cooperative product adding a row-major residual after no activation starts its
    whole tiles' accumulators from it and skips it in their epilogue; with an activation
    before the residual, a K split (the finish adds it) or in f32, the epilogue adds it."""
    g = _matmul_graph()
    kernel = lambda name, caps=COOP_CAPS: codegen.kernel_for(g, g[g.outputs[name]], caps)  # noqa: E731
    source = kernel("residual").source
    assert "subgroupMatrixLoad<subgroup_matrix_result<f32, 16, 16>>(&residual_in" in source
    assert "if (!residual_in_acc)" in source
    assert "residual_in_acc" not in kernel("epilogue").source                      # gelu before the residual
    f32 = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=False)
    assert "residual_in_acc" not in kernel("residual", f32).source
    s = Graph("split-residual")
    s.output("y", s.apply("fused_matmul", s.input("x", [64, 4096]), s.input("w", [4096, 64]),
                          s.input("r", [64, 64]), has_residual=True))
    split = codegen.kernel_for(s, s[s.outputs["y"]], COOP_CAPS)
    assert split.finish is not None and "residual_in_acc" not in split.source


def test_products_write_four_columns_at_a_time_where_their_columns_allow():
    """Tiled products, cooperative or f32, whose N is a multiple of 4 bind their output as
    vec4s and write 4 columns at once (one write where there were four: run 40); N = 130
    and a strided convolution's input gradient (its columns mapped to input positions)
    write one at a time. Both kinds' results are checked against the references by the
    tests that run _matmul_graph and the class input gradients."""
    g = _matmul_graph()
    strided = g.apply("conv_input_grad", g.input("dy", [2, 8, 9]), g.input("wk", [8, 4, 3]), stride=(2,),
                      padding=(1,), input_shape=(2, 4, 17))
    f32 = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=False,
                               knobs=Knobs(matmul="64"))   # the f32 tiles (small products take matmul.wgsl)
    vec4_out = "var<storage, read_write> out: array<vec4<f32>>;"
    for caps in (COOP_CAPS, f32):
        source = lambda node: codegen.kernel_for(g, node, caps).source  # noqa: E731
        for name in ("c00132", "c11132", "batched", "epilogue", "residual", "aligned"):
            text = source(g[g.outputs[name]])
            assert vec4_out in text and "store4(b, wg.z" in text and "out[at] =" not in text, (name, caps)
        for node in (g[g.outputs["c0070"]], g[strided]):
            text = source(node)
            assert vec4_out not in text and "out[at] = epilogue(b, row, col, acc);" in text, (node.op, caps)


def test_cooperative_kernels_are_chosen_by_output_size_and_workgroup_memory():
    small = codegen.Capabilities(subgroups=True, workgroup_storage=16384, dialect="tint", matmul_f16=True)
    assert codegen.matmul_variant(4096, 4096, 1, 4096, caps=COOP_CAPS) == "c128"
    assert codegen.matmul_variant(2048, 768, 1, 384, caps=COOP_CAPS) == "c64l"        # 96 tiles of 128 x 128
    assert codegen.matmul_variant(1500, 384, 1, 1536, caps=COOP_CAPS) == "c64l"       # whisper's fc2: 3 slices of 512
    assert codegen.matmul_variant(2048, 384, 1, 1536, caps=COOP_CAPS) == "c64"        # gpt-tiny's fc2: K not split
    assert codegen.matmul_variant(384, 1536, 1, 12000, True, caps=COOP_CAPS) == "c96"    # its weight gradient at b8:
    # 7 slices of 1714 (wide_fill), 128 x 96 tiles filling two waves as 128 x 128 do
    assert codegen.matmul_variant(12000, 1536, 1, 384, caps=COOP_CAPS) == "c128l"     # its fc1 at b8: K short
    assert codegen.matmul_variant(12000, 384, 1, 1536, caps=COOP_CAPS) == "c96"       # its fc2 at b8: K long, and
    assert codegen.matmul_variant(12000, 384, 1, 1152, caps=COOP_CAPS) == "c96"       # 128 x 96 tiles fill 3 waves
    assert codegen.matmul_variant(12000, 400, 1, 1536, caps=COOP_CAPS) == "c128"      # N no multiple of 96
    assert codegen.matmul_variant(4096, 4096, 1, 4096, caps=COOP_CAPS) == "c128"      # 8 waves either way: 11 of 96
    assert codegen.matmul_variant(12000, 384, 1, 1536, caps=dataclasses.replace(COOP_CAPS, invocations=256)) \
        == "c128l"                                                                      # 384 threads over 256
    assert not codegen.narrow_tiles_fill_better(128 * 128, 128, 1)                   # 128 tiles: one wave, 171 two
    assert codegen.matmul_variant(8, 4096, 1, 4096, caps=COOP_CAPS) not in codegen.COOP   # thinner than a fragment
    assert codegen.matmul_variant(4096, 4096, 1, 4096, caps=small) == "c64l"          # the others over 16 KiB
    assert codegen.matmul_variant(4096, 4096, 1, 4096, caps=dataclasses.replace(small, workgroup_storage=8192)) \
        == "128k8u"
    narrow = dataclasses.replace(COOP_CAPS, invocations=256)
    assert codegen.matmul_variant(4096, 4096, 1, 4096, caps=narrow) == "c128l"        # 512 threads over 256
    assert codegen.matmul_variant(4096, 4096, 1, 4096) == "128k8u"                    # f32 precision
    assert all(codegen.coop_workgroup_bytes(v) <= 49152 for v in codegen.COOP)
    plain = codegen.Capabilities.from_features(["subgroup", "shader-f16", codegen.SUBGROUP_MATRIX_FEATURE],
                                               dialect="naga", precision="f16")
    assert not plain.matmul_f16                                   # naga (wgpu-native) cannot enable them
    dawn = codegen.Capabilities.from_features(["subgroups", "shader-f16", codegen.SUBGROUP_MATRIX_FEATURE],
                                              dialect="tint", precision="f16")
    assert dawn.matmul_f16 and dawn.subgroups
    assert not codegen.Capabilities.from_features(["subgroups", "shader-f16"], dialect="tint",
                                                  precision="f16").matmul_f16


def test_f32_on_cooperative_units_takes_the_split_tiles_and_f16_wins_where_both_are_asked():
    """``matmul_split`` (f32 on a device with subgroup matrices) takes the split tile that
    ran faster on the H100 for each product timed both ways (run 46: whisper's b8 products
    and 4096^3), falls back where the memory is short, and leaves products thinner than a
    fragment to the f32 kernels; with ``matmul_f16`` set too (offered_capabilities) the
    f16 tiles win."""
    split = dataclasses.replace(COOP_CAPS, matmul_f16=False, matmul_split=True)
    faster = {(12000, 1536, 1, 384): "c128x3", (12000, 1152, 1, 384): "c128x3", (4096, 4096, 1, 4096): "c128x3",
              (12000, 384, 1, 1536): "c64x3", (12000, 384, 1, 384): "c64x3", (384, 384, 1, 12000): "c64x3",
              (384, 1536, 1, 12000): "c128x3"}
    for shape, want in faster.items():
        assert codegen.matmul_variant(*shape, caps=split) == want, shape
        f16 = codegen.matmul_variant(*shape, caps=COOP_CAPS)
        assert codegen.matmul_variant(*shape, caps=dataclasses.replace(split, matmul_f16=True)) == f16
    # the tuned cost of a 64 x 64 split K step (16ths of a 128 x 128 one's) moves the choice
    costing = lambda c: dataclasses.replace(split, tuning=Tuning(split_small_cost=c))  # noqa: E731
    assert codegen.matmul_variant(12000, 1536, 1, 384, caps=costing(4)) == "c64x3"
    assert codegen.matmul_variant(384, 384, 1, 12000, caps=costing(16)) == "c128x3"
    assert codegen.matmul_variant(4096, 4096, 1, 4096, caps=dataclasses.replace(split, workgroup_storage=28672)) \
        == "c64x3"                                                                      # 32 KiB over 28
    assert codegen.matmul_variant(8, 4096, 1, 4096, caps=split) not in codegen.COOP
    assert codegen.coop_workgroup_bytes("c128x3") == 2 * codegen.coop_workgroup_bytes("c128l") - 8192  # one scratch


def test_split_operands_keep_21_bits():
    """The split kernels' arithmetic in numpy: hi is x rounded to f16's 10 mantissa bits
    on its bits (exact in f16), lo = f16(x - hi); hi hi + hi lo + lo hi, summed in float64,
    is within 2^-21 of x y where one f16 product is within 2^-10, for values of the
    magnitudes a scaled operand's largest ones take ([2^-3, 2^15): the scale puts a
    workgroup's largest in [2^11, 2^15); far smaller ones keep an absolute error of 2^-25)."""
    rng = np.random.default_rng(0)
    x, y = ((rng.choice([-1.0, 1.0], 100_000) * 2.0 ** rng.uniform(-3, 15, 100_000)).astype(np.float32)
            for _ in range(2))

    def parts(v):
        hi = ((v.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
        assert np.array_equal(hi.astype(np.float16).astype(np.float32), hi)
        return hi.astype(np.float16).astype(np.float64), (v - hi).astype(np.float16).astype(np.float64)

    (xh, xl), (yh, yl), exact = parts(x), parts(y), x.astype(np.float64) * y
    three = xh * yh + xh * yl + xl * yh
    one = x.astype(np.float16).astype(np.float64) * y.astype(np.float16)
    assert np.max(np.abs(three - exact) / np.abs(exact)) < 2.0 ** -20.9
    assert 2.0 ** -12 < np.max(np.abs(one - exact) / np.abs(exact)) < 2.0 ** -10


def test_long_convolution_weight_gradients_take_the_wide_tile():
    """A convolution's weight gradient gathers both operands, so where its K splits into
    long slices it takes the 128 x 128 tile (whisper's conv1 at batch 8: [384, 240] over
    K = 24000) where a product of that size takes 64 x 64; at batch 1 (slices of 272) it
    keeps 64 x 64, input gradients keep the matmul's rule, and f32 kernels are unchanged."""
    def variant(batch, op="conv_weight_grad", caps=COOP_CAPS):
        g = Graph("conv1")
        x, d = g.input("x", [batch, 80, 3000]), g.input("d", [batch, 384, 3000])
        if op == "conv_weight_grad":
            node = g.apply(op, x, d, stride=(1,), padding=(1,), kernel=(3,))
        else:
            node = g.apply(op, d, g.parameter("w", [384, 80, 3]), stride=(1,), padding=(1,),
                           input_shape=(batch, 80, 3000))
        return codegen.kernel_for(g, g[node], caps).notes["variant"]
    assert codegen.matmul_variant(384, 240, 1, 24000, caps=COOP_CAPS) == "c64"
    assert variant(8).startswith("implicit GEMM 384x240x24000, 128x128 tile, cooperative"), variant(8)
    assert "64x64 tile, cooperative" in variant(1), variant(1)
    assert "64x64 tile, cooperative" in variant(1, "conv_input_grad")             # loaded weights: the rule's
    assert "cooperative" not in variant(8, caps=codegen.Capabilities())


def test_training_plans_scale_the_gradient_operands():
    """Gradients leave f16's range where activations stay inside it (audio-align's first
    gradient norm is 7.8e21), so in a training plan every weight and input gradient's
    product scales its gradient operand into f16's range first, whatever the loss is
    called, and the forward's products scale nothing; an inference plan scales nothing."""
    from engine import models
    from engine.autodiff.gradients import differentiate
    from engine.compile.plan import compile_plan
    model = models.create("gpt-tiny", ["seq=32"])
    forward = model.build(train=True, batch=2)
    train, pairs = differentiate(forward, "loss")
    plan = compile_plan(train, dict(pairs), "loss", COOP_CAPS)
    kinds = {}
    for d in plan.dispatches:
        if d.kernel.startswith("matmul:") and not d.kernel.endswith(":total"):
            node = train[d.nodes[-1]]
            gradient = node.id not in codegen.forward_nodes(train)
            assert "cooperative" in d.variant, d.variant
            kinds.setdefault(gradient, set()).add("scaled" in d.variant)
    assert kinds == {False: {False}, True: {True}}, kinds
    g = Graph("named-loss")
    w = g.parameter("w", [64, 64])
    g.output("objective", g.mean(g.matmul(g.input("x", [64, 64]), w)))
    named, named_pairs = differentiate(g, "objective")
    named_plan = compile_plan(named, dict(named_pairs), "objective", COOP_CAPS)
    notes = sorted(d.variant for d in named_plan.dispatches
                   if d.kernel.startswith("matmul:") and not d.kernel.endswith(":total"))
    assert len(notes) == 2 and sum("B scaled" in v for v in notes) == 1, notes
    inference = model.build(train=False, batch=2)
    variants = {d.variant for d in compile_plan(inference, loss=None, capabilities=COOP_CAPS).dispatches
                if d.kernel.startswith("matmul:") and not d.kernel.endswith(":total")}
    assert variants and all("cooperative" in v and "scaled" not in v for v in variants), variants


def test_gradients_past_f16s_range_come_out_right(monkeypatch, configure):
    """A loss scaled by 1e20 gives gradients of about 1e17, far past f16's 65504: on a
    device with subgroup matrices the weight gradient's product scales its operand into
    range and matches the float64 reference to f16's precision; elsewhere the f32
    kernels match it to f32's."""
    from engine.autodiff.gradients import differentiate
    g = Graph("huge-gradients")
    x = g.input("x", [96, 64])
    w = g.parameter("w", [64, 48])
    y = g.matmul(x, w)
    g.output("loss", g.mean(g.mul(y, g.constant(np.full([96, 48], 1e20, np.float32), name="c"))))
    train, _ = differentiate(g, "loss")
    s, _, _, ref = _run_on_device(train, monkeypatch, configure)
    got = s.read_output("grad:w")
    assert np.isfinite(got).all() and np.abs(ref["grad:w"]).max() > 1e15
    assert any("scaled" in d.variant for d in s.plan.dispatches) == s.capabilities.matmul_f16
    assert rel_err(got, ref["grad:w"]) < (5e-3 if s.capabilities.matmul_f16 else 1e-4), rel_err(got, ref["grad:w"])


def test_scaled_products_keep_their_scales_in_a_state_buffer_of_their_own():
    """A product that scales a gradient binds, after its output, a buffer of its own (two
    words a workgroup: each operand's scale at the previous step), and has no scan of
    its operand before the K loop; unscaled products bind none."""
    from engine.autodiff.gradients import differentiate
    from engine.compile.plan import compile_plan
    g = Graph("state")
    w = g.parameter("w", [384, 256])
    g.output("loss", g.mean(g.matmul(g.input("x", [1000, 384]), w)))
    train, pairs = differentiate(g, "loss")
    plan = compile_plan(train, dict(pairs), "loss", COOP_CAPS)
    products = [d for d in plan.dispatches if d.kernel.startswith("matmul:") and not d.kernel.endswith(":total")]
    assert {"scaled" in d.variant for d in products} == {True, False}
    for d in products:
        last = plan.buffers[d.bindings[-1].buffer]
        source = plan.kernels[d.key].source
        if "scaled" in d.variant:
            workgroups = d.workgroups[0] * d.workgroups[1] * d.workgroups[2]
            assert last.kind == "kernel_state" and last.nbytes >= 8 * workgroups and d.bindings[-1].access == "read_write"
            assert "scale_state" in source and "for (var kb = kbeg; kb < kend" not in source
        else:
            assert last.kind != "kernel_state" and "scale_state" not in source
    states = [b for b in plan.buffers if b.kind == "kernel_state"]
    assert len(states) == len({b.id for b in states}) == sum("scaled" in d.variant for d in products)


def _workgroup_bytes(source: str) -> int:
    """Bytes of the workgroup variables a WGSL source declares: arrays of 2- and 4-byte
    scalars (or vectors of them) whose lengths may use the source's u32 constants, and scalars."""
    import re
    number = lambda text: re.sub(r"\b(\d+)u\b", r"\1", text)   # noqa: E731
    consts = {}
    for name, value in re.findall(r"const (\w+): u32 = ([^;]+);", source):
        consts[name] = eval(number(value), {}, dict(consts))
    size = {"f16": 2, "f32": 4, "u32": 4, "i32": 4}
    total = 0
    for kind, count in re.findall(r"var<workgroup>\s+\w+\s*:\s*(?:array<)?(vec\d<\w+>|\w+)(?:,\s*([^>]+))?>?;", source):
        vec = re.match(r"vec(\d)<(\w+)>", kind)
        element = int(vec.group(1)) * size[vec.group(2)] if vec else size[kind]
        total += element * (eval(number(count), {}, dict(consts)) if count else 1)
    return total


def test_cooperative_training_kernels_fit_the_workgroup_memory_they_were_given():
    """Every kernel of whisper-tiny's and gpt-tiny's training plans compiled for 48 KiB of
    workgroup memory declares at most that much (pipelines over it fail to build: the
    scale state's two words once made a product 49184 bytes)."""
    from engine import models
    from engine.autodiff.gradients import differentiate
    from engine.compile.plan import compile_plan
    from engine.optimize import optimize
    for name, batch in (("whisper-tiny", 8), ("gpt-tiny", 8)):
        model = models.create(name)
        train, pairs = differentiate(optimize(model.build(train=True, batch=batch))[0], "loss")
        plan = compile_plan(optimize(train)[0], dict(pairs), "loss", COOP_CAPS)
        sizes = {(k.name, "scale_state" in k.source, "128 x 128" in k.source): _workgroup_bytes(k.source)
                 for k in plan.kernels.values()}
        assert any(scaled and wide for _, scaled, wide in sizes), sizes   # a scaled 128 x 128 product among them
        assert all(v <= 49152 for v in sizes.values()), sizes


def test_scaled_products_are_right_whatever_scale_the_step_before_left(monkeypatch, configure):
    """The scaled product runs its K loop with the scale its workgroup took the step before
    and again where the operand asks for another: gradients whose range moves by 2^30
    between steps, up and down, in some workgroups' rows and not others', come out as the
    reference has them each time, and equal to what a fresh session (no scales kept)
    computes from the same operands, bit for bit."""
    from engine.autodiff.gradients import differentiate
    g = Graph("moving-gradients")
    x = g.parameter("x", [300, 64])
    w = g.parameter("w", [64, 200])
    y = g.matmul(x, w)
    g.output("loss", g.mean(g.mul(y, g.input("c", [300, 200]))))
    train, _ = differentiate(g, "loss")
    configure(precision="f16")
    inputs, params = feeds(train)
    session = build_inference_session(train, optimize=False, capabilities=device_capabilities())
    session.set_parameters(params)
    rows = np.arange(300)[:, None]
    for scale in (1.0, 2.0 ** 30, 2.0 ** -30, 3.0):
        c = inputs["c"] * np.where(rows < 150, scale, 1.0).astype(np.float32)
        feed = dict(inputs, c=c)
        session.set_inputs(feed)
        session.run()
        got = {k: session.read_output(k) for k in ("grad:w", "grad:x")}
        ref = reference.run(train, feed, params, np.float64)
        fresh = build_inference_session(train, optimize=False, capabilities=device_capabilities())
        fresh.set_parameters(params)
        fresh.set_inputs(feed)
        fresh.run()
        for k, value in got.items():
            assert rel_err(value, ref[k]) < (5e-3 if session.capabilities.matmul_f16 else 1e-4), (scale, k)
            np.testing.assert_array_equal(value, fresh.read_output(k), err_msg=f"{k} at scale {scale}")


def test_bad_precision_and_backend_names_are_clear_errors():
    from engine.config import Config, ConfigError
    with pytest.raises(ConfigError, match="MEGANEURA_PRECISION='bf16' is not one of f32, f16"):
        Config.from_env({"MEGANEURA_PRECISION": "bf16"})
    with pytest.raises(ConfigError, match="MEGANEURA_WGPU='metal' is not one of native, dawn"):
        Config.from_env({"MEGANEURA_WGPU": "metal"})


TINT_CHECK = """
    from engine import models
    from engine.autodiff import differentiate
    from engine.compile import OptimizerSpec, compile_plan
    from engine.optimize import optimize
    from engine.train import TrainConfig
    capabilities = [codegen.Capabilities(subgroups=s, workgroup_storage=w, dialect="tint", matmul_f16=f,
                                          matmul_split=x, invocations=1024)
                    for s, w, f, x in ((True, 49152, True, False), (True, 49152, False, True),
                                       (True, 49152, False, False), (False, 32768, False, False))]
    for name in models.names():
        model = models.create(name, ["mel_len=200"] if name in ("whisper-tiny", "audio-align") else [])
        for train in (False, True):
            graph, _ = optimize(model.build(train=train, batch=2))
            forward, gradients, optimizers = graph, None, [None]
            if train:
                graph, pairs = differentiate(graph, "loss")
                graph, _ = optimize(graph)
                gradients = dict(pairs)
                optimizers = [OptimizerSpec.from_config(TrainConfig(optimizer=o, clip_norm=c), forward, list(gradients))
                              for o, c in (("sgd", None), ("adamw", 1.0))]
            for caps in capabilities:
                for spec in optimizers:
                    plan = compile_plan(graph, gradients, "loss" if train else None, caps, spec)
                    for kernel in plan.kernels.values():
                        check(name, kernel)
    # the ONNX importer's ops, which no built-in model uses: one graph of each kind
    from engine import Graph
    g = Graph("onnx-ops")
    x, w = g.input("x", [2, 4, 9, 10]), g.input("w", [6, 2, 3, 3])
    conv = dict(stride=(2, 1), pads=(1, 0, 0, 1), dilation=(1, 2), groups=2)
    y = g.apply("conv_general", x, w, g.input("b", [6]), **conv)
    d = g.input("d", g.shape(y))
    g.output("dx", g.apply("conv_general_input_grad", d, w, input_shape=(2, 4, 9, 10), **conv))
    g.output("dw", g.apply("conv_general_weight_grad", x, d, kernel=(3, 3), **conv))
    pool = dict(kernel=(3, 2), stride=(2, 2), pads=(1, 0, 1, 1), dilation=(1, 1), ceil_mode=True)
    mp = g.apply("max_pool", x, **pool)
    g.output("ap", g.apply("avg_pool", x, count_include_pad=True, **pool))
    g.output("mpg", g.apply("max_pool_grad", g.input("dm", g.shape(mp)), x, **pool))
    e = x
    for op in ("erf", "softplus", "floor", "ceil", "sign", "logical_not", "leaky_relu"):
        e = g.apply(op, e)
    e = g.apply("where", g.apply("less", e, x), g.apply("maximum", e, x), g.apply("power", x, e))
    g.output("e", g.apply("minimum", e, g.apply("cast", g.apply("cast", x, dtype="i32"), dtype="f32")))
    for caps in capabilities:
        for node in g.nodes:
            if node.op not in ("input", "parameter", "constant"):
                check("onnx-ops", codegen.kernel_for(g, node, caps))
"""


def test_every_generated_kernel_passes_tint():
    """Every kernel of every built-in model (inference and training; subgroups on and
    off; cooperative matmuls on and off) is valid WGSL for Tint, Dawn's compiler, which
    is stricter than naga (reserved words such as `meta`, literals that round past
    f32's range or fold to inf, `enable subgroups;`). The optimizer's kernels (SGD,
    AdamW with clipping) are among them."""
    kernels, coop = tint_check(TINT_CHECK)
    assert kernels > 80 and coop >= 5, (kernels, coop)


def test_every_cooperative_preset_passes_tint():
    """Every preset, forced, on every product and convolution of ``_matmul_graph``: the
    rule picks only some of them for the models, and a forced one must still compile."""
    kernels, coop = tint_check("""
        import dataclasses
        from engine.config import Knobs
        from test_coop_matmul import COOP_CAPS, _matmul_graph
        g = _matmul_graph()
        for variant in codegen.COOP:
            caps = dataclasses.replace(COOP_CAPS, knobs=Knobs(matmul=variant))
            for name, node in g.outputs.items():
                check(f"{variant} {name}", codegen.kernel_for(g, g[node], caps))
    """)
    assert coop >= 10 * len(codegen.COOP), (kernels, coop)
