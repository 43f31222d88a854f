"""Whether a config can work, before any work starts: each section's own checks (its fields' choices and
bounds, its own rules: ``Section.check``), then the few rules across sections, here. No model needed."""

from __future__ import annotations

from pacs.config.root import Config
from pacs.config.task import BUILTIN_TASKS
from pacs.registry import OBJECTIVES


def validate(cfg: Config, world_size: int = 1) -> None:
    """Reject configs that cannot work, with the offending setting named."""
    cfg.check()
    if cfg.optim.master_dtype != "float32" and cfg.model.dtype not in ("auto", cfg.optim.master_dtype):
        raise ValueError(f"optim.master_dtype={cfg.optim.master_dtype!r} (16-bit weights stepped directly) needs "
                         f"model.dtype={cfg.optim.master_dtype!r}, got model.dtype={cfg.model.dtype!r}; "
                         "optim.master_dtype=float32 keeps float32 master weights (the default)")
    if cfg.task.name in BUILTIN_TASKS and cfg.eval.num_problems > cfg.task.eval_size:
        raise ValueError(f"eval.num_problems ({cfg.eval.num_problems}) must be <= task.eval_size "
                         f"({cfg.task.eval_size}), the held-out set the training stream excludes")
    validate_train(cfg, world_size)
    check_batch_split(cfg, world_size)


def check_batch_split(cfg: Config, world_size: int) -> None:
    """A rollout step's prompts split over the data ranks, its mini-batches and micro-batches in whole groups."""
    r, o, sp = cfg.rollout, cfg.optim, cfg.train.sequence_parallel_size
    data_ranks = world_size // sp  # (validate_train: a divisor)
    if r.prompts_per_step % data_ranks:
        raise ValueError(
            f"rollout.prompts_per_step ({r.prompts_per_step}) must be divisible by the number of "
            f"processes ({world_size})" + (f" over train.sequence_parallel_size ({sp})" if data_ranks != world_size
                                           else ""))
    per_rank = r.prompts_per_step // data_ranks
    if per_rank % o.mini_batches_per_step:
        raise ValueError(
            f"optim.mini_batches_per_step ({o.mini_batches_per_step}) must divide the prompts per "
            f"rank and step ({per_rank}) so that every mini-batch holds whole groups")
    if o.micro_batch_responses is not None and o.micro_batch_responses % r.group_size:
        raise ValueError(
            f"optim.micro_batch_responses ({o.micro_batch_responses}) splits groups: it must be a "
            f"multiple of rollout.group_size ({r.group_size})")
    groups, mini = micro_batch_groups(cfg), per_rank // o.mini_batches_per_step
    if mini % groups:
        raise ValueError(
            f"optim.micro_batch_groups ({groups}) must divide the groups per mini-batch ({mini}); "
            "micro-batches hold whole groups")


def micro_batch_groups(cfg: Config) -> int:
    """Groups per micro-batch, from micro_batch_groups or micro_batch_responses."""
    group = cfg.rollout.group_size
    if cfg.optim.micro_batch_responses is not None:
        return cfg.optim.micro_batch_responses // group
    return cfg.optim.micro_batch_groups


def validate_train(cfg: Config, world_size: int = 1) -> None:
    """The ``train`` section (long-context settings) against the rollouts' lengths and the processes (again once
    an unset ``rollout.max_prompt_len`` is measured)."""
    tr = cfg.train
    tr.check()
    # a sequence's forward cannot be cut: a budget below the longest sequence the rollouts may give
    # would stop the run at the first one that long, perhaps hours in; say so before any work
    longest = (cfg.rollout.max_prompt_len or 1) + cfg.rollout.max_new_tokens  # (None: checked once measured)
    for name in ("max_tokens_per_micro_batch", "old_policy_max_tokens"):
        value = getattr(tr, name)
        if value is not None and value < longest:
            raise ValueError(
                f"train.{name}={value} is smaller than the longest sequence the rollouts may give: "
                f"rollout.max_prompt_len + rollout.max_new_tokens = {longest} tokens, and a sequence's forward "
                f"cannot be cut into parts; raise train.{name} to at least {longest}, or lower "
                "rollout.max_new_tokens or rollout.max_prompt_len (prompts are cut to it)")
    sp = tr.sequence_parallel_size
    if sp > 1 and world_size % sp:
        raise ValueError(
            f"train.sequence_parallel_size={sp} must divide the number of processes ({world_size}): each group of "
            f"{sp} ranks splits the tokens of its micro-batches (launch with torchrun --nproc-per-node a multiple "
            f"of {sp})")
    if tr.fsdp_cpu_offload and world_size < 2:
        raise ValueError("train.fsdp_cpu_offload needs FSDP, i.e. torchrun with >= 2 processes; got "
                         f"{world_size} process(es)")


def check_lengths(cfg: Config, max_positions: int | None) -> None:
    """Prompt + response must fit the model's positions (checked once the model config is known, again once
    an unset ``rollout.max_prompt_len`` is measured)."""
    need = (cfg.rollout.max_prompt_len or 1) + cfg.rollout.max_new_tokens
    if max_positions is not None and need > max_positions:
        raise ValueError(
            f"rollout.max_prompt_len + rollout.max_new_tokens = {need} exceeds the model's "
            f"max_position_embeddings ({max_positions})")


def check_algo(algo: str) -> None:
    """``optim.algo``: a registered objective's name, or ``module:Class`` (imported when the run starts:
    pacs/train/loss_objective.py)."""
    OBJECTIVES.check(algo, "optim.algo (--algo)")
