"""A new objective is one file: a callable satisfying the Objective protocol (docs/objectives.md), optionally
declaring its Capabilities. The engine runs it on every path, the one sweep included, with no change anywhere
else; here one is written in this file and trained a few steps."""

from dataclasses import dataclass

import pytest
import torch

from pacs_kernels import Capabilities, LossOptions, fused_linear_objective_loss, linear_logprobs


@dataclass(frozen=True)
class GroupBaselineReinforce:
    """-(1/B) sum_i (R_i - mean_group R) * mean_t logp[i, t]: a loss of the log-probs alone."""

    capabilities = Capabilities(chunking="batch", uses_entropy=False, one_sweep=True)

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
        grouped = rewards.to(logp.dtype).reshape(-1, group_size)
        advantage = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
        mean_logp = torch.where(mask, logp, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
        loss = -(advantage * mean_logp).mean()
        return loss, {"loss": float(loss.detach())}


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(8, 6, 16, generator=gen, dtype=torch.float64)
    weight = 0.3 * torch.randn(40, 16, generator=gen, dtype=torch.float64)
    targets, mask = torch.randint(0, 40, (8, 6), generator=gen), torch.rand(8, 6, generator=gen) > 0.2
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.0, 1.0], dtype=torch.float64)
    return hidden, weight, targets, mask, rewards


@pytest.mark.parametrize("path", ["single_pass", "two_pass", "one_sweep"])
def test_a_new_objective_runs_on_every_path_with_the_same_gradient(path):
    hidden, weight, targets, mask, rewards = batch()
    with torch.no_grad():
        old, lse = linear_logprobs(hidden, weight, targets, return_lse=True)
    grads = {}
    for run in ("two_pass", path):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        extra = dict(old_lse=lse) if run == "one_sweep" else {}
        options = LossOptions(backend="torch", path="auto" if run == "one_sweep" else run)
        loss, _ = fused_linear_objective_loss(h, w, targets, mask, old, rewards, objective=GroupBaselineReinforce(),
                                              group_size=4, options=options, **extra)
        loss.backward()
        grads[run] = (loss.detach(), h.grad, w.grad)
    for reference, value in zip(grads["two_pass"], grads[path]):
        torch.testing.assert_close(value, reference, rtol=1e-10, atol=1e-12)


def test_a_new_objective_trains():
    """Five SGD steps on the LM head with the new objective raise the log-probs of the better responses."""
    hidden, weight, targets, mask, rewards = batch(seed=1)
    weight = weight.clone().requires_grad_()
    objective = GroupBaselineReinforce()
    losses = []
    for _ in range(5):
        loss, _ = fused_linear_objective_loss(hidden, weight, targets, mask, None, rewards, objective=objective,
                                              group_size=4)
        loss.backward()
        with torch.no_grad():
            weight -= 2.0 * weight.grad
        weight.grad = None
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
