"""benchmarks/results/ holds evidence only, within a size budget: plots as compact PNGs, names that say what
was measured (never which issue asked for it), and an index (README.md) that names every entry."""

import os
import re

from trainer_helpers import repo_root

# about 1.96 MB in use: the raw runs of the seed sweeps (science*/runs.jsonl; science_family/, the GRPO family beside
# PACS, 0.16 MB) and the first GPU run (gpu/, 0.24 MB)
BUDGET_BYTES = 2_000_000
KINDS = (".md", ".csv", ".png", ".txt", ".jsonl", ".log")


def results_files() -> list[str]:
    root = os.path.join(repo_root(), "benchmarks", "results")
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, _, names in os.walk(root) for name in names)


def test_results_stay_within_the_size_budget():
    root = os.path.join(repo_root(), "benchmarks", "results")
    sizes = {path: os.path.getsize(os.path.join(root, path)) for path in results_files()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert total <= BUDGET_BYTES, (
        f"benchmarks/results/ holds {total:,} bytes, over its budget of {BUDGET_BYTES:,}; the largest: {largest}. "
        "Compact new plots (python scripts/compact_plots.py benchmarks/results) and leave out progress logs")


def test_results_are_evidence_files_named_for_what_they_measure():
    odd = [path for path in results_files() if not path.endswith(KINDS)]
    assert not odd, f"benchmarks/results/ holds files of other kinds (plots go in as PNG): {odd}"
    issues = [path for path in results_files() if re.search(r"issue", path, re.I)]
    assert not issues, f"names must say what was measured, not which issue asked for it: {issues}"


def test_index_names_every_entry():
    root = os.path.join(repo_root(), "benchmarks", "results")
    with open(os.path.join(root, "README.md")) as f:
        index = f.read()
    entries = {path.split(os.sep)[0] for path in results_files()} - {"README.md"}
    stems = {re.sub(r"\.\w+$", "", entry) for entry in entries}
    missing = sorted(stem for stem in stems if stem not in index)
    assert not missing, f"benchmarks/results/README.md does not name {missing}"
