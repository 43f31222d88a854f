"""PACSTrainer's configuration: ``PACSConfig`` (a ``trl.GRPOConfig`` plus the PACS loss options) and the checks made
before the trainer starts (settings PACS cannot honour, a vLLM model without a saved directory, reward functions'
values). The trainer itself: pacs/integrations/trl.py."""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from dataclasses import dataclass, field, fields

# TRL 1.16 warns at import that it "supports vLLM 0.22-0.31" (see pacs/integrations/trl.py): that message goes.
warnings.filterwarnings("ignore", message=r"TRL currently supports vLLM versions", category=UserWarning)
from trl import GRPOConfig  # noqa: E402  (after the filter above)

from pacs.train.rollout_correction import TRL_MODES  # noqa: E402
from pacs_kernels.loss_inputs import check_beta  # noqa: E402

# GRPOConfig fields that only shape GRPO's loss or advantages: ignored by PACS (warning when changed).
IGNORED_GRPO_OPTIONS = (
    "epsilon", "epsilon_high", "delta", "scale_rewards", "importance_sampling_level", "use_bias_correction_kl",
    "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg", "multi_objective_aggregation",
)


@dataclass
class PACSConfig(GRPOConfig):
    """GRPOConfig plus the PACS loss options (semantics: docs/pacs-algorithm.md).

    ``pacs_beta`` is PACS's score scale (GRPOConfig's ``beta`` is the KL coefficient, which must
    stay 0). ``loss_type`` is "pacs". ``temperature`` (GRPOConfig's) is the sampling temperature the
    log-probs are taken at. ``vllm_importance_sampling_correction``, ``_mode``, ``_clip_min`` and ``_clip_max``
    are GRPOConfig's, with its defaults (on, ``sequence_mask``, no lower bound, 3.0) and its meaning: with
    ``use_vllm=True`` each completion token's PACS term is weighted by TRL's importance-sampling ratio
    (the loss's ``token_weights``; docs/rollout-correction.md).
    """

    loss_type: str = field(default="pacs", metadata={"help": "Must be 'pacs' for PACSTrainer."})
    pacs_beta: float = field(default=1.0, metadata={"help": "PACS score scale beta."})
    pacs_score: str = field(default="log_ratio", metadata={"help": "'log_ratio' | 'mean_logp'."})
    pacs_advantage: str = field(default="rloo", metadata={"help": "'rloo' | 'grpo' | 'naive'."})
    pacs_weighting: str = field(
        default="balanced", metadata={"help": "'balanced' | 'none' | 'positive_only' | 'negative_only'."})
    pacs_score_function_term: bool = field(
        default=False, metadata={"help": "Add the paper's Eq. 6 score-function term to the gradient."})
    pacs_backend: str = field(
        default="auto", metadata={"help": "Log-prob backend: 'auto' | 'triton' | 'torch' | 'naive'."})
    pacs_padding_free: bool | None = field(
        default=None, metadata={"help": "Run the loss's forward on each micro-batch's real tokens packed into one row "
                                        "(no padding: left-padded prompts, right-padded completions), attention kept "
                                        "within each sequence (pacs_packed_sdpa, or the model's flash attention). "
                                        "None: wherever that is exact for the model (not for hybrid models, models "
                                        "attending by code of their own or without rotary positions, nor for sliding "
                                        "windows or attention soft-caps without flash attention) and TRL's "
                                        "generation allows it (not with transformers' continuous batching)."})
    pacs_tiled_mlp: bool = field(
        default=False, metadata={"help": "Run each decoder MLP over tiles of tokens, keeping only its input for the "
                                         "backward (pacs/model/tiled_mlp.py): long completions on little memory."})
    pacs_mlp_tile_tokens: int | None = field(
        default=None, metadata={"help": "Tokens per MLP tile with pacs_tiled_mlp (None: the model's hidden size)."})
    pacs_activation_offload: bool = field(
        default=False, metadata={"help": "Tensors the loss's forward saves for the backward go to host memory (pinned "
                                         "on CUDA) and come back for the backward (torch's save_on_cpu); with "
                                         "gradient_checkpointing that is each decoder layer's input only: long "
                                         "completions on little GPU memory, for a host copy each way."})
    pacs_skip_zero_gradient_groups: bool = field(
        default=True, metadata={"help": "On-policy training steps (no old log-probs: psi = 0), rloo/grpo advantage, "
                                        "log-ratio score, no score-function term: groups whose responses all got "
                                        "the same reward have a gradient of exactly 0 and are not run (their loss "
                                        "value is added). The logged entropy and PACS statistics then cover the "
                                        "groups that ran; pacs/loss and pacs/frac_single_label_groups cover all."})
    pacs_checkpoint_on_signal: bool = field(
        default=True, metadata={"help": "SIGTERM / SIGUSR1 / Ctrl-C during train(): finish the optimizer step, save "
                                        "a checkpoint, stop (pacs/run/stop_signals.py)."})
    pacs_checkpoint_minutes: float | None = field(
        default=None, metadata={"help": "Also save a checkpoint after any optimizer step that ends this many minutes "
                                        "after the last save (or the start), whatever save_steps says: a crash loses "
                                        "at most about this much time plus one step. None: TRL's save strategy only."})
    def __post_init__(self):
        check_beta(self.pacs_beta, "pacs_beta")  # before GRPOConfig's own checks: a bad value is named first
        super().__post_init__()


def check_pacs_config(args: PACSConfig) -> None:
    """Refuse (ValueError/TypeError) the settings PACS cannot honour; warn about GRPO-only knobs."""
    if not isinstance(args, PACSConfig):
        raise TypeError(f"args must be a PACSConfig, got {type(args).__name__}")
    check_beta(args.pacs_beta, "pacs_beta")
    if args.loss_type != "pacs":
        raise ValueError(f"PACSTrainer computes the PACS loss: loss_type must be 'pacs', got {args.loss_type!r}")
    tile = args.pacs_mlp_tile_tokens
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
        raise ValueError(f"pacs_mlp_tile_tokens must be a positive integer (tokens per MLP tile) or None, got {tile!r}")
    minutes = args.pacs_checkpoint_minutes
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0):
        raise ValueError(f"pacs_checkpoint_minutes must be a number of minutes > 0 or None, got {minutes!r}")
    if args.pacs_padding_free is True and args.use_transformers_continuous_batching:
        raise ValueError("pacs_padding_free=True switches the model's attention to pacs_packed_sdpa, which "
                         "transformers' continuous batching (use_transformers_continuous_batching=True) refuses for "
                         "generation: expected pacs_padding_free=None or False with it")
    if args.vllm_importance_sampling_mode not in TRL_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(TRL_MODES)}, got "
                         f"{args.vllm_importance_sampling_mode!r}")
    G = args.num_generations
    if args.per_device_train_batch_size % G != 0:
        raise ValueError(
            f"per_device_train_batch_size must be a multiple of num_generations ({G}) so that every micro-batch "
            f"holds whole groups (PACS's loss needs all of a group's log-probs), got "
            f"{args.per_device_train_batch_size}")
    if args.num_generations_eval not in (None, G):
        raise ValueError(f"PACSTrainer evaluates its loss on groups of num_generations ({G}): expected "
                         f"num_generations_eval=None or {G}, got {args.num_generations_eval}")
    if args.do_eval and args.eval_strategy != "no" and args.per_device_eval_batch_size % G != 0:
        raise ValueError(
            f"per_device_eval_batch_size must be a multiple of num_generations ({G}), got "
            f"{args.per_device_eval_batch_size}")
    refused = {
        "beta": (args.beta != 0.0, "PACS's reference is the rollout policy itself (reset every rollout); a KL "
                 "term to a fixed reference model is not part of it: expected beta=0.0"),
        "top_entropy_quantile": (args.top_entropy_quantile < 1.0,
                                 "entropy masking is a per-token GRPO device: expected 1.0"),
        "entropy_coef": (args.entropy_coef != 0.0 or args.use_adaptive_entropy,
                         "the entropy bonus is not implemented for PACS: expected entropy_coef=0.0 and "
                         "use_adaptive_entropy=False"),
        "off_policy_mask_threshold": (args.off_policy_mask_threshold is not None,
                                      "the off-policy sequence mask is a GRPO device: expected None"),
        "sync_ref_model": (args.sync_ref_model, "there is no reference model in PACS: expected False"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"PACSTrainer cannot honour {name}={getattr(args, name)!r}: {why}")
    defaults = {f.name: f.default for f in fields(GRPOConfig)}
    changed = [name for name in IGNORED_GRPO_OPTIONS if getattr(args, name) != defaults[name]
               and not (name == "scale_rewards" and getattr(args, name) == "group")]
    if changed:
        warnings.warn(f"PACSTrainer ignores these GRPO-only options (PACS uses the raw 0/1 rewards and its own "
                      f"loss): {', '.join(f'{n}={getattr(args, n)!r}' for n in changed)}", stacklevel=3)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_vllm_model(model, args: PACSConfig) -> None:
    """``use_vllm=True`` in colocate mode starts ``LLM(model=model.name_or_path)``: a model object must come from a
    saved directory or a hub id. A ValueError saying so, before any engine starts, for one built in code."""
    if not args.use_vllm or getattr(args, "vllm_mode", "colocate") != "colocate" or isinstance(model, str):
        return
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if os.path.isdir(os.path.expanduser(name)) or (HUB_ID.fullmatch(name) and not os.path.exists(name)):
        return
    raise ValueError(f"use_vllm=True (vllm_mode='colocate') starts vLLM from the model's saved directory or hub id, "
                     f"and this model has none (its name_or_path is {name!r}, as for a model built in code); save it "
                     "first (model.save_pretrained(DIR), tokenizer too) and pass DIR or the model loaded from it")


def is_async(func) -> bool:
    import inspect

    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def checked_reward_function(func, name: str):
    """``func`` with its values checked: each a number (bool, int, float or a 0-d tensor / numpy value) that is not
    NaN, or None (no verdict); anything else is a TypeError / ValueError naming the function and the completion."""

    @functools.wraps(func)
    def checked(*args, **kwargs):
        values = func(*args, **kwargs)
        if not hasattr(values, "__len__"):  # a generator: read once here, so a list for TRL
            values = list(values)
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
                raise TypeError(f"reward function {name!r} returned {type(value).__name__} {value!r} for completion "
                                f"{i}: expected a number (1.0 correct, 0.0 wrong) or None (no verdict)")
            if math.isnan(float(value)):
                raise ValueError(f"reward function {name!r} returned NaN for completion {i}: expected 1.0 (correct), "
                                 "0.0 (wrong) or None (no verdict; a NaN is not taken for one)")
        return values

    return checked

