"""The built-in models: registry, settings, forward passes against independent
PyTorch implementations, batch independence, weights files."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_reference as tr
from engine.data import audio
from engine import models
from engine.graph import nn, reference
from engine.errors import MeganeuraError, UnknownModelError
from engine.models.gpt import BOS, IGNORE, decode, encode
from engine.weights import WeightsMismatchError, load_safetensors

REL_TOL = 1e-4
SMALL = {"mlp": {"samples": 64}, "whisper-tiny": {"mel_len": 64, "samples": 2},
         "gpt-tiny": {"seq": 16, "batch": 2, "samples": 4}, "audio-align": {"mel_len": 64, "batch": 2}}


def rel_err(found, expected):
    return float(np.abs(np.asarray(found, np.float64) - expected).max() / np.abs(expected).max())


def jittered_params(model, seed=0):
    """Initial values plus noise, so norms and biases are not trivially 1 and 0."""
    rng = np.random.default_rng(seed + 1)
    return {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32)
            for k, v in model.init_params(seed).items()}


@pytest.fixture(scope="module")
def whisper():
    return models.create("whisper-tiny", **SMALL["whisper-tiny"])


@pytest.fixture(scope="module")
def whisper_params(whisper):
    return jittered_params(whisper)


# ---------------------------------------------------------------- registry and settings

def test_registry_lists_the_builtin_models():
    assert {"mlp", "whisper-tiny", "gpt-tiny", "audio-align"} <= set(models.names())
    for name in models.names():
        assert models.get(name).name == name


def test_unknown_model_names_the_known_ones():
    with pytest.raises(UnknownModelError) as e:
        models.get("whisper-huge")
    assert "whisper-huge" in str(e.value) and "gpt-tiny" in str(e.value) and "mlp" in str(e.value)


def test_settings_parse_from_strings():
    m = models.get("whisper-tiny").from_overrides(["batch=3", "mel_len=500"])
    assert m.settings["batch"] == 3 and m.settings["mel_len"] == 500
    assert m.build().inputs.keys() == {"mel"} and m.build().shape(m.build().outputs["hidden"]) == (3, 250, 384)


@pytest.mark.parametrize("overrides, words", [
    (["depth=3"], ["depth", "batch"]),            # unknown setting lists the known ones
    (["batch=abc"], ["batch", "int"]),
    (["batch=0"], ["batch", "positive"]),
    (["mel_len=63"], ["mel_len", "even"]),
    (["mel_len=3002"], ["mel_len", "3000"]),
    (["batch"], ["NAME=VALUE"]),
])
def test_bad_settings_are_user_errors(overrides, words):
    with pytest.raises(MeganeuraError) as e:
        models.create("whisper-tiny", overrides)
    for w in words:
        assert w in str(e.value)


def test_float_setting_rejects_text():
    with pytest.raises(MeganeuraError, match="noise"):
        models.create("mlp", ["noise=loud"])
    assert models.create("mlp", ["noise=0.25"]).settings["noise"] == 0.25


# ---------------------------------------------------------------- forward against PyTorch

def test_mlp_forward_matches_torch():
    m = models.create("mlp", **SMALL["mlp"])
    params = jittered_params(m)
    x = m.example_inputs(batch=4)["x"]
    out = reference.run(m.build(batch=4), {"x": x}, params)["logits"]
    assert rel_err(out, tr.mlp_logits(x, m.to_file_layout(params))) < REL_TOL


@pytest.mark.parametrize("batch", [1, 2])
def test_whisper_forward_matches_torch(whisper, whisper_params, batch):
    mel = whisper.dataset(0)["mel"][:batch]
    out = reference.run(whisper.build(batch=batch), {"mel": mel}, whisper_params)["hidden"]
    assert out.shape == (batch, 32, 384)
    assert rel_err(out, tr.whisper_encoder(mel, whisper.to_file_layout(whisper_params))) < REL_TOL


def test_whisper_batch_of_two_equals_two_single_runs(whisper, whisper_params):
    mel = whisper.dataset(0)["mel"]
    both = reference.run(whisper.build(batch=2), {"mel": mel}, whisper_params)["hidden"]
    single = whisper.build(batch=1)
    for i in range(2):
        alone = reference.run(single, {"mel": mel[i:i + 1]}, whisper_params)["hidden"]
        np.testing.assert_allclose(both[i:i + 1], alone, rtol=1e-5, atol=1e-5)


def test_gpt_forward_and_loss_match_torch():
    m = models.create("gpt-tiny", **SMALL["gpt-tiny"])
    params = jittered_params(m)
    data = m.example_inputs(train=True)
    out = reference.run(m.build(train=True), data, params)
    logits = tr.gpt_logits(data["tokens"], m.to_file_layout(params))
    assert rel_err(out["logits"], logits.numpy()) < REL_TOL
    loss = F.cross_entropy(logits.reshape(-1, 257), torch.from_numpy(data["targets"].astype(np.int64)).reshape(-1),
                           ignore_index=IGNORE)
    assert abs(float(out["loss"]) - loss.item()) < REL_TOL * loss.item()


@pytest.mark.parametrize("name", ["gpt-tiny", "audio-align"])
def test_decoder_depth_is_a_setting_and_weights_of_another_depth_are_refused_by_name(name):
    """``--set depth=N`` builds N decoder layers (the torch reference reads its depth from
    the weights); a file of the default 6 layers names the 32 tensors depth 2 lacks."""
    m = models.create(name, **SMALL[name], depth=2)
    prefix = "gpt." if name == "audio-align" else ""
    layers = {k.removeprefix(prefix).split(".")[1] for k in m.parameter_shapes() if k.startswith(prefix + "layers.")}
    assert layers == {"0", "1"}
    params = jittered_params(m)
    data = m.example_inputs(train=True)
    out = reference.run(m.build(train=True), data, params)["logits"]
    file = m.to_file_layout(params)
    theirs = (tr.gpt_logits(data["tokens"], file).numpy() if name == "gpt-tiny"
              else tr.audio_align_logits(data["mel"], data["tokens"], file))
    assert rel_err(out, theirs) < REL_TOL
    deeper = models.create(name, **SMALL[name])
    with pytest.raises(WeightsMismatchError, match=rf"32 unexpected: {prefix}layers\.2\.attn_norm\.weight"):
        m.bind(deeper.to_file_layout(deeper.init_params(0)))


def test_training_graphs_add_a_scalar_loss_and_share_parameter_names():
    for name in models.names():
        m = models.create(name, **SMALL[name])
        infer, train = m.build(train=False, batch=1), m.build(train=True)
        assert "loss" not in infer.outputs and train.shape(train.outputs["loss"]) == ()
        assert infer.parameters.keys() == train.parameters.keys() == m.parameter_shapes().keys()
        loss = reference.run(train, m.example_inputs(train=True), m.init_params(0))["loss"]
        assert np.isfinite(loss) and loss > 0


def test_gpt_causal_prefix_independence():
    """Changing a later token leaves the logits of earlier positions unchanged."""
    m = models.create("gpt-tiny", **SMALL["gpt-tiny"])
    params, g = m.init_params(0), m.build(batch=1)
    tokens = m.example_inputs(batch=1)["tokens"].copy()
    before = reference.run(g, {"tokens": tokens}, params)["logits"]
    tokens[0, 10] = (tokens[0, 10] + 1) % 256
    after = reference.run(g, {"tokens": tokens}, params)["logits"]
    np.testing.assert_array_equal(before[0, :10], after[0, :10])
    assert not np.allclose(before[0, 10:], after[0, 10:])


@pytest.fixture(scope="module")
def align():
    return models.create("audio-align", **SMALL["audio-align"])


def test_audio_align_forward_and_loss_match_torch(align):
    params = jittered_params(align)
    data = align.example_inputs(train=True)
    out = reference.run(align.build(train=True), data, params)
    logits = tr.audio_align_logits(data["mel"], data["tokens"], align.to_file_layout(params))
    assert out["logits"].shape == (2, 16, 257)
    assert rel_err(out["logits"], logits) < REL_TOL
    loss = F.cross_entropy(torch.from_numpy(logits).reshape(-1, 257),
                           torch.from_numpy(data["targets"].astype(np.int64)).reshape(-1), ignore_index=IGNORE)
    assert abs(float(out["loss"]) - loss.item()) < REL_TOL * loss.item()


def test_audio_align_starts_by_ignoring_audio_and_freezes_the_encoder(align):
    g, params = align.build(capture=True, batch=1), align.init_params(0)
    tokens = align.example_inputs(batch=1)["tokens"]
    runs = [reference.run(g, {"mel": mel, "tokens": tokens}, params)
            for mel in align.dataset(0)["mel"][[0, 4], None]]
    np.testing.assert_array_equal(nn.read_captures(runs[0])["audio_tokens"], 0)
    np.testing.assert_array_equal(runs[0]["logits"], runs[1]["logits"])
    frozen = {k for k, meta in g.param_meta.items() if not meta["trainable"]}
    assert frozen == {k for k in g.parameters if k.startswith("model.encoder.")}
    assert "model.encoder.layers.3.fc2.weight" in frozen


def test_audio_align_dataset_is_the_five_tone_clips(tmp_path, align):
    data = align.dataset(0)
    assert data["mel"].shape == (5, 80, 64)
    assert [decode(t[t != IGNORE]) for t in data["targets"]] == align.transcripts()
    assert (data["tokens"][:, 0] == BOS).all()
    assert align.transcripts() == ["low tone", "mid low tone", "middle tone", "mid high tone", "high tone"]
    clips = align.clips(0)
    assert clips.shape == (5, 80_000)
    spectrum = np.abs(np.fft.rfft(clips[2]))
    assert np.argmax(spectrum) * audio.SAMPLE_RATE / clips.shape[1] == pytest.approx(440, abs=1)
    path = align.write_clips(tmp_path)[2]
    wave, rate = audio.read_wav(path)
    assert rate == 16_000 and np.abs(wave - clips[2]).max() < 2 / 32767


# ---------------------------------------------------------------- names and weights files

def test_whisper_uses_huggingface_names_and_transposes(whisper):
    shapes = whisper.parameter_shapes()
    assert shapes["model.encoder.conv1.weight"] == (384, 80, 3)
    assert shapes["model.encoder.embed_positions.weight"] == (1500, 384)
    assert shapes["model.encoder.layers.3.fc1.weight"] == (384, 1536)
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in shapes
    assert "model.encoder.layers.0.self_attn.q_proj.bias" in shapes
    assert {"model.encoder.layer_norm.weight", "model.encoder.layers.2.final_layer_norm.bias",
            "model.encoder.layers.1.self_attn_layer_norm.weight"} <= shapes.keys()
    expected_t = {f"model.encoder.layers.{i}.{p}.weight" for i in range(4)
                  for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                            "self_attn.out_proj", "fc1", "fc2")}
    assert whisper.weight_transposes == expected_t
    assert len(shapes) == 4 + 1 + 4 * 15 + 2


def test_save_load_round_trip_gives_identical_outputs(tmp_path, whisper, whisper_params):
    path = tmp_path / "whisper.safetensors"
    whisper.save_weights(whisper_params, path)
    stored = load_safetensors(path)
    assert stored["model.encoder.layers.0.fc1.weight"].shape == (1536, 384)  # HF layout on disk
    loaded = whisper.load_weights(path)
    assert loaded.keys() == whisper_params.keys()
    mel = {"mel": whisper.dataset(0)["mel"][:1]}
    g = whisper.build(batch=1)
    np.testing.assert_array_equal(reference.run(g, mel, loaded)["hidden"],
                                  reference.run(g, mel, whisper_params)["hidden"])


def test_whisper_weights_with_missing_and_misshaped_tensors_name_both(tmp_path, whisper, whisper_params):
    tensors = whisper.to_file_layout(whisper_params)
    del tensors["model.encoder.layers.2.fc2.bias"]
    tensors["model.encoder.conv2.weight"] = tensors["model.encoder.conv2.weight"][:, :, :2]
    with pytest.raises(WeightsMismatchError) as e:
        whisper.bind(tensors, source="broken.safetensors")
    text = str(e.value)
    assert "model.encoder.layers.2.fc2.bias" in text and "model.encoder.conv2.weight" in text
    assert "[384, 384, 3]" in text and "[384, 384, 2]" in text and "broken.safetensors" in text


# ---------------------------------------------------------------- datasets and tokenizer

def test_mlp_dataset_is_learnable_by_nearest_class_mean():
    data = models.create("mlp", samples=400).dataset(3)
    x, y = data["x"], data["labels"]
    means = np.stack([x[:200][y[:200] == c].mean(0) for c in range(10)])
    predicted = np.argmin(((x[200:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (predicted == y[200:]).mean() > 0.9
    assert x.dtype == np.float32 and y.dtype == np.int32


def test_datasets_are_deterministic_per_seed():
    m = models.create("gpt-tiny", **SMALL["gpt-tiny"])
    a, b, c = m.dataset(1), m.dataset(1), m.dataset(2)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], c["tokens"])


def test_byte_tokenizer_round_trip():
    text = "low tone, naïve café ☕"
    ids = encode(text)
    assert ids[0] == BOS and max(ids[1:]) < 256 and len(ids) == 1 + len(text.encode("utf-8"))
    assert decode(ids) == text


def test_gpt_targets_are_the_shifted_tokens():
    data = models.create("gpt-tiny", seq=64, samples=3).dataset(0)
    tokens, targets = data["tokens"], data["targets"]
    assert (tokens[:, 0] == BOS).all()
    # Where the next position is still text, the target is the next input token.
    both_text = (targets[:, :-1] != IGNORE) & (targets[:, 1:] != IGNORE)
    np.testing.assert_array_equal(targets[:, :-1][both_text], tokens[:, 1:][both_text])
    assert both_text.sum() > 100
    assert decode(tokens[0]).startswith(("the ", "a ", "my "))


@pytest.mark.parametrize("dtype, eps", [(torch.float16, 2.0 ** -11), (torch.bfloat16, 2.0 ** -8)])
def test_whisper_weights_in_half_precision_load_and_match_f32(tmp_path, whisper, whisper_params, dtype, eps):
    """A file written by torch/safetensors in f16 or bf16 loads through load_weights (widened
    to float32, transposes applied) and gives the f32 weights' outputs within the format's
    precision: each weight is rounded exactly as torch rounds it, and the output moves by
    about the relative rounding error (unit roundoff ``eps``) of the weights (measured:
    1.5 eps for both formats)."""
    from safetensors.torch import save_file
    file_layout = whisper.to_file_layout(whisper_params)
    path = tmp_path / f"whisper-{str(dtype).split('.')[-1]}.safetensors"
    save_file({k: torch.from_numpy(v).to(dtype) for k, v in file_layout.items()}, str(path))
    loaded = whisper.load_weights(path)
    assert loaded.keys() == whisper_params.keys()
    for name, value in loaded.items():
        assert value.dtype == np.float32 and value.shape == whisper_params[name].shape
        rounded = torch.from_numpy(file_layout[name]).to(dtype).float().numpy()
        np.testing.assert_array_equal(value, rounded.T if name in whisper.weight_transposes else rounded)
        assert np.abs(value - whisper_params[name]).max() <= eps * np.abs(whisper_params[name]).max()
    mel = {"mel": whisper.dataset(0)["mel"][:1]}
    g = whisper.build(batch=1)
    full = reference.run(g, mel, whisper_params)["hidden"]
    half = reference.run(g, mel, loaded)["hidden"]
    err = rel_err(half, full)
    assert 0 < err < 5 * eps, f"{dtype}: relative error {err:.2e} vs unit roundoff {eps:.1e}"
