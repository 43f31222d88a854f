"""Preflight: the largest steps the settings allow, run once before the first rollout.

A run whose micro-batches do not fit in memory fails at the first rollout whose responses are long
enough, which can be hours in (RL lengthens responses as it trains). The preflight builds the worst
cases the settings allow and runs them through the trainer's own code, the no-grad old-policy pass
and the updates' forwards and backwards (``update_policy``: token budgets, split groups and memory
levers included), with the optimizer step left out:

  * full length: every prompt ``rollout.max_prompt_len`` tokens, every response
    ``rollout.max_new_tokens``, as many groups as one micro-batch holds;
  * the budget filled: under a token budget the planner packs more groups of slightly shorter rows,
    up to the budget (a group larger than it: parts of whole rows up to it); this case has the budget's
    tokens in rows as long as that allows, when that is more tokens than the first;
  * each in two mini-batches where the step has two or more (the first after a rollout takes other
    paths than the later ones: the one-sweep loss, no no-grad pass over a split group's parts);
  * the old-policy pass also on its own worst chunk (``train.old_policy_max_tokens`` may exceed the
    training budget).

A step's peak is one micro-batch's (the next ones reuse the memory; gradients accumulate in the same
buffers). On a fresh run the AdamW moments, which the first update allocates, are held during the
preflight so that the peak counts them. Weights, optimizer state, scheduler, the step counters and
every random stream (torch's, CUDA's, Python's) are as they were afterwards, so a run with the
preflight trains exactly as one without. Not covered: generation (the rollout engine's own memory)
and evaluation.

On CUDA it reports the peak next to the memory this process can have; running out of memory stops
the run at once, naming the settings still off (on every rank that ran out, so that under torchrun the
message is not lost). The step metrics' ``peak_memory_mib`` then counts from the preflight's end (on
the CPU, where it is the process's peak resident set, it includes the preflight).
``train.preflight`` (default: on CUDA only, where memory is the device's and running out is an
exception; a CPU process that runs out is killed instead) switches it.
"""

from __future__ import annotations

import copy
import gc
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pacs.config import micro_batch_groups
from pacs.run import TrainingStopped
from pacs.train.batch import build_batch
from pacs.train.memory_plan import planned_training_gib
from pacs.train.update_batch import update_batch

GiB = 2**30


class _NoOptimizerStep:
    """Stands in for the optimizer inside the preflight's update: gradients are cleared, nothing steps."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's, read (the update reports its learning rate), never stepped."""
        return self.optimizer.param_groups

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class _NoSchedulerStep:
    def step(self) -> None:
        pass


@dataclass(frozen=True)
class TrainerSteps:
    """The trainer's own steps that the preflight runs (pacs/train/update.py's ``preflight_steps()``):
    its no-grad old-policy pass, the micro-batch ranges of that pass, and its update."""

    old_policy_logprobs: Callable
    old_policy_ranges: Callable
    update_policy: Callable


@dataclass(frozen=True)
class WorstCase:
    """``groups`` groups of rows ``row_len`` tokens long (prompt + response), per micro-batch."""

    label: str
    groups: int
    row_len: int

    def tokens(self, group_size: int) -> int:
        return self.groups * group_size * self.row_len


def preflight_enabled(cfg, device: torch.device) -> bool:
    """``train.preflight``, or by default: on CUDA."""
    return cfg.train.preflight if cfg.train.preflight is not None else device.type == "cuda"


def worst_cases(cfg, budget: int | None, max_groups: int) -> list[WorstCase]:
    """The micro-batches with the longest rows and with the most tokens that ``budget`` (tokens;
    None: ``optim.micro_batch_groups`` groups) lets the planner build from at most ``max_groups``
    groups (pacs/model/packing.py packs whole groups greedily, a group over the budget in parts)."""
    r = cfg.rollout
    longest, group = r.max_prompt_len + r.max_new_tokens, r.group_size
    if budget is None:
        return [WorstCase("full length", min(max_groups, micro_batch_groups(cfg)), longest)]
    full = WorstCase("full length", max(1, min(max_groups, budget // (group * longest))), longest)
    # its largest micro-batch: the whole groups, or a part of whole rows when one group exceeds the budget
    full_micro = full.tokens(group) if full.tokens(group) <= budget else budget // longest * longest
    groups = min(max_groups, math.ceil(budget / (group * longest)))  # rows as long as the budget allows
    row_len = min(longest, budget // (groups * group))
    filled = WorstCase("the budget filled", groups, row_len)
    return [full, filled] if row_len >= 2 and filled.tokens(group) > full_micro else [full]


def worst_case_batch(cfg, case: WorstCase, copies: int, vocab_size: int, pad_token_id: int, device: torch.device):
    """``copies`` x ``case.groups`` groups of ``case.row_len``-token rows (random tokens from a private
    generator; the prompt as long as the settings allow, at least one response token), both labels in
    every group so that the loss has a gradient."""
    r = cfg.rollout
    gen = torch.Generator().manual_seed(0)
    low = min(3, vocab_size - 1)  # past the usual special ids
    prompt_len = min(r.max_prompt_len, case.row_len - 1)
    prompts, responses = [], []
    for _ in range(case.groups * copies):
        prompt = torch.randint(low, vocab_size, (prompt_len,), generator=gen).tolist()
        for _ in range(r.group_size):
            prompts.append(prompt)
            responses.append(torch.randint(low, vocab_size, (case.row_len - prompt_len,), generator=gen).tolist())
    rewards = [float(i % 2) for i in range(len(responses))]
    return build_batch(prompts, responses, rewards, pad_token_id).to(device)


def levers_off(cfg) -> list[str]:
    """The memory settings of ``cfg`` that are still at their roomiest value."""
    tr = cfg.train
    off = [f"{key}=true" for key, value in (("model.gradient_checkpointing", cfg.model.gradient_checkpointing),
                                            ("train.tiled_mlp", tr.tiled_mlp),
                                            ("train.offload_activations", tr.offload_activations)) if not value]
    if tr.max_tokens_per_micro_batch is None:
        off.append("train.max_tokens_per_micro_batch=<tokens> (a group larger than it runs in parts)")
    if tr.loss_chunk_mib is None:
        off.append("train.loss_chunk_mib=<MiB> (below the default)")
    return off


def run_preflight(cfg, policy, optimizer, pad_token_id: int, dist_info, *, packed: bool, steps: TrainerSteps,
                  say=print) -> dict:
    """Run the worst cases (module doc) with every random stream restored afterwards; returns what it
    measured. Raises ``TrainingStopped`` when they run out of memory."""
    device = dist_info.device
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
        try:
            return _run_worst_cases(cfg, policy, optimizer, pad_token_id, dist_info, packed=packed, steps=steps,
                                    say=say)
        except torch.OutOfMemoryError as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        finally:
            optimizer.zero_grad(set_to_none=True)
            random.setstate(python_state)
    # out of memory: the failed step's tensors are released (its frames left with the exception) before
    # the message goes out, on every rank that ran out
    gc.collect()
    size = ""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        size = f" ({torch.cuda.get_device_properties(device).total_memory / GiB:.1f} GiB)"
    message = (f"preflight: the largest step these settings allow ({_describe(cfg)}) ran out of {device} memory"
               f"{size}: {reason} Settings still off: {'; '.join(levers_off(cfg)) or 'none'}; or lower "
               "rollout.max_new_tokens. (advanced.train.preflight=false skips this check.)")
    if dist_info.world_size > 1:
        print(f"[rank {dist_info.rank}] {message}", file=sys.stderr, flush=True)
    raise TrainingStopped(message)


def _describe(cfg) -> str:
    r = cfg.rollout
    return (f"groups of {r.group_size} responses, prompts of {r.max_prompt_len} and responses of "
            f"{r.max_new_tokens} tokens")


def _run_worst_cases(cfg, policy, optimizer, pad_token_id: int, dist_info, *, packed: bool, steps: TrainerSteps,
                     say) -> dict:
    old_policy_logprobs, old_policy_ranges, update_policy = (steps.old_policy_logprobs, steps.old_policy_ranges,
                                                             steps.update_policy)

    r, o, tr = cfg.rollout, cfg.optim, cfg.train
    device, world = dist_info.device, dist_info.dp_size  # ranks with their own data
    cuda = device.type == "cuda"
    vocab = policy.causal_lm.get_input_embeddings().num_embeddings
    per_rank = r.prompts_per_step // world
    n_minis = min(2, o.mini_batches_per_step)
    updates = worst_cases(cfg, tr.max_tokens_per_micro_batch, max(1, per_rank // o.mini_batches_per_step))
    old_budget = tr.old_policy_max_tokens or tr.max_tokens_per_micro_batch
    old_only = [c for c in worst_cases(cfg, old_budget, per_rank)
                if old_budget is not None and c.groups > max(u.groups for u in updates) * n_minis]
    if cuda:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        available = free + torch.cuda.memory_reserved(device)  # what this process's allocator can reach
        torch.cuda.reset_peak_memory_stats(device)
    # a fresh run's first update allocates AdamW's two moments: hold their size while the preflight runs
    reserve = [] if optimizer.state or tr.fsdp_cpu_offload or not cuda else [
        torch.empty_like(_local(p)) for group in optimizer.param_groups for p in group["params"] for _ in range(2)]
    start = time.perf_counter()
    for case in old_only:  # the no-grad pass's own largest chunk
        batch = worst_case_batch(cfg, case, 1, vocab, pad_token_id, device)
        old_policy_logprobs(policy, batch, old_policy_ranges(cfg, batch, dist_info, packed), r.temperature,
                            o.logprob_backend, packed, dist_info.sp)
        del batch
    for case in updates:
        step_cfg = copy.deepcopy(cfg)  # one micro-batch of the case per mini-batch, on every rank
        step_cfg.rollout.prompts_per_step = case.groups * n_minis * world
        step_cfg.optim.mini_batches_per_step = n_minis
        batch = worst_case_batch(cfg, case, n_minis, vocab, pad_token_id, device)
        old_logp, old_lse, _ = old_policy_logprobs(policy, batch, old_policy_ranges(step_cfg, batch, dist_info, packed),
                                                   r.temperature, o.logprob_backend, packed, dist_info.sp)
        scratch = {"step": 0, "data_position": 0, "consecutive_nan": 0, "skipped_updates": 0}
        # a step's first mini-batch takes the one-sweep path where the reference is the rollout-time policy;
        # with a reference kept across rollout steps the steps in between take the usual path, which a second
        # mini-batch runs anyway: with a single one, the step runs once more with the usual first mini-batch
        firsts = [None, old_logp] if o.ref_reset_every > 1 and n_minis == 1 else [None]
        for rollout_logp in firsts:
            data = update_batch(step_cfg, batch, old_logp, old_lse, rollout_logp, packed, dist_info.sp)
            update_policy(step_cfg, policy, _NoOptimizerStep(optimizer), _NoSchedulerStep(), data, scratch, dist_info,
                          0, say=lambda *a, **k: None)
        del batch, old_logp, old_lse, data
    seconds = time.perf_counter() - start
    reserved_gib = adamw_state_gib(optimizer) if reserve else 0.0
    del reserve
    cases = "; ".join(f"{c.label}: {c.groups} group(s) of {r.group_size} x {c.row_len} tokens" for c in updates)
    cases += "".join(f"; old-policy pass: {c.groups} group(s) of {r.group_size} x {c.row_len}" for c in old_only)
    result = {"cases": cases, "seconds": seconds}
    if not cuda:
        say(f"[preflight] the largest steps these settings allow ran ({cases}; {seconds:.1f}s)")
        return result
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / GiB
    torch.cuda.reset_peak_memory_stats(device)  # the step metrics report training, not this
    result.update(peak_gib=peak, adamw_state_gib=reserved_gib, available_gib=available / GiB, total_gib=total / GiB)
    planned = planned_training_gib(cfg, policy.causal_lm.config, total / GiB, dist_info.world_size)
    say(f"[preflight] the largest steps these settings allow fit ({cases}): peak {peak:.1f} GiB"
        + (f" (pacs plan predicted {planned:.1f} GiB)" if planned is not None else "")
        + (f" with the {reserved_gib:.1f} GiB of AdamW state the first update allocates" if reserved_gib else "")
        + f", of {available / GiB:.1f} GiB this process can use ({total / GiB:.1f} GiB on the device; "
        f"{seconds:.1f}s)")
    if peak > 0.95 * available / GiB:
        say(f"[warning] preflight: the peak is within 5% of the memory this process can use; settings still "
            f"off: {'; '.join(levers_off(cfg)) or 'none'}")
    return result


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def adamw_state_gib(optimizer: torch.optim.Optimizer) -> float:
    """The two moment buffers AdamW allocates at its first step (as large as the parameters: the
    local shards under FSDP2), GiB: what the preflight holds while it runs on a fresh run."""
    return sum(2 * _local(p).numel() * _local(p).element_size()
               for group in optimizer.param_groups for p in group["params"]) / GiB
