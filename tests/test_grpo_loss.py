"""grpo_loss / fused_linear_grpo_loss against a plain per-response float64 reference."""

import pytest
import torch
from seeds import stable_seed

from pacs_kernels import GRPO, GRPOStats, LossOptions, fused_linear_grpo_loss, grpo_loss
from pacs_kernels.reference import naive_linear_logprobs, reference_grpo_loss


def make_inputs(n_groups=3, group_size=4, length=8, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b = n_groups * group_size
    logp = -2.0 * torch.rand(b, length, generator=gen, dtype=torch.float64)
    # ratios spread both sides of the clip range
    old_logp = logp + 0.5 * torch.randn(b, length, generator=gen, dtype=torch.float64)
    ref_logp = logp + 0.3 * torch.randn(b, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    logp = torch.where(mask, logp, torch.full_like(logp, 50.0))  # garbage at padding: exp would overflow
    rewards = torch.randint(0, 2, (b,), generator=gen).double()
    rewards[-1] = 0.3  # GRPO takes any real reward
    return logp, old_logp, ref_logp, rewards, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("clip_eps_high", [None, 0.28])
def test_matches_reference(aggregation, kl_coef, clip_eps_high):
    logp, old_logp, ref_logp, rewards, mask = make_inputs(seed=stable_seed(aggregation, kl_coef) % 1000)
    opts = dict(group_size=4, clip_eps=0.2, clip_eps_high=clip_eps_high, aggregation=aggregation,
                ref_logp=ref_logp, kl_coef=kl_coef)
    lp_ref = logp.clone().requires_grad_()
    expected = reference_grpo_loss(lp_ref, old_logp, rewards, mask, **opts)
    (expected_grad,) = torch.autograd.grad(expected, lp_ref)
    lp = logp.clone().requires_grad_()
    loss = grpo_loss(lp, old_logp, rewards, mask, **opts)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    assert bool(torch.isfinite(grad).all()) and bool((grad[~mask] == 0).all())
    assert bool((grad[mask] != 0).any())


def test_aggregations_differ_and_clipping_is_active():
    logp, old_logp, ref_logp, rewards, mask = make_inputs(seed=1)
    token = grpo_loss(logp, old_logp, rewards, mask, group_size=4)
    seq, stats = grpo_loss(logp, old_logp, rewards, mask, group_size=4, aggregation="seq_mean",
                           ref_logp=ref_logp, return_stats=True)
    assert token.item() != pytest.approx(seq.item())
    assert isinstance(stats, GRPOStats) and stats.loss == seq.item()
    assert 0 < stats.clip_frac < 1 and stats.kl_mean > 0 and stats.advantage_abs_mean > 0
    ratio = torch.exp(logp - old_logp)[mask]
    assert stats.ratio_mean == pytest.approx(ratio.mean().item(), rel=1e-9)


def test_equal_rewards_give_zero_advantage():
    logp, old_logp, _, _, mask = make_inputs(seed=2)
    lp = logp.clone().requires_grad_()
    loss = grpo_loss(lp, old_logp, torch.ones(12), mask, group_size=4)
    loss.backward()
    assert loss.item() == 0.0 and bool((lp.grad == 0).all())


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_fused_matches_naive(backend):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(8, 6, 12, generator=gen)
    weight = 0.3 * torch.randn(40, 12, generator=gen)
    targets = torch.randint(0, 40, (8, 6), generator=gen)
    mask = torch.rand(8, 6, generator=gen) > 0.3
    mask[:, 0] = True
    targets = targets.masked_fill(~mask, -1)
    old = torch.randn(8, 6, generator=gen) * 0.1 - 3.5
    rewards = torch.randint(0, 2, (8,), generator=gen).float()
    settings = dict(aggregation="seq_mean", clip_eps_high=0.3)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_grpo_loss(h1, w1, targets, mask, old, rewards, group_size=4, objective=GRPO(**settings),
                                  options=LossOptions(temperature=0.8, backend=backend))
    loss.backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp, _ = naive_linear_logprobs(h2, w2, targets.clamp(min=0), temperature=0.8)
    expected = reference_grpo_loss(logp, old, rewards, mask, group_size=4, **settings)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad.double(), h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("changes,error,match", [
    (dict(group_size=5), ValueError, "group_size"),
    (dict(group_size=1), ValueError, "group_size"),
    (dict(rewards=torch.ones(11)), ValueError, "rewards"),
    (dict(rewards=torch.full((12,), float("nan"))), ValueError, "rewards"),
    (dict(clip_eps=-0.1), ValueError, "clip_eps"),
    (dict(clip_eps_high=float("inf")), ValueError, "clip_eps_high"),
    (dict(aggregation="sum"), ValueError, "aggregation"),
    (dict(kl_coef=0.1), ValueError, "ref_logp"),
    (dict(kl_coef=-1.0, ref_logp=torch.zeros(12, 8)), ValueError, "kl_coef"),
    (dict(ref_logp=torch.zeros(12, 7)), ValueError, "ref_logp"),
    (dict(mask=torch.ones(12, 7)), ValueError, "mask"),
    (dict(old_logp=torch.zeros(12, 8, device="meta")), ValueError, "device"),
    (dict(rewards=[1.0] * 12), TypeError, "rewards"),
])
def test_bad_input(changes, error, match):
    logp, old_logp, _, rewards, mask = make_inputs(seed=4)
    args = dict(logp=logp, old_logp=old_logp, rewards=rewards, mask=mask)
    kwargs = dict(group_size=4)
    for key, value in changes.items():
        (args if key in args else kwargs)[key] = value
    with pytest.raises(error, match=match):
        grpo_loss(args["logp"], args["old_logp"], args["rewards"], args["mask"], **kwargs)


def test_empty_responses():
    """An empty-mask response is a zero-loss response (TRL, Liger): seq_mean divides its 0 by max(0, 1), the
    1/B still counts it (tests/test_empty_mask.py checks every objective and path)."""
    logp, old_logp, _, rewards, mask = make_inputs(seed=5)
    mask[3] = False
    grpo_loss(logp, old_logp, rewards, mask, group_size=4)  # token_mean: fine
    loss = grpo_loss(logp, old_logp, rewards, mask, group_size=4, aggregation="seq_mean")
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(logp, old_logp, rewards, torch.zeros_like(mask), group_size=4)


def test_fused_full_mask():
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = 0.3 * torch.randn(30, 8, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 30, (4, 5), generator=gen)
    mask = torch.ones(4, 5, dtype=torch.bool)
    old = -3.4 + 0.1 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    loss = fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=2,
                                  options=LossOptions(backend="torch"))
    logp, _ = naive_linear_logprobs(hidden, weight, targets)
    expected = reference_grpo_loss(logp, old, rewards, mask, group_size=2)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-7)  # logp comes back float32
