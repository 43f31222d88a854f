"""Validation and layout of the inputs of the group losses (PACS and GRPO).

Two layouts of per-token tensors (log-probs, old log-probs, mask):

* padded: ``(B, T)``, one response per row;
* packed: ``(N,)`` (or ``(1, N)``), every token of the micro-batch in one row, with
  ``cu_seqlens`` ``(B + 1,)`` giving response ``i`` the tokens ``cu_seqlens[i]:cu_seqlens[i+1]``.

``ResponseLayout`` records which one is in use so that the loss code can compute the
per-response sums without padding. The checks here cost a few small reductions (device syncs
on GPU); every failure is a ``ValueError``/``TypeError`` naming the argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checks import FLOAT_DTYPES, INT_DTYPES, check_choice, check_no_inf_where, check_same_device, check_tensor

SCORES = ("log_ratio", "mean_logp")
ADVANTAGES = ("rloo", "grpo", "naive")
WEIGHTINGS = ("balanced", "none", "positive_only", "negative_only")
LOSS_BACKENDS = ("auto", "triton", "torch")
MASK_DTYPES = (torch.bool,) + INT_DTYPES + FLOAT_DTYPES
GRPO_STD_EPS = 1e-6  # the public code's epsilon in (x - mean) / (std + eps), for scores and rewards alike


@dataclass(frozen=True)
class ResponseLayout:
    """Where each response's tokens live in the flattened per-token tensors.

    n_responses: B.  padded_len: T for the padded layout, None for packed.
    cu_seqlens: (B + 1,) int64 token offsets for the packed layout (None when padded).
    max_len: the longest response, in tokens (T when padded).
    """

    n_responses: int
    padded_len: int | None
    cu_seqlens: torch.Tensor | None
    max_len: int

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> "ResponseLayout":
        """The packed layout of responses holding ``counts`` (B,) tokens each, back to back."""
        offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=counts.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        return cls(counts.shape[0], None, offsets, int(counts.max()) if counts.numel() else 0)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def segment_ids(self) -> torch.Tensor:
        """(N,) int64: the response index of every token (packed layout only)."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(
            torch.arange(self.n_responses, device=lengths.device), lengths,
            output_size=int(self.cu_seqlens[-1]))

    def offsets(self, device: torch.device) -> torch.Tensor:
        """(B + 1,) int64 token offsets for either layout (padded rows are T apart)."""
        if self.cu_seqlens is not None:
            return self.cu_seqlens
        return torch.arange(self.n_responses + 1, device=device, dtype=torch.int64) * self.padded_len


def check_group_size(group_size, n_responses: int, advantage: str) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {group_size!r}")
    minimum = 1 if advantage == "naive" else 2
    if group_size < minimum:
        raise ValueError(
            f"group_size must be >= {minimum} for advantage={advantage!r} "
            + ("(the estimator compares each response with the others of its group)" if minimum == 2 else "")
            + f", got {group_size}")
    if n_responses % group_size != 0:
        raise ValueError(
            f"the batch size B = {n_responses} (rows of rewards) must be divisible by "
            f"group_size = {group_size}: each group's responses are contiguous")
    return group_size


def check_beta(beta, name: str = "beta") -> float:
    """PACS's score scale: a finite number > 0 (0 makes every score 0 and the loss constant; a negative
    one rewards the wrong answers)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or not beta > 0:
        raise ValueError(f"{name} must be a finite number > 0 (PACS's score scale), got {beta!r}")
    return float(beta)


def check_response_rewards(rewards, n_responses: int, device: torch.device) -> None:
    """A real-valued reward per response (the GRPO family's): a (B,) tensor on the hidden states' device."""
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    check_tensor("rewards", rewards, ndim=1)
    if rewards.shape[0] != n_responses or rewards.device != device:
        raise ValueError(f"rewards must have shape (B,) = ({n_responses},) on {device}, "
                         f"got {tuple(rewards.shape)} on {rewards.device}")


def check_rewards(rewards, n_responses: int, weighting: str) -> torch.Tensor:
    """rewards (B,) bool/int/float -> float tensor; labels in {0, 1} unless weighting='none'."""
    check_tensor("rewards", rewards, dtypes=MASK_DTYPES, ndim=1)
    if rewards.shape[0] != n_responses:
        raise ValueError(
            f"rewards must have shape (B,) = ({n_responses},), one label per response, "
            f"got {tuple(rewards.shape)}")
    values = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    if n_responses == 0:
        return values
    if bool(torch.isnan(values).any()):
        raise ValueError("rewards must not contain NaN")
    if weighting == "none":
        lo, hi = float(values.min()), float(values.max())
        if lo < 0 or hi > 1:
            raise ValueError(
                "rewards must lie in [0, 1] (BCE labels) with weighting='none', "
                f"got values in [{lo}, {hi}]")
    elif not bool(((values == 0) | (values == 1)).all()):
        bad = values[(values != 0) & (values != 1)][:4].tolist()
        raise ValueError(
            f"rewards must be 0/1 labels with weighting={weighting!r} (it counts each label per group), "
            f"got values such as {bad}; use weighting='none' for soft labels in [0, 1]")
    return values


def check_valid(valid, rewards: torch.Tensor, n_responses: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """valid (B,) bool/0-1 or None -> (bool tensor or None, rewards with invalid entries set to 0).

    An invalid response (say, its reward function returned None) keeps its score in its group's
    baseline but contributes no loss term and is left out of the class counts; its reward may be NaN.
    """
    if valid is None:
        return None, rewards
    check_tensor("valid", valid, dtypes=MASK_DTYPES, ndim=1)
    if valid.shape[0] != n_responses:
        raise ValueError(f"valid must have shape (B,) = ({n_responses},), one flag per response, "
                         f"got {tuple(valid.shape)}")
    if valid.device != rewards.device:
        raise ValueError(f"valid must be on the device of rewards ({rewards.device}), got {valid.device}")
    if valid.dtype != torch.bool:
        if valid.numel() and not bool(((valid == 0) | (valid == 1)).all()):
            raise ValueError("valid must hold only 0 and 1 (or True/False), got other values")
        valid = valid != 0
    if rewards.dtype.is_floating_point:
        rewards = torch.where(valid, rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device))
    else:
        rewards = rewards * valid.to(rewards.dtype)
    return valid, rewards


def check_group_ids(group_ids, n_responses: int, group_size: int, device: torch.device) -> None:
    """group_ids (B,) int: equal within each block of group_size rows, distinct across blocks."""
    if group_ids is None:
        return
    check_tensor("group_ids", group_ids, dtypes=INT_DTYPES, ndim=1)
    if group_ids.shape[0] != n_responses:
        raise ValueError(f"group_ids must have shape (B,) = ({n_responses},), got {tuple(group_ids.shape)}")
    if group_ids.device != device:
        raise ValueError(f"group_ids must be on {device} with the other tensors, got {group_ids.device}")
    blocks = group_ids.reshape(-1, group_size)
    if not bool((blocks == blocks[:, :1]).all()):
        row = int((blocks != blocks[:, :1]).any(1).nonzero()[0, 0])
        raise ValueError(
            f"group_ids must hold each group's {group_size} responses contiguously: rows "
            f"{row * group_size}..{row * group_size + group_size - 1} carry ids "
            f"{blocks[row].tolist()}")
    firsts = blocks[:, 0]
    if firsts.unique().numel() != firsts.numel():
        raise ValueError(
            "group_ids must give each group of group_size contiguous rows its own id; "
            f"an id is used by more than one block of rows: {firsts.tolist()[:16]}")


def check_mask_values(mask: torch.Tensor) -> torch.Tensor:
    """mask of any dtype holding 0/1 -> bool tensor."""
    if mask.dtype == torch.bool:
        return mask
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1 (1 on response tokens), got other values")
    return mask != 0


def check_cu_seqlens(cu_seqlens, n_tokens: int) -> tuple[torch.Tensor, int]:
    """cu_seqlens (B+1,) int, 0 first, non-decreasing, n_tokens last -> (int64 tensor, max length)."""
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INT_DTYPES, ndim=1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape (B + 1,) with B >= 1, got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != n_tokens or bool((lengths < 0).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at the number of tokens ({n_tokens}), "
            f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''} (last {last})")
    return cu, int(lengths.max())


def check_token_tensors(logp, old_logp, mask, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   ResponseLayout]:
    """Check logp/old_logp/mask and return (logp, old_logp, mask as bool, layout).

    Padded: all (B, T). Packed: all (N,) or (1, N) (squeezed to (N,)) with cu_seqlens (B+1,).
    """
    check_tensor("logp", logp, dtypes=FLOAT_DTYPES)
    check_tensor("old_logp", old_logp, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    for name, value in (("old_logp", old_logp), ("mask", mask)):
        if tuple(value.shape) != tuple(logp.shape):
            raise ValueError(f"{name} must have the shape of logp {tuple(logp.shape)}, got {tuple(value.shape)}")
    check_same_device(logp=logp, old_logp=old_logp, mask=mask, cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        if logp.dim() != 2:
            raise ValueError(
                f"logp must be (B, T) in the padded layout (or pass cu_seqlens for the packed layout), "
                f"got shape {tuple(logp.shape)}")
        layout = ResponseLayout(logp.shape[0], logp.shape[1], None, logp.shape[1])
    else:
        if not (logp.dim() == 1 or (logp.dim() == 2 and logp.shape[0] == 1)):
            raise ValueError(
                f"with cu_seqlens (packed layout) logp must be (N,) or (1, N), got shape {tuple(logp.shape)}")
        logp, old_logp, mask = logp.reshape(-1), old_logp.reshape(-1), mask.reshape(-1)
        cu, max_len = check_cu_seqlens(cu_seqlens, logp.shape[0])
        layout = ResponseLayout(cu.shape[0] - 1, None, cu, max_len)
    mask = check_mask_values(mask)
    check_no_inf_where("old_logp", old_logp, mask)
    return logp, old_logp, mask, layout


def response_token_counts(mask: torch.Tensor, layout: ResponseLayout) -> torch.Tensor:
    """(B,) int64: masked tokens per response."""
    if not layout.packed:
        return mask.sum(-1)
    counts = torch.zeros(layout.n_responses, dtype=torch.int64, device=mask.device)
    return counts.index_add_(0, layout.segment_ids(), mask.to(torch.int64))


def check_options(score: str, advantage: str, weighting: str) -> None:
    check_choice("score", score, SCORES)
    check_choice("advantage", advantage, ADVANTAGES)
    check_choice("weighting", weighting, WEIGHTINGS)
