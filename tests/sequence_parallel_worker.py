"""One rank of tests/test_sequence_parallel.py (torchrun, 2 CPU ranks, gloo, float64).

A tiny Qwen2 built in code (for each head layout of ``HEADS``: key/value heads split over the ranks,
too few to split, multi-head) and one packed micro-batch of two groups (sequences of odd lengths, so the
row is padded). Each rank computes, on its half of the tokens with the Ulysses attention, the final hidden
states, then the PACS loss on the gathered log-probs (``pacs.model.sequence_parallel.whole_micro_batch``), and
its backward; the ranks' gradients are summed. Rank 0 also runs the same micro-batch in one process
(the packed forward and the loss on the whole row; log-probs from float64 logits in both). Writes OUT_DIR/rank{R}.pt:
{layout: {"hidden": this rank's hidden states, "hidden_reference": the one-process run's (rank 0),
"loss", "loss_reference", "grads", "grads_reference"}, "old_policy": the old-policy pass's results without and
with filler forwards}.

usage: python -m torch.distributed.run --nproc-per-node 2 sequence_parallel_worker.py OUT_DIR
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_helpers import leave_distributed_run  # noqa: E402

from pacs.model.packing import enable_packed_attention, pack_rows, packed_forward, shard_packed  # noqa: E402
from pacs.model.policy import Policy  # noqa: E402
from pacs.model.sequence_parallel import (  # noqa: E402
    enable_sequence_parallel_attention,
    new_sequence_parallel,
    whole_micro_batch,
)
from pacs_kernels import pacs_loss  # noqa: E402

V, G = 23, 2
HEADS = {"kv_split": (4, 2), "kv_repeated": (4, 1), "multi_head": (4, 4)}
LENGTHS = [7, 5, 9, 4]  # prompt + response tokens of each row: 25 in all, odd, so the row is padded


def build_model(heads: int, kv_heads: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                         max_position_embeddings=64, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).double()


def make_batch():
    from pacs.train.batch import build_batch

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (3,), generator=gen).tolist() for _ in range(2)]
    responses = [torch.randint(0, V, (n - 3,), generator=gen).tolist() for n in LENGTHS]
    batch = build_batch([prompts[i // G] for i in range(4)], responses, [1.0, 0.0, 0.0, 0.0], pad_token_id=0)
    old = -2 * torch.rand(batch.targets.shape, generator=gen, dtype=torch.float64)
    return batch, (old * batch.mask).float()


def logprobs64(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Float64 log-probs from materialized logits (the kernels return float32; this test is about the split)."""
    return torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None])[:, 0]


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sp = new_sequence_parallel(2, rank, dist.get_world_size())
    batch, old = make_batch()
    results = {}
    for layout, (heads, kv_heads) in HEADS.items():
        model = build_model(heads, kv_heads)
        reference = Policy(copy.deepcopy(model))
        enable_packed_attention(reference.causal_lm, torch.device("cpu"))
        enable_sequence_parallel_attention(model, 2)
        policy = Policy(model)
        part = shard_packed(pack_rows(batch, 0, 4), sp)
        hidden, weight, bias = packed_forward(policy, part)
        logp = logprobs64(hidden[part.mask], weight, part.targets[part.mask])
        logp_rows = whole_micro_batch(part, logp, 0, batch.targets.shape[1])
        loss = pacs_loss(logp_rows, old.double(), batch.rewards, batch.mask, group_size=G, backend="torch")
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        mine = {"hidden": hidden.detach(), "loss": float(loss), "grads": grads, "rows": part.rows, "cols": part.cols,
                "mask": part.mask}
        if rank == 0:
            whole = pack_rows(batch, 0, 4)
            hidden_ref, weight_ref, _ = packed_forward(reference, whole)
            logp_ref = torch.zeros(batch.targets.shape, dtype=torch.float64).index_put(
                (whole.rows[whole.mask], whole.cols[whole.mask]),
                logprobs64(hidden_ref[whole.mask], weight_ref, whole.targets[whole.mask]))
            loss_ref = pacs_loss(logp_ref, old.double(), batch.rewards, batch.mask, group_size=G, backend="torch")
            loss_ref.backward()
            mine.update(hidden_reference=hidden_ref.detach(), n_tokens=whole.n_tokens, loss_reference=float(loss_ref),
                        grads_reference={n: p.grad.clone() for n, p in reference.named_parameters()})
        results[layout] = mine
    # the old-policy pass with a filler forward (a rank with fewer chunks than another runs as many): row 0
    # alone splits over the ranks otherwise than rows 0-1 do, and its results must not be added in again
    from pacs.train.old_policy import old_policy_logprobs

    with torch.no_grad():
        plain = old_policy_logprobs(policy, batch, [(0, 2), (2, 4)], 1.0, "torch", packed=True, sp=sp)
        filled = old_policy_logprobs(policy, batch, [(0, 2), (2, 4)], 1.0, "torch", packed=True, sp=sp,
                                     fillers=[(0, 1), (2, 3)])
    results["old_policy"] = {"plain": plain, "with_fillers": filled}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_distributed_run()


if __name__ == "__main__":
    main()
