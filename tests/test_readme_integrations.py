"""The integration code blocks of README.md and docs/*.md, run as they stand.

Each block follows a ``<!-- tested: NAME -->`` line in README.md or a page of docs/; the test supplies
what the block assumes exists (a tiny model, a batch) and checks what it produced. Every other code
block runs in tests/test_docs_code_blocks.py."""

import glob
import importlib.util
import os
import re

import pytest
import torch
from trainer_helpers import repo_root

from pacs_kernels import pacs_loss


def readme_block(name: str) -> str:
    pages = [os.path.join(repo_root(), "README.md")] + sorted(glob.glob(os.path.join(repo_root(), "docs", "*.md")))
    found = []
    for page in pages:
        with open(page) as f:
            found += re.findall(rf"<!-- tested: {name} -->\n```python\n(.*?)```", f.read(), re.S)
    assert len(found) == 1, f"expected one block marked <!-- tested: {name} --> in README.md and docs/: {len(found)}"
    return found[0]


@pytest.mark.slow
def test_trl_snippet(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace = {}
    exec(readme_block("trl"), namespace)  # self-contained: builds its own tiny model, tokenizer and data
    trainer = namespace["trainer"]
    assert type(trainer).__name__ == "PACSTrainer" and trainer.state.global_step == 2
    assert os.path.isdir(tmp_path / "runs" / "trl-pacs")
    rows = [row for row in trainer.state.log_history if "pacs/psi_std" in row]
    assert rows and all("entropy" in row for row in rows)


# verl 0.9 imports ray, tensordict, hydra/omegaconf, codetiming and torchdata at package import
VERL_MODULES = ("verl", "ray", "tensordict", "omegaconf", "hydra", "codetiming", "torchdata")


@pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in VERL_MODULES),
                    reason="verl is not installed: PACS_WITH_VERL=1 bash scripts/setup_env.sh installs it")
def test_verl_snippet():
    """The overrides, applied to verl's own ppo_trainer config with the paper-like batch settings of
    the example config, give a config whose actor section passes the plugin's group checks."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from pacs.integrations.verl import check_actor_config

    namespace = {}
    exec(readme_block("verl"), namespace)
    batch_settings = ["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=8"]
    with initialize_config_dir(config_dir=os.path.join(repo_root(), "configs"), version_base=None):
        cfg = compose(config_name="verl_pacs_qwen2.5_7b", overrides=namespace["overrides"] + batch_settings)
    assert cfg.actor_rollout_ref.model.external_lib == "pacs.integrations.verl"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert check_actor_config(actor) == 8 and actor.policy_loss.loss_mode == "pacs"
    assert cfg.algorithm.adv_estimator == "pacs_label" and cfg.trainer.balance_batch is False


def test_plain_loop_snippet():
    """The plain-loop block: its loss equals pacs_loss on naive float32 log-probs (with validity), and
    the optimizer step it takes moves the weights."""
    # the block runs as pasted: its stand-in model and batch, then the step (here with a padded response and one
    # without a verdict put in between)
    setup, step = readme_block("plain").split("# the PACS step\n")
    namespace = {}
    exec(setup, namespace)
    G, P = 4, 5
    model, completion_ids = namespace["model"], namespace["completion_ids"]
    completion_mask = namespace["completion_mask"]
    completion_mask[1, -2:] = 0
    attention_mask = torch.cat([torch.ones(2 * G, P, dtype=torch.long), completion_mask], 1)
    namespace["attention_mask"] = attention_mask
    namespace["valid"] = valid = torch.tensor([True] * 7 + [False])
    input_ids = torch.cat([namespace["prompt_ids"], completion_ids], 1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, P - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids[..., None])[..., 0]
        expected = pacs_loss(logp, logp, namespace["rewards"], completion_mask, group_size=G, valid=valid)
    before = [p.detach().clone() for p in model.parameters()]
    exec(step, namespace)
    out = namespace["out"]
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert out.stats["valid_frac"] == pytest.approx(7 / 8) and out.stats["entropy_mean"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
