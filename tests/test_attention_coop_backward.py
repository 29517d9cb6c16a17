"""The attention backward on cooperative matrices (attention_coop_backward.wgsl: dq, and dk
with dv, from f16 fragments accumulating in f32, dO and dS scaled by powers of two into
f16's range).

As for the forward (test_attention_coop.py): CI's lavapipe cannot enable subgroup
matrices, so there the kernels must pass Tint's front end (Dawn's Null backend) and
``MEGANEURA_PRECISION=f16`` must keep the f32 kernels with their tolerance; on a device
that has them (the H100 through ``MEGANEURA_WGPU=dawn``) the same numerics test runs the
cooperative kernels against a float64 reference.
"""

import dataclasses

import numpy as np
import pytest

from engine import Graph, codegen, models
from engine.codegen import attention_coop_backward
from engine.compile.cache import cached_training_graph
from engine.compile.plan import compile_plan
from engine.codegen import Tuning
from engine.config import Config, ConfigError, Knobs
from engine.graph import reference
from engine.graph.ops import attention_grad_kv_layout
from engine.runtime.device import device_capabilities
from engine.runtime.dispatches import _graph_dispatch
from engine.runtime.session import build_inference_session

from test_attention_backward import attention_attrs, with_row_stats
from test_runtime import TOL, rel_err
from tint_check import tint_check

COOP_CAPS = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=True,
                                 invocations=1024)
F32_CAPS = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=False)
GRAD_OPS = ("attention_grad_q", "attention_grad_kv")


def grad_graph(batch, t, s, heads, kv_heads, d, causal=False, scale=None, between=False):
    """attention_grad_q and attention_grad_kv on inputs q, k, v, dout, lse, delta; outputs
    dq and dk, dv (``part`` views of the packed result); ``between``: and dq + dq, made
    before attention_grad_kv."""
    attrs = attention_attrs(heads, kv_heads, causal, scale)
    g = Graph("attention-grad")
    shapes = {"q": [batch, t, heads * d], "k": [batch, s, kv_heads * d], "v": [batch, s, kv_heads * d],
              "dout": [batch, t, heads * d]}
    q, k, v, dout = (g.input(n, shape) for n, shape in shapes.items())
    lse, delta = g.input("lse", [batch, t, heads]), g.input("delta", [batch, t, heads])
    g.output("dq", g.apply("attention_grad_q", q, k, v, dout, lse, delta, **attrs))
    if between:
        g.output("dq2", g.apply("add", g.outputs["dq"], g.outputs["dq"]))
    kv = g.apply("attention_grad_kv", q, k, v, dout, lse, delta, **attrs)
    for name, at in zip(("dk", "dv"), attention_grad_kv_layout(g.shape(k))[0]):
        g.output(name, g.apply("part", kv, offset=at, shape=g.shape(k)))
    return g, attrs


def _variants(caps, *shape, causal=False):
    g, _ = grad_graph(*shape, causal=causal)
    return [codegen.kernel_for(g, n, caps).notes["variant"] for n in g.nodes if n.op in GRAD_OPS]


def test_cooperative_backward_follows_the_forward():
    """f16 capabilities take the cooperative dq and dkdv for whole fragments up to D = 64
    in 24 KiB; f32 ones, other head dims, the per-query and f32-backward knobs and small
    workgroup memories keep the f32 kernels (attention_lse always does)."""
    for d in (16, 32, 48, 64):
        assert all(v.startswith("cooperative backward") for v in _variants(COOP_CAPS, 2, 70, 130, 6, 2, d)), d
        assert codegen.attention_coop_backward.coop_backward_bytes(d) <= 24576   # two a SM on the H100 (run 37)
    assert all(v.startswith("cooperative backward") for v in _variants(COOP_CAPS, 8, 1500, 1500, 6, 6, 64, causal=True))
    tiled = lambda variants: all(v.startswith("tiled backward") for v in variants)  # noqa: E731
    assert tiled(_variants(F32_CAPS, 2, 70, 130, 6, 2, 64))
    assert tiled(_variants(COOP_CAPS, 1, 40, 40, 2, 2, 36))                          # not whole fragments
    for knobs in (Knobs(attention="per-query"), Knobs(attention_backward="f32")):
        caps = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=True,
                                    knobs=knobs)
        assert tiled(_variants(caps, 1, 40, 40, 2, 2, 64)), knobs
    need = codegen.attention_coop_backward.coop_backward_bytes(64)
    small = codegen.Capabilities(subgroups=True, workgroup_storage=need - 4, dialect="tint", matmul_f16=True)
    assert tiled(_variants(small, 1, 40, 40, 2, 2, 64))                               # 4 bytes short of its 23 KiB
    g, _ = grad_graph(1, 40, 40, 2, 2, 64)
    lse = g.apply("attention_lse", g.inputs["q"], g.inputs["k"], **attention_attrs(2, 2, False, None))
    assert codegen.kernel_for(g, g[lse], COOP_CAPS).notes["variant"].startswith("tiled backward")


def test_the_backward_streams_blocks_of_32_rows_where_its_grid_fills_the_gpu():
    """Blocks of 32 streamed rows (two workgroups an SM) where the grid has at least one
    workgroup an SM (the tuning's full attention grid / 6) and dq streams at least the
    tuning's ``dq_long_stream`` keys (512 by default), else of 64 where they fit."""
    rule = codegen.attention_coop_backward.backward_streamed
    assert rule(24 * 6 * 8, 64, COOP_CAPS) == 32                  # whisper-tiny's dk/dv at batch 8
    assert rule(24 * 6 * 8, 64, COOP_CAPS, dq_keys=1500) == 32    # and its dq
    assert rule(24 * 6, 64, COOP_CAPS) == 32                      # at batch 1: 144 of 128
    assert rule(4 * 6 * 8, 64, COOP_CAPS, dq_keys=256) == 64      # gpt-tiny's dq: a short stream
    assert rule(4 * 3 * 4, 64, COOP_CAPS) == 64                   # the SmolLM2-shaped Llama's dk/dv at 4 x 256
    assert rule(127, 64, COOP_CAPS) == 64 and rule(128, 64, COOP_CAPS) == 32
    assert rule(128, 64, COOP_CAPS, dq_keys=511) == 64 and rule(128, 64, COOP_CAPS, dq_keys=512) == 32
    tuned = dataclasses.replace(COOP_CAPS, tuning=Tuning(dq_long_stream=256))      # meganeura tune's number
    assert rule(4 * 6 * 8, 64, tuned, dq_keys=256) == 32 and rule(4 * 6 * 8, 64, tuned, dq_keys=255) == 64
    wide = codegen.attention_coop_backward.coop_backward_bytes(64, 64)
    assert rule(48, 64, dataclasses.replace(COOP_CAPS, workgroup_storage=wide - 4)) == 32   # 64 do not fit
    block = lambda variants: [v.split("streamed ")[1].split(" ")[0] for v in variants]  # noqa: E731
    assert block(_variants(COOP_CAPS, 4, 256, 256, 9, 3, 64, causal=True)) == ["64", "64"]   # dq 144, dk/dv 48
    assert block(_variants(COOP_CAPS, 8, 1500, 1500, 6, 6, 64)) == ["32", "32"]
    forced = dataclasses.replace(COOP_CAPS, knobs=Config.from_env({"MEGANEURA_ATTENTION_BACKWARD_BLOCK": "32"}).knobs)
    assert block(_variants(forced, 4, 256, 256, 9, 3, 64, causal=True)) == ["32", "32"]
    with pytest.raises(ConfigError, match="MEGANEURA_ATTENTION_BACKWARD_BLOCK='48' is not one of 32, 64"):
        Config.from_env({"MEGANEURA_ATTENTION_BACKWARD_BLOCK": "48"})


def test_split_products_stream_blocks_of_16_rows_two_workgroups_an_sm():
    """f32 as split products (37.3 KiB at D = 64 in blocks of 32: one workgroup an SM)
    streams 16 rows a block where each thread stages whole vec4s (D = 32, 64): 20,128 bytes
    at D = 64, two an SM of the H100; D = 16 and 48 keep 32."""
    split = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_split=True)
    rule = codegen.attention_coop_backward.backward_streamed
    assert [rule(24 * 6 * 8, d, split) for d in (16, 32, 48, 64)] == [32, 16, 32, 16]
    assert codegen.attention_coop_backward.coop_backward_bytes(64, 16, split=True) == 20128 <= 24576
    block = lambda variants: [v.split("streamed ")[1].split(" ")[0] for v in variants]  # noqa: E731
    assert block(_variants(split, 8, 1500, 1500, 6, 6, 64)) == ["16", "16"]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("streamed", [16, 32, 64])
@pytest.mark.parametrize("mode", [0, 1])
def test_the_results_leave_through_the_scratch_within_its_rows(mode, streamed, split):
    """dq, dk and dv leave through each subgroup's scratch, whose rows hold ``streamed``
    columns: no round stores a fragment past its row's end (blocks of 16 take one fragment
    a round; two, as in blocks of 32, wrote over the next row's first columns and gave
    dk and dv errors of order 1 on the H100), and every fragment of every result leaves."""
    import re
    subs = codegen.attention_coop_backward._subs(64, mode, streamed, split=split)
    offsets = [int(x) for x in re.findall(r"subgroupMatrixStore\(&Sc, sb \+ (\d+)u, subgroupMatrixScalarMultiply",
                                          subs["STORE"])]
    assert offsets and max(offsets) + 16 <= min(streamed, codegen.attention_coop.scratch_row(streamed))
    assert len(offsets) == 4 * (1 + mode)    # D / 16 fragments of dq or dk, and of dv


TINT_CHECK = """
    import dataclasses
    from engine.codegen import Tuning
    from engine.config import Knobs
    from test_attention_coop_backward import BLOCKS, GRAD_OPS, grad_graph
    for block in BLOCKS:
        caps = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=True,
                                    knobs=Knobs(attention_backward_block=block))
        for d in (32, 64):
            for causal in (False, True):
                g, _ = grad_graph(1, 70, 130, 6, 2, d, causal=causal)
                for node in [n for n in g.nodes if n.op in GRAD_OPS]:
                    check(f"blocks of {block} D={d} causal={causal}", codegen.kernel_for(g, node, caps))
        for d in (16, 48, 64):   # dkdv writing dS, and dq as its product (fetching 1 to 4 blocks ahead)
            g, _ = grad_graph(1, 70, 130, 6, 2, d)
            kv, q = (next(n for n in g.nodes if n.op == op) for op in ("attention_grad_kv", "attention_grad_q"))
            for ahead in (1, 2, 3, 4):
                tuned = dataclasses.replace(caps, tuning=Tuning(dq_prefetch=ahead))
                for kernel in codegen.scores_pair(g, kv, q, tuned)[:2]:
                    check(f"scores, blocks of {block} D={d}, {ahead} ahead", kernel)
        g, _ = grad_graph(1, 70, 4200, 2, 2, 32)   # dq's factors read as it stages, not staged once
        kv, q = (next(n for n in g.nodes if n.op == op) for op in ("attention_grad_kv", "attention_grad_q"))
        check(f"scores of 4,200 keys, blocks of {block}", codegen.scores_pair(g, kv, q, caps)[1])
    split = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_split=True)
    for d in (16, 32, 48, 64):   # f32 as split products: blocks of 32; dq its own kernel, and the product
        g, _ = grad_graph(1, 70, 130, 6, 2, d)
        for node in [n for n in g.nodes if n.op in GRAD_OPS]:
            check(f"split products D={d}", codegen.kernel_for(g, node, split))
        kv, q = (next(n for n in g.nodes if n.op == op) for op in ("attention_grad_kv", "attention_grad_q"))
        for ahead in (1, 2):
            tuned = dataclasses.replace(split, tuning=Tuning(dq_prefetch=ahead))
            for kernel in codegen.scores_pair(g, kv, q, tuned)[:2]:
                check(f"split scores D={d}, {ahead} ahead", kernel)
    g, _ = grad_graph(1, 70, 4200, 2, 2, 32)   # the split product's factors read as it stages
    kv, q = (next(n for n in g.nodes if n.op == op) for op in ("attention_grad_kv", "attention_grad_q"))
    check("split scores of 4,200 keys", codegen.scores_pair(g, kv, q, split)[1])
"""


def test_every_cooperative_backward_kernel_passes_tint():
    """dq and dkdv in blocks of 32 and 64 streamed rows at D = 32 and 64, grouped-query,
    causal or not (causality is a meta word: one source each), and dkdv writing dS with dq
    as its product (fetching 1 to 4 blocks ahead) at D = 16, 48 and 64, and that product over
    4,200 keys (its factors read as it stages), and dq and dkdv as split products (f32)
    at D = 16, 32, 48 and 64, on their own and as dkdv writing dS's two parts with dq as
    their product (1 and 2 blocks ahead; over 4,200 keys), are valid WGSL for Tint."""
    assert tint_check(TINT_CHECK) == (48, 48)


def test_the_dq_product_stages_its_factors_once_where_they_fit():
    """A factor for each 16 keys and 32 queries, in whole rounds of the workgroup's 128
    threads, worked out before the blocks up to DQ_FACTORS slots (4,096 keys); past that,
    read as each element is staged."""
    from engine.codegen.attention_coop_backward import DQ_FACTORS, dq_factors
    assert dq_factors(1500, 128) == 256 and dq_factors(130, 128) == 128 and dq_factors(4096, 128) == DQ_FACTORS
    assert dq_factors(4097, 128) == 0
    for keys, staged in ((1500, True), (4200, False)):
        g, _ = grad_graph(1, 70, keys, 2, 2, 32)
        kv, q = (next(n for n in g.nodes if n.op == op) for op in ("attention_grad_kv", "attention_grad_q"))
        kernel = codegen.scores_pair(g, kv, q, BIG_BINDINGS)[1]
        assert ("its factors staged once" in kernel.notes["variant"]) == staged
        assert ("fs[i] = select(" in kernel.source) == staged
        assert ("cs[qb * (QG / 16u)] / scale_of(" in kernel.source) == (not staged)


def test_the_dq_product_fetches_as_many_blocks_ahead_as_the_tuning_says():
    """``tuning.dq_prefetch`` (``meganeura tune`` measures it; 2 by default: run 42) sets of
    registers, each staged once a loop: at least 1 and at most 4."""
    g, _ = grad_graph(1, 130, 130, 6, 2, 64)
    kv, q = (next(n for n in g.nodes if n.op == op) for op in ("attention_grad_kv", "attention_grad_q"))
    for tuned, ahead in ((Tuning(), 2), (Tuning(dq_prefetch=1), 1), (Tuning(dq_prefetch=3), 3),
                         (Tuning(dq_prefetch=9), 4)):
        kernel = codegen.scores_pair(g, kv, q, dataclasses.replace(COOP_CAPS, tuning=tuned))[1]
        assert kernel.source.count("put_k(tid + 0u,") == ahead, tuned
        assert f"fetched {ahead} block{'s' * (ahead > 1)} ahead" in kernel.notes["variant"]


BIG_BINDINGS = dataclasses.replace(COOP_CAPS, storage_binding=1 << 31)


def _scored_plan(caps, *shape, causal=False, between=False):
    """grad_graph (dq before dkdv, as it builds them; ``between``: a node reading dq before
    dkdv runs), its plan and the plan's attention dispatches."""
    g, _ = grad_graph(*shape, causal=causal, between=between)
    plan = compile_plan(g, None, None, caps)
    return g, plan, [d for d in plan.dispatches if d.archetype == "attention"]


def test_dq_is_the_product_of_the_ds_dkdv_writes_where_the_scores_fit():
    """Where both backward kernels are cooperative, dkdv binds a pooled scratch after its
    output (written: read-write) and dq, moved after it, binds k, that scratch (read) and
    its output: whisper-tiny's encoder at batch 8 needs 224,649,216 bytes of scores (dS^T
    as f16 pairs, 1,536 queries a row, then a scale for each 16 keys and 32 queries). Not
    where the scores pass the device's largest binding (WebGPU's least: 128 MiB), under
    ``attention_dq="kernel"``, on f32 kernels, or where something reads dq before dkdv."""
    rows = 8 * 6 * 1500 * 192   # vec4s: 1,536 queries of halves a key row
    assert attention_coop_backward.scores_layout(8, 1500, 1500, 6) == (rows, rows + 8 * 6 * 94 * 48)
    assert 16 * attention_coop_backward.scores_layout(8, 1500, 1500, 6)[1] == 224_649_216
    # split products (f32): dS's lo parts after its hi parts, the scales after both, one a 16 queries
    assert attention_coop_backward.scores_layout(8, 1500, 1500, 6, True) == (2 * rows, 2 * rows + 8 * 6 * 94 * 96)
    g, plan, (kv, q) = _scored_plan(BIG_BINDINGS, 8, 1500, 1500, 6, 6, 64)
    assert kv.kernel.startswith("attention_grad_kv") and kv.variant.endswith("writes dS for dq's product")
    assert q.variant.startswith("cooperative dq as the product dS K")
    scores = kv.bindings[-1]
    assert (scores.size, scores.access) == (224_649_216, "read_write")
    assert [(b.buffer, b.access) for b in q.bindings] == [(kv.bindings[1].buffer, "read"), (scores.buffer, "read"),
                                                         (q.bindings[2].buffer, "read_write")]
    assert plan.buffers[scores.buffer].kind == "intermediate"
    kv_info, q_info = (_graph_dispatch(g, d) for d in (kv, q))   # the profiler's accounting
    assert q_info.flops == 2 * 8 * 6 * 1500 * 1500 * 64                       # one product, no softmax
    assert q_info.bytes == 18_432_000 + 224_649_216 + 18_432_000              # k, the scores, dq
    assert kv_info.bytes == 4 * 18_432_000 + 2 * 288_000 + 36_864_000 + 224_649_216
    for caps, shape in ((COOP_CAPS, (8, 1500, 1500, 6, 6, 64)),                       # 214 MiB > 128 MiB
                        (dataclasses.replace(BIG_BINDINGS, knobs=Knobs(attention_dq="kernel")),
                         (1, 130, 130, 6, 2, 64)),
                        (F32_CAPS, (1, 130, 130, 6, 2, 64))):
        *_, dispatches = _scored_plan(caps, *shape)
        assert not any("dS" in d.variant.split("scaled")[-1] for d in dispatches), (caps, shape)
    *_, dispatches = _scored_plan(BIG_BINDINGS, 1, 130, 130, 6, 2, 64, between=True)
    assert [d.kernel.split(":")[0] for d in dispatches] == ["attention_grad_q", "attention_grad_kv"]
    assert not any("dS K" in d.variant for d in dispatches)
    assert Config.from_env({"MEGANEURA_ATTENTION_DQ": "kernel"}).knobs.attention_dq == "kernel"
    with pytest.raises(ConfigError, match="MEGANEURA_ATTENTION_DQ='scores' is not one of auto, kernel"):
        Config.from_env({"MEGANEURA_ATTENTION_DQ": "scores"})
    *_, dispatches = _scored_plan(COOP_CAPS, 1, 130, 130, 6, 2, 64, causal=True)   # grouped, causal: taken
    assert [d.kernel.split(":")[0] for d in dispatches] == ["attention_grad_kv", "attention_grad_q"]
    assert dispatches[1].variant.startswith("cooperative dq as the product")


def test_plans_know_the_largest_binding_of_their_device():
    """device_capabilities carries the device's max_storage_buffer_binding_size, which
    decides whether the scores fit (the H100 through Dawn: 2,147,483,644 bytes)."""
    from engine.runtime.device import _limit, get_device
    assert device_capabilities().storage_binding == _limit(get_device().limits, "max_storage_buffer_binding_size")
    assert codegen.Capabilities.from_features([], storage_binding=1 << 30).storage_binding == 1 << 30
    assert codegen.Capabilities.from_features([]).storage_binding == 1 << 27


def test_no_dispatch_between_dkdv_and_dq_touches_their_scores():
    """The scores' pooled buffer stays out of the pool from dkdv to dq in whisper-tiny's
    training plan (the four encoder layers); another tensor may take it after."""
    model = models.create("whisper-tiny", ["mel_len=256", "batch=2"])
    train, pairs, *_ = cached_training_graph(model.build(train=True), "loss")
    plan = compile_plan(train, dict(pairs), "loss", BIG_BINDINGS)
    kvs = [d for d in plan.dispatches if d.variant.endswith("writes dS for dq's product")]
    assert len(kvs) == 4
    for kv in kvs:
        scores = kv.bindings[-1].buffer
        q = next(d for d in plan.dispatches[kv.index + 1:] if scores in d.reads)
        assert q.variant.startswith("cooperative dq as the product"), q.name
        assert q.name.split(":")[0] == kv.name.split(":")[0]
        assert not any(scores in d.reads + d.writes for d in plan.dispatches[kv.index + 1:q.index])


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def _f16_relative(x):
    """x rounded to f16's 11 significant bits at its own magnitude: f16 after the power of
    two that puts its largest |value| in [2^14, 2^15), undone. The kernels scale dO by such
    powers (per workgroup or block: no less), so they round these values exactly."""
    e = np.floor(np.log2(np.abs(x).max()))
    return _f16(x * 2.0 ** (14 - e)) * 2.0 ** (e - 14)


CASES = {
    # name: (batch, T, S, heads, kv heads, D, causal, scale), dO's magnitude
    "gqa-causal": ((1, 130, 130, 6, 2, 64, True, None), 1.0),
    "cross-ragged-queries": ((2, 70, 200, 4, 2, 32, False, 0.3), 1.0),
    "causal-fewer-keys": ((1, 150, 70, 2, 1, 32, True, None), 1.0),
    "head-dim-16": ((2, 70, 100, 2, 2, 16, False, None), 1.0),
    "head-dim-48": ((1, 100, 90, 3, 3, 48, False, None), 1.0),
    "large-dout": ((1, 130, 130, 6, 2, 64, True, None), 1e4),
    "tiny-dout": ((1, 130, 130, 6, 2, 64, True, None), 1e-6),
    # dO from 1e-4 to 1e4 along the queries: each block of dkdv's streamed queries, and
    # dq's dS, lowers the scale the result fragments hold
    "dout-spanning": ((1, 130, 130, 6, 2, 64, False, None), np.logspace(-4.0, 4.0, 130)[None, :, None]),
    "dout-shrinking": ((1, 130, 130, 6, 2, 64, False, None), np.logspace(4.0, -4.0, 130)[None, :, None]),
    # keys past DQ_FACTORS' 4,096: dq's product reads each factor as it stages an element
    "long-keys": ((1, 70, 4200, 2, 2, 32, False, None), np.logspace(-3.0, 3.0, 70)[None, :, None]),
}


def grad_inputs(shape, magnitude, seed=0):
    """f16-representable q, k, v, dO (dO at ``magnitude``, as ``_f16_relative``) and their
    float64 lse and Delta, rounded to f32."""
    batch, t, s, heads, kv_heads, d, causal, scale = shape
    rng = np.random.default_rng(seed)
    x = {"q": _f16(rng.standard_normal((batch, t, heads * d))),
         "k": _f16(rng.standard_normal((batch, s, kv_heads * d))),
         "v": _f16(rng.standard_normal((batch, s, kv_heads * d))),
         "dout": _f16_relative(rng.standard_normal((batch, t, heads * d)) * magnitude)}
    return with_row_stats(x, attention_attrs(heads, kv_heads, bool(causal), scale))


BLOCKS = (32, 64)   # streamed rows a block of the cooperative kernels (backward_streamed)


def measure(case, block=32, dq="auto"):
    """(errors of dq, dk, dv against the float64 reference, the grad kernels' variants),
    the cooperative kernels in blocks of ``block`` streamed rows, dq as the knob
    ``attention_dq`` says ("auto": the product of dkdv's dS, "kernel": its own kernel)."""
    shape, magnitude = CASES[case]
    g, _ = grad_graph(*shape[:6], causal=bool(shape[6]), scale=shape[7])
    inputs = grad_inputs(shape, magnitude)
    caps = device_capabilities()
    caps = dataclasses.replace(caps, knobs=dataclasses.replace(caps.knobs, attention_backward_block=block,
                                                               attention_dq=dq))
    s = build_inference_session(g, optimize=False, capabilities=caps)
    s.set_inputs(inputs)
    s.run()
    want = reference.run(g, inputs, {}, np.float64)
    errors = {n: rel_err(s.read_output(n), want[n]) for n in ("dq", "dk", "dv")}
    variants = [d.variant for d in s.plan.dispatches if d.archetype == "attention"]
    return errors, variants, s.capabilities.matmul_f16


@pytest.mark.parametrize("dq", ("auto", "kernel"))
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("case", CASES)
def test_f16_backward_matches_the_reference(case, block, dq, configure):
    """On a device with subgroup matrices the cooperative kernels (in blocks of 32 and of
    64 streamed rows; dq as the product of the dS that dkdv writes, and as its own kernel)
    match the float64
    reference of f16-representable q, k, v, dO to 1e-3 of each result's largest value
    (3.7e-4 at most on the H100): scores and dP are f32 sums of exact products, and
    beyond the reference they round only P (for dV) and dS to f16 (at most 2^-11
    relative), then sum in f32. dO at 1e4 or 1e-6 keeps that accuracy: it is scaled into f16's
    range before it is rounded; and dS for dq's product, rounded at each dkdv block's
    scale, is brought to a common one for each 32 queries without overflow. Elsewhere
    (lavapipe) the f32 kernels run and match to f32's tolerance."""
    configure(precision="f16")
    errors, variants, cooperative = measure(case, block, dq)
    assert len(variants) == 2, variants
    if cooperative:
        kv, q = sorted(variants, key=lambda v: "keys a workgroup" not in v)
        assert kv.startswith("cooperative backward") and f"streamed {block} at a time" in kv, variants
        if dq == "auto":
            assert kv.endswith("writes dS for dq's product") and q.startswith("cooperative dq as the product"), variants
        else:
            assert q.startswith("cooperative backward") and "dS" not in kv.split("scaled")[1], variants
        assert all(e < 1e-3 for e in errors.values()), errors
    else:
        assert all(v.startswith("tiled backward") for v in variants), variants
        assert all(e < TOL for e in errors.values()), errors


F32_CASES = {
    # name: (batch, T, S, heads, kv heads, D, causal, scale), (q, k, v, dO magnitudes)
    "gqa-causal": ((1, 130, 130, 6, 2, 64, True, None), (1.0, 1.0, 1.0, 1.0)),
    "cross-ragged-queries": ((2, 70, 200, 4, 2, 32, False, 0.3), (1.0, 1.0, 1.0, 1.0)),
    "head-dim-16": ((2, 70, 100, 2, 2, 16, False, None), (1.0, 1.0, 1.0, 1.0)),
    "head-dim-48": ((1, 100, 90, 3, 3, 48, False, None), (1.0, 1.0, 1.0, 1.0)),
    # past f16's 65504 and below its subnormals (q k near 1, so that scores stay near 1)
    "huge-q-tiny-k": ((1, 130, 130, 6, 2, 64, True, None), (1e6, 1e-6, 3e7, 1e-9)),
    "tiny-q-huge-k": ((1, 130, 130, 6, 2, 64, False, None), (1e-6, 1e6, 1e-9, 1e7)),
    # every streamed block at its own magnitude, growing and shrinking
    "dout-spanning": ((1, 130, 130, 6, 2, 64, False, None), (1.0, 1.0, 1.0, np.logspace(-4.0, 4.0, 130)[None, :, None])),
    # (k within 10x, as scores of 100 would leave P only 2^-21 x 100 of f32's accuracy)
    "keys-spanning": ((1, 130, 130, 6, 2, 64, False, None),
                      (1.0, np.logspace(1.0, -1.0, 130)[None, :, None], np.logspace(-4.0, 4.0, 130)[None, :, None], 1.0)),
}


@pytest.mark.parametrize("dq", ("auto", "kernel"))
@pytest.mark.parametrize("case", F32_CASES)
def test_f32_backward_on_cooperative_matrices_matches_the_exact_reference(case, dq, configure):
    """In f32 on a device with subgroup matrices dq and dkdv multiply every operand as hi
    and lo f16 parts, three products each (split_products), dq as the product of the dS
    (both parts) that dkdv writes, or as a kernel of its own: they match the exact float64 reference to 5e-5 of each result's largest value (at
    most 4.5e-6 on the H100, keys spanning 100x: 3.4e-5), where the f16 kernels are 1e-3
    off f16-rounded operands; also with q, k, v and dO far outside
    f16's range, and with blocks at magnitudes 1e8 apart. Elsewhere the f32 kernels run,
    held to f32's tolerance."""
    configure(precision="f32", attention_dq=dq)
    shape, magnitudes = F32_CASES[case]
    g, _ = grad_graph(*shape[:6], causal=bool(shape[6]), scale=shape[7])
    batch, t, s, heads, kv_heads, d = shape[:6]
    rng = np.random.default_rng(3)
    sizes = {"q": (batch, t, heads * d), "k": (batch, s, kv_heads * d), "v": (batch, s, kv_heads * d),
             "dout": (batch, t, heads * d)}
    inputs = with_row_stats({n: rng.standard_normal(size) * m for (n, size), m in zip(sizes.items(), magnitudes)},
                            attention_attrs(heads, kv_heads, bool(shape[6]), shape[7]))
    session = build_inference_session(g, optimize=False, capabilities=device_capabilities())
    session.set_inputs(inputs)
    session.run()
    want = reference.run(g, inputs, {}, np.float64)
    errors = {n: rel_err(session.read_output(n), want[n]) for n in ("dq", "dk", "dv")}
    variants = [d.variant for d in session.plan.dispatches if d.archetype == "attention"]
    split = session.capabilities.matmul_split
    assert all(("hi and lo f16 parts" in v) == split for v in variants) and len(variants) == 2, variants
    assert any(v.startswith("cooperative dq as the product") for v in variants) == (split and dq == "auto"), variants
    assert all(e < (5e-5 if split else TOL) for e in errors.values()), errors
