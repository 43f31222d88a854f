"""The ``rollout_correction`` section: the sampler is not the trainer (pacs/train/rollout_correction.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pacs.config.fields import check_section, setting


@dataclass
class RolloutCorrectionConfig:
    """The sampler is not the trainer (pacs/train/rollout_correction.py, docs/rollout-correction.md): every step
    logs the mismatch of their log-probs; a mode drops what lies outside [c_min, c_max] of the ratio
    pi_trainer / pi_sampler, for any objective."""

    TRAINING_ONLY: ClassVar[bool] = True  # pacs eval reads none of it

    mode: str = setting("none", "none | token_mask (tokens out of the band) | sequence_mask (whole responses) | "
                        "token_truncate / sequence_truncate (each token's term x its ratio clamped to the band)",
                        choices=("none", "token_mask", "sequence_mask", "token_truncate", "sequence_truncate"),
                        advanced=True)
    c_min: float = setting(0.0, "the band's low end (0: none; the ratio is > 0)", advanced=True)
    c_max: float = setting(3.0, "the band's high end (TRL's vllm_importance_sampling_clip_max default)", advanced=True)
    sequence_ratio: str = setting("product", "a response's ratio: product (exp of the summed log-ratios, TRL's "
                                  "sequence modes) | geometric (exp of their mean)", choices=("product", "geometric"),
                                  advanced=True)
    sampler_temperature: float | None = setting(
        None, "sample the training rollouts at this temperature instead of rollout.temperature, the trainer's "
        "log-probs staying at rollout.temperature: a deliberately mismatched sampler, for experiments (None: the "
        "same)", above=0, advanced=True)

    def check(self) -> None:
        check_section(self, "rollout_correction.")
        if not 0 <= self.c_min < 1 < self.c_max:
            raise ValueError("advanced.rollout_correction needs 0 <= c_min < 1 < c_max (a band around the on-policy "
                             f"ratio 1), got c_min={self.c_min}, c_max={self.c_max}")
