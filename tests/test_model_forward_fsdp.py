"""add_pacs_forward under FSDP2 (2 CPU ranks, gloo): the loss called through the sharded model's
forward gives the gradients of the single-process loss over both ranks' groups, LM head included,
wherever the LM head's parameters are sharded (the root unit, a unit of its own, with the final norm);
a DTensor LM head that FSDP does not gather (tensor parallel) is refused."""

import json
import os

import pytest
import torch
from fsdp_forward_worker import LAYOUTS
from trainer_helpers import repo_root, run_torchrun


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_forward")
    run_torchrun([os.path.join(repo_root(), "tests", "fsdp_forward_worker.py"), out], "the FSDP forward worker",
                 timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_gradients_equal_single_process(fsdp_run, layout):
    reference = torch.load(fsdp_run / "reference.pt")
    assert reference["lm_head.weight"].abs().max() > 0
    for rank in range(2):
        grads = torch.load(fsdp_run / f"rank{rank}_{layout}.pt")
        assert grads.keys() == reference.keys()
        for name, ref in reference.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")


@pytest.mark.slow
def test_distributed_head_without_fsdp_is_refused(fsdp_run):
    for rank in range(2):
        refused = (fsdp_run / f"rank{rank}_refused.txt").read_text()
        assert "LM head's weight is a DTensor" in refused and "not supported" in refused, refused


@pytest.mark.slow
def test_bf16_mixed_precision_leaves_the_loss_inputs_in_float32(fsdp_run):
    """FSDP2's bf16 policy casts the float tensors of the forward's arguments (dataclasses, dicts, tuples) to
    bf16; PACSBatch is a plain object, so the old log-probs reach the loss in float32 (bf16 would bias psi)
    while the backbone and the head run in bf16."""
    for rank in range(2):
        seen = json.loads((fsdp_run / f"rank{rank}_bf16_inputs.json").read_text())
        assert seen == {"old_logp": "torch.float32", "rewards": "torch.float32", "mask": "torch.int64",
                        "hidden": "torch.bfloat16", "weight": "torch.bfloat16"}, seen
