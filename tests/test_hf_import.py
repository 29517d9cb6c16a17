"""Hugging Face checkpoint import (engine/importers/hf/) against transformers itself:
tiny randomly initialised models saved with save_pretrained, loaded with load_model,
outputs compared in f32 on the reference backend and on the GPU (lavapipe)."""

from __future__ import annotations

import json

from llama_checkpoint import llama_relative
import numpy as np
import pytest

import torch
import transformers

from engine.errors import MeganeuraError, ModelImportError
from engine.importers import load_model

B, T = 2, 8
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("f32_kernels")   # the comparisons are f32's


def rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def save(model, path, **kw):
    model.eval()
    model.save_pretrained(path, **kw)
    return path


def llama(tie=True, **extra):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tie, **extra)
    return transformers.LlamaForCausalLM(cfg).eval()


# Llama's relatives: (transformers' class prefix, config fields beyond llama_relative's small shape).
RELATIVES = {
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(head_dim=16, attention_bias=True)),
    "mistral": ("Mistral", dict(sliding_window=16)),
    "granite": ("Granite", dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3,
                                logits_scaling=2.5, attention_bias=True, tie_word_embeddings=True)),
    "phi3": ("Phi3", dict(sliding_window=16, pad_token_id=0)),
    "olmo2": ("Olmo2", dict(attention_bias=True, pad_token_id=0)),
    "smollm3": ("SmolLM3", dict(no_rope_layers=[1, 0], pad_token_id=0)),
    "llama-biases": ("Llama", dict(attention_bias=True, mlp_bias=True)),
    # Llama 3.1/3.2's RoPE scaling; its original context of 16 puts this head's wavelengths in all three bands
    "llama-llama3-rope": ("Llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
}


def relative(which, **fields):
    """``llama_relative`` of the family ``which`` names in RELATIVES."""
    family, extra = RELATIVES[which]
    return llama_relative(family, 4, **{**extra, **fields})


def gpt2():
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=110, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def ids(vocab, seed=0, dtype=np.int32):
    return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(dtype)


def torch_logits(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x.astype(np.int64))).logits.numpy()


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):
    hf = llama(tie=True)
    return hf, save(hf, tmp_path_factory.mktemp("llama_tied"))


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    hf = gpt2()
    return hf, save(hf, tmp_path_factory.mktemp("gpt2"))


# ---------------------------------------------------------------- forward matches

def test_llama_tied_gqa_matches_transformers_reference_and_gpu(llama_tied):
    hf, path = llama_tied
    model = load_model(str(path), ["batch=2", "seq=8"])
    assert "lm_head.weight" not in model.parameter_shapes()
    x = ids(120)
    ref = torch_logits(hf, x)
    out = model.run({"input_ids": x}, backend="reference")["logits"]
    assert out.shape == (B, T, 120)
    assert rel(out, ref) < TOL
    gpu = model.run({"input_ids": x}, backend="gpu")["logits"]
    assert rel(gpu, ref) < TOL


def test_llama_untied_with_wide_heads_matches_transformers(tmp_path):
    hf = llama(tie=False, head_dim=16)  # 4 heads of 16 on a width of 32
    model = load_model(str(save(hf, tmp_path)), ["batch=2", "seq=8"])
    assert model.parameter_shapes()["lm_head.weight"] == (32, 120)
    assert model.parameter_shapes()["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    x = ids(120, seed=3)
    ref = torch_logits(hf, x)
    assert rel(model.run({"input_ids": x}, backend="reference")["logits"], ref) < TOL


@pytest.mark.parametrize("which", sorted(RELATIVES))
def test_llama_relatives_match_transformers_reference_and_gpu(tmp_path, which):
    hf = relative(which)
    model = load_model(str(save(hf, tmp_path)), ["batch=2", "seq=8"])
    shapes = model.parameter_shapes()
    assert set(shapes) == {n for n, _ in hf.named_parameters()} - ({"lm_head.weight"} if model.tied else set())
    assert model.summary()["model_type"] == which.split("-")[0]
    if which == "llama-llama3-rope":
        assert model.c["rope_scaling"] == ("llama3", 8.0, 1.0, 4.0, 16.0)
    x = ids(120, seed=6)
    ref = torch_logits(hf, x)
    assert rel(model.run({"input_ids": x}, backend="reference")["logits"], ref) < TOL
    assert rel(model.run({"input_ids": x}, backend="gpu")["logits"], ref) < TOL


@pytest.mark.parametrize("rope", [
    dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192, rope_theta=500000.0),                 # Llama 3.2's
    dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=3.0,
         original_max_position_embeddings=64, rope_theta=10000.0),
    dict(rope_type="linear", factor=2.5, rope_theta=10000.0),
    dict(rope_type="default", rope_theta=1000000.0)])
def test_rope_frequencies_equal_transformers(rope):
    """RoPE's inverse frequencies, as the importer reads a config and the kernels and the
    reference compute them, against transformers' own functions (which work in f32)."""
    from engine.graph.ops import rope_inverse_frequencies
    from engine.importers.hf.base import ConfigReader
    from engine.importers.hf.llama import rope_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=rope)
    compute = ROPE_INIT_FUNCTIONS.get(rope["rope_type"])
    want = (compute(cfg, "cpu")[0] if compute else
            1.0 / rope["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128)).numpy()
    reader = ConfigReader({"rope_parameters": rope}, "llama")
    theta, scaling = rope_config(reader)
    assert not reader.refused and theta == rope["rope_theta"]
    got = rope_inverse_frequencies(128, theta, scaling)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    if rope["rope_type"] != "default":      # the scaling moves some frequencies
        assert not np.allclose(got, rope_inverse_frequencies(128, theta))
    # older configs: rope_theta at the top, the scaling in rope_scaling
    legacy = ConfigReader({"rope_theta": rope["rope_theta"],
                           "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}, "llama")
    assert rope_config(legacy) == (theta, scaling) and not legacy.refused


def test_qwen3_head_dim_defaults_to_128_as_in_transformers(tmp_path):
    """An older config.json may leave head_dim out: Qwen3 then has heads of 128, not
    hidden_size / num_attention_heads."""
    hf = relative("qwen3", head_dim=128)
    save(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(str(tmp_path), ["batch=2", "seq=8"])
    assert model.parameter_shapes()["model.layers.0.self_attn.q_proj.weight"] == (32, 4 * 128)
    x = ids(120, seed=10)
    assert rel(model.run({"input_ids": x}, backend="reference")["logits"], torch_logits(hf, x)) < TOL


def test_sliding_windows_bound_the_sequence_where_full_attention_is_exact(tmp_path, capsys):
    """Mistral's window covers every layer; Qwen's only with use_sliding_window, from
    max_window_layers on. Up to the window, windowed and full attention agree, so the
    importer allows sequences that long and refuses longer ones by name."""
    from engine.cli import main
    mistral = load_model(str(save(relative("mistral"), tmp_path / "mistral")))
    assert mistral.context_length == 16 and "sliding_window=16" in mistral.summary()["context_note"]
    with pytest.raises(MeganeuraError, match="16"):
        load_model(str(tmp_path / "mistral"), ["seq=17"])
    assert main(["inspect", str(tmp_path / "mistral")]) == 0
    assert "context     16 tokens (sliding_window=16" in capsys.readouterr().out
    plain = load_model(str(save(relative("mistral", sliding_window=None), tmp_path / "plain")))
    assert plain.context_length == 64 and "context_note" not in plain.summary()
    off = load_model(str(save(relative("qwen2", sliding_window=8), tmp_path / "off")))
    assert off.context_length == 64          # use_sliding_window is false
    on = save(relative("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1), tmp_path / "on")
    assert json.loads((on / "config.json").read_text())["layer_types"] == ["full_attention", "sliding_attention"]
    assert load_model(str(on)).context_length == 8
    config = json.loads((on / "config.json").read_text())
    config["layer_types"] = ["full_attention", "chunked_attention"]
    (on / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelImportError, match="layer_types.*chunked_attention"):
        load_model(str(on))


def test_gpt2_matches_transformers_reference_and_gpu(gpt2_ckpt):
    hf, path = gpt2_ckpt
    model = load_model(str(path), ["batch=2", "seq=8"])
    x = ids(110, seed=1)
    ref = torch_logits(hf, x)
    assert rel(model.run({"input_ids": x}, backend="reference")["logits"], ref) < TOL
    assert rel(model.run({"input_ids": x}, backend="gpu")["logits"], ref) < TOL


def test_bert_matches_transformers(tmp_path):
    torch.manual_seed(2)
    cfg = transformers.BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, type_vocab_size=2)
    hf = transformers.BertModel(cfg).eval()
    model = load_model(str(save(hf, tmp_path)), ["batch=2", "seq=8"])
    x = ids(90, seed=2)
    types = np.zeros_like(x)
    types[:, T // 2:] = 1
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(x).long(), token_type_ids=torch.from_numpy(types).long())
        ref0 = hf(input_ids=torch.from_numpy(x).long())
    out = model.run({"input_ids": x, "token_type_ids": types}, backend="reference")
    assert rel(out["last_hidden_state"], ref.last_hidden_state.numpy()) < TOL
    assert rel(out["pooler_output"], ref.pooler_output.numpy()) < TOL
    default = model.run({"input_ids": x}, backend="reference")  # token_type_ids default to zeros
    assert rel(default["last_hidden_state"], ref0.last_hidden_state.numpy()) < TOL
    gpu = model.run({"input_ids": x, "token_type_ids": types}, backend="gpu")
    assert rel(gpu["last_hidden_state"], ref.last_hidden_state.numpy()) < TOL
    assert rel(gpu["pooler_output"], ref.pooler_output.numpy()) < TOL
    types[0, 0] = 2
    with pytest.raises(MeganeuraError, match=r"token_type_ids.* 2\b"):
        model.run({"input_ids": x, "token_type_ids": types}, backend="reference")


def test_whisper_encoder_matches_transformers(tmp_path):
    torch.manual_seed(3)
    cfg = transformers.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, num_mel_bins=16,
                                     max_source_positions=8, max_target_positions=8, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1)
    hf = transformers.WhisperModel(cfg).eval()
    model = load_model(str(save(hf, tmp_path)), ["batch=2"])
    assert any(k.startswith("decoder.") for k in model.summary()["ignored_tensors"])
    mel = np.random.default_rng(4).normal(size=(B, 16, 16)).astype(np.float32)
    with torch.no_grad():
        ref = hf.encoder(torch.from_numpy(mel)).last_hidden_state.numpy()
    assert rel(model.run({"mel": mel}, backend="reference")["last_hidden_state"], ref) < TOL
    assert rel(model.run({"mel": mel}, backend="gpu")["last_hidden_state"], ref) < TOL


# ---------------------------------------------------------------- file variants

@pytest.mark.parametrize("dtype,tag", [("bfloat16", b"BF16"), ("float16", b"F16")])
def test_half_precision_checkpoint_loads_the_rounded_weights(tmp_path, dtype, tag):
    hf = llama(tie=True)
    save(hf.to(getattr(torch, dtype)), tmp_path)
    text = (tmp_path / "model.safetensors").read_bytes()[:4000]
    assert b'"dtype":"' + tag + b'"' in text
    model = load_model(str(tmp_path), ["batch=2", "seq=8"])
    params = model.init_params()
    for name, value in hf.state_dict().items():
        if name in params:
            want = value.float().numpy()
            got = params[name].T if name in model.weight_transposes else params[name]
            np.testing.assert_array_equal(got, want)
    x = ids(120)
    ref = torch_logits(hf.float(), x)  # the bf16-rounded weights, computed in f32
    assert rel(model.run({"input_ids": x}, backend="reference")["logits"], ref) < TOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = gpt2()
    save(hf, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    shards = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) > 1
    reads = []
    model = load_model(str(tmp_path), ["batch=2", "seq=8"], progress=lambda done, total: reads.append((done, total)))
    x = ids(110, seed=5)
    assert rel(model.run({"input_ids": x}, backend="reference")["logits"], torch_logits(hf, x)) < TOL
    # the read's progress over all the shards: one report a tensor, rising to the shards' bytes
    total = sum((tmp_path / shard).stat().st_size for shard in set(shards))
    assert len(reads) == len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    assert {t for _, t in reads} == {total} and reads[-1][0] == total
    assert all(a < b for (a, _), (b, _) in zip(reads, reads[1:]))

    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop()
    with pytest.raises(Stop):   # what the callback raises ends the read (the Studio's Cancel)
        load_model(str(tmp_path), ["batch=2", "seq=8"], progress=stop)


def test_gpt2_file_without_prefix_and_with_mask_buffers(tmp_path, gpt2_ckpt):
    """The original openai-community/gpt2 layout: ``h.0...`` names plus causal-mask buffers."""
    from safetensors.numpy import load_file, save_file
    hf, path = gpt2_ckpt
    tensors = {k[len("transformer."):]: v for k, v in load_file(str(path / "model.safetensors")).items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((32, 32), np.float32))[None, None]
        tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = load_model(str(tmp_path), ["batch=2", "seq=8"])
    assert "wte.weight" in model.parameter_shapes()
    x = ids(110, seed=11)
    assert rel(model.run({"input_ids": x}, backend="reference")["logits"], torch_logits(hf, x)) < TOL
    tensors["h.1.attn.bias"] = np.ones((1, 1, 32, 32), np.float32)  # not causal: refused, named
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelImportError, match=r"h\.1\.attn\.bias"):
        load_model(str(tmp_path), ["batch=2", "seq=8"])


# ---------------------------------------------------------------- training loss

@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_causal_lm_loss_equals_transformers(which, llama_tied, gpt2_ckpt):
    from engine.graph import reference
    hf, path = llama_tied if which == "llama" else gpt2_ckpt
    vocab = hf.config.vocab_size
    model = load_model(str(path), ["batch=2", "seq=8"])
    x = ids(vocab, seed=7)
    labels = ids(vocab, seed=8)
    labels[0, 3] = labels[1, 6] = labels[1, 1] = -100
    with torch.no_grad():
        want = hf(torch.from_numpy(x).long(), labels=torch.from_numpy(labels).long()).loss.item()
    g = model.build(train=True)
    assert set(g.inputs) == {"input_ids", "labels"} and g.shape(g.outputs["loss"]) == ()
    got = reference.run(g, {"input_ids": x, "labels": labels}, model.init_params(), dtype=np.float32)["loss"]
    assert abs(float(got) - want) / abs(want) < TOL


@pytest.mark.parametrize("which", ["llama", "gpt2", "qwen3", "granite", "phi3", "olmo2"])
def test_causal_lm_gpu_training_step_matches_transformers_gradients(which, llama_tied, gpt2_ckpt, tmp_path):
    """One SGD step on the GPU: the loss, and (p_before - p_after) / lr = the gradient,
    against torch's backward (the tied embedding gathers from two uses; Qwen3's q and k
    biases and per-head norms; Granite's multipliers on each path; Phi-3's fused
    projections, their gradients the slices' gradients side by side; OLMo 2's norms after
    each branch). lr is 1000 so that a
    gradient of 1e-5 on a parameter near 1 (the per-head norms') moves it by more than
    f32's rounding of the difference."""
    from engine.train.config import TrainConfig
    from engine.train.session import build_session
    if which in ("qwen3", "granite", "phi3", "olmo2"):
        hf = relative(which)
        path = save(hf, tmp_path)
    else:
        hf, path = llama_tied if which == "llama" else gpt2_ckpt
    vocab = hf.config.vocab_size
    model = load_model(str(path), ["batch=2", "seq=8"])
    x, labels = ids(vocab, seed=12), ids(vocab, seed=13)
    labels[1, 4] = -100
    hf.zero_grad()
    want = hf(torch.from_numpy(x).long(), labels=torch.from_numpy(labels).long()).loss
    want.backward()
    before = model.init_params()
    lr = 1000.0
    session = build_session(model.build(train=True), TrainConfig(optimizer="sgd", lr=lr), before)
    session.set_inputs({"input_ids": x, "labels": labels})
    session.step()
    assert abs(float(session.read_loss()) - want.item()) / want.item() < TOL
    after = session.get_parameters()
    grads = dict(hf.named_parameters())
    assert set(before) == set(grads)
    for name, value in before.items():
        step = (value.astype(np.float64) - after[name]) / lr
        step = step.T if name in model.weight_transposes else step
        assert rel(step, grads[name].grad.numpy()) < 1e-3, name


# ---------------------------------------------------------------- inputs

def test_int64_ids_and_out_of_vocabulary(llama_tied):
    hf, path = llama_tied
    model = load_model(str(path), ["batch=2", "seq=8"])
    x = ids(120, seed=9, dtype=np.int64)
    out = model.run({"input_ids": x}, backend="reference")["logits"]
    assert rel(out, torch_logits(hf, x)) < TOL
    bad = x.copy()
    bad[1, 2] = 120
    with pytest.raises(MeganeuraError, match=r"input_ids.*120"):
        model.run({"input_ids": bad}, backend="reference")
    bad[1, 2] = -1
    with pytest.raises(MeganeuraError, match=r"input_ids.*-1"):
        model.run({"input_ids": bad}, backend="gpu")
    bad[1, 2] = 2**40 + 3                  # was cast to int32: row 3, without a word
    with pytest.raises(MeganeuraError, match=r"input 'input_ids' holds 1099511627779, beyond the int32 range"):
        model.run({"input_ids": bad}, backend="reference")
    summary = model.summary()
    assert summary["model_type"] == "llama"
    assert summary["inputs"] == [{"name": "input_ids", "shape": [2, 8], "dtype": "i32"}]
    assert summary["outputs"] == [{"name": "logits", "shape": [2, 8, 120], "dtype": "f32"}]
    assert summary["parameters"] == sum(p.numel() for p in hf.parameters())
    assert summary["parameter_bytes"] == 4 * summary["parameters"]
    assert summary["ops"]["attention"] == 2 and summary["ops"]["rope"] == 4


# ---------------------------------------------------------------- errors

def test_folder_errors(tmp_path, llama_tied):
    _, good = llama_tied
    with pytest.raises(ModelImportError, match="no config.json"):
        load_model(str(tmp_path))
    config = json.loads((good / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelImportError, match=r"no weights.*model\.safetensors"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ModelImportError, match=r"'mamba'.*llama, qwen2, qwen3, mistral, granite, phi3, olmo2, smollm3, gpt2, bert, whisper"):
        load_model(str(tmp_path))


def test_weights_that_disagree_with_the_config_are_all_named(tmp_path, llama_tied):
    from safetensors.numpy import load_file, save_file
    _, good = llama_tied
    tensors = load_file(str(good / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(ModelImportError) as info:
        load_model(str(tmp_path))
    text = str(info.value)
    assert "\n" not in text
    for name in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.extra.weight", "missing", "unexpected", "mis-shaped"):
        assert name in text


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path, llama_tied):
    from safetensors.numpy import load_file, save_file
    _, good = llama_tied
    tensors = load_file(str(good / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(ModelImportError, match=r"tie_word_embeddings.*lm_head\.weight"):
        load_model(str(tmp_path))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # an identical copy is accepted
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in load_model(str(tmp_path)).parameter_shapes()


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("pretraining_tp", 2),
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}),
    ("hidden_act", "tanh"),
    ("rope_interleaved", True),
    ("partial_rotary_factor", 0.75),                                   # Phi-4-mini's, at the top level
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}),
    ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),   # Phi-3's 128k
])
def test_unsupported_config_fields_are_refused_by_name(tmp_path, llama_tied, field, value):
    import shutil
    _, good = llama_tied
    shutil.copy(good / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((good / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelImportError, match=field):
        load_model(str(tmp_path))
