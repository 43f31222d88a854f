"""fused_linear_pacs_loss(old_lse=...): the one-sweep first step equals the usual path."""

from __future__ import annotations

import warnings

import pytest
import torch
from seeds import stable_seed

from pacs_kernels import PACS, LossOptions, PACSLoss, fused_linear_pacs_loss, linear_logprobs

VOCAB, WIDTH = 70, 24


def _batch(seed, dtype=torch.float32, n_groups=2, group_size=4, length=10):
    gen = torch.Generator().manual_seed(seed)
    b = n_groups * group_size
    hidden = torch.randn(b, length, WIDTH, generator=gen).to(dtype)
    weight = (0.4 * torch.randn(VOCAB, WIDTH, generator=gen)).to(dtype)
    bias = (0.1 * torch.randn(VOCAB, generator=gen)).to(dtype)
    targets = torch.randint(0, VOCAB, (b, length), generator=gen)
    pos = torch.arange(length)[None, :]
    mask = (pos >= torch.randint(0, 3, (b, 1), generator=gen)) & (pos < torch.randint(5, length + 1, (b, 1),
                                                                                        generator=gen))
    rewards = torch.randint(0, 2, (b,), generator=gen).float()
    return hidden, weight, bias, targets, mask, rewards


def _loss_and_grads(hidden, weight, bias, targets, mask, old, rewards, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    loss, stats = fused_linear_pacs_loss(leaves[0], leaves[1], targets, mask, old, rewards, bias=leaves[2],
                                         return_stats=True, **kw)
    loss.backward()
    return loss.detach(), stats, [t.grad for t in leaves]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("advantage,score,weighting", [("rloo", "log_ratio", "balanced"),
                                                       ("naive", "mean_logp", "none"),
                                                       ("rloo", "log_ratio", "positive_only")])
def test_one_sweep_first_step_equals_usual_path(backend, advantage, score, weighting):
    hidden, weight, bias, targets, mask, rewards = _batch(seed=stable_seed(backend, advantage, score) % 999)
    opts = dict(group_size=4, objective=PACS(beta=0.7, advantage=advantage, score=score, weighting=weighting),
                options=LossOptions(temperature=0.9, backend=backend))
    with torch.no_grad():  # the rollout-time pass: old log-probs and their log-sum-exp
        old, old_lse = linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.9, backend=backend,
                                       return_lse=True)
    usual = _loss_and_grads(hidden, weight, bias, targets, mask, old, rewards, **opts)
    fast = _loss_and_grads(hidden, weight, bias, targets, mask, old, rewards, old_lse=old_lse, **opts)
    torch.testing.assert_close(fast[0], usual[0], rtol=1e-5, atol=1e-6)
    assert fast[1].psi_mean == pytest.approx(usual[1].psi_mean, abs=1e-5)
    for got, want in zip(fast[2], usual[2]):
        # (a floor: where every group has a single label the exact gradient is 0 and both paths give rounding)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item() + 1e-6)


def test_module_and_tied_weight_take_old_lse():
    hidden, weight, _, targets, mask, rewards = _batch(seed=3)
    with torch.no_grad():
        old, old_lse = linear_logprobs(hidden, weight, targets, backend="torch", return_lse=True)
    loss_fn = PACSLoss(group_size=4, options=LossOptions(backend="torch"))
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_fn(hidden, w1, targets, mask, old, rewards).backward()
    loss_fn(hidden, w2, targets, mask, old, rewards, old_lse=old_lse).backward()
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-4, atol=1e-6)


def test_a_stale_old_lse_warns_and_the_usual_path_runs():
    """old_lse from other weights (an optimizer step later): a warning, and the loss and gradients of the
    usual path, exact for the current weights (a trainer must not stop on it)."""
    hidden, weight, _, targets, mask, rewards = _batch(seed=4)
    with torch.no_grad():
        old, old_lse = linear_logprobs(hidden, weight, targets, backend="torch", return_lse=True)
    moved = weight + 0.3 * torch.randn_like(weight)  # an optimizer step later: old_lse is stale
    w_stale, w_usual = moved.clone().requires_grad_(), moved.clone().requires_grad_()
    with pytest.warns(RuntimeWarning, match="old_lse does not belong to these weights.*usual path"):
        stale, stats = fused_linear_pacs_loss(hidden, w_stale, targets, mask, old, rewards, group_size=4,
                                              old_lse=old_lse, options=LossOptions(backend="torch"),
                                              return_stats=True)
    usual = fused_linear_pacs_loss(hidden, w_usual, targets, mask, old, rewards, group_size=4,
                                   options=LossOptions(backend="torch"))
    assert stats.path != "one_sweep"
    stale.backward()
    usual.backward()
    torch.testing.assert_close(stale, usual)
    torch.testing.assert_close(w_stale.grad, w_usual.grad)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2), (torch.float16, 5e-2)])
def test_the_one_sweep_tolerates_rounding_not_moved_weights(dtype, tolerance):
    """Log-probs within the dtype's rounding of old_logp stay on the one sweep; one token beyond it sends
    the call to the usual path. 16-bit passes of one weight state differ by 1e-2 and more between batch
    compositions, so their tolerance is wider; each token is measured against 1 + |its old_logp|."""
    from pacs_kernels.engine.one_sweep import stale_lse_tolerance

    assert stale_lse_tolerance(dtype) == tolerance
    hidden, weight, _, targets, mask, rewards = _batch(seed=5)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.no_grad():
        old, old_lse = linear_logprobs(hidden, weight, targets, backend="torch", return_lse=True)
    # within the tolerance for every token; beyond it for one token only (the likeliest: the smallest scale)
    likeliest = old.masked_fill(~mask, -float("inf")).flatten().argmax()
    within = old + 0.5 * tolerance * (1 + old.abs())
    beyond = old.clone()
    beyond.view(-1)[likeliest] -= 3 * tolerance * (1 + old.view(-1)[likeliest].abs())
    for moved, expected in ((within, "one_sweep"), (beyond, None)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, moved, rewards, group_size=4,
                                              old_lse=old_lse, options=LossOptions(backend="torch"),
                                              return_stats=True)
        stale = [w for w in caught if "old_lse does not belong" in str(w.message)]
        if expected == "one_sweep":
            assert stats.path == "one_sweep" and not stale
        else:
            assert stats.path != "one_sweep" and len(stale) == 1
    with pytest.raises(ValueError, match="old_lse must have the shape of old_logp"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4, old_lse=old_lse[:2],
                               options=LossOptions(backend="torch"))
    with pytest.raises(ValueError, match="needs backend 'auto', 'torch' or 'triton'"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4, old_lse=old_lse,
                               options=LossOptions(backend="naive"))
