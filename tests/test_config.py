"""Config tree: YAML files, overrides, and the errors for configs that cannot work."""

import os

import pytest

from pacs.cli import build_config, main
from pacs.config import Config, apply_override, config_keys, load_config, save_config, user_key, validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_validate_and_yaml_roundtrip(tmp_path):
    cfg = Config()
    validate(cfg)
    path = tmp_path / "c.yaml"
    save_config(cfg, str(path))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("name", ["default.yaml", "grpo.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(os.path.join(REPO, "configs", name))
    validate(cfg)
    if name == "default.yaml":
        assert cfg == load_config(None), "configs/default.yaml must reproduce the built-in run's defaults"
        # and show every key (the docs send readers to it for the defaults)
        import yaml

        def keys(tree, prefix=""):
            for key, value in tree.items():
                yield from keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]

        with open(os.path.join(REPO, "configs", name)) as f:
            listed = set(keys(yaml.safe_load(f)))
        assert listed == {user_key(key) for key, _ in config_keys()}, "configs/default.yaml must list every config key"
    else:
        assert cfg.optim.algo == "grpo"


def test_overrides_coerce_types():
    cfg = load_config(None, ["optim.lr=2e-4", "rollout.group_size=4", "model.gradient_checkpointing=true",
                             "eval.ks=[1,4]", "max_minutes=none", "task.data_path=x.jsonl"])
    assert cfg.optim.lr == 2e-4 and cfg.rollout.group_size == 4
    assert cfg.model.gradient_checkpointing is True and cfg.eval.ks == (1, 4)
    assert cfg.max_minutes is None and cfg.task.data_path == "x.jsonl"


@pytest.mark.parametrize("override, match", [
    ("optim.nope=1", "unknown config key 'optim.nope'"),
    ("rollout.group_size=abc", "rollout.group_size must be an integer"),
    ("model.gradient_checkpointing=3", "must be true or false"),
    ("seed", "key.path=value"),
])
def test_bad_overrides(override, match):
    with pytest.raises((ValueError, TypeError), match=match):
        apply_override(Config(), override)


@pytest.mark.parametrize("data, match", [
    ({"optim": {"lrr": 1e-4}}, "unknown config key 'optim.lrr'; did you mean optim.lr[?] known: "),
    ({"optm": {"lr": 1e-4}}, "unknown config key 'optm'; did you mean optim[?] known: "),
    ({"advanced": {"optim": {"weighing": "none"}}},
     "unknown config key 'advanced.optim.weighing'; did you mean advanced.optim.weighting[?] known under "),
    ({"optim": {"group_size": 4}}, "unknown config key 'optim.group_size'; did you mean rollout.group_size[?] "),
    ({"zzz": 1}, "unknown config key 'zzz'; known: "),
    # a name far from any in its section gets no guess (not the section's nearest-looking key)
    ({"advanced": {"optim": {"nope": 1}}}, "unknown config key 'advanced.optim.nope'; known under advanced.optim: "),
])
def test_an_unknown_key_names_the_key_meant_in_the_library_too(tmp_path, data, match):
    """The suggestion comes from the config module, so the Python API (load_config) gets it, not only the CLI."""
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=match):
        load_config(str(path))


@pytest.mark.parametrize("overrides, match", [
    (["rollout.group_size=1"], "group_size must be >= 2"),
    (["advanced.optim.micro_batch_responses=12"], "splits groups"),
    (["optim.micro_batch_groups=3"], "micro_batch_groups .3. must divide"),
    (["optim.mini_batches_per_step=5"], "mini_batches_per_step .5. must divide"),
    (["optim.algo=ppo"], "optim.algo"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.temperature=0"], "temperature must be > 0"),
    (["eval.n_samples=4", "eval.temperature=0"], "greedy"),
    (["task.name=math"], "task.data_path"),
    (["advanced.task.hidden_size=100", "advanced.task.num_heads=3"], "divisible"),
    (["advanced.optim.logprob_backend=naive"], "one_sweep_first_step needs"),
    (["task.data_path=x.jsonl"], r"task.data_path is read by task.name=math only \(task.name is 'embedded'\)"),
    (["task.name=wordmath", "task.eval_path=x.jsonl"], "task.eval_path is read by task.name=math only"),
])
def test_configs_that_cannot_work(overrides, match):
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError, match=match):
        validate(cfg)


def test_prompts_must_split_over_ranks():
    with pytest.raises(ValueError, match="divisible by the number of processes"):
        validate(load_config(None, ["rollout.prompts_per_step=3", "optim.mini_batches_per_step=1",
                                    "optim.micro_batch_groups=1"]), world_size=2)


def test_named_flags_win_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 5\nmax_steps: 7\noptim: {algo: grpo}\n")
    import argparse

    args = argparse.Namespace(config=str(path), overrides=["optim.lr=0.5"], model="m", output_dir="o",
                              seed=9, rollout="hf", max_steps=2, algo="pacs", resume=True)
    cfg = build_config(args)
    assert (cfg.seed, cfg.max_steps, cfg.optim.algo, cfg.optim.lr) == (9, 2, "pacs", 0.5)
    assert (cfg.model.path, cfg.output_dir, cfg.rollout.engine, cfg.resume) == ("m", "o", "hf", True)


def test_cli_errors_before_work(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["train", "--output-dir", str(tmp_path / "o"), "rollout.group_size=1"]) == 2
    assert "group_size must be >= 2" in capsys.readouterr().err
    assert main(["train", "--model", str(tmp_path / "no_model"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    out = str(tmp_path / "o")
    assert main(["train", "--output-dir", out, "rollout.max_prompt_len=60", "rollout.max_new_tokens=10"]) == 2
    assert "exceeds the model's max_position_embeddings (64)" in capsys.readouterr().err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_bench_forwards_argv_to_the_benchmarks_package(monkeypatch, capsys):
    import benchmarks.run

    monkeypatch.setattr(benchmarks.run, "main", lambda argv: print("got", argv) or 0)
    assert main(["bench", "--quick", "--device", "cpu"]) == 0
    assert "got ['--quick', '--device', 'cpu']" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--n", "-5"], "--n values must be >= 1, got -5"),
    (["--d", "0", "--v", "16"], "--d must be >= 1, got 0"),
    (["--d", "16", "--v", "-1"], "--v must be >= 1, got -1"),
    (["--timeout", "0"], "--timeout must be > 0"),
])
def test_bench_nonsense_sizes_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_outside_a_source_checkout_says_so(monkeypatch, tmp_path, capsys):
    """The benchmarks are not installed with the package: pacs bench loads them from the checkout and
    says clearly when there is none."""
    import pacs.cli

    monkeypatch.setattr(pacs.cli, "benchmarks_dir", lambda: str(tmp_path / "benchmarks"))
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "pacs bench needs a source checkout (benchmarks/ not found next to the pacs package" in err


def test_bench_finds_the_checkouts_harness():
    import pacs.cli

    run = pacs.cli.load_benchmarks_run()
    assert os.path.realpath(os.path.dirname(run.__file__)) == os.path.realpath(pacs.cli.benchmarks_dir())
