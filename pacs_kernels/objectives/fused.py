"""fused_linear_objective_loss(): any objective, straight from hidden states and the LM head.

The engine (pacs_kernels/engine.py) hands the objective the response tokens' log-probs (and entropy,
when it asks for it) as left-aligned padded rows, one per response, (B, max response length), with their
own mask. By default that is the single pass: chunks of whole groups, each chunk's logits built once,
the per-token gradient by autograd on the chunk's log-probs, dh and dW from the same tile (3 matmuls);
an objective that uses the entropy, or ``LossOptions(path="two_pass")``, runs ``linear_logprobs`` and
autograd instead (4 matmuls). So any callable satisfying the ``Objective`` protocol gets the fused path,
provided its groups interact only through constants (rewards, mask): the engine checks that.

Objectives only see which tokens belong to which response, never their positions, so the padded
(B, T, d) and the packed (N, d) + ``cu_seqlens`` layouts give the same loss.
"""

from __future__ import annotations

from .. import engine, pieces
from ..keywords import sort_keywords
from ..loss_inputs import check_group_size, check_response_rewards
from ..options import LossOptions

OBJECTIVE_INPUTS = ("old_logp", "ref_logp", "bias", "cu_seqlens", "piece")


def fused_linear_objective_loss(hidden, weight, targets, mask, rewards, objective, *, group_size: int,
                                options: LossOptions | None = None, **inputs):
    """``objective`` (see :class:`Objective`) on the log-probs of ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: padded (B, T, d), or packed (N, d) / (1, N, d) with ``cu_seqlens`` (B + 1,).
        weight: (V, d) LM head; targets: like hidden[..., 0], token ids (any value where mask is 0).
        mask: like targets, 1 on response tokens. rewards: (B,), each group's ``group_size`` contiguous.
        objective: a callable satisfying the Objective protocol (GRPO(), DAPO(), ... or your own).
        options: :class:`LossOptions` (backend, path, temperature, ...; None: ``LossOptions()``).
        inputs: ``old_logp`` / ``ref_logp`` laid out like targets (None: on-policy / no KL reference);
            ``bias`` (V,); ``cu_seqlens``; ``piece``: these tokens are a piece of a batch whose loss is
            completed elsewhere (:class:`KnownGradient`, :class:`GatheredLogprobs`; rewards unused then).
            ``temperature=`` / ``backend=`` still work, deprecated for ``options``.

    Returns:
        ``(loss, stats)`` as the objective returns them; the loss is differentiable in hidden, weight, bias.
    """
    if not callable(objective):
        raise TypeError("objective must be a callable satisfying the Objective protocol, "
                        f"got {type(objective).__name__}")
    _, options, given = sort_keywords("fused_linear_objective_loss", inputs, inputs=OBJECTIVE_INPUTS,
                                      objective=None, options=options)
    if given.get("piece") is not None:  # a piece of a batch whose loss is completed elsewhere (pieces.py)
        pieces.refuse_with_piece(given)
        return pieces.run_piece(hidden, weight, targets, mask, given["piece"], objective, options,
                                group_size=group_size, bias=given.get("bias"))
    batch = engine.LossBatch.build(hidden, weight, targets, mask, given.get("old_logp"), rewards,
                                   group_size=group_size, cu_seqlens=given.get("cu_seqlens"), bias=given.get("bias"))
    check_response_rewards(rewards, batch.n_responses, batch.hidden.device)
    check_group_size(group_size, batch.n_responses, getattr(objective, "advantage", "grpo"))
    if batch.n_responses == 0 or batch.n_selected == 0:
        raise ValueError("mask must select at least one response token")
    return engine.run_objective(batch, objective, options, ref_logp=batch.select("ref_logp", given.get("ref_logp")))
