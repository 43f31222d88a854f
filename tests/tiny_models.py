"""Tiny Hugging Face models saved to a directory, built in code (no hub): the shared builder of the tests that
load a policy or an engine from a model directory."""

import torch
import transformers

QWEN2 = dict(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)


def save_tiny_qwen2(path, seed: int = 0, **config) -> str:
    """A Qwen2 (``QWEN2``: 2 layers, hidden 32, grouped key/value heads, untied embeddings; ``config`` overrides any
    Qwen2Config field) with Hugging Face's initialization from ``seed`` (the global RNG left as it was), saved in
    float32 to ``path``; returns ``path`` as a string."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**(QWEN2 | config))).save_pretrained(path)
    return str(path)
