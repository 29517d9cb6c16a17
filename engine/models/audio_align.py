"""``audio-align``: a frozen Whisper-tiny encoder feeding gpt-tiny through a projector.

mel [batch, 80, mel_len] -> whisper-tiny encoder (frozen: parameters not trainable,
output behind stop_gradient) -> ``projector`` (fc1 384->384, GELU, fc2 384->384 with
fc2 zero-initialised, so the model starts by ignoring the audio) -> ``audio_norm``
(RMSNorm) -> audio soft tokens [batch, mel_len/2, 384], prepended to the text
embeddings of gpt-tiny of ``depth`` layers, 6 by default (RoPE positions run over audio,
then text) -> output ``logits`` [batch, seq, 257] over the text positions only; the training graph's
``loss`` is the cross-entropy on those (audio positions never enter it).

Names: the encoder keeps HuggingFace's ``model.encoder.*`` (a Whisper file binds);
``projector.fc1/fc2``, ``audio_norm`` and the decoder under ``gpt.*``.

Dataset (issue 7): five 5-second clips at 16 kHz — sines at 220, 330, 440, 660 and
880 Hz plus the second harmonic at half amplitude and 1% Gaussian noise — with the
transcripts below; ``write_clips`` writes them as PCM16 WAV.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..graph import nn
from ..data.audio import HOP, clip_features, log_mel_spectrogram, pad_or_trim, tone, write_wav
from ..graph.ir import Graph
from .base import BuiltinModel, Setting, positive
from .gpt import DEPTH, GPT, IGNORE, RMS_EPS, encode, next_token_row
from .whisper import MAX_MEL_LEN, N_MELS, WIDTH, WhisperEncoder

CLIPS = ((220.0, "low tone"), (330.0, "mid low tone"), (440.0, "middle tone"),
         (660.0, "mid high tone"), (880.0, "high tone"))
CLIP_SECONDS = 5.0


def text_row(text: str, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens = [BOS] + bytes, targets = the bytes shifted by one; padded with BOS / -100."""
    return next_token_row(encode(text), seq)


class AudioAlign(BuiltinModel):
    name = "audio-align"
    description = "frozen whisper-tiny encoder -> projector -> audio soft tokens prepended to gpt-tiny"
    # The nanochat-omni audio smoke's recipe (issue 7).
    TRAIN_DEFAULTS = {"optimizer": "adamw", "lr": 3e-3, "betas": (0.9, 0.95), "clip_norm": 1.0}
    SETTINGS = {
        "batch": Setting(5, "clips per step", positive),
        "mel_len": Setting(500, "mel frames per clip (even, at most 3000; 5 s = 500)",
                           lambda v: None if 2 <= v <= MAX_MEL_LEN and v % 2 == 0
                           else f"must be an even number from 2 to {MAX_MEL_LEN}"),
        "seq": Setting(16, "text tokens per clip (BOS + transcript, padded)", positive),
        "depth": DEPTH,
    }

    def make_module(self):
        encoder = WhisperEncoder().freeze()
        projector = nn.MLP(WIDTH, WIDTH, WIDTH, activation="gelu", init=nn.normal(0.02), out_init=nn.zeros())
        return nn.Container(model=nn.Container(encoder=encoder), projector=projector,
                            audio_norm=nn.RMSNorm(WIDTH, RMS_EPS), gpt=GPT(depth=self.settings["depth"]))

    def input_names(self, train):
        return ["mel", "tokens", "targets"] if train else ["mel", "tokens"]

    def build(self, train=False, batch=None, capture=False) -> Graph:
        batch = batch or self.settings["batch"]
        mel_len, seq = self.settings["mel_len"], self.settings["seq"]
        m = self.module
        g = Graph(f"audio-align-{'train' if train else 'infer'}-b{batch}")
        mel = g.input("mel", (batch, N_MELS, mel_len))
        tokens = g.input("tokens", (batch, seq), "i32")
        audio_hidden = g.stop_gradient(m.model.encoder(g, mel))
        soft_tokens = m.audio_norm(g, m.projector(g, audio_hidden))
        if capture:
            nn.capture(g, "audio_tokens", soft_tokens)
        x = g.concat([soft_tokens, m.gpt.embed(g, tokens)], axis=1)
        all_logits = m.gpt.decode(g, x, capture=capture)
        audio_len = g.shape(soft_tokens)[1]
        logits = g.output("logits", g.slice(all_logits, 1, audio_len, audio_len + seq))
        if train:
            targets = g.input("targets", (batch, seq), "i32")
            g.output("loss", g.cross_entropy_loss(logits, targets, ignore_index=IGNORE))
        return g

    def clips(self, seed=0) -> np.ndarray:
        """The five clips as float32 audio [5, 80000]."""
        rng = np.random.default_rng(seed)
        return np.stack([tone(f, CLIP_SECONDS, rng, harmonic=0.5, noise=0.01) for f, _ in CLIPS])

    def write_clips(self, folder, seed=0) -> list[Path]:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = [folder / f"clip{i}.wav" for i in range(len(CLIPS))]
        for path, wave in zip(paths, self.clips(seed)):
            write_wav(path, wave)
        return paths

    def dataset(self, seed=0):
        mel_len, seq = self.settings["mel_len"], self.settings["seq"]
        audio = pad_or_trim(self.clips(seed), mel_len * HOP)
        rows = [text_row(text, seq) for _, text in CLIPS]
        return {"mel": log_mel_spectrogram(audio)[..., :mel_len],
                "tokens": np.stack([r[0] for r in rows]), "targets": np.stack([r[1] for r in rows])}

    audio_transcripts = True

    def audio_examples(self, clips):
        """A user's clips with their transcripts: log-mel features, [BOS] + text and its targets."""
        mel_len, seq = self.settings["mel_len"], self.settings["seq"]
        clips = list(clips)
        rows = [text_row(text, seq) for _, _, text in clips]
        return {"mel": np.stack([clip_features(wave, mel_len) for _, wave, _ in clips]),
                "tokens": np.stack([r[0] for r in rows]), "targets": np.stack([r[1] for r in rows])}

    @staticmethod
    def transcripts() -> list[str]:
        return [text for _, text in CLIPS]
