"""Naive reference implementations: they materialize the N x V logits.

Ground truth for tests and the baseline in benchmarks. Plain PyTorch autograd does the
backward, so these are correct by construction; they are just memory hungry.
"""

from __future__ import annotations

import torch


def naive_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax((hidden @ weight.T + bias) / temperature)``.

    hidden (..., d), weight (V, d), targets (...) int, bias (V,) or None.
    Computes in ``compute_dtype`` (default: float32, or float64 when the inputs are float64)
    and returns ``(logp, entropy)`` in that dtype, shape (...).
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    if softcap is not None:  # Gemma-style logit soft-capping, before the temperature
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


# ----------------------------------------------------------------------------- group losses
#
# Float64 re-statements of the public PACS code (ritzz-ai/PACS, pacs_core_algos.py) and of a
# plain clipped GRPO surrogate, written with per-group Python loops on purpose: they share no
# code with the vectorised implementations they check. The one deliberate difference from the
# public code: the response mask is applied to every per-token sum.


def reference_pacs_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int,
    beta: float = 1.0,
    score: str = "log_ratio",
    advantage: str = "rloo",
    weighting: str = "balanced",
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PACS loss in float64, (B, T) padded inputs. Returns (loss, {score, psi, weight, bce}) (B,) each.

    Differentiable in ``logp`` (autograd); no score-function term. ``valid`` (B,) bool: an invalid
    response gets weight 0 and is left out of its group's label counts (its score stays in the baseline).
    """
    logp = logp.to(torch.float64)
    old_logp = old_logp.detach().to(torch.float64)
    mask = mask.to(torch.float64)
    labels = rewards.detach().to(torch.float64)
    n = logp.shape[0]
    scores = []
    for i in range(n):
        tokens = mask[i] != 0
        if score == "log_ratio":
            scores.append(beta * (logp[i][tokens] - old_logp[i][tokens]).sum())
        else:
            scores.append(beta * logp[i][tokens].sum() / max(int(tokens.sum()), 1))  # empty: 0, as TRL's clamp
    psi = []
    for g0 in range(0, n, group_size):
        group = scores[g0:g0 + group_size]
        for i, r in enumerate(group):
            if advantage == "rloo":
                others = [group[j] for j in range(group_size) if j != i]
                psi.append(r - sum(others) / (group_size - 1))
            elif advantage == "grpo":
                stacked = torch.stack(group)
                psi.append((r - stacked.mean()) / (torch.std(stacked) + 1e-6))
            else:
                psi.append(r)
    weights = []
    keep = [True] * n if valid is None else [bool(v) for v in valid]
    labels = torch.where(torch.tensor(keep, device=labels.device), labels, torch.zeros_like(labels))
    for g0 in range(0, n, group_size):
        group = [float(v) for v, k in zip(labels[g0:g0 + group_size], keep[g0:g0 + group_size]) if k]
        classes = sorted(set(group))
        for i in range(g0, g0 + group_size):
            label = float(labels[i])
            if not keep[i]:  # an invalid response: no loss term, not counted
                weights.append(0.0)
            elif weighting == "balanced":
                # sklearn compute_class_weight("balanced"): n_samples / (n_classes * count)
                weights.append(len(group) / (len(classes) * group.count(label)) if len(classes) > 1 else 1.0)
            elif weighting == "positive_only":
                weights.append(1.0 if label == 1 else 0.0)
            elif weighting == "negative_only":
                weights.append(1.0 if label == 0 else 0.0)
            else:
                weights.append(1.0)
    psi_t = torch.stack(psi)
    weight_t = torch.tensor(weights, dtype=torch.float64, device=logp.device)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(psi_t, labels, weight=weight_t)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(psi_t, labels, reduction="none")
    return loss, {"score": torch.stack(scores).detach(), "psi": psi_t.detach(), "weight": weight_t,
                  "bce": bce.detach()}


def reference_grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: str = "token_mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Clipped GRPO surrogate in float64 with per-response loops, (B, T) padded inputs."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    logp = logp.to(torch.float64)
    labels = rewards.detach().to(torch.float64)
    n = logp.shape[0]
    per_response_sums, per_response_counts = [], []
    for i in range(n):
        g0 = (i // group_size) * group_size
        group = labels[g0:g0 + group_size]
        adv = (labels[i] - group.mean()) / (group.std() + 1e-6)
        tokens = mask[i] != 0
        lp = logp[i][tokens]
        ratio = torch.exp(lp - old_logp[i][tokens].detach().to(torch.float64))
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1 - clip_eps, 1 + high)
        per_token = torch.maximum(unclipped, clipped)
        if ref_logp is not None and kl_coef != 0:
            delta = ref_logp[i][tokens].detach().to(torch.float64) - lp
            per_token = per_token + kl_coef * (torch.exp(delta) - delta - 1)
        per_response_sums.append(per_token.sum())
        per_response_counts.append(int(tokens.sum()))
    if aggregation == "token_mean":
        return torch.stack(per_response_sums).sum() / sum(per_response_counts)
    return torch.stack([s / max(c, 1) for s, c in zip(per_response_sums, per_response_counts)]).mean()
