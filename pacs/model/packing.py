"""Padding-free packed micro-batches and token-budget micro-batching.

A packed micro-batch concatenates the real tokens (prompt + response, no padding) of its rows into
one row of ``N`` tokens. ``position_ids`` restart at 0 for every sequence and ``cu_seqlens`` (B + 1
offsets) mark where each sequence starts, so that

  * attention stays within each sequence: on CUDA with ``flash_attn`` installed, Hugging Face's
    ``flash_attention_2`` runs the varlen kernel on ``cu_seq_lens_q/k``; everywhere else the
    attention registered here (``pacs_packed_sdpa``) runs PyTorch's own flash varlen kernel, one call
    for the whole row, where it can (CUDA, 16-bit: pacs/model/varlen_attention.py), else
    ``scaled_dot_product_attention`` with ``is_causal=True`` once per sequence; no N x N mask is ever
    built (memory O(N), exact);
  * the loss takes the packed layout directly: ``fused_linear_pacs_loss(hidden (N, d), ...,
    cu_seqlens=cu_seqlens)`` with the mask selecting the response tokens of each sequence.

Under sequence parallelism each rank of a group holds an equal slice of a packed row's tokens
(:func:`shard_packed`; the attention trades the slices: pacs/model/sequence_parallel.py). :func:`slice_micro_batch`
cuts rows of a batch in either layout, a rank's slice included.

Packed and padded steps compute the same loss and gradients (tests/test_packing.py); what packing saves is the
padding: a micro-batch costs the sum of its sequence lengths instead of rows x longest row.

Token budgets (``train.max_tokens_per_micro_batch``): whole groups are packed greedily, in order, until the
next group would exceed the budget. A group larger than the budget is cut into parts of whole responses
(``split_groups``), and only such a group: PACS's gradient for any token of a response depends, through the
group's RLOO baseline and the BCE on psi, on the log-probs of every response of its group, so one backward over
part of a group is not the gradient of anything by itself. The trainer makes it exact in two phases
(known_gradients in pacs/train/update.py): the group's log-probs first, without gradient, give every token's
gradient; then each part's backward carries those fixed gradients. A single sequence larger than the budget is an
error that names the setting and the sequence's token count (its forward cannot be cut).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pacs.model.packed_attention import (
    SEQUENCE_PARALLEL_KWARG,
    packed_attention_implementation,
    packed_call,
    register_packed_attention,
)
from pacs.model.profile import ModelProfile

# ----------------------------------------------------------------------------- the layout


@dataclass
class PackedMicroBatch:
    """Rows ``[lo, hi)`` of a right-padded batch, their real tokens concatenated into one row.

    input_ids, position_ids: (1, N) int64 (positions restart at 0 for every sequence);
    cu_seqlens: (B + 1,) int32 sequence offsets (0 first, N last); max_seqlen: the longest sequence;
    targets: (N,) int64 the next token of each position; mask: (N,) bool, True where targets is a
    response token; rewards: (B,) float32; rows, cols: (N,) int64, where each packed token sits in
    the padded batch (``take`` gathers any (B_total, L) per-token tensor into the packed layout).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    targets: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shard: TokenShard | None = None  # sequence parallelism: this rank's slice (:func:`shard_packed`)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def n_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def take(self, padded: torch.Tensor) -> torch.Tensor:
        """(B_total, L) per-token tensor of the whole padded batch -> (N,) in the packed order."""
        return padded[self.rows, self.cols]


def real_token_spans(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) 0/1 attention mask whose rows each hold one contiguous run of ones (right padding, left
    padding, or both: a left-padded prompt before a right-padded completion) -> (starts, lengths),
    (B,) int64 each. A ValueError for a row with a gap in its ones (packing would close the gap and
    change the positions after it) or with no real token."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, L), got shape {tuple(attention_mask.shape)}")
    real = attention_mask != 0
    lengths = real.sum(1).to(torch.int64)
    starts = real.to(torch.int8).argmax(1).to(torch.int64)  # the first one (0 for an empty row)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    span = (positions[None, :] >= starts[:, None]) & (positions[None, :] < (starts + lengths)[:, None])
    if not bool((span == real).all() & (lengths > 0).all()):  # (one device sync for both checks)
        rows = (span != real).any(1).nonzero().flatten().tolist()
        if rows:
            raise ValueError(f"attention_mask rows {rows[:8]} hold real tokens with padding between them; a "
                             "packed row needs each row's real tokens in one contiguous run (padding only before "
                             "or after)")
        rows = (lengths == 0).nonzero().flatten().tolist()
        raise ValueError(f"attention_mask rows {rows[:8]} hold no real token: an empty row cannot be packed")
    return starts, lengths


@dataclass
class PackedRows:
    """The real tokens of a (B, L) batch concatenated into one row of N tokens (:func:`pack_real_tokens`).

    input_ids, position_ids: (1, N) int64 (positions restart at 0 for every sequence); cu_seqlens: (B + 1,)
    int32; bounds: the same offsets as a list; max_seqlen: the longest sequence; rows, cols: (N,) int64, where
    each packed token sits in the (B, L) batch; starts, lengths: (B,) int64, each row's first real column and
    its real token count.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    bounds: list[int]
    max_seqlen: int
    rows: torch.Tensor
    cols: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor

    def packed_index(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) columns of the (B, L) batch, row b's in row b -> (index (B, C) into the packed row, real
        (B, C) bool: the column holds a real token; where it does not, index is a valid stand-in, 0)."""
        offset = cols - self.starts[:, None]
        real = (offset >= 0) & (offset < self.lengths[:, None])
        index = self.cu_seqlens[:-1].to(torch.int64)[:, None] + offset
        return torch.where(real, index, torch.zeros_like(index)), real


def pack_real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack the real tokens (``attention_mask`` 1, one contiguous run per row: :func:`real_token_spans`)
    of ``input_ids`` (B, L) into one row."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must have the same (B, L) shape")
    starts, lengths = real_token_spans(attention_mask)
    device = input_ids.device
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=cu[1:])
    bounds = cu.tolist()  # the one device sync of the layout
    n = bounds[-1]
    rows = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths, output_size=n)
    offsets = torch.arange(n, device=device) - torch.repeat_interleave(cu[:-1], lengths, output_size=n)
    cols = starts[rows] + offsets
    return PackedRows(input_ids=input_ids[rows, cols].unsqueeze(0), position_ids=offsets.unsqueeze(0),
                      cu_seqlens=cu.to(torch.int32), bounds=bounds,
                      max_seqlen=max(e - s for s, e in zip(bounds[:-1], bounds[1:])), rows=rows, cols=cols,
                      starts=starts, lengths=lengths)


def pack_rows(batch, lo: int, hi: int) -> PackedMicroBatch:
    """Pack rows ``[lo, hi)`` of ``batch`` (a :class:`pacs.train.batch.Batch`: right-padded
    input_ids/attention_mask/targets/mask (B, L) and rewards (B,)) into a :class:`PackedMicroBatch`.

    The target and mask of each packed position are those of the padded batch at the same place:
    the padded targets are the next token of the row, and the mask is False at each row's last real
    position, so no packed position predicts across a sequence boundary.
    """
    if not 0 <= lo < hi <= batch.input_ids.shape[0]:
        raise ValueError(f"rows [lo, hi) must satisfy 0 <= lo < hi <= {batch.input_ids.shape[0]}, got [{lo}, {hi})")
    try:
        layout = pack_real_tokens(batch.input_ids[lo:hi], batch.attention_mask[lo:hi])
    except ValueError as exc:
        raise ValueError(f"rows [{lo}, {hi}) cannot be packed: {exc}") from None
    rows, cols = layout.rows + lo, layout.cols
    return PackedMicroBatch(
        input_ids=layout.input_ids, position_ids=layout.position_ids, cu_seqlens=layout.cu_seqlens,
        max_seqlen=layout.max_seqlen, targets=batch.targets[rows, cols], mask=batch.mask[rows, cols].bool(),
        rewards=batch.rewards[lo:hi], rows=rows, cols=cols)


# ----------------------------------------------------------------------------- a sequence-parallel rank's tokens


@dataclass
class TokenShard:
    """Where this rank's tokens sit in the whole packed micro-batch (padded to ``P`` x tokens per rank).

    start, stop: this rank's tokens of the padded row; rows, cols, mask: (N_padded,) each token's place in
    the padded batch and whether it is a response token (padding: False), for every rank's tokens."""

    sp: object  # pacs.model.sequence_parallel.SequenceParallel
    start: int
    stop: int
    rows: torch.Tensor
    cols: torch.Tensor
    mask: torch.Tensor


def shard_packed(packed: PackedMicroBatch, sp) -> PackedMicroBatch:
    """This rank's tokens of ``packed``: the row padded to a multiple of ``sp.size`` (the padding is one
    more sequence, masked out of the loss), then cut into equal slices. The result's per-token fields
    (input_ids, position_ids, targets, mask, rows, cols) are this rank's slice; ``cu_seqlens`` and
    ``max_seqlen`` stay those of the whole padded row (attention runs over it after the all-to-all);
    ``shard`` says where the slice sits."""
    n = packed.n_tokens
    pad = -n % sp.size
    per_rank = (n + pad) // sp.size

    def padded(t: torch.Tensor, fill: torch.Tensor | int | bool) -> torch.Tensor:
        if not pad:
            return t
        extra = fill.expand(pad) if isinstance(fill, torch.Tensor) else torch.full((pad,), fill, dtype=t.dtype,
                                                                                    device=t.device)
        return torch.cat([t, extra.to(t.dtype)])

    cu = packed.cu_seqlens
    if pad:
        cu = torch.cat([cu, cu[-1:] + pad])
    # padding tokens point at the row's last real token (any valid place: their mask is False)
    rows, cols = padded(packed.rows, packed.rows[-1]), padded(packed.cols, packed.cols[-1])
    mask = padded(packed.mask, False)
    positions = torch.cat([packed.position_ids[0], torch.arange(pad, device=cu.device)])
    start, stop = sp.rank * per_rank, (sp.rank + 1) * per_rank
    return PackedMicroBatch(
        input_ids=padded(packed.input_ids[0], packed.input_ids[0, -1])[start:stop].unsqueeze(0),
        position_ids=positions[start:stop].unsqueeze(0), cu_seqlens=cu, max_seqlen=max(packed.max_seqlen, pad),
        targets=padded(packed.targets, packed.targets[-1])[start:stop], mask=mask[start:stop],
        rewards=packed.rewards, rows=rows[start:stop], cols=cols[start:stop],
        shard=TokenShard(sp=sp, start=start, stop=stop, rows=rows, cols=cols, mask=mask))


def slice_micro_batch(batch, lo: int, hi: int, packed: bool, sp=None):
    """Rows ``[lo, hi)`` of ``batch`` as a :class:`PackedMicroBatch`, or as padded rows
    (``batch.rows``, trimmed to the longest row). ``sp`` (a
    :class:`pacs.model.sequence_parallel.SequenceParallel`, packed only): this rank's slice of the tokens."""
    if not packed:
        if sp is not None:  # (the trainer's config checks refuse this earlier)
            raise ValueError("sequence parallelism splits packed micro-batches only: set train.packing=true")
        return batch.rows(lo, hi)
    part = pack_rows(batch, lo, hi)
    if sp is None:
        return part
    return shard_packed(part, sp)


def backend_for(selected: torch.Tensor, backend: str) -> str:
    """``backend`` for a log-prob call over the ``selected`` tokens, "torch" when there are none (a rank of a
    sequence-parallel group may hold only prompt tokens: the empty call must still reach autograd, so that
    this rank's backward runs the layers' exchanges with the others)."""
    return backend if bool(selected.any()) else "torch"


# ----------------------------------------------------------------------------- token budgets


def plan_micro_batches(lengths: list[int], group_size: int, max_tokens: int, *, padded: bool = False,
                       setting: str = "train.max_tokens_per_micro_batch",
                       split_groups: bool = False) -> list[tuple[int, int]]:
    """Row ranges ``[(lo, hi), ...]`` of micro-batches of whole groups that fit ``max_tokens``.

    lengths: real tokens (prompt + response) of each row, groups of ``group_size`` rows contiguous.
    A micro-batch costs ``sum(lengths)`` tokens when packed, ``rows * max(lengths)`` when
    ``padded``. Greedy in order: a group joins the current micro-batch while the cost stays within
    the budget, else it starts the next one. A group that alone exceeds the budget raises a
    ValueError naming ``setting`` and the group's token count, unless ``split_groups``: it is then
    cut (greedily, in order) into parts of whole rows within the budget, each a micro-batch of its
    own (:func:`is_part_of_a_group`); a row that alone exceeds the budget still raises.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"{setting} must be a positive integer, got {max_tokens!r}")
    if group_size < 1 or len(lengths) % group_size:
        raise ValueError(f"lengths ({len(lengths)} rows) must hold whole groups of group_size={group_size}")

    def cost(lo: int, hi: int) -> int:
        part = lengths[lo:hi]
        return (hi - lo) * max(part) if padded else sum(part)

    plan: list[tuple[int, int]] = []
    start = 0
    for lo in range(0, len(lengths), group_size):
        hi = lo + group_size
        if cost(lo, hi) > max_tokens:
            layout = "padded: rows x longest row" if padded else "packed"
            if not split_groups:
                raise ValueError(
                    f"{setting}={max_tokens} is smaller than group {lo // group_size} of this step, which needs "
                    f"{cost(lo, hi)} tokens ({layout}; {group_size} responses with prompt). This pass does not "
                    f"split groups: raise {setting} to at least {cost(lo, hi)}, or lower rollout.max_new_tokens")
            if start < lo:
                plan.append((start, lo))
            plan += _split_group(lengths, lo, hi, max_tokens, cost, setting)
            start = hi
            continue
        if cost(start, hi) > max_tokens:
            plan.append((start, lo))
            start = lo
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def _split_group(lengths: list[int], lo: int, hi: int, max_tokens: int, cost, setting: str) -> list[tuple[int, int]]:
    """Rows [lo, hi) of one group in parts of whole rows within ``max_tokens``, greedily in order."""
    parts, start = [], lo
    for row in range(lo, hi):
        if cost(row, row + 1) > max_tokens:
            raise ValueError(
                f"{setting}={max_tokens} is smaller than sequence {row} of this step (prompt + response: "
                f"{lengths[row]} tokens). Groups are split into parts of whole sequences, but a sequence's "
                f"forward cannot be cut: raise {setting} to at least {cost(row, row + 1)}, or lower "
                "rollout.max_new_tokens")
        if cost(start, row + 1) > max_tokens:
            parts.append((start, row))
            start = row
    parts.append((start, hi))
    return parts


def is_part_of_a_group(lo: int, hi: int, group_size: int) -> bool:
    """Does micro-batch rows [lo, hi) hold part of a group (rather than whole groups)? Plans hold
    either whole groups or parts of exactly one group."""
    return bool(lo % group_size or hi % group_size)


def fixed_micro_batches(n_rows: int, rows_per_micro: int) -> list[tuple[int, int]]:
    """Row ranges of ``rows_per_micro`` rows each (the count-based micro-batches)."""
    return [(lo, min(lo + rows_per_micro, n_rows)) for lo in range(0, n_rows, rows_per_micro)]


# ----------------------------------------------------------------------------- which models can be packed


def causal_lm_class(model_config):
    """The transformers class ``AutoModelForCausalLM`` builds for this config, or None (a model whose code is
    not in transformers: ``trust_remote_code``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_config), None)


def packing_obstacle(model_config, attention: str, model_class=None, left_padded: bool = False) -> str | None:
    """Why packed rows, run with the attention implementation ``attention``, would not compute what
    padded rows compute for this model (a transformers config); None when they would
    (:meth:`pacs.model.profile.ModelProfile.packing_obstacle` says when). ``model_class``: the model's class
    (default: the one transformers builds for the config; unknown, a model with code of its own, is an
    obstacle). ``left_padded``: the padded rows compared against are left-padded (TRL's prompts)."""
    model_class = causal_lm_class(model_config) if model_class is None else model_class
    return ModelProfile.from_config(model_config).packing_obstacle(attention, model_class, left_padded)


def use_packing(cfg, model_config=None, attention: str = "pacs_packed_sdpa") -> bool:
    """``cfg.train.packing`` resolved: None is packed wherever that is exact (given the model's config,
    :func:`packing_obstacle` with ``attention`` finds nothing); true where it is not: a ValueError saying why."""
    requested = cfg.train.packing
    if requested is False or model_config is None:
        return requested is not False
    why = packing_obstacle(model_config, attention)
    if why is not None and requested:
        raise ValueError(f"train.packing=true cannot be exact for this model: {why}; set train.packing=false")
    return why is None


def switch_attention(causal_lm, attention: str, *, required_by: str | None, off: str) -> bool:
    """Switch ``causal_lm`` (a Hugging Face model) to ``attention``, one that keeps packed sequences apart
    (``pacs_packed_sdpa`` is registered first); whether it runs it now. Where transformers keeps the old
    attention (it may only warn) or refuses, the old one is restored and, when the switch is ``required_by``
    a setting (e.g. "train.packing=true"), a ValueError names it and ``off``, the setting that avoids it."""
    current = causal_lm.config._attn_implementation or "sdpa"
    if attention == current:
        return True
    register_packed_attention()
    try:
        causal_lm.set_attn_implementation(attention)
        failure = None if causal_lm.config._attn_implementation == attention else "transformers kept " + str(
            causal_lm.config._attn_implementation)
    except (ValueError, ImportError) as exc:
        failure = str(exc)
    if failure is None:
        return True
    if causal_lm.config._attn_implementation != current:
        causal_lm.set_attn_implementation(current)
    if required_by:
        raise ValueError(f"{required_by} needs an attention that keeps packed sequences apart, and "
                         f"{type(causal_lm).__name__} cannot switch to {attention} ({failure}); set {off}")
    return False


def enable_packed_attention(causal_lm, device: torch.device) -> str:
    """Switch ``causal_lm`` (a Hugging Face model) to an attention that honours packed sequences;
    padded calls keep working unchanged. Returns the implementation's name."""
    name = packed_attention_implementation(device)
    switch_attention(causal_lm, name, required_by="train.packing", off="train.packing=false")
    return name


def packed_backbone_kwargs(position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """What a Hugging Face backbone takes for a packed row, besides ``input_ids`` and no attention mask:
    ``position_ids`` (RoPE restarts per sequence) and the flash-attention varlen arguments
    ``cu_seq_lens_q/k``, ``max_length_q/k`` (also read by ``pacs_packed_sdpa``)."""
    return dict(position_ids=position_ids, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                max_length_q=max_seqlen, max_length_k=max_seqlen)


def packed_forward(policy, packed: PackedMicroBatch):
    """Run ``policy`` (:class:`pacs.model.policy.Policy`) on a packed micro-batch.

    Returns (hidden (N, d), lm_head_weight (V, d), lm_head_bias (V,) or None). The backbone gets no
    attention mask and :func:`packed_backbone_kwargs`. A model on another attention implementation
    (``sdpa``, ``eager``) still computes the right thing: Hugging Face builds a block-diagonal causal
    mask from the restarting ``position_ids`` (N x N memory).
    """
    # sequence parallelism: this rank's slice of the tokens; the attention trades it (pacs/model/sequence_parallel.py)
    split = {} if packed.shard is None else {SEQUENCE_PARALLEL_KWARG: packed.shard.sp}
    backbone = packed_backbone_kwargs(packed.position_ids, packed.cu_seqlens, packed.max_seqlen)
    with packed_call(packed.cu_seqlens.tolist()):
        hidden, weight, bias = policy(packed.input_ids, None, **split, **backbone)
    return hidden.reshape(-1, hidden.shape[-1]), weight, bias


# ----------------------------------------------------------------------------- either layout


def micro_batch_ranges(lengths: list[int], lo: int, hi: int, *, group_size: int, rows_per_micro: int,
                       max_tokens: int | None, packed: bool,
                       setting: str = "train.max_tokens_per_micro_batch") -> list[tuple[int, int]]:
    """Row ranges of the micro-batches of rows ``[lo, hi)`` (``lo`` a group boundary):
    ``rows_per_micro`` rows each when ``max_tokens`` is None, else whole groups within the token
    budget, a group larger than it in parts of whole rows (:func:`plan_micro_batches`, counting
    packed tokens when ``packed``, rows x longest row otherwise)."""
    if max_tokens is None:
        plan = fixed_micro_batches(hi - lo, rows_per_micro)
    else:
        plan = plan_micro_batches(lengths[lo:hi], group_size, max_tokens, padded=not packed, setting=setting,
                                  split_groups=True)
    return [(lo + a, lo + b) for a, b in plan]


def to_layout(part, lo: int, padded: torch.Tensor) -> torch.Tensor:
    """A per-token tensor of the whole padded batch (B_total, L) -> the layout of ``part`` (rows
    ``[lo, ...)``): (N,) when packed, (b, T) padded."""
    if isinstance(part, PackedMicroBatch):
        return part.take(padded)
    return padded[lo:lo + part.targets.shape[0], :part.targets.shape[1]]


def forward_micro_batch(policy, part):
    """(hidden, lm_head_weight, lm_head_bias) of a micro-batch: hidden (N, d) packed, (b, T, d) padded."""
    if isinstance(part, PackedMicroBatch):
        return packed_forward(policy, part)
    return policy(part.input_ids, part.attention_mask)


def response_positions(part, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) in the whole padded batch of the micro-batch's ``mask == 1`` tokens, in the order
    in which ``hidden[part.mask]`` lists them."""
    if isinstance(part, PackedMicroBatch):
        return part.rows[part.mask], part.cols[part.mask]
    rows, cols = part.mask.nonzero(as_tuple=True)
    return rows + lo, cols


def split_to_count(plan: list[tuple[int, int]], count: int, group_size: int) -> list[tuple[int, int]]:
    """Split micro-batches of ``plan`` until there are ``count`` of them: the one with the most rows
    first, at the group boundary nearest its middle when it holds two groups or more, else between
    rows (a group then runs in parts, which the trainer makes exact: pacs/train/update.py, known_gradients). Each part
    costs no more than the micro-batch it came from, so a plan within a token budget stays within it.
    Raises ValueError when ``count`` exceeds the number of rows."""
    plan = list(plan)
    rows = sum(hi - lo for lo, hi in plan)
    if count > rows:
        raise ValueError(f"cannot cut {rows} rows into {count} micro-batches")
    while len(plan) < count:
        i = max(range(len(plan)), key=lambda j: plan[j][1] - plan[j][0])
        lo, hi = plan[i]
        middle = (lo + hi) / 2
        boundaries = range(lo - lo % group_size + group_size, hi, group_size)
        mid = min(boundaries, key=lambda b: abs(b - middle)) if boundaries else (lo + hi) // 2
        plan[i:i + 1] = [(lo, mid), (mid, hi)]
    return plan


def same_count_on_every_rank(plan: list[tuple[int, int]], group_size: int, world_size: int,
                             device: torch.device) -> list[tuple[int, int]]:
    """Under FSDP every rank must run the same number of forwards and backwards (each one gathers
    parameters and reduces gradients collectively), but token budgets cut each rank's groups
    differently: all ranks take the largest count, splitting their own micro-batches to reach it."""
    if world_size <= 1:
        return plan
    import torch.distributed as dist

    count = torch.tensor([len(plan)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return split_to_count(plan, int(count), group_size)
