"""A user's training data (issue 19): arrays, text (a tokenizer.json or bytes), audio (read
with soundfile, resampled, log-mel as transformers' WhisperFeatureExtractor), the
validation hold-out, and every kind of bad data as one line and exit status 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch
import tokenizers
import transformers

from engine import models
from engine.cli import main
from engine.data import audio
from engine.data.datasets import hold_out
from engine.errors import DataError
from engine.importers import load_model
from engine.models.audio_align import text_row
from engine.graph.inputs import IndexRange, index_ranges
from engine.models.gpt import BOS, IGNORE

DOCS = ["the cat sees the moon. ", "a dog finds an apple again. ", "the robot builds the map today. "]


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- audio

def test_log_mel_matches_whisper_feature_extractor():
    """Our clip features against transformers' WhisperFeatureExtractor padded to the same
    length: a 3.3 s clip padded to 5 s (mel_len 500) and cut to 2 s (mel_len 200)."""
    wave = audio.tone(440.0, 3.3, np.random.default_rng(0)) + audio.tone(1250.0, 3.3, None, amplitude=0.1)
    extractor = transformers.WhisperFeatureExtractor()
    for mel_len in (500, 200):
        ref = extractor(wave, sampling_rate=16000, return_tensors="np", max_length=mel_len * 160).input_features[0]
        ours = audio.clip_features(wave, mel_len)
        assert ours.shape == ref.shape == (80, mel_len)
        np.testing.assert_allclose(ours, ref, atol=2e-4)   # measured 6e-5: transformers computes in float32


def test_read_audio_mixes_channels_and_resamples_to_16k(tmp_path):
    """A 22.05 kHz stereo FLAC: the channels averaged and resampled give the same tone
    sampled at 16 kHz directly (away from the filter's edges)."""
    t = np.arange(int(0.5 * 22050)) / 22050
    left, right = 0.4 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 440 * t)
    soundfile.write(tmp_path / "a.flac", np.stack([left, right], 1), 22050, subtype="PCM_24")
    wave = audio.read_audio(tmp_path / "a.flac")
    expected = 0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000)
    assert wave.dtype == np.float32 and len(wave) == 8000
    np.testing.assert_allclose(wave[400:-400], expected[400:-400], atol=2e-3)


def write_clips(folder, seconds=(0.3, 0.5), transcripts=("low tone", "high tone"), rate=16000):
    folder.mkdir()
    for i, (s, text) in enumerate(zip(seconds, transcripts)):
        soundfile.write(folder / f"clip{i}.wav", audio.tone(220.0 * (i + 1), s, None), rate)
        if text is not None:
            (folder / f"clip{i}.txt").write_text(text + "\n")
    return folder


def test_audio_folder_for_audio_align_and_whisper(tmp_path):
    folder = write_clips(tmp_path / "clips")
    model = models.create("audio-align", ["mel_len=40", "seq=12", "batch=1"])
    data = model.training_data(folder)
    assert data.kind == "audio" and len(data) == 2
    waves = [audio.read_audio(folder / f"clip{i}.wav") for i in range(2)]
    np.testing.assert_array_equal(data.arrays["mel"], np.stack([audio.clip_features(w, 40) for w in waves]))
    np.testing.assert_array_equal(data.arrays["tokens"][1], text_row("high tone", 12)[0])
    np.testing.assert_array_equal(data.arrays["targets"][0], text_row("low tone", 12)[1])
    whisper = models.create("whisper-tiny", ["mel_len=40"]).training_data(folder)
    assert whisper.arrays["mel"].shape == (2, 80, 40) and whisper.arrays["target"].shape == (2, 20, 384)


# ---------------------------------------------------------------- text

def test_gpt_tiny_text_is_bos_and_bytes_in_windows(tmp_path):
    """Each document is [BOS] + its UTF-8 bytes; the stream is cut into windows of seq + 1
    that overlap by one token: tokens the first seq, targets the next (the last padded)."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    model = models.create("gpt-tiny", ["seq=16", "batch=2"])
    data = model.training_data(path)
    stream = [t for d in DOCS for t in [BOS, *d.encode()]]
    rows = -(-(len(stream) - 1) // 16)
    assert data.kind == "text" and data.notes == [] and data.arrays["tokens"].shape == (rows, 16)
    for k in range(rows):
        window = stream[16 * k: 16 * k + 17]
        np.testing.assert_array_equal(data.arrays["tokens"][k][:len(window) - 1], window[:-1])
        np.testing.assert_array_equal(data.arrays["targets"][k][:len(window) - 1], window[1:])
        assert (data.arrays["targets"][k][len(window) - 1:] == IGNORE).all()


@pytest.fixture(scope="module")
def gpt2_with_tokenizer(tmp_path_factory):
    """A tiny GPT-2 checkpoint with a word-level tokenizer.json of its own vocabulary."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    words = sorted({w for d in DOCS for w in d.replace(".", " .").split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("gpt2_tok")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=1, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, tokenizer


def test_hf_text_goes_through_the_checkpoint_tokenizer(tmp_path, gpt2_with_tokenizer):
    folder, tokenizer = gpt2_with_tokenizer
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, d in enumerate(DOCS):
        (texts / f"{i}.txt").write_text(d)
    model = load_model(str(folder), ["seq=6", "batch=1"])
    vocab = tokenizer.get_vocab_size()
    assert index_ranges(model.build(train=True)) == {"input_ids": IndexRange(0, vocab),     # via a slice, a concat
                                                     "labels": IndexRange(0, vocab, -100)}
    data = model.training_data(texts)
    stream = [i for d in DOCS for i in tokenizer.encode(d).ids]
    ids, labels = data.arrays["input_ids"], data.arrays["labels"]
    assert data.notes == [] and ids.shape[1] == 6 and len(ids) == -(-(len(stream) - 1) // 5)
    for k in range(len(ids)):   # windows of seq overlapping by one: labels are the ids (the shift is inside)
        window = stream[5 * k: 5 * k + 6]
        np.testing.assert_array_equal(ids[k][:len(window)], window)
        np.testing.assert_array_equal(labels[k][:len(window)], window)
        assert (labels[k][len(window):] == IGNORE).all()


def test_bytes_without_a_tokenizer_json_say_so_once(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "a.txt").write_text("".join(DOCS))
    code, out, err = cli(capsys, "train", tmp_path / "ckpt", "--set", "seq=8", "--data", tmp_path / "a.txt",
                         "--val-data", tmp_path / "a.txt", "--steps", "1", "--backend", "reference",
                         "--run-dir", tmp_path / "run", "--json")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "no tokenizer.json" in line]
    assert len(notes) == 1 and notes[0].startswith("meganeura: note:") and "UTF-8 bytes" in notes[0]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["kind"] == "text" and config["data"]["val"] == str(tmp_path / "a.txt")
    # the checkpoint says how its ids were made: text in, the same bytes as ids, text out
    checkpoint = tmp_path / "run" / "checkpoint-1"
    code, out, err = cli(capsys, "generate", checkpoint, "--prompt", "héllo", "--max-new-tokens", "3",
                         "--backend", "reference", "--json")
    result = json.loads(out)
    assert code == 0 and result["prompt_tokens"] == len("héllo".encode()), err
    tokenizer = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert tokenizer.encode("héllo").ids == list("héllo".encode())
    assert result["text"] == tokenizer.decode(result["tokens"]) and not (tmp_path / "ckpt" / "tokenizer.json").exists()


# ---------------------------------------------------------------- validation split

def test_hold_out_is_the_same_whatever_the_seed_and_keeps_rows_aligned():
    data = {"x": np.arange(40)[:, None] * 10.0, "y": np.arange(40)}
    train, val = hold_out(data, 0.1)
    again, val_again = hold_out(data, 0.1)
    assert len(val["y"]) == 4 and len(train["y"]) == 36
    np.testing.assert_array_equal(val["y"], val_again["y"])
    assert sorted(np.concatenate([train["y"], val["y"]])) == list(range(40))
    np.testing.assert_array_equal(train["x"][:, 0], train["y"] * 10.0)
    assert hold_out(data, 0.0)[1] is None
    with pytest.raises(DataError, match="--val-fraction"):
        hold_out(data, 1.0)


# ---------------------------------------------------------------- bad data

def npz(path, **arrays):
    np.savez(path, **arrays)
    return path


X, LABELS = np.zeros((16, 784), np.float32), np.zeros(16, np.int64)


@pytest.mark.parametrize("case, make, message", [
    ("no array", lambda p: npz(p / "d.npz", x=X),
     "no array for input(s) labels ([N] int32); it holds x"),
    ("dtype", lambda p: npz(p / "d.npz", x=X, labels=LABELS.astype(np.float32)),
     "input 'labels' has dtype float32, expected integers (int32)"),
    ("shape", lambda p: npz(p / "d.npz", x=X[:, :783], labels=LABELS),
     "input 'x' has shape [16, 783], expected [N, 784] (N examples)"),
    ("lengths", lambda p: npz(p / "d.npz", x=X, labels=LABELS[:15]),
     "the arrays disagree on the number of examples (x has 16, labels has 15)"),
    ("empty", lambda p: npz(p / "d.npz", x=X[:0], labels=LABELS[:0]), "the dataset is empty (0 examples)"),
    ("label", lambda p: npz(p / "d.npz", x=X, labels=LABELS + 10),
     "input 'labels' holds 10, outside [0, 10) (or -100 to ignore a position)"),
    ("batch", lambda p: npz(p / "d.npz", x=X[:5], labels=LABELS[:5]),
     "the training data has 5 examples, fewer than one batch of 8"),
    ("no file", lambda p: p / "missing.npz", "no such file or folder"),
    ("not data", lambda p: (p / "notes.md").write_text("hi") and p / "notes.md", "not a data file this reads"),
    ("text for mlp", lambda p: (p / "t.txt").write_text("hi") and p / "t.txt", "does not train on text"),
])
def test_bad_data_is_one_line_and_exit_2(tmp_path, capsys, case, make, message):
    path = make(tmp_path)
    code, out, err = cli(capsys, "train", "mlp", "--set", "batch=8", "--data", path, "--val-fraction", "0",
                         "--backend", "reference", "--run-dir", tmp_path / "run")
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("meganeura: error: ") and message in lines[0], err
    assert not (tmp_path / "run").exists()          # bad data: no run directory is left behind


@pytest.mark.parametrize("case, message", [("unreadable", "cannot read it"), ("no transcript", "no transcript")])
def test_bad_audio_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    folder = write_clips(tmp_path / "clips", transcripts=("low", None if case == "no transcript" else "high"))
    if case == "unreadable":
        (folder / "clip1.wav").write_bytes(b"RIFF\x00\x00\x00\x00not audio at all")
    code, _, err = cli(capsys, "train", "audio-align", "--set", "mel_len=40", "--set", "seq=8", "--set", "batch=1",
                       "--data", folder, "--backend", "reference", "--run-dir", tmp_path / "run")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0] and "clip1" in lines[0], err
