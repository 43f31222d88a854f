"""The built-in "embedded" run: a tiny model and a character tokenizer built in code, warmed up by a
short supervised phase on the addition format, cached on disk in Hugging Face format.

The warm-up teaches the format and leaves the task far from solved; PACS then lifts held-out
accuracy. Everything here is deterministic in the config, so the cache key is a hash of it.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile

import torch

from ..config import TaskConfig, config_hash
from .arithmetic import AdditionTask

CHARACTERS = list("0123456789+-*=")
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast (pad 0, bos 1, eos 2); adds BOS to every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        padding_side="left")


def build_model(cfg: TaskConfig, vocab_size: int, seed: int):
    """A Qwen2-style causal LM with tied embeddings, randomly initialized from ``seed``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    head_dim = cfg.hidden_size // cfg.num_heads
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, head_dim=head_dim, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        use_sliding_window=False, torch_dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def cache_root(cfg: TaskConfig) -> str:
    return cfg.cache_dir or os.environ.get("PACS_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pacs")


def warmup_key(cfg: TaskConfig, seed: int) -> str:
    fields = {k: getattr(cfg, k) for k in (
        "digits", "hidden_size", "num_layers", "num_heads", "intermediate_size", "warmup_steps",
        "warmup_batch_size", "warmup_lr")}
    fields.update(seed=seed, version=1, vocab="".join(SPECIAL_TOKENS + CHARACTERS))
    return config_hash(fields)


def _sft_batch(task: AdditionTask, tokenizer, rng: random.Random, size: int):
    """Token ids, attention mask and loss mask (answer + EOS only) of ``size`` solved problems."""
    rows, masks = [], []
    for _ in range(size):
        problem = task.train_problem(rng.randrange(1 << 40))
        prompt = tokenizer(problem.prompt)["input_ids"]
        answer = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(r) for r in rows)
    ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros(size, width, dtype=torch.long)
    loss_mask = torch.zeros(size, width, dtype=torch.bool)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        loss_mask[i, :len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return ids, attention, loss_mask


def supervised_warmup(model, tokenizer, task: AdditionTask, cfg: TaskConfig, seed: int, log=print) -> None:
    """``cfg.warmup_steps`` AdamW steps of cross-entropy on the answer tokens, cosine-decayed lr."""
    rng = random.Random(f"warmup-{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    model.train()
    for step in range(cfg.warmup_steps):
        lr = cfg.warmup_lr * 0.5 * (1 + math.cos(math.pi * step / max(cfg.warmup_steps, 1)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, attention, loss_mask = _sft_batch(task, tokenizer, rng, cfg.warmup_batch_size)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        targets, mask = ids[:, 1:], loss_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % 50 == 0 or step + 1 == cfg.warmup_steps:
            log(f"[warm-up] step {step + 1}/{cfg.warmup_steps} loss {loss.item():.3f}")
    model.eval()


def prepare_embedded_model(cfg: TaskConfig, seed: int, log=print) -> str:
    """Path of the warmed-up tiny model in HF format, building and caching it on first use."""
    path = os.path.join(cache_root(cfg), "embedded", warmup_key(cfg, seed))
    if os.path.isfile(os.path.join(path, "config.json")):
        log(f"[warm-up] using cached model {path}")
        return path
    log(f"[warm-up] building the tiny model and running {cfg.warmup_steps} supervised steps "
        f"(cached at {path})")
    tokenizer = build_tokenizer()
    task = AdditionTask(cfg.digits, seed=seed, eval_size=cfg.eval_size)
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg, len(tokenizer), seed)
        torch.manual_seed(seed)
        supervised_warmup(model, tokenizer, task, cfg, seed, log=log)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(path))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return path
