"""The docs site: mkdocs.yml builds with ``--strict`` (a broken link between pages, a page left out of the
nav, a docstring parameter the signature lacks all fail it), the API reference holds every public name,
docs/config.md's key tables are what `python -m pacs.config.docs` writes, and every repository path a page names
in a code span exists."""

import glob
import os
import re
import subprocess
import sys

import pytest
from trainer_helpers import repo_root

import pacs_kernels

# paths that pages name before they exist, each with what writes it
NOT_YET_WRITTEN = {"pacs_kernels/gpu_dispatch.json": "benchmarks/gpu.sh, on a GPU"}
REPO_PATH = re.compile(r"(?:pacs|pacs_kernels|benchmarks|configs|tests|scripts|requirements|docs)/[\w./-]*")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=repo_root(),
        capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_site_builds_strict(site):
    assert (site / "index.html").is_file() and (site / "config" / "index.html").is_file()


def test_api_reference_documents_every_public_name(site):
    page = (site / "reference" / "pacs_kernels" / "index.html").read_text()
    missing = [name for name in pacs_kernels.__all__ if f'id="pacs_kernels.{name}"' not in page]
    assert not missing, f"docs/reference/pacs_kernels.md renders no entry for {missing}"
    assert ":func:" not in page and ":class:" not in page  # scripts/mkdocs_sphinx_roles.py drops the roles
    for page, names in (("trl", ["PACSConfig", "PACSTrainer"]), ("trainer", ["train"])):
        text = (site / "reference" / page / "index.html").read_text()
        assert all(f'.{name}"' in text for name in names), (page, names)


def test_config_reference_is_generated():
    from pacs.config import docs

    with open(os.path.join(repo_root(), "docs", "config.md")) as f:
        committed = f.read()
    assert committed == docs.with_tables(committed), (
        f"docs/config.md's key tables differ from the fields of pacs/config/: run `{docs.REGENERATE}` and commit it")


def test_config_reference_has_a_row_per_key_with_its_default():
    from pacs.config import ADVANCED_KEYS, config_keys, user_key
    from pacs.config.docs import key_tables

    page = key_tables()
    rows = dict(re.findall(r"^\| `([\w.]+)` \| `[^`]+` \| `([^`]*)`", page, re.M))
    keys = [key for key, _ in config_keys()]  # the user's keys first, then the advanced ones
    assert list(rows) == [user_key(key) for key in keys if key not in ADVANCED_KEYS] + [
        user_key(key) for key in keys if key in ADVANCED_KEYS]
    assert rows["optim.lr"] == "1e-06" and rows["rollout.max_prompt_len"] == "null"
    assert rows["advanced.optim.betas"] == "[0.9, 0.999]" and rows["train.packing"] == "null"


@pytest.mark.parametrize("page", sorted(glob.glob(os.path.join(repo_root(), "docs", "**", "*.md"), recursive=True)),
                         ids=lambda p: os.path.relpath(p, repo_root()))
def test_repository_paths_in_code_spans_exist(page):
    """Pages name source and results files as code spans (the site serves docs/ only); each must exist."""
    with open(page) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    missing = []
    for match in re.finditer(r"`([^`\n]+)`(\]\(https?:)?", text):
        span, external = match.group(1), match.group(2)
        if external or not REPO_PATH.fullmatch(span) or span in NOT_YET_WRITTEN:
            continue
        if (re.search(r"\w\.\w+$", span) or span.endswith("/")) and not os.path.exists(
                os.path.join(repo_root(), span)):
            missing.append(span)
    assert not missing, f"{os.path.relpath(page, repo_root())} names missing files: {missing}"
