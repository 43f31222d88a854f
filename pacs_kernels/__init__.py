"""pacs_kernels: fused linear log-probs and the PACS loss, without materializing N x V logits."""

from .logprobs import linear_logprobs
from .loss import PACSStats, pacs_loss
from .fused import PACSLoss, fused_linear_pacs_loss
from .grpo import GRPOStats, fused_linear_grpo_loss, grpo_loss

__all__ = [
    "linear_logprobs",
    "pacs_loss",
    "PACSStats",
    "fused_linear_pacs_loss",
    "PACSLoss",
    "grpo_loss",
    "fused_linear_grpo_loss",
    "GRPOStats",
]
__version__ = "0.1.0"
