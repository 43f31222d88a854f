"""Training: the loop, its run directory, checkpoints, preflight, stop signals, metrics and the console."""
