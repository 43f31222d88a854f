"""Choices as registries (issue 49 item 3): objectives, rollout engines, tasks and rewards are found by name in
pacs/registry.py, which a user's module extends; here a module written outside the package defines one of each
and ``pacs train`` runs a few steps with them, named ``module:Name`` (and by a registered name)."""

from __future__ import annotations

import json
import math
import os
import textwrap

import pytest
from test_run_errors import TINY_RUN, run_cli, tiny_model  # noqa: F401  (tiny_model: a fixture)

from pacs.config import load_config, validate
from pacs.registry import OBJECTIVES, REWARDS, ROLLOUT_ENGINES, TASKS, Registry

USER_MODULE = textwrap.dedent('''
    """A user's choices, outside the pacs package: each call noted in the file $MY_CHOICES_LOG."""
    import os
    from dataclasses import dataclass

    import torch

    from pacs.rollout.hf import HFGenerateEngine
    from pacs.tasks.arithmetic import AdditionTask


    def note(what):
        with open(os.environ["MY_CHOICES_LOG"], "a") as f:
            f.write(what + "\\n")


    @dataclass(frozen=True)
    class MeanBaselinePG:
        """-(1/B) sum_i (R_i - mean of its group) * mean_t logp[i, t]."""

        def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
            grouped = rewards.to(logp.dtype).reshape(-1, group_size)
            advantage = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
            mean_logp = torch.where(mask, logp, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
            loss = -(advantage * mean_logp).mean()
            return loss, {"my_objective_advantage": float(advantage.abs().mean())}


    class NotingEngine(HFGenerateEngine):
        """Hugging Face generate, noting that it was built and used."""

        def __init__(self, model_dir, *, max_model_len, seed, dtype):
            note("engine")
            super().__init__(model_dir, max_model_len=max_model_len, seed=seed, dtype=dtype)

        def generate(self, *args, **kwargs):
            note("generate")
            return super().generate(*args, **kwargs)


    class OneDigitSums(AdditionTask):
        """The addition task with one-digit numbers, built from the run's config."""

        name = "one_digit_sums"

        def __init__(self, cfg):
            note("task")
            super().__init__(1, seed=cfg.seed, eval_size=cfg.task.eval_size)


    def odd_length(response, answer):
        note("reward")
        return float(len(response.strip()) % 2)
''')

SPECS = ["optim.algo=my_choices:MeanBaselinePG", "rollout.engine=my_choices:NotingEngine",
         "task.name=my_choices:OneDigitSums", "advanced.task.reward=my_choices:odd_length"]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_choices.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    log = tmp_path / "calls.log"
    monkeypatch.setenv("MY_CHOICES_LOG", str(log))
    return log


def test_pacs_train_runs_a_users_objective_engine_task_and_reward(tmp_path, capsys, tiny_model,  # noqa: F811
                                                                  user_module):
    out = str(tmp_path / "run")
    code, _, err = run_cli(capsys, "train", "--output-dir", out, "--model", tiny_model, "--max-steps", "2",
                           *TINY_RUN, "rollout.max_new_tokens=3", "optim.lr=2e-4", *SPECS)
    assert code == 0, err
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["rollout_engine"] == "NotingEngine"
    assert all(math.isfinite(r["loss"]) and "my_objective_advantage" in r for r in rows[1:])
    calls = user_module.read_text().split()
    assert {"engine", "generate", "task", "reward"} <= set(calls)
    # a resume names the user's objective as the run recorded it: another one is refused
    code, _, err = run_cli(capsys, "train", "--output-dir", out, "--model", tiny_model, "--max-steps", "3",
                           "--resume", *TINY_RUN, "rollout.max_new_tokens=3", "optim.lr=2e-4", *SPECS[1:],
                           "optim.algo=grpo")
    assert code == 2 and 'optim.algo "my_choices:MeanBaselinePG" -> "grpo"' in err


def test_a_registered_name_is_a_choice_of_the_config_and_the_factories(user_module):
    from pacs.tasks import make_task
    from pacs.train.loss_objective import loss_objective

    registered = [(OBJECTIVES, "mean_baseline", "my_choices:MeanBaselinePG"),
                  (TASKS, "one_digit_sums", "my_choices:OneDigitSums"),
                  (REWARDS, "odd_length", "my_choices:odd_length"),
                  (ROLLOUT_ENGINES, "noting", "my_choices:NotingEngine")]
    for registry, name, spec in registered:
        registry.register(name, spec)
    try:
        cfg = load_config(None, ["optim.algo=mean_baseline", "task.name=one_digit_sums",
                                 "advanced.task.reward=odd_length", "rollout.engine=noting"])
        validate(cfg)
        assert type(loss_objective(cfg)).__name__ == "MeanBaselinePG"
        task = make_task(cfg)
        assert type(task).__name__ == "OneDigitSums" and task.reward_fn.__name__ == "odd_length"
        with pytest.raises(ValueError, match="a task named 'one_digit_sums' is registered already"):
            TASKS.register("one_digit_sums", "my_choices:OneDigitSums")
    finally:
        for registry, name, _ in registered:
            registry.unregister(name)
    with pytest.raises(ValueError, match="optim.algo .--algo. must be one of pacs, grpo, dapo, dr_grpo, gspo, cispo, "
                                         "or a user's objective as module:Class"):
        validate(load_config(None, ["optim.algo=mean_baseline"]))


def test_a_registry_resolves_on_use_and_names_what_is_wrong(user_module):
    registry = Registry("thing", "section.thing", {"lazy": "no_such_module_49:Thing"}, example="mod:Thing")
    assert registry.names() == ("lazy",)  # nothing imported yet
    with pytest.raises(ValueError, match=r"section.thing='lazy' \(no_such_module_49:Thing\): cannot import module "
                                         "'no_such_module_49'"):
        registry.resolve("lazy")
    with pytest.raises(ValueError, match="'my_choices' has no attribute 'Nope'"):
        registry.resolve("my_choices:Nope")
    with pytest.raises(ValueError, match="section.thing must be one of lazy, or a user's thing as module:Name "
                                         r"\(e.g. mod:Thing\); got 'other'"):
        registry.check("other")
    with pytest.raises(ValueError, match="a string must be 'module:attribute'"):
        registry.register("x", "not a spec")
    with pytest.raises(ValueError, match="'lazy' is no thing registered by register"):
        registry.unregister("lazy")
