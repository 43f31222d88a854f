"""PACS's reference kept for several rollout steps (optim.ref_reset_every, pacs/model/reference_policy.py):
the snapshot and its swap, the schedule, the trainer's use of it, and resuming with it."""

import math
import os

import pytest
import torch
from trainer_helpers import comparable, tiny_config

from pacs.config import load_config, validate
from pacs.model.reference_policy import ReferenceSnapshot, is_reset_step
from pacs.train import train
from pacs.train.metrics import read_metrics


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmup_cache"))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def test_reset_steps_are_one_then_every_k():
    assert [s for s in range(1, 11) if is_reset_step(s, 3)] == [1, 4, 7, 10]
    assert all(is_reset_step(s, 1) for s in range(1, 6))


def test_the_snapshot_is_swapped_in_for_a_block_and_the_current_weights_come_back():
    model = _model(0)
    x = torch.randn(4, 5)
    snapshot = ReferenceSnapshot(model)
    with pytest.raises(RuntimeError, match="no reference snapshot"):
        with snapshot.weights_in():
            pass
    snapshot.take(step=1)
    before = model(x).detach()
    with torch.no_grad():  # an optimizer step's worth of change
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    current = {name: p.detach().clone() for name, p in model.named_parameters()}
    after = model(x).detach()
    assert not torch.allclose(before, after)
    with snapshot.weights_in():
        assert torch.equal(model(x), before)  # the reference's outputs, bit for bit
    assert all(torch.equal(p, current[name]) for name, p in model.named_parameters())
    with pytest.raises(ValueError, match="inside"):  # restored when the block raises, too
        with snapshot.weights_in():
            raise ValueError("inside")
    assert all(torch.equal(p, current[name]) for name, p in model.named_parameters())
    assert snapshot.step == 1


def test_a_checkpointed_snapshot_restores_the_same_reference_and_refuses_another_model():
    model = _model(1)
    snapshot = ReferenceSnapshot(model)
    snapshot.take(step=4)
    saved = snapshot.full_state()
    other = ReferenceSnapshot(_model(2))
    other.load_full_state(saved)
    assert other.step == 4
    assert all(torch.equal(other.weights[name], snapshot.weights[name]) for name in snapshot.weights)
    wider = ReferenceSnapshot(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)))
    with pytest.raises(ValueError, match="has shape .* it was written for another model"):
        wider.load_full_state(saved)
    with pytest.raises(ValueError, match="lack .* written for another model"):
        ReferenceSnapshot(torch.nn.Sequential(torch.nn.Linear(5, 7))).load_full_state(
            {"step": 1, "weights": {"9.weight": torch.zeros(1)}})


@pytest.mark.parametrize("overrides,message", [
    (["advanced.optim.ref_reset_every=0"], "optim.ref_reset_every must be an integer >= 1"),
    (["advanced.optim.ref_reset_every=2", "optim.algo=grpo"], "needs optim.algo=pacs and optim.score=log_ratio"),
    (["advanced.optim.ref_reset_every=2",
      "advanced.optim.score=mean_logp"], "needs optim.algo=pacs and optim.score=log_ratio"),
])
def test_settings_that_cannot_keep_a_reference_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(load_config(None, overrides))


def test_between_resets_the_loss_scores_against_the_older_reference(tmp_path, cache_dir):
    """k = 2: step 1 resets (as k = 1 does: the same numbers), step 2 scores against step 1's weights, so
    its first mini-batch's psi is no longer 0 and its loss differs from the k = 1 run's; step 3 resets."""
    runs = {}
    for k in (1, 2):
        cfg = tiny_config(tmp_path / f"k{k}", cache_dir, "max_steps=3", "rollout.engine=hf", "eval.every=0",
                          "checkpoint_every=0", f"advanced.optim.ref_reset_every={k}")
        train(cfg)
        runs[k] = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    every, kept = runs[1], runs[2]
    assert [r.get("ref_age") for r in kept[1:]] == [0.0, 1.0, 0.0]
    assert "ref_age" not in every[1]
    for key in ("loss", "grad_norm", "psi_std", "reward_mean"):
        assert kept[1][key] == pytest.approx(every[1][key], rel=1e-6, abs=1e-9), key
    assert kept[2]["reward_mean"] == every[2]["reward_mean"]  # the same weights sampled step 2
    assert not math.isclose(kept[2]["psi_std"], every[2]["psi_std"], rel_tol=1e-3)
    assert not math.isclose(kept[2]["loss"], every[2]["loss"], rel_tol=1e-4)


def test_a_resumed_run_scores_against_the_reference_it_had(tmp_path, cache_dir):
    """k = 3, checkpoint at step 2, resumed: step 3 needs step 1's weights (kept in the checkpoint); the
    resumed run logs what the uninterrupted one does."""
    steps = ["rollout.engine=hf", "eval.every=2", "checkpoint_every=2", "advanced.optim.ref_reset_every=3",
             "optim.lr_schedule=constant"]  # (the schedule would follow max_steps, which the two runs differ in)
    full = tiny_config(tmp_path / "full", cache_dir, "max_steps=4", *steps)
    train(full)
    expected = comparable(read_metrics(os.path.join(full.output_dir, "metrics.jsonl")))
    part = tiny_config(tmp_path / "part", cache_dir, "max_steps=2", *steps)
    train(part)
    assert os.path.isfile(os.path.join(part.output_dir, "checkpoints", "step_000002", "reference.pt"))
    resumed = tiny_config(tmp_path / "part", cache_dir, "max_steps=4", "advanced.resume=true", *steps)
    train(resumed)
    got = comparable(read_metrics(os.path.join(resumed.output_dir, "metrics.jsonl")))
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    # step 3 scored against the restored step-1 reference (a lost one would have been reset: age 0)
    assert [r["ref_age"] for r in got[1:]] == [0.0, 1.0, 2.0, 0.0]
    assert got == expected
