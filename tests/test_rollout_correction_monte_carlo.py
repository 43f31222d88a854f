"""The correction corrects (issue 48, "Prove it"): a Monte Carlo test of the expected gradient, float64, CPU.

A tiny policy: responses of T tokens, token t drawn from softmax(h_t W^T / tau) (a linear softmax over V tokens,
fixed features h_t); the reward R(o) = 1 when the response's two tokens agree. The trainer's policy is tau = 1.0;
the sampler draws at tau = 1.1 (a sampler that differs, as vLLM's does from the trainer). The objective: PACS
with ``advantage="naive"``, ``weighting="none"``, one response per group, so each response's gradient at the
rollout depends on itself alone: (sigmoid(0) - R(o)) * beta * grad log pi(o) (the score-function estimator).

The on-policy expected gradient E_{o ~ pi}[...] is computed exactly, by enumerating the V^T responses (plain
autograd, no engine). Many responses drawn from the sampler then give the engine's gradient in batches, whose
spread is its Monte Carlo error: with ``sequence_truncate`` weights (rho(o) = pi(o) / q(o), clamped to
[0, 3], which no response reaches here: unbiased) the mean gradient lies within that error of the truth; without
the correction it lies many standard errors away (the test fails if the correction did nothing).
"""

from __future__ import annotations

import itertools

import torch

from pacs.train.rollout_correction import Band, truncated_weights
from pacs_kernels import PACS, LossOptions
from pacs_kernels.fused import fused_linear_pacs_loss

V, T, D = 4, 2, 3
SAMPLER_TEMPERATURE, TRAINER_TEMPERATURE = 1.1, 1.0
BATCHES, PER_BATCH = 40, 5000
OBJECTIVE = PACS(beta=1.0, advantage="naive", weighting="none")


def policy(seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(T, D, generator=g, dtype=torch.float64)  # h_t, the same for every response
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 1.5
    return features, weight


def reward(tokens: torch.Tensor) -> torch.Tensor:
    return (tokens[:, 0] == tokens[:, 1]).to(torch.float64)


def token_logp(features, weight, tokens, temperature):
    """(B, T) log-probs of ``tokens`` under softmax(h_t W^T / temperature)."""
    logits = features @ weight.T / temperature  # (T, V)
    return torch.log_softmax(logits, -1).gather(-1, tokens.T).T


def exact_on_policy_gradient(features, weight) -> torch.Tensor:
    """E_{o ~ pi}[(1/2 - R(o)) beta sum_t grad_W log pi(o_t)], by enumerating all V^T responses."""
    tokens = torch.tensor(list(itertools.product(range(V), repeat=T)))
    w = weight.clone().requires_grad_()
    logp = token_logp(features, w, tokens, TRAINER_TEMPERATURE)
    prob = logp.sum(1).exp().detach()
    assert abs(float(prob.sum()) - 1.0) < 1e-12
    surrogate = (prob * (0.5 - reward(tokens)) * OBJECTIVE.beta * logp.sum(1)).sum()
    (grad,) = torch.autograd.grad(surrogate, w)
    return grad


def sampled_gradients(features, weight, *, corrected: bool, seed=1) -> torch.Tensor:
    """(BATCHES, V, D): the engine's gradient on each batch of responses drawn from the sampler."""
    g = torch.Generator().manual_seed(seed)
    sampler_probs = torch.softmax(features @ weight.T / SAMPLER_TEMPERATURE, -1)  # (T, V)
    hidden = features.expand(PER_BATCH, T, D).contiguous()
    mask = torch.ones(PER_BATCH, T, dtype=torch.bool)
    grads, capped = [], 0
    for _ in range(BATCHES):
        tokens = torch.stack([torch.multinomial(sampler_probs[t], PER_BATCH, replacement=True, generator=g)
                              for t in range(T)], 1)
        old = token_logp(features, weight, tokens, TRAINER_TEMPERATURE)  # the trainer's old-policy pass
        sampler = token_logp(features, weight, tokens, SAMPLER_TEMPERATURE)  # what the sampler returned
        weights = truncated_weights(old, sampler, mask, "sequence_truncate", Band(0.0, 3.0)) if corrected else None
        if weights is not None:
            capped += int((weights >= 3.0).sum())
        w = weight.clone().requires_grad_()
        loss = fused_linear_pacs_loss(hidden, w, tokens, mask, old, reward(tokens), group_size=1, objective=OBJECTIVE,
                                      options=LossOptions(temperature=TRAINER_TEMPERATURE), token_weights=weights)
        (grad,) = torch.autograd.grad(loss, w)
        grads.append(grad)
    assert capped == 0, "a weight reached c_max: the estimator would be biased by the truncation"
    return torch.stack(grads)


def z_scores(grads: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Each gradient component's distance from the truth in Monte Carlo standard errors."""
    mean, error = grads.mean(0), grads.std(0) / BATCHES ** 0.5
    return (mean - truth) / error


def test_corrected_gradient_matches_the_on_policy_gradient_and_uncorrected_does_not():
    features, weight = policy()
    truth = exact_on_policy_gradient(features, weight)
    assert float(truth.abs().max()) > 0.05  # a gradient worth matching
    corrected = z_scores(sampled_gradients(features, weight, corrected=True), truth)
    uncorrected = z_scores(sampled_gradients(features, weight, corrected=False), truth)
    # 12 components: all within 4.5 standard errors (a chance failure ~1e-4); the uncorrected bias far outside
    assert float(corrected.abs().max()) < 4.5, corrected
    assert float(uncorrected.abs().max()) > 10.0, uncorrected
