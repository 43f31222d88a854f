"""benchmarks/gpu.sh, the prepared GPU run: its CPU dry run (every step of every part at tiny shapes, in the
order of value: correctness, the loss race, the training steps, the peers, the grids), each part packed into
OUT/<part>.tgz; its argument checks; and the TRL peer it races (trl.kernels, TRL 1.15+) against naive."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.sh"
# every step's stamp, in the order the script must run them
STEPS = ["1/4", "1b/4", "2/4", "3/4", "4/4", "5/8", "5b/8", "6/8", "7/8", "8/8", "9/12", "10/12", "11/12", "12/12",
         "grid 1/2", "grid 2/2"]


def _run(args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_usage_and_unknown_parts_are_refused(tmp_path):
    done = _run([])
    assert done.returncode == 2 and "usage: bash benchmarks/gpu.sh [--dry-run] OUT_DIR" in done.stderr
    done = _run(["--dry-run", str(tmp_path)], env={"PACS_GPU_PART": "everything"})
    assert done.returncode == 2 and "PACS_GPU_PART must be race, long, peers, grid or all" in done.stderr


@pytest.mark.slow
def test_dry_run_runs_every_step_in_order_and_packs_each_part(tmp_path):
    env = {"PYTHON": sys.executable, "PACS_GPU_WORK": str(tmp_path / "work")}
    done = _run(["--dry-run", str(tmp_path / "out")], env=env, timeout=3000)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert done.returncode == 0, log[-4000:]
    assert "!!!" not in log, [line for line in log.splitlines() if "!!!" in line]
    found = [next((m.start() for m in re.finditer(rf"\] {re.escape(step)}[ :]", log)), -1) for step in STEPS]
    assert -1 not in found, [step for step, at in zip(STEPS, found) if at < 0]
    assert found == sorted(found), "the parts ran out of their order of value"
    assert "[check] all cases within tolerance" in log
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "grid.tgz", "log.txt", "long.tgz", "peers.tgz", "race.tgz"]  # within the device tool's 8 files
    packed = {}
    for part in ("race", "long", "peers", "grid"):
        with tarfile.open(tmp_path / "out" / f"{part}.tgz") as archive:
            packed[part] = {Path(name).relative_to(part).as_posix() for name in archive.getnames() if name != part}
    assert {"correctness.txt", "gpu_grad_gemms.csv", "loss_grid_dry.csv", "loss_grid_dry_paired.csv",
            "dispatch.json", "device_profile.txt", "device_profile/device_profiles.json"} <= packed["race"]
    assert {"train_smoke_metrics.jsonl", "train_smoke.log"} <= packed["long"]
    assert {"peers_check.txt", "loss_grid_dry.csv", "gpu.csv"} <= packed["peers"]
    assert {"loss_grid_dry.csv", "loss_grid_dry_dapo.csv"} <= packed["grid"]
    # the peers' race has a row per peer: timed, or the reason it could not run (never silently absent)
    peers_csv = (tmp_path / "work" / "peers" / "loss_grid_dry.csv").read_text()
    for column in ("naive", "cce", "liger_chunked", "trl_chunked"):
        assert re.search(rf",{column},", peers_csv), column


def test_trl_peer_gives_naive_log_probs_and_gradients():
    pytest.importorskip("trl")
    from benchmarks.ops import impl_unavailable_reason, logprob_function

    if impl_unavailable_reason("logprobs_fwd_bwd", "trl_chunked", "cpu"):
        pytest.skip(impl_unavailable_reason("logprobs_fwd_bwd", "trl_chunked", "cpu"))
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(37, 16, generator=gen), torch.randn(300, 16, generator=gen) / 4
    targets, upstream = torch.randint(0, 300, (37,), generator=gen), torch.randn(37, generator=gen)
    grads = []
    for impl in ("trl_chunked", "naive"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = logprob_function(impl)(h, w, targets)
        logp.backward(upstream)
        grads.append((logp.detach(), h.grad, w.grad))
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
