"""PACS in verl: a plugin module that verl imports through its external-module hook.

    actor_rollout_ref.model.external_lib=pacs.integrations.verl   (or VERL_USE_EXTERNAL_MODULES=pacs.integrations.verl)
    algorithm.adv_estimator=pacs_label
    actor_rollout_ref.actor.policy_loss.loss_mode=pacs

Importing this module registers two functions in verl's registries (``verl.trainer.ppo.core_algos``):

- advantage estimator ``"pacs_label"``: carries each response's 0/1 reward (the sum of its
  token-level rewards) to the loss as its "advantage", the same value on every response token;
  it refuses rewards other than 0/1, a batch whose groups (same ``uid``) are not whole and
  contiguous (``trainer.balance_batch=True`` reorders responses and splits groups), and verl's
  bypass mode (``algorithm.rollout_correction.bypass_mode=True``: the rollout engine's sampling
  log-probs as the old log-probs, so the score would not start at 0; the policy loss cannot see
  that setting, its ActorConfig does not carry it);
- policy loss ``"pacs"``: ``pacs_kernels.pacs_loss`` on verl's log-probs (current and rollout-time)
  with the labels read back from the advantages; the group size is ``actor.rollout_n``. It refuses
  settings that split groups (dynamic batch sizes, a micro-batch that is not a multiple of the
  group size, shuffling inside the mini-batch). verl's rollout importance-sampling weights
  (``rollout_is_weights``, from ``algorithm.rollout_correction.rollout_is``) are the loss's per-token
  weights (``token_weights``: PACS's score taken at old + w (logp - old), docs/rollout-correction.md; any
  other objective's policy term times w). The loss is normalised like verl's
  "seq-mean" aggregation: the sum over the micro-batch's responses of w * BCE, divided by the
  global mini-batch size (in responses) and multiplied by the data-parallel size (DDP/FSDP average
  the gradients), which is the public PACS code's per-micro-batch mean divided by the number of
  micro-batches. Checked through verl 0.9.1's own actor update (FSDP2 on CPU, 1 and 2 ranks, several
  mini- and micro-batches) against a float64 reference: tests/test_verl_actor_update.py.

Any other objective of pacs_kernels, or a user's, runs in the same policy loss: ``PACS_OBJECTIVE`` names it (``pacs``,
the default; ``grpo``, ``dapo``, ``dr_grpo``, ``gspo``, ``cispo``; or ``my_module:MyObjective``, a class built with
``PACS_OPTIONS`` as its keywords or any callable satisfying the ``Objective`` protocol), and ``PACS_OPTIONS`` holds its
settings (its class's keywords, e.g. ``{"eps_high": 0.28}``; Dr.GRPO needs ``max_completion_length``, verl's
``data.max_response_length``). The objective gets verl's log-probs, the 0/1 rewards read back from the advantages
("pacs_label" carries them: the GRPO family computes its own group advantages from them) and the response mask. Its
loss is normalised by what it declares (pacs.train.loss_objective.token_mean): a mean over responses (GSPO, Dr.GRPO,
GRPO with ``aggregation="seq_mean"``) as PACS's, times the micro-batch's responses over the global mini-batch's and
the data-parallel size; a token mean (GRPO's default, DAPO, CISPO) as verl's own "token-mean", times the
micro-batch's response tokens over the global mini-batch's (``batch_num_tokens`` of verl's global batch info) and the
data-parallel size, so the mini-batch's loss is its one token mean. (PACS's scaling is checked through verl's actor
update; the token-mean one follows verl's ``agg_loss`` and is not.)

Metrics: the loss's stats under ``actor/pacs/``, one value per optimizer step (verl averages the
micro-batches' values). ``sigmoid_psi_correct_mean`` (``..._incorrect_mean``) is NaN for a micro-batch
without a correct (incorrect) response, and verl's plain mean then makes the step's value NaN (with one
group per micro-batch, whenever a group's responses are all wrong or all right).

PACS options (defaults: the paper's run) come from the environment variable ``PACS_OPTIONS``, a
JSON object with any of ``beta``, ``score``, ``advantage``, ``weighting``, ``score_function_term``
(set it for the Ray workers too, e.g. through ``ray_kwargs.ray_init.runtime_env.env_vars``).

What the loss receives is verl's per-token log-probs (computed by verl's actor: its own fused
kernels or the full logits), so here the fused part of pacs_kernels is the group loss
(``pacs_loss``); the log-prob kernels stay verl's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from pacs.train.loss_objective import named_objective, token_mean
from pacs_kernels import pacs_loss
from pacs_kernels.loss_inputs import check_beta
from pacs_kernels.objectives.pacs import weighted_logprobs

OPTION_NAMES = ("beta", "score", "advantage", "weighting", "score_function_term")
OBJECTIVE_VARIABLE = "PACS_OBJECTIVE"  # which objective the "pacs" policy loss runs (default: pacs)


def objective_name() -> str:
    """``PACS_OBJECTIVE``: a built-in objective's name or a user's ``module:Class`` (unset: ``pacs``)."""
    return os.environ.get(OBJECTIVE_VARIABLE, "").strip() or "pacs"


def pacs_options(objective: str = "pacs") -> dict:
    """The loss options from ``PACS_OPTIONS`` (JSON object): for PACS, checked for unknown names; for another
    objective, the keywords of its class (checked when it is built)."""
    raw = os.environ.get("PACS_OPTIONS", "").strip()
    if not raw:
        return {}
    options = json.loads(raw)
    if not isinstance(options, dict):
        raise ValueError(f"PACS_OPTIONS must be a JSON object, got {raw!r}")
    if objective != "pacs":
        return options
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"PACS_OPTIONS: unknown option(s) {unknown}; expected a subset of {list(OPTION_NAMES)}")
    if "beta" in options:
        check_beta(options["beta"], "PACS_OPTIONS beta")
    return options


def check_whole_groups(index: Sequence) -> int:
    """index: (B,) group ids (verl's ``uid``) in batch order -> group size G.

    Raises ValueError unless every group's responses are contiguous and every group has the same size.
    """
    ids = list(index)
    if not ids:
        raise ValueError("index must hold one group id per response, got an empty batch")
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    sizes = [end - start for start, end in zip(starts, starts[1:] + [len(ids)])]
    if len(set(ids[s] for s in starts)) != len(starts):
        raise ValueError(
            "PACS needs each group's responses contiguous in the batch, but a uid appears in separate runs "
            "(trainer.balance_batch=True reorders responses across groups: set trainer.balance_batch=False; "
            "verl's v1 trainer, its default, reorders them whatever balance_batch says: set "
            "trainer.use_v1=False)")
    if len(set(sizes)) != 1:
        raise ValueError(f"PACS needs groups of equal size, got group sizes {sorted(set(sizes))}")
    return sizes[0]


def pacs_label_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config=None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator "pacs_label": (B, T) token rewards -> ((B, T) labels, (B, T) labels).

    The label of response i is ``token_level_rewards[i].sum()``, which must be 0 or 1; it is written
    on each of the response's tokens (0 elsewhere) so that it reaches the policy loss.
    """
    labels = token_level_rewards.sum(-1)
    bad = (labels != 0) & (labels != 1)
    if bool(bad.any()):
        raise ValueError(
            "PACS needs 0/1 rewards (a verifier's right/wrong), got response rewards "
            f"{sorted(set(labels[bad].tolist()))[:8]}")
    if config is not None:
        check_algorithm_config(config)
    if index is not None:
        check_whole_groups(index)
    check_no_empty_response(response_mask)
    advantages = labels[:, None] * response_mask.to(labels.dtype)
    return advantages, advantages


def _setting(config, name: str, default=None):
    """``config.name`` of a verl config: a dataclass (verl's BaseConfig, which also has ``get``), a DictConfig
    or a plain mapping."""
    get = getattr(config, "get", None)
    if callable(get):
        return get(name, default)
    return getattr(config, name, default)


def check_algorithm_config(config) -> None:
    """The verl ``algorithm`` settings (the AlgoConfig verl's ``compute_advantage`` passes the advantage
    estimator) PACS needs; ValueError otherwise.

    ``algorithm.rollout_correction.bypass_mode=True`` makes verl skip the actor's recompute of the old
    log-probs and use the rollout engine's sampling log-probs (vLLM/SGLang) as ``old_log_probs`` (verl 0.9.1:
    ``apply_bypass_mode`` in ``trainer/ppo/rollout_corr_helper.py``, ``_compute_old_log_prob`` of the v1
    trainer). PACS's score is ``beta * sum(log pi_theta - log pi_old)`` with pi_old the trained policy's own
    forward at rollout time: with the engine's log-probs it does not start at 0 (different kernels and
    precision), and nothing in the batch the loss receives shows it, nor does the actor's config, so it is
    refused here, before the first update.
    """
    correction = _setting(config, "rollout_correction")
    # verl's own test: ``rollout_corr_config and rollout_corr_config.get("bypass_mode", False)``
    if correction and _setting(correction, "bypass_mode", False):
        raise ValueError(
            "PACS needs the old log-probs recomputed by the actor at rollout time (psi = beta * sum(log pi_theta "
            "- log pi_old) must start at 0), but algorithm.rollout_correction.bypass_mode=True makes verl use the "
            "rollout engine's sampling log-probs as old_log_probs: set algorithm.rollout_correction.bypass_mode="
            "false (verl's one-step-off-policy and fully-async recipes set it to true)")


VERL_RS_MODES = {"token_k1": ("token_mask", "product"), "seq_sum_k1": ("sequence_mask", "product"),
                 "seq_mean_k1": ("sequence_mask", "geometric")}


def rollout_correction_settings(correction) -> dict | None:
    """verl's ``algorithm.rollout_correction`` (``RolloutCorrectionConfig``: ``rollout_is``, ``rollout_is_threshold``,
    ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``) as ``pacs train``'s
    ``advanced.rollout_correction`` settings ``{mode, c_min, c_max, sequence_ratio}`` (None: no correction):

    - ``rollout_is="token"`` / ``"sequence"`` (truncated IS, ``min(rho, rollout_is_threshold)``): ``token_truncate`` /
      ``sequence_truncate`` with ``c_max = rollout_is_threshold``, ``c_min = 0``;
    - ``rollout_rs="token_k1"`` / ``"seq_sum_k1"`` / ``"seq_mean_k1"`` (rejection outside the ratio band
      ``rollout_rs_threshold``: ``"lower_upper"``, or an upper bound whose reciprocal is the lower): ``token_mask`` /
      ``sequence_mask`` (product) / ``sequence_mask`` (geometric).

    A ValueError names what has no single equivalent: both at once, the k2/k3/max rejection modes, batch
    normalisation of the weights."""
    if not correction:
        return None
    is_level, rs_modes = _setting(correction, "rollout_is"), _setting(correction, "rollout_rs")
    if is_level and rs_modes:
        raise ValueError(f"algorithm.rollout_correction sets both rollout_is={is_level!r} and rollout_rs={rs_modes!r}: "
                         "advanced.rollout_correction.mode takes one of them")
    if is_level:
        if is_level not in ("token", "sequence"):
            raise ValueError(f"algorithm.rollout_correction.rollout_is must be 'token', 'sequence' or null, got "
                             f"{is_level!r}")
        if _setting(correction, "rollout_is_batch_normalize", False):
            raise ValueError("algorithm.rollout_correction.rollout_is_batch_normalize=True has no equivalent in "
                             "advanced.rollout_correction (weights are not renormalised)")
        return {"mode": f"{is_level}_truncate", "c_min": 0.0,
                "c_max": float(_setting(correction, "rollout_is_threshold", 2.0)), "sequence_ratio": "product"}
    if not rs_modes:
        return None
    if rs_modes not in VERL_RS_MODES:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={rs_modes!r} has no equivalent in "
                         f"advanced.rollout_correction: expected one of {', '.join(VERL_RS_MODES)} (a ratio band)")
    mode, sequence_ratio = VERL_RS_MODES[rs_modes]
    threshold = _setting(correction, "rollout_rs_threshold")
    if threshold is None:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={rs_modes!r} needs rollout_rs_threshold")
    if isinstance(threshold, str) and "_" in threshold:
        low, high = (float(x) for x in threshold.split("_", 1))
    else:
        high = float(threshold)
        low = 1.0 / high
    return {"mode": mode, "c_min": low, "c_max": high, "sequence_ratio": sequence_ratio}


def check_no_empty_response(response_mask: torch.Tensor) -> None:
    """Every response keeps a token: its label rides on its tokens, so a response whose mask verl zeroed (the
    rejection sampling of algorithm.rollout_correction drops whole responses) would read as label 0."""
    empty = ~response_mask.bool().any(-1)
    if bool(empty.any()):
        raise ValueError(
            f"responses {empty.nonzero().flatten()[:8].tolist()} have an all-zero response_mask (verl's "
            "algorithm.rollout_correction rejection sampling drops whole responses): their 0/1 labels would be "
            "lost and read as 0; PACS refuses rollout correction: set algorithm.rollout_correction.rollout_rs=null")


def check_actor_config(config) -> int:
    """The verl ActorConfig settings PACS needs -> group size G (``rollout_n``); ValueError otherwise."""
    group_size = config.rollout_n
    if config.use_dynamic_bsz:
        raise ValueError("PACS needs whole groups in every micro-batch: expected actor.use_dynamic_bsz=False "
                         "(dynamic batch sizes cut micro-batches by tokens), got True")
    micro = config.ppo_micro_batch_size_per_gpu
    if micro is None or micro % group_size != 0:
        raise ValueError(f"actor.ppo_micro_batch_size_per_gpu must be a multiple of rollout.n ({group_size}) so that "
                         f"micro-batches hold whole groups, got {micro}")
    if getattr(config, "shuffle", False):
        raise ValueError("PACS needs whole groups in every micro-batch: expected actor.shuffle=False, got True")
    return group_size


def labels_from_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) advantages written by "pacs_label" -> (B,) float32 0/1 labels (checked)."""
    mask = response_mask.bool()
    labels = torch.where(mask, advantages, torch.zeros_like(advantages)).amax(-1).float()
    same = torch.where(mask, advantages.float() == labels[:, None], torch.ones_like(mask)).all(-1)
    if not bool(same.all()) or bool(((labels != 0) & (labels != 1)).any()):
        raise ValueError("the advantages do not hold one 0/1 label per response: use algorithm.adv_estimator="
                         "pacs_label together with policy_loss.loss_mode=pacs")
    return labels


def compute_policy_loss_pacs(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-sum", config=None,
                             rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """verl policy loss "pacs": (B, T) log-probs, labels in ``advantages`` -> (loss, metrics).

    ``loss_agg_mode`` is not used (PACS's loss is a mean over responses, normalised as described in
    the module doc).
    """
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it carries rollout_n, the group size")
    group_size = check_actor_config(config)
    check_no_empty_response(response_mask)
    labels = labels_from_advantages(advantages, response_mask)
    name = objective_name()
    weights = None if rollout_is_weights is None else rollout_is_weights.detach().to(log_prob.dtype)
    if name == "pacs":  # verl's IS weights weigh each token's term of the score (pacs_kernels/objectives/pacs.py)
        loss, stats = pacs_loss(weighted_logprobs(log_prob, old_log_prob, weights), old_log_prob, labels,
                                response_mask, group_size=group_size, return_stats=True, **pacs_options())
        stats = stats.as_dict()
    else:  # another objective (PACS_OBJECTIVE), built with PACS_OPTIONS as its keywords
        objective = named_objective(name, pacs_options(name), where=OBJECTIVE_VARIABLE)
        extra = {} if weights is None else {"token_weights": weights}
        loss, stats = objective(log_prob, old_log_prob, labels.to(log_prob.dtype), response_mask.bool(),
                                group_size=group_size, **extra)
    # verl 0.9.1's actor update (checked through it: tests/test_verl_actor_update.py): RayPPOTrainer._update_actor
    # sets global_batch_size = ppo_mini_batch_size * rollout.n (responses per optimizer step, all ranks),
    # ppo_loss copies it and dp_size into config.global_batch_info, FSDPEngine.forward_backward_batch calls
    # loss.backward() on each micro-batch's loss as returned (no other scaling) and steps once per mini-batch,
    # FSDP averages the gradients over the dp ranks. So sum_micro(mean * B_micro) / global * dp, averaged over
    # dp, is the mean over the global mini-batch: the public code's micro-batch mean / number of micro-batches.
    info = getattr(config, "global_batch_info", None) or {}
    global_size, global_tokens = info.get("global_batch_size"), info.get("batch_num_tokens")
    if name != "pacs" and token_mean(objective) and global_tokens:  # verl's token-mean: over the mini-batch's tokens
        loss = loss * response_mask.sum() / global_tokens * info.get("dp_size", 1)
    elif global_size:
        loss = loss * labels.shape[0] / global_size * info.get("dp_size", 1)
    # verl passes no entropy (nor a reference's log-probs) to the policy loss: those stats are always NaN there
    metrics = {f"actor/pacs/{key}": value for key, value in stats.items() if key not in ("entropy_mean", "kl_mean")}
    return loss, metrics


def register() -> bool:
    """Register "pacs_label" and "pacs" in verl's registries; False when verl is not importable."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        return False
    if core_algos.ADV_ESTIMATOR_REGISTRY.get("pacs_label") is not pacs_label_advantage:
        core_algos.register_adv_est("pacs_label")(pacs_label_advantage)
    core_algos.register_policy_loss("pacs")(compute_policy_loss_pacs)
    return True


REGISTERED = register()
