"""Generation with a KV cache (engine/train/generation.py, engine/graph/kv_cache.py and the
ops cache_write / cached_attention): greedy ids against transformers' ``generate`` on tiny
random checkpoints, cached decoding against recomputing the whole sequence, the kernels
against the reference, sampling, bad requests and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os

from llama_checkpoint import llama_relative
from tint_check import tint_check
import numpy as np
import pytest

import torch
import transformers

from engine import models
from engine.autodiff.gradients import differentiate
from engine.cli import main
from engine.config import Config
from engine.errors import GraphError, MeganeuraError
from engine.graph import reference
from engine.graph.ir import Graph
from engine.graph.ops import argmax_ref, norm_matmuls_layout
from engine.importers import load_model
from engine.runtime.device import device_capabilities
from engine.runtime.session import Session
from engine.runtime.session import submission_chunks
from engine.train.generation import Sampling, cache_capacity
from engine.train.sampling import draw, largest_first, reach_blocked


# ---------------------------------------------------------------- checkpoints

def llama_checkpoint(path, tie=True):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                                   rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tie, eos_token_id=None,
                                   bos_token_id=None)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf, path


def gpt2_checkpoint(path):
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=90, n_embd=32, n_layer=2, n_head=4, n_positions=40,
                                  bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(path)
    return hf, path


def qwen3_checkpoint(path):
    """Qwen3: q and k normalised per head before RoPE, which a decode step applies inside
    the cache write and the cached attention; biases on q, k, v and o."""
    torch.manual_seed(2)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                   max_position_embeddings=48, rms_norm_eps=1e-5, rope_theta=500.0,
                                   tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf, path


def relative_checkpoint(path, family: str, seed: int, **fields):
    """``llama_relative`` of ``family`` (no end-of-sequence id, so that generation runs its
    full length), saved to ``path``."""
    hf = llama_relative(family, seed, **{**dict(vocab_size=96, max_position_embeddings=48, pad_token_id=0,
                                                eos_token_id=None, bos_token_id=None), **fields})
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """Phi-3: q, k and v one projection and gate and up another, sliced in every graph."""
    return relative_checkpoint(tmp_path_factory.mktemp("gen_phi3"), "Phi3", 6)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """Granite: the embeddings, residual branches, attention scores and logits scaled."""
    return relative_checkpoint(tmp_path_factory.mktemp("gen_granite"), "Granite", 5, tie_word_embeddings=True,
                               embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.25,
                               logits_scaling=3.0)


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """SmolLM3: its second layer without RoPE, so that its cache holds keys as they are."""
    return relative_checkpoint(tmp_path_factory.mktemp("gen_smollm3"), "SmolLM3", 8, no_rope_layers=[1, 0])


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """OLMo 2: q and k normalised over all heads before the deferred RoPE, norms after each branch."""
    return relative_checkpoint(tmp_path_factory.mktemp("gen_olmo2"), "Olmo2", 7)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_checkpoint(tmp_path_factory.mktemp("gen_qwen3"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_checkpoint(tmp_path_factory.mktemp("gen_llama"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return gpt2_checkpoint(tmp_path_factory.mktemp("gen_gpt2"))


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A checkpoint folder shaped like SmolLM2's, shrunk: a vocabulary of 512 ids (more than
    the 256 bytes) and no tokenizer files, as a folder of only the weights is."""
    return relative_checkpoint(tmp_path_factory.mktemp("gen_no_tokenizer"), "Llama", 9, vocab_size=512)


def hf_greedy(hf, prompt, new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          pad_token_id=hf.config.eos_token_id or 0)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------- the ops on the GPU

LLAMA3 = ("llama3", 8.0, 1.0, 4.0, 16.0)   # Llama 3's RoPE scaling, its original context short enough to matter


def generation_ops_graph(b, t, s, h, hkv, d, rope, scaling=()):
    g = Graph("cache ops")
    q, k, v = g.input("q", (b, t, h * d)), g.input("k", (b, t, hkv * d)), g.input("v", (b, t, hkv * d))
    pos = g.input("positions", (b, t), "i32")
    kc = g.parameter("kc", (b, s, hkv * d), trainable=False)
    vc = g.parameter("vc", (b, s, hkv * d), trainable=False)
    kw = g.output("cache.k", g.cache_write(kc, k, pos, hkv if rope else 0, 700.0, scaling))
    vw = g.output("cache.v", g.cache_write(vc, v, pos))
    g.output("o", g.cached_attention(g.rope(q, h, base=700.0, positions=pos, scaling=scaling) if rope == "node" else q,
                                     kw, vw, pos, h, hkv, rope=rope is True, rope_base=700.0, rope_scaling=scaling))
    return g


@pytest.mark.parametrize("b,t,s,h,hkv,d,rope,scaling", [
    (1, 1, 40, 4, 2, 16, True, ()), (2, 3, 300, 2, 1, 8, False, ()), (1, 2, 70, 2, 2, 6, "node", ()),
    (2, 3, 50, 2, 1, 16, "node", ()), (1, 2, 40, 4, 2, 16, True, LLAMA3), (2, 3, 50, 2, 1, 16, "node", LLAMA3)])
def test_cache_ops_on_the_gpu_match_the_reference(b, t, s, h, hkv, d, rope, scaling):
    """Several 256-key rounds of the kernel (s=300), GQA, a head dim that is not a
    multiple of 4 (scalar key reads), RoPE fused into both ops and as a node of its own
    (scalar and in pairs of vec4s), with Llama 3's scaled frequencies too."""
    rng = np.random.default_rng(s)
    g = generation_ops_graph(b, t, s, h, hkv, d, rope, scaling)
    positions = np.stack([np.sort(rng.choice(s, t, replace=False)) for _ in range(b)]).astype(np.int32)
    inputs = {"q": rng.standard_normal((b, t, h * d)), "k": rng.standard_normal((b, t, hkv * d)),
              "v": rng.standard_normal((b, t, hkv * d)), "positions": positions}
    inputs = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in inputs.items()}
    params = {"kc": rng.standard_normal((b, s, hkv * d)).astype(np.float32),
              "vc": rng.standard_normal((b, s, hkv * d)).astype(np.float32)}
    want = reference.run(g, inputs, params)
    session = Session(g)
    session.set_inputs(inputs)
    session.set_parameters(params)
    session.run()
    for name, value in want.items():
        got = session.read_output(name)
        assert np.abs(got - value).max() <= 1e-5 * max(1.0, np.abs(value).max()), name
    # a GPU's sin and cos of angles past pi (positions up to s) are not exact: the output
    # is checked against the reference above, the parameter against the output
    np.testing.assert_array_equal(session.get_parameter("kc"), session.read_output("cache.k"),
                                  err_msg="the write is in place, in the parameter")


def test_one_write_fills_a_layers_keys_and_values_on_the_gpu():
    """cache [2, B, S, W]: keys (rotated) in plane 0, values in plane 1, one dispatch."""
    rng = np.random.default_rng(7)
    b, t, s, w = 2, 3, 64, 12
    g = Graph("kv write")
    kv = g.parameter("kv", (2, b, s, w), trainable=False)
    k, v, pos = g.input("k", (b, t, w)), g.input("v", (b, t, w)), g.input("positions", (b, t), "i32")
    g.output("kv", g.cache_write(kv, [k, v], pos, 3, 500.0))
    inputs = {"k": rng.standard_normal((b, t, w)).astype(np.float32),
              "v": rng.standard_normal((b, t, w)).astype(np.float32),
              "positions": np.array([[9, 2, 63], [0, 40, 5]], np.int32)}
    params = {"kv": rng.standard_normal((2, b, s, w)).astype(np.float32)}
    want = reference.run(g, inputs, params)["kv"]
    session = Session(g)
    assert len(session.plan.dispatches) == 1
    session.set_inputs(inputs)
    session.set_parameters(params)
    session.run()
    got = session.get_parameter("kv")   # the GPU's sin and cos at position 63 differ from numpy's by ~1e-6
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_array_equal(got[1], want[1])   # values: copied, not rotated
    np.testing.assert_array_equal(want[1][[0, 0, 0, 1, 1, 1], [9, 2, 63, 0, 40, 5]], inputs["v"].reshape(-1, w))


def decode_folds_caps(folds: bool):
    """The device's capabilities with the decode folds on or off (``MEGANEURA_DECODE_FOLDS``)."""
    knobs = Config.from_env({**os.environ, "MEGANEURA_DECODE_FOLDS": "1" if folds else "0"}).knobs
    assert knobs.decode_folds == folds
    return dataclasses.replace(device_capabilities(), knobs=knobs)


def decode_attention_graph(b, s, h, hkv, d, rope):
    """One decode step's attention as a decode graph builds it (engine.graph.kv_cache):
    one write of the step's keys (rotated where ``rope``) and values into the layer's cache
    [2, B, S, W], and the cached attention reading its two planes as part views."""
    g = Graph("decode attention")
    w = hkv * d
    q, k, v = g.input("q", (b, 1, h * d)), g.input("k", (b, 1, w)), g.input("v", (b, 1, w))
    pos = g.input("positions", (b, 1), "i32")
    written = g.output("kv", g.cache_write(g.parameter("kv", (2, b, s, w), trainable=False), [k, v], pos,
                                           hkv if rope else 0, 700.0, LLAMA3 if rope else ()))
    planes = [g.apply("part", written, offset=i * b * s * w, shape=(b, s, w)) for i in range(2)]
    g.output("o", g.cached_attention(q, *planes, pos, h, hkv, rope=rope, rope_base=700.0,
                                     rope_scaling=LLAMA3 if rope else ()))
    return g


@pytest.mark.parametrize("b,s,h,hkv,d,rope,positions", [
    (1, 1024, 4, 2, 16, True, [[700]]), (2, 512, 2, 1, 8, False, [[0], [511]]), (1, 768, 2, 2, 6, True, [[300]]),
    (1, 64, 4, 2, 16, True, [[63]])])
def test_the_cached_attention_writes_its_steps_keys_and_values(b, s, h, hkv, d, rope, positions):
    """A decode step's cache write is done by the attention kernel that reads it (one
    dispatch fewer a layer): over caches the attention splits (the step's position in a
    later part, in the first, the last row) and one it does not, GQA, RoPE with Llama 3's
    frequencies, a head dim that is not a multiple of 4. The cache and the output equal
    the two kernels' bit for bit, and the reference's."""
    rng = np.random.default_rng(s + d)
    g = decode_attention_graph(b, s, h, hkv, d, rope)
    inputs = {"q": rng.standard_normal((b, 1, h * d)).astype(np.float32),
              "k": rng.standard_normal((b, 1, hkv * d)).astype(np.float32),
              "v": rng.standard_normal((b, 1, hkv * d)).astype(np.float32),
              "positions": np.array(positions, np.int32)}
    params = {"kv": rng.standard_normal((2, b, s, hkv * d)).astype(np.float32)}
    want = reference.run(g, inputs, params)

    def run(folds=True):
        session = Session(g, capabilities=decode_folds_caps(folds))
        session.set_inputs(inputs)
        session.set_parameters(params)
        session.run()
        return session, session.read_output("o"), session.get_parameter("kv")
    session, out, cache = run()
    kernels = [d.kernel for d in session.plan.dispatches]
    assert "cache_write" not in kernels and kernels[0] == "cached_attention", kernels
    assert sorted(session.plan.dispatches[0].nodes) == sorted(n.id for n in g.nodes if n.op in (
        "cache_write", "cached_attention"))
    # a GPU's sin and cos of angles past pi are not exact: within the values' scale of the reference
    assert np.abs(out - want["o"]).max() <= 1e-5 * np.abs(want["kv"]).max()
    assert np.abs(cache - want["kv"]).max() <= 1e-5 * np.abs(want["kv"]).max()
    np.testing.assert_array_equal(cache[1][np.arange(b), [p[0] for p in positions]], inputs["v"][:, 0])
    apart, out_apart, cache_apart = run(folds=False)   # MEGANEURA_DECODE_FOLDS=0
    assert "cache_write" in [d.kernel for d in apart.plan.dispatches]
    np.testing.assert_array_equal(cache, cache_apart)
    np.testing.assert_array_equal(out, out_apart)


PROJECTED = 384   # outputs of decode_projection_graph's projection


def decode_projection_graph(s, h, hkv, d):
    """``decode_attention_graph`` at batch 1 with RoPE, its output projected as a decode
    step's o projection: a weight kept [out, in] (PROJECTED outputs) and a residual."""
    g = decode_attention_graph(1, s, h, hkv, d, True)
    attention = g.outputs.pop("o")
    n = PROJECTED
    g.output("o", g.apply("fused_matmul", attention, g.parameter("w", (n, h * d)), g.input("residual", (1, 1, n)),
                          transpose_b=True, has_residual=True))
    return g


def test_the_projection_combines_the_parts_only_where_they_fit_its_workgroup_memory():
    """4096 values of A (16 KiB) beside the partial sums (1 KiB) need more than 16 KiB of
    workgroup memory: there the combine stays a dispatch of its own."""
    from engine import codegen
    from engine.compile.plan import compile_plan
    g = decode_projection_graph(512, 32, 8, 128)
    product = next(n for n in g.nodes if n.op == "fused_matmul")
    for storage, fits in ((16384, False), (17408, True)):
        caps = dataclasses.replace(device_capabilities(), workgroup_storage=storage)
        assert (codegen.product_combining(g, product, 2, 128, caps) is not None) == fits, storage
        kernels = [d.kernel for d in compile_plan(g, capabilities=caps).dispatches]
        assert ("cached_attention:total" not in kernels) == fits, kernels


def test_tint_compiles_the_decode_folds():
    """The attention writing the cache (vec4 and scalar keys), the projection combining
    its parts, the LM head leaving its workgroups' best (after a norm or not) and the argmax
    of those, through Dawn's WGSL compiler (lavapipe cannot run Dawn)."""
    assert tint_check("""
        from engine.compile import decode_folds
        from test_generation import decode_attention_graph, decode_projection_graph, lm_head_graph
        caps = codegen.Capabilities(subgroups=True, dialect="tint")
        for g in (decode_projection_graph(1024, 4, 2, 16), decode_attention_graph(1, 64, 2, 2, 6, True)):
            for _, kernel in decode_folds.cache_writes_in_attention(g, caps, g.nodes).values():
                check("attention writing the cache", kernel)
            for _, kernel in decode_folds.combines_in_products(g, caps, g.nodes).values():
                check("projection combining the parts", kernel)
        for norm in (True, False):
            g = lm_head_graph(1001, 64, norm)
            for _, product, argmax in decode_folds.argmax_from_products(g, caps, g.nodes).values():
                check("LM head leaving its best", product)
                check("argmax of the workgroups' best", argmax)
        """) == (6, 0)   # the two argmax kernels are one source


def lm_head_graph(n, k, norm):
    """A decode step's last two dispatches: the LM head (a weight [n, k] read transposed,
    after the final RMS norm where ``norm``) and the argmax of its one row of logits."""
    g = Graph("lm head")
    x, w = g.input("x", (1, 1, k)), g.parameter("w", (n, k))
    logits = (g.apply("norm_matmul", x, g.parameter("nw", (k,)), w, eps=1e-5, transpose_b=True) if norm
              else g.matmul(x, w, transpose_b=True))
    g.output("next_id", g.argmax(g.output("logits", logits)))
    return g


@pytest.mark.parametrize("n,case", [(1001, "tie"), (1001, "nan"), (1000, "inf"), (1000, "-inf"), (49152, "tie")])
def test_the_argmax_reads_the_lm_heads_workgroups_best(n, case):
    """The LM head's workgroups each leave the best of their columns (value and column) and
    the argmax reduces those, not the row: a decode step's argmax over 128,256 logits on one
    workgroup took 47 us. The same ids as numpy's and as the argmax of the row, bit for
    bit: the largest value, the lower column of a tie across workgroups (and in the last,
    partial one), -1 for a row holding a NaN or +inf, 0 for a row of -inf. The logits are
    column 0 of the weight (A one-hot)."""
    from engine.graph.ops import argmax_ref
    k = 64
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    top = w[:, 0].max() + 1.0
    w[[n - 1, 700, 13], 0] = top           # a tie: 13 wins, across workgroups
    if case == "nan":
        w[[400, 5], 0] = np.nan
    elif case == "inf":
        w[999, 0] = np.inf
    elif case == "-inf":
        w[:, 0] = -np.inf
    x = np.zeros((1, 1, k), np.float32)
    x[0, 0, 0] = 1.0
    g = lm_head_graph(n, k, False)
    got = {}
    for folds in (True, False):
        session = Session(g, capabilities=decode_folds_caps(folds))
        session.set_parameter("w", w)
        session.set_inputs({"x": x})
        session.run()
        variants = [d.variant for d in session.plan.dispatches]
        assert len(variants) == 2 and ("workgroups' best" in variants[1]) == folds, variants
        got[folds] = int(session.read_output("next_id")[0, 0])
        assert np.array_equal(session.read_output("logits")[0, 0], w[:, 0], equal_nan=True)
    want = {"tie": 13, "nan": -1, "inf": -1, "-inf": 0}[case]
    assert got[True] == got[False] == int(argmax_ref(w[:, 0])) == want


def test_the_folded_argmax_of_a_normed_lm_head_equals_the_row():
    """With the final norm in the LM head (norm_matmul), random weights: the same id as the
    argmax of the logits the head wrote, and as the reference's."""
    rng = np.random.default_rng(9)
    g = lm_head_graph(5000, 256, True)
    params = {"w": (rng.standard_normal((5000, 256)) / 16).astype(np.float32),
              "nw": rng.standard_normal(256).astype(np.float32)}
    x = rng.standard_normal((1, 1, 256)).astype(np.float32)
    session = Session(g, capabilities=decode_folds_caps(True))
    session.set_parameters(params)
    session.set_inputs({"x": x})
    session.run()
    assert "workgroups' best" in session.plan.dispatches[-1].variant
    logits = session.read_output("logits")[0, 0]
    assert int(session.read_output("next_id")[0, 0]) == int(np.argmax(logits))
    assert int(np.argmax(logits)) == int(reference.run(g, {"x": x}, params)["next_id"][0, 0])


@pytest.mark.parametrize("s,h,hkv,d,position", [(1024, 4, 2, 16, 700), (512, 8, 2, 8, 3), (768, 2, 1, 32, 767),
                                                 (512, 8, 2, 64, 300), (512, 32, 8, 128, 300)])
def test_the_output_projection_combines_a_split_attentions_parts(s, h, hkv, d, position):
    """A decode step's split cached attention leaves its parts (each part's maximum, sum
    and sums) to the one-row product that reads its value, which combines them into
    workgroup memory first: no combine dispatch, the attention's value never stored. Its
    result equals the reference's and, to f32 rounding, the combine dispatch's. 512 values
    (8 heads of 64): whole rounds of the workgroup's threads; 4096 (32 heads of 128, an
    8B-class model's): 16 KiB of workgroup memory."""
    rng = np.random.default_rng(s + h)
    g = decode_projection_graph(s, h, hkv, d)
    n = PROJECTED
    inputs = {"q": rng.standard_normal((1, 1, h * d)), "k": rng.standard_normal((1, 1, hkv * d)),
              "v": rng.standard_normal((1, 1, hkv * d)), "residual": rng.standard_normal((1, 1, n)),
              "positions": np.array([[position]], np.int32)}
    inputs = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in inputs.items()}
    params = {"kv": rng.standard_normal((2, 1, s, hkv * d)).astype(np.float32),
              "w": (rng.standard_normal((n, h * d)) / np.sqrt(h * d)).astype(np.float32)}
    want = reference.run(g, inputs, params)["o"]

    def run(folds=True):
        session = Session(g, capabilities=decode_folds_caps(folds))
        session.set_inputs(inputs)
        session.set_parameters(params)
        session.run()
        return session.plan, session.read_output("o")
    plan, got = run()
    kernels = lambda plan: [d.kernel.split(":activation")[0] for d in plan.dispatches]   # noqa: E731
    assert kernels(plan) == ["cached_attention", "fused_matmul"]
    assert plan.dispatches[1].variant.endswith("attention parts"), plan.dispatches[1].variant
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    apart, got_apart = run(folds=False)
    assert kernels(apart) == ["cache_write", "cached_attention", "cached_attention:total", "fused_matmul"]
    np.testing.assert_allclose(got, got_apart, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_cached_attention_over_a_prefix_equals_causal_attention():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 12)) for _ in range(3))
    pos = np.tile(np.arange(5, dtype=np.int32), (2, 1))
    from engine.graph.ops import attention_ref, cached_attention_ref, cache_write_ref
    cache = cache_write_ref(np.zeros((2, 9, 12)), k, pos)
    values = cache_write_ref(np.full((2, 9, 12), 7.0), v, pos)
    got = cached_attention_ref(q, cache, values, pos, num_heads=3)
    np.testing.assert_allclose(got, attention_ref(q, k, v, num_heads=3, causal=True), rtol=1e-12)


def test_generation_ops_refuse_gradients_and_bad_positions():
    g = Graph("trainable q")
    q = g.parameter("q", (1, 1, 8))
    kv, pos = g.input("kv", (1, 4, 8)), g.input("positions", (1, 1), "i32")
    g.output("loss", g.sum(g.cached_attention(q, kv, kv, pos, 2)))
    with pytest.raises(GraphError, match="inference only"):
        differentiate(g)
    g = Graph("argmax of a parameter")
    w = g.parameter("w", (1, 4))
    g.output("loss", g.sum(g.mul(w, g.apply("cast", g.argmax(w), dtype="f32"))))
    wv = np.array([[0.5, 3.0, -1.0, 2.0]], np.float32)
    grad = reference.run(differentiate(g)[0], {}, {"w": wv})["grad:w"]
    np.testing.assert_array_equal(grad, [[1.0, 1.0, 1.0, 1.0]])   # d(w * 1)/dw: nothing through the index
    from engine.graph.ops import cache_write_ref
    with pytest.raises(IndexError, match="positions"):
        cache_write_ref(np.zeros((1, 4, 2)), np.zeros((1, 1, 2)), np.array([[4]]))


@pytest.mark.parametrize("shape", [(4, 1, 5000), (4, 7), (5, 2049), (4, 40000)])
def test_argmax_on_the_gpu_matches_numpy(shape):
    """Rows over several rounds of the deep loads and their tail, with 256 threads and (the
    longest row, where the adapter allows) 1024; ties (the first wins), a row of -inf, and
    rows holding a NaN or +inf, which give -1."""
    rng = np.random.default_rng(shape[-1])
    x = rng.standard_normal(shape).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    rows[0, [3, shape[-1] - 1]] = rows[0].max() + 1.0
    rows[1, [5, 1]] = np.nan
    rows[2] = -np.inf
    rows[3, 4] = np.inf
    g = Graph("argmax")
    g.output("i", g.argmax(g.input("x", shape)))
    session = Session(g)
    session.set_inputs({"x": x})
    session.run()
    got = session.read_output("i")
    assert got.dtype == np.int32 and got.shape == shape[:-1]
    np.testing.assert_array_equal(got, argmax_ref(x))
    assert got.reshape(-1).tolist() == [3, -1, 0, -1, *np.argmax(rows[4:], axis=-1)]


def test_plan_writes_the_cache_in_place_and_binds_it_once():
    g = generation_ops_graph(1, 1, 8, 2, 2, 4, True)
    session = Session(g)
    plan = session.plan
    cache = plan.parameters["kc"]
    assert plan.outputs["cache.k"] == cache
    writes = [d for d in plan.dispatches if d.kernel == "cache_write" and cache in d.writes]
    assert len(writes) == 1 and cache not in writes[0].reads


# ---------------------------------------------------------------- against transformers

@pytest.mark.parametrize("backend", ["reference", "gpu"])
@pytest.mark.parametrize("which", ["llama", "gpt2", "granite", "phi3"])
def test_greedy_ids_equal_transformers(request, which, backend):
    hf, path = request.getfixturevalue(which)
    model = load_model(str(path))
    rng = np.random.default_rng(3)
    for length, new in ((5, 12), (1, 6)):
        prompt = rng.integers(1, model.vocab_size, length).tolist()
        result = model.generate(prompt, max_new_tokens=new, backend=backend)
        want = hf_greedy(hf, prompt, new)
        assert result.tokens == want, (prompt, result.tokens, want)
        assert result.stopped == ("eos" if want[-1] in model.eos_ids() else "length")


@pytest.mark.usefixtures("f32_kernels")   # what the cache holds, not f16's rounding (Qwen3's heads of 16 take it)
@pytest.mark.parametrize("which", ["llama", "qwen3", "granite", "phi3", "olmo2", "smollm3"])
def test_decoding_with_the_cache_equals_recomputing_the_sequence(request, which):
    """Every decode step's logits (GPU, one token over the cache) against the reference
    forward over the whole sequence so far (Qwen3's norms of q and k come before the RoPE
    that a decode step defers into the cache write and the cached attention; Granite's
    attention scale reaches the cached attention; Phi-3's fused projections are sliced;
    OLMo 2's norms of q and k span every head; a SmolLM3 layer without RoPE)."""
    _, path = request.getfixturevalue(which)
    model = load_model(str(path))
    gen = model.generator(backend="gpu")
    ids = [5, 17, 3, 40]
    decode_against_recomputing(path, gen.steps(gen.check(ids, 6)), ids, 6)


def decode_against_recomputing(path, steps, ids: list, count: int) -> None:
    """``count`` greedy steps of ``steps`` after prompt ``ids``, each step's logits (GPU, the
    prefill's, then one token over the cache) against the reference forward over the whole
    sequence so far."""
    logits = steps.run(ids, 0, prefill=True)
    for _ in range(count):
        full = load_model(str(path), [f"seq={len(ids)}"])
        want = full.run({"input_ids": np.array([ids], np.int32)}, backend="reference")["logits"][0, -1]
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        ids.append(int(np.argmax(logits)))
        logits = steps.run(ids[-1:], len(ids) - 1, prefill=False)


def test_decoding_past_one_round_of_keys_equals_recomputing_the_sequence(tmp_path):
    """A prompt of 300 tokens: a cache of 512 rows, which the decode step's attention splits
    into parts that its output projection combines (and whose writes it does itself)."""
    _, path = relative_checkpoint(tmp_path / "long", "Llama", 9, max_position_embeddings=512)
    model = load_model(str(path))
    gen = model.generator(backend="gpu")
    ids = np.random.default_rng(9).integers(1, 96, 300).tolist()
    steps = gen.steps(gen.check(ids, 3))
    variants = [d.variant for d in steps.decode.plan.dispatches]
    assert steps.capacity == 512 and sum("attention parts" in v for v in variants) == 2, variants
    decode_against_recomputing(path, steps, ids, 3)


def test_gpt_tiny_generates_with_its_byte_tokenizer():
    model = models.create("gpt-tiny")
    params = model.init_params(0)
    tok = model.tokenizer()
    prompt = tok.encode("the cat")
    assert prompt[0] == 256 and bytes(prompt[1:]) == b"the cat"
    ref = model.generate(prompt, max_new_tokens=4, params=params, backend="reference")
    gpu = model.generate(prompt, max_new_tokens=4, params=params, backend="gpu")
    assert ref.tokens == gpu.tokens and len(ref.tokens) == 4


def test_the_byte_tokenizer_refuses_ids_it_cannot_decode():
    """gpt-tiny's BOS gives no text, as before; an id that is not a byte is an error, not
    dropped (dropping it printed an empty text for a checkpoint's ids)."""
    tok = models.create("gpt-tiny").tokenizer()
    assert tok.decode([256, 104, 105]) == "hi"
    with pytest.raises(MeganeuraError, match="token id 300 is not a byte"):
        tok.decode([104, 300])


def test_a_tokenizer_file_shows_ids_it_has_no_token_for(tmp_path):
    """A model's vocabulary is often padded past its tokenizer's: such an id is shown, not
    dropped as the tokenizers library drops it."""
    from engine.data.tokenizer import FileTokenizer, byte_tokenizer_json
    path = tmp_path / "tokenizer.json"
    path.write_text(byte_tokenizer_json())
    tok = FileTokenizer(path)
    assert tok.encode("hé") == list("hé".encode())
    assert tok.decode([104, 300, 105, 256]) == "h<id 300>i<id 256>" and tok.decode([104, 105]) == "hi"


def test_decode_graph_has_no_rope_nodes_and_names_its_caches(llama):
    model = load_model(str(llama[1]))
    decode = model.generation_graph(1, 64, prefill=False)
    prefill = model.generation_graph(7, 64, prefill=True)
    assert not any(n.op == "rope" for n in decode.nodes)
    assert sum(n.op == "rope" for n in prefill.nodes) == 4
    caches = {f"kv_cache.{i}" for i in range(2)}
    assert set(decode.parameters) - set(model.parameter_shapes()) == caches
    assert set(prefill.parameters) == set(decode.parameters)
    assert caches < set(decode.outputs) and decode.shape(decode.outputs["logits"]) == (1, 1, 96)
    assert decode.shape(decode.outputs["next_id"]) == (1, 1) and "next_id" not in prefill.outputs
    writes = [n for n in decode.nodes if n.op == "cache_write"]
    assert len(writes) == 2 and all(len(n.inputs) == 4 for n in writes)   # keys and values: one write a layer
    assert decode.shape(decode.parameters["kv_cache.0"]) == (2, 1, 64, 16)


def test_a_deferred_rope_must_reach_attention():
    from engine.graph.kv_cache import generation_graph, rotary

    def logits(g, ids):
        x = g.embedding(g.parameter("table", (10, 8)), ids)
        return rotary(g, x, 2, 100.0)
    with pytest.raises(GraphError, match="without attending"):
        generation_graph("bad", "ids", 1, 16, False, logits)


def test_a_decode_step_allocates_nothing(llama, monkeypatch):
    model = load_model(str(llama[1]))
    gen = model.generator(backend="gpu")
    gen.generate([1, 2, 3], 4)
    session = gen.steps(gen.check([1, 2, 3], 4)).decode
    device_type = type(session.device)
    created = []
    for method in ("create_buffer", "create_bind_group", "create_compute_pipeline"):
        original = getattr(device_type, method)
        monkeypatch.setattr(device_type, method,
                            (lambda m, o: lambda self, *a, **k: created.append(m) or o(self, *a, **k))(method, original))
    again = gen.generate([1, 2, 3], 8)
    assert len(again.tokens) == 8 and len(again.per_token_ms) == 7
    assert created == []


def test_greedy_decoding_runs_ahead_on_the_gpu(llama, monkeypatch):
    """19 decode steps (batches of 8, 8, 3) without reading a step's logits back: the same
    ids as the reference; EOS and a cancel in the middle of a batch stop at that token,
    and the generator is sound for the next call. Sampling reads each step's logits, the
    next step recorded before it waits for them."""
    from engine.train import generation
    model = load_model(str(llama[1]))
    prompt = [5, 17, 3]
    want = model.generate(prompt, 20, backend="reference").tokens
    gen = model.generator(backend="gpu")
    reads, events = [], []
    read_logits, step_commands = generation.read_logits, generation.step_commands
    monkeypatch.setattr(generation, "read_logits",
                        lambda *a: reads.append(1) or events.append("read") or read_logits(*a))
    monkeypatch.setattr(generation, "step_commands", lambda *a: events.append("record") or step_commands(*a))
    got = gen.generate(prompt, 20)
    assert got.tokens == want and len(got.per_token_ms) == 19 and all(ms > 0 for ms in got.per_token_ms)
    assert len(reads) == 1, "only the prefill's logits come back to the host"
    at = want.index(want[10])
    stopped = gen.generate(prompt, 20, eos_ids=[want[10]])
    assert stopped.tokens == want[:at + 1] and stopped.stopped == "eos"
    seen = []
    cancelled = gen.generate(prompt, 20, on_token=lambda t, ms: seen.append(t), should_stop=lambda: len(seen) >= 5)
    assert cancelled.tokens == seen == want[:5] and cancelled.stopped == "cancelled"
    assert gen.generate(prompt, 20).tokens == want
    events.clear()
    sampled = gen.generate(prompt, 6, Sampling(temperature=1e-6, seed=1))   # the host path, one step a read
    assert sampled.tokens == want[:6] and len(reads) == 4 + 6
    assert events == ["record", "read"] + ["record"] + ["record", "read"] * 4 + ["read"]   # the prefill, then ahead


# ---------------------------------------------------------------- sampling and limits

def test_sampling_rules():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    assert Sampling().choose(logits, rng) == 0
    assert all(Sampling(temperature=5.0, top_k=1).choose(logits, rng) == 0 for _ in range(20))
    assert all(Sampling(temperature=1.0, top_p=0.5).choose(logits, rng) == 0 for _ in range(20))
    assert 2 not in {Sampling(temperature=1.0, top_k=2).choose(logits, rng) for _ in range(200)}
    draws = [Sampling(temperature=1.0).choose(logits, rng) for _ in range(4000)]
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 4000, [0.6, 0.3, 0.1], atol=0.03)
    hot = [Sampling(temperature=2.0).choose(logits, rng) for _ in range(4000)]
    flatter = np.exp(logits / 2) / np.exp(logits / 2).sum()
    np.testing.assert_allclose(np.bincount(hot, minlength=3) / 4000, flatter, atol=0.03)
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(MeganeuraError):
            Sampling(**bad)


def test_logits_that_are_not_numbers_are_an_error_naming_the_step(tmp_path, capsys):
    """NaN or +inf logits (an overflow) give no meaningful token: greedy and sampled choices
    refuse them, naming the step; -inf (a masked token) is a number. A checkpoint whose
    weights hold a NaN gets one line from `meganeura generate`, exit status 2."""
    rng = np.random.default_rng(0)
    for bad in (np.nan, np.inf):
        logits = np.array([1.0, bad, 0.5], np.float32)
        for sampling in (Sampling(), Sampling(temperature=0.8), Sampling(temperature=0.8, top_k=2)):
            with pytest.raises(MeganeuraError, match=r"new token 7 \(position 40\): 1 of 3 logits are NaN or \+inf"):
                sampling.choose(logits, rng, "the logits of new token 7 (position 40)")
    assert Sampling(temperature=0.8).choose(np.array([-np.inf, 2.0, 1.0]), rng) in (1, 2)
    hf = llama_relative("Llama", 2)
    with torch.no_grad():
        hf.model.norm.weight[3] = float("nan")
    hf.save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt-ids", "3,9,27", "--max-new-tokens", "4",
                 "--temperature", "0.8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("meganeura: error: the prompt's logits (new token 1): ") and "NaN or +inf" in err


def test_greedy_decoding_on_the_gpu_refuses_logits_that_are_not_numbers(tmp_path):
    """The argmax marks a row holding a NaN with -1, and the host names the step: here the
    embedding of the first new token is NaN (untied, so the prompt's logits are numbers)."""
    prompt = [3, 9, 27]
    hf = llama_relative("Llama", 2)
    hf.save_pretrained(tmp_path / "clean")
    first = load_model(str(tmp_path / "clean")).generate(prompt, 1).tokens[0]
    assert first not in prompt
    with torch.no_grad():
        hf.model.embed_tokens.weight[first] = float("nan")
    hf.save_pretrained(tmp_path / "nan")
    generator = load_model(str(tmp_path / "nan")).generator(backend="gpu")
    with pytest.raises(MeganeuraError, match=r"the logits of new token 2 \(position 3\): they hold NaN"):
        generator.generate(prompt, 12)


def test_sampling_sorts_only_what_it_needs():
    """The top-k candidates are those of a stable sort of the whole vocabulary, in its
    order, whatever the ties, the -inf and the length (runs of FLOOR_BLOCK and a tail)."""
    rng = np.random.default_rng(5)
    values = rng.integers(0, 50, 3000).astype(np.float64)   # many ties
    for k in (1, 7, 46, 47, 1024, 2999, 3000):
        assert largest_first(values, k).tolist() == np.argsort(-values, kind="stable")[:k].tolist()
    vocab = rng.standard_normal(128_256 + 37).astype(np.float32)
    vocab[rng.integers(0, vocab.size, 500)] = np.float32(vocab.max())   # ties at the top
    vocab[rng.integers(0, vocab.size, 500)] = -np.inf
    order = np.argsort(-vocab, kind="stable")
    for k in (1, 50, 501, 1024, 2100):
        assert largest_first(vocab, k).tolist() == order[:k].tolist()


def _nucleus_by_sorting(logits, temperature, top_p):
    """The nucleus as its definition reads: a stable sort of all the logits, the shortest
    prefix whose weights reach top_p of their sum."""
    w = np.exp((logits - logits.max()) * (1.0 / temperature))
    order = np.argsort(-logits, kind="stable")
    cumulative = np.cumsum(w[order], dtype=np.float64)
    return order[:int(np.searchsorted(cumulative, top_p * w.sum(dtype=np.float64))) + 1]


def test_the_nucleus_is_the_shortest_likeliest_prefix():
    """Peaked logits (the nucleus among the likeliest 1,024) and flat ones (most of the
    vocabulary: found from the sorted values), f32 and f64, with ties where it ends."""
    rng = np.random.default_rng(6)
    cases = [rng.standard_normal(5000) * 4, rng.standard_normal(5000) * 0.01,
             (rng.standard_normal(128_256) * 3).astype(np.float32),
             (rng.standard_normal(128_256) * 0.02).astype(np.float32),
             np.round(rng.standard_normal(20_000), 1)]   # many equal values
    for logits in cases:
        for top_p in (0.3, 0.8, 0.95):
            sampling = Sampling(temperature=0.7, top_p=top_p)
            weights = sampling._weights(logits, logits.max())
            kept = sampling.nucleus(logits, weights, logits.max())
            assert sorted(kept.tolist()) == sorted(_nucleus_by_sorting(logits, 0.7, top_p).tolist())
            draws = {sampling.choose(logits, rng) for _ in range(50)}
            assert draws <= set(kept.tolist())


def test_a_draw_follows_its_weights_and_never_takes_a_zero():
    """draw() against numpy's inverse CDF from the same uniform (the blocks only change
    where the sum is found), on weights crossing many blocks; zeros are never drawn, and
    the frequencies follow the weights."""
    rng = np.random.default_rng(7)
    weights = rng.random(1000) ** 8
    weights[::3] = 0.0
    for seed in range(300):
        u = np.random.default_rng(seed).random()
        expected = int(np.searchsorted(np.cumsum(weights), u * weights.sum(), side="right"))
        assert draw(weights, np.random.default_rng(seed)) == expected
    small = np.array([0.0, 3.0, 0.0, 1.0, 6.0], np.float32)
    counts = np.bincount([draw(small, rng) for _ in range(20_000)], minlength=5) / 20_000
    np.testing.assert_allclose(counts, small / small.sum(), atol=0.015)
    last = np.zeros(700)
    last[-1] = 1e-300   # one tiny weight, at the end of a partial block
    assert all(draw(last, rng) == 699 for _ in range(20))
    w = rng.random(128_256).astype(np.float32)
    for target in (0.0, 1.0, 0.37 * w.sum(dtype=np.float64), w.sum(dtype=np.float64) * 0.999):
        cumulative = np.cumsum(w, dtype=np.float64)
        assert reach_blocked(w, target) == min(int(np.searchsorted(cumulative, target)) + 1, w.size)


def test_logits_all_minus_infinity_are_refused():
    with pytest.raises(MeganeuraError, match="every logit is -inf"):
        Sampling(temperature=0.8).choose(np.full(8, -np.inf, np.float32), np.random.default_rng(0), "step 3")


def test_same_seed_same_sample_and_eos_stops(llama):
    model = load_model(str(llama[1]))
    gen = model.generator(backend="reference")
    a = gen.generate([4, 9], 8, Sampling(temperature=1.0, seed=7))
    b = gen.generate([4, 9], 8, Sampling(temperature=1.0, seed=7))
    assert a.tokens == b.tokens
    stop = gen.generate([4, 9], 8, Sampling(temperature=1.0, seed=7), eos_ids=[a.tokens[2]])
    assert stop.tokens == a.tokens[:3] and stop.stopped == "eos"


def test_bad_requests_are_refused(llama):
    model = load_model(str(llama[1]))
    gen = model.generator(backend="reference")
    with pytest.raises(MeganeuraError, match="context length of 48"):
        gen.generate(list(range(40)), 9)
    with pytest.raises(MeganeuraError, match="empty"):
        gen.generate([], 3)
    with pytest.raises(MeganeuraError, match="outside the vocabulary of 96"):
        gen.generate([3, 96], 3)
    with pytest.raises(MeganeuraError, match="does not generate"):
        models.create("mlp").generator()


def test_capacity_and_submission_chunks():
    assert cache_capacity(10, 4096) == 256 and cache_capacity(300, 4096) == 512 and cache_capacity(300, 400) == 400
    chunks = submission_chunks(453)
    assert [len(c) for c in chunks][:5] == [16, 32, 64, 128, 128]
    assert [i for c in chunks for i in c] == list(range(453))


# ---------------------------------------------------------------- the command line

def test_cli_generate_json_and_stream(capsys):
    assert main(["generate", "gpt-tiny", "--prompt", "the cat", "--max-new-tokens", "5", "--json",
                 "--backend", "reference"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = models.create("gpt-tiny")
    want = model.generate(model.tokenizer().encode("the cat"), 5, params=model.init_params(0), backend="reference")
    assert out["tokens"] == want.tokens and out["text"] == model.tokenizer().decode(want.tokens)
    assert out["prompt_tokens"] == 8 and out["stopped"] == "length" and len(out["per_token_ms"]) == 4
    assert out["prefill_seconds"] > 0 and out["decode_tokens_per_second"] > 0 and out["adapter"] is None
    assert out["build_seconds"] > 0
    assert main(["generate", "gpt-tiny", "--prompt-ids", "256,116,104", "--max-new-tokens", "3",
                 "--backend", "reference"]) == 0
    captured = capsys.readouterr()
    assert "3 tokens (length); built in " in captured.err


def test_cli_generate_with_a_tokenizer_json(llama, capsys, tmp_path):
    import shutil
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    folder = tmp_path / "with_tokenizer"
    shutil.copytree(llama[1], folder)
    words = ["hello", "world", "the", "cat", "sat"]
    tok = Tokenizer(tok_models.WordLevel({w: i + 10 for i, w in enumerate(words)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", str(folder), "--prompt", "hello world", "--max-new-tokens", "4", "--json",
                 "--backend", "reference"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 2
    assert out["tokens"] == hf_greedy(llama[0], [10, 11], 4)


@pytest.mark.parametrize("argv,message", [
    (["--prompt-ids", "1,x"], "give integers"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "5000"], "context length"),
    (["--prompt", "hi", "--top-p", "2"], "top-p"),
])
def test_cli_generate_bad_input_exits_2(argv, message, capsys):
    assert main(["generate", "gpt-tiny", "--backend", "reference", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_generate_text_needs_a_tokenizer(gpt2, capsys):
    assert main(["generate", str(gpt2[1]), "--prompt", "hi", "--backend", "reference"]) == 2
    assert "give the prompt as token ids (--prompt-ids" in capsys.readouterr().err


def test_cli_generate_without_a_tokenizer_prints_the_ids(no_tokenizer, capsys):
    """A folder without a tokenizer.json has no tokenizer: the new ids stream as ids and
    --json's text is null (not the ids read as bytes, which dropped every id over 255)."""
    hf, path = no_tokenizer
    argv = ["generate", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--backend", "reference"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] is None and out["tokens"] == hf_greedy(hf, [1, 2, 3], 4)
    assert max(out["tokens"]) >= 256                      # ids no byte tokenizer could show
    assert main(argv) == 0
    assert capsys.readouterr().out == " ".join(map(str, out["tokens"])) + " \n"


def test_cli_generate_text_without_a_tokenizer_names_what_is_missing(no_tokenizer, capsys):
    assert main(["generate", str(no_tokenizer[1]), "--prompt", "hi", "--backend", "reference"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "no tokenizer.json" in captured.err and "--prompt-ids" in captured.err


def test_cli_profile_generate_separates_prefill_and_decode(tmp_path, capsys):
    trace = tmp_path / "gen.json"
    assert main(["profile", "gpt-tiny", "--set", "seq=8", "--generate", "2", "--json", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["phases"] == ["prefill", "decode"] and out["steps"] == 3
    phases = [d["phase"] for d in out["dispatches"]]
    assert set(phases) == {"prefill", "decode"} and phases.count("decode") % 2 == 0
    assert {d["step"] for d in out["dispatches"] if d["phase"] == "prefill"} == {0}
    assert {d["step"] for d in out["dispatches"] if d["phase"] == "decode"} == {1, 2}
    assert any(r["name"].startswith("decode:") and "cached_attention" in r["name"] for r in out["per_kernel"])
    assert all(r["name"].split(":")[0] in ("prefill", "decode") for r in out["per_kernel"])
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    tid_of = {phase: next(t for t, n in names.items() if n.endswith(": " + phase)) for phase in ("prefill", "decode")}
    slices = [e for e in events if e.get("cat") == "gpu"]
    assert {e["tid"] for e in slices if e["name"].endswith("cached_attention")} == {tid_of["decode"]}
    assert len([e for e in slices if e["tid"] == tid_of["prefill"]]) == phases.count("prefill")


def test_cli_profile_generate_says_what_its_steps_take_of_the_context(llama, capsys):
    """N profiled decode steps advance the cache 2N + 2 positions: too many for the
    context is one line naming the most it takes; a seq that does not fit beside them is
    cut, and the progress line says so, and the prefill profiled is that long."""
    assert main(["profile", str(llama[1]), "--generate", "23"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--generate 23 runs 48 decode steps" in err and "give at most 22" in err
    assert main(["profile", str(llama[1]), "--set", "seq=40", "--generate", "3", "--json"]) == 0
    assert "the prompt is cut" not in capsys.readouterr().err   # 40 + 8 fits in 48
    assert main(["profile", str(llama[1]), "--set", "seq=45", "--generate", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert "the prompt is cut to 40 of seq=45 tokens" in captured.err
    assert "prefill of 40 tokens" in captured.err


def test_cli_optimize_generation_graphs(capsys):
    nodes = {}
    for phase in ("decode", "prefill"):
        assert main(["optimize", "gpt-tiny", "--set", "seq=8", "--generate", phase, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["generate"] == phase and out["dispatches_after"] < out["dispatches_before"]
        nodes[phase] = out["nodes_before"]
    assert min(nodes.values()) > 0   # which ops each phase has: test_decode_graph_has_no_rope_nodes...
    assert main(["optimize", "mlp", "--generate", "decode"]) == 2
    assert "does not generate" in capsys.readouterr().err


def test_few_row_fusions_keep_the_outputs_and_cut_dispatches(llama):
    from engine.optimize import cost, optimize
    from engine.optimize.few_rows import fuse_few_rows
    model = load_model(str(llama[1]))
    graph, _ = optimize(model.generation_graph(1, 64, prefill=False))
    fused, counts = fuse_few_rows(graph)
    # per layer: the MLP; q, k, v each take the norm, then run as one norm_matmuls
    assert counts == {"swiglu_matmul": 2, "norm_matmul_shared": 6, "norm_matmuls": 2}
    assert cost.graph_cost(fused)[1] == cost.graph_cost(graph)[1] - 12
    assert not any(n.op in ("rms_norm", "mul", "norm_matmul") for n in fused.nodes if n.id != fused.outputs["logits"])
    packed = [n for n in fused.nodes if n.op == "norm_matmuls"]
    assert [len(n.inputs) for n in packed] == [5, 5]   # x, the norm's weight, wq, wk, wv
    parts = [n for n in fused.nodes if n.op == "part" and fused[n.inputs[0]].op == "norm_matmuls"]
    assert len(parts) == 6 and {m for n in parts for m in n.modules} >= {"model.layers.1.self_attn.v_proj"}
    params = {**model.init_params(), **{k: np.random.default_rng(1).standard_normal(graph.shape(i)).astype(np.float32)
                                        for k, i in graph.parameters.items() if k.startswith("kv_cache.")}}
    inputs = {"input_ids": np.array([[7]], np.int32), "positions": np.array([[5]], np.int32)}
    want, got = reference.run(graph, inputs, params), reference.run(fused, inputs, params)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    prefill, _ = optimize(model.generation_graph(8, 64, prefill=True))
    assert fuse_few_rows(prefill)[1] == {}, "eight rows are not few"


@pytest.mark.parametrize("rows,tb,norm", [(1, False, True), (3, True, False), (2, True, True)])
def test_swiglu_matmul_on_the_gpu(rows, tb, norm):
    rng = np.random.default_rng(rows)
    k, n = 300, 70
    g = Graph("swiglu")
    ops = [g.input("x", (1, rows, k)), g.input("wg", (n, k) if tb else (k, n)), g.input("wu", (n, k) if tb else (k, n))]
    if norm:
        ops.append(g.input("nw", (k,)))
    g.output("y", g.apply("swiglu_matmul", *ops, transpose_b=tb, eps=1e-5))
    inputs = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.inputs.items()}
    session = Session(g)
    session.set_inputs(inputs)
    session.run()
    want = reference.run(g, inputs, {})["y"]
    assert np.abs(session.read_output("y") - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("splits,small", [(1, False), (3, False), (0, False), (0, True)])
def test_vector_products_split_along_k(splits, small, configure):
    """Few-row products cut into K slices, which matmul_splits.wgsl adds up before the
    epilogue: bias, activation and residual, SwiGLU's second product, the norm's sums of
    squares. 1: whole; 3: forced (MEGANEURA_MATMUL_SPLITS); 0: vector_layout's choice,
    K = 1300 allowing 5 slices of at least 256. Weights this small keep 8 columns, whole,
    unless the tuning's ``vector_small_kib`` says otherwise (``small`` False)."""
    if splits:
        configure(matmul_splits=splits)
    caps = device_capabilities()
    if not small:
        caps = dataclasses.replace(caps, tuning=dataclasses.replace(caps.tuning, vector_small_kib=1))
    rng = np.random.default_rng(splits)
    k, n = 1300, 70
    g = Graph("vector-splits")
    x, w, nw = g.input("x", (1, 2, k)), g.input("w", (k, n)), g.input("nw", (k,))
    g.output("fused", g.apply("fused_matmul", x, w, g.input("bias", (n,)), g.input("res", (1, 2, n)),
                              activation="gelu", has_add=True, has_residual=True))
    g.output("transposed", g.matmul(x, g.input("wt", (n, k)), transpose_b=True))
    g.output("swiglu", g.apply("swiglu_matmul", x, w, g.input("wu", (k, n)), nw, transpose_b=False, eps=1e-5))
    g.output("norm", g.apply("norm_matmul", x, nw, w, eps=1e-5, transpose_b=False))
    g.output("batched", g.matmul(g.input("xb", (3, 2, k)), g.input("wb", (3, k, n))))   # a B per batch: 3 x 3 blocks
    inputs = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.inputs.items()}
    session = Session(g, capabilities=caps)
    session.set_inputs(inputs)
    session.run()
    want = reference.run(g, inputs, {})
    for name in g.outputs:   # SwiGLU: silu of one sum times another; the H100 left 2.9e-6 of the largest
        got = session.read_output(name)
        assert np.abs(got - want[name]).max() <= (1e-5 if name == "swiglu" else 2e-6) * np.abs(want[name]).max(), name
    cut = [d.variant for d in session.plan.dispatches if "K split" in d.variant]
    assert len(cut) == (0 if splits == 1 or small else 5), cut
    assert all(f"K split {splits or 5} ways" in v for v in cut)
    wide = sum("32 columns x 8 K slices" in d.variant for d in session.plan.dispatches)
    assert wide == (0 if small else 4)   # B's columns contiguous: all but the transposed


@pytest.mark.parametrize("rows,tb,widths,split", [(1, True, (96, 32, 32), 0), (3, False, (70, 33), 0),
                                                  (2, True, (5, 64, 130), 0), (1, False, (70, 34, 34), 3),
                                                  (3, False, (70, 34, 34), 3)])
def test_norm_matmuls_on_the_gpu(rows, tb, widths, split, configure):
    """Each weight's product lands in its place of the packed result (widths that are and
    are not multiples of the 8 columns a workgroup takes; transposed weights or not). With
    ``split`` (and weights counted large, ``vector_small_kib``): 32 columns a workgroup and,
    for one row, K in that many slices, added by matmul_splits.wgsl with the norm."""
    if split:
        configure(matmul_splits=split)
    caps = device_capabilities()
    if split:
        caps = dataclasses.replace(caps, tuning=dataclasses.replace(caps.tuning, vector_small_kib=1))
    rng = np.random.default_rng(rows)
    k = 1300 if split else 300
    g = Graph("norm_matmuls")
    x, nw = g.input("x", (1, rows, k)), g.input("nw", (k,))
    weights = [g.input(f"w{i}", (n, k) if tb else (k, n)) for i, n in enumerate(widths)]
    g.output("y", g.apply("norm_matmuls", x, nw, *weights, transpose_b=tb, eps=1e-5))
    inputs = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.inputs.items()}
    session = Session(g, capabilities=caps)
    session.set_inputs(inputs)
    session.run()
    variant = session.plan.dispatches[0].variant
    assert variant.startswith(f"{rows}-row vector kernel, {32 if split else 8} columns")
    assert variant.endswith(f"{len(widths)} weights ({' + '.join(map(str, widths))} columns)")
    assert ("K split" in variant) == bool(split and rows == 1) and (not split or f"K split {split} ways" in variant
                                                                   or rows > 1)
    want = reference.run(g, inputs, {})["y"]
    got = session.read_output("y")
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    xn = inputs["x"] / np.sqrt((inputs["x"].astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * inputs["nw"]
    _, offsets, _ = norm_matmuls_layout((1, rows, k), [g.shape(w) for w in weights], tb)
    for i, at in enumerate(offsets):
        w = inputs[f"w{i}"].astype(np.float64)
        part = got[at:at + rows * widths[i]].reshape(1, rows, widths[i])
        assert np.abs(part - xn @ (w.T if tb else w)).max() <= 1e-5 * np.abs(xn @ (w.T if tb else w)).max()


def test_prompts_of_nearby_lengths_share_one_padded_prefill(llama):
    """A GPU prefill runs its prompt padded at its end to PREFILL_ROUND tokens (at most the
    context, 48 here): prompts of 3, 10 and 47 tokens share one session, each gives the
    logits of its own last row as the reference's unpadded prefill does, and the padding's
    cache rows do not change the ids that follow."""
    from engine.train.generation import prefill_length
    model = load_model(str(llama[1]))
    gpu, ref = model.generator(backend="gpu"), model.generator(backend="reference")
    rng = np.random.default_rng(5)
    for length in (3, 10, 47):
        prompt = rng.integers(1, model.vocab_size, length).tolist()
        capacity = gpu.check(prompt, 1)
        assert prefill_length(length, capacity, model.context_length) == 48
        got = gpu.steps(capacity).run(prompt, 0, prefill=True)
        want = ref.steps(capacity).run(prompt, 0, prefill=True)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        new = min(4, model.context_length - length)
        assert gpu.generate(prompt, new).tokens == ref.generate(prompt, new).tokens
    assert list(gpu.steps(capacity).prefills) == [48]
    assert [prefill_length(n, 1024, 2048) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert prefill_length(700, 768, 2048) == 704 and prefill_length(750, 760, 760) == 760


def test_a_generator_keeps_a_few_prefill_sessions(llama, monkeypatch):
    from engine.train import generation
    from engine.train.generation import MAX_PREFILLS
    monkeypatch.setattr(generation, "PREFILL_ROUND", 1)   # a session per prompt length
    model = load_model(str(llama[1]))
    gen = model.generator(backend="gpu")
    for length in range(1, MAX_PREFILLS + 3):
        gen.generate(list(range(1, length + 1)), 1)
    steps = gen.steps(gen.check([1], 1))
    assert list(steps.prefills) == list(range(3, MAX_PREFILLS + 3))
