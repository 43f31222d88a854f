"""pacs_kernels: fused linear log-probs and the PACS loss, without materializing N x V logits."""

from .logprobs import linear_logprobs

__all__ = ["linear_logprobs"]
__version__ = "0.1.0"
