"""fused_linear_pacs_loss() and PACSLoss: hidden states + LM head -> PACS loss, never holding logits.

Only the response tokens (mask == 1) matter to the loss, so only their rows of ``hidden`` are
gathered and sent to ``linear_logprobs`` (one call); prompt and padding tokens cost nothing.
The selected tokens stay in order, so they form a packed layout whose response offsets are the
running sum of each response's token count; the group loss runs on that layout directly and the
per-response sums need no (B, T) padding. The backward of the gather scatters the hidden-state
gradient back to the selected rows (zeros elsewhere); the LM-head gradient arrives once per call,
so a tied input/output embedding simply receives the sum of both uses through autograd.

Layouts:
    padded: hidden (B, T, d); targets, mask, old_logp (B, T).
    packed: hidden (N, d) or (1, N, d); targets, mask, old_logp (N,) or (1, N);
            cu_seqlens (B + 1,) int: response i owns tokens cu_seqlens[i]:cu_seqlens[i+1].
"""

from __future__ import annotations

import torch
from torch import nn

from .checks import FLOAT_DTYPES, INT_DTYPES, check_choice, check_same_device, check_temperature, check_tensor
from .known_grad import linear_logprobs_known_grad
from .logprobs import linear_logprobs
from .loss import _pacs_on_layout
from .loss_inputs import (
    MASK_DTYPES,
    ResponseLayout,
    check_beta,
    check_cu_seqlens,
    check_group_size,
    check_mask_values,
    check_options,
)

FUSED_BACKENDS = ("auto", "triton", "torch", "naive")


def _check_fused_tensors(hidden, targets, mask, old_logp, cu_seqlens):
    """-> (hidden (N, d), targets (N,), mask bool (N,), old_logp (N,), counts (B,) int64, B)."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    check_tensor("targets", targets, dtypes=INT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    check_tensor("old_logp", old_logp, dtypes=FLOAT_DTYPES)
    if cu_seqlens is None:
        if hidden.dim() != 3:
            raise ValueError(
                "hidden must be (B, T, d) in the padded layout (or pass cu_seqlens for the packed "
                f"layout with hidden (N, d)), got shape {tuple(hidden.shape)}")
    elif not (hidden.dim() == 2 or (hidden.dim() == 3 and hidden.shape[0] == 1)):
        raise ValueError(
            f"with cu_seqlens (packed layout) hidden must be (N, d) or (1, N, d), got shape {tuple(hidden.shape)}")
    token_shape = tuple(hidden.shape[:-1])
    for name, value in (("targets", targets), ("mask", mask), ("old_logp", old_logp)):
        if tuple(value.shape) != token_shape:
            raise ValueError(f"{name} must have shape hidden.shape[:-1] = {token_shape}, got {tuple(value.shape)}")
    check_same_device(hidden=hidden, targets=targets, mask=mask, old_logp=old_logp, cu_seqlens=cu_seqlens)
    mask = check_mask_values(mask)
    width = hidden.shape[-1]
    if cu_seqlens is None:
        counts = mask.sum(-1)
        n_responses = hidden.shape[0]
    else:
        cu, _ = check_cu_seqlens(cu_seqlens, hidden.numel() // max(width, 1))
        n_responses = cu.shape[0] - 1
        segment = ResponseLayout(n_responses, None, cu, 0).segment_ids()
        counts = torch.zeros(n_responses, dtype=torch.int64, device=hidden.device)
        counts.index_add_(0, segment, mask.reshape(-1).to(torch.int64))
    return (hidden.reshape(-1, width), targets.reshape(-1), mask.reshape(-1), old_logp.reshape(-1),
            counts, n_responses)


def selected_index(mask: torch.Tensor) -> torch.Tensor | None:
    """Indices of the mask == 1 tokens of a bool (N,) mask, or None when every token is selected."""
    return None if bool(mask.all()) else mask.nonzero().squeeze(1)


def selected_logprobs(hidden, weight, targets, mask, *, temperature, bias, backend, logprob_options):
    """Log-probs of the mask == 1 tokens only: (hidden (N, d), targets (N,), mask bool (N,)) ->
    (logp (N_sel,) float32, selected token indices (N_sel,) int64, or None when every token is
    selected: then hidden is used as it is, without a copy)."""
    options = {k: v for k, v in logprob_options.items() if v is not None}
    index = selected_index(mask)
    if index is None:
        logp = linear_logprobs(hidden, weight, targets, temperature=temperature, bias=bias, backend=backend,
                               **options)
        return logp, None
    logp = linear_logprobs(
        hidden.index_select(0, index), weight, targets.index_select(0, index), temperature=temperature,
        bias=bias, backend=backend, **options)
    return logp, index


def fused_linear_pacs_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    rewards: torch.Tensor,
    *,
    group_size: int,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    beta: float = 1.0,
    score: str = "log_ratio",
    advantage: str = "rloo",
    weighting: str = "balanced",
    score_function_term: bool = False,
    return_stats: bool = False,
    group_ids: torch.Tensor | None = None,
    backend: str = "auto",
    filter_eps: float | None = None,
    chunk_elements: int | None = None,
    vocab_splits: int | None = None,
    old_lse: torch.Tensor | None = None,
):
    """PACS loss straight from final hidden states and the LM head (``linear_logprobs`` + ``pacs_loss``).

    Args:
        hidden: (B, T, d) padded, or (N, d) / (1, N, d) packed with ``cu_seqlens``; the backbone's
            final hidden states (after the last norm), float16/bfloat16/float32.
        weight: (V, d) LM-head weight, hidden's dtype (may be the tied input embedding).
        targets: (B, T) / (N,) int: the sampled token at each position (any value where mask == 0).
        mask: (B, T) / (N,) 0/1 (bool/int/float): 1 on response tokens. Log-probs are computed
            only there.
        old_logp: (B, T) / (N,) the rollout policy's log-probs (constant).
        rewards: (B,) 0/1 labels, each group's ``group_size`` responses contiguous.
        group_size, beta, score, advantage, weighting, score_function_term, return_stats,
            group_ids: as in :func:`pacs_loss`.
        temperature: the sampling temperature (logits are divided by it).
        bias: optional (V,) LM-head bias.
        cu_seqlens: (B + 1,) int response offsets for the packed layout.
        backend: "auto" | "triton" | "torch" | "naive" for the log-probs; the group loss uses
            triton for "triton" (and "auto" on CUDA), torch otherwise.
        filter_eps, chunk_elements, vocab_splits: passed to ``linear_logprobs``.
        old_lse: optional, same shape as old_logp: the log-sum-exp from the old-policy pass
            (``linear_logprobs(..., return_lse=True)``). Pass it ONLY while the weights are still
            those that produced old_logp (the first optimizer step after a rollout): then logp ==
            old_logp, the per-token gradient is known before the forward, and one sweep over the
            vocabulary (3 matmuls instead of 4) gives the loss and its gradients
            (``linear_logprobs_known_grad``). A stale old_lse is detected (the recomputed log-probs
            differ from old_logp) and raises a ValueError.

    Returns:
        0-d float32 loss (or ``(loss, PACSStats)``), differentiable in hidden, weight and bias.
    """
    check_options(score, advantage, weighting)
    check_choice("backend", backend, FUSED_BACKENDS)
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    hidden_2d, targets_1d, mask_1d, old_1d, counts, n_responses = _check_fused_tensors(
        hidden, targets, mask, old_logp, cu_seqlens)
    # cheap checks first, before the log-prob pass
    check_group_size(group_size, n_responses, advantage)
    if rewards.dim() != 1 or rewards.shape[0] != n_responses:
        raise ValueError(f"rewards must have shape (B,) = ({n_responses},), got {tuple(rewards.shape)}")
    offsets = torch.zeros(n_responses + 1, dtype=torch.int64, device=hidden.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    layout = ResponseLayout(n_responses, None, offsets, int(counts.max()) if n_responses else 0)
    loss_options = dict(group_size=group_size, beta=beta, score=score, advantage=advantage, weighting=weighting,
                        score_function_term=score_function_term, return_stats=return_stats, group_ids=group_ids,
                        backend="torch" if backend == "naive" else backend, counts=counts, mask_is_full=True)
    if old_lse is not None:
        return _first_step_after_rollout(hidden_2d, weight, targets_1d, mask_1d, old_1d, old_lse, rewards, layout,
                                         temperature=temperature, bias=bias, logprob_backend=backend,
                                         **loss_options)
    logp, index = selected_logprobs(
        hidden_2d, weight, targets_1d, mask_1d, temperature=temperature, bias=bias, backend=backend,
        logprob_options=dict(filter_eps=filter_eps, chunk_elements=chunk_elements, vocab_splits=vocab_splits))
    old_selected = old_1d if index is None else old_1d.index_select(0, index)
    full_mask = torch.ones_like(logp, dtype=torch.bool)
    return _pacs_on_layout(logp, old_selected, full_mask, rewards, layout, **loss_options)


def _first_step_after_rollout(hidden, weight, targets, mask, old_logp, old_lse, rewards, layout, *, temperature,
                              bias, logprob_backend, **loss_options):
    """The loss and its exact gradient in one vocabulary sweep, while logp == old_logp.

    The loss is a function of the log-probs alone, so its value and its per-token gradient g
    follow from pacs_loss at logp = old_logp; the sweep then rebuilds each logits tile once and
    forms dh, dW from g and old_lse (known_grad.py). The returned tensor has the loss's value and
    the sweep's gradients: loss + (surrogate - surrogate.detach()).
    """
    check_tensor("old_lse", old_lse, dtypes=FLOAT_DTYPES)
    if old_lse.numel() != old_logp.numel():
        raise ValueError(f"old_lse must have the shape of old_logp ({old_logp.numel()} entries), "
                         f"got shape {tuple(old_lse.shape)}")
    if logprob_backend == "naive":
        raise ValueError("old_lse (the one-sweep first step) needs backend 'auto', 'torch' or 'triton', got 'naive'")
    index = selected_index(mask)
    pick = (lambda t: t) if index is None else (lambda t: t.index_select(0, index))
    old_selected = pick(old_logp).detach()
    at_old = old_selected.float().clone().requires_grad_()
    full_mask = torch.ones_like(at_old, dtype=torch.bool)
    with torch.enable_grad():
        result = _pacs_on_layout(at_old, old_selected, full_mask, rewards, layout, **loss_options)
        loss = result[0] if isinstance(result, tuple) else result
        (grad_logp,) = torch.autograd.grad(loss, at_old)
    surrogate, logp = linear_logprobs_known_grad(
        pick(hidden), weight, pick(targets), grad_logp, pick(old_lse.reshape(-1)), temperature=temperature,
        bias=bias, backend=logprob_backend)
    drift = (logp - old_selected.float()).abs().max().item() if logp.numel() else 0.0
    if not drift <= 1e-3 * (1.0 + old_selected.abs().max().item()):
        raise ValueError(
            f"old_lse does not belong to these weights: the recomputed log-probs differ from old_logp by up to "
            f"{drift:.3g}. Pass old_lse only on the first optimizer step after the rollout that produced it.")
    total = loss.detach() + (surrogate - surrogate.detach())
    return (total, result[1]) if isinstance(result, tuple) else total


class PACSLoss(nn.Module):
    """The PACS loss as a module, configured once; forward takes hidden states and the LM head.

    Example::

        loss_fn = PACSLoss(group_size=8, beta=1.0, temperature=1.0)
        loss = loss_fn(hidden, model.lm_head.weight, targets, mask, old_logp, rewards)
    """

    def __init__(
        self,
        group_size: int,
        *,
        beta: float = 1.0,
        score: str = "log_ratio",
        advantage: str = "rloo",
        weighting: str = "balanced",
        temperature: float = 1.0,
        score_function_term: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_options(score, advantage, weighting)
        check_choice("backend", backend, FUSED_BACKENDS)
        check_group_size(group_size, group_size, advantage)
        beta = check_beta(beta)
        temperature = check_temperature(temperature)
        if not isinstance(score_function_term, bool):
            raise TypeError(f"score_function_term must be a bool, got {score_function_term!r}")
        self.group_size, self.beta, self.temperature = group_size, beta, temperature
        self.score, self.advantage, self.weighting = score, advantage, weighting
        self.score_function_term, self.backend = score_function_term, backend

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        return_stats: bool = False,
        group_ids: torch.Tensor | None = None,
        old_lse: torch.Tensor | None = None,
    ):
        """Arguments as in :func:`fused_linear_pacs_loss` (``old_lse``: the one-sweep first step)."""
        return fused_linear_pacs_loss(
            hidden, lm_head_weight, targets, mask, old_logp, rewards, group_size=self.group_size,
            temperature=self.temperature, bias=bias, cu_seqlens=cu_seqlens, beta=self.beta, score=self.score,
            advantage=self.advantage, weighting=self.weighting, score_function_term=self.score_function_term,
            return_stats=return_stats, group_ids=group_ids, backend=self.backend, old_lse=old_lse)

    def extra_repr(self) -> str:
        return (f"group_size={self.group_size}, beta={self.beta}, score={self.score!r}, "
                f"advantage={self.advantage!r}, weighting={self.weighting!r}, temperature={self.temperature}, "
                f"score_function_term={self.score_function_term}, backend={self.backend!r}")
