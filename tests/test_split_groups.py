"""Groups larger than the micro-batch token budget run in parts (pacs/train/update.py, known_gradients) and train
exactly like the whole group: same gradients, same weights, for PACS and GRPO, padded and packed,
on the first mini-batch after a rollout (log-probs from the old-policy pass) and on later ones
(a no-grad pass over the parts first)."""

import pytest
import torch
from test_packing import GROUP, config, loss_and_grads, random_batch, tiny_policy

from pacs.model.packing import is_part_of_a_group, plan_micro_batches, split_to_count
from pacs.model.policy import DistInfo
from pacs.train.old_policy import old_policy_logprobs
from pacs.train.update import update_policy
from pacs.train.update_batch import update_batch


def test_plan_splits_only_groups_larger_than_the_budget():
    lengths = [5, 6, 7, 30, 40, 50, 2, 2, 2]  # 3 groups of 3: 18, 120, 6 tokens (packed)
    plan = plan_micro_batches(lengths, GROUP, 60, split_groups=True)
    assert plan == [(0, 3), (3, 4), (4, 5), (5, 6), (6, 9)]
    assert [is_part_of_a_group(lo, hi, GROUP) for lo, hi in plan] == [False, True, True, True, False]
    # a part never shares its micro-batch with another group
    assert plan_micro_batches(lengths, GROUP, 90, split_groups=True) == [(0, 3), (3, 5), (5, 6), (6, 9)]
    with pytest.raises(ValueError, match=r"smaller than group 1 .*does not split groups"):
        plan_micro_batches(lengths, GROUP, 60)
    with pytest.raises(ValueError, match=r"=45 is smaller than sequence 5 .* 50 tokens"):
        plan_micro_batches(lengths, GROUP, 45, split_groups=True)


def test_split_to_count_cuts_groups_into_parts_when_it_must():
    lengths = [9, 4, 7, 30, 2, 2, 5, 5, 5, 8, 8, 1]  # 4 groups of 3
    plan = plan_micro_batches(lengths, GROUP, 60)
    for count in range(len(plan), 13):
        split = split_to_count(plan, count, GROUP)
        assert len(split) == count and split[0][0] == 0 and split[-1][1] == len(lengths)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(split, split[1:]))
        assert all(sum(lengths[lo:hi]) <= 60 for lo, hi in split)
        # whole groups, or parts of exactly one group
        assert all(not is_part_of_a_group(lo, hi, GROUP) or lo // GROUP == (hi - 1) // GROUP for lo, hi in split)
        if count <= 4:
            assert not any(is_part_of_a_group(lo, hi, GROUP) for lo, hi in split)
    with pytest.raises(ValueError, match="12 rows into 13"):
        split_to_count(plan, 13, GROUP)


def one_update(cfg, batch, packed: bool, reference_seed: int | None = None):
    """One rollout step's update of a fresh policy; with ``reference_seed``, PACS's reference is another
    policy (a reference kept across rollout steps: optim.ref_reset_every > 1)."""
    policy = tiny_policy(5)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)  # plain SGD: the step is the gradient
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    n = batch.input_ids.shape[0]
    old_logp, old_lse, _ = old_policy_logprobs(policy, batch, [(0, n)], cfg.rollout.temperature, "torch",
                                               packed=packed)
    rollout_logp = None
    if reference_seed is not None:
        rollout_logp = old_logp
        old_logp, _, _ = old_policy_logprobs(tiny_policy(reference_seed), batch, [(0, n)], cfg.rollout.temperature,
                                             "torch", packed=packed)
    state = {"consecutive_nan": 0, "skipped_updates": 0}
    data = update_batch(cfg, batch, old_logp, old_lse, rollout_logp, packed=packed)
    update = update_policy(cfg, policy, optimizer, scheduler, data, state, DistInfo(device=torch.device("cpu")), step=1)
    return policy, update


@pytest.mark.parametrize("packed", [False, True])
def test_a_split_group_scored_against_an_older_reference_trains_like_the_whole_group(packed):
    """optim.ref_reset_every > 1 between resets: the first mini-batch's split groups take the rollout-time
    log-probs as the current ones (not the reference's), and train as the whole groups do."""
    batch = random_batch(32, n_groups=4)
    budget = batch.input_ids.shape[1] if not packed else max(batch.attention_mask.sum(1).tolist())
    common = ["rollout.prompts_per_step=4", "optim.mini_batches_per_step=2", "optim.micro_batch_groups=2",
              f"train.packing={str(packed).lower()}", "advanced.optim.ref_reset_every=2"]
    whole_policy, whole = one_update(config(*common), batch, packed, reference_seed=6)
    split_policy, split = one_update(config(*common, f"train.max_tokens_per_micro_batch={budget}"), batch, packed,
                                     reference_seed=6)
    assert len(split.losses) > len(whole.losses) and whole.stats["psi_std"] > 0.1  # parts; psi far from 0
    # (float32 log-probs on the split path, float64 on the whole one: 1e-6 apart here; reading the reference's
    # log-probs as the current ones puts the first grad norm 3% off)
    assert split.grad_norms[0] == pytest.approx(whole.grad_norms[0], rel=1e-5)
    assert split.grad_norms[1] == pytest.approx(whole.grad_norms[1], rel=1e-5)
    for (name, a), (_, b) in zip(whole_policy.named_parameters(), split_policy.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


# every built-in objective and a user's (tests/objective_plugin.py), as optim.algo names them
EVERY_OBJECTIVE = ["pacs", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "objective_plugin:LeaveOneOutPG"]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("algo", EVERY_OBJECTIVE)
def test_a_split_group_trains_like_the_whole_group(algo, packed):
    batch = random_batch(31, n_groups=4)
    lengths = batch.attention_mask.sum(1).tolist()
    width = batch.input_ids.shape[1]
    # a budget of the longest row: every group (3 rows) is cut into parts; two mini-batches, so the
    # second runs after an optimizer step (its parts need the no-grad pass first)
    budget = width if not packed else max(lengths)
    # neither PACS's mini-batch loss nor GRPO's token mean depends on how it is cut into micro-batches
    common = [f"optim.algo={algo}", "rollout.prompts_per_step=4", "optim.mini_batches_per_step=2",
              "optim.micro_batch_groups=2", f"train.packing={str(packed).lower()}",
              "rollout.temperature=0.9", "rollout.max_new_tokens=9"]  # (Dr.GRPO's L: the longest response)
    whole_policy, whole = one_update(config(*common), batch, packed)
    split_policy, split = one_update(config(*common, f"train.max_tokens_per_micro_batch={budget}"), batch, packed)
    assert len(split.losses) > len(whole.losses)  # it did run groups in parts
    assert len(whole.grad_norms) == len(split.grad_norms) == 2 and whole.grad_norms[1] > 0
    # the log-probs the split path reads (the old-policy pass's, then a no-grad pass's) are float32
    # (linear_logprobs' contract) where the whole path computes them in the policy's float64
    assert split.grad_norms[0] == pytest.approx(whole.grad_norms[0], rel=1e-6)
    assert split.grad_norms[1] == pytest.approx(whole.grad_norms[1], rel=1e-5)
    for (name, a), (_, b) in zip(whole_policy.named_parameters(), split_policy.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("algo", EVERY_OBJECTIVE[1:])
def test_grpo_token_mean_is_one_mean_over_the_mini_batch_however_it_is_cut(algo, packed):
    """GRPO's token mean (TRL's, DAPO's): the mini-batch's token terms summed over its token count, whatever its
    micro-batches, token budget or groups in parts: the update is that one loss's gradient. So for every objective
    of the GRPO family and a user's: a token mean (GRPO's, DAPO's, CISPO's, the plugin's, which declares it) or a
    mean over responses (GSPO's, Dr.GRPO's), each the mini-batch's one loss (pacs/train/loss_objective.token_mean)."""
    batch = random_batch(33, n_groups=4)
    n, width = batch.input_ids.shape
    common = [f"optim.algo={algo}", "rollout.prompts_per_step=4", "optim.mini_batches_per_step=1",
              f"train.packing={str(packed).lower()}", "advanced.optim.max_grad_norm=1e9", "rollout.temperature=0.9",
              "rollout.max_new_tokens=9"]
    policy = tiny_policy(5)
    old_logp, _, _ = old_policy_logprobs(policy, batch, [(0, n)], 0.9, "torch", packed=packed)
    _, grads, _ = loss_and_grads(policy, batch, old_logp, packed, config(*common))  # one micro-batch: the reference
    initial = {name: p.detach().clone() for name, p in policy.named_parameters()}
    budget = width if not packed else max(batch.attention_mask.sum(1).tolist())
    for cut in (["optim.micro_batch_groups=1"], ["optim.micro_batch_groups=3"],
                ["optim.micro_batch_groups=2", f"train.max_tokens_per_micro_batch={budget}"]):
        trained, update = one_update(config(*common, *cut), batch, packed)
        assert len(update.losses) > 1
        for name, p in trained.named_parameters():  # SGD at lr 0.5: the step is half the gradient
            torch.testing.assert_close((initial[name] - p.detach()) / 0.5, grads[name], rtol=1e-5, atol=1e-6,
                                       msg=f"{cut}: {name}")


@pytest.mark.slow
def test_two_fsdp_ranks_with_split_groups(tmp_path):
    """2 FSDP ranks with a token budget below every group (and the preflight, whose worst case runs
    in parts too): the same weights as one process (one mini-batch per step); with two mini-batches
    the parts' no-grad passes line up across ranks (a rank with fewer parts repeats a small forward)
    and the ranks stay in sync."""
    import json

    from test_trainer_fsdp import close, run_worker

    # every group runs (none skipped for a zero gradient: tests/test_single_label_groups.py), each in parts
    split = ("train.packing=true", "train.max_tokens_per_micro_batch=24", "rollout.max_prompt_len=16",
             "advanced.train.skip_zero_gradient_groups=false")
    run_worker(tmp_path / "one", tmp_path / "cache", 1, *split)
    run_worker(tmp_path / "two", tmp_path / "cache", 2, *split, "advanced.train.preflight=true")  # changes nothing
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    ranks = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    assert one["metrics"]["split_groups"] == 4 and ranks[0]["metrics"]["split_groups"] == 2  # every group, per rank
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["pushes"][0] != ranks[0]["pushes"][1], "training must change the weights"
    assert close(ranks[0]["final"], one["final"])
    run_worker(tmp_path / "two_minis", tmp_path / "cache", 2, *split, "optim.mini_batches_per_step=2")
    ranks = [json.loads((tmp_path / "two_minis" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["metrics"]["split_groups"] == 2
    assert ranks[0]["final"] == ranks[1]["final"]


def test_the_loss_chunk_setting_reaches_the_fused_loss(caplog):
    """train.loss_chunk_mib is the fused loss's chunk budget: below one group, the single pass rebuilds part of
    each group's logits or (at these toy shapes, auto's cost model) the eager two passes take chunks within it
    (said in the kernels' debug log); same loss and gradients."""
    import logging

    from test_packing import loss_and_grads

    from pacs.config import validate
    from pacs.train.old_policy import old_policy_logprobs as old_pass

    policy = tiny_policy(9)
    batch = random_batch(12)
    n = batch.input_ids.shape[0]
    old_logp, _, _ = old_pass(policy, batch, [(0, n)], 1.0, "torch")
    results = {}
    for chunk in (None, 0.001):  # 0.001 MiB: a few tokens' float64 logits at V = 48
        cfg = config(*([] if chunk is None else [f"train.loss_chunk_mib={chunk}"]))
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="pacs_kernels"):
            results[chunk] = loss_and_grads(policy, batch, old_logp, False, cfg)
        bounded = any("built twice" in record.getMessage() or "(the budget)" in record.getMessage()
                      for record in caplog.records)
        assert bounded == (chunk is not None)
    torch.testing.assert_close(results[0.001][0], results[None][0], rtol=1e-10, atol=1e-12)
    for name, grad in results[None][1].items():
        torch.testing.assert_close(results[0.001][1][name], grad, rtol=1e-9, atol=1e-12, msg=name)
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="train.loss_chunk_mib"):
            validate(config(f"train.loss_chunk_mib={bad}"))
