"""Config a user can hold in their head (issue #30 item 4): at most 45 keys a user sets; the rest written under
``advanced:`` in YAML files and overrides, refused at their old spots with the spelling to use; a run's saved
config loads back equal, and a run directory saved before the ``advanced:`` section resumes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from pacs.cli import main
from pacs.config import ADVANCED_KEYS, Config, apply_override, config_keys, load_config, save_config, to_dict, user_key
from pacs.run.resume_check import HISTORY_NAME, plan_resume, resume_command, settings_in_effect
from pacs.tasks.embedded import build_model, build_tokenizer

TINY_RUN = ["advanced.task.digits=1", "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=3", "optim.mini_batches_per_step=1", "optim.micro_batch_groups=1",
            "eval.num_problems=4", "eval.every=0", "checkpoint_every=1", "advanced.plot=false",
            "advanced.torch_threads=1"]


def test_at_most_45_keys_for_users_and_every_advanced_key_is_a_key():
    keys = [key for key, _ in config_keys()]
    user = [key for key in keys if key not in ADVANCED_KEYS]
    assert len(user) <= 45, f"{len(user)} user keys: {user}"
    assert len(set(ADVANCED_KEYS)) == len(ADVANCED_KEYS)
    assert set(ADVANCED_KEYS) <= set(keys), set(ADVANCED_KEYS) - set(keys)
    assert len(user) + len(ADVANCED_KEYS) == len(keys)


@pytest.mark.parametrize("key, value", [("train.preflight", "false"), ("optim.ref_reset_every", "2"),
                                        ("plot", "false"), ("task.cache_dir", "/tmp/c")])
def test_an_advanced_key_at_its_old_spot_is_refused_with_the_new_spelling(tmp_path, key, value):
    message = f"{key} is an advanced key now: write advanced.{key}"
    with pytest.raises(ValueError) as refused:
        apply_override(Config(), f"{key}={value}")
    assert str(refused.value) == message
    *sections, name = key.split(".")
    tree: dict = {name: yaml.safe_load(value)}
    for section in reversed(sections):
        tree = {section: tree}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ValueError) as refused:
        load_config(str(path))
    assert str(refused.value) == message


def test_the_cli_refuses_an_old_spot_in_one_line(tmp_path, capsys):
    assert main(["train", "--output-dir", str(tmp_path / "o"), "train.preflight=false"]) == 2
    err = capsys.readouterr().err
    assert "train.preflight is an advanced key now: write advanced.train.preflight" in err


def test_advanced_spelling_in_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 0.5}\nadvanced:\n  plot: false\n  train: {preflight: false}\n"
                    "  optim: {ref_reset_every: 3}\n")
    cfg = load_config(str(path), ["advanced.optim.weighting=none", "advanced.train.preflight=true"])
    assert (cfg.optim.lr, cfg.plot, cfg.optim.ref_reset_every, cfg.optim.weighting) == (0.5, False, 3, "none")
    assert cfg.train.preflight is True  # the override wins over the file
    with pytest.raises(ValueError, match="^advanced.optim.lr is not an advanced key: write optim.lr$"):
        load_config(None, ["advanced.optim.lr=0.1"])
    with pytest.raises(ValueError, match="unknown config key 'advanced.optim.nope'; known under advanced.optim: w"):
        load_config(None, ["advanced.optim.nope=1"])


def test_a_saved_config_loads_back_equal_with_the_advanced_keys_under_advanced(tmp_path):
    cfg = load_config(None, ["optim.lr=0.001", "advanced.optim.ref_reset_every=4", "advanced.train.preflight=false",
                             "advanced.eval.top_p=0.9", "advanced.plot=false", "eval.ks=[1]"])
    path = tmp_path / "config.yaml"
    save_config(cfg, str(path))
    saved = yaml.safe_load(path.read_text())
    assert saved["advanced"]["optim"]["ref_reset_every"] == 4 and "preflight" not in saved["train"]
    assert "plot" not in saved and saved["advanced"]["plot"] is False
    assert load_config(str(path)) == cfg


def _model(path) -> str:
    build_model(Config().task, len(build_tokenizer()), seed=3).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_a_run_directory_saved_before_the_advanced_section_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    model = _model(tmp_path / "model")
    args = ["train", "--model", model, "--output-dir", str(out), "--max-steps", "2", *TINY_RUN,
            "advanced.optim.weighting=none"]
    assert main(args) == 0
    capsys.readouterr()
    # the layout the run would have saved before the advanced section: every key at its declared spot
    cfg = load_config(str(out / "config.yaml"))
    with open(out / "config.yaml", "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
    assert settings_in_effect(str(out)) == cfg and cfg.optim.weighting == "none" and cfg.task.digits == 1
    assert plan_resume(dataclasses.replace(cfg, max_steps=3), str(out)).accepted == {"max_steps": [2, 3]}
    # another value of an advanced setting that changes what the run is: refused, spelled as a user writes it
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "advanced.optim.weighting=balanced"]) == 2
    assert "advanced.optim.weighting \"none\" -> \"balanced\"" in capsys.readouterr().err
    # the command the old run printed continues it; a named change is recorded in the new layout
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "--max-steps", "3",
                 "--change", "advanced.optim.weighting=balanced"]) == 0
    assert "changed (--change): advanced.optim.weighting \"none\" -> \"balanced\"" in capsys.readouterr().out
    history = [json.loads(line) for line in (out / HISTORY_NAME).read_text().splitlines()]
    assert history[0]["config"]["advanced"]["optim"]["weighting"] == "balanced"
    assert history[0]["changed"] == {"advanced.optim.weighting": ["none", "balanced"]}
    command = resume_command(str(out))
    assert command == (f"pacs train --config {out}/config.yaml --resume --change advanced.optim.weighting=balanced "
                       "max_steps=3")
    assert main(command.split()[1:]) == 0
    assert "[resume] from step" not in capsys.readouterr().out  # nothing differs from the settings in effect


def test_resume_compares_settings_by_the_key_a_user_writes():
    assert user_key("train.preflight") == "advanced.train.preflight" and user_key("optim.lr") == "optim.lr"
