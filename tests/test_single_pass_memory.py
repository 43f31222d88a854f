"""The single pass holds one chunk's logits, and a group bigger than the budget no more than the
budget: peak RSS measured in fresh processes, as in test_linear_logprobs_memory.py.

One group of 4 responses x 256 tokens at V = 16384: its float32 logits are 64 MiB. With a budget
of the whole group the single pass holds them all; with a budget of an eighth it keeps a few
tiles, rebuilds the rest, and its peak stays near the budget (8 MiB) plus dW (4 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, torch
from pacs_kernels import LossOptions, fused_linear_pacs_loss

def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

budget = float(sys.argv[1])
gen = torch.Generator().manual_seed(0)
group, length, d, v = 4, 256, 64, 16384
hidden = torch.randn(group, length, d, generator=gen).requires_grad_()
weight = (torch.randn(v, d, generator=gen) / 8).requires_grad_()
targets = torch.randint(0, v, (group, length), generator=gen)
mask = torch.ones(group, length, dtype=torch.bool)
with torch.no_grad():
    old = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    old += 0.05 * torch.randn(old.shape, generator=gen)
rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
def run(h, w, t, m, o, b):
    return fused_linear_pacs_loss(h, w, t, m, o, rewards, group_size=group, options=LossOptions(chunk_budget_mib=b),
                                  return_stats=True)
# warm up on a tiny input (pages in the code), with both budgets' code paths
for b in (64.0, 0.001):
    small, _ = run(hidden[:, :8].detach().requires_grad_(), weight[:64].detach().requires_grad_(),
                   targets[:, :8] % 64, mask[:, :8], old[:, :8], b)
    small.backward()
hidden.grad = torch.zeros_like(hidden); weight.grad = torch.zeros_like(weight)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = rss_kib("VmRSS")
loss, stats = run(hidden, weight, targets, mask, old, budget)
loss.backward()
peak = rss_kib("VmHWM")
print(json.dumps({"peak_increase_mib": (peak - base) / 1024, "path": stats.path, "loss": float(loss)}))
"""


def _measure(budget_mib: float) -> dict:
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak-RSS counter")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=root, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(budget_mib)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_group_bigger_than_the_budget_stays_within_the_budget():
    group_logits_mib = 4 * 256 * 16384 * 4 / 2 ** 20  # 64 MiB
    whole = _measure(group_logits_mib)
    eighth = _measure(group_logits_mib / 8)
    assert whole["path"] == eighth["path"] == "single_pass"
    assert whole["loss"] == pytest.approx(eighth["loss"], rel=1e-6)
    assert whole["peak_increase_mib"] > group_logits_mib, whole  # the measurement sees the group's logits
    assert eighth["peak_increase_mib"] < group_logits_mib / 8 + 12, eighth  # budget + dW (4) + small buffers
