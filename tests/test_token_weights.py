"""Per-token weights through the loss engine (issue 48: rollout correction's truncated importance weights).

``token_weights=`` of the fused entries multiplies each token's policy term, for every objective, on every path
(single pass, two passes, one sweep) and in both layouts (padded, packed): float64 parity against plain-PyTorch
references written here from each objective's formula, loops over responses. For PACS the weight enters the
score (pacs_kernels/objectives/pacs.py: r = beta sum_t m w (logp - old_logp)); its claim, that at logp = old_logp
the loss is unchanged and every token's gradient is its weight times the unweighted one, is tested directly.
"""

from __future__ import annotations

import pytest
import torch

from pacs_kernels import CISPO, DAPO, GRPO, GSPO, PACS, DrGRPO, LossOptions
from pacs_kernels.fused import fused_linear_grpo_loss, fused_linear_objective_loss, fused_linear_pacs_loss
from pacs_kernels.logprobs import linear_logprobs

B, G, T, D, V = 6, 3, 5, 4, 11


def tiny(seed=0, *, drift=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.7
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    old = logp + drift * torch.randn(B, T, generator=g, dtype=torch.float64)
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5  # some near 0, some over 1
    return hidden, weight, targets, mask, old, rewards, weights


# ------------------------------------------------------------------ plain-PyTorch references (float64, loops)

def normalized_adv(rewards, i, *, std=True):
    group = rewards[(i // G) * G:(i // G + 1) * G]
    centred = rewards[i] - group.mean()
    return centred / (group.std() + 1e-6) if std else centred


def clipped_term(lp, old, adv, low, high):
    ratio = torch.exp(lp - old)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv)


def reference(objective, logp, old, rewards, mask, w):
    """The weighted loss of ``objective`` from its formula: each token's policy term times its weight."""
    per_response, n_tokens = [], int(mask.sum())
    for i in range(B):
        m = mask[i]
        lp, o, wi = logp[i][m], old[i][m], w[i][m]
        if isinstance(objective, GRPO):
            per_response.append((clipped_term(lp, o, normalized_adv(rewards, i), objective.clip_eps,
                                              objective.clip_eps) * wi).sum())
        elif isinstance(objective, DAPO):
            per_response.append((clipped_term(lp, o, normalized_adv(rewards, i), objective.eps_low,
                                              objective.eps_high) * wi).sum())
        elif isinstance(objective, DrGRPO):
            per_response.append((clipped_term(lp, o, normalized_adv(rewards, i, std=False), objective.eps_low,
                                              objective.eps_high) * wi).sum())
        elif isinstance(objective, GSPO):
            s = torch.exp((lp - o).mean())
            adv = normalized_adv(rewards, i)
            term = -torch.minimum(s * adv, torch.clamp(s, 1 - objective.eps_low, 1 + objective.eps_high) * adv)
            per_response.append(term * wi.mean())  # l[i] spread over its tokens, each weighted
        elif isinstance(objective, CISPO):
            clip = torch.clamp(torch.exp(lp - o).detach(), 1 - objective.eps_low, 1 + objective.eps_high)
            per_response.append((-clip * normalized_adv(rewards, i) * lp * wi).sum())
    if isinstance(objective, GRPO):
        if objective.aggregation == "token_mean":
            return sum(per_response) / n_tokens
        return sum(r / int(mask[i].sum()) for i, r in enumerate(per_response)) / B
    if isinstance(objective, (DAPO, CISPO)):
        return sum(per_response) / n_tokens
    if isinstance(objective, DrGRPO):
        return sum(per_response) / (B * objective.max_completion_length)
    if isinstance(objective, GSPO):
        return sum(per_response) / B
    return reference_pacs(objective, logp, old, rewards, mask, w)


def reference_pacs(objective, logp, old, rewards, mask, w):
    """PACS with the weighted score r[i] = beta sum_t m w (logp - old), RLOO, balanced class weights, BCE / B."""
    score = torch.stack([objective.beta * (w[i][mask[i]] * (logp[i][mask[i]] - old[i][mask[i]])).sum()
                         for i in range(B)])
    total = 0.0
    for g0 in range(0, B, G):
        r, labels = score[g0:g0 + G], rewards[g0:g0 + G]
        n_pos = float(labels.sum())
        for k in range(G):
            psi = r[k] - (r.sum() - r[k]) / (G - 1)
            own = n_pos if labels[k] == 1 else G - n_pos
            cw = G / (2 * own) if 0 < n_pos < G else 1.0
            total = total + cw * (torch.nn.functional.softplus(psi) - labels[k] * psi)
    loss = total / B
    if objective.kl_coef:
        return loss  # the KL term is added by the caller (test below)
    return loss


OBJECTIVES = [PACS(), PACS(beta=0.5), GRPO(), GRPO(aggregation="seq_mean", clip_eps=0.3), DAPO(),
              DrGRPO(max_completion_length=T), GSPO(eps_low=0.2, eps_high=0.3), CISPO()]


def packed(hidden, targets, mask, *per_token):
    """The padded batch as one packed sequence (every position kept; mask selects the response tokens)."""
    cu = torch.arange(0, B * T + 1, T)
    return (hidden.reshape(B * T, D), targets.reshape(-1), mask.reshape(-1), cu,
            *[None if x is None else x.reshape(-1) for x in per_token])


def run_entry(objective, layout, path, hidden, weight, targets, mask, old, rewards, w, old_lse=None):
    cu = None
    if layout == "packed":
        hidden, targets, mask, cu, old, w, old_lse = packed(hidden, targets, mask, old, w, old_lse)
    options = LossOptions(path=path if path != "one_sweep" else "auto", backend="torch")
    loss, _ = fused_linear_objective_loss(hidden, weight, targets, mask, old, rewards, objective=objective,
                                          group_size=G, options=options, cu_seqlens=cu, token_weights=w,
                                          old_lse=old_lse)
    return loss


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: repr(o)[:40])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("path", ["single_pass", "two_pass", "one_sweep"])
def test_weighted_loss_and_gradients_match_the_reference(objective, layout, path):
    hidden, weight, targets, mask, old, rewards, w = tiny()
    old_lse = None
    if path == "one_sweep":  # the first step after the rollout: old_logp is the current log-probs
        old, old_lse = linear_logprobs(hidden, weight, targets, return_lse=True)
        old, old_lse = old.detach(), old_lse.detach()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = run_entry(objective, layout, path, h1, w1, targets, mask, old, rewards, w, old_lse)
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = torch.log_softmax(h2 @ w2.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    expected = reference(objective, logp, old, rewards, mask, w)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-9, atol=1e-12)
    # and the weights matter: unit weights give another gradient
    h3, w3 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    run_entry(objective, layout, path, h3, w3, targets, mask, old, rewards, torch.ones_like(w), old_lse).backward()
    assert not torch.allclose(w3.grad, w2.grad, rtol=1e-3)


def test_unit_weights_are_the_unweighted_loss():
    hidden, weight, targets, mask, old, rewards, _ = tiny(1)
    for objective in OBJECTIVES:
        ones = run_entry(objective, "padded", "two_pass", hidden, weight, targets, mask, old, rewards,
                         torch.ones(B, T, dtype=torch.float64))
        none = run_entry(objective, "padded", "two_pass", hidden, weight, targets, mask, old, rewards, None)
        torch.testing.assert_close(ones, none, rtol=1e-12, atol=1e-14)


def test_pacs_claim_at_the_rollout_value_unchanged_gradient_weighted():
    """docs/rollout-correction.md: at logp = old_logp PACS's weighted loss equals the unweighted one (ln 2 per
    group) and dloss/dlogp[j,t] = w[j,t] x the unweighted dloss/dlogp[j,t]; on other log-probs the score is
    beta sum_t m w (logp - old)."""
    _, _, _, mask, old, rewards, w = tiny(2)
    for objective in (PACS(), PACS(score="mean_logp"), PACS(score_function_term=True)):
        at = old.clone().requires_grad_()
        plain, _ = objective(at, old, rewards, mask, group_size=G)
        (g_plain,) = torch.autograd.grad(plain, at)
        at = old.clone().requires_grad_()
        weighted, _ = objective(at, old, rewards, mask, group_size=G, token_weights=w)
        (g_weighted,) = torch.autograd.grad(weighted, at)
        torch.testing.assert_close(weighted, plain, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(g_weighted, torch.where(mask, w * g_plain, 0.0), rtol=1e-12, atol=1e-15)
    logp = old + 0.2 * torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    value, _ = PACS(beta=0.7)(logp, old, rewards, mask, group_size=G, token_weights=w)
    torch.testing.assert_close(value, reference_pacs(PACS(beta=0.7), logp, old, rewards, mask, w),
                               rtol=1e-12, atol=1e-14)


def test_regularized_objectives_weigh_only_the_policy_term():
    """A KL term is not weighted (TRL adds beta * KL after multiplying per_token_loss by the IS ratio)."""
    hidden, weight, targets, mask, old, rewards, w = tiny(4)
    ref = old + 0.1
    loss, _ = fused_linear_objective_loss(hidden, weight, targets, mask, old, rewards, objective=GRPO(kl_coef=0.3),
                                          group_size=G, ref_logp=ref, token_weights=w)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    delta = torch.where(mask, ref - logp, 0.0)
    kl = torch.where(mask, torch.exp(delta) - delta - 1, 0.0).sum() / mask.sum()
    torch.testing.assert_close(loss, reference(GRPO(), logp, old, rewards, mask, w) + 0.3 * kl, rtol=1e-10,
                               atol=1e-12)


def test_the_grpo_and_pacs_entries_take_weights_too():
    hidden, weight, targets, mask, old, rewards, w = tiny(5)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    grpo = fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=G, token_weights=w)
    torch.testing.assert_close(grpo, reference(GRPO(), logp, old, rewards, mask, w), rtol=1e-10, atol=1e-12)
    pacs = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=G, token_weights=w)
    torch.testing.assert_close(pacs, reference(PACS(), logp, old, rewards, mask, w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad, match", [
    (torch.ones(B, T + 1, dtype=torch.float64), r"token_weights must have shape hidden.shape\[:-1\]"),
    (torch.ones(B, T, dtype=torch.int64), "token_weights"),
    (torch.full((B, T), float("nan"), dtype=torch.float64), "token_weights must be finite"),
    (-torch.ones(B, T, dtype=torch.float64), "token_weights must be >= 0"),
])
def test_bad_weights_are_named(bad, match):
    hidden, weight, targets, mask, old, rewards, _ = tiny()
    with pytest.raises((ValueError, TypeError), match=match):
        fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=G, token_weights=bad)


def test_weights_outside_the_mask_are_not_read():
    hidden, weight, targets, mask, old, rewards, w = tiny()
    garbage = torch.where(mask, w, float("nan"))
    a = fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=G, token_weights=garbage)
    b = fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=G, token_weights=w)
    torch.testing.assert_close(a, b)


def test_an_objective_without_weights_is_refused_by_the_planner():
    hidden, weight, targets, mask, old, rewards, w = tiny()

    def plain_objective(logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
        return (logp * mask).sum() / mask.sum(), {}

    with pytest.raises(ValueError, match=r"token_weights= needs an objective that takes per-token weights"):
        fused_linear_objective_loss(hidden, weight, targets, mask, old, rewards, objective=plain_objective,
                                    group_size=G, token_weights=w)
