"""The tiled (flash) attention kernel on lavapipe against the numpy reference, and which
attention kernel a shape gets. Sequence lengths are chosen off the 32-query / 32-key blocks
(1, 33, 70, 130) so the edge masking runs; head dims off 64 so threads without an output
column run too."""

import numpy as np
import pytest

from engine import Graph, codegen
from engine.graph import reference
from engine.errors import DeviceError
from engine.runtime.session import build_inference_session
from test_runtime import TOL, rel_err


# the tiled kernel is the f32 path on CUDA cores; on Dawn the cooperative ones take its place
pytestmark = pytest.mark.usefixtures("simt_attention")


def attention_graph(batch, t, s, heads, kv_heads, d, causal=False, scale=None):
    g = Graph("attn")
    q = g.input("q", [batch, t, heads * d])
    k = g.input("k", [batch, s, kv_heads * d])
    v = g.input("v", [batch, s, kv_heads * d])
    g.output("o", g.attention(q, k, v, num_heads=heads, num_kv_heads=kv_heads, causal=causal, scale=scale))
    return g


def run_against_reference(g, inputs, variant="tiled"):
    s = build_inference_session(g, optimize=False)
    dispatch = s.plan.dispatches[0]
    assert dispatch.variant.startswith(variant), dispatch.variant
    assert len(s.plan.dispatches) == (2 if "split" in dispatch.variant else 1)
    s.set_inputs(inputs)
    s.run()
    ref = reference.run(g, inputs, {}, np.float64)["o"]
    return rel_err(s.read_output("o"), ref)


def random_inputs(g, seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(g[i].shape) for name, i in g.inputs.items()}


CASES = {
    # name: batch, T, S, heads, kv heads, D, causal, scale
    "causal": (2, 70, 70, 2, 2, 64, True, None),
    "full": (2, 70, 70, 2, 2, 64, False, None),
    "gqa-3-groups-causal": (1, 130, 130, 6, 2, 64, True, None),
    "gqa-2-groups": (1, 130, 130, 6, 3, 64, False, None),
    "cross-more-keys": (2, 33, 130, 6, 3, 64, False, 0.3),
    "cross-fewer-keys": (1, 130, 33, 2, 1, 64, False, None),
    "causal-more-keys": (1, 40, 70, 2, 1, 64, True, None),
    "causal-fewer-keys": (1, 70, 40, 2, 1, 64, True, None),
    "one-query": (2, 1, 70, 2, 2, 64, False, None),
    "one-query-causal": (2, 1, 70, 2, 2, 64, True, None),
    "one-key": (1, 70, 1, 2, 2, 64, False, None),
    "head-dim-8": (2, 70, 45, 6, 2, 8, False, 0.7),
    "head-dim-36-causal": (1, 70, 70, 3, 3, 36, True, None),
}


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "keys-split-3"])
@pytest.mark.parametrize("case", CASES)
def test_tiled_attention_matches_reference(case, splits, monkeypatch, configure):
    """Also with the keys split among three workgroups a block of queries, whose partial
    rows the second dispatch combines (causal: the last parts of early query blocks see
    no key at all)."""
    configure(attention_splits=splits)
    batch, t, s, heads, kv_heads, d, causal, scale = CASES[case]
    g = attention_graph(batch, t, s, heads, kv_heads, d, causal, scale)
    assert run_against_reference(g, random_inputs(g)) < TOL


@pytest.mark.parametrize("level", ["0", "1"])
@pytest.mark.parametrize("case", ["gqa-3-groups-causal", "cross-more-keys", "head-dim-36-causal"])
def test_prefetch_levels_give_the_same_attention(case, level, monkeypatch, configure):
    """The forward fetches V before the scores and the next block's K before P . V (the
    default, MEGANEURA_ATTENTION_PREFETCH=2); levels 0 (each block where it is stored) and
    1 (V only) are kept for benchmarks and must compute the same, split or not."""
    batch, t, s, heads, kv_heads, d, causal, scale = CASES[case]
    g = attention_graph(batch, t, s, heads, kv_heads, d, causal, scale)
    (node,) = [n for n in g.nodes if n.op == "attention"]
    default = codegen.kernel_for(g, node).source
    configure(attention_prefetch=int(level))
    source = codegen.kernel_for(g, node, _configured()).source
    assert "kpre0 = fetch_k" in default and "let vpre0 = fetch_v" in default
    assert "kpre0" not in source and ("let vpre0 = fetch_v" in source) == (level == "1")
    for splits in ("1", "3"):
        configure(attention_splits=int(splits))
        assert run_against_reference(g, random_inputs(g, seed=4)) < TOL


@pytest.mark.parametrize("case", ["gqa-3-groups-causal", "head-dim-8"])
def test_row_thread_layout_gives_the_same_attention(case, monkeypatch, configure):
    """Attention numbers its threads so that a warp is 8 x 4 of them; the 16 x 2 layout
    the matmul keeps (MEGANEURA_THREAD_LAYOUT=rows, for benchmarks) computes the same."""
    batch, t, s, heads, kv_heads, d, causal, scale = CASES[case]
    g = attention_graph(batch, t, s, heads, kv_heads, d, causal, scale)
    (node,) = [n for n in g.nodes if n.op == "attention"]
    assert codegen.THREAD_LAYOUTS["warp"] in codegen.kernel_for(g, node).source
    configure(thread_layout="rows")
    assert codegen.THREAD_LAYOUTS["rows"] in codegen.kernel_for(g, node, _configured()).source
    assert run_against_reference(g, random_inputs(g, seed=5)) < TOL


def test_unknown_knob_values_are_refused():
    from engine.config import Config, ConfigError, Knobs
    with pytest.raises(ConfigError, match="MEGANEURA_ATTENTION_PREFETCH='3' is not one of 0, 1, 2"):
        Config.from_env({"MEGANEURA_ATTENTION_PREFETCH": "3"})
    with pytest.raises(ConfigError, match="MEGANEURA_ATTENTION_SPLITS='two' is not a positive whole number"):
        Config.from_env({"MEGANEURA_ATTENTION_SPLITS": "two"})
    g = attention_graph(1, 70, 70, 2, 2, 64)
    (node,) = [n for n in g.nodes if n.op == "attention"]
    with pytest.raises(DeviceError, match="MEGANEURA_THREAD_LAYOUT='cols'"):
        codegen.kernel_for(g, node, codegen.Capabilities(knobs=Knobs(thread_layout="cols")))


def test_tiled_attention_rescales_when_a_later_block_has_the_max():
    """Scores grow along the keys and span hundreds: each key block raises every row's
    max, so the running sum and the accumulated outputs are rescaled block after block;
    exp of an unshifted score would overflow f32."""
    g = attention_graph(1, 70, 200, 1, 1, 64, scale=1.0)
    rng = np.random.default_rng(3)
    q = np.abs(rng.standard_normal((1, 70, 64))) + 0.5
    growth = np.linspace(0.0, 6.0, 200)[None, :, None]
    k = (np.abs(rng.standard_normal((1, 200, 64))) + 0.5) * growth
    inputs = {"q": q, "k": k, "v": rng.standard_normal((1, 200, 64))}
    assert run_against_reference(g, inputs) < TOL


def test_tiled_attention_over_whisper_length():
    """1500 queries x 1500 keys at head dim 64, whisper-tiny's encoder."""
    g = attention_graph(1, 1500, 1500, 1, 1, 64)
    assert run_against_reference(g, random_inputs(g, seed=1)) < TOL


def test_tiled_attention_over_100k_keys():
    """llvmpipe (lavapipe) ends an invocation after ~65535 loop iterations in total and
    silently leaves the rest of its work undone. The kernel unrolls its loops over d and
    over a block's keys, so ~5 iterations a block of 32 keys remain; with a loop over d
    (64 a block) this failed from ~30k keys on."""
    g = attention_graph(1, 40, 100_000, 1, 1, 64)
    assert run_against_reference(g, random_inputs(g, seed=2)) < TOL


def _configured():
    """Plain capabilities with the process's configured knobs (what a session would get)."""
    from engine import config
    return codegen.Capabilities(knobs=config.current().knobs)


def variant_of(*shape, causal=False):
    g = attention_graph(*shape, causal=causal)
    (node,) = [n for n in g.nodes if n.op == "attention"]
    return codegen.kernel_for(g, node, _configured()).notes["variant"]


def test_model_shapes_get_the_tiled_kernel():
    whisper = variant_of(1, 1500, 1500, 6, 6, 64)
    gpt = variant_of(8, 256, 256, 6, 6, 64, causal=True)
    assert whisper.startswith("tiled") and gpt.startswith("tiled"), (whisper, gpt)


def test_grids_too_small_to_fill_the_gpu_split_their_keys():
    """whisper-tiny at batch 1 makes 47 x 6 workgroups, two for each of an H100's SMs: its
    keys are split; at batch 8 (2,256 workgroups) they are not, nor where a part would
    keep fewer than ATTENTION_MIN_PART blocks."""
    fill, least = codegen.Tuning().attention_fill, codegen.ATTENTION_MIN_PART
    assert codegen.attention_splits(47 * 6, 47) == -(-fill // 282) > 1
    assert "keys split" in variant_of(1, 1500, 1500, 6, 6, 64)
    assert codegen.attention_splits(47 * 6 * 8, 47) == 1
    assert "split" not in variant_of(8, 1500, 1500, 6, 6, 64)
    assert codegen.attention_splits(10, 2 * least - 1) == 1
    assert codegen.attention_splits(1, 10_000) == codegen.ATTENTION_MAX_SPLITS
    small_gpu = codegen.Tuning(attention_fill=282)     # a tuned adapter that 282 workgroups fill
    assert codegen.attention_splits(47 * 6, 47, tuning=small_gpu) == 1


@pytest.mark.parametrize("d", [5, 2, 68, 128])
def test_head_dims_the_tiled_kernel_lacks_fall_back_to_one_thread_per_query(d):
    assert variant_of(1, 40, 40, 2, 2, d) == "one thread per query"


def test_env_forces_the_per_query_kernel(monkeypatch, configure):
    configure(attention="per-query")
    assert variant_of(1, 1500, 1500, 6, 6, 64) == "one thread per query"
    g = attention_graph(2, 70, 45, 6, 2, 64, causal=True)
    assert run_against_reference(g, random_inputs(g), variant="one thread per query") < TOL


def test_layers_of_one_head_dim_share_one_pipeline():
    """Shapes, heads, causal and scale live in meta, not in the source."""
    a = attention_graph(2, 70, 70, 6, 2, 64, causal=True)
    b = attention_graph(1, 33, 130, 2, 2, 64, scale=0.3)
    ka, kb = (codegen.kernel_for(g, next(n for n in g.nodes if n.op == "attention")) for g in (a, b))
    assert ka.source == kb.source and ka.meta != kb.meta


def test_profiler_counts_a_split_attention_once(monkeypatch, configure):
    """With its keys split, attention is two dispatches: the first does the attention's
    FLOPs, the second (the combine) about one per partial float it reads."""
    from engine.runtime.dispatches import estimate_flops, session_dispatches
    configure(attention_splits=3)
    g = attention_graph(1, 130, 130, 2, 2, 64)
    s = build_inference_session(g, optimize=False)
    first, combine = session_dispatches(s)
    (node,) = [n for n in g.nodes if n.op == "attention"]
    partials = s.plan.dispatches[0].bindings[-1].size
    assert combine.kernel == first.kernel + ":total" and first.archetype == "attention"
    assert first.flops == estimate_flops(g, node)
    assert combine.flops == partials // 4 and combine.bytes == partials + node.nbytes
    assert partials >= 3 * node.nbytes


def test_block_of_queries_follows_the_devices_workgroup_memory():
    """32 queries a workgroup where the device's workgroup memory holds the block (NVIDIA's
    48 KiB at D = 64), else 16 (lavapipe's 32 KiB at D = 64): the kernel declares no more
    than the limit. The 32-query kernel runs on lavapipe at smaller head dims (CASES'
    head-dim-8 and head-dim-36-causal), the 16-query one at D = 64."""
    lavapipe, nvidia = codegen.Capabilities(), codegen.Capabilities(workgroup_storage=49152)
    assert [codegen.attention_queries(d, lavapipe) for d in (8, 36, 52, 56, 64)] == [32, 32, 32, 16, 16]
    assert codegen.attention_queries(64, nvidia) == 32
    for caps in (lavapipe, nvidia):
        for d in (8, 36, 64):
            assert codegen.attention_workgroup_bytes(codegen.attention_queries(d, caps), d) <= caps.workgroup_storage
    g = attention_graph(1, 1500, 1500, 6, 6, 64)
    (node,) = [n for n in g.nodes if n.op == "attention"]
    small, large = (codegen.kernel_for(g, node, caps) for caps in (lavapipe, nvidia))
    assert small.workgroups[0] == -(-1500 // 16) and large.workgroups[0] == -(-1500 // 32)
    assert "@workgroup_size(64)" in small.source and "@workgroup_size(128)" in large.source
    assert small.notes["variant"].startswith("tiled (flash) 16 queries x 64 keys")
