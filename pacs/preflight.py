"""Preflight: the longest step the settings allow, run once before the first rollout.

A run whose micro-batches do not fit in memory fails at the first rollout whose responses are long
enough, which can be hours in (RL lengthens responses as it trains). The preflight builds the worst
case the settings allow, every prompt ``rollout.max_prompt_len`` tokens and every response
``rollout.max_new_tokens``, as much of it as one micro-batch holds (a step's peak is one
micro-batch's: the next ones reuse the memory; the gradients accumulate in the same buffers), in
two mini-batches where the step has two or more (the first after a rollout takes other paths than
the later ones), and runs it through the trainer's own code: the no-grad old-policy pass, then the
updates' forwards and backwards (``update_policy``, token budgets, split groups and memory levers
included) with the optimizer step left out. Weights, optimizer state, scheduler, metrics and random streams are not
touched, so a run with the preflight trains exactly as one without.

On CUDA it reports the step's peak memory next to the device's, plus the AdamW state the first
update will allocate if it does not exist yet; running out of memory stops the run at once with
the levers that are still off. ``train.preflight`` (default: on CUDA only, where memory is the
device's and running out is an exception; a CPU process that runs out is killed instead) switches it.
"""

from __future__ import annotations

import copy
import time

import torch

GiB = 2**30


class _NoOptimizerStep:
    """Stands in for the optimizer inside the preflight's update: gradients are cleared, nothing steps."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class _NoSchedulerStep:
    def step(self) -> None:
        pass


def preflight_enabled(cfg, device: torch.device) -> bool:
    """``train.preflight``, or by default: on CUDA."""
    return cfg.train.preflight if cfg.train.preflight is not None else device.type == "cuda"


def worst_case_groups(cfg, world_size: int) -> int:
    """Groups in the worst case's micro-batch: what one micro-batch holds when every sequence has the
    longest length the settings allow, at most one mini-batch's share of this rank."""
    from .config import micro_batch_groups

    r, o, tr = cfg.rollout, cfg.optim, cfg.train
    per_mini = max(1, r.prompts_per_step // world_size // o.mini_batches_per_step)
    if tr.max_tokens_per_micro_batch is None:
        per_micro = micro_batch_groups(cfg)
    else:  # whole groups within the budget (packed or padded, all rows as long), else one group in parts
        per_micro = max(1, tr.max_tokens_per_micro_batch // (r.group_size * (r.max_prompt_len + r.max_new_tokens)))
    return min(per_mini, per_micro)


def worst_case_batch(cfg, n_groups: int, vocab_size: int, pad_token_id: int, device: torch.device):
    """``n_groups`` groups of full-length rows (random tokens from a private generator), both labels in
    every group so that the loss has a gradient."""
    from .trainer import build_batch

    r = cfg.rollout
    gen = torch.Generator().manual_seed(0)
    low = min(3, vocab_size - 1)  # past the usual special ids
    prompts, responses = [], []
    for _ in range(n_groups):
        prompt = torch.randint(low, vocab_size, (r.max_prompt_len,), generator=gen).tolist()
        for _ in range(r.group_size):
            prompts.append(prompt)
            responses.append(torch.randint(low, vocab_size, (r.max_new_tokens,), generator=gen).tolist())
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


def run_preflight(cfg, policy, optimizer, pad_token_id: int, dist_info, *, packed: bool, say=print) -> dict:
    """Run the worst-case micro-batch (module doc); returns what it measured. Raises
    ``TrainingStopped`` when it runs out of memory."""
    from .trainer import TrainingStopped, old_policy_logprobs, old_policy_ranges, update_policy

    r, o = cfg.rollout, cfg.optim
    device = dist_info.device
    n_groups = worst_case_groups(cfg, dist_info.world_size)
    # one micro-batch of these groups per mini-batch, on every rank; two mini-batches where the step has
    # them: the first after a rollout takes other paths (the one-sweep loss, no no-grad pass over a split
    # group's parts) than the later ones
    n_minis = min(2, o.mini_batches_per_step)
    case = copy.deepcopy(cfg)
    case.rollout.prompts_per_step = n_groups * n_minis * dist_info.world_size
    case.optim.mini_batches_per_step = n_minis
    batch = worst_case_batch(cfg, n_groups * n_minis, policy.causal_lm.config.vocab_size, pad_token_id, device)
    what = (f"{n_groups} group(s) x {r.group_size} responses of {r.max_prompt_len} + {r.max_new_tokens} tokens "
            f"({n_groups * r.group_size * (r.max_prompt_len + r.max_new_tokens):,} tokens) a micro-batch, "
            f"{n_minis} mini-batch(es)")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        old_logp, old_lse, _ = old_policy_logprobs(policy, batch, old_policy_ranges(case, batch, dist_info, packed),
                                                   r.temperature, o.logprob_backend, packed)
        scratch = {"step": 0, "data_position": 0, "consecutive_nan": 0, "skipped_updates": 0}
        update_policy(case, policy, _NoOptimizerStep(optimizer), _NoSchedulerStep(), batch, old_logp, old_lse,
                      scratch, dist_info, 0, say=lambda *a, **k: None, packed=packed)
    except torch.OutOfMemoryError as exc:
        optimizer.zero_grad(set_to_none=True)
        del batch
        size = ""
        if cuda:
            torch.cuda.empty_cache()
            size = f" ({torch.cuda.get_device_properties(device).total_memory / GiB:.1f} GiB)"
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise TrainingStopped(
            f"preflight: the longest step these settings allow ({what}) ran out of {device} memory{size}: "
            f"{reason} Settings still off: {'; '.join(levers_off(cfg)) or 'none'}; or lower rollout.max_new_tokens. "
            "(train.preflight=false skips this check.)") from None
    finally:
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    result = {"tokens": n_groups * r.group_size * (r.max_prompt_len + r.max_new_tokens), "seconds": seconds}
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / GiB
        total = torch.cuda.get_device_properties(device).total_memory / GiB
        adam = 0.0 if optimizer.state or cfg.train.fsdp_cpu_offload else adamw_state_gib(optimizer)
        torch.cuda.reset_peak_memory_stats(device)  # the step metrics report training, not this
        result.update(peak_gib=peak, adamw_state_gib=adam, total_gib=total)
        say(f"[preflight] the longest step these settings allow ({what}) fits: peak {peak:.1f} GiB"
            + (f" + {adam:.1f} GiB of AdamW state at the first update" if adam else "")
            + f" of {total:.1f} GiB ({seconds:.1f}s)")
        if peak + adam > 0.95 * total:
            say(f"[warning] preflight: {peak + adam:.1f} GiB is within 5% of the device's {total:.1f} GiB; "
                f"settings still off: {'; '.join(levers_off(cfg))}")
    else:
        say(f"[preflight] the longest step these settings allow ({what}) ran ({seconds:.1f}s)")
    return result


def adamw_state_gib(optimizer: torch.optim.Optimizer) -> float:
    """The two moment buffers AdamW allocates at its first step (as large as the parameters: the
    local shards under FSDP2), GiB."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += 2 * local.numel() * local.element_size()
    return total / GiB
