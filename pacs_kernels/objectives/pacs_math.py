"""pacs_loss(): the PACS objective on per-token log-probs (semantics: docs/pacs-algorithm.md).

For B = n_groups * G responses (each group's G responses contiguous), with the response mask m:

    sum_logp[i] = sum_t m[i,t] logp[i,t]      sum_old[i] = sum_t m[i,t] old_logp[i,t]
    score r[i]  = beta * (sum_logp[i] - sum_old[i])             ("log_ratio")
                | beta * sum_logp[i] / sum_t m[i,t]             ("mean_logp")
    psi[i]      = r[i] - mean_{j in group, j != i} r[j]         ("rloo")
                | (r[i] - mean_group r) / (std_group(r, unbiased) + 1e-6)   ("grpo")
                | r[i]                                          ("naive")
    w[i]        = G / (2 * #{j in group: R[j] = R[i]}) in groups holding both labels, else 1
                                                                ("balanced"; "none": 1;
                                                                 "positive_only": R; "negative_only": 1 - R)
    l[i]        = softplus(psi[i]) - R[i] psi[i]                (BCE with logits)
    loss        = (1/B) sum_i w[i] l[i]                         (BCEWithLogitsLoss(weight=w), mean over B)

The gradient with respect to logp is one scalar per response times the mask,
dloss/dlogp[j,t] = m[j,t] * c[j] (derivation in triton/group_loss.py). The torch path gets it
by autograd; the Triton path computes c in its forward kernel and broadcasts it in backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..loss_inputs import (
    GRPO_STD_EPS,
    LOSS_BACKENDS,
    ResponseLayout,
    check_beta,
    check_group_ids,
    check_group_size,
    check_options,
    check_rewards,
    check_token_tensors,
    check_valid,
    response_token_counts,
)


@dataclass(frozen=True)
class PACSStats:
    """What a trainer logs about one PACS loss evaluation (plain floats; one device sync to build).

    psi_mean / psi_std: the implicit advantage logits (std over the batch, population).
    sigmoid_psi_mean vs reward_mean: the implicit critic's calibration (predicted vs actual success).
    score_mean: mean reward proxy r (the beta-scaled log-ratio or mean log-prob).
    weight_mean / weight_min / weight_max: the class weights used.
    frac_single_label_groups: groups whose responses all carry the same label.
    sigmoid_psi_correct_mean / sigmoid_psi_incorrect_mean: mean sigmoid(psi) over the responses
        labelled 1 / 0 (NaN when there are none). Under RLOO psi sums to 0 within a group, so
        sigmoid_psi_mean sits near 0.5 by construction; the gap between these two is what shows
        whether the implicit critic separates right from wrong answers.
    single_label_grad_share: the share of the loss's gradient that single-label groups carry, as
        sum over their responses of c[j]^2 / sum over all of c[j]^2, c[j] = dloss/dr[j] (the gradient
        with respect to response j's score; its tokens' log-probs get beta * c[j] under "log_ratio").
        Under "rloo" and "grpo" it is 0 while the reference is the current policy (psi = 0 in every
        group: a single-label group then has one BCE slope for all its responses, which the baseline
        cancels); a reference kept for several rollout steps makes these groups pull each response's
        log-ratio toward its group's, toward the reference. NaN when every c[j] is 0. The
        score-function term and mean_logp's division by the length are not in c.
    entropy_mean: mean token entropy of the policy (NaN unless the fused loss was asked for it).
    valid_frac: fraction of responses that count (``valid``); 1.0 without a validity mask.
    path: how the fused loss ran: "single_pass", "two_pass" or "one_sweep" ("" for ``pacs_loss``).
    """

    loss: float
    psi_mean: float
    psi_std: float
    sigmoid_psi_mean: float
    reward_mean: float
    score_mean: float
    weight_mean: float
    weight_min: float
    weight_max: float
    frac_single_label_groups: float
    sigmoid_psi_correct_mean: float
    sigmoid_psi_incorrect_mean: float
    single_label_grad_share: float
    entropy_mean: float = float("nan")
    valid_frac: float = 1.0
    path: str = ""

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """The numbers, keys prefixed (``path`` is left out: it is a name, not a metric)."""
        return {prefix + key: value for key, value in asdict(self).items() if not isinstance(value, str)}


# ----------------------------------------------------------------------------- torch math


def class_weights(rewards: torch.Tensor, group_size: int, weighting: str,
                  valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) per-response weights (float, rewards' dtype); rewards hold 0/1 labels (or [0,1] for 'none').

    ``valid`` (B,) bool: invalid responses get weight 0 and are left out of their group's class
    counts ("balanced": n_valid / (2 * count of the label among the valid responses)).
    """
    if weighting == "none":
        weights = torch.ones_like(rewards)
    elif weighting == "positive_only":
        weights = rewards.clone()
    elif weighting == "negative_only":
        weights = 1.0 - rewards
    else:
        labels = rewards.reshape(-1, group_size)
        present = torch.ones_like(labels) if valid is None else valid.reshape(-1, group_size).to(labels.dtype)
        n_pos = (labels * present).sum(1, keepdim=True)
        n_valid = present.sum(1, keepdim=True)
        n_neg = n_valid - n_pos
        own_count = torch.where(labels == 1, n_pos, n_neg).clamp(min=1)
        mixed = (n_pos > 0) & (n_neg > 0)
        weights = torch.where(mixed, n_valid / (2.0 * own_count), torch.ones_like(labels)).reshape(-1)
    return weights if valid is None else weights * valid.to(weights.dtype)


def group_advantage(score: torch.Tensor, group_size: int, advantage: str) -> torch.Tensor:
    """(B,) psi from (B,) scores, within contiguous groups of group_size."""
    if advantage == "naive":
        return score
    grouped = score.reshape(-1, group_size)
    if advantage == "rloo":
        others_mean = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - others_mean).reshape(-1)
    centred = grouped - grouped.mean(1, keepdim=True)
    return (centred / (grouped.std(1, keepdim=True) + GRPO_STD_EPS)).reshape(-1)


def score_gradient(bce_slope: torch.Tensor, score: torch.Tensor, group_size: int, advantage: str) -> torch.Tensor:
    """(B,) dloss/dr from dloss/dpsi (``bce_slope``) through the group advantage psi(r): J^T slope.

    rloo: psi = r - (S - r)/(G-1) is linear with a symmetric Jacobian, so J^T g is rloo(g).
    grpo: psi_i = (r_i - mean r)/s, s = std(r) + eps, std unbiased; d std/d r_j = (r_j - mean r)/((G-1) std),
    so (J^T g)_j = (g_j - mean g)/s - (r_j - mean r) * sum_i g_i (r_i - mean r) / ((G-1) std s^2), the
    second term 0 where std = 0 (every r equal: r - mean r = 0)."""
    if advantage != "grpo":
        return group_advantage(bce_slope, group_size, advantage)
    g, r = bce_slope.reshape(-1, group_size), score.reshape(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    std = r.std(1, keepdim=True)
    s = std + GRPO_STD_EPS
    safe_std = torch.where(std > 0, std, torch.ones_like(std))
    along = (g * centred).sum(1, keepdim=True) / ((group_size - 1) * safe_std * s * s)
    return ((g - g.mean(1, keepdim=True)) / s - centred * along).reshape(-1)


def bce_with_logits(psi: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-element softplus(psi) - labels * psi (BCEWithLogitsLoss, reduction='none')."""
    return torch.nn.functional.softplus(psi) - labels * psi


def response_sums(values: torch.Tensor, mask: torch.Tensor, layout: ResponseLayout) -> torch.Tensor:
    """(B,) sum of ``values`` over each response's masked tokens (differentiable)."""
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if not layout.packed:
        return masked.sum(-1)
    sums = torch.zeros(layout.n_responses, dtype=values.dtype, device=values.device)
    return sums.index_add(0, layout.segment_ids(), masked)


def pacs_group_loss(logp, old_logp, mask, counts, rewards, layout, *, group_size, beta, score, advantage,
                    weighting, score_function_term, valid=None, n_total=None):
    """The loss on one layout; ``n_total``: the B to divide by when this is a share of a larger batch."""
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    sum_logp = response_sums(logp.to(cdt), mask, layout)
    rewards = rewards.to(cdt)
    if score == "log_ratio":
        sum_old = response_sums(old_logp.detach().to(cdt), mask, layout)
        proxy = beta * (sum_logp - sum_old)
    else:
        proxy = beta * sum_logp / counts.to(cdt).clamp(min=1)  # an empty response: score 0, as its log-ratio sum
    psi = group_advantage(proxy, group_size, advantage)
    weights = class_weights(rewards, group_size, weighting, valid)
    bce = bce_with_logits(psi, rewards)
    n = layout.n_responses if n_total is None else n_total
    loss = (weights * bce).sum() / n
    if score_function_term:
        # Eq. 6's l[j] * grad log pi(o_j): a surrogate whose value is exactly 0 and whose
        # gradient is m[j,t] * w[j] * l[j] / B.
        surrogate = (sum_logp * (weights * bce).detach()).sum() / n
        loss = loss + (surrogate - surrogate.detach())
    return loss, (proxy.detach(), psi.detach(), weights, bce.detach())


# ----------------------------------------------------------------------------- triton path


def _group_loss_module():
    from ..logprobs import _triton_module

    _triton_module()  # raises the ValueError that explains a missing triton
    from ..triton import group_loss

    return group_loss


class _TritonGroupLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, mask, offsets, rewards, options):
        kernels = _group_loss_module()
        loss, per_response = kernels.group_loss_forward(logp, old_logp, mask, offsets, rewards, **options)
        ctx.save_for_backward(per_response[4], mask, offsets)
        ctx.n_tokens, ctx.max_len, ctx.dtype = logp.shape[0], options["max_len"], logp.dtype
        ctx.mark_non_differentiable(per_response)
        return loss, per_response

    @staticmethod
    def backward(ctx, grad_loss, _grad_per_response):
        coef, mask, offsets = ctx.saved_tensors
        grad = _group_loss_module().group_loss_backward(
            grad_loss.reshape(1).float().contiguous(), coef, mask, offsets, ctx.n_tokens, ctx.max_len)
        return grad.to(ctx.dtype), None, None, None, None, None


def _pacs_triton(logp, old_logp, mask, rewards, layout, *, group_size, beta, score, advantage, weighting,
                 score_function_term, mask_is_full=False):
    flat_logp = logp.reshape(-1).contiguous()
    flat_old = old_logp.detach().reshape(-1).contiguous()
    flat_mask = None if mask_is_full else mask.reshape(-1).contiguous().view(torch.uint8)
    offsets = layout.offsets(logp.device).contiguous()
    options = dict(group_size=group_size, max_len=layout.max_len, beta=beta, score=score,
                   advantage=advantage, weighting=weighting, score_function_term=score_function_term)
    loss, per_response = _TritonGroupLoss.apply(
        flat_logp, flat_old, flat_mask, offsets, rewards.float().contiguous(), options)
    return loss, tuple(per_response[:4])


def resolve_loss_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'triton' on CUDA (not float64) when triton imports, else 'torch'."""
    from ..logprobs import resolve_backend

    return resolve_backend(backend, device, dtype, choices=LOSS_BACKENDS, inputs="logp")


# ----------------------------------------------------------------------------- public API


def compute_stats(loss, per_response, rewards, group_size, *, advantage, valid=None, entropy=None) -> PACSStats:
    """PACSStats from the loss and the per-response (score, psi, weight, bce); entropy (N,) optional."""
    proxy, psi, weights, _ = (t.double() for t in per_response)
    labels = rewards.double().reshape(-1, group_size)
    single_groups = (labels == labels[:, :1]).all(1)
    single = single_groups.double().mean()
    sig = torch.sigmoid(psi)
    correct = rewards.double().reshape(-1) == 1
    nan = torch.full((), float("nan"), dtype=torch.float64, device=sig.device)
    squared = score_gradient(weights * (sig - rewards.double().reshape(-1)), proxy, group_size, advantage).square()
    total = squared.sum()
    in_single = squared.reshape(-1, group_size)[single_groups].sum()
    grad_share = torch.where(total > 0, in_single / torch.where(total > 0, total, torch.ones_like(total)), nan)
    values = torch.stack([
        loss.detach().double().reshape(()), psi.mean(), psi.std(unbiased=False), sig.mean(),
        rewards.double().mean(), proxy.mean(), weights.mean(), weights.min(), weights.max(), single,
        sig[correct].mean() if bool(correct.any()) else nan, sig[~correct].mean() if bool((~correct).any()) else nan,
        grad_share,
        entropy.double().mean() if entropy is not None and entropy.numel() else nan,
        valid.double().mean() if valid is not None and valid.numel() else torch.ones_like(nan),
    ]).tolist()
    return PACSStats(*values)


def check_group_inputs(rewards, valid, layout, device, *, group_size, beta, advantage, weighting,
                       score_function_term, group_ids):
    """Checks shared by every PACS entry point -> (rewards as float, valid as bool or None, beta)."""
    check_group_size(group_size, layout.n_responses, advantage)
    if layout.n_responses == 0:
        raise ValueError("the batch must hold at least one group of responses, got B = 0 "
                         "(rewards, logp and mask are empty)")
    beta = check_beta(beta)
    if not isinstance(score_function_term, bool):
        raise TypeError(f"score_function_term must be a bool, got {score_function_term!r}")
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.device != device:
        raise ValueError(f"rewards must be on the device of logp ({device}), got {rewards.device}")
    valid, rewards = check_valid(valid, rewards, layout.n_responses)
    rewards = check_rewards(rewards, layout.n_responses, weighting)
    check_group_ids(group_ids, layout.n_responses, group_size, device)
    return rewards, valid, beta


def pacs_loss_on_layout(logp, old_logp, mask, rewards, layout, *, group_size, beta, score, advantage, weighting,
                        score_function_term, return_stats, group_ids, backend, counts=None, mask_is_full=False,
                        valid=None, entropy=None):
    """Checked options, checked layout; shared by pacs_loss and fused_linear_pacs_loss's two-pass path."""
    rewards, valid, beta = check_group_inputs(
        rewards, valid, layout, logp.device, group_size=group_size, beta=beta, advantage=advantage,
        weighting=weighting, score_function_term=score_function_term, group_ids=group_ids)
    if score == "mean_logp":
        counts = response_token_counts(mask, layout) if counts is None else counts
    backend = resolve_loss_backend(backend, logp.device, logp.dtype)
    options = dict(group_size=group_size, beta=beta, score=score, advantage=advantage, weighting=weighting,
                   score_function_term=score_function_term)
    if backend == "triton" and valid is None:  # the Triton group kernel has no validity mask
        loss, per_response = _pacs_triton(logp, old_logp, mask, rewards, layout, mask_is_full=mask_is_full,
                                          **options)
    else:
        loss, per_response = pacs_group_loss(logp, old_logp, mask, counts, rewards, layout, valid=valid, **options)
    if return_stats:
        return loss, compute_stats(loss, per_response, rewards, group_size, advantage=advantage, valid=valid,
                                   entropy=entropy)
    return loss


def pacs_loss(
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
    score_function_term: bool = False,
    return_stats: bool = False,
    group_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    valid: torch.Tensor | None = None,
):
    """The PACS loss (BCE of the group-relative score against the 0/1 reward) from per-token log-probs.

    Args:
        logp: (B, T) float, differentiable: the policy's log-prob of each sampled token.
            Packed layout: (N,) or (1, N) with ``cu_seqlens``.
        old_logp: like logp, the rollout policy's log-probs (treated as a constant: detached).
        rewards: (B,) 0/1 labels (bool/int/float; any value in [0, 1] with weighting="none").
            Each group's ``group_size`` responses are contiguous.
        mask: like logp, bool/int/float 0/1, 1 on response tokens. Always applied (the public
            code's one deliberate difference): padding and prompt tokens never enter the loss.
        group_size: G, responses per prompt (>= 2 for "rloo"/"grpo").
        beta: scale of the score.
        score: "log_ratio" (beta * sum of masked log-ratios) | "mean_logp" (beta * mean masked logp).
        advantage: "rloo" | "grpo" (std unbiased, + 1e-6) | "naive".
        weighting: "balanced" (sklearn's balanced class weights per group) | "none" |
            "positive_only" | "negative_only".
        score_function_term: add the paper's Eq. 6 term: dloss/dlogp[j,t] += m[j,t] w[j] l[j] / B
            (l the detached per-response BCE). The returned loss VALUE is unchanged.
        return_stats: also return a :class:`PACSStats` (costs one device sync).
        group_ids: optional (B,) int group id of each response, checked for contiguous whole groups.
        cu_seqlens: optional (B + 1,) int response offsets: selects the packed layout.
        backend: "auto" (triton on CUDA, torch otherwise) | "triton" | "torch".
        valid: optional (B,) bool: False marks a response that must not count (e.g. its reward
            function returned None; its reward may then be NaN). It contributes no loss term and
            is left out of its group's class counts; its score still enters the group's baseline
            (the score does not depend on the label). The loss is still divided by B.

    Returns:
        0-d loss (float32; float64 for float64 logp on the torch path), or ``(loss, PACSStats)``.
        Differentiable with respect to logp only. On the "grpo" advantage, where a group's scores
        are all equal (std 0), the std's own gradient is taken as 0 (as torch.std does).
    """
    check_options(score, advantage, weighting)
    logp, old_logp, mask, layout = check_token_tensors(logp, old_logp, mask, cu_seqlens)
    return pacs_loss_on_layout(
        logp, old_logp, mask, rewards, layout, group_size=group_size, beta=beta, score=score,
        advantage=advantage, weighting=weighting, score_function_term=score_function_term,
        return_stats=return_stats, group_ids=group_ids, backend=backend, valid=valid)
