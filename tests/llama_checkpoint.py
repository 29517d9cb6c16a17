"""A tiny Llama checkpoint folder written by transformers (random weights), as users open
one; the tests of module names and of the graph view share it."""

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
