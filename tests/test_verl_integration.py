"""The verl plugin (pacs.integrations.verl): its functions against the float64 reference PACS loss
(always), and, when verl imports, registered through verl's own hook and called through verl's
registries, ActorConfig and compute_advantage."""

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from trainer_helpers import repo_root

from pacs.integrations.verl import (
    check_whole_groups,
    compute_policy_loss_pacs,
    pacs_label_advantage,
)
from pacs_kernels.reference import reference_pacs_loss

G = 4


def batch(n_groups=3, length=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B = n_groups * G
    logp = (-3 * torch.rand(B, length, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, length, generator=gen) > 0.25
    mask[:, 0] = True
    labels = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 1][:B], dtype=torch.float64)
    token_rewards = torch.zeros(B, length, dtype=torch.float64)
    last = mask.cumsum(-1).argmax(-1)  # verl puts the outcome reward on the last response token
    token_rewards[torch.arange(B), last] = labels
    return logp, old, mask, labels, token_rewards


def actor_config(**overrides):
    settings = dict(rollout_n=G, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=2 * G, shuffle=False,
                    global_batch_info={})
    settings.update(overrides)
    return SimpleNamespace(**settings)


def test_label_advantage_and_loss_equal_the_reference():
    logp, old, mask, labels, token_rewards = batch()
    advantages, returns = pacs_label_advantage(token_rewards, mask, index=np.repeat(np.arange(3), G))
    assert torch.equal(advantages, labels[:, None] * mask) and torch.equal(returns, advantages)
    loss, metrics = compute_policy_loss_pacs(old, logp, advantages, mask, config=actor_config())
    ref, _ = reference_pacs_loss(logp, old, labels, mask, group_size=G)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    grad, = torch.autograd.grad(loss, logp)
    ref_grad, = torch.autograd.grad(ref, logp)
    assert ref_grad.abs().max() > 0
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert {"actor/pacs/psi_std", "actor/pacs/sigmoid_psi_mean", "actor/pacs/weight_mean"} <= metrics.keys()


def test_global_normalisation_and_options(monkeypatch):
    """With verl's global batch info: sum over the micro-batch / global mini-batch * dp size."""
    logp, old, mask, labels, token_rewards = batch(seed=1)
    advantages, _ = pacs_label_advantage(token_rewards, mask)
    monkeypatch.setenv("PACS_OPTIONS", '{"beta": 0.5, "advantage": "grpo"}')
    config = actor_config(global_batch_info={"global_batch_size": 48, "dp_size": 2})
    loss, _ = compute_policy_loss_pacs(old, logp, advantages, mask, config=config)
    ref, _ = reference_pacs_loss(logp, old, labels, mask, group_size=G, beta=0.5, advantage="grpo")
    torch.testing.assert_close(loss, ref * 12 / 48 * 2, rtol=1e-10, atol=1e-12)
    monkeypatch.setenv("PACS_OPTIONS", '{"temperature": 1}')
    with pytest.raises(ValueError, match="unknown option"):
        compute_policy_loss_pacs(old, logp, advantages, mask, config=config)


@pytest.mark.parametrize("name, options", [
    ("grpo", {}), ("dapo", {"eps_high": 0.3}), ("dr_grpo", {"max_completion_length": 7}), ("gspo", {}),
    ("cispo", {}), ("objective_plugin:LeaveOneOutPG", {"eps": 0.1}),
])
def test_any_objective_by_name(monkeypatch, name, options):
    """PACS_OBJECTIVE picks the objective the "pacs" policy loss runs (a built-in one by name, a user's as
    module:Class), PACS_OPTIONS its class's keywords; the loss is the objective's on the 0/1 rewards the advantages
    carry, normalised over the global mini-batch as PACS's."""
    import json

    from pacs.train.loss_objective import named_objective, token_mean

    logp, old, mask, labels, token_rewards = batch(seed=2)
    advantages, _ = pacs_label_advantage(token_rewards, mask)
    monkeypatch.setenv("PACS_OBJECTIVE", name)
    monkeypatch.setenv("PACS_OPTIONS", json.dumps(options))
    config = actor_config(global_batch_info={"global_batch_size": 24, "batch_num_tokens": 200, "dp_size": 2})
    loss, metrics = compute_policy_loss_pacs(old, logp, advantages, mask, config=config)
    objective = named_objective(name, options)
    expected, stats = objective(logp, old, labels, mask, group_size=G)
    # a token mean over the global mini-batch's tokens (verl's token-mean), else a mean over its responses
    share = float(mask.sum()) / 200 if token_mean(objective) else 12 / 24
    assert token_mean(objective) == (name in ("grpo", "dapo", "cispo", "objective_plugin:LeaveOneOutPG"))
    torch.testing.assert_close(loss, expected * share * 2, rtol=1e-12, atol=1e-14)
    grad, = torch.autograd.grad(loss, logp)
    assert grad.abs().max() > 0
    assert metrics and all(key.startswith("actor/pacs/") for key in metrics)
    assert "actor/pacs/entropy_mean" not in metrics and "actor/pacs/kl_mean" not in metrics


def test_an_unknown_objective_or_setting_is_refused(monkeypatch):
    logp, old, mask, _, token_rewards = batch()
    advantages, _ = pacs_label_advantage(token_rewards, mask)
    for name, options, match in (("ppo", "{}", "PACS_OBJECTIVE must be one of"),
                                 ("dapo", '{"beta": 1}', "PACS_OBJECTIVE='dapo'.*beta"),
                                 ("no_such_module:X", "{}", "cannot import module 'no_such_module'")):
        monkeypatch.setenv("PACS_OBJECTIVE", name)
        monkeypatch.setenv("PACS_OPTIONS", options)
        with pytest.raises(ValueError, match=match):
            compute_policy_loss_pacs(old, logp, advantages, mask, config=actor_config())


@pytest.mark.parametrize("overrides, match", [
    (dict(use_dynamic_bsz=True), "use_dynamic_bsz"),
    (dict(ppo_micro_batch_size_per_gpu=6), "multiple of rollout.n"),
    (dict(shuffle=True), "shuffle"),
])
def test_group_splitting_settings_refused(overrides, match):
    logp, old, mask, _, token_rewards = batch()
    advantages, _ = pacs_label_advantage(token_rewards, mask)
    with pytest.raises(ValueError, match=match):
        compute_policy_loss_pacs(old, logp, advantages, mask, config=actor_config(**overrides))


def test_bad_inputs_refused():
    logp, old, mask, _, token_rewards = batch()
    with pytest.raises(ValueError, match="0/1 rewards"):
        pacs_label_advantage(token_rewards * 0.5, mask)
    with pytest.raises(ValueError, match="balance_batch"):
        check_whole_groups(["a", "a", "b", "b", "a", "a"])
    with pytest.raises(ValueError, match="equal size"):
        check_whole_groups(["a", "a", "b"])
    assert check_whole_groups(["x"] * 4 + ["y"] * 4) == 4
    advantages, _ = pacs_label_advantage(token_rewards, mask)
    with pytest.raises(ValueError, match="pacs_label"):
        compute_policy_loss_pacs(old, logp, advantages * 0.5, mask, config=actor_config())
    with pytest.raises(ValueError, match="use_v1=False"):  # the v1 trainer reorders whatever balance_batch says
        check_whole_groups(["a", "b", "a", "b"])
    # rejection sampling zeroes a whole response's mask: its label (1 here) would read as 0
    rejected = mask.clone()
    rejected[0] = False
    for call in (lambda: pacs_label_advantage(token_rewards, rejected),
                 lambda: compute_policy_loss_pacs(old, logp, advantages * rejected, rejected, config=actor_config())):
        with pytest.raises(ValueError, match=r"responses \[0\] have an all-zero response_mask.*rollout_rs=null"):
            call()


def test_rollout_is_weights_weigh_the_loss():
    """verl's rollout_is_weights (truncated IS, token or sequence level) are the loss's per-token weights: PACS on
    old + w (logp - old) (the float64 reference on those log-probs), and another objective's token_weights=."""
    from pacs_kernels import GRPO

    logp, old, mask, labels, token_rewards = batch(seed=4)
    advantages, _ = pacs_label_advantage(token_rewards, mask)
    weights = torch.exp((old - old.mean()).clamp(max=0.5)).clamp(max=2.0) * mask  # some above 1, some below
    loss, _ = compute_policy_loss_pacs(old, logp, advantages, mask, config=actor_config(), rollout_is_weights=weights)
    expected, _ = reference_pacs_loss(old + weights * (logp - old), old, labels, mask, group_size=G)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    plain, _ = compute_policy_loss_pacs(old, logp, advantages, mask, config=actor_config())
    (plain_grad,) = torch.autograd.grad(plain, logp)
    assert not torch.allclose(grad, plain_grad)
    os.environ["PACS_OBJECTIVE"] = "grpo"
    try:
        loss, _ = compute_policy_loss_pacs(old, logp, advantages, mask, config=actor_config(),
                                           rollout_is_weights=weights)
    finally:
        del os.environ["PACS_OBJECTIVE"]
    expected, _ = GRPO()(logp, old, labels, mask, group_size=G, token_weights=weights)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("settings, expected", [
    (None, None),
    (dict(rollout_is=None, rollout_rs=None), None),
    (dict(rollout_is="token", rollout_is_threshold=2.0), dict(mode="token_truncate", c_min=0.0, c_max=2.0)),
    (dict(rollout_is="sequence", rollout_is_threshold=5.0), dict(mode="sequence_truncate", c_min=0.0, c_max=5.0)),
    (dict(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
     dict(mode="token_mask", c_min=0.5, c_max=2.0)),
    (dict(rollout_is=None, rollout_rs="seq_sum_k1", rollout_rs_threshold=4.0),
     dict(mode="sequence_mask", c_min=0.25, c_max=4.0)),
    (dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
     dict(mode="sequence_mask", c_min=0.999, c_max=1.001, sequence_ratio="geometric")),
])
def test_verl_rollout_correction_maps_onto_ours(settings, expected):
    """verl's algorithm.rollout_correction names (rollout_is, rollout_is_threshold, rollout_rs,
    rollout_rs_threshold) as pacs train's advanced.rollout_correction settings; each valid for our config."""
    from pacs.config import load_config, validate
    from pacs.integrations.verl import rollout_correction_settings

    got = rollout_correction_settings(None if settings is None else SimpleNamespace(**settings))
    if expected is None:
        assert got is None
        return
    assert got == {"sequence_ratio": "product", **expected}
    validate(load_config(None, [f"advanced.rollout_correction.{k}={v}" for k, v in got.items()]))


@pytest.mark.parametrize("settings, match", [
    (dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold=1.01), "both"),
    (dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01), "no equivalent"),
    (dict(rollout_is="sequence", rollout_is_batch_normalize=True), "batch_normalize"),
    (dict(rollout_is="group"), "rollout_is must be"),
])
def test_verl_rollout_correction_without_an_equivalent_is_named(settings, match):
    from pacs.integrations.verl import rollout_correction_settings

    with pytest.raises(ValueError, match=match):
        rollout_correction_settings(SimpleNamespace(**settings))


@pytest.mark.parametrize("as_mapping", [False, True])
def test_bypass_mode_refused(as_mapping):
    """algorithm.rollout_correction.bypass_mode=True: verl skips the actor's recompute of the old log-probs and
    hands the loss the rollout engine's sampling log-probs as old_log_probs, so psi would not start at 0; nothing
    in the batch shows it (no IS weights, no zeroed masks) and the ActorConfig does not carry it, so the advantage
    estimator refuses it from the AlgoConfig verl's compute_advantage passes (attributes or a DictConfig-like
    mapping)."""
    _, _, mask, _, token_rewards = batch()

    def algorithm(bypass_mode):
        correction = dict(rollout_is=None, rollout_rs=None, bypass_mode=bypass_mode, loss_type="ppo_clip")
        if as_mapping:
            return {"adv_estimator": "pacs_label", "rollout_correction": correction}
        return SimpleNamespace(adv_estimator="pacs_label", rollout_correction=SimpleNamespace(**correction))

    index = np.repeat(np.arange(3), G)
    with pytest.raises(ValueError, match=r"algorithm\.rollout_correction\.bypass_mode=True.*bypass_mode=false"):
        pacs_label_advantage(token_rewards, mask, index=index, config=algorithm(True))
    for config in (algorithm(False), None, SimpleNamespace(rollout_correction=None), {"rollout_correction": None}):
        advantages, _ = pacs_label_advantage(token_rewards, mask, index=index, config=config)
        assert advantages.shape == mask.shape


# verl 0.9 imports ray, tensordict, hydra/omegaconf, codetiming and torchdata at package import
VERL_MODULES = ("verl", "ray", "tensordict", "omegaconf", "hydra", "codetiming", "torchdata")
verl_missing = any(importlib.util.find_spec(name) is None for name in VERL_MODULES)


@pytest.mark.skipif(verl_missing, reason="verl (with ray, tensordict, ...) is not installed: "
                    "PACS_WITH_VERL=1 bash scripts/setup_env.sh installs it")
def test_through_verl_hook_and_registries():
    """A fresh process with VERL_USE_EXTERNAL_MODULES=pacs.integrations.verl: verl imports the plugin;
    verl's registries return "pacs_label" (called with the arguments verl's compute_advantage passes,
    uids from a DataProto; verl's AlgoConfig with bypass mode refused) and "pacs" (called with a real
    ActorConfig); the loss equals the reference."""
    code = r"""
import numpy as np, torch, verl
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig
from pacs_kernels.reference import reference_pacs_loss
import sys; sys.path.insert(0, "tests")
from test_verl_integration import batch, G
logp, old, mask, labels, token_rewards = batch(seed=2)
data = DataProto.from_dict(tensors={"token_level_rewards": token_rewards, "response_mask": mask},
                           non_tensors={"uid": np.repeat(np.array(["p0", "p1", "p2"], dtype=object), G)})
estimator = core_algos.get_adv_estimator_fn("pacs_label")
advantages, _ = estimator(token_level_rewards=data.batch["token_level_rewards"],
                          response_mask=data.batch["response_mask"], config=None, index=data.non_tensor_batch["uid"])
config = ActorConfig(strategy="fsdp", rollout_n=G, ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=2 * G)
loss_fn = core_algos.get_policy_loss_fn("pacs")
loss, metrics = loss_fn(old_log_prob=old, log_prob=logp, advantages=advantages, response_mask=mask,
                        loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=None)
ref, _ = reference_pacs_loss(logp, old, labels, mask, group_size=G)
torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
try:
    estimator(token_level_rewards=token_rewards, response_mask=mask, config=None,
              index=np.array(["p0", "p1"] * 6, dtype=object))
    raise SystemExit("split groups were not refused")
except ValueError as error:
    assert "balance_batch" in str(error)
# bypass mode, in the AlgoConfig verl's compute_advantage passes: the dataclass and the trainer's DictConfig
from dataclasses import asdict
from omegaconf import OmegaConf
from verl.trainer.config import AlgoConfig, RolloutCorrectionConfig
bypass = AlgoConfig(adv_estimator="pacs_label", rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip())
for algorithm in (bypass, OmegaConf.create({"rollout_correction": asdict(bypass.rollout_correction)})):
    try:
        estimator(token_level_rewards=token_rewards, response_mask=mask, config=algorithm,
                  index=data.non_tensor_batch["uid"])
        raise SystemExit("bypass mode was not refused")
    except ValueError as error:
        assert "algorithm.rollout_correction.bypass_mode=True" in str(error)
decoupled = AlgoConfig(adv_estimator="pacs_label", rollout_correction=RolloutCorrectionConfig())
estimator(token_level_rewards=token_rewards, response_mask=mask, config=decoupled, index=data.non_tensor_batch["uid"])
print("VERL_OK", verl.__version__)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo_root(), os.environ.get("PYTHONPATH", "")]),
           "VERL_USE_EXTERNAL_MODULES": "pacs.integrations.verl"}
    done = subprocess.run([sys.executable, "-c", code], cwd=repo_root(), env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "VERL_OK" in done.stdout, (done.stdout[-2000:], done.stderr[-4000:])


@pytest.mark.skipif(verl_missing, reason="verl (with ray, tensordict, ...) is not installed: "
                    "PACS_WITH_VERL=1 bash scripts/setup_env.sh installs it")
def test_example_config_composes_with_verl_and_passes_the_group_checks():
    """configs/verl_pacs_qwen2.5_7b.yaml on top of verl's own ppo_trainer config (hydra), its actor
    section turned into verl's ActorConfig: the paper's settings, and check_actor_config accepts it."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from pacs.integrations.verl import check_actor_config

    with initialize_config_dir(config_dir=os.path.join(repo_root(), "configs"), version_base=None):
        cfg = compose(config_name="verl_pacs_qwen2.5_7b")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert check_actor_config(actor) == 8
    assert (cfg.algorithm.adv_estimator, actor.policy_loss.loss_mode) == ("pacs_label", "pacs")
    assert cfg.actor_rollout_ref.model.external_lib == "pacs.integrations.verl"
    assert cfg.trainer.balance_batch is False and actor.optim.lr == 1e-6
    assert cfg.data.max_response_length == 4096 and cfg.actor_rollout_ref.model.use_remove_padding
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing
