"""What every checkpoint architecture shares: reading the folder (config.json and the
safetensors weights, sharded too), reading a config field by field (``ConfigReader``:
every field it cannot honour refused by name, all together), the model base binding the
weights, and the causal LMs' inputs, training graph and generation hooks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ...errors import MeganeuraError, ModelImportError, WeightsError
from ...graph import nn
from ...graph.ir import Graph
from ...models.base import BuiltinModel, Setting, at_most, positive

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


def read_weights(folder: Path, progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (float32 for floats), from one file or its shards;
    ``progress(bytes read, bytes in all)`` as they are read (what it raises ends the read)."""
    from ...weights import load_safetensors
    done = [0]

    def load(path, total=None):
        total = total or path.stat().st_size
        report = None if progress is None else (lambda read, _size: progress(done[0] + read, total))
        try:
            tensors = load_safetensors(path, report)
        except WeightsError as exc:
            raise ModelImportError(str(exc)) from None
        done[0] += path.stat().st_size
        return tensors

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
        shards = sorted(set(map(str, weight_map.values())))
        absent = [shard for shard in shards if not (folder / shard).is_file()]
        total = sum((folder / shard).stat().st_size for shard in shards if shard not in absent)
        for shard in shards:
            if shard not in absent:
                tensors.update(load(folder / shard, total))
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

REQUIRED = object()   # a field without a default: its absence is an error naming it


class ConfigReader:
    """Reads fields of a config and collects the ones this importer cannot honour."""

    def __init__(self, config: Mapping, model_type: str):
        self.config, self.model_type = config, model_type
        self.refused: list[str] = []

    def get(self, key, default=REQUIRED, *aliases):
        for k in (key, *aliases):
            if k in self.config and self.config[k] is not None:
                return self.config[k]
        if default is REQUIRED:
            raise ModelImportError(f"{self.model_type} config: field {key!r} is missing")
        return default

    def integer(self, key, default=REQUIRED, *aliases) -> int:
        value = self.get(key, default, *aliases)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelImportError(f"{self.model_type} config: {key} must be a positive integer, found {value!r}")
        return value

    def number(self, key, default=REQUIRED, *aliases) -> float:
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


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


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
        from ...weights import bind_weights
        chosen = self.select_tensors(dict(tensors))
        self.ignored_tensors = sorted(set(tensors) - set(chosen))
        try:
            self._params = bind_weights(chosen, self.parameter_shapes(), self.weight_transposes,
                                        source=self.folder, owned=True)
        except WeightsError as exc:
            raise ModelImportError(f"{exc} (config.json: model_type {self.model_type})") from None

    def checkpoint_files(self) -> list[Path]:
        """config.json and the tokenizer and generation files the checkpoint folder has."""
        return [self.folder / name for name in CHECKPOINT_FILES if (self.folder / name).is_file()]

    def init_params(self, seed: int = 0) -> dict[str, np.ndarray]:
        """The checkpoint's weights, whatever the seed, as read-only views: nothing writes
        into a parameter dict's arrays (training and generation make new ones), and a copy
        of a 1B-parameter model's is 5 GB."""
        return {k: _read_only(v) for k, v in self._params.items()}

    def reset(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Fresh random weights from the module's init specs (to train from scratch)."""
        return self.module.init_params(seed)

    # inputs
    def check_inputs(self, inputs: Mapping[str, np.ndarray], graph: Graph) -> dict[str, np.ndarray]:
        """Integer ids where the model takes ids, the graph's shapes; MeganeuraError otherwise.
        The ids' range (and int32) is checked by ``run`` for every model, from the graph: a
        cast here would wrap ids beyond int32 before that check saw them."""
        out = dict(inputs)
        for name in (n for n in self.index_inputs if n in out):
            dtype = np.asarray(out[name]).dtype
            if dtype.kind not in "iu":
                raise MeganeuraError(f"model {self.name!r}: input {name} must hold integer ids, found dtype {dtype}")
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
        """The folder's tokenizer.json. Without one there is no tokenizer: the checkpoint's
        ids are its own tokenizer's, not bytes, so decoding them as bytes would show nothing
        or garbage. Callers then show ids and refuse text prompts."""
        from ...data.tokenizer import load_tokenizer
        found = load_tokenizer(self.folder)
        if found is None:
            raise MeganeuraError(f"{self.folder} has no tokenizer.json (the only tokenizer file read), so text "
                                 f"cannot become its token ids: give the prompt as token ids (--prompt-ids on the command line)")
        return found

    def eos_ids(self) -> list[int]:
        """config.json's eos_token_id (an id or a list of them)."""
        eos = self.config.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return [int(i) for i in ids if isinstance(i, int)]

    def input_names(self, train):
        return ["input_ids", "labels"] if train else ["input_ids"]

    def text_examples(self, ids):
        """Windows of seq ids (the loss shifts inside): labels are the ids, -100 on padding."""
        from ...data.text import token_windows
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
