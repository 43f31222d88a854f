"""pacs_kernels: fused linear log-probs and the PACS loss, without materializing N x V logits."""

from .fused import PACSLoss, fused_linear_grpo_loss, fused_linear_objective_loss, fused_linear_pacs_loss
from .known_grad import linear_logprobs_known_grad
from .logprobs import linear_logprobs
from .objectives import CISPO, DAPO, GRPO, GSPO, PACS, Capabilities, DrGRPO, Objective
from .objectives.grpo_math import GRPOStats, grpo_loss
from .objectives.pacs_math import PACSStats, pacs_loss
from .options import LossOptions
from .pieces import GatheredLogprobs, KnownGradient, known_gradient_on_rows

__all__ = [
    "linear_logprobs",
    "linear_logprobs_known_grad",
    "pacs_loss",
    "PACSStats",
    "fused_linear_pacs_loss",
    "PACSLoss",
    "grpo_loss",
    "fused_linear_grpo_loss",
    "GRPOStats",
    "fused_linear_objective_loss",
    "LossOptions",
    "KnownGradient",
    "GatheredLogprobs",
    "known_gradient_on_rows",
    "Objective",
    "GRPO",
    "DAPO",
    "DrGRPO",
    "GSPO",
    "CISPO",
    "PACS",
    "Capabilities",
]
__version__ = "0.1.0"
