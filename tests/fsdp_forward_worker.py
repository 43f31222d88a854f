"""One rank of tests/test_model_forward_fsdp.py (run under torchrun, 2 CPU ranks, gloo).

A tiny Llama (untied LM head) sharded with FSDP2 (each decoder layer, then the root), the PACS loss
called through ``model(..., pacs_batch=...)``: each rank trains on its own group; the gathered
gradients are written to OUT_DIR/rank{R}.pt, and rank 0 also writes the single-process reference
(the unsharded model, the mean of the two groups' losses)."""

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_helpers as helpers  # noqa: E402
from trainer_helpers import leave_distributed_run  # noqa: E402

from pacs.integrations.model_forward import PACSBatch, add_pacs_forward  # noqa: E402
from pacs_kernels import PACSLoss  # noqa: E402

G, P, C, V = 4, 5, 6, 17


def group_batch(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    prompt = torch.randint(3, V, (G, P), generator=gen)
    completion = torch.randint(3, V, (G, C), generator=gen)
    mask = torch.ones(G, C, dtype=torch.long)
    mask[rank, -2:] = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0]) if rank == 0 else torch.tensor([0.0, 1.0, 0.0, 0.0])
    attention = torch.cat([torch.ones(G, P, dtype=torch.long), mask], 1)
    old = -3 * torch.rand(G, C, generator=gen)  # rollout-time log-probs (off-policy step)
    batch = PACSBatch(targets=completion, mask=mask, rewards=rewards, valid=torch.ones(G, dtype=torch.bool),
                      old_logp=old)
    return torch.cat([prompt, completion], 1), attention, batch


def loss_of(model, rank: int):
    input_ids, attention, batch = group_batch(rank)
    return model(input_ids=input_ids, attention_mask=attention, pacs_batch=batch).loss


def main(out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = helpers.tiny_model(V)
    reference = copy.deepcopy(model)
    add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    loss_of(model, rank).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
    if rank == 0:
        add_pacs_forward(reference, PACSLoss(group_size=G), temperature=1.0)
        ((loss_of(reference, 0) + loss_of(reference, 1)) / 2).backward()
        torch.save({name: p.grad for name, p in reference.named_parameters()}, os.path.join(out_dir, "reference.pt"))
    leave_distributed_run()  # every rank's results are written: leave without teardown


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
