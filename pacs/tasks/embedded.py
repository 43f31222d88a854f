"""The built-in "embedded" run: a tiny model and a character tokenizer built in code, warmed up by a
short supervised phase on the addition format, cached on disk in Hugging Face format. With
``task.name=wordmath`` the same model family gets the word tokenizer of
:mod:`pacs.tasks.word_problems` and is warmed up on word problems instead.

The warm-up teaches the format and leaves the task far from solved; PACS then lifts held-out
accuracy. Everything here is deterministic in the config, so the cache key is a hash of it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time

import torch

from pacs.config import TaskConfig, config_hash
from pacs.tasks.arithmetic import AdditionTask
from pacs.tasks.base import Task
from pacs.tasks.word_problems import WORDS, WordProblemTask, build_word_tokenizer

CHARACTERS = list("0123456789+-*=")
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
MAX_POSITIONS = 64


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


def model_config(cfg: TaskConfig, vocab_size: int):
    """The Qwen2 config of the embedded model (also what the config checks read before it is built)."""
    from transformers import Qwen2Config

    head_dim = cfg.hidden_size // cfg.num_heads
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, head_dim=head_dim, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        use_sliding_window=False, torch_dtype="float32")


def build_model(cfg: TaskConfig, vocab_size: int, seed: int):
    """A Qwen2-style causal LM with tied embeddings, randomly initialized from ``seed``."""
    from transformers import Qwen2ForCausalLM

    config = model_config(cfg, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def cache_root(cfg: TaskConfig) -> str:
    return cfg.cache_dir or os.environ.get("PACS_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pacs")


def warmup_key(cfg: TaskConfig, seed: int) -> str:
    fields = {k: getattr(cfg, k) for k in (
        "digits", "reverse", "hidden_size", "num_layers", "num_heads", "intermediate_size", "warmup_steps",
        "warmup_batch_size", "warmup_lr", "warmup_target_accuracy")}
    fields.update(seed=seed, version=2, vocab="".join(SPECIAL_TOKENS + CHARACTERS))
    if cfg.name == "wordmath":  # the addition task's key is left as it was (its caches stay valid)
        fields.update(task="wordmath", word_steps=cfg.word_steps, vocab=" ".join(WORDS))
    return config_hash(fields)


def warmup_task_and_tokenizer(cfg: TaskConfig, seed: int):
    """The task whose problems the warm-up trains on, and the tokenizer of its tiny model."""
    if cfg.name == "wordmath":
        return WordProblemTask(cfg.word_steps, seed=seed, eval_size=cfg.eval_size), build_word_tokenizer()
    return AdditionTask(cfg.digits, seed=seed, eval_size=cfg.eval_size, reverse=cfg.reverse), build_tokenizer()


def _sft_batch(task: Task, tokenizer, rng: random.Random, size: int):
    """Token ids, attention mask and loss mask (target + EOS only) of ``size`` solved problems."""
    rows, masks = [], []
    for _ in range(size):
        problem = task.train_problem(rng.randrange(1 << 40))
        prompt = tokenizer(problem.prompt)["input_ids"]
        answer = tokenizer(task.target_text(problem), add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id]
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


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems, task: Task | None = None) -> float:
    """Accuracy of greedy answers (HF generate, left-padded batch): ``task.reward``, or exact match
    with the answer when no task is given."""
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    targets = [task.target_text(p) if task is not None else p.answer for p in problems]
    longest_answer = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in targets) + 1
    out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=longest_answer, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    if task is None:
        return sum(t.strip() == p.answer for t, p in zip(texts, problems)) / len(problems)
    return sum(task.reward(t, p) for t, p in zip(texts, problems)) / len(problems)


def supervised_warmup(model, tokenizer, task: Task, cfg: TaskConfig, seed: int, log=print) -> dict:
    """Cross-entropy on the answer tokens (AdamW, constant lr) until greedy accuracy on a validation
    set (training-stream problems, never the held-out ones) reaches ``cfg.warmup_target_accuracy``,
    or for at most ``cfg.warmup_steps`` steps. Stopping at a target, not a step count, leaves the
    task equally far from solved whatever the seed. Returns a summary."""
    rng = random.Random(f"warmup-{seed}")
    validation = task.train_batch(10**9, 200)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    accuracy, step = 0.0, 0
    for step in range(1, cfg.warmup_steps + 1):
        model.train()
        ids, attention, loss_mask = _sft_batch(task, tokenizer, rng, cfg.warmup_batch_size)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        targets, mask = ids[:, 1:], loss_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == cfg.warmup_steps:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, validation, task)
            if step % 250 == 0 or accuracy >= cfg.warmup_target_accuracy:
                log(f"[warm-up] step {step}: loss {loss.item():.3f}, validation accuracy {accuracy:.3f}")
            if accuracy >= cfg.warmup_target_accuracy:
                break
    model.eval()
    return {"steps": step, "validation_accuracy": accuracy}


def prepare_embedded_model(cfg: TaskConfig, seed: int, log=print) -> str:
    """Path of the warmed-up tiny model in HF format, building and caching it on first use."""
    path = os.path.join(cache_root(cfg), "embedded", warmup_key(cfg, seed))
    if os.path.isfile(os.path.join(path, "config.json")):
        log(f"[warm-up] using cached model {path}")
        return path
    log(f"[warm-up] building the tiny model; supervised steps until validation accuracy "
        f">= {cfg.warmup_target_accuracy} (at most {cfg.warmup_steps}); cached at {path}")
    task, tokenizer = warmup_task_and_tokenizer(cfg, seed)
    start = time.time()
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg, len(tokenizer), seed)
        torch.manual_seed(seed)
        summary = supervised_warmup(model, tokenizer, task, cfg, seed, log=log)
    summary["seconds"] = round(time.time() - start, 1)
    log(f"[warm-up] done in {summary['seconds']} s ({summary['steps']} steps)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(path))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "warmup.json"), "w") as fh:
        json.dump(summary, fh)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return path
