"""Triton kernels. Import this package only after deciding to use Triton (it imports triton).

Under ``TRITON_INTERPRET=1`` (set before the first import) the kernels run on the CPU through
Triton's interpreter; that is how the test-suite checks them on machines without a GPU.

Files: logits_tile.py (the shared logits tile), logprob_forward.py (online log-sum-exp),
logprob_backward.py (dz per token chunk; also the one-sweep path), grad_matmuls.py (dh and dW
from dz, no atomics), softmax_rows.py (the single pass's row kernels), group_loss.py (the PACS
group part), launch_config.py (autotune candidates, vocabulary split, chunk size, int32 offsets),
compile_check.py (compile for sm_90 on the CPU: registers, spills, tensor cores), kernel_report.py
(what the GPU compiled and loaded, printed by the GPU run).
"""

from .launch_config import INTERPRETED
from .logprob_backward import logprob_backward
from .logprob_forward import logprob_forward

__all__ = ["INTERPRETED", "logprob_forward", "logprob_backward"]
