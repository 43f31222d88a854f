"""pacs: a lean RLVR trainer (PACS or GRPO) on top of the pacs_kernels fused losses.

Entry point: ``pacs train | eval | bench`` (pacs/cli.py); the loop is pacs/train/loop.py.
"""


def __getattr__(name: str):
    """``pacs.__version__``: pacs_kernels' (one version source, read by pyproject.toml), imported when asked for,
    so that importing a light part of pacs (its config, pacs/config/) does not import the kernels and torch."""
    if name == "__version__":
        from pacs_kernels import __version__

        return __version__
    raise AttributeError(f"module 'pacs' has no attribute {name!r}")
