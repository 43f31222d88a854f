"""The PACS training loop, top to bottom.

One rollout step:
  1. sample prompts (each rank its share); generate ``group_size`` responses per prompt, groups
     contiguous from here on;
  2. score every response with the task's 0/1 reward;
  3. update the policy (pacs/train/update.py): the old policy's log-probs of every response token,
     then for each mini-batch of whole groups, gradients accumulated over its micro-batches, clipped,
     and AdamW's step; a NaN loss or gradient skips the step;
  4. push the new weights into the rollout engine;
  5. log the step's metrics; evaluate every eval.every steps;
  6. checkpoint every checkpoint_every steps (and when checkpoint_minutes have passed).

Before the first step: pacs/train/start.py (checks, run directory, model, task, tokenizer, engine); after the
last, or when the run is stopped: pacs/train/finish.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pacs.config import Config
from pacs.eval.evaluate import decode_response, encode_prompts
from pacs.model.policy import full_named_tensors, setup_distributed
from pacs.model.sequence_parallel import gather_rollouts, prompt_share
from pacs.rollout.sampled import SampledResponses
from pacs.run import StopSignals, TrainingPreempted, resume_hint, save_checkpoint
from pacs.run.run_lock import abandon_run_directory
from pacs.train.batch import Batch, build_batch
from pacs.train.evaluation import evaluate_policy, step_seed
from pacs.train.finish import TrainResult, finish_training, stopped_training
from pacs.train.health import progress_fields
from pacs.train.start import before_the_first_step, set_up_training, start_run
from pacs.train.step_metrics import step_metrics
from pacs.train.training import Training
from pacs.train.update import UpdateResult, update_step

checkpoint_clock = time.monotonic  # what checkpoint_minutes is measured with (a module name: tests replace it)


@dataclass
class StepEnd:
    """What every rank agreed on at the end of a step (pacs/run/stop_signals.py)."""

    stop_signal: str | None  # a signal's name: checkpoint this step and stop
    out_of_time: bool  # max_minutes reached
    checkpoint_due: bool  # checkpoint_minutes passed since the last checkpoint
    last_step: bool


def train(cfg: Config, change: tuple[str, ...] = ()) -> TrainResult:
    """Run (or resume) training as configured. ``change``: the settings a resume may change although they
    change what the run is (``pacs train --resume --change KEY=VALUE``; pacs/run/resume_check.py)."""
    dist_info = setup_distributed(cfg.train.sequence_parallel_size, cfg.train.distributed_timeout_minutes)
    say = print if dist_info.is_main else (lambda *a, **k: None)
    run, resume, resume_plan = start_run(cfg, dist_info, say, change)  # checks; the run directory; task, tokenizer
    try:
        t = set_up_training(cfg, dist_info, say, run, resume, resume_plan)  # policy, optimizer, engine, metrics log
        t.last_checkpoint_time = checkpoint_clock()
    except ValueError:  # refused (the disk too small for the checkpoints, ...): a new run leaves no config.yaml
        if resume is None and dist_info.is_main:
            abandon_run_directory(cfg.output_dir, remove_directory=False, config_too=True)
        raise
    # SIGTERM / SIGUSR1 (a scheduler's preemption), Ctrl-C: finish the step, checkpoint it, stop
    # (pacs/run/stop_signals.py)
    with StopSignals(notice_prefix="[train]" if dist_info.is_main else None) as stop_signals:
        try:
            before_the_first_step(t, resume)  # out of memory now rather than hours in; the step-0 evaluation
            for step in range(t.state["step"] + 1, cfg.max_steps + 1):
                step_start = time.time()
                rollout = generate_rollouts(t, step)  # 1. prompts, G responses each, from the current policy
                rollout_time = time.time() - step_start
                batch, responses = score_rollouts(t, *rollout)  # 2. a verifiable reward for each response
                update_start = time.time()
                update, entropy = update_step(t, step, batch)  # 3. learn from them
                update_time, sync_start = time.time() - update_start, time.time()
                t.engine.sync_weights(full_named_tensors(t.policy))  # 4. the new weights into the rollout engine
                sync_time = time.time() - sync_start
                times = {"rollout_time": rollout_time, "update_time": update_time, "sync_time": sync_time,
                         "step_time": time.time() - step_start, "elapsed": time.time() - t.start_time}
                end = log_step(t, step, batch, responses, entropy, update, times, stop_signals)  # 5. metrics, eval
                checkpoint_if_due(t, step, end)  # 6. so that a stopped run resumes from here
                if end.stop_signal is not None:
                    raise TrainingPreempted(f"{end.stop_signal} received: stopped after step {step}, its checkpoint "
                                            f"written; {resume_hint(cfg.output_dir)}", end.stop_signal)
                if end.out_of_time:
                    say(f"[train] max_minutes={cfg.max_minutes} reached after step {step}: stopping")
                    break
        except BaseException as exc:
            interrupted = stopped_training(t, exc)  # the engine closed; where to resume said
            if interrupted is not None:
                raise interrupted from None
            raise
        t.progress.close()
    return finish_training(t)  # the final model, the curves, a summary line


def generate_rollouts(t: Training, step: int) -> tuple[list, list, list, int, int]:
    """This rank's share of the step's prompts and G responses each, groups contiguous; seeds depend on
    (seed, step, row) only, so a resumed run samples what the uninterrupted one did. Returns the problems,
    their encoded prompts, the responses of the share ``[start, stop)`` this rank generated (the ranks of a
    sequence-parallel group each generate a part), start and stop."""
    cfg, r, dist_info = t.cfg, t.cfg.rollout, t.dist_info
    per_rank = r.prompts_per_step // dist_info.dp_size  # a sequence-parallel group shares its data
    problems = t.run.task.train_batch(t.state["data_position"] + dist_info.dp_rank * per_rank, per_rank)
    t.state["data_position"] += r.prompts_per_step
    prompts, cut = encode_prompts(t.run.tokenizer, problems, template=cfg.task.prompt_template,
                                  use_chat_template=cfg.task.use_chat_template, max_prompt_len=r.max_prompt_len)
    if cut and not r.truncate_prompts:  # (a generated task's prompt beyond the ones measured)
        raise ValueError(f"rollout.max_prompt_len={r.max_prompt_len}: a prompt of rollout step {step} is "
                         "longer; raise it or set rollout.truncate_prompts=true")
    if cut and not t.warned_cut and dist_info.is_main:
        t.warned_cut = True  # (tqdm's write: on a line of its own above the progress bar, not after it)
        t.progress.write(f"[warning] prompts longer than rollout.max_prompt_len={r.max_prompt_len} tokens "
                         "are cut to their last max_prompt_len tokens")
    start, stop = prompt_share(per_rank, dist_info.sp)
    # with the sampler's log-prob of each token: the mismatch with the trainer's (pacs/train/rollout_correction.py);
    # advanced.rollout_correction.sampler_temperature: a sampler mismatched on purpose (None: the trainer's)
    temperature = cfg.rollout_correction.sampler_temperature or r.temperature
    outputs = t.engine.generate(prompts[start:stop], r.group_size, temperature=temperature, top_p=r.top_p,
                                max_new_tokens=r.max_new_tokens, stop_token_ids=t.run.stop_ids,
                                seed=step_seed(cfg.seed, step, (dist_info.dp_rank * per_rank + start) * r.group_size),
                                return_logprobs=True) if stop > start else SampledResponses([], [])
    return problems, prompts, outputs, start, stop


def score_rollouts(t: Training, problems: list, prompts: list, sampled: SampledResponses, start: int,
                   stop: int) -> tuple[Batch, list[list[int]]]:
    """One verifiable reward per response, scored once, where it was generated (a reward with a timeout could
    score differently elsewhere), then gathered with it within a sequence-parallel group. Returns the step's
    batch and its responses."""
    group_size, (outputs, logprobs) = t.cfg.rollout.group_size, sampled
    scores = [[t.run.task.reward(decode_response(t.run.tokenizer, resp), problem) for resp in group_out]
              for problem, group_out in zip(problems[start:stop], outputs)]
    outputs, scores = gather_rollouts(outputs, scores, t.dist_info.sp)
    logprobs, _ = gather_rollouts(logprobs, [], t.dist_info.sp)
    responses = [resp for group_out in outputs for resp in group_out]
    rewards = [reward for group_scores in scores for reward in group_scores]
    batch = build_batch([p for p in prompts for _ in range(group_size)], responses, rewards, t.run.pad_id,
                        sampler_logprobs=[values for group_values in logprobs for values in group_values])
    return batch.to(t.dist_info.device), responses


def log_step(t: Training, step: int, batch: Batch, responses: list, entropy: float, update: UpdateResult,
             times: dict, stop_signals: StopSignals) -> StepEnd:
    """The step's metrics (averaged over ranks), what every rank agrees on (a stop signal, the wall-clock
    limit, a checkpoint due), the held-out evaluation every eval.every steps and at the end, the progress bar."""
    cfg, dist_info = t.cfg, t.dist_info
    extra = t.run.task.reward_metrics()
    if t.reference is not None:  # rollout steps since the reference was reset (0: this step)
        extra["ref_age"] = float(step - t.reference.step)
    extra.update(t.mismatch)  # sampler vs trainer log-probs, the same on every rank (pacs/train/rollout_correction.py)
    row = step_metrics(step, batch, responses, entropy, update, t.state, times, dist_info,
                       extra=extra, group_size=cfg.rollout.group_size)
    # every rank, every step: the same answer on all of them (a stop signal, the wall-clock limit)
    stop_signal, out_of_time, checkpoint_due = stop_signals.agreed(
        dist_info.world_size, dist_info.device,
        out_of_time=cfg.max_minutes is not None and time.time() - t.start_time > 60 * cfg.max_minutes,
        checkpoint_due=(cfg.checkpoint_minutes is not None
                        and checkpoint_clock() - t.last_checkpoint_time > 60 * cfg.checkpoint_minutes))
    if step == cfg.max_steps:
        stop_signal = None  # the run is done anyway: it ends as usual (evaluated, exported)
    last_step = step == cfg.max_steps or out_of_time or stop_signal is not None
    # a preempted run keeps only the scheduled evaluations (its resumed run then logs what an
    # uninterrupted one does, and a scheduler's grace period is better spent on the checkpoint)
    if (cfg.eval.every and step % cfg.eval.every == 0) or (last_step and stop_signal is None):
        row.update(evaluate_policy(cfg, t.engine, t.run, dist_info, step))
    t.metrics.write(row)
    t.row = row
    # what moves when the run learns (pacs/train/health.py); not the loss: PACS's on-policy loss is ln 2 by design
    t.progress.set_postfix(progress_fields(row))
    t.progress.update(1)
    t.state["step"] = step
    return StepEnd(stop_signal, out_of_time, checkpoint_due, last_step)


def checkpoint_if_due(t: Training, step: int, end: StepEnd) -> None:
    """Every checkpoint_every steps, once checkpoint_minutes have passed since the last one, and at the end."""
    if (t.cfg.checkpoint_every and step % t.cfg.checkpoint_every == 0) or end.checkpoint_due or end.last_step:
        save_checkpoint(t.run_dir.path, step, t.policy, t.optimizer, t.scheduler, t.state, t.dist_info,
                        reference_state=None if t.reference is None else t.reference.full_state())
        t.last_checkpoint_time = checkpoint_clock()
