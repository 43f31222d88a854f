"""fused_linear_objective_loss(): any objective, straight from hidden states and the LM head.

Only the response tokens (mask == 1) are sent to ``linear_logprobs``; their log-probs (and entropy,
when the objective asks for it) are laid out as left-aligned padded rows, one per response,
(B, max response length), with their own mask, and handed to the objective. The objective returns
a scalar; autograd carries dloss/dlogp back through the row layout (a gather) into
``linear_logprobs``'s backward, which turns it into the hidden-state and LM-head gradients without
the N x V logits. So any callable satisfying the ``Objective`` protocol gets the fused path.

Objectives only see which tokens belong to which response, never their positions, so the padded
(B, T, d) and the packed (N, d) + ``cu_seqlens`` layouts give the same loss.
"""

from __future__ import annotations

import torch

from ..checks import BACKENDS, FLOAT_DTYPES, check_choice, check_linear_inputs, check_temperature, check_tensor
from ..logprobs import linear_logprobs
from ..loss_inputs import check_group_size, check_response_rewards
from ..token_selection import check_response_tokens, match_head_dtype, pick, selected_index


class ResponseRows:
    """Scatter of the selected tokens (in order) into left-aligned (B, width) rows."""

    def __init__(self, counts: torch.Tensor) -> None:
        n_responses = counts.shape[0]
        offsets = torch.zeros(n_responses + 1, dtype=torch.int64, device=counts.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        n_selected = int(offsets[-1])
        self.rows = torch.repeat_interleave(torch.arange(n_responses, device=counts.device), counts,
                                            output_size=n_selected)
        self.cols = torch.arange(n_selected, device=counts.device) - offsets[self.rows]
        self.shape = (n_responses, max(int(counts.max()), 1))
        self.mask = torch.zeros(self.shape, dtype=torch.bool, device=counts.device).index_put(
            (self.rows, self.cols), torch.ones((), dtype=torch.bool, device=counts.device))

    def __call__(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """(N_sel,) -> (B, width), zeros outside the mask; differentiable in ``values``."""
        if values is None:
            return None
        return values.new_zeros(self.shape).index_put((self.rows, self.cols), values)


def fused_linear_objective_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    objective,
    *,
    group_size: int,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
):
    """``objective`` (see :class:`Objective`) on the log-probs of ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: padded (B, T, d), or packed (N, d) / (1, N, d) with ``cu_seqlens`` (B + 1,).
        weight: (V, d) LM head; targets: like hidden[..., 0], token ids (any value where mask is 0).
        mask: like targets, 1 on response tokens. rewards: (B,), each group's ``group_size`` contiguous.
        objective: a callable satisfying the Objective protocol (GRPO(), DAPO(), ... or your own).
        old_logp: laid out like targets, or None (on-policy).
        ref_logp: laid out like targets, or None (no KL reference).
        temperature: as in :func:`pacs_kernels.linear_logprobs`.
        bias: as in :func:`pacs_kernels.linear_logprobs`.
        backend: as in :func:`pacs_kernels.linear_logprobs`.

    Returns:
        ``(loss, stats)`` as the objective returns them; the loss is differentiable in hidden, weight, bias.
    """
    if not callable(objective):
        raise TypeError("objective must be a callable satisfying the Objective protocol, "
                        f"got {type(objective).__name__}")
    check_choice("backend", backend, BACKENDS)
    hidden = match_head_dtype(hidden, weight)
    tokens = check_response_tokens(hidden, targets, mask, old_logp, cu_seqlens)
    check_linear_inputs(tokens.hidden, weight, tokens.targets, bias)
    temperature = check_temperature(temperature)
    n = tokens.n_responses
    check_response_rewards(rewards, n, tokens.hidden.device)
    check_group_size(group_size, n, "grpo")
    if ref_logp is not None:
        check_tensor("ref_logp", ref_logp, dtypes=FLOAT_DTYPES)
        if tuple(ref_logp.shape) != tokens.token_shape or ref_logp.device != tokens.hidden.device:
            raise ValueError(f"ref_logp must have shape hidden.shape[:-1] = {tokens.token_shape} on "
                             f"{tokens.hidden.device}, got {tuple(ref_logp.shape)} on {ref_logp.device}")
    if n == 0 or int(tokens.counts.sum()) == 0:
        raise ValueError("mask must select at least one response token")

    index = selected_index(tokens.mask)
    uses_entropy = bool(getattr(objective, "uses_entropy", False))
    outputs = linear_logprobs(pick(tokens.hidden, index), weight, pick(tokens.targets, index),
                              temperature=temperature, bias=bias, backend=backend, return_entropy=uses_entropy)
    logp, entropy = outputs if uses_entropy else (outputs, None)
    to_rows = ResponseRows(tokens.counts)
    old_rows = to_rows(pick(tokens.old_logp, index))
    ref_rows = None if ref_logp is None else to_rows(pick(ref_logp.reshape(-1), index))
    result = objective(to_rows(logp), None if old_rows is None else old_rows.detach(), rewards, to_rows.mask,
                       group_size=group_size, ref_logp=ref_rows, entropy=to_rows(entropy))
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and result[0].dim() == 0 and isinstance(result[1], dict)):
        raise TypeError("objective must return (loss, stats): a 0-d tensor and a dict, "
                        f"got {type(result).__name__}")
    return result
