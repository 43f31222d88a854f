"""add_pacs_forward under FSDP2 (2 CPU ranks, gloo): the loss called through the sharded model's
forward gives the gradients of the single-process loss over both ranks' groups, LM head included."""

import os

import pytest
import torch
from trainer_helpers import repo_root, run_torchrun


@pytest.mark.slow
def test_fsdp2_gradients_equal_single_process(tmp_path):
    worker = os.path.join(repo_root(), "tests", "fsdp_forward_worker.py")
    run_torchrun([worker, tmp_path], "the FSDP forward worker", timeout=600)
    reference = torch.load(tmp_path / "reference.pt")
    assert reference["lm_head.weight"].abs().max() > 0
    for rank in range(2):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        assert grads.keys() == reference.keys()
        for name, ref in reference.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")
