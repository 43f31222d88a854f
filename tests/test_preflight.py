"""The preflight (pacs/preflight.py): it runs the worst case the settings allow through the trainer's
own update, changes nothing about the run, sizes the worst micro-batch like the planner, and turns
running out of memory into a stop that names the settings still off."""

import os

import pytest
import torch
from trainer_helpers import comparable, tiny_config

from pacs.config import Config, load_config
from pacs.preflight import adamw_state_gib, levers_off, preflight_enabled, worst_case_groups


def cfg_with(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def test_enabled_on_cuda_by_default_and_when_asked():
    assert preflight_enabled(Config(), torch.device("cuda"))
    assert not preflight_enabled(Config(), torch.device("cpu"))
    assert preflight_enabled(cfg_with("train.preflight=true"), torch.device("cpu"))
    assert not preflight_enabled(cfg_with("train.preflight=false"), torch.device("cuda"))


def test_the_worst_micro_batch_holds_what_the_planner_would_put_in_it():
    base = ["rollout.prompts_per_step=32", "rollout.group_size=8", "rollout.max_prompt_len=100",
            "rollout.max_new_tokens=900", "optim.mini_batches_per_step=2"]  # 8 x 1,000 tokens a group
    assert worst_case_groups(cfg_with(*base, "optim.micro_batch_groups=3"), 1) == 3
    assert worst_case_groups(cfg_with(*base, "optim.micro_batch_groups=64"), 2) == 8  # a mini-batch's share
    assert worst_case_groups(cfg_with(*base, "train.max_tokens_per_micro_batch=25000"), 1) == 3  # 3 groups fit
    assert worst_case_groups(cfg_with(*base, "train.max_tokens_per_micro_batch=3000"), 1) == 1  # one, in parts


def test_levers_off_lists_what_is_still_at_its_roomiest():
    assert levers_off(Config())[:3] == ["model.gradient_checkpointing=true", "train.tiled_mlp=true",
                                        "train.offload_activations=true"]
    all_on = cfg_with("model.gradient_checkpointing=true", "train.tiled_mlp=true", "train.offload_activations=true",
                      "train.max_tokens_per_micro_batch=4096", "train.loss_chunk_mib=64")
    assert levers_off(all_on) == []


def test_adamw_state_is_two_buffers_as_large_as_the_parameters():
    params = [torch.nn.Parameter(torch.zeros(1024, 256)), torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16))]
    expected = 2 * (1024 * 256 * 4 + 256 * 2) / 2**30
    assert adamw_state_gib(torch.optim.AdamW(params)) == pytest.approx(expected)


@pytest.mark.slow
def test_a_run_with_the_preflight_trains_exactly_as_one_without(tmp_path, monkeypatch, capsys):
    """Same metrics and weights; the preflight's update saw full-length rows only (every prompt
    max_prompt_len tokens, every response max_new_tokens), as many groups as one micro-batch holds in
    each of two mini-batches (the run has two), in parts when the token budget is below a group."""
    import pacs.trainer as trainer
    from pacs.metrics import read_metrics

    seen = []
    real_update = trainer.update_policy

    def recording_update(cfg, policy, optimizer, scheduler, batch, *args, **kwargs):
        if step_of(args) == 0:
            seen.append((batch.attention_mask.sum(1).tolist(), type(optimizer).__name__))
        return real_update(cfg, policy, optimizer, scheduler, batch, *args, **kwargs)

    def step_of(args):
        return args[4]  # (old_logp, old_lse, state, dist_info, step)

    monkeypatch.setattr(trainer, "update_policy", recording_update)
    cache = tmp_path / "cache"
    common = ["max_steps=2", "rollout.engine=hf", "eval.every=0", "checkpoint_every=0", "train.packing=true",
              "rollout.max_prompt_len=12", "train.max_tokens_per_micro_batch=40"]  # a group (4 x 15) in parts
    runs = {flag: trainer.train(tiny_config(tmp_path / flag, cache, *common, f"train.preflight={flag}"))
            for flag in ("false", "true")}
    assert "[preflight] the longest step these settings allow (1 group(s) x 4 responses of 12 + 3 tokens" in (
        capsys.readouterr().out)
    assert seen == [([15] * 8, "_NoOptimizerStep")]  # once, full length, 2 mini-batches of a group, no step
    rows = {k: comparable(read_metrics(os.path.join(r.output_dir, "metrics.jsonl"))) for k, r in runs.items()}
    assert rows["true"] == rows["false"]
    for (name, a), (_, b) in zip(runs["false"].policy.named_parameters(), runs["true"].policy.named_parameters()):
        assert torch.equal(a, b), name


def test_running_out_of_memory_stops_with_the_settings_still_off(tmp_path, monkeypatch):
    import pacs.trainer as trainer

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB.")

    monkeypatch.setattr(trainer, "update_policy", out_of_memory)
    cfg = tiny_config(tmp_path / "run", tmp_path / "cache", "max_steps=1", "rollout.engine=hf", "eval.every=0",
                      "train.preflight=true", "model.gradient_checkpointing=true")
    with pytest.raises(trainer.TrainingStopped) as stopped:
        trainer.train(cfg)
    message = str(stopped.value)
    assert "preflight: the longest step these settings allow (1 group(s) x 4 responses of 32 + 3 tokens" in message
    assert "ran out of cpu memory: CUDA out of memory. Tried to allocate 9.50 GiB." in message
    assert "train.tiled_mlp=true" in message and "model.gradient_checkpointing" not in message
    assert "train.preflight=false skips this check" in message
