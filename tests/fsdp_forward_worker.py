"""One rank of tests/test_model_forward_fsdp.py (run under torchrun, 2 CPU ranks, gloo).

A tiny Llama (untied LM head) sharded with FSDP2 in each of ``LAYOUTS`` (each decoder layer, then
the LM head where the layout puts it, then the root), the PACS loss called through
``model(..., pacs_batch=...)``: each rank trains on its own group; the gathered gradients are
written to OUT_DIR/rank{R}_{layout}.pt, and rank 0 also writes the single-process reference
OUT_DIR/reference.pt (the unsharded model, the mean of the two groups' losses). Last, an LM head whose
weight is a DTensor without FSDP's hooks (as tensor parallelism makes it): the ValueError's message
goes to OUT_DIR/rank{R}_refused.txt. And under FSDP2's bf16 mixed precision (which casts the float
tensors of the forward's arguments): the dtypes the loss receives, OUT_DIR/rank{R}_bf16_inputs.json."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_helpers as helpers  # noqa: E402
from trainer_helpers import leave_distributed_run  # noqa: E402

from pacs.model.model_forward import PACSBatch, add_pacs_forward  # noqa: E402
from pacs_kernels import PACSLoss  # noqa: E402

G, P, C, V = 4, 5, 6, 17
# Where the LM head's parameters live: in the root unit (pacs/model/policy.py's layout); a unit of its own,
# resharded after its forward; with the final norm, kept unsharded (accelerate 1.15's FSDP2 layout,
# the input embedding a unit of its own).
LAYOUTS = ("head_in_root", "head_alone", "head_with_norm")


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


def shard(model, layout: str) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if layout == "head_alone":
        fully_shard(model.lm_head)
    elif layout == "head_with_norm":
        fully_shard(model.model.embed_tokens)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    elif layout != "head_in_root":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    fully_shard(model)


def refusal_of_a_distributed_head(rank: int) -> str:
    """The message of the ValueError that the loss raises on a DTensor LM head, or '' if none is raised."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    model = helpers.tiny_model(V)
    add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
    try:
        loss_of(model, rank)
    except ValueError as error:
        return str(error)
    return ""


def dtypes_under_bf16_mixed_precision(model, rank: int) -> dict:
    """{name: dtype} of the PACSBatch tensors the loss receives when FSDP2 runs in bf16 (accelerate's bf16
    policy: parameters in bf16, cast_forward_inputs=True), the caller passing float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from pacs.model import model_forward

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    seen = {}
    head_loss = model_forward.pacs_head_loss

    def recording_head_loss(loss_fn, hidden, weight, bias, batch):
        seen.update({name: str(getattr(batch, name).dtype) for name in ("old_logp", "rewards", "mask")})
        seen["hidden"], seen["weight"] = str(hidden.dtype), str(weight.dtype)
        return head_loss(loss_fn, hidden, weight, bias, batch)

    model_forward.pacs_head_loss = recording_head_loss
    try:
        loss_of(model, rank)
    finally:
        model_forward.pacs_head_loss = head_loss
    return seen


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = helpers.tiny_model(V)
    for layout in LAYOUTS:
        model = copy.deepcopy(reference)
        add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0)
        shard(model, layout)
        loss_of(model, rank).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        torch.save(grads, os.path.join(out_dir, f"rank{rank}_{layout}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}_refused.txt"), "w") as f:
        f.write(refusal_of_a_distributed_head(rank))
    model = copy.deepcopy(reference)
    add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0)
    with open(os.path.join(out_dir, f"rank{rank}_bf16_inputs.json"), "w") as f:
        json.dump(dtypes_under_bf16_mixed_precision(model, rank), f)
    if rank == 0:
        add_pacs_forward(reference, PACSLoss(group_size=G), temperature=1.0)
        ((loss_of(reference, 0) + loss_of(reference, 1)) / 2).backward()
        torch.save({name: p.grad for name, p in reference.named_parameters()}, os.path.join(out_dir, "reference.pt"))
    leave_distributed_run()  # every rank's results are written: leave without teardown


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
