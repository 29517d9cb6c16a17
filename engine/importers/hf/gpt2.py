"""GPT-2 checkpoints (transformer. prefix or none, Conv1D weights stored [in, out])."""

from __future__ import annotations

import math

import numpy as np

from ...errors import ModelImportError
from ...graph import kv_cache, nn
from .base import CausalLM, REQUIRED, activation, tied_head


def conv1d_linear(n_in, n_out):
    """GPT-2's Conv1D: a Linear whose weight files store [in, out] already."""
    return nn.Linear(n_in, n_out, bias=True, init=nn.normal(0.02), transpose_on_load=False)


class GPT2Attention(nn.Module):
    def __init__(self, width, heads, scale):
        self.width, self.heads, self.scale = width, heads, scale
        self.c_attn = conv1d_linear(width, 3 * width)
        self.c_proj = conv1d_linear(width, width)

    def forward(self, g, x):
        qkv = self.c_attn(g, x)
        q, k, v = (g.slice(qkv, 2, i * self.width, (i + 1) * self.width) for i in range(3))
        return self.c_proj(g, kv_cache.self_attention(g, q, k, v, self.heads, scale=self.scale))


class GPT2MLP(nn.Module):
    def __init__(self, width, inner, act):
        self.act = act
        self.c_fc = conv1d_linear(width, inner)
        self.c_proj = conv1d_linear(inner, width)

    def forward(self, g, x):
        return self.c_proj(g, nn.activate(g, self.c_fc(g, x), self.act))


class GPT2Block(nn.Module):
    def __init__(self, c):
        self.ln_1 = nn.LayerNorm(c["width"], c["eps"])
        self.attn = GPT2Attention(c["width"], c["heads"], c["scale"])
        self.ln_2 = nn.LayerNorm(c["width"], c["eps"])
        self.mlp = GPT2MLP(c["width"], c["inner"], c["act"])

    def forward(self, g, x):
        x = g.add(x, self.attn(g, self.ln_1(g, x)))
        return g.add(x, self.mlp(g, self.ln_2(g, x)))


class GPT2Body(nn.Module):
    def __init__(self, c):
        self.wte = nn.Embedding(c["vocab"], c["width"], init=nn.normal(0.02))
        self.wpe = nn.Embedding(c["positions"], c["width"], init=nn.normal(0.01))
        self.h = [GPT2Block(c) for _ in range(c["layers"])]
        self.ln_f = nn.LayerNorm(c["width"], c["eps"])


class GPT2Model(CausalLM):
    model_type = "gpt2"
    description = "GPT-2 causal LM (learned positions, pre-LayerNorm, GELU MLP, tied head)"

    def read_config(self, cfg):
        c = {}
        c["vocab"] = self.vocab = cfg.integer("vocab_size")
        c["width"] = cfg.integer("n_embd", REQUIRED, "hidden_size")
        c["layers"] = cfg.integer("n_layer", REQUIRED, "num_hidden_layers")
        c["heads"] = cfg.integer("n_head", REQUIRED, "num_attention_heads")
        c["positions"] = self.max_positions = cfg.integer("n_positions", REQUIRED, "max_position_embeddings")
        c["inner"] = cfg.integer("n_inner", 4 * c["width"])
        c["eps"] = cfg.number("layer_norm_epsilon", 1e-5)
        c["act"] = activation(cfg, "activation_function", "gelu_new")
        if c["width"] % c["heads"]:
            cfg.refused.append(f"n_embd={c['width']} not a multiple of n_head={c['heads']}")
        scaled = cfg.expect("scale_attn_weights", [True, False], True)
        c["scale"] = 1.0 / math.sqrt(c["width"] // c["heads"]) if scaled else 1.0
        cfg.expect("scale_attn_by_inverse_layer_idx", [False], False)
        cfg.expect("add_cross_attention", [False], False)
        tie = cfg.expect("tie_word_embeddings", [True, False], True)
        self.tied = bool(tie)
        self.c = c
        self.prefix = "transformer."

    def make_module(self):
        body = GPT2Body(self.c)
        root = nn.Container(transformer=body) if self.prefix else body
        if not self.tied:
            root.lm_head = nn.Linear(self.c["width"], self.c["vocab"], bias=False, init=nn.normal(0.02))
        return root

    @property
    def body(self) -> GPT2Body:
        return self.module.transformer if self.prefix else self.module

    def configure_for(self, tensors):
        """GPT2LMHeadModel files name ``transformer.h.0...``; GPT2Model files (the original
        openai-community/gpt2 one among them) ``h.0...``."""
        self.prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
        self.module = self.make_module()

    def select_tensors(self, tensors):
        """Older files also store each layer's causal-mask buffers (``h.N.attn.bias``, a
        lower-triangular [1, 1, P, P] of ones, and ``h.N.attn.masked_bias``): the attention
        op's causal flag is that mask, so they are checked and left out, never bound."""
        out, bad = {}, []
        for name, value in tensors.items():
            parts = name[len(self.prefix):].split(".") if name.startswith(self.prefix) else []
            if len(parts) == 4 and parts[0] == "h" and parts[2] == "attn" and parts[3] in ("bias", "masked_bias"):
                if parts[3] == "bias" and not (value.ndim == 4 and value.shape[-1] == value.shape[-2]
                                               and np.array_equal(value[0, 0] != 0,
                                                                  np.tril(np.ones(value.shape[-2:], bool)))):
                    bad.append(name)
                continue
            out[name] = value
        if bad:
            raise ModelImportError(f"weights in {self.folder}: {', '.join(bad)} are not the causal mask GPT-2 "
                                   f"uses; masks other than causal are not supported")
        return out

    def logits(self, g, ids, capture):
        body = self.body
        seq = g.shape(ids)[1]
        x = g.add(body.wte(g, ids), kv_cache.position_rows(g, body.wpe.weight.node(g), seq))
        for layer in body.h:
            x = layer(g, x)
            if capture:
                nn.capture(g, layer.path, x)
        x = body.ln_f(g, kv_cache.last_token(g, x))
        return tied_head(g, x, body.wte.weight) if self.tied else self.module.lm_head(g, x)
