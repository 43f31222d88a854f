"""One rollout step's rows as tensors: prompt + response, right-padded, groups contiguous, with the mask of
the positions that predict response tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Padded (right) prompt+response rows of one rollout step, groups contiguous.

    input_ids, attention_mask: (B, L) int64; targets: (B, L) the next token at each position;
    mask: (B, L) bool, True where ``targets`` is a response token; rewards: (B,) float32.
    valid: (B,) bool or None: False for a response the loss leaves out (PACS: weight 0, out of the class counts;
    pacs/train/rollout_correction.py), None: all count. sampler_logp: (B, L) float32 or None: the rollout engine's
    log-prob of each response token as it sampled it (0 off the mask). token_weights: (B, L) float64 or None: the
    rollout correction's truncated importance weight of each response token (the loss's ``token_weights=``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    valid: torch.Tensor | None = None
    sampler_logp: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None

    def _map(self, fn) -> "Batch":
        return Batch(*(None if t is None else fn(t) for t in (self.input_ids, self.attention_mask, self.targets,
                                                               self.mask, self.rewards, self.valid, self.sampler_logp,
                                                               self.token_weights)))

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop), trimmed to their longest row."""
        width = int(self.attention_mask[start:stop].sum(1).max())
        return self._map(lambda t: t[start:stop, :width] if t.dim() == 2 else t[start:stop])

    def select(self, rows: torch.Tensor) -> "Batch":
        """The rows in the order ``rows`` (a permutation), full width."""
        return self._map(lambda t: t.index_select(0, rows))

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device))


def build_batch(prompts: list[list[int]], responses: list[list[int]], rewards: list[float],
                pad_token_id: int, sampler_logprobs: list[list[float]] | None = None) -> Batch:
    """Rows ``prompt + response`` (``len(responses)`` rows; prompt i // n for response i when the
    caller repeated prompts). The loss mask covers the positions that predict response tokens.
    ``sampler_logprobs``: per response, the engine's log-prob of each of its tokens (-> ``Batch.sampler_logp``)."""
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, :len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention[i, :len(p) + len(r)] = 1
        mask[i, len(p) - 1:len(p) + len(r) - 1] = True  # position t predicts token t + 1
    targets = torch.roll(input_ids, -1, dims=1)
    targets[:, -1] = pad_token_id
    sampler_logp = None
    if sampler_logprobs is not None:
        if [len(x) for x in sampler_logprobs] != [len(r) for r in responses]:
            raise ValueError("sampler_logprobs must hold one log-prob per response token")
        sampler_logp = torch.zeros(n, width, dtype=torch.float32)
        # the mask's positions, row by row in order, are exactly the response tokens
        sampler_logp[mask] = torch.tensor([v for row in sampler_logprobs for v in row], dtype=torch.float32)
    return Batch(input_ids, attention, targets, mask, torch.tensor(rewards, dtype=torch.float32),
                 sampler_logp=sampler_logp)
