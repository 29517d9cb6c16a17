"""The built-in models in PyTorch for timing: the tensor functions of
``tests/torch_reference.py`` (the tests' independent implementation, any device and
dtype, trainable), fed with float32 tensors on the benchmark's device.

Weights come in file layout (``model.to_file_layout(params)``: Linear [out, in]).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import torch_reference as tr  # noqa: E402


def to_torch(params: dict, device, frozen=()) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in params.items():
        t = torch.tensor(v, dtype=torch.float32, device=device)
        t.requires_grad_(k not in frozen)
        out[k] = t
    return out


whisper_encoder = tr.whisper_forward


def loss_fn(model: str, w, inputs):
    """The training loss of each built-in model, as the engine's training graph has it."""
    if model == "mlp":
        return tr.cross_entropy(tr.mlp_forward(inputs["x"], w), inputs["labels"])
    if model == "whisper-tiny":
        return tr.whisper_loss(inputs["mel"], inputs["target"], w)
    if model == "gpt-tiny":
        return tr.cross_entropy(tr.gpt_forward(inputs["tokens"], w), inputs["targets"])
    raise ValueError(model)
