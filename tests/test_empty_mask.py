"""A response whose mask is all False (TRL's ``mask_truncated_completions`` masks a truncated completion out)
is a zero-loss response in every aggregation, as TRL and Liger count it: it adds nothing, still counts in the 1/B
of the per-response means, and no gradient reaches its tokens. Every GRPO-family objective, each path and
layout of the fused loss, against the float64 references and TRL's own sequence-mean formula."""

import pytest
import torch

from pacs_kernels import GRPO, LossOptions, fused_linear_grpo_loss, fused_linear_objective_loss, grpo_loss
from pacs_kernels.objectives import CISPO, DAPO, GSPO, DrGRPO
from pacs_kernels.objectives.cispo import reference_cispo_loss
from pacs_kernels.objectives.dapo import reference_dapo_loss
from pacs_kernels.objectives.dr_grpo import reference_dr_grpo_loss
from pacs_kernels.objectives.grpo import reference_grpo_objective
from pacs_kernels.objectives.gspo import reference_gspo_loss
from pacs_kernels.reference import naive_linear_logprobs

B, T, D, V, G = 6, 7, 8, 23, 3
OBJECTIVES = {
    "grpo_seq_mean": (GRPO(aggregation="seq_mean"), reference_grpo_objective),
    "grpo_token_mean": (GRPO(), reference_grpo_objective),
    "dapo": (DAPO(), reference_dapo_loss),
    "dr_grpo": (DrGRPO(max_completion_length=T), reference_dr_grpo_loss),
    "gspo": (GSPO(eps_low=0.05, eps_high=0.05), reference_gspo_loss),
    "cispo": (CISPO(), reference_cispo_loss),
}


def batch_with_an_empty_response(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    weight = 0.3 * torch.randn(V, D, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    mask[1] = False  # response 1: truncated, masked out
    with torch.no_grad():
        old = naive_linear_logprobs(hidden, weight, targets)[0] + 0.05 * torch.randn(B, T, generator=gen,
                                                                                     dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    return hidden, weight, targets, mask, old, rewards


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("path", ["single_pass", "two_pass"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_an_empty_mask_response_is_a_zero_loss_response(name, path, packed):
    objective, reference = OBJECTIVES[name]
    hidden, weight, targets, mask, old, rewards = batch_with_an_empty_response()
    leaf = hidden.clone().requires_grad_()
    inputs = dict(old_logp=old)
    h, y, m = leaf, targets, mask
    if packed:
        h, y, m = leaf.reshape(B * T, D), targets.reshape(-1), mask.reshape(-1)
        inputs = dict(old_logp=old.reshape(-1), cu_seqlens=torch.arange(0, B * T + 1, T))
    loss, _ = fused_linear_objective_loss(h, weight, y, m, rewards=rewards, objective=objective, group_size=G,
                                          options=LossOptions(path=path, backend="torch"), **inputs)
    loss.backward()
    logp, _ = naive_linear_logprobs(hidden, weight, targets)
    expected = reference(objective, logp, old, rewards, mask, group_size=G)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    on_rows, _ = objective(logp, old, rewards, mask, group_size=G)  # the objective on padded rows agrees
    torch.testing.assert_close(on_rows, expected, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(leaf.grad).all() and not leaf.grad[1].any()  # nothing reaches the empty response


def test_seq_mean_is_trls_formula():
    """TRL's GRPOTrainer (loss_type="grpo"): ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()."""
    hidden, weight, targets, mask, old, rewards = batch_with_an_empty_response(seed=1)
    logp, _ = naive_linear_logprobs(hidden, weight, targets)
    adv = rewards.reshape(-1, G)
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-6)).reshape(-1, 1)
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    trl = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    torch.testing.assert_close(grpo_loss(logp, old, rewards, mask, group_size=G, aggregation="seq_mean"), trl)
    fused = fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=G,
                                   objective=GRPO(aggregation="seq_mean"), options=LossOptions(backend="torch"))
    torch.testing.assert_close(fused, trl, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("score", ["log_ratio", "mean_logp"])
@pytest.mark.parametrize("path", ["single_pass", "two_pass"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_pacs_counts_an_empty_mask_response_with_score_0(score, path, packed):
    """PACS: a response with no tokens scores 0 under either score (the log-ratio's sum over none; mean_logp over
    none taken as 0, TRL's clamp(min=1)); it keeps its BCE term and its place in its group's baseline, and no
    gradient reaches its row. Every path and layout against the float64 reference."""
    from pacs_kernels import PACS
    from pacs_kernels.reference import reference_pacs_loss

    hidden, weight, targets, mask, old, rewards = batch_with_an_empty_response(seed=2)
    leaf = hidden.clone().requires_grad_()
    inputs, h, y, m = dict(old_logp=old), leaf, targets, mask
    if packed:
        h, y, m = leaf.reshape(B * T, D), targets.reshape(-1), mask.reshape(-1)
        inputs = dict(old_logp=old.reshape(-1), cu_seqlens=torch.arange(0, B * T + 1, T))
    loss, _ = fused_linear_objective_loss(h, weight, y, m, rewards=rewards, objective=PACS(score=score),
                                          group_size=G, options=LossOptions(path=path, backend="torch"), **inputs)
    loss.backward()
    logp, _ = naive_linear_logprobs(hidden, weight, targets)
    expected, parts = reference_pacs_loss(logp, old, rewards, mask, group_size=G, score=score)
    assert float(parts["score"][1]) == 0.0
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(leaf.grad).all() and not leaf.grad[1].any()
