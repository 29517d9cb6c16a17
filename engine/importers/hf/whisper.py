"""Whisper checkpoints: their encoder, as the built-in whisper-tiny's graph."""

from __future__ import annotations

import numpy as np

from ...errors import MeganeuraError
from ...graph import nn
from ...graph.ir import Graph
from ...models.base import Setting, at_most, positive
from .base import HFModel


class WhisperModel(HFModel):
    model_type = "whisper"
    description = "Whisper audio encoder (the checkpoint's decoder is not built)"
    index_inputs: dict[str, int] = {}

    def read_config(self, cfg):
        c = {}
        c["n_mels"] = cfg.integer("num_mel_bins", 80)
        c["width"] = cfg.integer("d_model")
        c["layers"] = cfg.integer("encoder_layers")
        c["heads"] = cfg.integer("encoder_attention_heads")
        c["ffn"] = cfg.integer("encoder_ffn_dim")
        c["max_positions"] = cfg.integer("max_source_positions", 1500)
        if c["width"] % c["heads"]:
            cfg.refused.append(f"d_model={c['width']} not a multiple of encoder_attention_heads={c['heads']}")
        cfg.expect("activation_function", ["gelu"], "gelu")
        self.c = c
        self.prefix = "model.encoder."

    def make_settings(self):
        longest = 2 * self.c["max_positions"]
        return {
            "batch": Setting(1, "clips per step", positive),
            "mel_len": Setting(longest, f"mel frames per clip (even, at most {longest})",
                               lambda v: None if 2 <= v <= longest and v % 2 == 0
                               else f"must be an even number from 2 to {longest}"),
            "samples": Setting(8, "dataset size (random mel frames)", at_most(10_000)),
        }

    def make_module(self):
        from ...models.whisper import WhisperEncoder
        encoder = WhisperEncoder(**self.c)
        if self.prefix == "model.encoder.":
            return nn.Container(model=nn.Container(encoder=encoder))
        return nn.Container(encoder=encoder)

    def configure_for(self, tensors):
        """WhisperForConditionalGeneration names ``model.encoder...``, WhisperModel ``encoder...``."""
        self.prefix = "model.encoder." if any(k.startswith("model.encoder.") for k in tensors) else "encoder."
        self.module = self.make_module()

    @property
    def encoder(self):
        return self.module.model.encoder if self.prefix == "model.encoder." else self.module.encoder

    def select_tensors(self, tensors):
        decoder = ("model.decoder.", "decoder.", "proj_out.")
        return {k: v for k, v in tensors.items() if not k.startswith(decoder)}

    def input_names(self, train):
        if train:
            raise MeganeuraError(f"model {self.name!r}: the Whisper encoder has no training objective here "
                                 f"(only inference: build(train=False))")
        return ["mel"]

    def build(self, train=False, batch=None, capture=False) -> Graph:
        if train:
            self.input_names(True)
        batch = batch or self.settings["batch"]
        g = Graph(f"whisper-encoder-infer-b{batch}")
        mel = g.input("mel", (batch, self.c["n_mels"], self.settings["mel_len"]))
        g.output("last_hidden_state", self.encoder(g, mel, capture=capture))
        return g

    def dataset(self, seed=0):
        rng = np.random.default_rng(seed)
        shape = (self.settings["samples"], self.c["n_mels"], self.settings["mel_len"])
        return {"mel": rng.normal(0.0, 1.0, shape).astype(np.float32)}
