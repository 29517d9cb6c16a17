"""A tiny Llama checkpoint folder written by transformers (random weights), as users open
one; the tests of module names and of the graph view share it. And tiny random models of
Llama's relatives, which the importer's and the generation tests share."""

from __future__ import annotations


def save_llama(path, layers: int = 2, seed: int = 0, **config) -> str:
    """``save_pretrained`` of a Llama with ``layers`` layers (hidden 32, grouped-query
    attention, tied embeddings) into ``path``; returns it as a string."""
    import torch
    import transformers
    torch.manual_seed(seed)
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).save_pretrained(path)
    return str(path)


def llama_relative(family: str, seed: int, **config):
    """A tiny random transformers model of a Llama-family ``family`` (its classes' prefix:
    "Qwen3", "Phi3", ...) in eval mode, ``config`` over a shared small shape; its biases
    and norms moved off their initial zeros and ones so that one bound to the wrong place
    shows, its q and k projections scaled up (the scores far from 0) so that an attention
    scale or a RoPE left out shows too."""
    import torch
    import transformers
    torch.manual_seed(seed)
    fields = dict(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0)
    cfg = getattr(transformers, f"{family}Config")(**{**fields, **config})
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(12.0)
    return hf
