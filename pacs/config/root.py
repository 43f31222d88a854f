"""The whole settings tree: the run's top-level keys and one section per concern."""

from __future__ import annotations

from dataclasses import dataclass

from pacs.config.eval import EvalConfig
from pacs.config.fields import check_section, section, setting
from pacs.config.model import ModelConfig
from pacs.config.optim import OptimConfig
from pacs.config.rollout import RolloutConfig
from pacs.config.rollout_correction import RolloutCorrectionConfig
from pacs.config.task import TaskConfig
from pacs.config.train import TrainConfig


@dataclass
class Config:
    seed: int = setting(0, "the seed of data order, sampling and the built-in model's initialization", at_least=0,
                        flag="--seed")
    output_dir: str = setting("runs/embedded", "the run directory: config, metrics, checkpoints, final_model/")
    max_steps: int = setting(600, "rollout steps", at_least=0, flag="--max-steps", training_only=True)
    max_minutes: float | None = setting(None, "end the run (checkpoint, eval, export) past this wall time (per "
                                        "process)", above=0, training_only=True)
    checkpoint_every: int = setting(50, "rollout steps between checkpoints (0: by checkpoint_minutes and at the end)",
                                    at_least=0, training_only=True)
    checkpoint_minutes: float | None = setting(
        30.0, "also checkpoint once this long has passed since the last one (or the start), at a step's end: a crash "
        "loses at most this much plus one step; None: by step count only", above=0, advanced=True, training_only=True)
    resume: bool = setting(False, "continue OUTPUT_DIR's run from its newest verified checkpoint (--resume)",
                           advanced=True, training_only=True)
    overwrite: bool = setting(False, "move a run already in OUTPUT_DIR aside (OUTPUT_DIR.replaced-<time>; "
                              "--overwrite)", advanced=True, training_only=True)
    max_consecutive_nan: int = setting(3, "non-finite updates in a row (each skipped) that stop the run", above=0,
                                       advanced=True, training_only=True)
    torch_threads: int | None = setting(
        None, "None: 1 on CPU for the embedded model (tiny ops; more threads only spin, 20x slower on a busy 2-core "
        "machine), else torch's", above=0, advanced=True)
    plot: bool = setting(True, "write the metrics' and evaluations' plots (PNG) to the run directory", advanced=True)
    model: ModelConfig = section(ModelConfig)
    task: TaskConfig = section(TaskConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    optim: OptimConfig = section(OptimConfig)
    eval: EvalConfig = section(EvalConfig)
    train: TrainConfig = section(TrainConfig)
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig)

    def check(self) -> None:
        """The top-level keys, then each section's own (the rules across sections: pacs/config/rules.py)."""
        check_section(self, "")
        if not self.output_dir:
            raise ValueError("output_dir (--output-dir) must be a directory path, got an empty string")
        for part in (self.optim, self.rollout, self.task, self.model, self.rollout_correction, self.train,
                     self.eval):
            part.check()
