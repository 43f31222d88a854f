"""The ``optim`` section: the objective (a registered one, pacs/registry.py), its settings and AdamW's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pacs.config.fields import check_section, setting
from pacs.registry import CLIP_RANGE_READERS, OBJECTIVES


@dataclass
class OptimConfig:
    TRAINING_ONLY: ClassVar[bool] = True  # pacs eval reads none of it

    algo: str = setting("pacs", "the objective: pacs | grpo | dapo | dr_grpo | gspo | cispo, or a user's as "
                        "module:Class (pacs/train/loss_objective.py)", choices=OBJECTIVES, flag="--algo")
    lr: float = setting(1e-6, "the paper's (the built-in tasks: 2e-4)", above=0, at_most=1,
                        why="AdamW moves each weight by about lr per step")
    weight_decay: float = setting(0.0, "AdamW's", at_least=0, advanced=True)
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW's", advanced=True)
    lr_schedule: str = setting("cosine", "constant | cosine | linear (decays to 0 at max_steps)",
                               choices=("constant", "cosine", "linear"))
    lr_warmup_steps: int = setting(0, "optimizer steps", at_least=0, advanced=True)
    mini_batches_per_step: int = setting(2, "optimizer steps per rollout step (whole groups each)", above=0)
    micro_batch_groups: int = setting(4, "groups per micro-batch (gradient accumulation)", above=0)
    micro_batch_responses: int | None = setting(None, "alternative to micro_batch_groups; must be a multiple of G",
                                                above=0, advanced=True)
    max_grad_norm: float = setting(1.0, "gradients clipped to this global norm before each optimizer step", above=0,
                                   advanced=True)
    master_dtype: str = setting(
        "float32", "the dtype of the weights AdamW steps (pacs/model/mixed_precision.py): float32 master weights "
        "under a 16-bit model.dtype; a 16-bit name equal to model.dtype steps those weights directly (warns: small "
        "updates round away); float32 | bfloat16 | float16", choices=("float32", "bfloat16", "float16"))
    beta: float = setting(1.0, "PACS (docs/pacs-algorithm.md); the score's scale: psi = beta * score, made relative "
                          "to the group", above=0)
    score: str = setting("log_ratio", "log_ratio (sum of log-probs minus the reference's) | mean_logp",
                         choices=("log_ratio", "mean_logp"), advanced=True)
    advantage: str = setting("rloo", "rloo | grpo | naive: how a score is made relative to its group",
                             choices=("rloo", "grpo", "naive"), advanced=True)
    weighting: str = setting("balanced", "BCE class weights: balanced | none | positive_only | negative_only",
                             choices=("balanced", "none", "positive_only", "negative_only"), advanced=True)
    score_function_term: bool = setting(False, "add Eq. 6's score-function term (its value 0, its gradient not)",
                                        advanced=True)
    ref_reset_every: int = setting(
        1, "the reference of the log-ratio score: the policy at rollout steps 1, 1 + k, 1 + 2k, ... (k = this); 1 "
        "(the public code's): the policy that generated each rollout (pacs/model/reference_policy.py)",
        at_least=1, expect="an integer >= 1 (rollout steps)", advanced=True)
    drop_single_label_groups: bool = setting(
        False, "PACS only: groups whose responses all got the same reward weigh 0 in the loss "
        "(pacs/train/single_label_groups.py; with a reset every rollout step they add no gradient on the first "
        "mini-batch anyway)", advanced=True)
    clip_eps: float = setting(0.2, "GRPO baseline; the ratio is clipped to [1 - clip_eps, 1 + clip_eps] (high side: "
                              "eps_high if set)", above=0, below=1, advanced=True)
    aggregation: str = setting("token_mean", "token_mean (over the mini-batch's tokens) | seq_mean (of response "
                               "means)", choices=("token_mean", "seq_mean"), advanced=True)
    eps_low: float | None = setting(
        None, "the GRPO family's clip range [1 - eps_low, 1 + eps_high] (of the token ratio; GSPO's sequence ratio, "
        "CISPO's IS weight); None: the objective's own (low/high: dapo 0.2/0.28, dr_grpo 0.2/0.2, gspo 3e-4/4e-4, "
        "cispo 1/0.28); dapo, dr_grpo, gspo, cispo (grpo's low side is clip_eps)", at_least=0, at_most=1,
        why="the ratio is clipped below at 1 - eps_low", advanced=True)
    eps_high: float | None = setting(None, "dapo, dr_grpo, gspo, cispo, grpo (unset for grpo: clip_eps)", at_least=0,
                                     why="the ratio is clipped above at 1 + eps_high", advanced=True)
    logprob_backend: str = setting("auto", "the log-prob kernels: auto | triton | torch | naive (logits "
                                   "materialized)", choices=("auto", "triton", "torch", "naive"), advanced=True)
    one_sweep_first_step: bool = setting(
        True, "an objective that declares it (PACS, the GRPO family without an entropy bonus): on the first "
        "mini-batch after each rollout (weights unchanged since the old-policy pass), get loss and gradients in one "
        "vocabulary sweep (the loss's old_lse=)", advanced=True)

    def check(self) -> None:
        """Each setting in its range, and each objective setting set only for an objective that reads it."""
        check_section(self, "optim.")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"advanced.optim.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.one_sweep_first_step and self.logprob_backend == "naive":
            raise ValueError("optim.one_sweep_first_step needs optim.logprob_backend 'auto', 'torch' or 'triton', "
                             "got 'naive'; set advanced.optim.one_sweep_first_step=false to use the naive backend")
        if self.ref_reset_every > 1 and (self.algo != "pacs" or self.score != "log_ratio"):
            raise ValueError(
                f"optim.ref_reset_every={self.ref_reset_every} keeps PACS's reference for several rollout steps: it "
                "needs optim.algo=pacs and optim.score=log_ratio (the only score that uses a reference), got "
                f"algo={self.algo}, score={self.score}; GRPO's old policy must be the one that sampled")
        if self.drop_single_label_groups and self.algo != "pacs":
            raise ValueError(f"optim.drop_single_label_groups is a PACS option, got optim.algo={self.algo}; GRPO's "
                             "single-label groups have advantage 0 already")
        for key, algos in CLIP_RANGE_READERS.items():
            if getattr(self, key) is not None and self.algo not in algos:
                why = ("GRPO's low side is advanced.optim.clip_eps" if self.algo == "grpo" else
                       "a user's objective is built with its own defaults" if self.algo not in OBJECTIVES.builtin
                       else "PACS clips no ratio")
                raise ValueError(f"optim.{key} is read by optim.algo {', '.join(algos)}, got optim.algo={self.algo} "
                                 f"({why}); leave advanced.optim.{key} unset")
        if self.aggregation != "token_mean" and self.algo != "grpo":
            raise ValueError(f"optim.aggregation={self.aggregation!r} is GRPO's, got optim.algo={self.algo}; each "
                             "other objective has its own aggregation (docs/objectives.md)")
