"""The attention forward on cooperative matrices (attention_coop.wgsl: f16 Q K^T and P V
fragments accumulating in f32, the softmax in f32).

As for the cooperative matmul (test_coop_matmul.py): CI's lavapipe cannot enable
subgroup matrices, so there the kernels must pass Tint's front end (Dawn's Null backend)
and ``MEGANEURA_PRECISION=f16`` must keep the f32 SIMT kernel with its tolerance; on a
device that has them (the H100 through ``MEGANEURA_WGPU=dawn``) the same numerics test
runs the cooperative kernel against a float64 reference of the f16-rounded q, k, v.
"""

import numpy as np
import pytest

from engine import codegen
from engine.config import Knobs
from engine.graph import reference
from engine.optimize.attention_stats import share_attention_statistics
from engine.runtime.device import device_capabilities
from engine.runtime.session import build_inference_session

from test_attention_kernel import attention_graph, random_inputs
from test_attention_stats import with_lse
from test_runtime import TOL, rel_err
from tint_check import tint_check

COOP_CAPS = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=True,
                                 invocations=1024)
F32_CAPS = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=False)


def _variant(caps, *shape, causal=False):
    g = attention_graph(*shape, causal=causal)
    (node,) = [n for n in g.nodes if n.op == "attention"]
    return codegen.kernel_for(g, node, caps).notes["variant"]


def test_cooperative_attention_follows_the_matmul_precision_and_head_dim():
    """f16 capabilities take the cooperative kernel for whole fragments up to D = 128 in
    48 KiB; f32 ones, other head dims and the per-query knob keep the SIMT kernels."""
    assert _variant(COOP_CAPS, 8, 1500, 1500, 6, 6, 64).startswith("cooperative flash")
    assert _variant(COOP_CAPS, 2, 70, 70, 6, 2, 32, causal=True).startswith("cooperative flash")
    assert _variant(F32_CAPS, 8, 1500, 1500, 6, 6, 64).startswith("tiled (flash)")
    assert _variant(COOP_CAPS, 1, 40, 40, 2, 2, 36).startswith("tiled (flash)")      # not whole fragments
    assert _variant(COOP_CAPS, 1, 40, 40, 2, 2, 128).startswith("cooperative flash")    # Qwen3's heads
    assert _variant(COOP_CAPS, 1, 40, 40, 2, 2, 144) == "one thread per query"
    per_query = codegen.Capabilities(workgroup_storage=49152, dialect="tint", matmul_f16=True,
                                     knobs=Knobs(attention="per-query"))
    assert _variant(per_query, 1, 40, 40, 2, 2, 64) == "one thread per query"
    # f32 where the device has the units: split products, unless MEGANEURA_ATTENTION=tiled
    split = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_split=True)
    assert "f32 as hi and lo f16 parts" in _variant(split, 8, 1500, 1500, 6, 6, 64)
    assert "f32 as hi and lo f16 parts" in _variant(split, 1, 40, 40, 2, 2, 128)
    assert _variant(split, 1, 40, 40, 2, 2, 112) == "one thread per query"       # 49.3 KiB of split tiles
    tiled = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_split=True,
                                 knobs=Knobs(attention="tiled"))
    assert _variant(tiled, 8, 1500, 1500, 6, 6, 64).startswith("tiled (flash)")
    # the split kernel's lo tiles: 20 KiB at D = 64 (two workgroups an SM of the H100)
    assert codegen.attention_coop.coop_attention_bytes(64, split=True) == 20272
    small = codegen.Capabilities(workgroup_storage=12288, dialect="tint", matmul_f16=True)
    assert _variant(small, 1, 40, 40, 2, 2, 64).startswith("tiled (flash)")          # 12.3 KiB does not fit
    # under 24 KiB, two workgroups share an SM of the H100 (one of 28 KiB or more has it alone)
    assert all(codegen.attention_coop.coop_attention_bytes(d) <= 24576 for d in (16, 32, 48, 64))
    assert "keys split" in _variant(COOP_CAPS, 1, 1500, 1500, 6, 6, 64)             # 24 x 6 workgroups
    assert "split" not in _variant(COOP_CAPS, 8, 1500, 1500, 6, 6, 64)


def test_forward_blocks_of_16_keys_fit_three_workgroups_an_sm():
    """The forward streams 16 keys a block where a block's K rows are whole vec4s for each
    of its 128 threads (D = 32, 64): 12.3 KiB at D = 64, under the 16 KiB at which three
    workgroups share an SM of the H100 (run 43); D = 16 and 48 keep blocks of 32, under
    24 KiB (two)."""
    assert [codegen.attention_coop.forward_keys(d) for d in (16, 32, 48, 64)] == [32, 16, 32, 16]
    assert codegen.attention_coop.coop_attention_bytes(64) == 12560 <= 16384
    assert codegen.attention_coop.coop_attention_bytes(32) <= 16384
    assert "64 queries x 16 keys" in _variant(COOP_CAPS, 8, 1500, 1500, 6, 6, 64)
    assert "64 queries x 32 keys" in _variant(COOP_CAPS, 1, 100, 90, 3, 3, 48)


@pytest.mark.parametrize("d", [16, 32, 48, 64, 80, 128])
def test_each_subgroup_loads_its_own_query_rows(d):
    """Q's 64 rows go through the K and V tiles (all at once for tiles of 32 rows, in two
    rounds for 16): following the generated staging and loads in order, each subgroup's
    fragments come from the tile rows that hold its queries 16 sg .. 16 sg + 15."""
    import re
    subs = codegen.attention_coop._coop_subs(d)
    d4, holds, loaded = d // 4, {"Kh": {}, "Vh": {}}, {}
    for line in (subs["STAGE_Q"] + "\n" + subs["LOAD_Q"]).splitlines():
        put = re.search(r"put_(k|v)\(tid \+ (\d+)u, fetch_rows\(tid \+ (\d+)u, b, h, q0( \+ (\d+)u)?,", line)
        if put:
            tile, at, element, start = "Kh" if put[1] == "k" else "Vh", int(put[2]), int(put[3]), int(put[5] or 0)
            for tid in range(128):
                holds[tile][(at + tid) // d4] = start + (element + tid) // d4
        branch = re.search(r"if \(sg (==|<) (\d+)u\)|\} else \{", line)
        if branch:
            group = [int(branch[2])] if branch[1] == "==" else [0, 1] if branch[1] == "<" else [2, 3]
        load = re.search(r"qf0 = subgroupMatrixLoad<[^>]*>>\(&(Kh|Vh), (.+?) \* KS \+ 0u", line)
        if load:
            for sg in group:
                row = eval(load[2].replace("u", "").replace("sg", str(sg)))   # "(sg - 2) * 16" or "16"
                loaded[sg] = [holds[load[1]][row + i] for i in range(16)]
    assert loaded == {sg: list(range(16 * sg, 16 * sg + 16)) for sg in range(4)}, d


BANKS = 32   # 4-byte banks of workgroup memory (every GPU this runs on)


def test_the_scratch_rows_keep_fragment_stores_and_softmax_reads_on_every_bank():
    """A subgroup's f32 scratch (the forward's rows of 16 or 32 columns, the backward's of 64,
    ``scratch_row`` floats apart): storing a 16 x 16 result fragment puts 8 of its 256
    floats on each of the 32 banks (the fewest passes), and at each step the lanes'
    softmax reads (lane: row lane % 16, column ``lane_column``) hit 32 different banks.
    Rows 64 floats apart for 64 columns, as before run 37, put every row on the same 16
    banks and fail the first; at 16 columns the order rotated by the row (32 and 64
    columns) put two lanes on each bank."""
    for width in (16, 32, 64):
        row = codegen.attention_coop.scratch_row(width)
        per_bank = np.bincount([(i * row + j) % BANKS for i in range(16) for j in range(16)], minlength=BANKS)
        assert per_bank.max() == 16 * 16 // BANKS, width
        for c in range(width // 2):
            column = codegen.attention_coop.lane_column(c, width)
            banks = {(lane % 16 * row + eval(column.replace("u", ""), {"r": lane % 16, "half": lane // 16})) % BANKS
                     for lane in range(32)}
            assert len(banks) == BANKS, (width, c)
    assert len({(r * 18 + r % 8 * 2 + half) % BANKS for r in range(16) for half in (0, 1)}) == 16   # rotated


def test_the_rescale_scales_every_column_of_each_round_once():
    """The rescaling branch takes O through the scratch in rounds of as many fragments as
    a block has keys (one at D = 32 and 64, two at 16 and 48): for every head dim each
    round's lanes (row r = lane % 16, parity lane / 16) multiply each of the round's
    columns of their row exactly once (a last round of one fragment, at D = 16 and 48,
    once scaled columns past it and left half of its own)."""
    import re
    for d in (16, 32, 48, 64):
        rescale = codegen.attention_coop._coop_subs(d)["RESCALE"]
        rounds = rescale.split("subgroupMatrixLoad")[:-1]
        per = codegen.attention_coop.forward_keys(d) // 16   # the scratch's columns: 16 or 32 (D = 16, 48)
        widths = [16 * len(frags) for frags in codegen.attention_coop._fragment_rounds(d, per)]
        steps = [re.findall(r"Sc\[sb \+ r \* SS \+ ([^\]]+)\] =", text)
                 for text in rescale.split("workgroupBarrier();")[1::3]]
        assert len(steps) == len(widths) and rounds, d
        for width, found in zip(widths, steps):
            for r in range(16):
                for half in (0, 1):
                    cols = sorted(eval(c.replace("u", ""), {"r": r, "half": half}) for c in found)
                    assert cols == list(range(half, width, 2)), (d, width, r, half, cols)


TINT_CHECK = """
    from engine.config import Knobs
    from test_attention_kernel import attention_graph
    from test_attention_stats import with_lse
    from engine.optimize.attention_stats import share_attention_statistics
    for splits, f16 in ((0, True), (3, True), (0, False), (3, False)):
        caps = codegen.Capabilities(subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=f16,
                                    matmul_split=not f16, knobs=Knobs(attention_splits=splits))
        for d in (16, 32, 48, 64, 80, 96, 128):
            g = attention_graph(1, 70, 130, 2, 1, d, causal=True)
            (node,) = [n for n in g.nodes if n.op == "attention"]
            kernels = [codegen.kernel_for(g, node, caps)]
            if d == 64:   # attention_stats: the same kernel writing its rows' log-sum-exp
                stats = share_attention_statistics(with_lse(g))[0]
                kernels += [codegen.kernel_for(stats, n, caps) for n in stats.nodes if n.op == "attention_stats"]
            for kernel in kernels:
                check(f"D={d}", kernel)
                check(f"D={d}", kernel.finish)
"""


def test_every_cooperative_attention_kernel_passes_tint():
    """Each head dim's kernel, f16 and f32 (split products), whole and split among
    workgroups (and the split's combine), and at D = 64 the attention_stats kernels, are
    valid WGSL for Tint; the models' own (D = 64) are also in test_coop_matmul's check of
    every kernel."""
    assert tint_check(TINT_CHECK) == (34, 32)   # (14 + 2 stats) x 2 cooperative kernels, 2 combines


def _run(g, inputs):
    """(o, the session) of ``g`` run on ``inputs`` with the device's capabilities."""
    s = build_inference_session(g, optimize=False, capabilities=device_capabilities())
    s.set_inputs(inputs)
    s.run()
    return s.read_output("o"), s


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


CASES = {
    # name: (batch, T, S, heads, kv heads, D, causal, scale), splits
    "gqa-causal-off-blocks": ((1, 130, 130, 6, 2, 64, True, None), 0),
    "cross-more-keys": ((2, 33, 200, 4, 2, 64, False, 0.3), 0),
    "causal-fewer-keys-split": ((1, 150, 70, 2, 1, 32, True, None), 3),
    "head-dim-16-split": ((2, 70, 300, 2, 2, 16, False, None), 3),
    "head-dim-48": ((1, 100, 90, 3, 3, 48, False, None), 0),
    "head-dim-128-gqa-causal": ((1, 130, 130, 4, 2, 128, True, None), 0),    # Qwen3's heads
}


@pytest.mark.parametrize("case", CASES)
def test_f16_attention_matches_the_reference(case, configure):
    """On a device with subgroup matrices the cooperative kernel matches the float64
    reference of f16-rounded q, k, v to 2e-3 of the output's largest value: its scores are
    f32 sums of exact products of the rounded operands, and beyond the reference it rounds
    only P to f16 (at most 2^-12 relative) while its row sums add the rounded P, so O is a
    convex combination of V's rows with weights off by at most ~2.5e-4 each; it matches the
    exact reference to 1e-2 (q and k's rounding moves scores of a few units by ~1e-3).
    Elsewhere (lavapipe) the SIMT kernel runs and matches the exact reference to f32's
    tolerance."""
    shape, splits = CASES[case]
    configure(precision="f16", attention_splits=splits)
    g = attention_graph(*shape)
    inputs = random_inputs(g, seed=7)
    got, s = _run(g, inputs)
    exact = reference.run(g, inputs, {}, np.float64)["o"]
    variant = s.plan.dispatches[0].variant
    assert ("split" in variant) == (splits > 1), variant
    if s.capabilities.matmul_f16:
        assert variant.startswith("cooperative flash"), variant
        rounded = reference.run(g, {k: _f16(v) for k, v in inputs.items()}, {}, np.float64)["o"]
        assert rel_err(got, rounded) < 2e-3, rel_err(got, rounded)
        assert rel_err(got, exact) < 1e-2, rel_err(got, exact)
    else:
        assert not variant.startswith("cooperative"), variant
        assert rel_err(got, exact) < TOL, rel_err(got, exact)


@pytest.mark.parametrize("d", [128, 64, 48, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_f16_attention_rescales_when_a_later_block_has_the_max(causal, d, configure):
    """Scores grow along the keys for even queries and shrink for odd ones, and span
    hundreds (a softmax without a running max would overflow): each key block moves the
    even rows' reference max past the lazy margin, so the workgroup takes O through the
    scratch and rescales those rows while the odd rows, in the same subgroups, keep
    theirs (factor 1). Causal: the first blocks of a row hold few visible keys. D = 48 and
    16 end with a round of one fragment through the scratch."""
    configure(precision="f16")
    g = attention_graph(1, 70, 200, 1, 1, d, causal=causal, scale=64.0 / d)
    rng = np.random.default_rng(3)
    sign = np.where(np.arange(70) % 2 == 0, 1.0, -1.0)[None, :, None]
    q = (np.abs(rng.standard_normal((1, 70, d))) + 0.5) * sign
    k = (np.abs(rng.standard_normal((1, 200, d))) + 0.5) * np.linspace(0.0, 6.0, 200)[None, :, None]
    inputs = {"q": q, "k": k, "v": rng.standard_normal((1, 200, d))}
    got, s = _run(g, inputs)
    if s.capabilities.matmul_f16:
        # scores in the hundreds: rounding q and k moves them by units, so the reference
        # takes the rounded operands, whose products the kernel sums exactly enough in f32
        rounded = reference.run(g, {n: _f16(v) for n, v in inputs.items()}, {}, np.float64)["o"]
        assert np.isfinite(got).all() and rel_err(got, rounded) < 2e-3, rel_err(got, rounded)
    else:
        assert rel_err(got, reference.run(g, inputs, {}, np.float64)["o"]) < TOL


@pytest.mark.parametrize("splits", [0, 3])
def test_f16_attention_keeps_its_log_sum_exp(splits, configure):
    """attention_stats (a training graph's forward) on a device with subgroup matrices:
    its result as the plain kernel's, and its rows' log-sum-exp, written by the kernel or
    (split) by the combine, that of the f16-rounded q and k's scores to 1e-4 of its
    largest magnitude (scores are exact f32 sums of the rounded products; the sum of P
    adds P rounded to f16, at most 2^-12 relative, moving a log by at most 2.5e-4 of one).
    Elsewhere the SIMT kernel writes them to f32's tolerance."""
    configure(precision="f16", attention_splits=splits)
    g = share_attention_statistics(with_lse(attention_graph(1, 150, 200, 6, 2, 64, causal=True)))[0]
    inputs = random_inputs(g, seed=5)
    s = build_inference_session(g, optimize=False, capabilities=device_capabilities())
    s.set_inputs(inputs)
    s.run()
    got = s.read_outputs()
    variant = s.plan.dispatches[0].variant
    assert "log-sum-exp kept" in variant and ("split" in variant) == (splits > 1), variant
    cooperative = s.capabilities.matmul_f16
    assert variant.startswith("cooperative flash") == cooperative, variant
    want = reference.run(g, {k: _f16(v) for k, v in inputs.items()} if cooperative else inputs, {}, np.float64)
    for name in ("lse", "lse_again"):
        assert rel_err(got[name], want[name]) < (1e-4 if cooperative else TOL), (name, rel_err(got[name], want[name]))
    assert rel_err(got["o"], want["o"]) < (2e-3 if cooperative else TOL)


SPLIT_TOL = 2e-5   # split products keep about 21 of f32's 24 bits (the f32 SIMT kernel: TOL)


@pytest.mark.parametrize("case", CASES)
def test_f32_attention_on_cooperative_matrices_matches_the_exact_reference(case, configure):
    """In f32 on a device with subgroup matrices the forward multiplies each operand as
    hi and lo f16 parts, three products each (split_products): it matches the exact
    float64 reference to 2e-5 of the output's largest value, where the f16 kernel is 1e-2
    off (q and k rounded to f16). Elsewhere the SIMT kernel runs, held to TOL."""
    shape, splits = CASES[case]
    configure(precision="f32", attention_splits=splits)
    g = attention_graph(*shape)
    inputs = random_inputs(g, seed=7)
    got, s = _run(g, inputs)
    variant = s.plan.dispatches[0].variant
    cooperative = s.capabilities.matmul_split
    assert ("hi and lo f16 parts" in variant) == cooperative and ("split" in variant) == (splits > 1), variant
    assert rel_err(got, reference.run(g, inputs, {}, np.float64)["o"]) < (SPLIT_TOL if cooperative else TOL)


@pytest.mark.parametrize("magnitudes", [(1e6, 3e7), (1e-6, 1e-9)])
def test_f32_attention_scales_operands_far_outside_f16s_range(magnitudes, configure):
    """q, k and v of magnitudes f16 cannot hold (past 65504, or below its subnormals:
    k is about 1 / q, so that the scores stay near 1), different in every key block (each
    block's K and V get their own power of two, and O is multiplied by the ratio where a
    block lowers V's): the split kernel still matches the exact reference to 2e-5, with
    causality and GQA."""
    configure(precision="f32")
    g = attention_graph(1, 150, 200, 4, 2, 64, causal=True)
    rng = np.random.default_rng(11)
    mq, mv = magnitudes
    block = np.repeat(np.exp2(rng.integers(-2, 3, size=(1, 13, 1))), 16, axis=1)[:, :200]
    inputs = {"q": rng.standard_normal((1, 150, 256)) * mq,
              "k": rng.standard_normal((1, 200, 128)) / mq * block,
              "v": rng.standard_normal((1, 200, 128)) * mv * block[:, ::-1]}
    got, s = _run(g, inputs)
    exact = reference.run(g, inputs, {}, np.float64)["o"]
    assert np.isfinite(got).all()
    assert rel_err(got, exact) < (SPLIT_TOL if s.capabilities.matmul_split else TOL), rel_err(got, exact)
