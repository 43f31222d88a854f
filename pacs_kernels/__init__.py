"""pacs_kernels: fused linear log-probs and the PACS loss, without materializing N x V logits."""

from .known_grad import linear_logprobs_known_grad
from .logprobs import linear_logprobs

__all__ = ["linear_logprobs", "linear_logprobs_known_grad"]
__version__ = "0.1.0"
