"""Everything before a run's first step: the checks, the run directory (locked; a resume's settings compared
with the run's; the checkpoint to resume from), the task and tokenizer (pacs/run/run_setup.py, shared with
``pacs eval``), the policy with its optimizer and schedule, PACS's reference, the disk space for the
checkpoints, the rollout engine, the metrics log; then the preflight and the step-0 evaluation."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time

import torch
import torch.distributed as dist

from pacs.config import Config, save_config
from pacs.model.mixed_precision import rounding_warning, share_frozen_by_rounding
from pacs.model.packing import use_packing
from pacs.model.policy import DistInfo, check_model_path, full_named_tensors, load_policy
from pacs.model.reference_policy import ReferenceSnapshot
from pacs.rollout import engine_kind, make_rollout_engine
from pacs.run import (
    Run,
    RunDir,
    apply_torch_threads,
    check_config,
    engine_options,
    find_checkpoint,
    load_checkpoint,
    lock_run_directory,
    prepare_run,
)
from pacs.run.checkpoint import KEEP as CHECKPOINTS_KEPT
from pacs.run.checkpoint import checkpoint_steps, load_reference_state
from pacs.run.console import hide_progress_bars
from pacs.run.disk_space import check_checkpoint_space
from pacs.run.resume_check import apply_optimizer_settings, plan_resume, record_resume
from pacs.run.run_lock import abandon_run_directory, check_no_other_holder
from pacs.run.run_setup import packed_attention_for
from pacs.train.evaluation import evaluate_policy
from pacs.train.loss_objective import loss_objective
from pacs.train.metrics import MetricsLog
from pacs.train.preflight import preflight_enabled, run_preflight
from pacs.train.training import Training
from pacs.train.update import preflight_steps


def start_run(cfg: Config, dist_info: DistInfo, say=print,
              change: tuple[str, ...] = ()) -> tuple[Run, object, object]:
    """Everything before the model loads: config checks, a usable output directory that holds
    no other run (unless ``resume`` / ``overwrite``) and no other process, a resume's settings
    compared with the run's (``change``: the keys named with --change; pacs/run/resume_check.py), the
    checkpoint to resume from, the model directory, task and tokenizer. Returns the run, the
    :class:`~pacs.run.checkpoint.CheckpointChoice` and the :class:`~pacs.run.resume_check.ResumePlan` (both None
    when not resuming). Nothing is written on a resume: its record is appended once the checkpoint loaded."""
    check_config(cfg, dist_info.world_size)
    loss_objective(cfg)  # the objective built (a user's module:Class imported) before any work
    run_dir = RunDir(cfg.output_dir)
    created = not os.path.exists(run_dir.path)
    run_dir.check_usable()
    fresh = not run_dir.contents()  # (a refusal below leaves a fresh directory as it found it)
    # one process per run directory (pacs/run/run_lock.py), before anything there is read
    on_main_rank(lambda: lock_run_directory(run_dir.path), dist_info)
    run_dir.check_free_for_run(resume=cfg.resume, overwrite=cfg.overwrite)
    choice = plan = None
    start_over = False  # --resume of a run killed before its first checkpoint: nothing to continue
    if cfg.resume:
        plan = on_main_rank(lambda: plan_resume(cfg, run_dir.path, change), dist_info)
        choice = find_checkpoint(run_dir.path) if dist_info.is_main else None
        if dist_info.world_size > 1:  # rank 0 verifies; every rank resumes from its choice
            shared = [choice]
            dist.broadcast_object_list(shared, src=0)
            choice = shared[0]
        for line in choice.describe():
            say(line)
        if choice.path is None:
            found = run_dir.contents()
            if found and choice.skipped:
                raise ValueError(
                    f"--resume: {run_dir.path!r} holds a run ({', '.join(found)}) but no checkpoint that "
                    "verifies (reasons above); pass --overwrite instead of --resume to move it aside and "
                    "start afresh")
            # killed before its first checkpoint (a scheduler's requeue resumes with the same command): the run
            # is moved aside, nothing deleted, and starts again
            start_over = bool(found)
            say(f"[resume] no checkpoint under {run_dir.checkpoints}: starting from scratch"
                + (f" (the run there wrote none: {', '.join(found)} moved aside)" if found else ""))
            choice = plan = None
    apply_torch_threads(cfg, dist_info.device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    try:  # its refusals (a prompt too long, a held-out split too small) before anything is written in the directory
        run = prepare_run(cfg, dist_info, log=say)
    except ValueError:
        if fresh and dist_info.is_main:  # a refused run leaves no trace: the same command, mended, starts there
            abandon_run_directory(run_dir.path, remove_directory=created)
        raise
    if cfg.overwrite or start_over:  # a live `pacs eval` in the run (its eval/.lock) is not moved away under it
        on_main_rank(lambda: check_no_other_holder(run_dir.path), dist_info)
    if dist_info.world_size > 1:  # every rank has checked the directory before rank 0 changes it
        dist.barrier()
    if dist_info.is_main:
        if cfg.overwrite or start_over:
            moved = run_dir.move_aside()
            if moved:
                lock_run_directory(run_dir.path)  # the lock file went aside with the old run: lock the new one
                say(f"[train] {'--overwrite' if cfg.overwrite else '--resume'}: moved the previous run in "
                    f"{run_dir.path} to {moved}")
        # the saved config resumes this run: `pacs train --config OUTPUT_DIR/config.yaml --resume`; written once,
        # when the run starts (a resume's settings go to config_history.jsonl)
        if choice is None or not os.path.isfile(run_dir.config):
            save_config(dataclasses.replace(cfg, resume=False, overwrite=False), run_dir.config)
    return run, choice, plan


def on_main_rank(check, dist_info: DistInfo):
    """``check()`` on rank 0, its result shared with every rank; its ValueError raised on every rank (one
    that only rank 0 raised would leave the others waiting in the next collective)."""
    result, refusal = None, None
    if dist_info.is_main:
        try:
            result = check()
        except ValueError as exc:
            if dist_info.world_size == 1:
                raise
            refusal = str(exc)
    if dist_info.world_size > 1:
        shared = [result, refusal]
        dist.broadcast_object_list(shared, src=0)
        result, refusal = shared
    if refusal is not None:
        raise ValueError(refusal)
    return result


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


def load_training_policy(cfg: Config, run: Run, dist_info: DistInfo, say) -> tuple[bool, torch.nn.Module, object,
                                                                                  object]:
    """The policy (packed where the loss takes padding-free micro-batches and they are exact for the model),
    its AdamW optimizer over the trainable parameters (all, or the LoRA adapters) and the lr schedule."""
    o = cfg.optim
    packed = use_packing(cfg, check_model_path(run.model_dir, cfg.model.trust_remote_code),
                         packed_attention_for(cfg.train.sequence_parallel_size, dist_info.device))
    policy = load_policy(run.model_dir, dtype=cfg.model.dtype, gradient_checkpointing=cfg.model.gradient_checkpointing,
                         dist_info=dist_info, trust_remote_code=cfg.model.trust_remote_code, packed_attention=packed,
                         liger_patches=cfg.train.liger_patches, fsdp_cpu_offload=cfg.train.fsdp_cpu_offload,
                         tiled_mlp=cfg.train.tiled_mlp, mlp_tile_tokens=cfg.train.mlp_tile_tokens,
                         master_dtype=o.master_dtype, lora=cfg.model.lora)
    if policy.precision.steps_16_bit_weights:  # asked for by name (optim.master_dtype): say what it costs
        say(rounding_warning(share_frozen_by_rounding(policy.parameters(), o.lr), o.lr, policy.precision.master,
                             f"optim.master_dtype={o.master_dtype}"))
    if (cfg.model.lora.rank and policy.precision.compute.itemsize < 4 and cfg.rollout.dtype != "float32"
            and not engine_shares_policy(cfg, dist_info)):
        say(f"[train] LoRA over a {str(policy.precision.compute).removeprefix('torch.')} base: the rollout engine "
            "serves the merged weights rounded to it, where small adapter changes round away, so rollouts lag "
            "the trained policy by that rounding (the loss's log-probs are the trainer's own); "
            "advanced.rollout.dtype=float32 serves them unrounded (docs/mixed-precision.md)")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr, betas=tuple(o.betas),
                                  weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, cfg.max_steps * o.mini_batches_per_step))
    return packed, policy, optimizer, scheduler


def engine_shares_policy(cfg: Config, dist_info: DistInfo) -> bool:
    """Whether the rollouts run on the policy itself: Hugging Face generate on one process (no copy of the
    weights; under FSDP each rank's engine needs whole weights of its own)."""
    return engine_kind(cfg.rollout.engine) == "hf" and dist_info.world_size == 1


def set_up_training(cfg: Config, dist_info: DistInfo, say, run: Run, resume, resume_plan) -> Training:
    """The policy, optimizer and schedule (a checkpoint's state when resuming), PACS's reference, the disk
    space check, the rollout engine serving the current weights and the metrics log (cut back on a resume)."""
    packed, policy, optimizer, scheduler = load_training_policy(cfg, run, dist_info, say)
    run_dir = RunDir(cfg.output_dir)
    state = {"step": 0, "data_position": 0, "consecutive_nan": 0, "skipped_updates": 0}
    if resume is not None:
        state.update(load_checkpoint(resume.path, policy, optimizer, scheduler, dist_info))
        # this run's lr / betas / decay and its schedule's current rate (a longer run re-plans the schedule)
        apply_optimizer_settings(cfg, optimizer, scheduler)
        if resume_plan is not None and dist_info.is_main:  # the checkpoint fits the model: the resume is recorded
            record_resume(run_dir.path, resume_plan, resume.step, say)
    # PACS's reference, when it is kept for optim.ref_reset_every > 1 rollout steps (pacs/model/reference_policy.py)
    reference = ReferenceSnapshot(policy) if cfg.optim.ref_reset_every > 1 else None
    if reference is not None and resume is not None:
        saved = load_reference_state(resume.path)
        if saved is not None:
            reference.load_full_state(saved)
    # the checkpoints this run keeps and its final model fit on the disk: said, or refused, before any rollout
    check_checkpoint_space(run_dir.path, policy, keep=CHECKPOINTS_KEPT, reference_kept=reference is not None,
                           existing=len(checkpoint_steps(run_dir.path)), say=say)
    engine = make_rollout_engine(**engine_options(cfg, run.model_dir, cfg.seed + dist_info.rank, log=say),
                                 policy=policy if engine_shares_policy(cfg, dist_info) else None)
    hide_progress_bars()  # again: a vLLM engine's start turns transformers' back on
    if resume is not None:
        engine.sync_weights(full_named_tensors(policy))
    metrics = MetricsLog(run_dir.metrics, resume_step=state["step"] if resume is not None else None,
                         enabled=dist_info.is_main, warn=say)
    return Training(cfg, dist_info, say, run, run_dir, packed, policy, optimizer, scheduler, reference, engine,
                    metrics, state, start_time=time.time())


def before_the_first_step(t: Training, resume) -> None:
    """The preflight (the largest steps these settings allow, once: out of memory now, not hours in;
    pacs/train/preflight.py), then a fresh run's step-0 evaluation and the progress bar."""
    from tqdm import tqdm

    cfg, dist_info = t.cfg, t.dist_info
    if preflight_enabled(cfg, dist_info.device) and t.state["step"] < cfg.max_steps:
        run_preflight(cfg, t.policy, t.optimizer, t.run.pad_id, dist_info, packed=t.packed, say=t.say,
                      steps=preflight_steps())
    if resume is None:
        t.row = {"step": 0, "rollout_engine": type(t.engine).__name__,
                 **evaluate_policy(cfg, t.engine, t.run, dist_info, 0)}
        t.metrics.write(t.row)
        t.say(f"[eval] step 0: held-out accuracy {t.row['eval_accuracy']:.3f}")
    t.progress = tqdm(total=cfg.max_steps, initial=t.state["step"], desc="rollout steps",
                      disable=not dist_info.is_main, dynamic_ncols=True)
