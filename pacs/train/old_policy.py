"""The old policy's log-probs: one no-grad pass of the current policy over a rollout step's responses, in
chunks of whole groups, before its updates (PACS's reference, reset every rollout step; GRPO's ratio's
denominator); the rollout correction measured against them; PACS's reference kept across rollout steps."""

from __future__ import annotations

import torch

from pacs.config import Config, micro_batch_groups
from pacs.model.packing import (
    backend_for,
    forward_micro_batch,
    micro_batch_ranges,
    response_positions,
    same_count_on_every_rank,
    slice_micro_batch,
)
from pacs.model.policy import DistInfo
from pacs.model.reference_policy import is_reset_step
from pacs.model.sequence_parallel import SequenceParallel, reduce_over_group
from pacs.train.batch import Batch
from pacs.train.loss_objective import loss_objective, takes_response_validity
from pacs.train.rollout_correction import Band
from pacs.train.rollout_correction import correct as correct_rollouts
from pacs.train.training import Training
from pacs.train.update_batch import UpdateBatch, update_batch
from pacs_kernels import linear_logprobs


def old_policy_ranges(cfg: Config, batch: Batch, dist_info: DistInfo, packed: bool) -> list[tuple[int, int]]:
    """Row ranges of the no-grad old-policy pass: whole groups, within ``train.old_policy_max_tokens``
    (else the micro-batch token budget), the same count on every rank (FSDP's collectives)."""
    tr, group = cfg.train, cfg.rollout.group_size
    lengths = batch.attention_mask.sum(1).tolist()
    ranges = micro_batch_ranges(
        lengths, 0, len(lengths), group_size=group, rows_per_micro=micro_batch_groups(cfg) * group,
        max_tokens=tr.old_policy_max_tokens or tr.max_tokens_per_micro_batch, packed=packed,
        setting="train.old_policy_max_tokens" if tr.old_policy_max_tokens else "train.max_tokens_per_micro_batch")
    return same_count_on_every_rank(ranges, group, dist_info.world_size, dist_info.device)


@torch.no_grad()
def old_policy_logprobs(policy, batch: Batch, ranges: list[tuple[int, int]], temperature: float, backend: str,
                        packed: bool = False, sp: SequenceParallel | None = None,
                        fillers: list[tuple[int, int]] = ()):
    """(B, L) log-probs of the targets under the current policy (0 off the mask), their (B, L)
    log-sum-exp (for the one-sweep first step), and the mean entropy of the policy over response
    tokens. One no-grad pass in chunks: the row ranges ``ranges``, packed or padded; with ``sp`` each
    rank of the group does its tokens of each chunk and the group adds up the results. ``fillers``: more
    forwards whose results are dropped (FSDP: a rank with fewer chunks than another runs as many)."""
    old_logp = torch.zeros(batch.targets.shape, dtype=torch.float32, device=batch.targets.device)
    old_lse = torch.zeros_like(old_logp)
    entropy_sum, tokens = 0.0, 0
    for i, (lo, hi) in enumerate([*ranges, *fillers]):
        part = slice_micro_batch(batch, lo, hi, packed, sp)
        selected, rows, cols = part.mask, *response_positions(part, lo)
        chunk_backend = backend_for(selected, backend)
        hidden, weight, bias = forward_micro_batch(policy, part)
        logp, entropy, lse = linear_logprobs(hidden[selected], weight, part.targets[selected], bias=bias,
                                             **policy.head_options(temperature), return_entropy=True, return_lse=True,
                                             backend=chunk_backend)
        if i >= len(ranges):  # a filler: under sequence parallelism its tokens may sit on other ranks than in
            continue          # the chunk that wrote them, and the group's sum would count them twice
        old_logp[rows, cols] = logp.to(old_logp.dtype)  # float32 buffers, also for a float64 model
        old_lse[rows, cols] = lse.to(old_lse.dtype)
        entropy_sum += float(entropy.sum())
        tokens += int(part.mask.sum())
    if sp is not None:  # each token was written by one rank of the group, 0 elsewhere
        totals = torch.tensor([entropy_sum, tokens], dtype=torch.float64, device=old_logp.device)
        reduce_over_group([old_logp, old_lse, totals], sp)
        entropy_sum, tokens = float(totals[0]), int(totals[1])
    return old_logp, old_lse, entropy_sum / max(tokens, 1)


def old_policy_pass(t: Training, step: int, batch: Batch) -> tuple[UpdateBatch, float]:
    """The old-policy log-probs of the step's response tokens (the policy that sampled), the rollout correction
    measured against them (``t.mismatch``; the batch it leaves, masked by advanced.rollout_correction.mode), then
    PACS's reference: reset every optim.ref_reset_every rollout steps, in between its own no-grad pass. Returns
    the batch as the updates learn from it, in the run's layout, and the policy's mean entropy over the response
    tokens."""
    cfg, o, r, dist_info, reference = t.cfg, t.cfg.optim, t.cfg.rollout, t.dist_info, t.reference
    ranges = old_policy_ranges(cfg, batch, dist_info, t.packed)
    old_logp, old_lse, entropy = old_policy_logprobs(t.policy, batch, ranges, r.temperature, o.logprob_backend,
                                                     t.packed, dist_info.sp)
    # the sampler's log-probs against the policy that sampled: measured; masked by advanced.rollout_correction.mode
    batch, mismatch = correct_rollouts(batch, old_logp, cfg.rollout_correction.mode, Band.of(cfg),
                                       response_valid=takes_response_validity(loss_objective(cfg)))
    t.mismatch = mismatch.all_ranks(dist_info.device, dist_info.world_size).columns()
    rollout_logp = None
    if reference is not None:
        if reference.weights is None and not is_reset_step(step, o.ref_reset_every):
            t.say(f"[train] step {step}: the checkpoint kept no reference weights (written with "
                  "advanced.optim.ref_reset_every=1?): the reference is reset to the current policy now")
        if reference.weights is None or is_reset_step(step, o.ref_reset_every):
            reference.take(step)
        else:
            rollout_logp = old_logp
            with reference.weights_in():
                old_logp, _, _ = old_policy_logprobs(t.policy, batch, ranges, r.temperature, o.logprob_backend,
                                                     t.packed, dist_info.sp)
    return update_batch(cfg, batch, old_logp, old_lse, rollout_logp, t.packed, dist_info.sp), entropy
