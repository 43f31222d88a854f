"""pacs: a lean RLVR trainer (PACS or GRPO) on top of the pacs_kernels fused losses.

Entry point: ``pacs train | eval | bench`` (pacs/cli.py); the loop is pacs/train/loop.py.
"""

from pacs_kernels import __version__  # noqa: F401  (one version source, read by pyproject.toml)
