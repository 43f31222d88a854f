"""PACS's score scale beta must be > 0 wherever it enters: pacs_loss, the PACS objective (what the fused loss
and PACSLoss take), the deprecated beta= keyword of both, PACSConfig and the verl plugin's options refuse 0 and
negative values with a ValueError naming the argument (issue #26)."""

import pytest
import torch

from pacs_kernels import PACS, LossOptions, PACSLoss, fused_linear_pacs_loss, pacs_loss

BAD = [0, 0.0, -1, -0.5, float("nan"), float("inf")]


def _group_inputs():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 3, generator=g)
    return logp, logp.clone(), torch.tensor([1, 0, 1, 0]), torch.ones(4, 3, dtype=torch.bool)


@pytest.mark.parametrize("beta", BAD)
def test_pacs_loss_refuses_beta_not_above_zero(beta):
    logp, old, rewards, mask = _group_inputs()
    with pytest.raises(ValueError, match=r"beta must be a finite number > 0"):
        pacs_loss(logp, old, rewards, mask, group_size=2, beta=beta)


@pytest.mark.parametrize("beta", BAD)
def test_the_pacs_objective_refuses_beta_not_above_zero(beta):
    with pytest.raises(ValueError, match=r"beta must be a finite number > 0"):
        PACS(beta=beta)


@pytest.mark.parametrize("beta", BAD)
def test_the_deprecated_beta_keyword_refuses_it_too(beta):
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, 3, 8, generator=g), torch.randn(11, 8, generator=g)
    targets, mask = torch.randint(0, 11, (4, 3), generator=g), torch.ones(4, 3, dtype=torch.bool)
    with pytest.warns(DeprecationWarning, match=r"fused_linear_pacs_loss\(beta=\.\.\.\) is deprecated"):
        with pytest.raises(ValueError, match=r"beta must be a finite number > 0"):
            fused_linear_pacs_loss(hidden, weight, targets, mask, torch.zeros(4, 3), torch.tensor([1, 0, 1, 0]),
                                   group_size=2, options=LossOptions(backend="torch"), beta=beta)
    with pytest.warns(DeprecationWarning, match=r"PACSLoss\(beta=\.\.\.\) is deprecated"):
        with pytest.raises(ValueError, match=r"beta must be a finite number > 0"):
            PACSLoss(group_size=2, beta=beta)


def test_a_positive_beta_still_works():
    logp, old, rewards, mask = _group_inputs()
    assert torch.isfinite(pacs_loss(logp, old, rewards, mask, group_size=2, beta=0.01))


@pytest.mark.parametrize("beta", [0.0, -1.0])
def test_pacs_config_refuses_beta_not_above_zero(tmp_path, beta):
    pytest.importorskip("trl")
    from pacs.integrations.trl import PACSConfig

    with pytest.raises(ValueError, match=r"pacs_beta must be a finite number > 0"):
        PACSConfig(output_dir=str(tmp_path), pacs_beta=beta, report_to="none", use_cpu=True)


@pytest.mark.parametrize("beta", ["0", "-1"])
def test_verl_options_refuse_beta_not_above_zero(monkeypatch, beta):
    from pacs.integrations.verl import pacs_options

    monkeypatch.setenv("PACS_OPTIONS", f'{{"beta": {beta}}}')
    with pytest.raises(ValueError, match=r"PACS_OPTIONS beta must be a finite number > 0"):
        pacs_options()
