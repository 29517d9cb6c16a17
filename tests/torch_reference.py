"""Independent PyTorch implementations of the built-in models, for the tests.

They read weights in PyTorch/HuggingFace layout (Linear [out, in]), i.e. what
``model.to_file_layout(params)`` gives, so they also check the transposes. They
use torch's own ops (conv1d, layer_norm, scaled_dot_product_attention, ...),
not the engine's reference functions.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def tensors(params: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in params.items()}


def linear(x, w, name, bias=True):
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias") if bias else None)


def split_heads(x, heads):
    b, t, width = x.shape
    return x.view(b, t, heads, width // heads).transpose(1, 2)


def rotate_half_rope(x, base=10000.0):
    """x [b, heads, t, d]: rotate pairs (i, i + d/2) by position * base^(-2i/d)."""
    d, t = x.shape[-1], x.shape[-2]
    freqs = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    angles = torch.arange(t, dtype=x.dtype)[:, None] * freqs[None, :]
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


def whisper_encoder(mel: np.ndarray, params: dict, layers=4, heads=6) -> np.ndarray:
    w, p = tensors(params), "model.encoder"
    x = F.gelu(F.conv1d(torch.from_numpy(mel).double(), w[f"{p}.conv1.weight"], w[f"{p}.conv1.bias"], padding=1))
    x = F.gelu(F.conv1d(x, w[f"{p}.conv2.weight"], w[f"{p}.conv2.bias"], stride=2, padding=1))
    x = x.permute(0, 2, 1)
    x = x + w[f"{p}.embed_positions.weight"][: x.shape[1]]
    for i in range(layers):
        lp = f"{p}.layers.{i}"
        x = x + self_attention(layer_norm(x, w, f"{lp}.self_attn_layer_norm"), w, f"{lp}.self_attn", heads,
                               k_bias=False)
        h = F.gelu(linear(layer_norm(x, w, f"{lp}.final_layer_norm"), w, f"{lp}.fc1"))
        x = x + linear(h, w, f"{lp}.fc2")
    return layer_norm(x, w, f"{p}.layer_norm").numpy()


def gpt_decode(x: torch.Tensor, w: dict, prefix="", depth=6, heads=6) -> torch.Tensor:
    """Embeddings [b, t, 384] -> logits, for the gpt-tiny weights under ``prefix``."""
    for i in range(depth):
        lp = f"{prefix}layers.{i}"
        x = x + self_attention(rms_norm(x, w, f"{lp}.attn_norm"), w, f"{lp}.attn", heads, causal=True,
                               rope=True, bias=False)
        h = F.gelu(linear(rms_norm(x, w, f"{lp}.mlp_norm"), w, f"{lp}.mlp.fc1", bias=False))
        x = x + linear(h, w, f"{lp}.mlp.fc2", bias=False)
    return linear(rms_norm(x, w, f"{prefix}norm"), w, f"{prefix}lm_head", bias=False)


def embed(tokens: np.ndarray, w: dict, prefix="") -> torch.Tensor:
    return w[f"{prefix}embed.weight"][torch.from_numpy(tokens.astype(np.int64))]


def gpt_logits(tokens: np.ndarray, params: dict) -> torch.Tensor:
    w = tensors(params)
    return gpt_decode(embed(tokens, w), w)


def audio_align_logits(mel: np.ndarray, tokens: np.ndarray, params: dict) -> np.ndarray:
    w = tensors(params)
    audio = torch.from_numpy(whisper_encoder(mel, params))
    audio = rms_norm(linear(F.gelu(linear(audio, w, "projector.fc1")), w, "projector.fc2"), w, "audio_norm")
    logits = gpt_decode(torch.cat([audio, embed(tokens, w, "gpt.")], 1), w, "gpt.")
    return logits[:, audio.shape[1]:].numpy()


def mlp_logits(x: np.ndarray, params: dict) -> np.ndarray:
    w = tensors(params)
    h = F.relu(linear(torch.from_numpy(x).double(), w, "fc1"))
    return linear(h, w, "fc2").numpy()
