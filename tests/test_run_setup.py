"""The run set-up shared by `pacs train` and `pacs eval`: one prompt-cutting rule for training
rollouts and both evaluators, one dtype resolution, one vLLM probe."""

from __future__ import annotations

import pytest
import torch

from pacs.config import load_config
from pacs.eval.evaluate import encode_prompts, evaluate
from pacs.model.policy import DistInfo, resolve_dtype
from pacs.run.run_setup import Run
from pacs.tasks import AdditionTask
from pacs.tasks.embedded import build_tokenizer
from pacs.train.evaluation import evaluate_policy


class RecordingEngine:
    """Answers every prompt with its own last token; records what it was asked."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, n, **kwargs):
        self.prompts.append([list(p) for p in prompts])
        return [[[p[-1]] for _ in range(n)] for p in prompts]


def test_encode_prompts_keeps_the_last_tokens_and_counts_the_cut():
    tokenizer = build_tokenizer()
    task = AdditionTask(3, seed=5, eval_size=16)
    problems = task.eval_problems(16)
    whole, none_cut = encode_prompts(tokenizer, problems)
    assert none_cut == 0 and min(len(p) for p in whole) > 6
    cut, count = encode_prompts(tokenizer, problems, max_prompt_len=6)
    assert count == sum(len(p) > 6 for p in whole) > 0
    assert cut == [p[-6:] for p in whole]


def test_trainer_and_pacs_eval_cut_prompts_alike():
    cfg = load_config(None, ["advanced.task.digits=3", "rollout.max_prompt_len=5", "eval.num_problems=12"])
    tokenizer = build_tokenizer()
    task = AdditionTask(3, seed=cfg.seed, eval_size=cfg.task.eval_size)
    run = Run(cfg, "unused", task, tokenizer, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    in_training, in_cli = RecordingEngine(), RecordingEngine()
    trained = evaluate_policy(cfg, in_training, run, DistInfo(), step=0)
    problems = task.eval_problems(cfg.eval.num_problems)
    standalone = evaluate(in_cli, task, tokenizer, problems, max_new_tokens=cfg.rollout.max_new_tokens,
                          stop_token_ids=run.stop_ids, max_prompt_len=cfg.rollout.max_prompt_len)
    assert in_training.prompts == in_cli.prompts
    assert all(len(p) == 5 for p in in_training.prompts[0])
    assert trained["eval_accuracy"] == standalone["accuracy"]


@pytest.mark.parametrize("name, device, expected", [
    ("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16), ("float16", "cpu", torch.float16),
    (torch.bfloat16, "cpu", torch.bfloat16),
])
def test_one_place_resolves_dtype(name, device, expected):
    assert resolve_dtype(name, device) == expected


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="model.dtype must be 'auto', 'float32', 'bfloat16', 'float16'; got 'fp8'"):
        resolve_dtype("fp8", "cpu")
