"""pacs: a lean RLVR trainer (PACS or GRPO) on top of the pacs_kernels fused losses.

Entry point: ``pacs train | eval | bench`` (pacs/cli.py); the loop is pacs/trainer.py.
"""

__version__ = "0.1.0"
