"""``whisper-tiny``: the Whisper-tiny audio encoder under HuggingFace tensor names.

mel [batch, 80, mel_len] -> conv1 (80->384, k3, pad 1) -> GELU -> conv2 (384->384,
k3, stride 2, pad 1) -> GELU -> [batch, mel_len/2, 384] + embed_positions[:mel_len/2]
-> 4 pre-LayerNorm layers (6-head self-attention with k_proj unbiased, 1536-wide
GELU MLP, residuals) -> layer_norm -> output ``hidden``. GELU is the erf form.

Names are HF's (``model.encoder.layers.0.self_attn.q_proj.weight``...); HF files
store Linear weights [out, in], so ``weight_transposes`` lists them. Conv weights
keep PyTorch's [out, in, k] layout. ``embed_positions`` starts as Whisper's
sinusoids and is not trained (as in HF).

The training graph (Whisper alone has no task) regresses ``hidden`` onto an input
``target`` [batch, mel_len/2, 384] with MSE; the dataset's target is a fixed random
projection of the mel frames, so the loss can go down.
"""

from __future__ import annotations

import numpy as np

from ..graph import nn
from ..data.audio import HOP, N_MELS, clip_features, log_mel_spectrogram, tone
from ..graph.ir import Graph
from .base import BuiltinModel, Setting, at_most, positive

WIDTH, HEADS, LAYERS, FFN, MAX_POSITIONS = 384, 6, 4, 1536, 1500
MAX_MEL_LEN = 2 * MAX_POSITIONS
LN_EPS = 1e-5
LINEAR_INIT = nn.normal(0.02)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, width=WIDTH, heads=HEADS, ffn=FFN):
        self.self_attn = nn.MultiHeadAttention(width, heads, k_bias=False, init=LINEAR_INIT)
        self.self_attn_layer_norm = nn.LayerNorm(width, LN_EPS)
        self.fc1 = nn.Linear(width, ffn, init=LINEAR_INIT)
        self.fc2 = nn.Linear(ffn, width, init=LINEAR_INIT)
        self.final_layer_norm = nn.LayerNorm(width, LN_EPS)

    def forward(self, g, x):
        x = g.add(x, self.self_attn(g, self.self_attn_layer_norm(g, x)))
        h = g.gelu(self.fc1(g, self.final_layer_norm(g, x)))
        return g.add(x, self.fc2(g, h))


class WhisperEncoder(nn.Module):
    """Whisper-tiny's sizes by default; the Hugging Face importer passes a config's
    (num_mel_bins, d_model, encoder_attention_heads, encoder_layers, encoder_ffn_dim,
    max_source_positions)."""

    def __init__(self, n_mels=N_MELS, width=WIDTH, heads=HEADS, layers=LAYERS, ffn=FFN,
                 max_positions=MAX_POSITIONS):
        self.conv1 = nn.Conv1d(n_mels, width, 3, padding=1)
        self.conv2 = nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(max_positions, width, init=nn.sinusoidal())
        self.embed_positions.weight.trainable = False
        self.layers = [WhisperEncoderLayer(width, heads, ffn) for _ in range(layers)]
        self.layer_norm = nn.LayerNorm(width, LN_EPS)

    def forward(self, g, mel, capture=False):
        x = g.gelu(self.conv1(g, mel))
        x = g.gelu(self.conv2(g, x))
        x = g.transpose(x, (0, 2, 1))
        frames = g.shape(x)[1]
        x = g.add(x, g.slice(self.embed_positions.weight.node(g), 0, 0, frames))
        for i, layer in enumerate(self.layers):
            x = layer(g, x)
            if capture:
                nn.capture(g, layer.path, x)
        return self.layer_norm(g, x)


class WhisperTiny(BuiltinModel):
    name = "whisper-tiny"
    description = "Whisper-tiny audio encoder (HuggingFace weight names)"
    SETTINGS = {
        "batch": Setting(1, "clips per step", positive),
        "mel_len": Setting(MAX_MEL_LEN, "mel frames per clip (even, at most 3000 = 30 s)",
                           lambda v: None if 2 <= v <= MAX_MEL_LEN and v % 2 == 0
                           else f"must be an even number from 2 to {MAX_MEL_LEN}"),
        "samples": Setting(8, "dataset size (synthetic tones)", at_most(10_000)),
    }

    def make_module(self):
        return nn.Container(model=nn.Container(encoder=WhisperEncoder()))

    @property
    def encoder(self) -> WhisperEncoder:
        return self.module.model.encoder

    def input_names(self, train):
        return ["mel", "target"] if train else ["mel"]

    def build(self, train=False, batch=None, capture=False) -> Graph:
        batch = batch or self.settings["batch"]
        mel_len = self.settings["mel_len"]
        g = Graph(f"whisper-tiny-{'train' if train else 'infer'}-b{batch}")
        mel = g.input("mel", (batch, N_MELS, mel_len))
        hidden = g.output("hidden", self.encoder(g, mel, capture=capture))
        if train:
            target = g.input("target", g.shape(hidden))
            g.output("loss", g.mse_loss(hidden, target))
        return g

    def dataset(self, seed=0):
        """Tones at random pitches -> log-mel; target: a fixed projection of frame pairs."""
        rng = np.random.default_rng(seed)
        mel_len, n = self.settings["mel_len"], self.settings["samples"]
        seconds = mel_len * HOP / 16_000
        audio = np.stack([tone(f, seconds, rng) for f in rng.uniform(100.0, 2000.0, n)])
        mel = log_mel_spectrogram(audio)[..., :mel_len]
        projection = rng.normal(0.0, 1.0 / np.sqrt(N_MELS), (N_MELS, WIDTH))
        return {"mel": mel.astype(np.float32), "target": frame_targets(mel, projection)}

    def audio_examples(self, clips):
        """A user's clips: their log-mel features, and as target the same kind of fixed
        projection of frame pairs as the synthetic dataset's (drawn from seed 0)."""
        mel = np.stack([clip_features(wave, self.settings["mel_len"]) for _, wave, _ in clips])
        projection = np.random.default_rng(0).normal(0.0, 1.0 / np.sqrt(N_MELS), (N_MELS, WIDTH))
        return {"mel": mel, "target": frame_targets(mel, projection)}


def frame_targets(mel: np.ndarray, projection: np.ndarray) -> np.ndarray:
    """tanh of each pair of mel frames (averaged) through ``projection``: [n, mel_len / 2, 384]."""
    n, _, mel_len = mel.shape
    pairs = mel.reshape(n, N_MELS, mel_len // 2, 2).mean(-1).transpose(0, 2, 1)
    return np.tanh(pairs @ projection).astype(np.float32)
