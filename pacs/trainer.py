"""The PACS training loop, top to bottom.

One rollout step:
  1. sample prompts (each rank its share); generate ``group_size`` responses per prompt, groups
     contiguous from here on;
  2. score every response with the task's 0/1 reward;
  3. old-policy log-probs of every response token: one no-grad pass of the current policy through
     the fused log-prob kernel (PACS's reference, reset every rollout step);
  4. for each mini-batch of whole groups: accumulate gradients over micro-batches of whole groups
     (each loss divided by the number of micro-batches), clip the gradient norm, step AdamW and the
     learning-rate schedule; a NaN loss or gradient skips the step;
  5. push the new weights into the rollout engine; log; evaluate and checkpoint every k steps.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs_kernels import fused_linear_grpo_loss, fused_linear_pacs_loss, linear_logprobs

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config, check_lengths, micro_batch_groups, save_config, validate
from .evaluate import decode_response, encode_prompt, mean_pass_at_k
from .metrics import MetricsLog, plot_metrics
from .policy import (
    DistInfo,
    check_model_path,
    export_hf,
    full_named_tensors,
    load_policy,
    max_positions,
    setup_distributed,
)
from .rollout import check_vllm_available, make_rollout_engine
from .tasks import make_task


@dataclass
class TrainResult:
    """What :func:`train` returns: the last metrics row and the trained policy (still sharded
    under FSDP; :func:`pacs.policy.full_named_tensors` gathers it)."""

    metrics: dict
    policy: torch.nn.Module
    output_dir: str


class TrainingStopped(RuntimeError):
    """Raised when repeated NaN losses/gradients stop a run (the last good checkpoint is kept)."""


@dataclass
class Batch:
    """Padded (right) prompt+response rows of one rollout step, groups contiguous.

    input_ids, attention_mask: (B, L) int64; targets: (B, L) the next token at each position;
    mask: (B, L) bool, True where ``targets`` is a response token; rewards: (B,) float32.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop), trimmed to their longest row."""
        width = int(self.attention_mask[start:stop].sum(1).max())
        return Batch(*(t[start:stop, :width] if t.dim() == 2 else t[start:stop] for t in (
            self.input_ids, self.attention_mask, self.targets, self.mask, self.rewards)))

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.targets, self.mask,
                                              self.rewards)))


def build_batch(prompts: list[list[int]], responses: list[list[int]], rewards: list[float],
                pad_token_id: int) -> Batch:
    """Rows ``prompt + response`` (``len(responses)`` rows; prompt i // n for response i when the
    caller repeated prompts). The loss mask covers the positions that predict response tokens."""
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, :len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention[i, :len(p) + len(r)] = 1
        mask[i, len(p) - 1:len(p) + len(r) - 1] = True  # position t predicts token t + 1
    targets = torch.roll(input_ids, -1, dims=1)
    targets[:, -1] = pad_token_id
    return Batch(input_ids, attention, targets, mask, torch.tensor(rewards, dtype=torch.float32))


def lr_lambda(cfg: Config, total_updates: int):
    """Multiplier of the base lr at optimizer step ``k``: linear warm-up, then the schedule."""
    o = cfg.optim

    def factor(k: int) -> float:
        if o.lr_warmup_steps and k < o.lr_warmup_steps:
            return (k + 1) / o.lr_warmup_steps
        progress = min(1.0, (k - o.lr_warmup_steps) / max(1, total_updates - o.lr_warmup_steps))
        if o.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if o.lr_schedule == "linear":
            return 1.0 - progress
        return 1.0

    return factor


def all_reduce_mean(values: dict[str, float], dist_info: DistInfo) -> dict[str, float]:
    """Mean of each value over the ranks, ignoring ranks where it is NaN (undefined there, e.g. a
    statistic of correct responses on a rank that had none); NaN where no rank has it. Every rank
    must pass the same keys."""
    if dist_info.world_size == 1:
        return values
    keys = sorted(values)
    finite = [math.isfinite(float(values[k])) for k in keys]
    t = torch.tensor([float(values[k]) if ok else 0.0 for k, ok in zip(keys, finite)] + [float(ok) for ok in finite],
                     dtype=torch.float64, device=dist_info.device)
    dist.all_reduce(t)
    sums, counts = t[:len(keys)].tolist(), t[len(keys):].tolist()
    return {k: (total / count if count else float("nan")) for k, total, count in zip(keys, sums, counts)}


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step_seed(seed: int, step: int, first_row: int = 0) -> int:
    """Sampling seed of rollout ``step`` for a call whose first response is global row ``first_row``.

    A function of (seed, step, row) only: a resumed run samples exactly what the uninterrupted run
    did, and engines that seed row j with ``seed + j`` sample the same rows on any number of ranks.
    """
    return (seed * 1_000_003 + step * 7_919_993) % (2**31 - 1) + first_row


@torch.no_grad()
def old_policy_logprobs(policy, batch: Batch, rows_per_pass: int, temperature: float, backend: str):
    """(B, L) log-probs of the targets under the current policy (0 off the mask), their (B, L)
    log-sum-exp (for the one-sweep first step), and the mean entropy of the policy over response
    tokens. One no-grad pass, ``rows_per_pass`` rows at a time."""
    old_logp = torch.zeros(batch.targets.shape, dtype=torch.float32, device=batch.targets.device)
    old_lse = torch.zeros_like(old_logp)
    entropy_sum, tokens = 0.0, 0
    for start in range(0, batch.targets.shape[0], rows_per_pass):
        part = batch.rows(start, min(start + rows_per_pass, batch.targets.shape[0]))
        hidden, weight, bias = policy(part.input_ids, part.attention_mask)
        logp, entropy, lse = linear_logprobs(hidden[part.mask], weight, part.targets[part.mask], bias=bias,
                                             temperature=temperature, return_entropy=True, return_lse=True,
                                             backend=backend)
        width = part.targets.shape[1]
        old_logp[start:start + part.targets.shape[0], :width][part.mask] = logp
        old_lse[start:start + part.targets.shape[0], :width][part.mask] = lse
        entropy_sum += float(entropy.sum())
        tokens += int(part.mask.sum())
    return old_logp, old_lse, entropy_sum / max(tokens, 1)


def policy_loss(cfg: Config, policy, part: Batch, old_logp: torch.Tensor, old_lse: torch.Tensor | None = None):
    """The configured loss (PACS or GRPO) of one micro-batch, straight from hidden states.
    ``old_lse`` (PACS, weights unchanged since the old-policy pass): the one-sweep first step."""
    hidden, weight, bias = policy(part.input_ids, part.attention_mask)
    o, group = cfg.optim, cfg.rollout.group_size
    common = dict(group_size=group, temperature=cfg.rollout.temperature, bias=bias, return_stats=True,
                  backend=o.logprob_backend)
    if o.algo == "pacs":
        loss, stats = fused_linear_pacs_loss(
            hidden, weight, part.targets, part.mask, old_logp, part.rewards, beta=o.beta, score=o.score,
            advantage=o.advantage, weighting=o.weighting, score_function_term=o.score_function_term,
            old_lse=old_lse, **common)
    else:
        loss, stats = fused_linear_grpo_loss(
            hidden, weight, part.targets, part.mask, old_logp, part.rewards, clip_eps=o.clip_eps,
            aggregation=o.aggregation, **common)
    return loss, stats.as_dict()


def evaluate_policy(cfg: Config, engine, task, tokenizer, stop_ids, dist_info: DistInfo, step: int) -> dict:
    """Held-out accuracy (and pass@k) with the rollout engine; each rank scores its share."""
    e = cfg.eval
    every = task.eval_problems(e.num_problems)
    share = math.ceil(len(every) / dist_info.world_size)
    first = dist_info.rank * share
    problems = every[first:first + share]
    prompts = [encode_prompt(tokenizer, p, template=cfg.task.prompt_template,
                             use_chat_template=cfg.task.use_chat_template)[-cfg.rollout.max_prompt_len:]
               for p in problems]
    outputs = engine.generate(prompts, e.n_samples, temperature=e.temperature, top_p=e.top_p,
                              max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=stop_ids,
                              seed=step_seed(cfg.seed + 1, step, first * e.n_samples)) if prompts else []
    counts = [int(sum(task.reward(decode_response(tokenizer, r), p) for r in rs))
              for p, rs in zip(problems, outputs)]
    sums = [float(sum(counts)), float(len(counts))]
    sums += [mean_pass_at_k(counts, e.n_samples, k) * len(counts) if counts else 0.0 for k in e.ks]
    if dist_info.world_size > 1:
        t = torch.tensor(sums, dtype=torch.float64, device=dist_info.device)
        dist.all_reduce(t)
        sums = t.tolist()
    result = {"eval_accuracy": sums[0] / (sums[1] * e.n_samples)}
    for k, total in zip(e.ks, sums[2:]):
        result[f"eval_pass@{k}"] = total / sums[1]
    return result


def apply_torch_threads(cfg: Config, device: torch.device) -> None:
    """Intra-op CPU threads: ``cfg.torch_threads``, or 1 for the tiny embedded model on CPU."""
    threads = cfg.torch_threads
    if threads is None and cfg.model.path == "embedded" and device.type == "cpu":
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def train(cfg: Config) -> TrainResult:
    """Run (or resume) training as configured."""
    dist_info = setup_distributed()
    say = print if dist_info.is_main else (lambda *a, **k: None)

    # ---- checks that need no model: fail before any work starts
    validate(cfg, dist_info.world_size)
    if cfg.rollout.engine == "vllm":
        check_vllm_available()
    if cfg.model.path != "embedded":
        check_lengths(cfg, max_positions(check_model_path(cfg.model.path, cfg.model.trust_remote_code)))
    else:
        from .tasks.embedded import MAX_POSITIONS

        check_lengths(cfg, MAX_POSITIONS)
    ckpt = latest_checkpoint(cfg.output_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        say(f"[resume] no checkpoint under {cfg.output_dir}/checkpoints: starting from scratch")

    # ---- task, model, tokenizer, optimizer
    apply_torch_threads(cfg, dist_info.device)
    seed = cfg.seed
    random.seed(seed)
    torch.manual_seed(seed)
    os.makedirs(cfg.output_dir, exist_ok=True)
    if dist_info.is_main:
        save_config(cfg, os.path.join(cfg.output_dir, "config.yaml"))
    task = make_task(cfg)
    model_dir = cfg.model.path
    if model_dir == "embedded":
        from .tasks.embedded import prepare_embedded_model

        if dist_info.is_main:  # rank 0 warms up (or finds the cache); the others wait and read it
            model_dir = prepare_embedded_model(cfg.task, seed, log=say)
        if dist_info.world_size > 1:
            shared = [model_dir]
            dist.broadcast_object_list(shared, src=0)
            model_dir = shared[0]
        check_lengths(cfg, max_positions(check_model_path(model_dir)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = [tokenizer.eos_token_id]
    policy = load_policy(model_dir, dtype=cfg.model.dtype, gradient_checkpointing=cfg.model.gradient_checkpointing,
                         dist_info=dist_info, trust_remote_code=cfg.model.trust_remote_code)
    o, r = cfg.optim, cfg.rollout
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg, cfg.max_steps * o.mini_batches_per_step))
    state = {"step": 0, "data_position": 0, "consecutive_nan": 0, "skipped_updates": 0}
    if ckpt is not None:
        state.update(load_checkpoint(ckpt, policy, optimizer, scheduler, dist_info))
        say(f"[resume] continuing from {ckpt} (step {state['step']})")

    # ---- rollout engine, serving the current weights
    engine = make_rollout_engine(
        r.engine, model_dir, max_model_len=r.max_prompt_len + r.max_new_tokens, seed=seed + dist_info.rank,
        dtype=cfg.model.dtype, log=say, gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_gib=r.kv_cache_gib, enforce_eager=r.enforce_eager)
    if ckpt is not None:
        engine.sync_weights(full_named_tensors(policy))

    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    metrics = MetricsLog(metrics_path, truncate_after=state["step"] if ckpt is not None else None,
                         enabled=dist_info.is_main)
    if ckpt is None:
        row = {"step": 0, "rollout_engine": type(engine).__name__,
               **evaluate_policy(cfg, engine, task, tokenizer, stop_ids, dist_info, 0)}
        metrics.write(row)
        say(f"[eval] step 0: held-out accuracy {row['eval_accuracy']:.3f}")

    per_rank = r.prompts_per_step // dist_info.world_size
    group = r.group_size
    groups_per_micro = micro_batch_groups(cfg)
    groups_per_mini = per_rank // o.mini_batches_per_step
    micro_per_mini = groups_per_mini // groups_per_micro
    start_time = time.time()
    row: dict = {}
    from tqdm import tqdm

    progress = tqdm(total=cfg.max_steps, initial=state["step"], desc="rollout steps",
                    disable=not dist_info.is_main, dynamic_ncols=True)
    for step in range(state["step"] + 1, cfg.max_steps + 1):
        step_start = time.time()
        # 1. prompts (this rank's share) and G responses each, groups contiguous
        first = state["data_position"] + dist_info.rank * per_rank
        problems = task.train_batch(first, per_rank)
        state["data_position"] += r.prompts_per_step
        prompts = [encode_prompt(tokenizer, p, template=cfg.task.prompt_template,
                                 use_chat_template=cfg.task.use_chat_template) for p in problems]
        if any(len(p) > r.max_prompt_len for p in prompts) and not state.get("warned_truncation"):
            state["warned_truncation"] = True
            say(f"[warning] prompts longer than rollout.max_prompt_len={r.max_prompt_len} tokens are "
                "cut to their last max_prompt_len tokens")
        prompts = [p[-r.max_prompt_len:] for p in prompts]
        outputs = engine.generate(prompts, group, temperature=r.temperature, top_p=r.top_p,
                                  max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids,
                                  seed=step_seed(seed, step, dist_info.rank * per_rank * group))
        rollout_time = time.time() - step_start

        # 2. verifiable rewards
        responses = [resp for group_out in outputs for resp in group_out]
        rewards = [task.reward(decode_response(tokenizer, resp), problem)
                   for problem, group_out in zip(problems, outputs) for resp in group_out]
        batch = build_batch([p for p in prompts for _ in range(group)], responses, rewards, pad_id)
        batch = batch.to(dist_info.device)

        # 3. old-policy log-probs (the PACS reference, reset every rollout step)
        update_start = time.time()
        old_logp, old_lse, entropy = old_policy_logprobs(policy, batch, groups_per_micro * group, r.temperature,
                                                         o.logprob_backend)
        one_sweep = o.algo == "pacs" and o.one_sweep_first_step

        # 4. mini-batches of whole groups, gradient accumulation over micro-batches of whole groups
        stat_sums: dict[str, float] = {}
        stat_counts: dict[str, int] = {}
        losses, grad_norms = [], []
        for mini in range(o.mini_batches_per_step):
            for micro in range(micro_per_mini):
                first_group = mini * groups_per_mini + micro * groups_per_micro
                lo, hi = first_group * group, (first_group + groups_per_micro) * group
                part = batch.rows(lo, hi)
                width = part.targets.shape[1]
                # the first mini-batch still has the old-policy weights: one vocabulary sweep suffices
                lse = old_lse[lo:hi, :width] if one_sweep and mini == 0 else None
                loss, stats = policy_loss(cfg, policy, part, old_logp[lo:hi, :width], lse)
                (loss / micro_per_mini).backward()
                losses.append(float(loss.detach()))
                for key, value in stats.items():  # NaN: undefined here (e.g. no correct response)
                    stat_sums.setdefault(key, 0.0)
                    stat_counts.setdefault(key, 0)
                    if math.isfinite(value):
                        stat_sums[key] += value
                        stat_counts[key] += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), o.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            bad = torch.tensor([0.0 if all(math.isfinite(x) for x in losses[-micro_per_mini:]) else 1.0,
                                0.0 if torch.isfinite(grad_norm) else 1.0], device=dist_info.device)
            if dist_info.world_size > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.any():
                state["consecutive_nan"] += 1
                state["skipped_updates"] += 1
                say(f"[warning] step {step}: non-finite {'loss' if bad[0] else 'gradient'}; "
                    f"update skipped ({state['consecutive_nan']} in a row)")
                optimizer.zero_grad(set_to_none=True)
                if state["consecutive_nan"] >= cfg.max_consecutive_nan:
                    progress.close()
                    engine.close()
                    last = latest_checkpoint(cfg.output_dir)
                    raise TrainingStopped(
                        f"{state['consecutive_nan']} non-finite updates in a row at step {step}: stopping. "
                        f"The last good checkpoint is {last or '(none written yet)'}; resume from it "
                        "with a lower optim.lr or check the data")
                continue
            state["consecutive_nan"] = 0
            grad_norms.append(float(grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        update_time = time.time() - update_start

        # 5. new weights into the rollout engine; metrics; eval; checkpoint
        sync_start = time.time()
        engine.sync_weights(full_named_tensors(policy))
        sync_time = time.time() - sync_start
        response_tokens = sum(len(x) for x in responses)
        local = {
            "reward_mean": float(batch.rewards.mean()), "entropy": entropy,
            "response_length": response_tokens / len(responses),
            "loss": sum(losses) / len(losses),
            **task.reward_metrics(),  # math-verify timeouts / errors (each scored 0) since the last step
            **{k: (v / stat_counts[k] if stat_counts[k] else float("nan"))
               for k, v in stat_sums.items() if k != "loss" and k != "reward_mean"},
        }
        row = {"step": step, **all_reduce_mean(local, dist_info)}
        step_time = time.time() - step_start
        row.update({
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "lr": scheduler.get_last_lr()[0], "skipped_updates": state["skipped_updates"],
            "tokens_per_s": response_tokens * dist_info.world_size / step_time,
            "rollout_time": rollout_time, "update_time": update_time, "sync_time": sync_time,
            "step_time": step_time, "elapsed": time.time() - start_time,
            "peak_memory_mib": peak_memory_mib(dist_info.device),
            "prompts_seen": state["data_position"],
        })
        out_of_time = cfg.max_minutes is not None and time.time() - start_time > 60 * cfg.max_minutes
        last_step = step == cfg.max_steps or out_of_time
        if (cfg.eval.every and step % cfg.eval.every == 0) or last_step:
            row.update(evaluate_policy(cfg, engine, task, tokenizer, stop_ids, dist_info, step))
        metrics.write(row)
        progress.set_postfix(reward=f"{row['reward_mean']:.2f}", loss=f"{row['loss']:.3f}",
                             **({"acc": f"{row['eval_accuracy']:.2f}"} if "eval_accuracy" in row else {}))
        progress.update(1)
        state["step"] = step
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or last_step:
            save_checkpoint(cfg.output_dir, step, policy, optimizer, scheduler, state, dist_info)
        if out_of_time:
            say(f"[train] max_minutes={cfg.max_minutes} reached after step {step}: stopping")
            break
    progress.close()

    # ---- final export (HF format, servable by vLLM) and the curves
    export_hf(policy, tokenizer, os.path.join(cfg.output_dir, "final_model"), dist_info)
    engine.close()
    if dist_info.is_main and cfg.plot and os.path.isfile(metrics_path):
        png = plot_metrics(metrics_path, os.path.join(cfg.output_dir, "metrics.png"),
                           title=f"{cfg.optim.algo} on {cfg.task.name} ({cfg.output_dir})")
        say(f"[train] metrics: {metrics_path}; curves: {png}")
    return TrainResult(metrics=row, policy=policy, output_dir=cfg.output_dir)
