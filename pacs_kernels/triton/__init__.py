"""Triton kernels. Import this package only after deciding to use Triton (it imports triton).

Under ``TRITON_INTERPRET=1`` (set before the first import) the kernels run on the CPU through
Triton's interpreter; that is how the test-suite checks them on machines without a GPU.
"""

from .launch_config import INTERPRETED
from .logprob_backward import logprob_backward
from .logprob_forward import logprob_forward

__all__ = ["INTERPRETED", "logprob_forward", "logprob_backward"]
