"""Every ```python block of README.md and docs/*.md runs as it stands, on the CPU.

A block is only compiled (``compile(src, name, "exec")``), not run, when the line before it is
``<!-- not-run: REASON -->`` (it needs a GPU, a real model or the network) or its first line is
``# needs: gpu``; a block after ``<!-- tested: NAME -->`` is run, with the objects it assumes, by
tests/test_readme_integrations.py and is only compiled here. Every relative link of those pages
points to a file or folder of the repository."""

import glob
import importlib.util
import os
import re

import pytest
from trainer_helpers import repo_root

BLOCK = re.compile(r"```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_pages() -> list[str]:
    root = repo_root()
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def code_blocks():
    """(page-relative name, source, mode) for every python block; mode: "run", "compile" or "tested"."""
    root = repo_root()
    blocks = []
    for page in doc_pages():
        with open(page) as f:
            text = f.read()
        for match in BLOCK.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            source = match.group(1)
            line = text.count("\n", 0, match.start()) + 1
            name = f"{os.path.relpath(page, root)}:{line}"
            if before.startswith("<!-- tested:"):
                mode = "tested"
            elif before.startswith("<!-- not-run:") or source.lstrip().startswith("# needs: gpu"):
                mode = "compile"
            else:
                mode = "run"
            blocks.append(pytest.param(name, source, mode, id=name))
    return blocks


def test_pages_have_code_blocks():
    assert len(code_blocks()) >= 5


@pytest.mark.parametrize("name, source, mode", code_blocks())
def test_code_block(name, source, mode, tmp_path, monkeypatch):
    code = compile(source, name, "exec")
    if mode != "run":
        return
    if "pacs.integrations.trl" in source and importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (pip install .[trl])")
    monkeypatch.chdir(tmp_path)  # whatever a block writes (runs/...) goes to a temporary directory
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(code, {"__name__": "__docs__"})


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: os.path.relpath(p, repo_root()))
def test_relative_links_exist(page):
    with open(page) as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
        if not os.path.exists(path):
            missing.append(target)
    assert not missing, f"{os.path.relpath(page, repo_root())} links to missing files: {missing}"
