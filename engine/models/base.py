"""What every built-in model provides, and its validated settings.

A built-in model is a class with a ``name``, a table of ``SETTINGS`` (each with a
default, a type and a check) and a root ``Module`` (``self.module``) whose
attribute paths are the parameter names of its weights files. Instances are
configured once (``Model(batch=8)`` or ``Model.from_overrides(["batch=8"])``) and
then build graphs: ``build(train=False)`` for inference, ``build(train=True)``
with the scalar output ``loss``. Both graphs name their parameters the same, so
one parameter dict (``init_params(seed)`` or ``load_weights(path)``) feeds both.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..errors import MeganeuraError
from ..graph import inputs as input_checks
from ..graph.ir import Graph
from ..graph.nn import Module


@dataclass(frozen=True)
class Setting:
    """One model setting: its default, its type, and a check returning an error text or None."""

    default: Any
    help: str
    check: Callable[[Any], str | None] = lambda v: None

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def maximum(self):
        """The largest value the check allows, where it says (``at_most``), else None."""
        return getattr(self.check, "limit", None)

    def describe(self) -> dict:
        """The setting for a table or an editor: default, type name, help, and maximum if any."""
        out = {"default": self.default, "type": self.type.__name__, "help": self.help}
        return {**out, "maximum": self.maximum} if self.maximum is not None else out

    def parse(self, model: str, name: str, value) -> Any:
        """``value`` (a string from the command line, or a Python value) as this setting's type."""
        bad = f"model {model!r}: setting {name}={value!r}"
        try:
            if isinstance(value, str) and self.type is not str:
                parsed = self.type(value.strip())
            elif self.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                parsed = float(value)
            else:
                parsed = value
        except ValueError:
            raise MeganeuraError(f"{bad} is not a valid {self.type.__name__}") from None
        if type(parsed) is not self.type:
            raise MeganeuraError(f"{bad} is not a valid {self.type.__name__}")
        problem = self.check(parsed)
        if problem:
            raise MeganeuraError(f"{bad}: {problem}")
        return parsed


def positive(v) -> str | None:
    return None if v > 0 else "must be positive"


class at_most:
    """The check of a positive setting up to ``limit``, which editors read as their maximum."""

    def __init__(self, limit):
        self.limit = limit

    def __call__(self, v) -> str | None:
        return positive(v) or (None if v <= self.limit else f"must be at most {self.limit}")


def parse_overrides(pairs: Iterable[str]) -> dict[str, str]:
    """``["batch=8", "mel_len=500"]`` -> ``{"batch": "8", "mel_len": "500"}``."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise MeganeuraError(f"setting {pair!r} must look like NAME=VALUE, e.g. batch=8")
        out[key.strip()] = value
    return out


class BuiltinModel:
    """Base of the built-in models. Subclasses set ``name``, ``description``,
    ``SETTINGS`` and ``self.module`` and implement ``forward``/``build``,
    ``dataset`` and ``example_inputs``."""

    name = "model"
    description = ""
    SETTINGS: dict[str, Setting] = {}
    # TrainConfig fields this model trains with unless the user says otherwise.
    TRAIN_DEFAULTS: dict[str, Any] = {"optimizer": "adamw", "lr": 1e-3}

    def __init__(self, **settings):
        unknown = set(settings) - set(self.SETTINGS)
        if unknown:
            known = ", ".join(f"{k} (default {s.default})" for k, s in self.SETTINGS.items())
            raise MeganeuraError(f"model {self.name!r} has no setting {', '.join(sorted(unknown))}; "
                                 f"its settings are: {known}")
        self.settings = {k: s.default for k, s in self.SETTINGS.items()}
        for key, value in settings.items():
            self.settings[key] = self.SETTINGS[key].parse(self.name, key, value)
        self.check_settings()
        self.module: Module = self.make_module()

    @classmethod
    def from_overrides(cls, pairs: Iterable[str]) -> "BuiltinModel":
        """Configure from ``--set NAME=VALUE`` strings."""
        return cls(**parse_overrides(pairs))

    @classmethod
    def describe_settings(cls) -> dict[str, dict]:
        return {k: s.describe() for k, s in cls.SETTINGS.items()}

    def check_settings(self) -> None:
        """Checks across settings; raise MeganeuraError on a bad combination."""

    def make_module(self) -> Module:
        raise NotImplementedError

    def build(self, train: bool = False, batch: int | None = None, capture: bool = False) -> Graph:
        raise NotImplementedError

    def dataset(self, seed: int = 0) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def example_inputs(self, batch: int | None = None, train: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
        """The first ``batch`` rows of the dataset, restricted to the graph's inputs."""
        batch = batch or self.settings["batch"]
        data = self.dataset(seed)
        rows = len(next(iter(data.values())))
        if batch > rows:
            raise MeganeuraError(f"model {self.name!r}: batch {batch} exceeds the {rows} dataset rows")
        keys = self.input_names(train)
        return {k: data[k][:batch] for k in keys}

    def input_names(self, train: bool) -> list[str]:
        raise NotImplementedError

    def batch_size(self) -> int:
        """Examples a step takes: the ``batch`` setting, or (a model file with a fixed
        batch) the leading dimension of its first input."""
        if "batch" in self.settings:
            return int(self.settings["batch"])
        g = self.build(train=False)
        shape = g.shape(next(iter(g.inputs.values())))
        return int(shape[0]) if shape else 1

    # ------------------------------------------------------------ parameters and weights

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.module.parameter_shapes()

    def init_params(self, seed: int = 0) -> dict[str, np.ndarray]:
        return self.module.init_params(seed)

    def reset(self, seed: int = 0) -> dict[str, np.ndarray]:
        return self.module.reset(seed)

    @property
    def weight_transposes(self) -> set[str]:
        """Parameter names whose tensors files store transposed ([out, in])."""
        return self.module.weight_transposes()

    def to_file_layout(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Parameters as a weights file stores them (transposes applied)."""
        t = self.weight_transposes
        return {k: np.ascontiguousarray(v.T if k in t else v) for k, v in params.items()}

    def bind(self, tensors: Mapping[str, np.ndarray], source=None, owned: bool = False) -> dict[str, np.ndarray]:
        """File tensors -> parameter dict; every missing/unexpected/mis-shaped name in one error
        (``owned``: tensors just read, bound without copies: ``bind_weights``)."""
        from ..weights import bind_weights
        return bind_weights(tensors, self.parameter_shapes(), self.weight_transposes, source=source, owned=owned)

    def load_weights(self, path) -> dict[str, np.ndarray]:
        from ..weights import load_safetensors
        return self.bind(load_safetensors(path), source=Path(path), owned=True)

    def save_weights(self, params: Mapping[str, np.ndarray], path) -> None:
        """The parameters in file layout; "format": "pt" is what transformers' loader looks for."""
        from ..weights import save_safetensors
        save_safetensors(self.to_file_layout(params), path, metadata={"format": "pt", "model": self.name})

    def checkpoint_files(self) -> list[Path]:
        """Files a checkpoint of this model copies beside its weights (a Hugging Face
        checkpoint's config.json and tokenizer files), so that the checkpoint opens as the model."""
        return []

    # ------------------------------------------------------------ training data
    audio_transcripts = False   # audio models: each clip needs its NAME.txt transcript

    def text_examples(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Training examples (input name -> array) from one stream of token ids: causal LMs."""
        from ..errors import DataError
        raise DataError(f"model {self.name!r} does not train on text; text data is for causal language models "
                        f"(gpt-tiny, Llama-family or GPT-2 checkpoints); give an .npz of its inputs")

    def audio_examples(self, clips) -> dict[str, np.ndarray]:
        """Training examples from (name, 16 kHz samples, transcript) clips: audio models."""
        from ..errors import DataError
        raise DataError(f"model {self.name!r} does not train on audio; audio data is for whisper-tiny and "
                        f"audio-align; give an .npz of its inputs")

    def training_data(self, path):
        """``engine.models.datasets.TrainingData`` of the data at ``path`` for this model."""
        from .datasets import load_training_data
        return load_training_data(self, path)

    # ------------------------------------------------------------ what it is
    def summary(self) -> dict[str, Any]:
        """What ``meganeura inspect`` prints: inputs and outputs (name, shape, dtype) of the
        inference graph, the parameter count and bytes, and its op histogram."""
        g = self.build(train=False)
        count = sum(math.prod(s) for s in self.parameter_shapes().values())
        tensor = lambda name, i: {"name": name, "shape": list(g.shape(i)), "dtype": g[i].dtype}  # noqa: E731
        return {"name": self.name,
                "inputs": [tensor(k, i) for k, i in g.inputs.items()],
                "outputs": [tensor(k, i) for k, i in g.outputs.items()],
                "parameters": int(count), "parameter_bytes": int(count * 4),
                "ops": dict(Counter(n.op for n in g.nodes if n.op not in ("input", "parameter", "constant")))}

    # ------------------------------------------------------------ generating
    token_input: str | None = None   # causal LMs: the name of the token-id input
    vocab_size = 0                   # causal LMs: ids lie in [0, vocab_size)
    context_length = 0               # causal LMs: the most tokens a sequence may hold

    @property
    def notes(self) -> list[str]:
        """What a user should know about how this model was read (e.g. a limit an importer
        chose, and why); the Studio's model panel shows them."""
        return []

    @property
    def generates(self) -> bool:
        return self.token_input is not None

    @property
    def cannot_train(self) -> str | None:
        """Why this model has no training graph (None: it has one), so that a panel can
        say so before a run is started rather than fail it."""
        return None

    def causal_logits(self, g: Graph, ids: int) -> int:
        """The logits of a causal LM on token ids (what its generation graphs compute)."""
        raise MeganeuraError(f"model {self.name!r} does not generate text; generation needs a causal language "
                             f"model (gpt-tiny, or a Llama-family or GPT-2 checkpoint)")

    def require_generation(self) -> None:
        """Raise the error of ``causal_logits`` unless this model generates."""
        if not self.generates:
            self.causal_logits(None, 0)

    def generation_graph(self, seq: int, capacity: int, prefill: bool) -> Graph:
        """A prefill (``seq`` prompt tokens) or decode (one token) graph over a KV cache of
        ``capacity`` positions (``engine.graph.kv_cache``)."""
        from ..graph.kv_cache import generation_graph
        self.require_generation()
        return generation_graph(self.name, self.token_input, seq, capacity, prefill, self.causal_logits)

    def tokenizer(self):
        """How text becomes ids: UTF-8 bytes unless the model has its own."""
        from ..data.tokenizer import ByteTokenizer
        return ByteTokenizer()

    def eos_ids(self) -> list[int]:
        """Ids that end a generation (none by default)."""
        return []

    def generator(self, params: Mapping[str, np.ndarray] | None = None, backend: str = "gpu"):
        """An ``engine.train.generation.Generator``: compiled sessions kept across calls."""
        from ..train.generation import Generator
        self.require_generation()
        return Generator(self, params, backend)

    def generate(self, prompt_ids, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, params: Mapping[str, np.ndarray] | None = None,
                 backend: str = "gpu", on_token=None):
        """New token ids after ``prompt_ids`` with a KV cache (greedy at temperature 0): an
        ``engine.train.generation.Generation`` (``tokens``, ``stopped``, timings)."""
        from ..train.generation import Sampling
        return self.generator(params, backend).generate(prompt_ids, max_new_tokens,
                                                        Sampling(temperature, top_k, top_p, seed),
                                                        self.eos_ids(), on_token)

    # ------------------------------------------------------------ running
    def check_input_names(self, names: Iterable[str]) -> None:
        """An InputError naming every one of ``names`` this model has no input of: a value
        under a misspelt name would otherwise be dropped and the input left to another."""
        input_checks.check_input_names(self.build(train=False), names, f"model {self.name!r}")

    def check_run_inputs(self, graph: Graph, inputs: Mapping[str, np.ndarray]) -> None:
        """Refuse, before either backend runs, inputs that do not fit ``graph``: unknown or
        missing names, integers beyond int32 or outside the table they index (the GPU
        would read zeros, the reference raise, a cast to int32 wrap)."""
        owner = f"model {self.name!r}"
        input_checks.check_input_names(graph, inputs, owner)
        missing = sorted(set(graph.inputs) - set(inputs))
        if missing:
            raise MeganeuraError(f"{owner}: no value for input(s) {', '.join(missing)}; "
                                 f"its inputs are {', '.join(graph.inputs)}")
        input_checks.check_integer_inputs(graph, inputs, owner)

    def run(self, inputs: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray] | None = None,
            backend: str = "gpu") -> dict[str, np.ndarray]:
        """One forward pass: output name -> array. ``params`` default to ``init_params()``
        (an imported model's own weights); ``backend`` is "gpu" or "reference"."""
        graph = self.build(train=False)
        params = self.init_params() if params is None else params
        self.check_run_inputs(graph, inputs)
        if backend == "reference":
            from ..graph import reference
            return reference.run(graph, dict(inputs), dict(params), dtype=np.float32)
        if backend != "gpu":
            raise MeganeuraError(f"backend {backend!r} is not one of gpu, reference")
        from ..runtime.session import build_inference_session
        session = build_inference_session(graph)
        for name, value in params.items():
            session.set_parameter(name, value)
        for name, value in inputs.items():
            session.set_input(name, value)
        session.run()
        return {name: session.read_output(name) for name in graph.outputs}
