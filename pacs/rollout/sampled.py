"""What a rollout engine returns when asked for the sampler's log-probs (``generate(..., return_logprobs=True)``)."""

from __future__ import annotations

from typing import NamedTuple


class SampledResponses(NamedTuple):
    """The responses of one ``generate`` call and the sampler's log-prob of each of their tokens.

    ``token_ids[i][j]``: response j of prompt i (as ``generate`` returns without log-probs);
    ``logprobs[i][j][k]``: the log-prob the sampler gave token ``token_ids[i][j][k]`` when it drew it, a float
    (what exactly, the temperature and top-p included, each engine's ``generate`` says).
    """

    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
