"""A resumed run stays the run it was: its settings are compared with the run's own before anything is written.

``OUTPUT_DIR/config.yaml`` is the run's config as it was started, never rewritten. Each resume appends
one line to ``OUTPUT_DIR/config_history.jsonl``: the checkpoint step it resumed from, the step its
settings take effect at, what differed from the settings in effect before (``changed``: settings named
with ``--change``; ``accepted``: settings that do not change what the run is) and the whole config
now in effect. The settings in effect are the last line's config (``config.yaml`` before any resume).

Settings that change what the run is (the model, the algorithm and its objective options, group size,
learning rate and schedule, data, seed, precision: every setting not listed in :data:`FREE_ON_RESUME`)
must equal the run's, or be named with ``--resume --change KEY=VALUE``; otherwise the resume is refused
in one line listing each difference. The others (how long it runs, evaluation, logging, checkpoint
cadence, memory levers, the rollout engine) are accepted and recorded. (The learning-rate schedule's
length follows ``max_steps``: a cosine or linear schedule is stretched by a resume that raises it.)

:func:`check_model_matches` refuses, before any write, a model whose parameters do not have the
checkpoint's names and shapes (another model, another hidden size).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shlex
from dataclasses import dataclass

from pacs.config import (
    Config,
    apply_dict,
    config_keys,
    declared_key,
    from_user_layout,
    load_config,
    to_user_dict,
    user_key,
)
from pacs.run.run_dir import HISTORY_NAME, RunDir

# settings that do not change what a run is: how long it runs, what it evaluates and logs, how often it
# checkpoints, how it uses memory and which engine generates (a dotted prefix ending in "." covers a section;
# keys as declared: an advanced key's entry covers its advanced.* spelling)
FREE_ON_RESUME = (
    "max_steps", "max_minutes", "checkpoint_every", "checkpoint_minutes", "max_consecutive_nan", "torch_threads",
    "plot", "eval.", "train.", "rollout.engine", "rollout.gpu_memory_utilization", "rollout.kv_cache_gib",
    "rollout.enforce_eager", "model.gradient_checkpointing", "task.cache_dir", "optim.logprob_backend",
    "optim.one_sweep_first_step",
)
NOT_SETTINGS = ("output_dir", "resume", "overwrite")  # where and how a run starts, not what it is


def changes_what_the_run_is(key: str) -> bool:
    key = declared_key(key)
    return not any(key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_ON_RESUME)


def _settings(cfg: Config) -> dict:
    """Each setting of ``cfg`` by the key a user writes (``advanced.train.preflight``) -> its value."""
    return {user_key(key): value for key, value in config_keys(cfg) if key not in NOT_SETTINGS}


def _read_config(data: dict, where: str) -> Config:
    try:  # (an entry written before the advanced: section is read in its layout: from_user_layout)
        return apply_dict(Config(), from_user_layout(data))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--resume: the run's settings in {where} cannot be read ({exc})") from exc


def settings_in_effect(output_dir: str) -> Config | None:
    """The config the run in ``output_dir`` last ran with (None: it has no config.yaml)."""
    path = RunDir(output_dir).config
    if not os.path.isfile(path):
        return None
    history = RunDir(output_dir).config_history
    if os.path.isfile(history):
        with open(history) as fh:
            lines = [line for line in fh.read().split("\n") if line.strip()]
        for line in reversed(lines):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a torn last line: the resume it described never took effect
                continue
            return _read_config(entry["config"], history)
    try:
        return load_config(path)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--resume: the run's settings in {path} cannot be read ({exc})") from exc


@dataclass
class ResumePlan:
    """What a resume changes: ``changed`` (named with --change) and ``accepted`` settings, each key ->
    [the run's value, the value now]; ``config``: the settings now in effect."""

    changed: dict
    accepted: dict
    config: dict


def plan_resume(cfg: Config, output_dir: str, change: tuple[str, ...] = ()) -> ResumePlan | None:
    """Compare ``cfg`` with the settings the run in ``output_dir`` last ran with. Raises a one-line
    ValueError listing each setting that changes what the run is and differs without being named in
    ``change`` (dotted keys); None when the run has no config.yaml (nothing to compare with)."""
    before = settings_in_effect(output_dir)
    if before is None:
        return None
    old, new = _settings(before), _settings(cfg)
    differ = {key: [old.get(key), new[key]] for key in new if old.get(key) != new[key]}
    refused = [key for key in differ if changes_what_the_run_is(key) and key not in change]
    if refused:
        listed = ", ".join(f"{key} {_show(differ[key][0])} -> {_show(differ[key][1])}" for key in refused)
        raise ValueError(
            f"--resume: {len(refused)} setting(s) differ from the run's in {output_dir} and change what the run "
            f"is: {listed}; resume with the run's settings ({resume_command(output_dir)}), or name each change "
            "with --change KEY=VALUE to make it from the resumed step on")
    changed = {key: value for key, value in differ.items() if changes_what_the_run_is(key)}
    accepted = {key: value for key, value in differ.items() if not changes_what_the_run_is(key)}
    config = to_user_dict(dataclasses.replace(cfg, resume=False, overwrite=False))
    return ResumePlan(changed, accepted, config)


def record_resume(output_dir: str, plan: ResumePlan, step: int, say=print) -> None:
    """Append the resume (from checkpoint ``step``) to config_history.jsonl, durably, and say what it changed."""
    entry = {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "resumed_from_step": step,
             "takes_effect_at_step": step + 1, "changed": plan.changed, "accepted": plan.accepted,
             "config": plan.config}
    path = RunDir(output_dir).config_history
    torn = os.path.isfile(path) and os.path.getsize(path) > 0 and not _ends_with_newline(path)
    with open(path, "a") as fh:
        # after a torn last line (a crash mid-append), a new line first: glued onto it, this entry would not parse
        fh.write(("\n" if torn else "") + json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    for kind, settings in (("changed (--change)", plan.changed), ("accepted", plan.accepted)):
        if settings:
            listed = ", ".join(f"{key} {_show(old)} -> {_show(new)}" for key, (old, new) in settings.items())
            say(f"[resume] from step {step + 1} on, {kind}: {listed} (recorded in {HISTORY_NAME})")


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def apply_optimizer_settings(cfg: Config, optimizer, scheduler) -> None:
    """After a checkpoint's optimizer and scheduler states were loaded (they carry the run's old learning
    rate, betas and weight decay): put this config's in their place, the current learning rate recomputed
    from this run's schedule at the step reached. Called on every resume: besides an ``optim.`` setting
    named with --change, a longer run (``max_steps``) re-plans the schedule, and the optimizer's stored rate
    (at the end of a cosine schedule, 0) would otherwise drive the first update after the resume."""
    o = cfg.optim
    for group in optimizer.param_groups:
        group.update(initial_lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = o.lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def resume_command(output_dir: str) -> str:
    """The command that continues the run in ``output_dir`` with the settings it last ran with: its
    config.yaml, ``--resume``, and what later resumes changed (``--change`` for the settings that change
    what the run is, KEY=VALUE for the others)."""
    command = f"pacs train --config {shlex.quote(RunDir(output_dir).config)} --resume"
    try:
        now = settings_in_effect(output_dir)
        first = load_config(RunDir(output_dir).config) if now is not None else None
    except (OSError, ValueError, TypeError, KeyError):
        return command
    if now is None:
        return command
    old, new = _settings(first), _settings(now)
    differ = [key for key in new if old.get(key) != new[key]]
    named = [f"--change {shlex.quote(f'{key}={_cli(new[key])}')}" for key in differ if changes_what_the_run_is(key)]
    free = [shlex.quote(f"{key}={_cli(new[key])}") for key in differ if not changes_what_the_run_is(key)]
    return " ".join([command, *named, *free])


def check_model_matches(saved: dict, model_state: dict, checkpoint: str) -> None:
    """Refuse (one-line ValueError) a model whose parameters have other shapes than checkpoint
    ``checkpoint``'s (or none of its names). ``saved``: the checkpoint's model state; ``model_state``: the
    model's (FSDP2's DTensors report their full shapes)."""
    common = [name for name in saved if name in model_state]
    shapes = [name for name in common if tuple(saved[name].shape) != tuple(model_state[name].shape)]
    if common and not shapes:
        return
    if shapes:
        name = shapes[0]
        why = (f"{name} is {tuple(saved[name].shape)} there, {tuple(model_state[name].shape)} in the model; "
               f"{len(shapes)} parameter(s) differ")
    else:
        why = f"none of its {len(saved)} parameter names are the model's"
    raise ValueError(
        f"--resume: the model does not match checkpoint {checkpoint} ({why}): resume with the model the run was "
        "trained with (model.path and the task's model settings in its config.yaml); nothing was written")


def _show(value) -> str:
    return json.dumps(value)


def _cli(value) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value).replace(" ", "")
