"""The step's loss statistics from its micro-batches' (pacs/train/loss_statistics.py): each mean weighs what it is
a mean over, extremes combine as such, the psi standard deviation is pooled; on several ranks, the sums are added
first. Checked against the statistics of the whole batch computed at once."""

import math

import pytest
import torch

from pacs.train.loss_statistics import LossStatistics
from pacs_kernels import grpo_loss, pacs_loss

G = 4


def batch(seed: int, groups: int = 6, width: int = 12):
    """Groups of G responses of very different lengths, mixed 0/1 rewards (one single-label group), log-probs
    away from the old ones (psi, ratios and clipping not trivial)."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * G
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    old = -torch.rand(n, width, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    rewards[:G] = 1.0
    return logp, old, rewards, mask


def combined(loss_fn, logp, old, rewards, mask, cuts, **options):
    statistics = LossStatistics()
    for lo, hi in zip(cuts, cuts[1:]):
        _, stats = loss_fn(logp[lo:hi], old[lo:hi], rewards[lo:hi], mask[lo:hi], group_size=G, return_stats=True,
                           **options)
        statistics.add(stats.as_dict(), hi - lo, int(mask[lo:hi].sum()))
    return statistics.means()


@pytest.mark.parametrize("loss_fn, options, keys", [
    (pacs_loss, {}, ["psi_mean", "psi_std", "sigmoid_psi_mean", "reward_mean", "score_mean", "weight_mean",
                     "weight_min", "weight_max", "frac_single_label_groups", "sigmoid_psi_correct_mean",
                     "sigmoid_psi_incorrect_mean", "valid_frac"]),
    (grpo_loss, {"clip_eps": 0.1}, ["clip_frac", "ratio_mean", "advantage_abs_mean", "kl_mean"]),
])
def test_micro_batches_combine_into_the_whole_batch_statistics(loss_fn, options, keys):
    logp, old, rewards, mask = batch(0)
    _, whole = loss_fn(logp, old, rewards, mask, group_size=G, return_stats=True, **options)
    whole = whole.as_dict()
    cuts = [0, G, 4 * G, 5 * G, 6 * G]  # micro-batches of 1, 3, 1 and 1 groups
    parts = combined(loss_fn, logp, old, rewards, mask, cuts, **options)
    for key in keys:
        assert parts[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-12), key
    # a plain mean over the micro-batches is not the batch's statistic: the test can tell
    key = "psi_std" if loss_fn is pacs_loss else "clip_frac"
    plain = [loss_fn(logp[lo:hi], old[lo:hi], rewards[lo:hi], mask[lo:hi], group_size=G, return_stats=True,
                     **options)[1].as_dict()[key] for lo, hi in zip(cuts, cuts[1:])]
    assert sum(plain) / len(plain) != pytest.approx(whole[key], rel=1e-3)


def test_undefined_statistics_weigh_nothing_and_nothing_seen_is_nan():
    statistics = LossStatistics()
    statistics.add({"sigmoid_psi_correct_mean": math.nan, "reward_mean": 0.0, "weight_min": math.nan}, 4, 10)
    assert math.isnan(statistics.means()["sigmoid_psi_correct_mean"]) and math.isnan(statistics.means()["weight_min"])
    statistics.add({"sigmoid_psi_correct_mean": 0.7, "reward_mean": 0.5, "weight_min": 2.0}, 4, 10)
    assert statistics.means() == {"sigmoid_psi_correct_mean": 0.7, "reward_mean": 0.25, "weight_min": 2.0}
    assert LossStatistics().means() == {}
