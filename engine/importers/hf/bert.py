"""BERT checkpoints: the encoder's last hidden state, and its pooler's output where it has one."""

from __future__ import annotations

import numpy as np

from ...errors import MeganeuraError
from ...graph import nn
from ...graph.ir import Graph
from ...models.base import Setting, at_most, positive
from .base import HFModel, activation


class BertEmbeddings(nn.Module):
    def __init__(self, c):
        self.word_embeddings = nn.Embedding(c["vocab"], c["width"], init=nn.normal(0.02))
        self.position_embeddings = nn.Embedding(c["positions"], c["width"], init=nn.normal(0.02))
        self.token_type_embeddings = nn.Embedding(c["types"], c["width"], init=nn.normal(0.02))
        self.LayerNorm = nn.LayerNorm(c["width"], c["eps"])

    def forward(self, g, ids, types):
        seq = g.shape(ids)[1]
        x = g.add(self.word_embeddings(g, ids), self.token_type_embeddings(g, types))
        x = g.add(x, g.slice(self.position_embeddings.weight.node(g), 0, 0, seq))
        return self.LayerNorm(g, x)


class BertSelfAttention(nn.Module):
    def __init__(self, width, heads):
        self.heads = heads
        self.query = nn.Linear(width, width, init=nn.normal(0.02))
        self.key = nn.Linear(width, width, init=nn.normal(0.02))
        self.value = nn.Linear(width, width, init=nn.normal(0.02))

    def forward(self, g, x):
        return g.attention(self.query(g, x), self.key(g, x), self.value(g, x), self.heads)


class BertResidualOutput(nn.Module):
    """dense -> + residual -> LayerNorm (BertSelfOutput and BertOutput)."""

    def __init__(self, n_in, width, eps):
        self.dense = nn.Linear(n_in, width, init=nn.normal(0.02))
        self.LayerNorm = nn.LayerNorm(width, eps)

    def forward(self, g, h, residual):
        return self.LayerNorm(g, g.add(self.dense(g, h), residual))


class BertAttention(nn.Module):
    def __init__(self, c):
        self.self = BertSelfAttention(c["width"], c["heads"])
        self.output = BertResidualOutput(c["width"], c["width"], c["eps"])

    def forward(self, g, x):
        return self.output(g, self.self(g, x), x)


class BertIntermediate(nn.Module):
    def __init__(self, c):
        self.act = c["act"]
        self.dense = nn.Linear(c["width"], c["inner"], init=nn.normal(0.02))

    def forward(self, g, x):
        return nn.activate(g, self.dense(g, x), self.act)


class BertLayer(nn.Module):
    def __init__(self, c):
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertResidualOutput(c["inner"], c["width"], c["eps"])

    def forward(self, g, x):
        h = self.attention(g, x)
        return self.output(g, self.intermediate(g, h), h)


class BertPooler(nn.Module):
    def __init__(self, width):
        self.dense = nn.Linear(width, width, init=nn.normal(0.02))

    def forward(self, g, x):
        b, _, w = g.shape(x)
        first = g.reshape(g.slice(x, 1, 0, 1), (b, w))
        return g.tanh(self.dense(g, first))


class BertBody(nn.Module):
    def __init__(self, c, pooler):
        self.embeddings = BertEmbeddings(c)
        self.encoder = nn.Container(layer=[BertLayer(c) for _ in range(c["layers"])])
        if pooler:
            self.pooler = BertPooler(c["width"])


class BertModel(HFModel):
    model_type = "bert"
    description = "BERT encoder (word + position + token-type embeddings, post-LayerNorm layers)"
    # Heads of BertFor* checkpoints that the encoder does not use: bound nowhere, listed in summary().
    HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")

    def read_config(self, cfg):
        c = {}
        c["vocab"] = self.vocab = cfg.integer("vocab_size")
        c["width"] = cfg.integer("hidden_size")
        c["layers"] = cfg.integer("num_hidden_layers")
        c["heads"] = cfg.integer("num_attention_heads")
        c["inner"] = cfg.integer("intermediate_size")
        c["positions"] = self.max_positions = cfg.integer("max_position_embeddings")
        c["types"] = self.types = cfg.integer("type_vocab_size", 2)
        c["eps"] = cfg.number("layer_norm_eps", 1e-12)
        c["act"] = activation(cfg, "hidden_act", "gelu")
        if c["width"] % c["heads"]:
            cfg.refused.append(f"hidden_size={c['width']} not a multiple of num_attention_heads={c['heads']}")
        cfg.expect("position_embedding_type", ["absolute"], "absolute")
        cfg.expect("is_decoder", [False], False)
        cfg.expect("add_cross_attention", [False], False)
        self.c = c
        self.prefix = ""
        self.pooler = True

    def make_settings(self):
        return {
            "batch": Setting(1, "sequences per step", positive),
            "seq": Setting(min(self.max_positions, 128), f"tokens per sequence (at most {self.max_positions})",
                           at_most(self.max_positions)),
            "samples": Setting(64, "dataset size (random token sequences)", at_most(1_000_000)),
        }

    def make_module(self):
        body = BertBody(self.c, self.pooler)
        return nn.Container(bert=body) if self.prefix else body

    @property
    def body(self) -> BertBody:
        return self.module.bert if self.prefix else self.module

    def configure_for(self, tensors):
        """BertModel files name tensors ``embeddings...``; BertFor* files ``bert.embeddings...``."""
        self.prefix = "bert." if any(k.startswith("bert.") for k in tensors) else ""
        self.pooler = f"{self.prefix}pooler.dense.weight" in tensors
        self.module = self.make_module()

    def select_tensors(self, tensors):
        if self.prefix:
            return {k: v for k, v in tensors.items() if not k.startswith(self.HEAD_PREFIXES)}
        return tensors

    @property
    def index_inputs(self):
        return {"input_ids": self.vocab, "token_type_ids": self.types}

    def input_names(self, train):
        if train:
            raise MeganeuraError(f"model {self.name!r}: a BERT encoder has no training objective here "
                                 f"(only inference: build(train=False))")
        return ["input_ids", "token_type_ids"]

    def default_inputs(self, inputs, graph):
        if "token_type_ids" not in inputs and "input_ids" in inputs:
            inputs["token_type_ids"] = np.zeros(np.shape(inputs["input_ids"]), np.int32)
        return inputs

    def build(self, train=False, batch=None, capture=False) -> Graph:
        if train:
            self.input_names(True)
        batch = batch or self.settings["batch"]
        seq = self.settings["seq"]
        g = Graph(f"bert-infer-b{batch}")
        ids = g.input("input_ids", (batch, seq), "i32")
        types = g.input("token_type_ids", (batch, seq), "i32")
        body = self.body
        x = body.embeddings(g, ids, types)
        for layer in body.encoder.layer:
            x = layer(g, x)
            if capture:
                nn.capture(g, layer.path, x)
        g.output("last_hidden_state", x)
        if self.pooler:
            g.output("pooler_output", body.pooler(g, x))
        return g

    def dataset(self, seed=0):
        rng = np.random.default_rng(seed)
        n, seq = self.settings["samples"], self.settings["seq"]
        return {"input_ids": rng.integers(0, self.vocab, (n, seq)).astype(np.int32),
                "token_type_ids": np.zeros((n, seq), np.int32)}
