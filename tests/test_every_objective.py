"""Every objective trains (issue 45 item 4): ``pacs train --algo`` (``optim.algo``) takes every built-in objective by
name and a user's as ``module:Class`` (here tests/objective_plugin.py), builds it from its settings
(pacs/train/loss_objective.py), refuses what it does not read, refuses a resume with another objective, logs the
objective's statistics, and (slow) trains the built-in task to a held-out accuracy above its start and resumes
exactly."""

from __future__ import annotations

import math
import os

import pytest
from objective_plugin import LeaveOneOutPG
from test_run_errors import TINY_RUN, one_error_line, run_cli, tiny_model  # noqa: F401  (tiny_model: a fixture)
from trainer_helpers import comparable

from pacs.config import BUILTIN_OBJECTIVES, load_config, validate
from pacs.train.loss_objective import (
    loss_objective,
    named_objective,
    one_sweep_first_step,
    takes_response_validity,
    token_mean,
)
from pacs.train.metrics import read_metrics
from pacs_kernels import CISPO, DAPO, GRPO, GSPO, PACS, DrGRPO

PLUGIN = "objective_plugin:LeaveOneOutPG"
FAMILY = ["dapo", "dr_grpo", "gspo", "cispo", PLUGIN]  # beside pacs and grpo, trained since issue 45


def built(*overrides: str):
    cfg = load_config(None, list(overrides))
    validate(cfg)
    return loss_objective(cfg)


def test_every_builtin_objective_by_name_with_its_own_defaults():
    assert BUILTIN_OBJECTIVES == ("pacs", "grpo", "dapo", "dr_grpo", "gspo", "cispo")
    assert built("optim.algo=pacs") == PACS()
    assert built("optim.algo=grpo") == GRPO()
    assert built("optim.algo=dapo") == DAPO()  # eps 0.2 / 0.28: the paper's clip-higher
    assert built("optim.algo=gspo") == GSPO()  # 3e-4 / 4e-4 on the sequence ratio
    assert built("optim.algo=cispo") == CISPO()  # 1.0 / 0.28 on the IS weight
    # Dr.GRPO's constant length is the rollout's response budget (the built-in task's: 6 tokens)
    assert built("optim.algo=dr_grpo") == DrGRPO(max_completion_length=6)
    assert built("optim.algo=dr_grpo", "rollout.max_new_tokens=9") == DrGRPO(max_completion_length=9)
    assert built(f"optim.algo={PLUGIN}") == LeaveOneOutPG()


def test_each_objective_takes_its_settings_from_the_config():
    clip = ("advanced.optim.eps_low=0.1", "advanced.optim.eps_high=0.3")
    for algo, cls in (("dapo", DAPO), ("gspo", GSPO), ("cispo", CISPO)):
        assert built(f"optim.algo={algo}", *clip) == cls(eps_low=0.1, eps_high=0.3)
    assert built("optim.algo=dr_grpo", *clip) == DrGRPO(max_completion_length=6, eps_low=0.1, eps_high=0.3)
    assert built("optim.algo=dapo", "advanced.optim.eps_high=0.4") == DAPO(eps_high=0.4)  # eps_low: DAPO's own
    assert built("optim.algo=grpo", "advanced.optim.clip_eps=0.1", "advanced.optim.eps_high=0.3",
                 "advanced.optim.aggregation=seq_mean") == GRPO(clip_eps=0.1, clip_eps_high=0.3, aggregation="seq_mean")
    assert built("optim.beta=0.5", "advanced.optim.advantage=grpo") == PACS(beta=0.5, advantage="grpo")


@pytest.mark.parametrize("overrides, match", [
    (["optim.algo=ppo"], r"optim.algo \(--algo\) must be one of pacs, grpo, dapo, dr_grpo, gspo, cispo, or a user's "
                         r"objective as module:Class .*got 'ppo'"),
    (["optim.algo=objective_plugin:"], "module:Class"),
    (["optim.algo=not a module:X"], "module:Class"),
    (["advanced.optim.eps_low=0.1"], r"optim.eps_low is read by optim.algo dapo, dr_grpo, gspo, cispo, got "
                                     r"optim.algo=pacs \(PACS clips no ratio\)"),
    (["optim.algo=grpo", "advanced.optim.eps_low=0.1"], "GRPO's low side is advanced.optim.clip_eps"),
    ([f"optim.algo={PLUGIN}", "advanced.optim.eps_high=0.3"], "built with its own defaults"),
    (["optim.algo=dapo", "advanced.optim.eps_low=1.5"], r"optim.eps_low must be in \[0, 1\]"),
    (["optim.algo=cispo", "advanced.optim.eps_high=-0.1"], "optim.eps_high must be >= 0"),
    (["optim.algo=dapo", "advanced.optim.aggregation=seq_mean"], "optim.aggregation='seq_mean' is GRPO's"),
    (["optim.algo=gspo", "advanced.optim.drop_single_label_groups=true"], "is a PACS option"),
])
def test_settings_an_objective_does_not_read_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate(load_config(None, overrides))


def test_a_user_objective_that_cannot_be_built_is_named():
    for spec, match in (("no_such_module_45:X", "cannot import module 'no_such_module_45'"),
                        ("objective_plugin:Missing", "has no attribute 'Missing'"),
                        ("objective_plugin:torch", "not an objective")):
        with pytest.raises(ValueError, match=match):
            named_objective(spec)
    assert named_objective(PLUGIN, {"eps": 0.1}) == LeaveOneOutPG(eps=0.1)
    with pytest.raises(ValueError, match="building the class with"):
        named_objective(PLUGIN, {"beta": 1.0})
    with pytest.raises(ValueError, match=r"optim.algo='dapo': .*beta"):
        named_objective("dapo", {"beta": 1.0})


def test_what_the_trainer_reads_is_declared_by_the_objective():
    """A token mean over the mini-batch (its micro-batches weighed by their tokens) or a mean over responses."""
    assert token_mean(GRPO()) and not token_mean(GRPO(aggregation="seq_mean"))
    assert token_mean(DAPO()) and token_mean(CISPO()) and token_mean(LeaveOneOutPG())
    assert not token_mean(GSPO()) and not token_mean(DrGRPO(max_completion_length=4)) and not token_mean(PACS())


def test_a_response_validity_mask_goes_to_an_objective_that_declares_it():
    """valid= (a per-response mask) is read from Capabilities(response_validity=...): PACS declares it; the GRPO
    family and a user's objective do not, and the engine refuses the mask for them by name (no silent drop)."""
    import torch

    from pacs_kernels import LossOptions, fused_linear_objective_loss

    assert takes_response_validity(PACS())
    assert not any(takes_response_validity(o) for o in (GRPO(), DAPO(), CISPO(), GSPO(), LeaveOneOutPG()))
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 3, 8, generator=g, dtype=torch.float64), torch.randn(11, 8, generator=g,
                                                                                          dtype=torch.float64)
    targets, mask = torch.randint(0, 11, (4, 3), generator=g), torch.ones(4, 3, dtype=torch.bool)
    old_logp, rewards = -torch.rand(4, 3, generator=g, dtype=torch.float64), torch.tensor([1.0, 0.0, 1.0, 0.0])
    valid = torch.tensor([True, True, False, True])
    loss, _ = fused_linear_objective_loss(hidden, weight, targets, mask, old_logp, rewards, objective=PACS(),
                                          group_size=2, options=LossOptions(backend="torch"), valid=valid)
    assert torch.isfinite(loss)
    for objective in (GRPO(), DAPO()):
        with pytest.raises(ValueError, match="valid= needs an objective that takes a per-response validity mask"):
            fused_linear_objective_loss(hidden, weight, targets, mask, old_logp, rewards, objective=objective,
                                        group_size=2, options=LossOptions(backend="torch"), valid=valid)


def test_the_one_sweep_first_step_is_what_the_objective_declares():
    """PACS and the GRPO family declare ``Capabilities(one_sweep=...)``: a loss of the log-probs alone takes the first
    mini-batch after a rollout in one vocabulary sweep; an entropy bonus does not. A user's objective that declares
    nothing runs as the engine runs it: one sweep unless it uses the entropy."""
    for objective in (PACS(), GRPO(), DAPO(), DrGRPO(max_completion_length=4), GSPO(), CISPO(), LeaveOneOutPG()):
        assert one_sweep_first_step(objective), objective
    assert not one_sweep_first_step(GRPO(entropy_coef=0.01)) and not one_sweep_first_step(DAPO(entropy_coef=0.01))


@pytest.mark.parametrize("algo", ["dapo", PLUGIN])
def test_pacs_train_gives_the_grpo_family_the_one_sweep_first_step(tmp_path, capsys, tiny_model, monkeypatch,
                                                                    algo):  # noqa: F811
    """The trainer's one loss call passes the rollout's log-sum-exp on the first mini-batch after each rollout
    (and only there) to any objective whose capabilities allow it: the engine then runs the one sweep."""
    import pacs.train.update as update

    real, first_steps = update.fused_linear_objective_loss, []

    def recording(*args, old_lse=None, **kwargs):
        first_steps.append(old_lse is not None)
        return real(*args, old_lse=old_lse, **kwargs)

    monkeypatch.setattr(update, "fused_linear_objective_loss", recording)
    argv = ["train", "--output-dir", str(tmp_path / "run"), "--model", tiny_model, "--algo", algo, "--max-steps", "2",
            *TINY_RUN, "optim.mini_batches_per_step=2", "advanced.optim.one_sweep_first_step=true"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert first_steps == [True, False, True, False]  # 2 rollout steps x 2 mini-batches of one micro-batch each


def test_pacs_train_names_a_bad_objective_in_one_line_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--output-dir", str(out), "--algo", "ppo", *TINY_RUN)
    assert code == 2 and "optim.algo (--algo) must be one of" in one_error_line(err)
    code, _, err = run_cli(capsys, "train", "--output-dir", str(out), "--algo", "no_such_module_45:Loss", *TINY_RUN)
    assert code == 2 and "cannot import module 'no_such_module_45'" in one_error_line(err)
    assert not out.exists()
    from pacs.cli import build_parser

    assert "{pacs,grpo,dapo,dr_grpo,gspo,cispo,MODULE:CLASS}" in build_parser().format_help() + \
        build_parser()._subparsers._group_actions[0].choices["train"].format_help()


@pytest.mark.parametrize("algo", FAMILY)
def test_pacs_train_runs_each_objective_and_logs_its_statistics(tmp_path, capsys, tiny_model, algo):  # noqa: F811
    """Two rollout steps through `pacs train --algo`: finite losses, the objective's statistics in the metrics, and
    a resume with another objective refused as today."""
    out = str(tmp_path / "run")
    argv = ["train", "--output-dir", out, "--model", tiny_model, "--algo", algo, "--max-steps", "2", *TINY_RUN,
            "rollout.max_new_tokens=3"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    stats = "advantage_abs_mean" if algo == PLUGIN else "clip_frac"
    for row in rows[1:]:
        assert math.isfinite(row["loss"]) and math.isfinite(row[stats]) and "kl_mean" not in row
    other = "cispo" if algo != "cispo" else "dapo"
    code, _, err = run_cli(capsys, "train", "--output-dir", out, "--model", tiny_model, "--algo", other,
                           "--max-steps", "3", "--resume", *TINY_RUN, "rollout.max_new_tokens=3")
    assert code == 2 and f'optim.algo "{algo}" -> "{other}"' in one_error_line(err)


# The built-in addition task as it ships (configs/default.yaml: 32 prompts x 8 responses a step, lr 2e-4), on a seed
# whose warm-up leaves room to learn, 20 rollout steps at a constant learning rate (so that a run stopped at step 10
# and resumed continues the schedule of one run of 20 steps), held-out accuracy at steps 0, 10 and 20 on the 200
# held-out problems, 4 samples each at temperature 0.6 (800 samples: one sample's noise is ~0.01). Measured on a
# 2-core AMD EPYC: from 0.066, every objective reaches 0.087-0.10 by step 20, ~15 s a run with the warm-up cached.
LEARNS = ["--seed", "9", "--rollout", "hf", "optim.lr_schedule=constant", "eval.every=10", "eval.num_problems=200",
          "eval.n_samples=4", "eval.temperature=0.6", "checkpoint_every=10", "advanced.plot=false",
          "advanced.torch_threads=1"]


@pytest.fixture(scope="module")
def warmup_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmup_cache"))


@pytest.mark.slow
@pytest.mark.parametrize("algo", FAMILY)
def test_each_objective_trains_the_builtin_task_and_resumes_exactly(tmp_path, capsys, warmup_cache, algo):
    """`pacs train --algo ALGO` lifts held-out accuracy above its start in 20 steps; the same run stopped after
    step 10 and resumed (`--resume`, `--max-steps 20`) writes the same metrics, evaluations included."""
    common = ["--algo", algo, *LEARNS, f"advanced.task.cache_dir={warmup_cache}"]
    full = str(tmp_path / "full")
    code, _, err = run_cli(capsys, "train", "--output-dir", full, "--max-steps", "20", *common)
    assert code == 0, err
    rows = comparable(read_metrics(os.path.join(full, "metrics.jsonl")))
    accuracy = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    assert sorted(accuracy) == [0, 10, 20]
    assert accuracy[20] > accuracy[0] + 0.01, f"{algo}: held-out accuracy {accuracy}"
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows[1:])

    stopped = str(tmp_path / "stopped")
    code, _, err = run_cli(capsys, "train", "--output-dir", stopped, "--max-steps", "10", *common)
    assert code == 0, err
    code, text, err = run_cli(capsys, "train", "--output-dir", stopped, "--max-steps", "20", "--resume", *common)
    assert code == 0, err
    assert "[resume] continuing from" in text
    assert comparable(read_metrics(os.path.join(stopped, "metrics.jsonl"))) == rows
