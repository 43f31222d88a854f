"""fused_linear_pacs_loss() and PACSLoss: hidden states + LM head -> PACS loss, never holding N x V logits.

Three ways to run it, picked per call (``path="auto"``) and reported in the stats:

* ``single_pass`` (single_pass.py): chunks of WHOLE groups, each chunk's logits built once: the
  log-probs, the group loss, its per-token gradient and dh, dW all come from that one tile
  (3 N x V x d matmuls, like the naive implementation). Used when every group fits the chunk
  budget (``chunk_budget_mib``), and, wherever the two passes would not run the Triton log-prob
  kernels (CPU, backend="torch", float32 on CUDA, a logit soft-cap), also for groups bigger than the budget: their
  logits are kept in part and the rest rebuilt (3 to 4 matmuls, memory within the budget).
* ``two_pass``: ``linear_logprobs`` (Triton on CUDA, chunked torch elsewhere) for the log-probs,
  the group loss on them, then the log-prob backward rebuilds the logits (4 matmuls). Memory does
  not depend on group size: with the Triton log-prob kernels (CUDA, 16-bit weights), the path for
  groups too long for the budget (long responses).
* ``one_sweep`` (known_grad.py): the first optimizer step after a rollout, with ``old_lse`` from
  the old-policy pass; logp == old_logp so the gradient is known up front (3 matmuls).

``old_logp=None`` means on-policy: the old log-probs are the current ones, detached (what TRL's
GRPOTrainer does with ``num_iterations=1``); every path handles it (the log-ratio score is then 0 with
a non-zero gradient).

Dtype policy, whatever autocast region the caller is in: hidden is cast to the LM head's dtype;
the GEMMs run in that dtype (tensor cores for bf16/fp16 on CUDA), logits, softmax and gradient
accumulation in float32 (float64 for float64 inputs); gradients return in the inputs' dtypes.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace

import torch
from torch import nn

from .checks import check_choice, check_linear_inputs, check_targets_in_range, check_temperature
from .known_grad import linear_logprobs_known_grad
from .logprobs import check_softcap, linear_logprobs, resolve_backend
from .loss import _pacs_on_layout, _pacs_torch, check_group_inputs, compute_stats
from .loss_inputs import (
    ResponseLayout,
    check_beta,
    check_group_size,
    check_nonempty_responses,
    check_options,
)
from .path_choice import PathQuery, choose_path, measured_rebuild_faster, measured_two_pass_faster  # noqa: F401
from .single_pass import (
    plan_group_chunks,
    recomputed_fraction,
    single_pass,
    tile_memory,
)
from .token_selection import check_response_tokens, match_head_dtype, pick, selected_index

FUSED_BACKENDS = ("auto", "triton", "torch", "naive")
PATHS = ("auto", "single_pass", "two_pass")
logger = logging.getLogger("pacs_kernels")


def check_chunk_budget(chunk_budget_mib) -> float | None:
    """A finite number of MiB > 0, or None (the device's default: single_pass.default_chunk_budget_mib)."""
    if chunk_budget_mib is None:
        return None
    if isinstance(chunk_budget_mib, bool) or not isinstance(chunk_budget_mib, (int, float)) \
            or not chunk_budget_mib > 0 or chunk_budget_mib == float("inf"):
        raise ValueError(f"chunk_budget_mib must be a finite number of MiB > 0 or None, got {chunk_budget_mib!r}")
    return float(chunk_budget_mib)


def fused_linear_pacs_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None,
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
    with_entropy: bool = False,
    group_ids: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    backend: str = "auto",
    path: str = "auto",
    chunk_budget_mib: float | None = None,
    filter_eps: float | None = None,
    chunk_elements: int | None = None,
    vocab_splits: int | None = None,
    old_lse: torch.Tensor | None = None,
    logit_softcap: float | None = None,
):
    """PACS loss straight from final hidden states and the LM head.

    Args:
        hidden: (B, T, d) padded, or (N, d) / (1, N, d) packed with ``cu_seqlens``; the backbone's
            final hidden states (after the last norm). Cast to weight's dtype if it differs.
        weight: (V, d) LM-head weight (may be the tied input embedding).
        targets: (B, T) / (N,) int: the sampled token at each position (any valid id where mask == 0).
        mask: (B, T) / (N,) 0/1 (bool/int/float): 1 on response tokens. Log-probs are computed
            only there.
        old_logp: (B, T) / (N,) the rollout policy's log-probs (constant), or None: on-policy
            (the current log-probs, detached).
        rewards: (B,) 0/1 labels, each group's ``group_size`` responses contiguous.
        group_size, beta, score, advantage, weighting, score_function_term, return_stats,
            group_ids, valid: as in :func:`pacs_loss`.
        with_entropy: with return_stats, also report the policy's mean token entropy.
        temperature: the sampling temperature (logits are divided by it).
        bias: optional (V,) LM-head bias.
        cu_seqlens: (B + 1,) int response offsets for the packed layout.
        backend: "auto" | "triton" | "torch" | "naive": the kernels of the two-pass path and of
            ``old_lse``'s one sweep, and the single pass's elementwise work (Triton row kernels or
            eager PyTorch around cuBLAS GEMMs); "naive" materializes the logits (tests, benchmarks).
        path: "auto" (the path of least time by a cost model calibrated on this device, path_choice.py:
            the single pass when the groups fit, on the CPU with an unset budget raised to hold them;
            two passes for groups bigger than the budget where they run the Triton log-prob kernels
            (CUDA, 16-bit weights, no soft-cap) unless the committed GPU run measured the rebuilding
            single pass faster, and on CUDA where that run measured two passes faster: dispatch.py)
            | "single_pass" (a group bigger than the budget keeps part of its logits and rebuilds
            the rest) | "two_pass".
        chunk_budget_mib: working memory of the single pass's logits (single_pass.tile_memory: on
            a GPU with the Triton row kernels 2 bytes per logit plus a float32 GEMM strip of 1/4 of
            the budget, about 5,300 tokens per 2 GiB at V = 152k; eager rows hold float32 logits, plus
            a bf16 dz copy on CUDA); None (default): 256 MiB on the CPU, 2 GiB on CUDA (a GPU chunk
            needs enough tokens to keep its GEMMs compute-bound); with path="auto" on the CPU, raised
            up to 1/8 of the memory where holding whole groups is faster. A smaller budget trades speed for
            memory only when a group no longer fits.
        filter_eps, chunk_elements, vocab_splits: the two-pass path's ``linear_logprobs`` options.
        old_lse: optional, like old_logp: the log-sum-exp from the old-policy pass
            (``linear_logprobs(..., return_lse=True)``). Pass it ONLY while the weights are still
            those that produced old_logp (the first optimizer step after a rollout): then one sweep
            over the vocabulary gives the loss and its gradients. A stale old_lse whose recomputed
            log-probs differ from old_logp by more than rounding (``stale_lse_tolerance``; coarse in
            16 bits) gives a RuntimeWarning and the usual path's exact result.
        logit_softcap: optional c > 0, Gemma-style soft-capping of the logits (``c * tanh(z / c)``,
            before the temperature), on every path (the single pass's Triton row kernels apply it;
            the two-pass and one-sweep paths then use the torch backend: the Triton log-prob kernels
            have no soft-cap).

    Returns:
        0-d float32 loss (or ``(loss, PACSStats)``), differentiable in hidden, weight and bias.
        Its gradients are computed in this call on the single-pass and one-sweep paths; a second
        backward needs ``retain_graph=True`` on the first, as anywhere in autograd.
    """
    check_options(score, advantage, weighting)
    check_choice("backend", backend, FUSED_BACKENDS)
    check_choice("path", path, PATHS)
    chunk_budget_mib = check_chunk_budget(chunk_budget_mib)
    if not isinstance(with_entropy, bool):
        raise TypeError(f"with_entropy must be a bool, got {with_entropy!r}")
    hidden = match_head_dtype(hidden, weight)
    tokens = check_response_tokens(hidden, targets, mask, old_logp, cu_seqlens)
    check_linear_inputs(tokens.hidden, weight, tokens.targets, bias)
    temperature = check_temperature(temperature)
    logit_softcap = check_softcap(logit_softcap)
    layout = tokens.selected_layout()
    rewards, valid, beta = check_group_inputs(
        rewards, valid, layout, tokens.hidden.device, group_size=group_size, beta=beta, advantage=advantage,
        weighting=weighting, score_function_term=score_function_term, group_ids=group_ids)
    if score == "mean_logp":
        check_nonempty_responses(tokens.counts, "score='mean_logp' (it divides by the response length)")
    options = dict(group_size=group_size, beta=beta, score=score, advantage=advantage, weighting=weighting,
                   score_function_term=score_function_term)
    n_selected = int(layout.cu_seqlens[-1])  # response tokens (one device sync)
    rebuilt = 0.0  # share of the logits the single pass builds twice (groups bigger than the budget)

    if old_lse is not None:
        if old_logp is None:
            raise ValueError("old_lse goes with the old_logp it was computed with; got old_lse with old_logp=None")
        chosen = "one_sweep"
        result = _first_step_after_rollout(tokens, weight, old_lse, rewards, valid, layout, temperature=temperature,
                                           bias=bias, backend=backend, return_stats=return_stats,
                                           softcap=logit_softcap, **options)
    if old_lse is None or result is None:  # the usual paths (also for an old_lse from other weights)
        chunks = None
        triton_two_pass = two_pass_runs_triton(backend, weight.device, weight.dtype, softcap=logit_softcap is not None)
        row_kernels = row_kernels_for(backend, weight)
        # auto: the path (and an unset budget) of least modelled time on this device (path_choice.py)
        choice = None if path != "auto" or backend == "naive" else choose_path(PathQuery(
            weight.device, weight.dtype, weight.shape[1], weight.shape[0], tuple(tokens.counts.tolist()), group_size,
            chunk_budget_mib, logit_softcap is not None, triton_two_pass, row_kernels))
        if path == "single_pass" and backend != "naive" or choice is not None and choice.path == "single_pass":
            budget_mib = chunk_budget_mib if choice is None else choice.budget_mib
            memory = tile_memory(budget_mib, weight.shape[0], weight.device, weight.dtype,
                                 softcap=logit_softcap is not None, row_kernels=row_kernels)
            budget_tokens = memory.tokens
            # a group bigger than the budget keeps what fits and rebuilds the rest (3 to 4 matmuls)
            chunks = plan_group_chunks(tokens.counts.tolist(), group_size, budget_tokens, oversized_alone=True)
            rebuilt = recomputed_fraction(chunks, budget_tokens)
        elif path == "single_pass":
            raise ValueError("path='single_pass' has no naive backend; use backend='auto', 'torch' or 'triton'")
        if chunks is not None:
            chosen = "single_pass"
            result = _single_pass_loss(tokens, weight, chunks, rewards, valid, temperature=temperature, bias=bias,
                                       return_stats=return_stats, with_entropy=with_entropy, row_kernels=row_kernels,
                                       softcap=logit_softcap, budget_tokens=budget_tokens, memory=memory, **options)
        else:
            chosen = "two_pass"
            result = _two_pass_loss(tokens, weight, rewards, valid, layout, temperature=temperature, bias=bias,
                                    backend=backend, return_stats=return_stats, with_entropy=with_entropy,
                                    logprob_options=dict(filter_eps=filter_eps, chunk_elements=chunk_elements,
                                                         vocab_splits=vocab_splits, logit_softcap=logit_softcap),
                                    **options)
    logger.debug("fused_linear_pacs_loss: %s path, B=%d, %d response tokens%s", chosen, tokens.n_responses,
                 n_selected, f", {rebuilt:.0%} of the logits built twice (groups bigger than the budget)"
                 if rebuilt else "")
    if return_stats:
        loss, stats = result
        return loss, replace(stats, path=chosen)
    return result


def logprob_drift(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """How far the one sweep's log-probs sit from old_logp: the largest |logp - old| / (1 + |old|), each token
    against its own scale, so that a likely token's drift is not hidden by a rare one's (0-d float32; 0 for
    no tokens). Compared with :func:`stale_lse_tolerance`."""
    if not logp.numel():
        return logp.new_zeros((), dtype=torch.float32)
    old32 = old_logp.float()
    return ((logp - old32).abs() / (1.0 + old32.abs())).max()


def stale_lse_tolerance(dtype: torch.dtype) -> float:
    """How far (each token relative to 1 + |old_logp|) the one sweep's log-probs may sit from old_logp and
    still count as the same weights. Two forward passes over the same weights agree to float32 rounding in
    float32; in 16 bits a different batch composition (another GEMM tiling, other attention kernels)
    rounds every layer's output differently, and log-probs of one weight state differ by 1e-2 and more,
    so there the check catches only large moves: an optimizer step's few hundredths go unseen (pass
    old_lse only on the first step after the rollout)."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


def two_pass_runs_triton(backend: str, device: torch.device, dtype: torch.dtype, *, softcap: bool = False) -> bool:
    """Would the two-pass path's log-prob matmuls run the Triton kernels? (On CUDA for 16-bit
    weights; float32 goes to cuBLAS under "auto", and then the rebuilding single pass is the better
    way to handle a group larger than the chunk budget. Never with a soft-cap: the Triton log-prob
    kernels have none, so the two passes would run eager PyTorch, or refuse backend="triton", where
    the single pass's row kernels apply the cap.)"""
    return not softcap and resolve_backend(backend, device, dtype, matmul_kernels=True) == "triton"


def row_kernels_for(backend: str, weight: torch.Tensor) -> str:
    """The single pass's elementwise work: Triton row kernels where the backend resolves to Triton
    (CUDA, or the interpreter when asked for explicitly), eager PyTorch otherwise."""
    resolved = resolve_backend(backend, weight.device, weight.dtype)
    return "triton" if resolved == "triton" and weight.dtype != torch.float64 else "torch"


def _single_pass_loss(tokens, weight, chunks, rewards, valid, *, temperature, bias, return_stats, with_entropy,
                      row_kernels, softcap, budget_tokens, memory, **options):
    """PACS over chunks of whole groups, one logits GEMM per chunk (single_pass.py)."""
    index = selected_index(tokens.mask)
    old_selected = pick(tokens.old_logp, index)
    targets = pick(tokens.targets, index)
    check_targets_in_range(targets, weight.shape[0])
    n_total = tokens.n_responses
    counts = tokens.counts

    def chunk_loss(logp, chunk):
        r0, r1 = chunk.r0, chunk.r1
        old = logp.detach() if old_selected is None else old_selected[chunk.tok0:chunk.tok1].detach()
        full = torch.ones_like(logp, dtype=torch.bool)
        return _pacs_torch(logp, old, full, counts[r0:r1], rewards[r0:r1], ResponseLayout.from_counts(counts[r0:r1]),
                           valid=None if valid is None else valid[r0:r1], n_total=n_total, **options)

    loss, extras, _, entropy = single_pass(
        pick(tokens.hidden, index), weight, targets, bias=bias, temperature=temperature, chunks=chunks,
        chunk_loss=chunk_loss, with_entropy=with_entropy and return_stats, row_kernels=row_kernels, softcap=softcap,
        budget_tokens=budget_tokens, strip_rows=memory.strip_rows, tile_dtype=memory.tile_dtype)
    loss = loss.float() if loss.dtype != torch.float64 else loss
    if not return_stats:
        return loss
    per_response = tuple(torch.cat([extra[k] for extra in extras]) for k in range(4))
    return loss, compute_stats(loss, per_response, rewards, options["group_size"], advantage=options["advantage"],
                                valid=valid, entropy=entropy)


def _two_pass_loss(tokens, weight, rewards, valid, layout, *, temperature, bias, backend, return_stats, with_entropy,
                   logprob_options, **options):
    """linear_logprobs on the selected tokens, then the group loss on their packed layout."""
    index = selected_index(tokens.mask)
    want_entropy = with_entropy and return_stats
    out = linear_logprobs(
        pick(tokens.hidden, index), weight, pick(tokens.targets, index), temperature=temperature, bias=bias,
        backend=backend, return_entropy=want_entropy,
        **{k: v for k, v in logprob_options.items() if v is not None})
    logp, entropy = out if want_entropy else (out, None)
    old = logp.detach() if tokens.old_logp is None else pick(tokens.old_logp, index)
    full_mask = torch.ones_like(logp, dtype=torch.bool)
    return _pacs_on_layout(logp, old, full_mask, rewards, layout, return_stats=return_stats, group_ids=None,
                           backend="torch" if backend == "naive" else backend, counts=tokens.counts,
                           mask_is_full=True, valid=valid, entropy=None if entropy is None else entropy.detach(),
                           **options)


def _first_step_after_rollout(tokens, weight, old_lse, rewards, valid, layout, *, temperature, bias, backend,
                              return_stats, softcap, **options):
    """The loss and its exact gradient in one vocabulary sweep, while logp == old_logp (None, after a
    warning, where the sweep's log-probs show that the weights moved since old_lse: the caller then runs
    the usual path).

    The loss is a function of the log-probs alone, so its value and its per-token gradient g
    follow from the group loss at logp = old_logp; the sweep then rebuilds each logits tile once and
    forms dh, dW from g and old_lse (known_grad.py). The returned tensor has the loss's value and
    the sweep's gradients: loss + (surrogate - surrogate.detach()).
    """
    if not isinstance(old_lse, torch.Tensor) or old_lse.numel() != tokens.old_logp.numel():
        raise ValueError(f"old_lse must have the shape of old_logp {tuple(tokens.token_shape)}, got "
                         + (f"shape {tuple(old_lse.shape)}" if isinstance(old_lse, torch.Tensor)
                            else type(old_lse).__name__))
    if backend == "naive":
        raise ValueError("old_lse (the one-sweep first step) needs backend 'auto', 'torch' or 'triton', got 'naive'")
    index = selected_index(tokens.mask)
    old_selected = pick(tokens.old_logp, index).detach()
    at_old = old_selected.float().clone().requires_grad_()
    full_mask = torch.ones_like(at_old, dtype=torch.bool)
    with torch.enable_grad():
        loss, per_response = _pacs_torch(at_old, old_selected, full_mask, tokens.counts, rewards, layout,
                                         valid=valid, **options)
        (grad_logp,) = torch.autograd.grad(loss, at_old)
    surrogate, logp = linear_logprobs_known_grad(
        pick(tokens.hidden, index), weight, pick(tokens.targets, index), grad_logp,
        pick(old_lse.reshape(-1), index), temperature=temperature, bias=bias, backend=backend, logit_softcap=softcap)
    drift = float(logprob_drift(logp, old_selected))
    if not drift <= stale_lse_tolerance(weight.dtype):
        warnings.warn(
            f"old_lse does not belong to these weights: the log-probs recomputed in the one sweep differ from "
            f"old_logp by up to {drift:.3g} x (1 + |old_logp|), more than rounding; the loss was computed on the "
            "usual path instead (exact for these weights). Pass old_lse only on the first optimizer step after "
            "the rollout that produced it.", RuntimeWarning, stacklevel=3)
        return None
    total = loss.detach().float() + (surrogate - surrogate.detach())
    if return_stats:
        return total, compute_stats(total, per_response, rewards, options["group_size"], advantage=options["advantage"],
                                   valid=valid)
    return total


class PACSLoss(nn.Module):
    """The PACS loss as a module, configured once; forward takes hidden states and the LM head.

    Example::

        loss_fn = PACSLoss(group_size=8, beta=1.0, temperature=1.0)
        loss = loss_fn(hidden, model.lm_head.weight, targets, mask, old_logp, rewards)
        loss = loss_fn(hidden, model.lm_head.weight, targets, mask, None, rewards)   # on-policy
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
        path: str = "auto",
        chunk_budget_mib: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        check_options(score, advantage, weighting)
        check_choice("backend", backend, FUSED_BACKENDS)
        check_choice("path", path, PATHS)
        check_group_size(group_size, group_size, advantage)
        beta = check_beta(beta)
        temperature = check_temperature(temperature)
        if not isinstance(score_function_term, bool):
            raise TypeError(f"score_function_term must be a bool, got {score_function_term!r}")
        self.group_size, self.beta, self.temperature = group_size, beta, temperature
        self.score, self.advantage, self.weighting = score, advantage, weighting
        self.score_function_term, self.backend = score_function_term, backend
        self.path, self.chunk_budget_mib = path, check_chunk_budget(chunk_budget_mib)
        self.logit_softcap = check_softcap(logit_softcap)

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
        old_logp: torch.Tensor | None,
        rewards: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        return_stats: bool = False,
        with_entropy: bool = False,
        group_ids: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        old_lse: torch.Tensor | None = None,
    ):
        """Arguments as in :func:`fused_linear_pacs_loss` (``old_logp=None``: on-policy;
        ``old_lse``: the one-sweep first step)."""
        return fused_linear_pacs_loss(
            hidden, lm_head_weight, targets, mask, old_logp, rewards, group_size=self.group_size,
            temperature=self.temperature, bias=bias, cu_seqlens=cu_seqlens, beta=self.beta, score=self.score,
            advantage=self.advantage, weighting=self.weighting, score_function_term=self.score_function_term,
            return_stats=return_stats, with_entropy=with_entropy, group_ids=group_ids, valid=valid,
            backend=self.backend, path=self.path, chunk_budget_mib=self.chunk_budget_mib, old_lse=old_lse,
            logit_softcap=self.logit_softcap)

    def extra_repr(self) -> str:
        return (f"group_size={self.group_size}, beta={self.beta}, score={self.score!r}, "
                f"advantage={self.advantage!r}, weighting={self.weighting!r}, temperature={self.temperature}, "
                f"score_function_term={self.score_function_term}, backend={self.backend!r}, path={self.path!r}, "
                f"chunk_budget_mib={self.chunk_budget_mib}, logit_softcap={self.logit_softcap}")

