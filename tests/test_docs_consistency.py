"""The docs say what the code does: each test here pins one statement of README.md or docs/ to the
code it describes, so that the two cannot drift apart unnoticed."""

import dataclasses
import importlib.util
import inspect
import os
import re

import pytest
import torch
from trainer_helpers import repo_root

import pacs_kernels
from pacs_kernels import fused_linear_pacs_loss, pacs_loss
from pacs_kernels.loss_inputs import ADVANTAGES, SCORES, WEIGHTINGS


def read(*path: str) -> str:
    with open(os.path.join(repo_root(), *path)) as f:
        return f.read()


def table_rows(text: str, after: str) -> list[list[str]]:
    """The cells of the first Markdown table after the line holding ``after``."""
    lines = text[text.index(after):].split("\n")
    rows, started = [], False
    for line in lines if lines[0].startswith("|") else lines[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not re.fullmatch(r"[-: ]+", "".join(cells)):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # without the header


# ---- README: size, first screen, no history ---------------------------------------------------

def test_readme_is_short_and_starts_with_the_two_commands():
    text = read("README.md")
    assert len(text.encode()) <= 15_000, f"README.md is {len(text.encode())} bytes; keep it at most 15 KB"
    first_block = re.search(r"```(\w*)\n(.*?)```", text, re.S)
    assert first_block.group(1) == "bash"
    assert [line.split("#")[0].strip() for line in first_block.group(2).strip().split("\n")] == [
        "bash scripts/train.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in read(".ci", "run")


def docs_pages() -> list[str]:
    """Every Markdown page of docs/ (the site's pages, the generated API reference included)."""
    root = os.path.join(repo_root(), "docs")
    return sorted(os.path.relpath(os.path.join(folder, name), repo_root())
                  for folder, _, names in os.walk(root) for name in names if name.endswith(".md"))


def dates_hashes_and_processor_names(text: str) -> list[str]:
    """What a page must not hold beside a measurement: the results file it cites carries device and date."""
    found = re.findall(r"\b20\d\d-\d\d-\d\d\b", text) + re.findall(r"\b\d\d:\d\d UTC\b", text)
    found += [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    return found + re.findall(r"Xeon|EPYC|Intel|AMD\b", text)


def test_readme_has_no_dates_hashes_or_processor_names():
    text = read("README.md")
    found = dates_hashes_and_processor_names(text) + re.findall(r"H100|H200", text)
    assert not found, f"README.md holds {found}: dates, hashes and devices belong in benchmarks/results/"


@pytest.mark.parametrize("page", docs_pages())
def test_docs_pages_have_no_dates_hashes_or_processor_names(page):
    # GPU names may appear in docs/ (kernels.md's cost model is an H200's spec sheet), not in README.md
    found = dates_hashes_and_processor_names(read(page))
    assert not found, (f"{page} holds {found}: cite the benchmarks/results/ file that holds the number "
                       "(it carries the device and date)")


# ---- API: the table of public functions, signatures, old_logp=None ------------------------------

def test_readme_api_table_has_one_row_per_public_name():
    rows = table_rows(read("README.md"), "## API")
    documented = {name for row in rows for name in re.findall(r"`(\w+)", row[0])}  # a row may name several
    assert documented == set(pacs_kernels.__all__)


def _parameter_names(cell: str) -> set[str]:
    cell = re.sub(r'"[^"]*"', "", cell.strip("`"))
    return set(re.findall(r"(?:^\(|,)\s*\**(\w+)", cell)) - {"_"}


@pytest.mark.parametrize("name", ["linear_logprobs", "linear_logprobs_known_grad", "pacs_loss",
                                  "fused_linear_pacs_loss", "grpo_loss", "fused_linear_grpo_loss",
                                  "fused_linear_objective_loss"])
def test_api_page_signatures_match_the_code(name):
    rows = {re.match(r"`(\w+)`", row[0]).group(1): row[1] for row in table_rows(read("docs", "api.md"), "| function")
            if re.match(r"`(\w+)`$", row[0])}
    signature = rows[name].split("`")[1]
    actual = set(inspect.signature(getattr(pacs_kernels, name)).parameters)
    assert _parameter_names(signature) == actual, name


def test_design_notes_contract_names_every_option():
    contract = read("docs", "design.md")
    for option in ("return_lse", "logit_softcap", "valid", "cu_seqlens", "group_ids", "return_stats", "old_lse"):
        assert option in contract, option


def test_only_the_fused_losses_take_old_logp_none():
    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 3, 8), torch.randn(11, 8)
    targets, mask, rewards = torch.randint(0, 11, (4, 3)), torch.ones(4, 3), torch.tensor([1.0, 0, 0, 1])
    fused_linear_pacs_loss(hidden, weight, targets, mask, None, rewards, group_size=2)
    with pytest.raises((TypeError, ValueError, AttributeError)):
        pacs_loss(torch.randn(4, 3), None, rewards, mask, group_size=2)
    api = read("docs", "api.md")
    assert "`old_logp=None`" in api and "`pacs_loss` and `grpo_loss`" in api
    for name in ("fused_linear_pacs_loss", "fused_linear_grpo_loss"):
        assert inspect.signature(getattr(pacs_kernels, name)).parameters["old_logp"].annotation != "torch.Tensor"


def test_grpo_loss_layouts_as_documented():
    assert "cu_seqlens" not in inspect.signature(pacs_kernels.grpo_loss).parameters
    assert inspect.signature(pacs_kernels.fused_linear_grpo_loss).parameters["cu_seqlens"].kind \
        is inspect.Parameter.KEYWORD_ONLY
    for page in ("README.md", "docs/api.md", "docs/results.md", "docs/kernels.md"):
        text = read(page)
        text = text.replace("padded `(B, T)` only (no `cu_seqlens`)", "")
        assert not re.search(r"`grpo_loss`[^.|]{0,40}(packed|cu_seqlens)", text), page


# ---- algorithm page: option names are the API's -------------------------------------------------

def test_algorithm_page_names_the_api_options():
    text = read("docs", "pacs-algorithm.md")
    for name in WEIGHTINGS[2:] + SCORES + ADVANTAGES:
        assert name in text, name
    for stale in ("only_positive", "only_negative"):  # the public code's names, only as such
        assert all(text[m.start() - 8:m.start()] == 'code\'s "' for m in re.finditer(stale, text)), stale
    from pacs.config import Config

    assert Config().optim.ref_reset_every == 1
    assert "may offer" not in text and "ref_reset_every" in text


def test_option_lists_in_the_docs_are_the_api_choices():
    api_options = read("README.md") + read("docs", "api.md")
    for name in WEIGHTINGS + SCORES + ADVANTAGES:
        assert name in api_options, name


# ---- TRL: PACSConfig fields, the on-policy path --------------------------------------------------

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")


@needs_trl
def test_trl_page_lists_every_pacs_config_field_with_its_default():
    from pacs.integrations.trl import PACSConfig

    fields = {f.name: f.default for f in dataclasses.fields(PACSConfig) if f.name.startswith("pacs_")}
    rows = table_rows(read("docs", "trl.md"), "pacs-config-fields")
    documented = {row[0].strip("`"): row[1].strip("`") for row in rows}
    assert set(documented) == set(fields)
    for name, default in fields.items():
        assert documented[name] == repr(default).replace("'", '"'), name
    added = [row for row in table_rows(read("README.md"), "What differs from `GRPOTrainer`") if row[0] == "added"][0]
    assert set(re.findall(r"`(pacs_\w+)`", added[1])) == set(fields)
    defaults = {f.name: f.default for f in dataclasses.fields(PACSConfig)}
    assert defaults["loss_type"] == "pacs" and defaults["vllm_importance_sampling_correction"] is True
    for page in ("README.md", "docs/trl.md"):
        assert "`loss_type`" in read(page) and "`vllm_importance_sampling_correction`" in read(page)


@needs_trl
def test_trl_docstring_describes_the_on_policy_path():
    import pacs.integrations.trl as trl

    assert "one vocabulary sweep" not in trl.__doc__  # on-policy there is no old lse: no one-sweep step
    assert "old_lse" not in inspect.getsource(trl.PACSTrainer)


# ---- examples that run on real models keep their settings real ------------------------------------

def test_multi_gpu_examples_do_not_run_from_the_cpu_venv():
    for page in ["README.md"] + docs_pages():
        assert ".venv/bin/torchrun" not in read(page), page


def test_real_model_examples_set_prompt_length_and_learning_rate():
    for page in ("README.md", "docs/trainer.md", "docs/memory.md"):
        for block in re.findall(r"```bash\n(.*?)```", read(page), re.S):
            for command in block.replace("\\\n", " ").split("\n"):
                if "--model /path/to" in command and " train " in command:
                    assert "rollout.max_prompt_len=" in command and "optim.lr=" in command, (page, command)


def test_layout_names_every_benchmark_script():
    layout = read("docs", "development.md")
    scripts = [f for f in os.listdir(os.path.join(repo_root(), "benchmarks"))
               if f.endswith((".py", ".sh")) and f != "__init__.py"]
    missing = [f for f in scripts if f not in layout]
    assert not missing, f"docs/development.md's layout does not name {missing}"


def test_readme_sections_in_the_users_order():
    headings = re.findall(r"^## (.+)$", read("README.md"), re.M)
    assert headings == ["What it is", "Install", "Quick start", "API", "TRL", "verl and plain PyTorch / FSDP2",
                        "`pacs train`", "Limited memory", "Results in brief", "Development", "Citation"]
    quick_start = read("README.md").split("## Quick start")[1]
    block = re.search(r"```python\n(.*?)```", quick_start, re.S).group(1)
    assert len(block.strip().split("\n")) <= 20
    assert "fused_linear_pacs_loss" in block and "None" in block
