"""Shared set-up for the TRL integration tests: a tiny Llama, the character tokenizer and a prompt
dataset, all built in code (no hub), and a deterministic 0/1 reward with mixed outcomes."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub, no telemetry

import torch  # noqa: E402

GROUP = 4


def tokenizer():
    from pacs.tasks.embedded import build_tokenizer

    return build_tokenizer()


def tiny_model(vocab_size: int, seed: int = 0, **config):
    """A 2-layer Llama (hidden 32, 4 heads of head_dim 8); ``config`` overrides any LlamaConfig field."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    settings.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**settings))


def prompts(n: int = 64, varied: bool = False):
    """``n`` prompts "a+b=", all 4 characters, or with ``varied`` "a+a+...=" of 3 to 13 characters (TRL left-pads
    the shorter ones)."""
    from datasets import Dataset

    if varied:
        return Dataset.from_dict({"prompt": [f"{i % 10}+" * (1 + i % 6) + "=" for i in range(n)]})
    return Dataset.from_dict({"prompt": [f"{i % 10}+{(3 * i) % 10}=" for i in range(n)]})


def contains_one(completions, **kwargs):
    """1.0 when the completion holds a '1', else 0.0 (about a third of the random model's answers)."""
    return [1.0 if "1" in text else 0.0 for text in completions]


def contains_one_or_none(completions, **kwargs):
    """As contains_one, but no verdict (None) when the completion holds a '7'."""
    return [None if "7" in text else (1.0 if "1" in text else 0.0) for text in completions]


def config(tmp_dir, **overrides):
    from pacs.integrations.trl import PACSConfig

    settings = dict(
        output_dir=str(tmp_dir), per_device_train_batch_size=2 * GROUP, gradient_accumulation_steps=2,
        num_generations=GROUP, max_completion_length=6, max_steps=3, learning_rate=1e-2, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, temperature=1.0,
        bf16=False)  # float32 comparisons (TRL defaults to bf16 autocast)
    settings.update(overrides)
    return PACSConfig(**settings)


def trainer(tmp_dir, reward=contains_one, model=None, varied_prompts: bool = False, **overrides):
    from pacs.integrations.trl import PACSTrainer

    tok = tokenizer()
    model = tiny_model(len(tok)) if model is None else model
    return PACSTrainer(model, reward, args=config(tmp_dir, **overrides), train_dataset=prompts(varied=varied_prompts),
                       processing_class=tok)


def naive_logp(model, batch, temperature):
    """(B, C) float32 log-probs of a TRL batch's completion tokens from the model's full logits, at
    ``temperature`` (differentiable; wrap in torch.no_grad() for values only)."""
    completion = batch["completion_ids"]
    input_ids = torch.cat([batch["prompt_ids"], completion], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, -completion.shape[1] - 1:-1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, completion[..., None])[..., 0]
