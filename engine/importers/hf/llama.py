"""Llama and the families that share its layers: Qwen2 (biases on q, k, v), Qwen3 (q and k
normalised per head), Mistral (a sliding window), Granite (scaled embeddings, residuals,
attention and logits), Phi-3 (q, k, v and gate, up fused), OLMo 2 (norms after each
branch), SmolLM3 (RoPE in some layers); RoPE as their configs give it, scaled exactly
(Llama 3's and linear scalings) or refused."""

from __future__ import annotations

import json

import numpy as np

from ...errors import ModelImportError
from ...graph import kv_cache, nn
from ...graph.ops import rope_inverse_frequencies
from .base import CausalLM, ConfigReader, activation, tied_head


class LlamaAttention(nn.Module):
    """Llama's attention, and its relatives' (``c``: which projections have biases, and
    whether q and k are RMS-normalised per head before RoPE, as Qwen3's are)."""

    def __init__(self, c):
        self.heads, self.kv_heads, self.head_dim = c["heads"], c["kv_heads"], c["head_dim"]
        self.theta, self.rope_scaling, self.rope = c["theta"], c["rope_scaling"], c.get("rope", True)
        self.scale = c["attention_scale"]
        self.make_projections(c)
        self.q_norm = nn.RMSNorm(self.head_dim, c["eps"]) if c["qk_norm"] else None
        self.k_norm = nn.RMSNorm(self.head_dim, c["eps"]) if c["qk_norm"] else None

    def make_projections(self, c):
        hidden, q, kv = c["hidden"], self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q, bias=c["qkv_bias"], init=nn.normal(0.02))
        self.k_proj = nn.Linear(hidden, kv, bias=c["qkv_bias"], init=nn.normal(0.02))
        self.v_proj = nn.Linear(hidden, kv, bias=c["qkv_bias"], init=nn.normal(0.02))
        self.o_proj = nn.Linear(q, hidden, bias=c["o_bias"], init=nn.normal(0.02))

    def per_head(self, g, norm, x, heads):
        if norm is None:
            return x
        shape = g.shape(x)
        rows = g.reshape(x, (*shape[:-1], heads, self.head_dim))
        return g.reshape(norm(g, rows), shape)

    def projections(self, g, x):
        """(q, k, v) of the layer's input."""
        return self.q_proj(g, x), self.k_proj(g, x), self.v_proj(g, x)

    def forward(self, g, x):
        q, k, v = self.projections(g, x)
        q = self.per_head(g, self.q_norm, q, self.heads)
        k = self.per_head(g, self.k_norm, k, self.kv_heads)
        if self.rope:
            q = kv_cache.rotary(g, q, self.heads, self.theta, self.rope_scaling)
            k = kv_cache.rotary(g, k, self.kv_heads, self.theta, self.rope_scaling)
        return self.o_proj(g, kv_cache.self_attention(g, q, k, v, self.heads, self.kv_heads, self.scale))


class LlamaMLP(nn.Module):
    def __init__(self, hidden, inner, act, bias=False):
        self.act = act
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, init=nn.normal(0.02))
        self.up_proj = nn.Linear(hidden, inner, bias=bias, init=nn.normal(0.02))
        self.down_proj = nn.Linear(inner, hidden, bias=bias, init=nn.normal(0.02))

    def gate_and_up(self, g, x):
        return self.gate_proj(g, x), self.up_proj(g, x)

    def forward(self, g, x):
        gate, up = self.gate_and_up(g, x)
        return self.down_proj(g, g.mul(nn.activate(g, gate, self.act), up))


class Phi3Attention(LlamaAttention):
    """Phi-3's attention: Llama's, its q, k and v one projection, ``qkv_proj``, whose
    output columns are q's, then k's, then v's."""

    def make_projections(self, c):
        hidden, q, kv = c["hidden"], self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, q + 2 * kv, bias=False, init=nn.normal(0.02))
        self.o_proj = nn.Linear(q, hidden, bias=False, init=nn.normal(0.02))

    def projections(self, g, x):
        qkv = self.qkv_proj(g, x)
        axis, q, kv = len(g.shape(qkv)) - 1, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return g.slice(qkv, axis, 0, q), g.slice(qkv, axis, q, q + kv), g.slice(qkv, axis, q + kv, q + 2 * kv)


class Phi3MLP(LlamaMLP):
    """Phi-3's MLP: Llama's, its gate and up projections one, ``gate_up_proj`` (gate's
    columns first)."""

    def __init__(self, hidden, inner, act, bias=False):
        self.act, self.inner = act, inner
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False, init=nn.normal(0.02))
        self.down_proj = nn.Linear(inner, hidden, bias=False, init=nn.normal(0.02))

    def gate_and_up(self, g, x):
        both = self.gate_up_proj(g, x)
        axis = len(g.shape(both)) - 1
        return g.slice(both, axis, 0, self.inner), g.slice(both, axis, self.inner, 2 * self.inner)


class LlamaDecoderLayer(nn.Module):
    ATTENTION, MLP = LlamaAttention, LlamaMLP

    def __init__(self, c):
        self.self_attn = self.ATTENTION(c)
        self.mlp = self.MLP(c["hidden"], c["inner"], c["act"], c["mlp_bias"])
        self.input_layernorm = nn.RMSNorm(c["hidden"], c["eps"])
        self.post_attention_layernorm = nn.RMSNorm(c["hidden"], c["eps"])
        self.residual_multiplier = c["residual_multiplier"]

    def forward(self, g, x):
        x = g.add(x, scaled(g, self.self_attn(g, self.input_layernorm(g, x)), self.residual_multiplier))
        return g.add(x, scaled(g, self.mlp(g, self.post_attention_layernorm(g, x)), self.residual_multiplier))


def scaled(g, x, factor: float):
    """x * factor, no node where the factor is 1 (every family but Granite)."""
    return x if factor == 1.0 else g.scale(x, factor)


class Phi3DecoderLayer(LlamaDecoderLayer):
    ATTENTION, MLP = Phi3Attention, Phi3MLP


class Olmo2Attention(LlamaAttention):
    """OLMo 2's attention: Llama's, q and k RMS-normalised over their whole projections
    (every head at once) before RoPE."""

    def __init__(self, c):
        super().__init__({**c, "qk_norm": False})
        self.q_norm = nn.RMSNorm(c["heads"] * c["head_dim"], c["eps"])
        self.k_norm = nn.RMSNorm(c["kv_heads"] * c["head_dim"], c["eps"])

    def per_head(self, g, norm, x, heads):
        return norm(g, x)


class Olmo2DecoderLayer(nn.Module):
    """OLMo 2's layer: each branch normalised after it, before its residual add, and no
    norm before it."""

    def __init__(self, c):
        self.self_attn = Olmo2Attention(c)
        self.mlp = LlamaMLP(c["hidden"], c["inner"], c["act"], c["mlp_bias"])
        self.post_attention_layernorm = nn.RMSNorm(c["hidden"], c["eps"])
        self.post_feedforward_layernorm = nn.RMSNorm(c["hidden"], c["eps"])

    def forward(self, g, x):
        x = g.add(x, self.post_attention_layernorm(g, self.self_attn(g, x)))
        return g.add(x, self.post_feedforward_layernorm(g, self.mlp(g, x)))


class LlamaBody(nn.Module):
    def __init__(self, c, layer=LlamaDecoderLayer):
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"], init=nn.normal(0.02))
        self.layers = [layer({**c, "rope": rope}) for rope in c["rope_layers"]]
        self.norm = nn.RMSNorm(c["hidden"], c["eps"])


# RoPE scalings read exactly (ops.rope_inverse_frequencies): rope_type -> its fields, in order.
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_config(cfg: ConfigReader) -> tuple[float, tuple]:
    """(theta, scaling) of a Llama-family config: transformers 5's ``rope_parameters``, or
    older files' ``rope_theta`` and ``rope_scaling``. Scalings other than ``ROPE_TYPES``
    (yarn, dynamic, longrope...) are refused by name."""
    params, source = {}, "rope_parameters"
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.config.get(key)
        if value is not None and not isinstance(value, dict):
            cfg.refused.append(f"{key}={json.dumps(value)} (an object)")
        elif value:
            clash = sorted(k for k in set(params) & set(value) if params[k] != value[k])
            if clash:
                cfg.refused.append(f"rope_scaling and rope_parameters disagree on {', '.join(clash)}")
                return 10000.0, ()
            params.update(value)
            source = key
    theta = params.get("rope_theta", cfg.config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        cfg.refused.append(f"rope_theta={json.dumps(theta)} (a positive number)")
        theta = 10000.0
    for where, fields in ((source, params), ("config", cfg.config)):
        if fields.get("partial_rotary_factor") not in (None, 1, 1.0):
            cfg.refused.append(f"{where}.partial_rotary_factor={json.dumps(fields['partial_rotary_factor'])} "
                               f"(RoPE over part of each head)")
            break
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        cfg.refused.append(f"{source}.rope_type={json.dumps(rope_type)} (supported: "
                           f"{', '.join(json.dumps(t) for t in ROPE_TYPES)})")
        return float(theta), ()
    numbers = []
    for field in ROPE_TYPES[rope_type]:
        value = params.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            cfg.refused.append(f"{source}.{field}={json.dumps(value)} (a positive number, for rope_type "
                               f"{json.dumps(rope_type)})")
            return float(theta), ()
        numbers.append(float(value))
    if rope_type == "llama3" and numbers[1] >= numbers[2]:
        cfg.refused.append(f"{source}: low_freq_factor {numbers[1]} not below high_freq_factor {numbers[2]}")
        return float(theta), ()
    return float(theta), (rope_type, *numbers) if numbers else ()


class LlamaModel(CausalLM):
    """Llama, and the families that differ from it only in biases, per-head norms of q and
    k, a sliding window and their config's defaults (subclasses below)."""

    model_type = "llama"
    description = "Llama-family causal LM (grouped-query attention, RoPE, RMSNorm, SwiGLU)"
    LAYER = LlamaDecoderLayer
    # The config class's defaults in transformers, for fields a config.json may leave out.
    MAX_POSITIONS = 2048
    HEAD_DIM: int | None = None          # None: hidden_size / num_attention_heads

    def read_config(self, cfg):
        c = {}
        c["vocab"] = self.vocab = cfg.integer("vocab_size")
        c["hidden"] = cfg.integer("hidden_size")
        c["layers"] = cfg.integer("num_hidden_layers")
        c["heads"] = cfg.integer("num_attention_heads")
        c["kv_heads"] = cfg.integer("num_key_value_heads", c["heads"])
        c["inner"] = cfg.integer("intermediate_size")
        c["head_dim"] = cfg.integer("head_dim", self.HEAD_DIM or c["hidden"] // c["heads"])
        c["eps"] = cfg.number("rms_norm_eps", 1e-6)
        self.max_positions = cfg.integer("max_position_embeddings", self.MAX_POSITIONS)
        c["act"] = activation(cfg, "hidden_act", "silu")
        if c["heads"] % c["kv_heads"]:
            cfg.refused.append(f"num_attention_heads={c['heads']} not a multiple of "
                               f"num_key_value_heads={c['kv_heads']}")
        if c["head_dim"] % 2:
            cfg.refused.append(f"head_dim={c['head_dim']} (RoPE needs an even head dim)")
        c["theta"], c["rope_scaling"] = rope_config(cfg)
        c["rope_layers"] = self.rope_layers(cfg, c["layers"])
        c.update(self.multipliers(cfg))
        cfg.expect("rope_interleaved", [False], False)
        cfg.expect("pretraining_tp", [1], 1)
        c.update(self.layout(cfg))
        window = self.sliding_window(cfg, c["layers"])
        self.window_note = ""
        if window is not None and window < self.max_positions:
            self.window_note = (f"sliding_window={window}: sequences stop at {window} tokens, within which "
                                f"the window sees every earlier token")
            self.max_positions = window
        tie = cfg.expect("tie_word_embeddings", [True, False], False)
        self.tied = bool(tie)
        self.c = c

    def layout(self, cfg) -> dict:
        """Which projections have biases, and whether q and k are normalised per head."""
        attention = bool(cfg.expect("attention_bias", [False, True], False))
        mlp = bool(cfg.expect("mlp_bias", [False, True], False))
        return {"qkv_bias": attention, "o_bias": attention, "mlp_bias": mlp, "qk_norm": False}

    def sliding_window(self, cfg, layers: int) -> int | None:
        """The window of the family's sliding-window layers, None where every layer sees all
        earlier tokens. Llama has none."""
        return None

    def rope_layers(self, cfg, layers: int) -> list[bool]:
        """Whether each layer rotates q and k: all of Llama's do."""
        return [True] * layers

    def multipliers(self, cfg) -> dict:
        """The attention's scale (None: 1 / sqrt(head_dim)) and the factors of the embeddings,
        of each residual branch and (dividing) of the logits: Llama's are all 1."""
        return {"attention_scale": None, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                "logits_scaling": 1.0}

    @property
    def notes(self):
        return [self.window_note] if self.window_note else []

    def summary(self):
        extra = {"context_length": self.context_length}
        if self.window_note:
            extra["context_note"] = self.window_note
        return {**super().summary(), **extra}

    def make_module(self):
        root = nn.Container(model=LlamaBody(self.c, self.LAYER))
        if not self.tied:
            root.lm_head = nn.Linear(self.c["hidden"], self.c["vocab"], bias=False, init=nn.normal(0.02))
        return root

    def select_tensors(self, tensors):
        # Older files store each layer's RoPE inverse frequencies: check them against the config, do not bind.
        hd, theta = self.c["head_dim"], self.c["theta"]
        want = rope_inverse_frequencies(hd, theta, self.c["rope_scaling"])
        for name in [k for k in tensors if k.endswith(".self_attn.rotary_emb.inv_freq")]:
            value = tensors.pop(name)
            if value.shape != want.shape or not np.allclose(value, want, rtol=1e-3):
                raise ModelImportError(f"weights in {self.folder}: {name} does not match rope_theta={theta}, "
                                       f"head_dim={hd} and the config's RoPE scaling; custom RoPE frequencies "
                                       f"are not supported")
        # Some tied checkpoints store lm_head.weight as a copy of the embedding: accept that copy only.
        if self.tied and "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
            head, table = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
            if head.shape == table.shape and np.array_equal(head, table):
                del tensors["lm_head.weight"]
            else:
                raise ModelImportError(f"weights in {self.folder}: tie_word_embeddings is true but lm_head.weight "
                                       f"differs from model.embed_tokens.weight")
        return tensors

    def logits(self, g, ids, capture):
        body = self.module.model
        x = scaled(g, body.embed_tokens(g, ids), self.c["embedding_multiplier"])
        for layer in body.layers:
            x = layer(g, x)
            if capture:
                nn.capture(g, layer.path, x)
        x = body.norm(g, kv_cache.last_token(g, x))
        logits = tied_head(g, x, body.embed_tokens.weight) if self.tied else self.module.lm_head(g, x)
        return scaled(g, logits, 1.0 / self.c["logits_scaling"])


class MistralModel(LlamaModel):
    """Mistral: Llama's layers without biases; every layer attends over a sliding window of
    ``sliding_window`` tokens (none when null). Here sequences stop at the window, so that
    full attention is exact."""

    model_type = "mistral"
    description = "Mistral-family causal LM (Llama's layers; sequences up to its sliding window)"
    MAX_POSITIONS = 4096 * 32

    def layout(self, cfg):
        return {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False}

    def sliding_window(self, cfg, layers):
        return every_layer_window(cfg, 4096)


class Phi3Model(LlamaModel):
    """Phi-3 (Phi-3-mini and -medium at 4k tokens): Llama's layers without biases, q, k and
    v one projection and gate and up another (their checkpoints' tensors); every layer attends
    over ``sliding_window`` tokens where given, so that sequences stop there, as Mistral's.
    longrope (the 128k variants) and RoPE over part of each head (Phi-4-mini) are refused."""

    model_type = "phi3"
    description = "Phi-3-family causal LM (Llama's layers; q, k, v and gate, up fused; sequences up to its window)"
    MAX_POSITIONS = 4096
    LAYER = Phi3DecoderLayer

    def layout(self, cfg):
        cfg.expect("attention_bias", [False, None], None)
        return {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False}

    def sliding_window(self, cfg, layers):
        return every_layer_window(cfg, None)


class Olmo2Model(LlamaModel):
    """OLMo 2: Llama's attention with q and k normalised over their whole projections, and
    each layer's branches normalised after (not before) them."""

    model_type = "olmo2"
    description = "OLMo 2 causal LM (Llama's layers; norms after each branch, q and k normalised)"
    LAYER = Olmo2DecoderLayer

    def layout(self, cfg):
        attention = bool(cfg.expect("attention_bias", [False, True], False))
        return {"qkv_bias": attention, "o_bias": attention, "mlp_bias": False, "qk_norm": False}


class SmolLM3Model(LlamaModel):
    """SmolLM3: Llama's layers, RoPE only in those ``no_rope_layers`` marks 1 (by default
    three of every four: each ``no_rope_layer_interval``-th goes without); sliding-window
    layers as Qwen2's."""

    model_type = "smollm3"
    description = "SmolLM3 causal LM (Llama's layers; some without RoPE)"
    MAX_POSITIONS = 32768

    def rope_layers(self, cfg, layers):
        interval = cfg.integer("no_rope_layer_interval", 4)
        marks = cfg.config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        if not isinstance(marks, list) or len(marks) != layers or any(m not in (0, 1) for m in marks):
            cfg.refused.append(f"no_rope_layers={json.dumps(marks)} (a 0 or 1 for each of {layers} layers)")
            return [True] * layers
        return [bool(m) for m in marks]

    def sliding_window(self, cfg, layers):
        return qwen_sliding_window(cfg, layers)


def every_layer_window(cfg: ConfigReader, default: int | None) -> int | None:
    """``sliding_window`` of a family whose every layer has it (Mistral, Phi-3): a positive
    integer, or null for none."""
    window = cfg.config.get("sliding_window", default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        cfg.refused.append(f"sliding_window={json.dumps(window)} (a positive integer or null)")
        return None
    return window


class Qwen2Model(LlamaModel):
    """Qwen2 (Qwen2.5): Llama's layers with biases on q, k and v; sliding-window layers only
    where ``use_sliding_window`` is on (from layer ``max_window_layers``, or as ``layer_types``
    says)."""

    model_type = "qwen2"
    description = "Qwen2-family causal LM (Llama's layers, biases on q, k and v)"
    MAX_POSITIONS = 32768

    def layout(self, cfg):
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}

    def sliding_window(self, cfg, layers):
        return qwen_sliding_window(cfg, layers)


class Qwen3Model(Qwen2Model):
    """Qwen3: Llama's layers with q and k RMS-normalised per head before RoPE, biases on the
    attention's projections where ``attention_bias`` says, head_dim 128 unless given."""

    model_type = "qwen3"
    description = "Qwen3-family causal LM (Llama's layers, q and k normalised per head)"
    HEAD_DIM = 128

    def layout(self, cfg):
        return {**LlamaModel.layout(self, cfg), "mlp_bias": False, "qk_norm": True}


class GraniteModel(LlamaModel):
    """Granite (IBM's Granite 3): Llama's layers, the embeddings times
    ``embedding_multiplier``, each residual branch times ``residual_multiplier``, the
    attention's scores times ``attention_multiplier`` (in place of 1 / sqrt(head_dim)) and
    the logits divided by ``logits_scaling``."""

    model_type = "granite"
    description = "Granite-family causal LM (Llama's layers; scaled embeddings, residuals, attention and logits)"

    def multipliers(self, cfg):
        fields = {}
        for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = cfg.number(key, 1.0)
            if not value > 0:
                cfg.refused.append(f"{key}={value} (a positive number)")
            fields[key] = value
        return {**fields, "attention_scale": fields.pop("attention_multiplier")}


def qwen_sliding_window(cfg: ConfigReader, layers: int) -> int | None:
    """As transformers reads a Qwen config: the window counts only with use_sliding_window,
    for the layers ``layer_types`` names "sliding_attention" (by default those from
    ``max_window_layers`` on)."""
    window = cfg.config.get("sliding_window", 4096) if cfg.config.get("use_sliding_window", False) else None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        cfg.refused.append(f"sliding_window={json.dumps(window)} (a positive integer or null)")
        return None
    first = cfg.config.get("max_window_layers", 28)
    types = cfg.config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                              for i in range(layers)]
    unknown = sorted(set(map(str, types)) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != layers:
        cfg.refused.append(f"layer_types={json.dumps(types)} (one of \"full_attention\", "
                           f"\"sliding_attention\" a layer)")
        return None
    return window if "sliding_attention" in types else None
