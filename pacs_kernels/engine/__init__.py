"""The loss engine: the checked batch (batch.py), the plan (plan.py, from a device profile: device.py) and one
module per path that executes a plan (single_pass.py, two_pass.py, one_sweep.py). The fused entries
(pacs_kernels/fused.py) run them in that order; this package's face hands no names on."""
