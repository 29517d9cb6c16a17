"""PyTorch versions of the built-in models for timing (any device, float32, trainable).

Same layers and shapes as ``engine/models`` and as ``tests/torch_reference.py``
(which is float64, CPU and numpy in/out, for correctness); these take a dict of
torch tensors in file layout (``model.to_file_layout(params)``: Linear [out, in]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def to_torch(params: dict, device, frozen=()) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in params.items():
        t = torch.tensor(v, dtype=torch.float32, device=device)
        t.requires_grad_(k not in frozen)
        out[k] = t
    return out


def linear(x, w, name, bias=True):
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias") if bias else None)


def split_heads(x, heads):
    b, t, width = x.shape
    return x.view(b, t, heads, width // heads).transpose(1, 2)


def rope(x, base=10000.0):
    d, t = x.shape[-1], x.shape[-2]
    freqs = base ** (-torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    angles = torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * freqs[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def self_attention(x, w, name, heads, causal=False, use_rope=False, bias=True, k_bias=True):
    q = split_heads(linear(x, w, f"{name}.q_proj", bias), heads)
    k = split_heads(linear(x, w, f"{name}.k_proj", k_bias), heads)
    v = split_heads(linear(x, w, f"{name}.v_proj", bias), heads)
    if use_rope:
        q, k = rope(q), rope(k)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    b, h, t, d = o.shape
    return linear(o.transpose(1, 2).reshape(b, t, h * d), w, f"{name}.out_proj", bias)


def layer_norm(x, w, name, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)


def rms_norm(x, w, name, eps=1e-6):
    return F.rms_norm(x, x.shape[-1:], w[f"{name}.weight"], eps)


def whisper_encoder(mel, w, layers=4, heads=6):
    p = "model.encoder"
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


def gpt_logits(tokens, w, depth=6, heads=6):
    x = w["embed.weight"][tokens]
    for i in range(depth):
        lp = f"layers.{i}"
        x = x + self_attention(rms_norm(x, w, f"{lp}.attn_norm"), w, f"{lp}.attn", heads, causal=True,
                               use_rope=True, bias=False)
        h = F.gelu(linear(rms_norm(x, w, f"{lp}.mlp_norm"), w, f"{lp}.mlp.fc1", bias=False))
        x = x + linear(h, w, f"{lp}.mlp.fc2", bias=False)
    return linear(rms_norm(x, w, "norm"), w, "lm_head", bias=False)


def mlp_logits(x, w):
    return linear(F.relu(linear(x, w, "fc1")), w, "fc2")


def loss_fn(model: str, w, inputs):
    """The training loss of each built-in model, as the engine's training graph has it."""
    if model == "mlp":
        return F.cross_entropy(mlp_logits(inputs["x"], w), inputs["labels"].long())
    if model == "whisper-tiny":
        return F.mse_loss(whisper_encoder(inputs["mel"], w), inputs["target"])
    if model == "gpt-tiny":
        logits = gpt_logits(inputs["tokens"].long(), w)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs["targets"].long().reshape(-1),
                               ignore_index=-100)
    raise ValueError(model)
