"""The preflight (pacs/train/preflight.py): it runs the worst case the settings allow through the trainer's
own update, changes nothing about the run, sizes the worst micro-batch like the planner, and turns
running out of memory into a stop that names the settings still off."""

import os

import pytest
import torch
from trainer_helpers import comparable, tiny_config

from pacs.config import Config, load_config
from pacs.run import TrainingStopped
from pacs.train import train
from pacs.train.preflight import WorstCase, adamw_state_gib, levers_off, preflight_enabled, worst_cases


def cfg_with(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def test_enabled_on_cuda_by_default_and_when_asked():
    assert preflight_enabled(Config(), torch.device("cuda"))
    assert not preflight_enabled(Config(), torch.device("cpu"))
    assert preflight_enabled(cfg_with("advanced.train.preflight=true"), torch.device("cpu"))
    assert not preflight_enabled(cfg_with("advanced.train.preflight=false"), torch.device("cuda"))


def test_the_worst_micro_batches_are_the_longest_rows_and_the_budget_filled():
    """The planner packs whole groups up to the budget: full-length groups, and as many groups of
    slightly shorter rows as fill it (more tokens), at most what the pass's share holds."""
    from pacs.model.packing import plan_micro_batches

    cfg = cfg_with("rollout.group_size=8", "rollout.max_prompt_len=100", "rollout.max_new_tokens=900",
                   "optim.micro_batch_groups=3")  # 8 x 1,000 tokens a full group
    assert worst_cases(cfg, None, 64) == [WorstCase("full length", 3, 1000)]
    assert worst_cases(cfg, None, 2) == [WorstCase("full length", 2, 1000)]
    cases = worst_cases(cfg, 15999, 64)  # 1 full group fits; 2 groups of 999-token rows do too
    assert cases == [WorstCase("full length", 1, 1000), WorstCase("the budget filled", 2, 999)]
    lengths = [999] * 16 + [1000] * 8
    assert plan_micro_batches(lengths, 8, 15999, split_groups=True)[0] == (0, 16)  # the planner agrees
    assert cases[1].tokens(8) <= 15999 < cases[1].tokens(8) + 16
    assert worst_cases(cfg, 16000, 64) == [WorstCase("full length", 2, 1000)]  # exactly full: one case
    assert worst_cases(cfg, 25000, 2) == [WorstCase("full length", 2, 1000)]  # the share caps it
    assert worst_cases(cfg, 1999, 64) == [WorstCase("full length", 1, 1000), WorstCase("the budget filled", 1, 249)]


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
    import pacs.train.update as update
    from pacs.train.metrics import read_metrics

    seen = []
    real_update = update.update_policy

    def recording_update(cfg, policy, optimizer, scheduler, data, *args, **kwargs):
        if step_of(args) == 0:
            seen.append((data.batch.attention_mask.sum(1).tolist(), type(optimizer).__name__))
        return real_update(cfg, policy, optimizer, scheduler, data, *args, **kwargs)

    def step_of(args):
        return args[2]  # (state, dist_info, step)

    monkeypatch.setattr(update, "update_policy", recording_update)
    cache = tmp_path / "cache"
    common = ["max_steps=2", "rollout.engine=hf", "eval.every=0", "checkpoint_every=0", "train.packing=true",
              "rollout.max_prompt_len=12", "train.max_tokens_per_micro_batch=40"]  # a group (4 x 15) in parts
    runs = {flag: train(tiny_config(tmp_path / flag, cache, *common, f"advanced.train.preflight={flag}"))
            for flag in ("false", "true")}
    out = capsys.readouterr().out
    assert "[preflight] the largest steps these settings allow ran (full length: 1 group(s) of 4 x 15 tokens; " \
           "the budget filled: 1 group(s) of 4 x 10 tokens" in out
    # full length, then the budget filled (40 tokens: 4 rows of 10), each in 2 mini-batches of a group; no step
    assert seen == [([15] * 8, "_NoOptimizerStep"), ([10] * 8, "_NoOptimizerStep")]
    rows = {k: comparable(read_metrics(os.path.join(r.output_dir, "metrics.jsonl"))) for k, r in runs.items()}
    assert rows["true"] == rows["false"]
    for (name, a), (_, b) in zip(runs["false"].policy.named_parameters(), runs["true"].policy.named_parameters()):
        assert torch.equal(a, b), name


def test_running_out_of_memory_stops_with_the_settings_still_off(tmp_path, monkeypatch):
    import pacs.train.update as update

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB.")

    monkeypatch.setattr(update, "update_policy", out_of_memory)
    cfg = tiny_config(tmp_path / "run", tmp_path / "cache", "max_steps=1", "rollout.engine=hf", "eval.every=0",
                      "advanced.train.preflight=true", "model.gradient_checkpointing=true")
    with pytest.raises(TrainingStopped) as stopped:
        train(cfg)
    message = str(stopped.value)
    assert ("preflight: the largest step these settings allow (groups of 4 responses, prompts of 32 and responses "
            "of 3 tokens)") in message
    assert "ran out of cpu memory: CUDA out of memory. Tried to allocate 9.50 GiB." in message
    assert "train.tiled_mlp=true" in message and "model.gradient_checkpointing" not in message
    assert "advanced.train.preflight=false skips this check" in message


def test_every_random_stream_is_as_it_was_after_the_preflight(tmp_path, monkeypatch):
    """Dropout in the preflight's forwards (here: draws inside its update) must not move torch's or
    Python's random streams, or a run with dropout would train differently with the preflight on."""
    import random

    import pacs.train.update as update
    from pacs.model.policy import DistInfo, load_policy
    from pacs.train.preflight import run_preflight

    real_update = update.update_policy

    def drawing_update(*args, **kwargs):
        torch.rand(3)
        random.random()
        return real_update(*args, **kwargs)

    monkeypatch.setattr(update, "update_policy", drawing_update)
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    policy = load_policy(str(model_dir), packed_attention=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    cfg = cfg_with("rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_prompt_len=5",
                   "rollout.max_new_tokens=4", "optim.mini_batches_per_step=1", "advanced.optim.logprob_backend=torch")
    torch.manual_seed(11)
    random.seed(11)
    expected = (torch.rand(2), random.random())
    torch.manual_seed(11)
    random.seed(11)
    before = [p.detach().clone() for p in policy.parameters()]
    run_preflight(cfg, policy, optimizer, 0, DistInfo(), packed=True, say=lambda *a: None,
                  steps=update.preflight_steps())
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters()))
    assert all(p.grad is None for p in policy.parameters()) and not optimizer.state


def test_the_old_policy_pass_gets_its_own_largest_chunk(monkeypatch):
    """train.old_policy_max_tokens above the training budget: the no-grad pass runs a chunk of its own
    budget, larger than any update micro-batch."""
    import pacs.train.update as update
    from pacs.model.policy import DistInfo
    from pacs.train.preflight import run_preflight

    calls = []
    monkeypatch.setattr(update, "old_policy_logprobs", lambda policy, batch, ranges, *a, **k: (
        calls.append(batch.attention_mask.sum().item()) or (torch.zeros(batch.targets.shape),) * 2 + (0.0,)))
    monkeypatch.setattr(update, "update_policy", lambda *a, **k: None)

    class Policy:
        causal_lm = tiny_model()

    cfg = cfg_with("rollout.group_size=2", "rollout.prompts_per_step=8", "rollout.max_prompt_len=5",
                   "rollout.max_new_tokens=5", "optim.mini_batches_per_step=1", "train.max_tokens_per_micro_batch=20",
                   "advanced.train.old_policy_max_tokens=80")
    run_preflight(cfg, Policy(), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), 0, DistInfo(),
                  packed=True, say=lambda *a: None, steps=update.preflight_steps())
    assert calls[0] == 80 and max(calls[1:]) == 20  # its own 4 groups of 2 x 10, then the update's


def tiny_model():
    import transformers

    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64))


@pytest.mark.parametrize("minis,every,firsts", [(1, 1, [False]), (1, 3, [False, True]), (2, 3, [False])])
def test_a_reference_kept_across_steps_preflights_the_usual_first_mini_batch(monkeypatch, minis, every, firsts):
    """optim.ref_reset_every > 1: steps between resets take the usual path (not one sweep) on their first
    mini-batch, reset steps the one sweep; with a single mini-batch per step the preflight runs both (a
    second mini-batch always runs the usual path)."""
    import pacs.train.update as update
    from pacs.model.policy import DistInfo
    from pacs.train.preflight import run_preflight

    seen = []
    monkeypatch.setattr(update, "old_policy_logprobs", lambda policy, batch, ranges, *a, **k: (
        (torch.zeros(batch.targets.shape),) * 2 + (0.0,)))
    monkeypatch.setattr(update, "update_policy",
                        lambda cfg, policy, optimizer, scheduler, data, *a, **k: seen.append(
                            data.rollout_logp is not None))

    class Policy:
        causal_lm = tiny_model()

    cfg = cfg_with("rollout.group_size=2", "rollout.prompts_per_step=4", "rollout.max_prompt_len=5",
                   "rollout.max_new_tokens=5", f"optim.mini_batches_per_step={minis}",
                   f"advanced.optim.ref_reset_every={every}")
    run_preflight(cfg, Policy(), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), 0, DistInfo(),
                  packed=True, say=lambda *a: None, steps=update.preflight_steps())
    assert seen and len(seen) % len(firsts) == 0 and seen == firsts * (len(seen) // len(firsts))
