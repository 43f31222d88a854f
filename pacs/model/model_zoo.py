"""Small random-weight copies of real architectures, for tests and dry runs without downloads.

``pacs/configs/models/<name>/config.json`` (package data; ``configs/models`` in a checkout) holds a published
model's config (no weights). :func:`build_small_model`
keeps what makes the architecture what it is -- model class, vocabulary size, rope (theta and scaling),
norms and their epsilon, activation, tied or untied embeddings, logit and attention soft-caps, query
pre-attention scalar, the ratio of query to key/value heads, an explicit ``head_dim`` that differs from
hidden / heads where the real one does, experts -- and shrinks depth and width (2 layers, hidden 64,
head_dim 32, 2 key/value heads with the real model's number of query heads per key/value head (a config
without ``head_dim``, which means hidden / heads: 1 key/value head, hidden = heads x 32), intermediate 128;
a sliding window shrinks to 16 tokens so that it still cuts at test lengths). It random-initializes that
model and saves it, with a byte-level tokenizer built in code (one token per byte, ids far below every
vocabulary size, a chat template in the Qwen style), as a Hugging Face directory ``pacs train --model DIR``,
``AutoModelForCausalLM.from_pretrained`` and vLLM load.
"""

from __future__ import annotations

import json

import torch

from pacs import configs as shipped_configs
from pacs.model.profile import ModelProfile

SPECIAL_TOKENS = ["<pad>", "<bos>", "<|im_end|>", "<|im_start|>"]  # pad 0, bos 1, eos 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# the reduced shape: depth and width only
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
SMALL_HEAD_DIM = 32
SMALL_KV_HEADS = 2
SMALL_SLIDING_WINDOW = 16
SMALL_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def available_models() -> list[str]:
    """Names of the shipped model configs (pacs/configs/models)."""
    return shipped_configs.model_names()


def published_config(name: str) -> dict:
    """The shipped config.json of model ``name`` (or its hub id, e.g. ``Qwen/Qwen3-0.6B``) as a dict."""
    path = shipped_configs.model_config_path(name)
    if path is None:
        raise ValueError(f"model name must be one of {', '.join(available_models())}; got {name!r}")
    with open(path) as fh:
        return json.load(fh)


def build_byte_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte, like the byte fallback of the real
    ones; Hugging Face's Qwen2Tokenizer rebuilds exactly it from its vocabulary): pad 0, bos 1, eos
    ``<|im_end|>`` 2, ``<|im_start|>`` 3, then the 256 byte symbols; :data:`CHAT_TEMPLATE` as its chat
    template. No BOS is added (as Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<|im_end|>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"], padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def small_config(name: str, tokenizer=None, **overrides):
    """The transformers config of model ``name`` at the reduced shape (:data:`SMALL`), special token ids
    those of ``tokenizer`` (default :func:`build_byte_tokenizer`'s); ``overrides``: any config field on top
    (e.g. ``initializer_range``)."""
    from transformers import AutoConfig

    data = published_config(name)
    profile = ModelProfile.from_config(data, name=name)
    tokenizer = tokenizer or build_byte_tokenizer()
    heads, kv_heads = profile.heads, profile.kv_heads
    if not heads or heads % kv_heads:
        raise ValueError(f"{name}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    # 2 key/value heads, each shared by as many query heads as in the real model. A config without head_dim
    # (Qwen2.5) means hidden / heads, as vLLM reads it: there, 1 key/value head and hidden = heads x head_dim.
    small = dict(SMALL, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    if profile.explicit_head_dim:
        small.update(num_attention_heads=SMALL_KV_HEADS * heads // kv_heads, num_key_value_heads=SMALL_KV_HEADS,
                     head_dim=SMALL_HEAD_DIM)
    else:
        small.update(num_attention_heads=heads // kv_heads, num_key_value_heads=1,
                     hidden_size=heads // kv_heads * SMALL_HEAD_DIM)
    if profile.sliding_window:
        small.update(sliding_window=SMALL_SLIDING_WINDOW)
    if "query_pre_attn_scalar" in data:  # Gemma 2: 1/sqrt(this) scales the scores; the real one is head_dim
        small.update(query_pre_attn_scalar=data["query_pre_attn_scalar"] * SMALL_HEAD_DIM // profile.head_dim)
    if profile.experts:
        small.update(SMALL_EXPERTS)
    for key in ("architectures", "transformers_version", "torch_dtype", "use_cache", "cache_implementation"):
        data.pop(key, None)
    data.update(small, **overrides)
    return AutoConfig.for_model(**data)  # data's model_type picks the config class


def build_small_model(name: str, out_dir: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      **overrides) -> str:
    """Random-initialize model ``name`` at the reduced shape (seeded; ``overrides`` as in :func:`small_config`),
    save it in ``dtype`` with the byte-level tokenizer to ``out_dir`` and return ``out_dir``."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_byte_tokenizer()
    config = small_config(name, tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
