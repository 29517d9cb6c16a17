"""Hugging Face checkpoint folders (``config.json`` + safetensors weights) as models.

``load_checkpoint(folder, settings)`` reads the config, picks the architecture by
``model_type`` (``llama``, with Llama 3's or linear RoPE scaling, and its relatives
``qwen2``, ``qwen3``, ``mistral``, ``granite``, ``phi3``, ``olmo2``, ``smollm3``:
``llama.py``; ``gpt2``, ``bert``, ``whisper`` — its encoder only: a module each), builds
it with the ``nn`` Module API under the checkpoint's own tensor names (``base.py``: what
they share), and binds the weights (``model.safetensors``, or the shards
``model.safetensors.index.json`` lists; f16/bf16 are widened to f32). Every problem is a
``ModelImportError`` of one line: no config, no weights, an unknown ``model_type``,
config fields this importer does not implement set to non-default values (named, never
approximated), weights that disagree with the config (every missing, unexpected and
mis-shaped tensor named).

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

from pathlib import Path
from typing import Mapping

from ...errors import ModelImportError
from .base import HFModel, read_config, read_weights
from .bert import BertModel
from .gpt2 import GPT2Model
from .llama import (GraniteModel, LlamaModel, MistralModel, Olmo2Model, Phi3Model, Qwen2Model,
                    Qwen3Model, SmolLM3Model)
from .whisper import WhisperModel


ARCHITECTURES: dict[str, type[HFModel]] = {
    "llama": LlamaModel, "qwen2": Qwen2Model, "qwen3": Qwen3Model, "mistral": MistralModel,
    "granite": GraniteModel, "phi3": Phi3Model, "olmo2": Olmo2Model, "smollm3": SmolLM3Model,
    "gpt2": GPT2Model, "bert": BertModel, "whisper": WhisperModel,
}


def load_checkpoint(folder: Path, settings: Mapping[str, str], progress=None) -> HFModel:
    """The model a Hugging Face checkpoint folder describes, holding its weights
    (``progress``: ``read_weights``')."""
    folder = Path(folder)
    config = read_config(folder)
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelImportError(f"{folder / 'config.json'} has no model_type, so the architecture is unknown; "
                               f"supported: {', '.join(ARCHITECTURES)}")
    if model_type not in ARCHITECTURES:
        raise ModelImportError(f"{folder / 'config.json'}: model_type {model_type!r} is not supported; "
                               f"supported: {', '.join(ARCHITECTURES)}")
    tensors = read_weights(folder, progress)
    model = ARCHITECTURES[model_type](folder, config, dict(settings))
    if hasattr(model, "configure_for"):
        model.configure_for(tensors)
    model.attach_weights(tensors)
    return model


__all__ = ["load_checkpoint", "ARCHITECTURES", "HFModel"]
