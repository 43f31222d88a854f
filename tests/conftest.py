"""Test set-up. Triton kernels run on the CPU through Triton's interpreter, which must be
switched on before triton (and our kernels) are first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# path="auto"'s device calibration stays in memory, in worker processes too (no cache under the home directory)
os.environ.setdefault("PACS_KERNELS_NO_DISK_CACHE", "1")


# A shell without job control starts background jobs with SIGINT ignored, and the processes the tests start
# (pacs train, torchrun) would inherit that: the Ctrl-C tests would see no KeyboardInterrupt. Python's own
# handler here means they start with the default action instead.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
