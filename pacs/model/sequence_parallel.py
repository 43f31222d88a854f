"""Sequence parallelism (DeepSpeed-Ulysses style): one packed micro-batch spread over several ranks.

With ``train.sequence_parallel_size = P`` the ranks form groups of P consecutive ranks. The ranks of a
group hold the same rollouts (each generates a share of the group's prompts and the group gathers them:
:func:`gather_rollouts`) and split every packed micro-batch of N tokens along the tokens: rank i holds
tokens [i N/P, (i+1) N/P) (the row padded to a multiple of P: ``pacs.model.packing.shard_packed``).
Everything in a decoder layer works token by token (embeddings, norms, RoPE at each token's own position,
the MLP, the LM head and the fused log-probs) except attention, which needs every earlier token of a
sequence. So attention trades the split, twice per layer:

    q, k, v (1, H, N/P, D) on each rank --all-to-all--> (1, H/P, N, D): every token, H/P heads
    causal attention over each packed sequence on those heads (exact: heads are independent)
    out (1, H/P, N, D) --all-to-all--> (1, H, N/P, D): this rank's tokens, every head again

An all-to-all's adjoint is the reverse all-to-all, so the backward is the same exchange reversed.
Each rank then holds activations of N/P tokens (attention: N tokens of H/P heads, the same size), so
the longest trainable response grows with P.

The loss couples the tokens of a group (PACS's RLOO baseline and BCE, GRPO's advantages), but only
through the per-token log-probs, N floats: each rank computes the log-probs of its own tokens (the fused
kernel, no N x V logits), the group's ranks gather them (:func:`gather_tokens`), and every rank
computes the same loss on the whole micro-batch's log-probs. The gather's backward hands each rank the
gradient of its own tokens, so the ranks' parameter gradients add up to the micro-batch's:

    dL/dtheta = sum over ranks i of  sum_{t on rank i} dL/dlogp_t * dlogp_t/dtheta
                (attention's cross-rank terms flow back through the all-to-alls)

FSDP2 averages gradients over all W ranks while only W / P of them hold different data, so the
trainer multiplies each backward by P (:attr:`SequenceParallel.size`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs.model.packed_attention import (
    SEQUENCE_PARALLEL_KWARG,
    packed_sdpa_attention,
    packed_sdpa_mask,
    register_packed_attention,
    require_causal,
    sequence_bounds,
)
from pacs.model.packing import PackedMicroBatch
from pacs.model.profile import ModelProfile
from pacs.model.varlen_attention import loop_causal_attention, varlen_causal_attention

ULYSSES_ATTENTION = "pacs_ulysses_sdpa"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` consecutive ranks; ``rank`` is this rank's place in it."""

    size: int
    rank: int
    group: object  # torch.distributed ProcessGroup


def new_sequence_parallel(size: int, rank: int, world_size: int, timeout=None) -> SequenceParallel | None:
    """Groups of ``size`` consecutive ranks (every rank creates every group, in the same order:
    ``new_group`` is collective), their collectives waiting ``timeout`` (a timedelta; None: torch's
    default); None for ``size == 1``."""
    if size == 1:
        return None
    if size < 1 or world_size % size:
        raise ValueError(f"train.sequence_parallel_size ({size}) must divide the number of processes ({world_size})")
    mine = None
    for first in range(0, world_size, size):
        group = dist.new_group(list(range(first, first + size)), timeout=timeout)
        if first <= rank < first + size:
            mine = SequenceParallel(size=size, rank=rank - first, group=group)
    return mine


class _GatherTokens(torch.autograd.Function):
    """(n,) on each rank of the group -> (P n,) in rank order; backward: this rank's slice of the gradient
    (every rank computes the same loss from the gathered tensor, so no sum over ranks)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp, ctx.n = sp, local.shape[0]
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(sp.size)]
        dist.all_gather(parts, local, group=sp.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.sp.rank * ctx.n:(ctx.sp.rank + 1) * ctx.n], None


def gather_tokens(local: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Every rank's ``local`` (n,) tokens, concatenated in rank order; differentiable."""
    return _GatherTokens.apply(local, sp)


def whole_micro_batch(part: PackedMicroBatch, values: torch.Tensor, lo: int, width: int) -> torch.Tensor:
    """``values`` (one per ``part.mask == 1`` token of this rank, in order) -> (rows of the micro-batch,
    ``width``) in the padded batch's layout, every rank's tokens gathered (differentiable; 0 off the mask).
    ``lo``: the micro-batch's first row in the batch."""
    shard = part.shard
    dense = values.new_zeros(part.mask.shape[0]).masked_scatter(part.mask, values)
    every = gather_tokens(dense, shard.sp)
    out = every.new_zeros(int(part.rewards.shape[0]), width)
    return out.index_put((shard.rows[shard.mask] - lo, shard.cols[shard.mask]), every[shard.mask])


def reduce_over_group(tensors: list[torch.Tensor], sp: SequenceParallel, op=dist.ReduceOp.SUM) -> None:
    """In place: each tensor reduced by ``op`` (a sum by default) over the group's ranks (no gradient)."""
    for t in tensors:
        dist.all_reduce(t, op=op, group=sp.group)


# ----------------------------------------------------------------------------- attention


def _all_to_all(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """x (P, ...) -> (P, ...): block j goes to rank j, block j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # (empty_like(x) keeps x's strides)
    dist.all_to_all_single(out, x, group=sp.group)
    return out


def _tokens_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(1, H, n, D) this rank's tokens, every head -> (1, H/P, P n, D) every token, this rank's heads."""
    _, heads, n, dim = x.shape
    received = _all_to_all(x.reshape(sp.size, heads // sp.size, n, dim), sp)  # (P from-rank, H/P, n, D)
    return received.transpose(0, 1).reshape(1, heads // sp.size, sp.size * n, dim)


def _heads_to_tokens(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The inverse of :func:`_tokens_to_heads`: (1, H/P, P n, D) -> (1, H, n, D)."""
    _, heads_here, total, dim = x.shape
    n = total // sp.size
    blocks = x.reshape(heads_here, sp.size, n, dim).transpose(0, 1)  # (P to-rank, H/P, n, D)
    return _all_to_all(blocks, sp).reshape(1, heads_here * sp.size, n, dim)


class _Exchange(torch.autograd.Function):
    """One of the two layout exchanges (``to_heads``: :func:`_tokens_to_heads`, else :func:`_heads_to_tokens`);
    its backward is the other one (an all-to-all's adjoint is the reverse all-to-all)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel, to_heads: bool) -> torch.Tensor:
        ctx.sp, ctx.to_heads = sp, to_heads
        return (_tokens_to_heads if to_heads else _heads_to_tokens)(x, sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_heads_to_tokens if ctx.to_heads else _tokens_to_heads)(grad, ctx.sp), None, None


def _ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs):
    """Hugging Face attention function. In a sequence-parallel forward (the backbone called with
    ``pacs_sequence_parallel=sp``, which Hugging Face hands to every attention call, also when gradient
    checkpointing recomputes a layer in the backward): query (1, H, n, D), key/value (1, H_kv, n, D) of this
    rank's tokens -> all-to-all -> causal attention over each packed sequence (``cu_seq_lens_q``: the whole row's
    bounds) on H/P heads (one flash varlen call where it runs, pacs/model/varlen_attention.py, else SDPA per sequence)
    -> all-to-all -> (1, n, H, D). Otherwise exactly ``pacs_packed_sdpa``
    (pacs/model/packing.py)."""
    sp = kwargs.pop(SEQUENCE_PARALLEL_KWARG, None)
    if sp is None:
        return packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    require_causal(module, kwargs, "sequence parallelism")
    bounds = sequence_bounds(kwargs["cu_seq_lens_q"], kwargs.get("sliding_window"), "sequence parallelism",
                             "train.sequence_parallel_size=1")
    kv_heads = key.shape[1]
    if kv_heads % sp.size:  # too few key/value heads to split: copies of each, just enough to split them
        # (P / gcd(H_kv, P) copies divide the H / H_kv query heads that share one, as P divides H)
        copies = sp.size // math.gcd(kv_heads, sp.size)
        key, value = key.repeat_interleave(copies, dim=1), value.repeat_interleave(copies, dim=1)
    q, k, v = (_Exchange.apply(x, sp, True) for x in (query, key, value))
    out = varlen_causal_attention(q, k, v, kwargs["cu_seq_lens_q"], bounds, scaling=scaling, dropout=dropout,
                                  extras=kwargs)
    if out is None:  # no flash varlen kernel here (pacs/model/varlen_attention.py): SDPA once per sequence
        out = loop_causal_attention(q, k, v, bounds, scaling=scaling, dropout=dropout)
    return _Exchange.apply(out, sp, False).transpose(1, 2).contiguous(), None


def check_model_splits(model_config, size: int) -> None:
    """Can a model with this (Hugging Face) config split its tokens over ``size`` ranks? Its attention heads
    must split over them, and every layer must be attention (a layer that mixes tokens otherwise, a
    state-space, linear-attention or convolution layer, would see this rank's tokens only). ValueError naming
    the setting otherwise."""
    profile = ModelProfile.from_config(model_config)
    name, heads, kv_heads = profile.config_class, profile.heads, profile.kv_heads
    if not heads:
        raise ValueError(f"train.sequence_parallel_size={size}: cannot find the number of attention heads of the "
                         f"model ({name} has no num_attention_heads)")
    if heads % size or heads % kv_heads:
        raise ValueError(
            f"train.sequence_parallel_size={size} must divide the model's attention heads "
            f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}): each rank attends with "
            f"num_attention_heads / sequence_parallel_size of them")
    other = profile.non_attention_layers
    if other:
        raise ValueError(
            f"train.sequence_parallel_size={size}: the model has layers that are not attention ({', '.join(other)}; "
            f"{name}.layer_types), which would see only this rank's tokens; set train.sequence_parallel_size=1")
    rope = profile.position_dependent_rope
    if rope is not None:
        raise ValueError(
            f"train.sequence_parallel_size={size}: the model's rotary frequencies (rope_type={rope!r}) follow the "
            "largest position each rank sees, so one sequence's halves would rotate by different frequencies; "
            "set train.sequence_parallel_size=1")


def enable_sequence_parallel_attention(causal_lm, size: int) -> str:
    """Switch ``causal_lm`` to ``pacs_ulysses_sdpa`` (registered here, idempotent), after checking that
    its tokens split over ``size`` ranks (:func:`check_model_splits`). Calls outside a sequence-parallel
    forward (generation, padded rows) run as ``pacs_packed_sdpa``. Returns the implementation's name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_model_splits(causal_lm.config, size)
    register_packed_attention()  # what calls outside a sequence-parallel forward run
    AttentionInterface.register(ULYSSES_ATTENTION, _ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, packed_sdpa_mask)
    causal_lm.set_attn_implementation(ULYSSES_ATTENTION)
    return ULYSSES_ATTENTION


# ----------------------------------------------------------------------------- rollouts


def prompt_share(n_prompts: int, sp: SequenceParallel | None) -> tuple[int, int]:
    """The prompts [start, stop) of a data rank's ``n_prompts`` that this rank of its group generates:
    contiguous, as equal as they can be (the first ranks take one more); all of them without a group."""
    if sp is None:
        return 0, n_prompts
    base, extra = divmod(n_prompts, sp.size)
    start = sp.rank * base + min(sp.rank, extra)
    return start, start + base + (sp.rank < extra)


def gather_rollouts(outputs: list, scores: list, sp: SequenceParallel | None) -> tuple[list, list]:
    """Every rank's ``outputs`` and ``scores`` (lists, picklable, one item per prompt) of the group, each
    concatenated in rank order."""
    if sp is None:
        return outputs, scores
    every = [None] * sp.size
    dist.all_gather_object(every, (outputs, scores), group=sp.group)
    return [item for part, _ in every for item in part], [item for _, part in every for item in part]
