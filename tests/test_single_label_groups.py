"""optim.drop_single_label_groups (pacs/train/single_label_groups.py): which responses it leaves out, that it changes
nothing where a single-label group's gradient is 0 (the first mini-batch after a reset), that it removes
the pull those groups have while the reference is older, and the settings it refuses."""

import math
import os

import pytest
import torch
from trainer_helpers import tiny_config

from pacs.config import load_config, validate
from pacs.train import train
from pacs.train.metrics import read_metrics
from pacs.train.single_label_groups import loss_valid, plan_group_skips, skip_rules
from pacs_kernels import pacs_loss


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmup_cache"))


def test_loss_valid_marks_the_groups_with_one_label():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert loss_valid(rewards, 3, False) is None
    assert loss_valid(rewards, 3, True).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    with pytest.raises(ValueError, match="whole groups of 4 responses"):
        loss_valid(rewards, 4, True)


@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_at_the_reference_the_dropped_groups_carried_no_gradient(advantage):
    """logp = old_logp: dropping the single-label groups leaves the gradient as it was (their terms had
    none); against an older reference it changes it (by what single_label_grad_share measures)."""
    gen = torch.Generator().manual_seed(5)
    logp = -2.0 * torch.rand(12, 5, generator=gen, dtype=torch.float64)
    older = logp + 0.3 * torch.randn(12, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(12, 5, generator=gen) > 0.2
    mask[:, 0] = True
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0], dtype=torch.float64)
    valid = loss_valid(rewards, 3, True)
    for reference, same in ((logp, True), (older, False)):
        grads = []
        for keep in (None, valid):
            leaf = logp.clone().requires_grad_()
            loss = pacs_loss(leaf, reference, rewards, mask, group_size=3, advantage=advantage, valid=keep)
            grads.append(torch.autograd.grad(loss, leaf)[0])
        if same:
            torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-15)
        else:  # grpo's standardisation projects out the pull's first order (sigmoid's linear part): smaller
            assert (grads[0] - grads[1]).abs().max() > (1e-3 if advantage == "rloo" else 1e-6)
        # the mixed groups' gradients are the same either way: B still counts the dropped responses
        torch.testing.assert_close(grads[0][valid], grads[1][valid], rtol=0, atol=1e-15)


def _run(tmp_path, cache_dir, name, *extra):
    cfg = tiny_config(tmp_path / name, cache_dir, "max_steps=3", "rollout.engine=hf", "eval.every=0",
                      "checkpoint_every=0", "optim.mini_batches_per_step=1", *extra)
    train(cfg)
    return [r for r in read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl")) if "reward_mean" in r]


def test_with_a_reset_every_step_and_one_mini_batch_dropping_changes_no_update(tmp_path, cache_dir):
    """One mini-batch per rollout step, the reference reset every step: every update is a first mini-batch,
    where single-label groups add no gradient, so the runs update alike (the loss value differs: the
    dropped terms' ln 2 is gone). With the reference kept for 2 steps, step 2 (age 1) differs."""
    kept, dropped = _run(tmp_path, cache_dir, "keep"), _run(tmp_path, cache_dir, "drop",
                                                             "advanced.optim.drop_single_label_groups=true")
    assert any(r["frac_single_label_groups"] > 0 for r in kept)  # there was something to drop
    for a, b in zip(kept, dropped):
        assert a["reward_mean"] == b["reward_mean"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["single_label_grad_share"] == pytest.approx(0.0, abs=1e-12) or math.isnan(
            a["single_label_grad_share"])
    old_kept = _run(tmp_path, cache_dir, "keep2", "advanced.optim.ref_reset_every=2")
    old_dropped = _run(tmp_path, cache_dir, "drop2", "advanced.optim.ref_reset_every=2",
                                            "advanced.optim.drop_single_label_groups=true")
    assert old_kept[0]["grad_norm"] == pytest.approx(old_dropped[0]["grad_norm"], rel=1e-5)  # step 1: a reset
    assert old_kept[1]["single_label_grad_share"] > 0.01  # step 2: those groups pull toward the reference
    assert not math.isclose(old_kept[1]["grad_norm"], old_dropped[1]["grad_norm"], rel_tol=1e-3)


def test_drop_single_label_groups_is_a_pacs_option():
    with pytest.raises(ValueError, match="drop_single_label_groups is a PACS option"):
        validate(load_config(None, ["optim.algo=grpo", "advanced.optim.drop_single_label_groups=true"]))
    with pytest.raises(TypeError, match="drop_single_label_groups must be true or false"):
        load_config(None, ["advanced.optim.drop_single_label_groups=3"])


# ----------------------------------------------------------------------------- skipping their compute


def test_plan_moves_the_skippable_groups_behind_the_others_within_each_mini_batch():
    # groups (G = 2): [1,1] [0,1] [0,0] [1,0] | [1,1] [0,0] [0,0] [0,1]; two mini-batches of 4 groups
    rewards = torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 1])
    order, run = plan_group_skips(rewards, 2, 2, skip_first=True, skip_every=False)
    assert order.tolist() == [2, 3, 6, 7, 0, 1, 4, 5] + list(range(8, 16)) and run == [2, 4]
    order, run = plan_group_skips(rewards, 2, 2, skip_first=True, skip_every=True)
    assert order.tolist() == [2, 3, 6, 7, 0, 1, 4, 5, 14, 15, 8, 9, 10, 11, 12, 13] and run == [2, 1]
    order, run = plan_group_skips(rewards, 2, 2, skip_first=False, skip_every=False)
    assert order is None and run == [4, 4]
    assert plan_group_skips(torch.tensor([0.0, 1, 1, 0]), 2, 1, skip_first=True, skip_every=True) == (None, [2])
    # a mini-batch of single-label groups only still runs one (its gradient is 0: the parameters get zeros)
    order, run = plan_group_skips(torch.tensor([1.0, 1, 0, 0, 0, 1, 1, 1]), 2, 2, skip_first=True, skip_every=True)
    assert order is None and run == [1, 1]


@pytest.mark.parametrize("overrides,reference_is_current,expected", [
    ([], True, (True, False)),
    ([], False, (False, False)),  # psi != 0 against an older reference
    (["advanced.optim.advantage=grpo"], True, (True, False)),
    (["advanced.optim.advantage=naive"], True, (False, False)),  # psi = r has no baseline to cancel the slope
    (["advanced.optim.score=mean_logp"], True, (False, False)),  # its psi is not 0 at the reference
    (["advanced.optim.score_function_term=true"], True, (False, False)),  # w l / B per response: not 0
    (["advanced.optim.one_sweep_first_step=false"], True, (False, False)),  # recomputed: psi of rounding size, not 0
    (["advanced.optim.drop_single_label_groups=true"], False, (True, True)),
    (["advanced.optim.drop_single_label_groups=true", "advanced.optim.score_function_term=true"], True, (True, True)),
    (["optim.algo=grpo"], True, (False, False)),  # GRPO's token mean counts every group's tokens
    (["advanced.train.skip_zero_gradient_groups=false"], True, (False, False)),
    (["advanced.train.skip_zero_gradient_groups=false",
      "advanced.optim.drop_single_label_groups=true"], True, (False, False)),
])
def test_skip_rules(overrides, reference_is_current, expected):
    assert skip_rules(load_config(None, overrides), reference_is_current=reference_is_current) == expected


@pytest.mark.parametrize("extra", [[], ["advanced.optim.drop_single_label_groups=true"],
                                   ["advanced.optim.ref_reset_every=2", "advanced.optim.drop_single_label_groups=true",
                                    "optim.micro_batch_groups=2"],
                                   ["optim.mini_batches_per_step=1", "rollout.max_prompt_len=8",
                                    "train.max_tokens_per_micro_batch=12"]],
                         ids=["reset", "drop", "kept_reference_drop", "token_budget"])
def test_skipping_the_zero_gradient_groups_trains_like_running_them(tmp_path, cache_dir, extra):
    """Skipped groups give the updates, losses (a mean over groups) and evaluations of running every group, up
    to float rounding, also where a mini-batch holds only single-label groups (it runs one of them). (A
    mini-batch run with none would leave the parameters without gradients: AdamW would skip its step count,
    and its bias corrections would differ from then on. This test caught that in a first version.)"""
    runs = {}
    for skip in ("true", "false"):
        cfg = tiny_config(tmp_path / skip, cache_dir, "max_steps=4", "rollout.engine=hf", "eval.every=2",
                          "checkpoint_every=0", f"advanced.train.skip_zero_gradient_groups={skip}", *extra)
        train(cfg)
        runs[skip] = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    skipped, ran = runs["true"], runs["false"]
    assert [r.get("eval_accuracy") for r in skipped] == [r.get("eval_accuracy") for r in ran]
    for a, b in zip(skipped[1:], ran[1:]):
        assert a["reward_mean"] == b["reward_mean"] and a.get("ref_age") == b.get("ref_age")
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-9)
        assert "skipped_group_frac" not in b
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), "a skipped group counts at its loss value"
    fractions = [r["skipped_group_frac"] for r in skipped[1:]]
    assert max(fractions) > 0
    if extra == []:  # the first of two mini-batches only, and one of its two groups runs at least
        assert max(fractions) == 0.25
    if extra == ["advanced.optim.drop_single_label_groups=true"]:  # 3 of 4 groups: a mini-batch of single-label ones
        assert max(r["frac_single_label_groups"] for r in skipped[1:]) >= 0.75
    if "train.max_tokens_per_micro_batch=12" in extra:  # groups over the budget ran in parts
        assert max(r["split_groups"] for r in skipped[1:]) > 0
