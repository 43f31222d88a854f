"""20 PACS updates at lr 1e-6 of the trainer's own update (pacs.train.update.update_policy) on one fixed batch,
with the policy loaded as ``pacs train`` loads it (1 process, or one FSDP2 rank under torchrun).

usage: python mixed_precision_worker.py OUT.pt MODEL_DIR MODEL_DTYPE MASTER_DTYPE

The reference of PACS's log-ratio is the initial policy (its log-probs computed once, in the run's own
precision), so the loss moves as the weights do. Rank 0 saves {losses, update_nonzero_frac, initial and
final full weights (float32), the warning printed} to OUT.pt.
"""

import contextlib
import io
import sys

import torch
import torch.distributed as dist
from trainer_helpers import leave_distributed_run  # the script's folder is on sys.path

from pacs.config import load_config
from pacs.model.mixed_precision import rounding_warning, share_frozen_by_rounding
from pacs.model.policy import full_named_tensors, load_policy, setup_distributed
from pacs.train.batch import build_batch
from pacs.train.old_policy import old_policy_logprobs
from pacs.train.update import update_policy
from pacs.train.update_batch import update_batch

STEPS, LR, GROUP, GROUPS = 20, 1e-6, 4, 4


def fixed_batch(vocab: int):
    """GROUPS groups of GROUP responses, every token id of the vocabulary used, rewards mixed in each group."""
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for _ in range(GROUPS):
        prompt = torch.randint(3, vocab, (6,), generator=gen).tolist()
        for _ in range(GROUP):
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (10,), generator=gen).tolist())
    rewards = [float(i % 3 == 0) for i in range(len(responses))]
    return build_batch(prompts, responses, rewards, pad_token_id=0)


def main() -> None:
    out, model_dir, model_dtype, master_dtype = sys.argv[1:5]
    torch.manual_seed(0)
    cfg = load_config(None, [f"rollout.group_size={GROUP}", f"rollout.prompts_per_step={GROUPS}",
                             "optim.mini_batches_per_step=1", "optim.micro_batch_groups=1", f"optim.lr={LR}",
                             "optim.lr_schedule=constant", "advanced.optim.one_sweep_first_step=false",
                             "advanced.optim.logprob_backend=torch", f"model.dtype={model_dtype}",
                             f"optim.master_dtype={master_dtype}"])
    dist_info = setup_distributed()
    policy = load_policy(model_dir, dtype=model_dtype, master_dtype=master_dtype, dist_info=dist_info)
    said = io.StringIO()
    if policy.precision.steps_16_bit_weights:  # what pacs train says (pacs/train/start.py)
        with contextlib.redirect_stdout(said):
            print(rounding_warning(share_frozen_by_rounding(policy.parameters(), LR), LR, policy.precision.master,
                                   f"optim.master_dtype={master_dtype}"))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    initial = {name: t.float().clone() for name, t in full_named_tensors(policy)}
    batch = fixed_batch(policy.causal_lm.config.vocab_size)
    rows = batch.input_ids.shape[0] // dist_info.world_size  # this rank's groups
    batch = batch.rows(dist_info.rank * rows, (dist_info.rank + 1) * rows)
    reference_logp, old_lse, _ = old_policy_logprobs(policy, batch, [(0, rows)], 1.0, "torch")
    state = {"consecutive_nan": 0, "skipped_updates": 0}
    losses, fractions = [], []
    for step in range(1, STEPS + 1):
        data = update_batch(cfg, batch, reference_logp, old_lse)
        update = update_policy(cfg, policy, optimizer, scheduler, data, state, dist_info, step,
                               say=lambda *a, **k: None)
        loss = torch.tensor(update.mean_loss(), dtype=torch.float64)
        if dist_info.world_size > 1:
            dist.all_reduce(loss)
            loss /= dist_info.world_size
        losses.append(float(loss))
        fractions += update.update_nonzero_fracs
    final = {name: t.float().clone() for name, t in full_named_tensors(policy)}
    if dist_info.is_main:
        torch.save({"losses": losses, "update_nonzero_frac": fractions, "initial": initial, "final": final,
                    "said": said.getvalue(), "world_size": dist_info.world_size,
                    "param_dtypes": sorted({str(p.dtype) for p in policy.parameters()})}, out)
    if dist_info.world_size > 1:
        leave_distributed_run()


if __name__ == "__main__":
    main()
