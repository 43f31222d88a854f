"""Each objective of pacs_kernels.objectives against its float64 reference (per-response loops written
from the paper's equations), on fresh random padded inputs: loss and the gradients with respect to logp
and entropy, off-policy with a KL reference and an entropy bonus, and on-policy (old_logp=None)."""

import pytest
import torch
from seeds import stable_seed

from pacs_kernels.objectives import CISPO, DAPO, GRPO, GSPO, PACS, DrGRPO, Objective
from pacs_kernels.objectives.cispo import reference_cispo_loss
from pacs_kernels.objectives.dapo import reference_dapo_loss
from pacs_kernels.objectives.dr_grpo import reference_dr_grpo_loss
from pacs_kernels.objectives.grpo import reference_grpo_objective
from pacs_kernels.objectives.gspo import reference_gspo_loss
from pacs_kernels.objectives.pacs import reference_pacs_objective

B, T, G = 12, 9, 4

# (name, objective with regularizers, its reference, needs 0/1 rewards)
CASES = [
    ("grpo_token", GRPO(clip_eps=0.2, clip_eps_high=0.25, kl_coef=0.05, entropy_coef=0.01), reference_grpo_objective,
     False),
    ("grpo_seq", GRPO(aggregation="seq_mean", kl_coef=0.05, entropy_coef=0.01), reference_grpo_objective, False),
    ("dapo", DAPO(kl_coef=0.05, entropy_coef=0.01), reference_dapo_loss, False),
    ("dr_grpo", DrGRPO(max_completion_length=16, kl_coef=0.05, entropy_coef=0.01), reference_dr_grpo_loss, False),
    ("gspo", GSPO(eps_low=0.02, eps_high=0.03, kl_coef=0.05, entropy_coef=0.01), reference_gspo_loss, False),
    ("cispo", CISPO(eps_low=0.1, eps_high=0.2, kl_coef=0.05, entropy_coef=0.01), reference_cispo_loss, False),
    ("pacs", PACS(beta=0.5, kl_coef=0.05, entropy_coef=0.01, backend="torch"), reference_pacs_objective, True),
]


def make_inputs(seed, binary_rewards):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.35
    mask[:, 0] = True
    logp = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5 - 2.0
    old = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 3.0
    # garbage outside the mask must never reach the loss (not even as NaN through exp)
    old, ref = old.masked_fill(~mask, 60.0), ref.masked_fill(~mask, -60.0)
    if binary_rewards:
        rewards = (torch.rand(B, generator=gen) > 0.5).double()
        rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # a mixed group, for sure
    else:
        rewards = torch.randn(B, generator=gen, dtype=torch.float64)
    return logp, old, ref, entropy, rewards, mask


@pytest.mark.parametrize("on_policy", [False, True], ids=["off_policy", "on_policy"])
@pytest.mark.parametrize("name,objective,reference,binary", CASES, ids=[c[0] for c in CASES])
def test_objective_matches_its_float64_reference(name, objective, reference, binary, on_policy):
    logp, old, ref, entropy, rewards, mask = make_inputs(stable_seed(name, on_policy), binary)
    old = None if on_policy else old
    lp1, h1 = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    loss, stats = objective(lp1, old, rewards, mask, group_size=G, ref_logp=ref, entropy=h1)
    loss.backward()
    lp2, h2 = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    expected = reference(objective, lp2, old, rewards, mask, group_size=G, ref_logp=ref, entropy=h2)
    expected.backward()
    assert isinstance(objective, Objective)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    assert lp1.grad.abs().sum() > 0 and bool((lp1.grad[~mask] == 0).all())
    assert stats["loss"] == pytest.approx(float(loss.detach())) and stats["kl_mean"] > 0
    if not on_policy and "clip_frac" in stats:
        assert stats["clip_frac"] > 0  # the clipped branch is exercised, not only the plain ratio


def test_objectives_differ_where_their_papers_do():
    logp, old, _, _, rewards, mask = make_inputs(7, False)
    values = {name: float(obj(logp, old, rewards, mask, group_size=G)[0])
              for name, obj in [("grpo", GRPO()), ("dapo", DAPO()), ("dr", DrGRPO(max_completion_length=T)),
                                ("gspo", GSPO()), ("cispo", CISPO())]}
    assert len({round(v, 9) for v in values.values()}) == len(values), values


def test_dr_grpo_ignores_the_std_and_the_response_length():
    """Scaling all rewards scales Dr. GRPO's loss (no std division) but leaves DAPO's unchanged."""
    logp, _, _, _, rewards, mask = make_inputs(8, False)
    dr, dapo = DrGRPO(max_completion_length=T), DAPO()
    assert float(dr(logp, None, 3 * rewards, mask, group_size=G)[0]) == pytest.approx(
        3 * float(dr(logp, None, rewards, mask, group_size=G)[0]), rel=1e-9)
    assert float(dapo(logp, None, 3 * rewards, mask, group_size=G)[0]) == pytest.approx(
        float(dapo(logp, None, rewards, mask, group_size=G)[0]), rel=1e-6)


@pytest.mark.parametrize("objective", [GRPO(), GRPO(aggregation="seq_mean"), DAPO(), DrGRPO(max_completion_length=T),
                                       GSPO(), CISPO()], ids=["grpo_token", "grpo_seq", "dapo", "dr_grpo", "gspo",
                                                              "cispo"])
@pytest.mark.parametrize("group_size", [8, 7])
def test_a_group_of_equal_rewards_gets_no_gradient_in_float32(objective, group_size):
    """Equal rewards that float32 cannot hold exactly (0.7, 0.3): with 7 or 8 of them the group's float32 mean
    is 1 ulp off, and that ulp over std (about 1 ulp) + 1e-6 gave each response an advantage near 0.06, all
    of one sign (the float64 references cannot see it)."""
    gen = torch.Generator().manual_seed(stable_seed("equal rewards", group_size))
    n = 3 * group_size
    mask = torch.rand(n, T, generator=gen) > 0.35
    mask[:, 0] = True
    logp = torch.randn(n, T, generator=gen) * 0.5 - 2.0
    old = logp + 0.3 * torch.randn(n, T, generator=gen)
    rewards = torch.rand(n, generator=gen)
    rewards[:group_size], rewards[group_size:2 * group_size] = 0.7, 0.3  # two groups with nothing to learn
    for old_logp in (old, None):
        lp = logp.clone().requires_grad_()
        objective(lp, old_logp, rewards, mask, group_size=group_size)[0].backward()
        assert bool((lp.grad[:2 * group_size] == 0).all()), lp.grad[:2 * group_size].abs().max()
        assert lp.grad[2 * group_size:].abs().sum() > 0


def test_cispo_keeps_a_gradient_on_clipped_tokens():
    """PPO-style clipping zeroes the gradient of a clipped token; CISPO only clips its weight."""
    logp, old, _, _, rewards, mask = make_inputs(9, False)
    lp = logp.clone().requires_grad_()
    CISPO(eps_low=0.0, eps_high=0.0)(lp, old, rewards, mask, group_size=G)[0].backward()
    adv_nonzero = (rewards.reshape(-1, G) != rewards.reshape(-1, G).mean(1, keepdim=True)).reshape(-1, 1)
    assert bool((lp.grad[mask & adv_nonzero] != 0).all())


@pytest.mark.parametrize("make,error,match", [
    (lambda: DAPO(eps_low=1.5), ValueError, "eps_low"),
    (lambda: DAPO(eps_high=-0.1), ValueError, "eps_high"),
    (lambda: GSPO(eps_low=float("nan")), ValueError, "eps_low"),
    (lambda: CISPO(eps_high=float("inf")), ValueError, "eps_high"),
    (lambda: GRPO(clip_eps=-1.0), ValueError, "clip_eps"),
    (lambda: GRPO(aggregation="sum"), ValueError, "aggregation"),
    (lambda: DrGRPO(max_completion_length=0), ValueError, "max_completion_length"),
    (lambda: DrGRPO(), TypeError, "max_completion_length"),
    (lambda: DAPO(kl_coef=-0.1), ValueError, "kl_coef"),
    (lambda: CISPO(entropy_coef=-1), ValueError, "entropy_coef"),
    (lambda: PACS(weighting="both"), ValueError, "weighting"),
])
def test_bad_hyperparameters(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("objective", [GRPO(), DAPO(), DrGRPO(max_completion_length=T), GSPO(), CISPO(), PACS()],
                         ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("changes,error,match", [
    (dict(group_size=5), ValueError, "group_size"),
    (dict(group_size=1), ValueError, "group_size"),
    (dict(rewards=torch.ones(11)), ValueError, "rewards"),
    (dict(rewards=torch.full((B,), float("nan"))), ValueError, "rewards"),
    (dict(rewards=[1.0] * B), TypeError, "rewards"),
    (dict(mask=torch.ones(B, T - 1, dtype=torch.bool)), ValueError, "mask"),
    (dict(old_logp=torch.zeros(B, T + 1)), ValueError, "old_logp"),
    (dict(logp=torch.zeros(B * T)), ValueError, "logp"),
    (dict(ref_logp=torch.zeros(B, T - 1)), ValueError, "ref_logp"),
    (dict(entropy=torch.zeros(B, 2)), ValueError, "entropy"),
    (dict(mask=torch.zeros(B, T, dtype=torch.bool)), ValueError, "mask"),
])
def test_bad_inputs(objective, changes, error, match):
    logp, old, _, _, _, mask = make_inputs(10, True)
    args = dict(logp=logp, old_logp=old, rewards=(torch.arange(B) % 2).double(), mask=mask, group_size=G)
    args.update(changes)
    with pytest.raises(error, match=match):
        objective(args.pop("logp"), args.pop("old_logp"), args.pop("rewards"), args.pop("mask"), **args)


@pytest.mark.parametrize("objective,match", [
    (GRPO(kl_coef=0.1), "ref_logp"), (DAPO(entropy_coef=0.1), "entropy"),
    (DrGRPO(max_completion_length=2), "max_completion_length"), (PACS(), "0/1"),
])
def test_inputs_the_objective_cannot_use(objective, match):
    logp, old, _, _, rewards, mask = make_inputs(11, False)  # real-valued rewards
    with pytest.raises(ValueError, match=match):
        objective(logp, old, rewards, mask, group_size=G)


def test_gspo_counts_an_empty_mask_response_as_zero_loss():
    """Issue 45: TRL and Liger count a response whose mask is all False as a zero-loss response; so does GSPO
    (tests/test_empty_mask.py checks every objective and path against the float64 references)."""
    logp, old, _, _, rewards, mask = make_inputs(12, False)
    mask[3] = False
    loss, _ = GSPO()(logp, old, rewards, mask, group_size=G)
    assert torch.isfinite(loss)


def test_an_infinite_old_or_reference_log_prob_on_a_loss_token_is_refused():
    """An old_logp of +-inf on a mask == 1 token (a sampler's -inf for a token outside its top-p) made the ratio
    0 or inf: a silently zero gradient for that token, or NaN on one path and a number on the other. On a
    masked-out token it is ignored, as before."""
    from pacs_kernels import (
        LossOptions,
        fused_linear_grpo_loss,
        fused_linear_objective_loss,
        fused_linear_pacs_loss,
        pacs_loss,
    )

    gen = torch.Generator().manual_seed(5)
    b, t, d, v = 4, 3, 8, 20
    hidden, weight = torch.randn(b, t, d, generator=gen), torch.randn(v, d, generator=gen)
    targets, mask = torch.randint(0, v, (b, t), generator=gen), torch.ones(b, t, dtype=torch.bool)
    mask[1, 2] = False
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    old = -torch.rand(b, t, generator=gen) - 0.5
    logp = old + 0.1
    masked_inf = old.clone()
    masked_inf[1, 2] = float("-inf")
    assert torch.isfinite(pacs_loss(logp, masked_inf, rewards, mask, group_size=2))  # outside the mask: ignored
    for value in (float("inf"), float("-inf")):
        bad = old.clone()
        bad[0, 0] = value
        match = r"old_logp must be finite on every token the mask selects \(mask == 1\), got -?inf at \(0, 0\)"
        with pytest.raises(ValueError, match=match):
            pacs_loss(logp, bad, rewards, mask, group_size=2)
        with pytest.raises(ValueError, match=match):
            fused_linear_pacs_loss(hidden, weight, targets, mask, bad, rewards, group_size=2)
        with pytest.raises(ValueError, match=match):
            fused_linear_grpo_loss(hidden, weight, targets, mask, bad, rewards, group_size=2)
        for path in ("single_pass", "two_pass"):
            with pytest.raises(ValueError, match=match):
                fused_linear_objective_loss(hidden, weight, targets, mask, bad, rewards, objective=GRPO(), group_size=2,
                                            options=LossOptions(path=path))
        with pytest.raises(ValueError, match=match):
            CISPO()(logp, bad, rewards, mask, group_size=2)
        with pytest.raises(ValueError, match=r"ref_logp must be finite on every token the mask selects"):
            DAPO(kl_coef=0.1)(logp, old, rewards, mask, group_size=2, ref_logp=bad)
        with pytest.raises(ValueError, match=r"ref_logp must be finite on every token the mask selects"):
            fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=2,
                                   objective=GRPO(kl_coef=0.1), ref_logp=bad)


def test_pacs_with_the_naive_score_takes_groups_of_one_on_every_route():
    """advantage='naive' compares no response with another, so pacs_loss takes group_size=1; the PACS objective
    refused it, naming advantage='grpo' (not its own)."""
    from pacs_kernels import fused_linear_objective_loss, pacs_loss

    gen = torch.Generator().manual_seed(6)
    logp, old = -torch.rand(4, 3, generator=gen, dtype=torch.float64), -torch.rand(4, 3, generator=gen,
                                                                                 dtype=torch.float64)
    mask, rewards = torch.ones(4, 3, dtype=torch.bool), torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    naive = PACS(advantage="naive", backend="torch")
    loss = naive(logp, old, rewards, mask, group_size=1)[0]
    torch.testing.assert_close(loss, pacs_loss(logp, old, rewards, mask, group_size=1, advantage="naive",
                                               backend="torch"))
    hidden, weight = torch.randn(4, 3, 8, generator=gen), torch.randn(20, 8, generator=gen)
    targets = torch.randint(0, 20, (4, 3), generator=gen)
    assert torch.isfinite(fused_linear_objective_loss(hidden, weight, targets, mask, old.float(), rewards.float(),
                                                      objective=naive, group_size=1)[0])
    with pytest.raises(ValueError, match=r"group_size must be >= 2 for advantage='rloo'"):
        PACS()(logp, old, rewards, mask, group_size=1)
