"""Independent PyTorch implementations of the built-in models, for the tests.

They read weights in PyTorch/HuggingFace layout (Linear [out, in]), i.e. what
``model.to_file_layout(params)`` gives, so they also check the transposes. They
use torch's own ops (conv1d, layer_norm, scaled_dot_product_attention, ...),
not the engine's reference functions.

Two levels:
- tensor functions (``*_forward``, ``*_loss``) take a dict of torch tensors ``w``
  (e.g. leaves with requires_grad, from ``leaves``) and tensor inputs, and return
  tensors, so autograd runs through them;
- numpy wrappers (``whisper_encoder``, ``audio_align_logits``, ``mlp_logits``,
  ``gpt_logits``) take numpy params/inputs and compute in float64.
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

IGNORE = -100


def tensors(params: Mapping, dtype=torch.float64) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.asarray(v), dtype=dtype) for k, v in params.items()}


def leaves(params: Mapping, trainable=lambda name: True, dtype=torch.float64, device=None) -> dict[str, torch.Tensor]:
    """Fresh leaf tensors; ``requires_grad`` only where ``trainable(name)``."""
    return {k: torch.tensor(np.asarray(v), dtype=dtype, device=device, requires_grad=bool(trainable(k)))
            for k, v in params.items()}


def as_tensor(x, dtype=torch.float64) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x), dtype=dtype)


def as_ids(x) -> torch.Tensor:
    return x.long() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x).astype(np.int64))


# ---------------------------------------------------------------- building blocks

def linear(x, w, name, bias=True):
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias") if bias else None)


def split_heads(x, heads):
    b, t, width = x.shape
    return x.view(b, t, heads, width // heads).transpose(1, 2)


def rotate_half_rope(x, base=10000.0):
    """x [b, heads, t, d]: rotate pairs (i, i + d/2) by position * base^(-2i/d)."""
    d, t = x.shape[-1], x.shape[-2]
    freqs = base ** (-torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    angles = torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * freqs[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def self_attention(x, w, name, heads, kv_heads=None, causal=False, rope=False, bias=True, k_bias=True):
    kv_heads = kv_heads or heads
    q = split_heads(linear(x, w, f"{name}.q_proj", bias), heads)
    k = split_heads(linear(x, w, f"{name}.k_proj", k_bias), kv_heads)
    v = split_heads(linear(x, w, f"{name}.v_proj", bias), kv_heads)
    if rope:
        q, k = rotate_half_rope(q), rotate_half_rope(k)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
    b, h, t, d = o.shape
    return linear(o.transpose(1, 2).reshape(b, t, h * d), w, f"{name}.out_proj", bias)


def layer_norm(x, w, name, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)


def rms_norm(x, w, name, eps=1e-6):
    return F.rms_norm(x, x.shape[-1:], w[f"{name}.weight"], eps)


def cross_entropy(logits, targets):
    """Mean cross-entropy over the positions whose target is not IGNORE."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), as_ids(targets).reshape(-1), ignore_index=IGNORE)


# ---------------------------------------------------------------- models on tensors

def whisper_forward(mel, w, prefix="model.encoder", layers=4, heads=6) -> torch.Tensor:
    """mel [b, 80, t] -> hidden [b, t/2, 384]."""
    p = prefix
    x = F.gelu(F.conv1d(mel, w[f"{p}.conv1.weight"], w[f"{p}.conv1.bias"], padding=1))
    x = F.gelu(F.conv1d(x, w[f"{p}.conv2.weight"], w[f"{p}.conv2.bias"], stride=2, padding=1))
    x = x.permute(0, 2, 1)
    x = x + w[f"{p}.embed_positions.weight"][: x.shape[1]]
    for i in range(layers):
        lp = f"{p}.layers.{i}"
        x = x + self_attention(layer_norm(x, w, f"{lp}.self_attn_layer_norm"), w, f"{lp}.self_attn", heads,
                               k_bias=False)
        h = F.gelu(linear(layer_norm(x, w, f"{lp}.final_layer_norm"), w, f"{lp}.fc1"))
        x = x + linear(h, w, f"{lp}.fc2")
    return layer_norm(x, w, f"{p}.layer_norm")


def whisper_loss(mel, target, w) -> torch.Tensor:
    """whisper-tiny's training loss: MSE of ``hidden`` against ``target``."""
    return F.mse_loss(whisper_forward(mel, w), target)


def gpt_decode(x: torch.Tensor, w: dict, prefix="", heads=6) -> torch.Tensor:
    """Embeddings [b, t, 384] -> logits, for the gpt-tiny weights under ``prefix`` (as many
    layers as the weights hold)."""
    depth = sum(1 for name in w if re.fullmatch(rf"{re.escape(prefix)}layers\.\d+\.attn_norm\.weight", name))
    for i in range(depth):
        lp = f"{prefix}layers.{i}"
        x = x + self_attention(rms_norm(x, w, f"{lp}.attn_norm"), w, f"{lp}.attn", heads, causal=True,
                               rope=True, bias=False)
        h = F.gelu(linear(rms_norm(x, w, f"{lp}.mlp_norm"), w, f"{lp}.mlp.fc1", bias=False))
        x = x + linear(h, w, f"{lp}.mlp.fc2", bias=False)
    return linear(rms_norm(x, w, f"{prefix}norm"), w, f"{prefix}lm_head", bias=False)


def embed(tokens, w: dict, prefix="") -> torch.Tensor:
    return w[f"{prefix}embed.weight"][as_ids(tokens)]


def gpt_forward(tokens, w) -> torch.Tensor:
    return gpt_decode(embed(tokens, w), w)


def audio_soft_tokens(hidden, w) -> torch.Tensor:
    """Encoder output -> projector -> audio_norm."""
    return rms_norm(linear(F.gelu(linear(hidden, w, "projector.fc1")), w, "projector.fc2"), w, "audio_norm")


def audio_align_forward(mel, tokens, w, hidden=None) -> torch.Tensor:
    """Logits over the text positions. ``hidden``, the (frozen) encoder's output for
    ``mel``, may be given to skip recomputing it."""
    if hidden is None:
        hidden = whisper_forward(mel, w)
    audio = audio_soft_tokens(hidden, w)
    logits = gpt_decode(torch.cat([audio, embed(tokens, w, "gpt.")], 1), w, "gpt.")
    return logits[:, audio.shape[1]:]


def mlp_forward(x, w) -> torch.Tensor:
    return linear(F.relu(linear(x, w, "fc1")), w, "fc2")


# ---------------------------------------------------------------- training

def audio_align_training_losses(model, params, batches, config, device=None, autocast=None,
                                compiled=False) -> list[float]:
    """audio-align's training recipe in PyTorch float32: frozen encoder (no gradient,
    its output computed without a graph), AdamW, clipping by the global norm summed in
    float64 like the engine (torch's clip_grad_norm_ sums in float32 and overflows on
    this model's first step, ~7e21). One loss per batch. For the benchmark: the forward
    and loss under autocast to ``autocast`` (a dtype), and through ``torch.compile``."""
    graph = model.build(train=True)
    trainable = sorted(n for n, m in graph.param_meta.items() if m["trainable"])
    w = leaves(model.to_file_layout(params), trainable=set(trainable).__contains__, dtype=torch.float32,
               device=device)
    params_ = [w[n] for n in trainable]
    opt = torch.optim.AdamW(params_, lr=config.lr, betas=config.betas, eps=config.eps,
                            weight_decay=config.weight_decay)
    encode, decode = (torch.compile(whisper_forward), torch.compile(audio_align_forward)) if compiled \
        else (whisper_forward, audio_align_forward)
    device_type = torch.device(device or "cpu").type
    losses = []
    for batch in batches:
        mel = torch.tensor(np.asarray(batch["mel"]), dtype=torch.float32, device=device)
        tokens = torch.tensor(np.asarray(batch["tokens"]), device=device)
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            with torch.no_grad():
                hidden = encode(mel, w)
            logits = decode(mel, tokens, w, hidden=hidden)
            loss = cross_entropy(logits, torch.tensor(np.asarray(batch["targets"]), device=device))
        opt.zero_grad()
        loss.backward()
        norm = sum(float(p.grad.double().square().sum()) for p in params_) ** 0.5
        factor = min(1.0, config.clip_norm / (norm + 1e-6))
        for p in params_:
            p.grad.mul_(factor)
        opt.step()
        losses.append(loss.item())
    assert all(w[n].grad is None for n in w if n.startswith("model.encoder."))
    return losses


# ---------------------------------------------------------------- numpy wrappers (float64)

def whisper_encoder(mel: np.ndarray, params: dict) -> np.ndarray:
    with torch.no_grad():
        return whisper_forward(as_tensor(mel), tensors(params)).numpy()


def gpt_logits(tokens: np.ndarray, params: dict) -> torch.Tensor:
    with torch.no_grad():
        return gpt_forward(tokens, tensors(params))


def audio_align_logits(mel: np.ndarray, tokens: np.ndarray, params: dict) -> np.ndarray:
    with torch.no_grad():
        return audio_align_forward(as_tensor(mel), tokens, tensors(params)).numpy()


def mlp_logits(x: np.ndarray, params: dict) -> np.ndarray:
    with torch.no_grad():
        return mlp_forward(as_tensor(x), tensors(params)).numpy()
