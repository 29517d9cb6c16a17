"""Hugging Face checkpoint folders (``config.json`` + safetensors weights) as models.

``load_checkpoint(folder, settings)`` reads the config, picks the architecture by
``model_type`` (``llama`` and its relatives ``qwen2``, ``qwen3``, ``mistral``; ``gpt2``,
``bert``, ``whisper`` — its encoder only), builds
it with the ``nn`` Module API under the checkpoint's own tensor names, and binds the
weights (``model.safetensors``, or the shards ``model.safetensors.index.json`` lists;
f16/bf16 are widened to f32). Every problem is a ``ModelImportError`` of one line:
no config, no weights, an unknown ``model_type``, config fields this importer does
not implement set to non-default values (named, never approximated), weights that
disagree with the config (every missing, unexpected and mis-shaped tensor named).

Causal LMs (the Llama family, gpt2) take ``input_ids`` [batch, seq] and output ``logits``
[batch, seq, vocab]; their training graph adds ``labels`` [batch, seq] (-100 =
ignored) and the scalar ``loss``: next-token cross-entropy with the shift inside, as
``transformers`` computes ``model(input_ids, labels=labels).loss``. ``bert`` takes
``input_ids`` and ``token_type_ids`` (zeros when not given to ``run``) and outputs
``last_hidden_state`` (and ``pooler_output`` when the checkpoint has a pooler).
``whisper`` takes ``mel`` [batch, num_mel_bins, mel_len] and outputs
``last_hidden_state``. ``run`` accepts int32 or int64 ids and refuses an id outside
its table, naming the input and the id.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import MeganeuraError, ModelImportError, WeightsError
from ..graph import kv_cache, nn
from ..graph.ir import Graph
from ..models.base import BuiltinModel, Setting, at_most, positive

IGNORE = -100
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# What a training checkpoint copies beside its weights, so that it opens in transformers and here.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


# ---------------------------------------------------------------- reading the folder

def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelImportError(f"checkpoint folder {folder}: no config.json (a Hugging Face checkpoint "
                               f"folder holds config.json and {WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelImportError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise ModelImportError(f"{path}: the config is a JSON {type(config).__name__}, not an object")
    return config


def read_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (float32 for floats), from one file or its shards."""
    from ..weights import load_safetensors

    def load(path):
        try:
            return load_safetensors(path)
        except WeightsError as exc:
            raise ModelImportError(str(exc)) from None

    single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
    if single.is_file():
        return load(single)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise ModelImportError(f"{index}: not a safetensors index with a weight_map ({exc})") from None
        tensors: dict[str, np.ndarray] = {}
        absent = []
        for shard in sorted(set(map(str, weight_map.values()))):
            path = folder / shard
            if not path.is_file():
                absent.append(shard)
                continue
            tensors.update(load(path))
        if absent:
            raise ModelImportError(f"{index} names shard(s) that are not in the folder: {', '.join(absent)}")
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ModelImportError(f"{index}: tensor(s) not found in the shards it names: {', '.join(missing)}")
        return tensors
    other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"))
    hint = f" (found {', '.join(other)}: only safetensors is read; convert with save_pretrained(..., " \
           f"safe_serialization=True))" if other else ""
    raise ModelImportError(f"checkpoint folder {folder}: no weights: expected {WEIGHTS_FILE} or {INDEX_FILE}{hint}")


# ---------------------------------------------------------------- config checks

_MISSING = object()


class ConfigReader:
    """Reads fields of a config and collects the ones this importer cannot honour."""

    def __init__(self, config: Mapping, model_type: str):
        self.config, self.model_type = config, model_type
        self.refused: list[str] = []

    def get(self, key, default=_MISSING, *aliases):
        for k in (key, *aliases):
            if k in self.config and self.config[k] is not None:
                return self.config[k]
        if default is _MISSING:
            raise ModelImportError(f"{self.model_type} config: field {key!r} is missing")
        return default

    def integer(self, key, default=_MISSING, *aliases) -> int:
        value = self.get(key, default, *aliases)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelImportError(f"{self.model_type} config: {key} must be a positive integer, found {value!r}")
        return value

    def number(self, key, default=_MISSING, *aliases) -> float:
        value = self.get(key, default, *aliases)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelImportError(f"{self.model_type} config: {key} must be a number, found {value!r}")
        return float(value)

    def expect(self, key, allowed, default=None):
        """Refuse (by name, later, all together) a field whose value is not in ``allowed``."""
        value = self.config.get(key, default)
        if value not in allowed:
            self.refused.append(f"{key}={json.dumps(value)} (supported: {', '.join(json.dumps(a) for a in allowed)})")
        return value

    def finish(self):
        if self.refused:
            raise ModelImportError(f"{self.model_type} config: not supported by this importer: "
                                   f"{'; '.join(self.refused)}")


ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_fast": None, "relu": "relu", "silu": "silu", "swish": "silu"}


def activation(cfg: ConfigReader, key: str, default: str) -> str:
    name = cfg.get(key, default)
    ours = ACTIVATIONS.get(name)
    if ours is None:
        cfg.refused.append(f"{key}={json.dumps(name)} (supported: "
                           f"{', '.join(json.dumps(k) for k, v in ACTIVATIONS.items() if v)})")
        return "gelu"
    return ours


# ---------------------------------------------------------------- the model base

class HFModel(BuiltinModel):
    """A model built from a checkpoint's config, holding the checkpoint's weights."""

    model_type = ""
    TRAIN_DEFAULTS = {"optimizer": "adamw", "lr": 1e-4}
    # Input name -> config-derived table size, filled by subclasses (checked in ``run``).
    index_inputs: dict[str, int]

    def __init__(self, folder: Path, config: dict, settings: Mapping[str, str]):
        self.folder, self.config = Path(folder), config
        self.cfg = ConfigReader(config, self.model_type)
        self.read_config(self.cfg)
        self.cfg.finish()
        self.name = f"{self.model_type}:{self.folder.name or self.folder}"
        self.SETTINGS = self.make_settings()
        super().__init__(**settings)
        self.ignored_tensors: list[str] = []
        self._params: dict[str, np.ndarray] = {}

    # subclasses
    def read_config(self, cfg: ConfigReader) -> None:
        raise NotImplementedError

    def make_settings(self) -> dict[str, Setting]:
        raise NotImplementedError

    def select_tensors(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors this model binds (e.g. without a decoder it does not build)."""
        return tensors

    # weights
    def attach_weights(self, tensors: dict[str, np.ndarray]) -> None:
        from ..weights import bind_weights
        chosen = self.select_tensors(dict(tensors))
        self.ignored_tensors = sorted(set(tensors) - set(chosen))
        try:
            self._params = bind_weights(chosen, self.parameter_shapes(), self.weight_transposes,
                                        source=self.folder)
        except WeightsError as exc:
            raise ModelImportError(f"{exc} (config.json: model_type {self.model_type})") from None

    def checkpoint_files(self) -> list[Path]:
        """config.json and the tokenizer and generation files the checkpoint folder has."""
        return [self.folder / name for name in CHECKPOINT_FILES if (self.folder / name).is_file()]

    def init_params(self, seed: int = 0) -> dict[str, np.ndarray]:
        """The checkpoint's weights (copies), whatever the seed."""
        return {k: v.copy() for k, v in self._params.items()}

    def reset(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Fresh random weights from the module's init specs (to train from scratch)."""
        return self.module.init_params(seed)

    # inputs
    def check_inputs(self, inputs: Mapping[str, np.ndarray], graph: Graph) -> dict[str, np.ndarray]:
        """Integer inputs as int32, each id inside its table; MeganeuraError otherwise."""
        out = dict(inputs)
        for name, size in self.index_inputs.items():
            if name not in out:
                continue
            value = np.asarray(out[name])
            if value.dtype.kind not in "iu":
                raise MeganeuraError(f"model {self.name!r}: input {name} must hold integer ids, "
                                     f"found dtype {value.dtype}")
            allowed = value if name != "labels" else value[value != IGNORE]
            bad = allowed[(allowed < 0) | (allowed >= size)]
            if bad.size:
                extra = " (or -100 to ignore a position)" if name == "labels" else ""
                raise MeganeuraError(f"model {self.name!r}: input {name} holds id {int(bad.flat[0])}, "
                                     f"outside the vocabulary [0, {size}){extra}")
            out[name] = value.astype(np.int32)
        for name, nid in graph.inputs.items():
            if name in out and tuple(np.shape(out[name])) != tuple(graph.shape(nid)):
                raise MeganeuraError(f"model {self.name!r}: input {name} has shape {list(np.shape(out[name]))}, "
                                     f"the model expects {list(graph.shape(nid))} "
                                     f"(change it with --set batch=B --set seq=T)")
        return out

    def default_inputs(self, inputs: dict, graph: Graph) -> dict:
        return inputs

    def run(self, inputs, params=None, backend="gpu"):
        graph = self.build(train=False)
        inputs = self.check_inputs(self.default_inputs(dict(inputs), graph), graph)
        return super().run(inputs, params=params, backend=backend)

    # description
    def summary(self) -> dict[str, Any]:
        return {"model_type": self.model_type, **super().summary(), "ignored_tensors": list(self.ignored_tensors)}


class CausalLM(HFModel):
    """Shared by llama and gpt2: ids in, logits out; training adds labels and loss."""

    vocab = 0
    max_positions = 0

    def make_settings(self):
        default_seq = min(self.max_positions or 128, 128)
        limit = self.max_positions or 1 << 16
        return {
            "batch": Setting(1, "sequences per step", positive),
            "seq": Setting(default_seq, f"tokens per sequence (at most {limit})", at_most(limit)),
            "samples": Setting(64, "dataset size (random token sequences)", at_most(1_000_000)),
        }

    @property
    def index_inputs(self):
        return {"input_ids": self.vocab, "labels": self.vocab}

    # generation
    token_input = "input_ids"

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def context_length(self) -> int:
        return self.max_positions or 1 << 16

    def causal_logits(self, g, ids):
        return self.logits(g, ids, capture=False)

    def tokenizer(self):
        """The folder's tokenizer.json, else UTF-8 bytes (ids 0-255)."""
        from ..data.tokenizer import ByteTokenizer, load_tokenizer
        found = load_tokenizer(self.folder)
        if found is None and self.vocab < 256:
            raise MeganeuraError(f"{self.folder} has no tokenizer.json and its vocabulary of {self.vocab} cannot "
                                 f"hold bytes; give token ids (--prompt-ids)")
        return found or ByteTokenizer(note=f"{self.folder} has no tokenizer.json: text is UTF-8 bytes (ids 0-255)")

    def eos_ids(self) -> list[int]:
        """config.json's eos_token_id (an id or a list of them)."""
        eos = self.config.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return [int(i) for i in ids if isinstance(i, int)]

    def input_names(self, train):
        return ["input_ids", "labels"] if train else ["input_ids"]

    def text_examples(self, ids):
        """Windows of seq ids (the loss shifts inside): labels are the ids, -100 on padding."""
        from ..data.text import token_windows
        windows, valid = token_windows(ids, self.settings["seq"], 0)
        return {"input_ids": windows, "labels": np.where(valid, windows, IGNORE).astype(np.int32)}

    def logits(self, g: Graph, ids: int, capture: bool) -> int:
        raise NotImplementedError

    def build(self, train=False, batch=None, capture=False) -> Graph:
        batch = batch or self.settings["batch"]
        seq = self.settings["seq"]
        g = Graph(f"{self.model_type}-{'train' if train else 'infer'}-b{batch}")
        ids = g.input("input_ids", (batch, seq), "i32")
        logits = g.output("logits", self.logits(g, ids, capture))
        if train:
            labels = g.input("labels", (batch, seq), "i32")
            if seq < 2:
                raise MeganeuraError(f"model {self.name!r}: training needs seq >= 2 (the loss predicts the next token)")
            # position t predicts label t + 1, the last predicts nothing (IGNORE): the labels
            # shift, not the logits, whose slice and its gradient's pad each copied the
            # [batch, seq - 1, vocab] logits (0.26 and 0.24 ms a step for SmolLM2-135M)
            last = g.constant(np.full((batch, 1), IGNORE, np.int32))
            targets = g.concat([g.slice(labels, 1, 1, seq), last], axis=1)
            g.output("loss", g.cross_entropy_loss(logits, targets, ignore_index=IGNORE))
        return g

    def dataset(self, seed=0):
        rng = np.random.default_rng(seed)
        n, seq = self.settings["samples"], self.settings["seq"]
        ids = rng.integers(0, self.vocab, (n, seq)).astype(np.int32)
        return {"input_ids": ids, "labels": ids.copy()}


def tied_head(g: Graph, x: int, table: nn.Parameter) -> int:
    """x @ tableᵀ: the output projection that shares the input embedding (module
    ``lm_head``, as in the checkpoint's class, though it has no weight of its own)."""
    with g.scope("lm_head"):
        return g.matmul(x, table.node(g), transpose_b=True)


# ---------------------------------------------------------------- llama

class LlamaAttention(nn.Module):
    """Llama's attention, and its relatives' (``c``: which projections have biases, and
    whether q and k are RMS-normalised per head before RoPE, as Qwen3's are)."""

    def __init__(self, c):
        hidden, heads, kv_heads, head_dim = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"]
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, c["theta"]
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=c["qkv_bias"], init=nn.normal(0.02))
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=c["qkv_bias"], init=nn.normal(0.02))
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=c["qkv_bias"], init=nn.normal(0.02))
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=c["o_bias"], init=nn.normal(0.02))
        self.q_norm = nn.RMSNorm(head_dim, c["eps"]) if c["qk_norm"] else None
        self.k_norm = nn.RMSNorm(head_dim, c["eps"]) if c["qk_norm"] else None

    def per_head(self, g, norm, x, heads):
        if norm is None:
            return x
        shape = g.shape(x)
        rows = g.reshape(x, (*shape[:-1], heads, self.head_dim))
        return g.reshape(norm(g, rows), shape)

    def forward(self, g, x):
        q = self.per_head(g, self.q_norm, self.q_proj(g, x), self.heads)
        k = self.per_head(g, self.k_norm, self.k_proj(g, x), self.kv_heads)
        q = kv_cache.rotary(g, q, self.heads, self.theta)
        k = kv_cache.rotary(g, k, self.kv_heads, self.theta)
        v = self.v_proj(g, x)
        return self.o_proj(g, kv_cache.self_attention(g, q, k, v, self.heads, self.kv_heads))


class LlamaMLP(nn.Module):
    def __init__(self, hidden, inner, act, bias=False):
        self.act = act
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, init=nn.normal(0.02))
        self.up_proj = nn.Linear(hidden, inner, bias=bias, init=nn.normal(0.02))
        self.down_proj = nn.Linear(inner, hidden, bias=bias, init=nn.normal(0.02))

    def forward(self, g, x):
        return self.down_proj(g, g.mul(nn.activate(g, self.gate_proj(g, x), self.act), self.up_proj(g, x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c):
        self.self_attn = LlamaAttention(c)
        self.mlp = LlamaMLP(c["hidden"], c["inner"], c["act"], c["mlp_bias"])
        self.input_layernorm = nn.RMSNorm(c["hidden"], c["eps"])
        self.post_attention_layernorm = nn.RMSNorm(c["hidden"], c["eps"])

    def forward(self, g, x):
        x = g.add(x, self.self_attn(g, self.input_layernorm(g, x)))
        return g.add(x, self.mlp(g, self.post_attention_layernorm(g, x)))


class LlamaBody(nn.Module):
    def __init__(self, c):
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"], init=nn.normal(0.02))
        self.layers = [LlamaDecoderLayer(c) for _ in range(c["layers"])]
        self.norm = nn.RMSNorm(c["hidden"], c["eps"])


class LlamaModel(CausalLM):
    """Llama, and the families that differ from it only in biases, per-head norms of q and
    k, a sliding window and their config's defaults (subclasses below)."""

    model_type = "llama"
    description = "Llama-family causal LM (grouped-query attention, RoPE, RMSNorm, SwiGLU)"
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
        # RoPE: rope_theta (older configs) or rope_parameters (transformers 5); scaling refused.
        params = cfg.config.get("rope_parameters") or {}
        if not isinstance(params, dict):
            cfg.refused.append(f"rope_parameters={json.dumps(params)}")
            params = {}
        theta = params.get("rope_theta", cfg.config.get("rope_theta", 10000.0))
        c["theta"] = float(theta)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            cfg.refused.append(f"rope_parameters.rope_type={json.dumps(rope_type)} (supported: \"default\")")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            cfg.refused.append(f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']}")
        cfg.expect("rope_scaling", [None])
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

    @property
    def notes(self):
        return [self.window_note] if self.window_note else []

    def summary(self):
        extra = {"context_length": self.context_length}
        if self.window_note:
            extra["context_note"] = self.window_note
        return {**super().summary(), **extra}

    def make_module(self):
        root = nn.Container(model=LlamaBody(self.c))
        if not self.tied:
            root.lm_head = nn.Linear(self.c["hidden"], self.c["vocab"], bias=False, init=nn.normal(0.02))
        return root

    def select_tensors(self, tensors):
        # Older files store each layer's RoPE inverse frequencies: check them against the config, do not bind.
        hd, theta = self.c["head_dim"], self.c["theta"]
        want = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
        for name in [k for k in tensors if k.endswith(".self_attn.rotary_emb.inv_freq")]:
            value = tensors.pop(name)
            if value.shape != want.shape or not np.allclose(value, want, rtol=1e-3):
                raise ModelImportError(f"weights in {self.folder}: {name} does not match rope_theta={theta} and "
                                       f"head_dim={hd}; scaled or custom RoPE frequencies are not supported")
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
        x = body.embed_tokens(g, ids)
        for layer in body.layers:
            x = layer(g, x)
            if capture:
                nn.capture(g, layer.path, x)
        x = body.norm(g, kv_cache.last_token(g, x))
        return tied_head(g, x, body.embed_tokens.weight) if self.tied else self.module.lm_head(g, x)


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
        window = cfg.config.get("sliding_window", 4096)
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


# ---------------------------------------------------------------- gpt2

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
        c["width"] = cfg.integer("n_embd", _MISSING, "hidden_size")
        c["layers"] = cfg.integer("n_layer", _MISSING, "num_hidden_layers")
        c["heads"] = cfg.integer("n_head", _MISSING, "num_attention_heads")
        c["positions"] = self.max_positions = cfg.integer("n_positions", _MISSING, "max_position_embeddings")
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


# ---------------------------------------------------------------- bert

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


# ---------------------------------------------------------------- whisper (encoder)

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
        from ..models.whisper import WhisperEncoder
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


# ---------------------------------------------------------------- entry point

ARCHITECTURES: dict[str, type[HFModel]] = {
    "llama": LlamaModel, "qwen2": Qwen2Model, "qwen3": Qwen3Model, "mistral": MistralModel,
    "gpt2": GPT2Model, "bert": BertModel, "whisper": WhisperModel,
}


def load_checkpoint(folder: Path, settings: Mapping[str, str]) -> HFModel:
    """The model a Hugging Face checkpoint folder describes, holding its weights."""
    folder = Path(folder)
    config = read_config(folder)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ModelImportError(f"{folder / 'config.json'}: model_type {model_type!r} is not supported; "
                               f"supported: {', '.join(ARCHITECTURES)}")
    tensors = read_weights(folder)
    model = ARCHITECTURES[model_type](folder, config, dict(settings))
    if hasattr(model, "configure_for"):
        model.configure_for(tensors)
    model.attach_weights(tensors)
    return model


__all__ = ["load_checkpoint", "ARCHITECTURES", "HFModel"]
