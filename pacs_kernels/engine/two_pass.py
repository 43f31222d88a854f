"""Two passes: the log-prob kernels over the batch's selected tokens (one sweep forward; the logits rebuilt in
the backward: 4 matmuls), then the loss on all of them, autograd joining the two.

The path where the single pass cannot run or is not the faster: an objective with an entropy term (the single
pass's entropy carries no gradient), ``path="two_pass"``, backend="naive", where the plan's cost model found it
faster (the Triton log-prob kernels on a GPU), or an objective whose chunks' shares did not add up. Also a
piece of a batch whose log-probs are gathered into the whole batch's rows (pieces.py).

The batch was checked and the backend resolved by the plan, so this calls the kernels' autograd Function
(``LinearLogprobs``) directly rather than ``linear_logprobs``, which checks and decides again. As there, a token
whose hidden state holds an inf or a NaN gets NaN as its log-prob (never a finite value, nor -inf).
"""

from __future__ import annotations

import torch

from ..logprobs import Kernels, LinearLogprobs, LogprobOptions
from .plan import Plan


def run_two_pass(batch, plan: Plan, loss, options):
    """The two passes of ``plan`` for an engine ``loss`` (objectives/protocol.py) -> its result."""
    with_entropy = loss.with_entropy
    if plan.backend == "naive":  # the logits materialized (tests, benchmarks), autograd through them
        logp, entropy = materialized_logprobs(batch, options, with_entropy=with_entropy)
    else:
        knobs = LogprobOptions(filter_eps=options.filter_eps,
                               chunk_elements=plan.chunk_elements or options.chunk_elements,
                               vocab_splits=options.vocab_splits, softcap=options.logit_softcap,
                               grad_gemms=options.grad_gemms, dispatch_table=options.dispatch_table)
        targets = batch.targets.contiguous() if plan.backend == "triton" else batch.targets
        bias = batch.bias.contiguous() if plan.backend == "triton" and batch.bias is not None else batch.bias
        logp, entropy, _ = LinearLogprobs.apply(batch.hidden, batch.weight, bias, targets, options.temperature,
                                                Kernels(plan.backend), with_entropy, knobs)
    with torch.no_grad():  # one reduction over hidden, no (N, d) temporary, no sync
        finite = torch.isfinite(torch.linalg.vector_norm(batch.hidden, ord=float("inf"), dim=-1))
    nan = torch.tensor(float("nan"), device=logp.device)
    logp = torch.where(finite, logp, nan)
    entropy = None if entropy is None else torch.where(finite, entropy, nan)
    return loss.two_pass_result(logp, entropy)


def materialized_logprobs(batch, options, *, with_entropy: bool):
    """The naive backend: the (N_sel, V) logits held whole, in float32 (float64 for float64 inputs), and
    log_softmax -> (logp, entropy or None), differentiable by autograd."""
    cdt = torch.float64 if batch.hidden.dtype == torch.float64 else torch.float32
    logits = batch.hidden.to(cdt) @ batch.weight.to(cdt).T
    if batch.bias is not None:
        logits = logits + batch.bias.to(cdt)
    if options.logit_softcap is not None:  # Gemma-style soft-cap, before the temperature
        logits = options.logit_softcap * torch.tanh(logits / options.logit_softcap)
    log_probs = torch.log_softmax(logits / options.temperature, dim=-1)
    logp = log_probs.gather(-1, batch.targets.long().unsqueeze(-1)).squeeze(-1)
    return logp, (-(log_probs.exp() * log_probs).sum(-1) if with_entropy else None)
