"""What ``pacs train`` and ``pacs eval`` both need before their first generation, done one way.

:func:`prepare_run` checks the config (no model needed), finds or builds the model directory,
checks it holds weights and that prompt + response fit its positions, builds the task (checking
that it has a held-out set) and loads the tokenizer. :func:`engine_options` gives the rollout
engine's arguments. Prompts are measured with the tokenizer before the model loads
(pacs/run/prompt_lengths.py); where ``rollout.truncate_prompts`` allows it they are cut to ``rollout.max_prompt_len``
by one function for training and both evaluations: :func:`pacs.eval.evaluate.encode_prompts`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs.config import Config, check_lengths, validate, validate_train
from pacs.model.lora import check_lora_targets
from pacs.model.packed_attention import packed_attention_implementation
from pacs.model.packing import packing_obstacle, use_packing
from pacs.model.policy import DistInfo, check_model_path, max_positions, resolve_dtype
from pacs.model.sequence_parallel import ULYSSES_ATTENTION, check_model_splits
from pacs.model.varlen_attention import check_requested_engine, requested_engine
from pacs.rollout import check_vllm_available
from pacs.rollout.stop_tokens import stop_token_ids
from pacs.run.export import recover_export
from pacs.run.prompt_lengths import fit_prompt_length
from pacs.tasks import Task, make_task
from pacs.tasks.datasets import HF_PREFIX
from pacs.tasks.embedded import build_tokenizer, prepare_embedded_model
from pacs.tasks.embedded import model_config as embedded_config


@dataclass
class Run:
    """A checked run: the model directory (built when ``embedded``), the task and the tokenizer.

    pad_id: the tokenizer's pad token (its eos when it has none); stop_ids: generation stops there
    (pacs/rollout/stop_tokens.py).
    """

    cfg: Config
    model_dir: str
    task: Task
    tokenizer: object
    pad_id: int
    stop_ids: list[int]


def check_config(cfg: Config, world_size: int = 1) -> None:
    """Checks that need no model: settings, vLLM when asked for, the model directory's config and
    weights and its positions (a local or hub model; the embedded one is checked once built). A model
    directory that an export killed between its renames left missing is put back first (pacs/run/export.py)."""
    validate(cfg, world_size)
    if cfg.task.name == "math":  # a missing data file first: it is what the user has to mend
        for key in ("data_path", "eval_path"):
            path = getattr(cfg.task, key)
            if path and not path.startswith(HF_PREFIX) and not os.path.isfile(os.path.expanduser(path)):
                raise ValueError(f"task.{key}: no such file {path!r}")
    if cfg.rollout.engine == "vllm":
        check_vllm_available()
    if cfg.model.path != "embedded":
        recover_export(cfg.model.path)
        model_config = check_model_path(cfg.model.path, cfg.model.trust_remote_code)
    else:  # built later, from the task's settings
        model_config = embedded_config(cfg.task, len(build_tokenizer()))
    check_lengths(cfg, max_positions(model_config))
    lora = cfg.model.lora  # (a target the model lacks, a rank wider than a layer: before the model loads)
    check_lora_targets(model_config, lora.rank, lora.target_modules, cfg.model.trust_remote_code)
    sp = cfg.train.sequence_parallel_size
    if sp > 1:  # before any model is built or trained
        check_model_splits(model_config, sp)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    attention = packed_attention_for(sp, device)
    packed = use_packing(cfg, model_config, attention)
    if not packed and sp > 1:  # (train.packing=true for such a model raised)
        raise ValueError(f"train.sequence_parallel_size={sp} splits packed micro-batches, which cannot be exact "
                         f"for this model: {packing_obstacle(model_config, attention)}")
    requested_engine()  # PACS_PACKED_ATTENTION's value
    if packed:
        check_requested_engine(device, resolve_dtype(cfg.model.dtype, device))


def packed_attention_for(sequence_parallel_size: int, device: torch.device) -> str:
    """The attention implementation packed micro-batches run with: the sequence-parallel one under a token
    split, else :func:`pacs.model.packed_attention.packed_attention_implementation`."""
    if sequence_parallel_size > 1:
        return ULYSSES_ATTENTION
    return packed_attention_implementation(device)


def prepare_run(cfg: Config, dist_info: DistInfo | None = None, log=print) -> Run:
    """Model directory, task and tokenizer of a checked config (call :func:`check_config` first).

    The embedded model is built (or found in its cache) by rank 0 while the other ranks wait.
    """
    dist_info = dist_info or DistInfo()
    model_dir = cfg.model.path
    if model_dir == "embedded":
        if dist_info.is_main:
            model_dir = prepare_embedded_model(cfg.task, cfg.seed, log=log)
        if dist_info.world_size > 1:
            shared = [model_dir]
            dist.broadcast_object_list(shared, src=0)
            model_dir = shared[0]
        check_lengths(cfg, max_positions(check_model_path(model_dir)))
    task = make_task(cfg)
    held_out = task.eval_problems(cfg.eval.num_problems)
    if not held_out:
        where = f"task.data_path {cfg.task.data_path!r}" if cfg.task.name == "math" else f"task {cfg.task.name!r}"
        raise ValueError(
            f"{where} is too small for a held-out split: 0 held-out problems (task.eval_size="
            f"{cfg.task.eval_size}); give more rows, a task.eval_path, or a larger data set")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    # the prompts measured with the run's tokenizer, before the model loads (pacs/run/prompt_lengths.py)
    measured = cfg.rollout.max_prompt_len is None
    fit_prompt_length(cfg, task, tokenizer, log=log if dist_info.is_main else (lambda *_: None))
    if measured:
        check_lengths(cfg, max_positions(check_model_path(model_dir, cfg.model.trust_remote_code)))
        validate_train(cfg, dist_info.world_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = stop_token_ids(tokenizer, model_dir, chat_template=cfg.task.use_chat_template,
                              trust_remote_code=cfg.model.trust_remote_code)
    if dist_info.is_main and stop_ids != [tokenizer.eos_token_id]:
        log("[rollout] responses end at " + ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i})" for i in stop_ids)
            + " (the tokenizer's eos, the model's config and generation config, the chat template's end of turn)")
    return Run(cfg, model_dir, task, tokenizer, pad_id, stop_ids)


def engine_options(cfg: Config, model_dir: str, seed: int, log=print) -> dict:
    """Keyword arguments of :func:`pacs.rollout.make_rollout_engine` for this run."""
    r = cfg.rollout
    return dict(kind=r.engine, model_dir=model_dir, max_model_len=r.max_prompt_len + r.max_new_tokens, seed=seed,
                dtype=cfg.model.dtype if r.dtype == "auto" else r.dtype, log=log,
                gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gib=r.kv_cache_gib,
                enforce_eager=r.enforce_eager)


def apply_torch_threads(cfg: Config, device: torch.device) -> None:
    """Intra-op CPU threads: ``cfg.torch_threads``, or 1 for the tiny embedded model on CPU."""
    threads = cfg.torch_threads
    if threads is None and cfg.model.path == "embedded" and device.type == "cpu":
        threads = 1
    if threads:
        torch.set_num_threads(threads)
