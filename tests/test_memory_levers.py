"""Each memory lever leaves the step's result unchanged: activation offload (with checkpointing),
FSDP2 CPU offload (one gloo rank), Liger patches (CUDA only; a clear error elsewhere); and the
trainer with packing, token budgets, checkpointing and offload matches the padded trainer."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from test_packing import config, random_batch, tiny_policy
from trainer_helpers import comparable, repo_root, tiny_config

from pacs.model.memory import activation_offload, apply_liger_patches, fsdp_kwargs
from pacs.model.packing import pack_rows
from pacs.model.tiled_mlp import is_tiled
from pacs.train.update import policy_loss


def packed_grads(policy, batch, old_logp, offload: bool):
    policy.zero_grad(set_to_none=True)
    part = pack_rows(batch, 0, batch.input_ids.shape[0])
    with activation_offload(offload, torch.device("cpu")):
        loss, _ = policy_loss(config(), policy, part, part.take(old_logp))
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in policy.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_offload_gives_the_same_gradients(checkpointing):
    policy = tiny_policy(11)
    if checkpointing:
        policy.causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = random_batch(12)
    old_logp = torch.randn(batch.targets.shape, dtype=torch.float64) * 0.1 - 3.0
    loss_ref, grads_ref = packed_grads(policy, batch, old_logp, offload=False)
    loss, grads = packed_grads(policy, batch, old_logp, offload=True)
    assert torch.equal(loss, loss_ref)
    assert any(g.abs().max() > 1e-6 for g in grads_ref.values())
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-12, atol=0.0, msg=name)


def test_activation_offload_switch():
    assert isinstance(activation_offload(True, torch.device("cpu")), torch.autograd.graph.save_on_cpu)
    assert isinstance(activation_offload(False, torch.device("cpu")), contextlib.nullcontext)
    assert fsdp_kwargs(False) == {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert isinstance(fsdp_kwargs(True)["offload_policy"], CPUOffloadPolicy)


FSDP_WORKER = r"""
import copy, os, sys, torch, torch.distributed as dist
sys.path.insert(0, "tests")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from test_packing import config, random_batch, tiny_policy
from pacs.model.memory import fsdp_kwargs
from pacs.model.packing import pack_rows
from pacs.model.layers import decoder_layers
from pacs.train.update import policy_loss

reference = tiny_policy(21, dtype=torch.float32)
sharded = copy.deepcopy(reference)
mesh = init_device_mesh("cpu", (1,))
for layer in decoder_layers(sharded.causal_lm):
    fully_shard(layer, mesh=mesh, **fsdp_kwargs(True))
fully_shard(sharded, mesh=mesh, **fsdp_kwargs(True))
batch = random_batch(22)
part = pack_rows(batch, 0, batch.input_ids.shape[0])
old = part.take(torch.randn(batch.targets.shape) * 0.1 - 3.0)
for policy in (reference, sharded):
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    for _ in range(2):
        loss, _ = policy_loss(config(), policy, part, old)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
moved = 0.0
for (name, a), (_, b) in zip(reference.named_parameters(), sharded.named_parameters()):
    assert isinstance(b, DTensor) and b.device.type == "cpu", name
    torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6, msg=name)
moved = max(float((a.detach() - p.detach()).abs().max()) for a, p in zip(reference.parameters(),
            tiny_policy(21, dtype=torch.float32).parameters()))
assert moved > 1e-3, moved
dist.destroy_process_group()
print("FSDP_CPU_OFFLOAD_OK")
"""


@pytest.mark.slow
def test_fsdp_cpu_offload_on_one_gloo_rank_matches_plain_training():
    """FSDP2 with CPUOffloadPolicy (parameters, gradients, optimizer state on the host): two AdamW
    steps on a packed micro-batch end at the same weights as the unsharded model."""
    port = str(29500 + os.getpid() % 400)
    env = {**os.environ, "PYTHONPATH": repo_root(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", FSDP_WORKER, port], cwd=repo_root(), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "FSDP_CPU_OFFLOAD_OK" in done.stdout, done.stderr[-3000:]


def test_liger_patches_need_cuda_and_liger():
    policy = tiny_policy(31, dtype=torch.float32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="train.liger_patches needs a CUDA device"):
            apply_liger_patches(policy.causal_lm, torch.device("cpu"))
        return
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install liger-kernel"):
            apply_liger_patches(policy.causal_lm, torch.device("cuda"))
        return
    policy = policy.cuda()
    x = torch.randint(0, 48, (2, 9), device="cuda")
    before, _, _ = policy(x, None)
    apply_liger_patches(policy.causal_lm, torch.device("cuda"))
    after, _, _ = policy(x, None)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def assert_rows_match(rows_a, rows_b, keys=None):
    assert len(rows_a) == len(rows_b) == 3
    for a, b in zip(rows_a, rows_b):
        assert a.keys() == b.keys()
        for key in keys or a:
            if key not in a:
                continue
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6, nan_ok=True), key
            else:
                assert b[key] == a[key], key


@pytest.mark.slow
def test_trainer_packed_with_levers_matches_padded(tmp_path, monkeypatch):
    """Two rollout steps, same seeded rollouts: padded micro-batches; packed ones of the same
    groups; packed token-budget micro-batches with checkpointing, activation offload, the tiled MLP and
    the old-policy pass in small chunks (a different cut of the mini-batch): every metric (each the step's
    whole batch's, pacs/train/loss_statistics.py) and the weights equal, up to float rounding."""
    from pacs.train import old_policy, train, update
    from pacs.train.metrics import read_metrics

    cuts = []  # the token-budget run's micro-batches (row ranges)

    def recorded(*args, **kwargs):
        cuts.append(real(*args, **kwargs))
        return cuts[-1]

    cache = tmp_path / "cache"
    common = ["max_steps=2", "rollout.engine=hf", "eval.every=0", "checkpoint_every=0", "optim.lr_schedule=constant",
              "optim.micro_batch_groups=1"]
    runs = {
        "padded": train(tiny_config(tmp_path / "padded", cache, *common, "train.packing=false")),
        "packed": train(tiny_config(tmp_path / "packed", cache, *common, "train.packing=true")),
    }
    real = update.micro_batch_ranges  # (the old-policy pass's cut and the mini-batches')
    monkeypatch.setattr(old_policy, "micro_batch_ranges", recorded)
    monkeypatch.setattr(update, "micro_batch_ranges", recorded)
    runs |= {
        "budget": train(tiny_config(
            tmp_path / "budget", cache, *common, "train.packing=true", "train.max_tokens_per_micro_batch=72",
            "advanced.train.old_policy_max_tokens=40", "train.offload_activations=true",
            "model.gradient_checkpointing=true",
            "train.tiled_mlp=true", "advanced.train.mlp_tile_tokens=5")),
    }
    rows = {k: comparable(read_metrics(os.path.join(r.output_dir, "metrics.jsonl"))) for k, r in runs.items()}
    assert rows["padded"][1]["grad_norm"] > 0
    assert all(is_tiled(layer.mlp) and layer.mlp.tiled_mlp_tokens == 5
               for layer in runs["budget"].policy.causal_lm.model.layers)  # train.tiled_mlp reached the model
    assert_rows_match(rows["padded"], rows["packed"])
    # single_label_grad_share alone is combined approximately over micro-batches (pacs/train/loss_statistics.py)
    assert_rows_match(rows["padded"], rows["budget"], sorted({k for row in rows["padded"] for k in row}
                                                             - {"single_label_grad_share"}))
    group = 4  # TINY's rollout.group_size; optim.micro_batch_groups=1: one group per micro-batch without a budget
    assert any(hi - lo > group for plan in cuts for lo, hi in plan)  # a different cut: several groups at once
    for other in ("packed", "budget"):
        for (name, a), (_, b) in zip(runs["padded"].policy.named_parameters(), runs[other].policy.named_parameters()):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"{other}: {name}")


@pytest.mark.slow
def test_two_fsdp_ranks_with_token_budgets_match_one_process(tmp_path):
    """Token budgets cut each rank's groups on its own; the ranks agree on the number of
    micro-batches (FSDP's collectives need it) and train the same weights as one process (the two
    ranks with the tiled MLP inside their FSDP2 units, the one process without)."""
    import json

    from test_trainer_fsdp import close, run_worker

    extra = ("train.packing=true", "train.max_tokens_per_micro_batch=72", "advanced.train.old_policy_max_tokens=40")
    run_worker(tmp_path / "one", tmp_path / "cache", 1, *extra)
    run_worker(tmp_path / "two", tmp_path / "cache", 2, *extra, "train.tiled_mlp=true",
                          "advanced.train.mlp_tile_tokens=5")
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    ranks = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["pushes"][0] != ranks[0]["pushes"][1], "training must change the weights"
    assert close(ranks[0]["final"], one["final"])
    assert (ranks[0]["tiled_mlps"], ranks[1]["tiled_mlps"], one["tiled_mlps"]) == (2, 2, 0)
    # AdamW's update is blind to a gradient's scale: the gradient norms are compared too
    assert ranks[0]["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
