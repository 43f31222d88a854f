"""The ``eval`` section: held-out evaluations during training (and ``pacs eval``)."""

from __future__ import annotations

from dataclasses import dataclass

from pacs.config.fields import check_section, setting


@dataclass
class EvalConfig:
    every: int = setting(25, "rollout steps between held-out evaluations (0: start and end only)", at_least=0,
                         training_only=True)
    num_problems: int = setting(200, "held-out problems per evaluation (at most task.eval_size)", above=0)
    n_samples: int = setting(1, "> 1 with temperature > 0 gives pass@k", above=0)
    temperature: float = setting(0.0, "0: greedy", at_least=0)
    top_p: float = setting(1.0, "nucleus sampling of the evaluation; 1: off", above=0, at_most=1, advanced=True)
    ks: tuple[int, ...] = setting((1,), "the k of each pass@k reported (each <= n_samples)")

    def check(self) -> None:
        check_section(self, "eval.")
        for k in self.ks:
            if not 1 <= k <= self.n_samples:
                raise ValueError(f"eval.ks entries must be in [1, eval.n_samples={self.n_samples}], got {k}")
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError("eval.n_samples > 1 needs eval.temperature > 0 (greedy samples are identical)")
