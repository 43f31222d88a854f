"""The loss engine: one checked batch, one place that picks the path and the backend, any objective.

Every fused entry (``fused_linear_pacs_loss``, ``fused_linear_grpo_loss``, ``fused_linear_objective_loss``,
``PACSLoss``) builds a :class:`LossBatch` once (layout, tokens, head) and calls one of the ``run_*``
functions here with a :class:`~pacs_kernels.options.LossOptions`. The engine owns:

* the chunking (single_pass.py: chunks of whole groups, or of tokens for per-token losses);
* the path, decided in one function, :func:`choose_path`: ``single_pass`` (each chunk's logits built
  once, the per-token gradient by autograd on the chunk's log-probs, dh and dW from that tile),
  ``two_pass`` (``linear_logprobs`` then its backward), or, for PACS given ``old_lse``, the
  ``one_sweep`` first step (known_grad.py);
* the backend (``LossOptions.backend``) and the GPU dispatch table (dispatch.py, ``LossOptions.dispatch_table``
  / ``grad_gemms``).

Objectives supply only the group loss on per-token log-probs. A plain objective (the ``Objective``
protocol, a user's function included) gets the single pass through :func:`run_objective`: each chunk's
loss is the objective on the whole batch's rows with that chunk's log-probs live and every other
response at a constant filler, minus the objective at the filler; for a loss in which groups interact
only through constants (rewards, mask, counts) these shares add up to the loss and their gradients are
exact. The engine checks the sum against the objective on all the log-probs and refuses (explicit
``path="single_pass"``) or reruns on two passes (``"auto"``) an objective that couples groups through
their log-probs.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace

import torch

from . import path_choice
from .checks import FLOAT_DTYPES, check_linear_inputs, check_no_inf_where, check_targets_in_range, check_tensor
from .grpo import GRPOStats, check_grpo_options, group_normalized_advantages, grpo_token_terms
from .known_grad import linear_logprobs_known_grad
from .logprobs import linear_logprobs, resolve_backend
from .loss import check_group_inputs, compute_stats, pacs_group_loss, pacs_loss_on_layout
from .loss_inputs import ResponseLayout, check_nonempty_responses, check_response_rewards
from .options import LossOptions
from .response_rows import ResponseRows
from .single_pass import (
    Chunk,
    TileMemory,
    plan_group_chunks,
    plan_token_chunks,
    recomputed_fraction,
    single_pass,
    tile_memory,
)
from .token_selection import check_response_tokens, match_head_dtype, pick, selected_index

logger = logging.getLogger("pacs_kernels")


@dataclass(frozen=True)
class LossBatch:
    """A micro-batch checked once at the entry, its response tokens selected (mask == 1, in order).

    hidden (N_sel, d) in the head's dtype, targets (N_sel,), old_logp (N_sel,) or None (on-policy),
    counts (B,) response lengths, layout: the packed layout of the selected tokens; weight (V, d),
    bias (V,) or None; rewards (B,) as given (each route checks them its way); group_size; index: the
    selected positions of the flattened input (None: all); token_shape: the input's per-token shape.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor
    old_logp: torch.Tensor | None
    counts: torch.Tensor
    layout: ResponseLayout
    rewards: torch.Tensor
    group_size: int
    index: torch.Tensor | None
    token_shape: tuple

    @classmethod
    def build(cls, hidden, weight, targets, mask, old_logp, rewards, *, group_size, cu_seqlens=None,
              bias=None) -> "LossBatch":
        """Check the per-token inputs (padded (B, T, d) or packed (N, d) with ``cu_seqlens``) and select."""
        hidden = match_head_dtype(hidden, weight)
        tokens = check_response_tokens(hidden, targets, mask, old_logp, cu_seqlens)
        index = selected_index(tokens.mask)
        selected_hidden, selected_targets, selected_old = tokens.selected(index)
        check_linear_inputs(selected_hidden, weight, selected_targets, bias)
        return cls(selected_hidden, weight, bias, selected_targets, selected_old, tokens.counts,
                   tokens.selected_layout(), rewards, group_size, index, tokens.token_shape)

    @property
    def n_responses(self) -> int:
        return self.counts.shape[0]

    @property
    def n_tokens(self) -> int:
        """Tokens of the input, selected or not."""
        return int(torch.Size(self.token_shape).numel())

    @property
    def n_selected(self) -> int:
        return self.hidden.shape[0]

    def select(self, name: str, per_token: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token input laid out like targets (e.g. ref_logp, old_lse) -> its (N_sel,) selected values."""
        if per_token is None:
            return None
        check_tensor(name, per_token, dtypes=FLOAT_DTYPES)
        if tuple(per_token.shape) != self.token_shape or per_token.device != self.hidden.device:
            raise ValueError(f"{name} must have shape hidden.shape[:-1] = {self.token_shape} on {self.hidden.device}, "
                             f"got {tuple(per_token.shape)} on {per_token.device}")
        return pick(per_token.reshape(-1), self.index)


@dataclass(frozen=True)
class PathChoice:
    """The path the engine runs: ``name`` "single_pass" (with its ``chunks``, ``row_kernels``, ``memory``
    and the share of logits ``rebuilt``) or "two_pass" (chunks None)."""

    name: str
    chunks: list[Chunk] | None = None
    row_kernels: str = "torch"
    memory: TileMemory | None = None
    rebuilt: float = 0.0


def choose_path(batch: LossBatch, options: LossOptions, *, whole_groups: bool = True,
                single_pass_possible: bool = True) -> PathChoice:
    """The path for this batch: the one place that decides ``path="auto"``.

    ``path="auto"`` over chunks of whole groups asks the device-calibrated cost model (path_choice.py): the
    single pass or the two passes, whichever is modelled faster, and, on the CPU with no chunk budget given,
    a budget raised to hold the largest group whole; on CUDA the committed GPU run's table (dispatch.py)
    overrides the model where it measured the shape. Chunks of tokens (``whole_groups`` False: GRPO) take the
    single pass at the budget. Two passes always for ``path="two_pass"``, backend="naive" and objectives the
    single pass cannot run (``single_pass_possible`` False). ``path="single_pass"``: a group bigger than the
    budget keeps part of its logits and rebuilds the rest.
    """
    path, weight = options.path, batch.weight
    if path == "single_pass" and options.backend == "naive":
        raise ValueError("path='single_pass' has no naive backend; use backend='auto', 'torch' or 'triton'")
    if path == "two_pass" or options.backend == "naive" or not single_pass_possible:
        return PathChoice("two_pass")
    softcap = options.logit_softcap is not None
    row_kernels = row_kernels_for(options.backend, weight)
    counts = batch.counts.tolist()
    budget_mib = options.chunk_budget_mib
    if path == "auto" and whole_groups:
        triton_two_pass = two_pass_runs_triton(options.backend, weight.device, weight.dtype, softcap=softcap)
        modelled = path_choice.choose_path(path_choice.PathQuery(
            weight.device, weight.dtype, weight.shape[1], weight.shape[0], tuple(counts), batch.group_size,
            budget_mib, softcap, triton_two_pass, row_kernels, options.dispatch_table))
        logger.debug("path='auto': %s (modelled seconds %s)", modelled.path, modelled.modelled_s)
        if modelled.path == "two_pass":
            return PathChoice("two_pass")
        budget_mib = modelled.budget_mib
    memory = tile_memory(budget_mib, weight.shape[0], weight.device, weight.dtype, softcap=softcap,
                         row_kernels=row_kernels)
    if not whole_groups:
        return PathChoice("single_pass", plan_token_chunks(counts, memory.tokens), row_kernels, memory)
    chunks = plan_group_chunks(counts, batch.group_size, memory.tokens, oversized_alone=True)
    return PathChoice("single_pass", chunks, row_kernels, memory, recomputed_fraction(chunks, memory.tokens))


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


def batch_single_pass(batch: LossBatch, options: LossOptions, choice: PathChoice, chunk_loss, *,
                      with_entropy: bool = False):
    """single_pass.single_pass over the batch's selected tokens with the chosen chunks and memory."""
    check_targets_in_range(batch.targets, batch.weight.shape[0])
    return single_pass(batch.hidden, batch.weight, batch.targets, bias=batch.bias, temperature=options.temperature,
                       chunks=choice.chunks, chunk_loss=chunk_loss, with_entropy=with_entropy,
                       row_kernels=choice.row_kernels, softcap=options.logit_softcap,
                       budget_tokens=choice.memory.tokens, strip_rows=choice.memory.strip_rows,
                       tile_dtype=choice.memory.tile_dtype)


def batch_logprobs(batch: LossBatch, options: LossOptions, *, with_entropy: bool = False):
    """The two passes' first: ``linear_logprobs`` on the selected tokens (-> logp, or (logp, entropy))."""
    knobs = dict(filter_eps=options.filter_eps, chunk_elements=options.chunk_elements,
                 vocab_splits=options.vocab_splits, logit_softcap=options.logit_softcap,
                 grad_gemms=options.grad_gemms, dispatch_table=options.dispatch_table)
    return linear_logprobs(batch.hidden, batch.weight, batch.targets, temperature=options.temperature,
                           bias=batch.bias, backend=options.backend, return_entropy=with_entropy,
                           **{k: v for k, v in knobs.items() if v is not None})


# --- PACS: the group loss of loss.py on chunks of whole groups, two passes, or the one sweep ---------------

def run_pacs(batch: LossBatch, pacs_settings: dict, options: LossOptions, *, valid=None, group_ids=None,
             old_lse=None, return_stats: bool = False, with_entropy: bool = False):
    """The PACS loss of ``batch`` (``pacs_settings``: group_size excluded, beta, score, advantage, weighting,
    score_function_term, all checked by the caller); ``(loss, PACSStats)`` with return_stats, the path in
    its ``path`` field."""
    settings = dict(group_size=batch.group_size, **pacs_settings)
    rewards, valid, beta = check_group_inputs(
        batch.rewards, valid, batch.layout, batch.hidden.device, group_size=batch.group_size,
        beta=settings["beta"], advantage=settings["advantage"], weighting=settings["weighting"],
        score_function_term=settings["score_function_term"], group_ids=group_ids)
    settings["beta"] = beta
    if settings["score"] == "mean_logp":
        check_nonempty_responses(batch.counts, "score='mean_logp' (it divides by the response length)")
    result, chosen, rebuilt = None, "one_sweep", 0.0
    if old_lse is not None:
        if batch.old_logp is None:
            raise ValueError("old_lse goes with the old_logp it was computed with; got old_lse with old_logp=None")
        result = pacs_one_sweep(batch, old_lse, rewards, valid, options, settings, return_stats=return_stats)
    if result is None:  # the usual paths (also for an old_lse from other weights)
        choice = choose_path(batch, options)
        chosen, rebuilt = choice.name, choice.rebuilt
        if choice.name == "single_pass":
            result = pacs_single_pass(batch, choice, rewards, valid, options, settings, return_stats=return_stats,
                                      with_entropy=with_entropy)
        else:
            result = pacs_two_pass(batch, rewards, valid, options, settings, return_stats=return_stats,
                                   with_entropy=with_entropy)
    logger.debug("fused PACS loss: %s path, B=%d, %d response tokens%s", chosen, batch.n_responses,
                 batch.n_selected, f", {rebuilt:.0%} of the logits built twice (groups bigger than the budget)"
                 if rebuilt else "")
    if return_stats:
        loss, stats = result
        return loss, replace(stats, path=chosen)
    return result


def pacs_single_pass(batch, choice, rewards, valid, options, settings, *, return_stats, with_entropy):
    """PACS over chunks of whole groups, one logits GEMM per chunk (single_pass.py)."""
    counts, n_total = batch.counts, batch.n_responses

    def chunk_loss(logp, chunk):
        r0, r1 = chunk.r0, chunk.r1
        old = logp.detach() if batch.old_logp is None else batch.old_logp[chunk.tok0:chunk.tok1].detach()
        full = torch.ones_like(logp, dtype=torch.bool)
        return pacs_group_loss(logp, old, full, counts[r0:r1], rewards[r0:r1],
                               ResponseLayout.from_counts(counts[r0:r1]),
                               valid=None if valid is None else valid[r0:r1], n_total=n_total, **settings)

    want_entropy = with_entropy and return_stats
    loss, extras, _, entropy = batch_single_pass(batch, options, choice, chunk_loss, with_entropy=want_entropy)
    loss = loss.float() if loss.dtype != torch.float64 else loss
    if not return_stats:
        return loss
    per_response = tuple(torch.cat([extra[k] for extra in extras]) for k in range(4))
    return loss, compute_stats(loss, per_response, rewards, batch.group_size, advantage=settings["advantage"],
                               valid=valid, entropy=entropy)


def pacs_two_pass(batch, rewards, valid, options, settings, *, return_stats, with_entropy):
    """linear_logprobs on the selected tokens, then the group loss on their packed layout."""
    want_entropy = with_entropy and return_stats
    out = batch_logprobs(batch, options, with_entropy=want_entropy)
    logp, entropy = out if want_entropy else (out, None)
    old = logp.detach() if batch.old_logp is None else batch.old_logp
    full_mask = torch.ones_like(logp, dtype=torch.bool)
    return pacs_loss_on_layout(logp, old, full_mask, rewards, batch.layout, return_stats=return_stats, group_ids=None,
                               backend="torch" if options.backend == "naive" else options.backend,
                               counts=batch.counts, mask_is_full=True, valid=valid,
                               entropy=None if entropy is None else entropy.detach(), **settings)


def pacs_one_sweep(batch, old_lse, rewards, valid, options, settings, *, return_stats):
    """The loss and its exact gradient in one vocabulary sweep, while logp == old_logp (None, after a
    warning, where the sweep's log-probs show that the weights moved since old_lse: the caller then runs
    the usual path).

    The loss is a function of the log-probs alone, so its value and its per-token gradient g
    follow from the group loss at logp = old_logp; the sweep then rebuilds each logits tile once and
    forms dh, dW from g and old_lse (known_grad.py). The returned tensor has the loss's value and
    the sweep's gradients: loss + (surrogate - surrogate.detach()).
    """
    if not isinstance(old_lse, torch.Tensor) or old_lse.numel() != batch.n_tokens:
        raise ValueError(f"old_lse must have the shape of old_logp {tuple(batch.token_shape)}, got "
                         + (f"shape {tuple(old_lse.shape)}" if isinstance(old_lse, torch.Tensor)
                            else type(old_lse).__name__))
    if options.backend == "naive":
        raise ValueError("old_lse (the one-sweep first step) needs backend 'auto', 'torch' or 'triton', got 'naive'")
    old_selected = batch.old_logp.detach()
    cdt = torch.float64 if batch.weight.dtype == torch.float64 else torch.float32
    at_old = old_selected.to(cdt).clone().requires_grad_()
    full_mask = torch.ones_like(at_old, dtype=torch.bool)
    with torch.enable_grad():
        loss, per_response = pacs_group_loss(at_old, old_selected, full_mask, batch.counts, rewards, batch.layout,
                                             valid=valid, **settings)
        (grad_logp,) = torch.autograd.grad(loss, at_old)
    surrogate, logp = linear_logprobs_known_grad(
        batch.hidden, batch.weight, batch.targets, grad_logp, pick(old_lse.reshape(-1), batch.index),
        temperature=options.temperature, bias=batch.bias, backend=options.backend,
        logit_softcap=options.logit_softcap)
    drift = float(logprob_drift(logp, old_selected))
    if not drift <= stale_lse_tolerance(batch.weight.dtype):
        warnings.warn(
            f"old_lse does not belong to these weights: the log-probs recomputed in the one sweep differ from "
            f"old_logp by up to {drift:.3g} x (1 + |old_logp|), more than rounding; the loss was computed on the "
            "usual path instead (exact for these weights). Pass old_lse only on the first optimizer step after "
            "the rollout that produced it.", RuntimeWarning, stacklevel=4)
        return None
    total = loss.detach().to(cdt) + (surrogate - surrogate.detach())
    if return_stats:
        return total, compute_stats(total, per_response, rewards, batch.group_size, advantage=settings["advantage"],
                                    valid=valid)
    return total


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


# --- GRPO: a per-token loss once advantages and normalisers are known: chunks of tokens ----------------------

def run_grpo(batch: LossBatch, settings: dict, options: LossOptions, *, ref_logp=None, return_stats: bool = False):
    """The clipped GRPO surrogate of grpo.py (``settings``: clip_eps, clip_eps_high, aggregation, kl_coef);
    ``(loss, GRPOStats)`` with return_stats."""
    n, counts, aggregation = batch.n_responses, batch.counts, settings["aggregation"]
    low, high, kl_coef = check_grpo_options(batch.group_size, n, settings["clip_eps"], settings["clip_eps_high"],
                                            settings["kl_coef"], ref_logp, _token_like(batch))
    check_response_rewards(batch.rewards, n, batch.hidden.device)
    if aggregation == "seq_mean":
        check_nonempty_responses(counts, "aggregation='seq_mean' (it averages over each response)")
    elif int(counts.sum()) == 0:
        raise ValueError("mask must select at least one token with aggregation='token_mean'")
    cdt = torch.float64 if batch.weight.dtype == torch.float64 else torch.float32
    values = batch.rewards.detach().to(cdt)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("rewards must be finite (no NaN or inf)")

    # per selected token: its response's advantage and its share of the normaliser
    segment = batch.layout.segment_ids()
    adv = group_normalized_advantages(values, batch.group_size)
    token_adv = adv[segment]
    if aggregation == "token_mean":
        token_coef = torch.full_like(token_adv, 1.0 / int(counts.sum()))
    else:
        token_coef = (1.0 / (counts.to(cdt) * n))[segment]
    ref_sel = None if ref_logp is None else pick(ref_logp.reshape(-1), batch.index)
    if ref_sel is not None:  # the selected tokens: every one counts
        check_no_inf_where("ref_logp", ref_sel, torch.ones_like(ref_sel, dtype=torch.bool))

    def share(logp, t0, t1):
        old = logp.detach() if batch.old_logp is None else batch.old_logp[t0:t1].detach().to(cdt)
        ref = None if ref_sel is None else ref_sel[t0:t1].detach().to(cdt)
        terms = grpo_token_terms(logp.to(cdt), old, token_adv[t0:t1], ref, None, low=low, high=high,
                                 kl_coef=kl_coef)
        return (terms.per_token * token_coef[t0:t1]).sum(), terms

    choice = choose_path(batch, options, whole_groups=False)
    if choice.name == "single_pass":
        loss, all_terms, _, _ = batch_single_pass(batch, options, choice, lambda lp, c: share(lp, c.tok0, c.tok1))
    else:
        logp = batch_logprobs(batch, options)
        loss, terms = share(logp, 0, logp.shape[0])
        all_terms = [terms]
    loss = loss.float() if loss.dtype != torch.float64 else loss
    if not return_stats:
        return loss
    clipped, ratio_sum, kl_sum = torch.tensor([t.stat_sums() for t in all_terms], dtype=torch.float64).sum(0).tolist()
    n_tokens = max(int(counts.sum()), 1)
    return loss, GRPOStats(loss=float(loss.detach()), clip_frac=clipped / n_tokens, ratio_mean=ratio_sum / n_tokens,
                           advantage_abs_mean=float(adv.abs().mean()), kl_mean=kl_sum / n_tokens)


def _token_like(batch: LossBatch) -> torch.Tensor:
    """A tensor with the input's per-token shape and device (for shape checks of per-token inputs)."""
    return torch.empty(batch.token_shape, dtype=torch.bool, device=batch.hidden.device)


# --- any objective (the Objective protocol): whole groups as padded rows ------------------------------------

def run_objective(batch: LossBatch, objective, options: LossOptions, *, ref_logp=None):
    """``objective`` on the batch's per-token log-probs as (B, width) rows -> ``(loss, stats)`` as it returns
    them (the path is logged at debug level). Single pass (chunks of whole groups) unless the objective uses the
    entropy (the single pass's entropy carries no gradient) or two passes are asked for or chosen."""
    uses_entropy = bool(getattr(objective, "uses_entropy", False))
    if uses_entropy and options.path == "single_pass":
        raise ValueError("path='single_pass' cannot run an objective that uses the entropy (entropy_coef > 0): "
                         "its gradient needs the two passes; use LossOptions(path='two_pass') or 'auto'")
    rows = ResponseRows(batch.counts)
    ref_rows = None if ref_logp is None else rows(ref_logp.detach())
    old_rows = None if batch.old_logp is None else rows(batch.old_logp).detach()

    def call(logp_rows, entropy_rows=None):
        result = objective(logp_rows, old_rows, batch.rewards, rows.mask, group_size=batch.group_size,
                           ref_logp=ref_rows, entropy=entropy_rows)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
                and result[0].dim() == 0 and isinstance(result[1], dict)):
            raise TypeError("objective must return (loss, stats): a 0-d tensor and a dict, "
                            f"got {type(result).__name__}")
        return result

    choice = choose_path(batch, options, single_pass_possible=not uses_entropy)
    if choice.name == "single_pass":
        result = objective_single_pass(batch, options, choice, rows, call)
        if result is not None:
            logger.debug("fused objective loss: single_pass path, %d chunks", len(choice.chunks))
            return result
    logger.debug("fused objective loss: two_pass path")
    out = batch_logprobs(batch, options, with_entropy=uses_entropy)
    logp, entropy = out if uses_entropy else (out, None)
    return call(rows(logp), rows(entropy))


def objective_single_pass(batch: LossBatch, options: LossOptions, choice: PathChoice, rows: ResponseRows, call):
    """The single pass for a plain objective; None (after a warning, ``path="auto"``) where the objective
    turns out to couple groups through their log-probs (the caller then runs two passes).

    Chunk k's share is objective(rows with chunk k live, the rest at a constant filler) - objective(all at the
    filler): for a loss whose groups interact only through constants, these shares add up to the loss and
    each chunk's gradient is exact. The filler is old_logp (0 on-policy)."""
    cdt = torch.float64 if batch.weight.dtype == torch.float64 else torch.float32
    filler = torch.zeros(batch.n_selected, dtype=cdt, device=batch.hidden.device) if batch.old_logp is None \
        else batch.old_logp.detach().to(cdt)
    with torch.no_grad():
        at_filler = call(rows(filler))[0].detach()

    def chunk_loss(logp, chunk):
        live = torch.cat([filler[:chunk.tok0], logp.to(cdt), filler[chunk.tok1:]])
        return call(rows(live))[0] - at_filler, None

    loss, _, logp_all, _ = batch_single_pass(batch, options, choice, chunk_loss)
    loss = loss + at_filler.to(loss.dtype)
    with torch.no_grad():
        whole, stats = call(rows(logp_all.to(cdt)))
    # rounding: each chunk's share is a difference of two objective values of the filler's size
    scale = (1.0 + abs(float(whole)) + abs(float(at_filler))) * len(choice.chunks)
    tolerance = (1e-10 if cdt == torch.float64 else 1e-5) * scale
    if abs(float(loss.detach()) - float(whole)) > tolerance:
        message = (f"the objective's loss over chunks of whole groups ({float(loss.detach()):.6g}) differs from its "
                   f"loss on the whole batch ({float(whole):.6g}): it couples groups through their log-probs, "
                   "which the single pass cannot split")
        if options.path == "single_pass":
            raise ValueError(message + "; use LossOptions(path='two_pass')")
        warnings.warn(message + "; computed on two passes instead", RuntimeWarning, stacklevel=4)
        return None
    loss = loss.float() if loss.dtype != torch.float64 else loss
    return loss, {**stats, "loss": float(loss.detach())}
