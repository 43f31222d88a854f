"""The paper's math datasets, named in one place: Hugging Face ids, splits and column names.

PACS trains on DeepScaleR and reports pass@k on MATH500, AMC23, AIME 2024 and AIME 2025 (the
public code's README names these ids). Each entry says which columns hold the question and the
final answer, so a local copy in the same schema (``.jsonl`` / ``.parquet``, e.g. written with
``datasets``' ``to_json``/``to_parquet``) loads offline with :func:`load_dataset_file`, and
``task.data_path=hf:NAME`` loads the Hugging Face copy when the ``datasets`` package and the network
are available.
"""

from __future__ import annotations

from dataclasses import dataclass

from pacs.tasks.base import Problem
from pacs.tasks.row_files import read_rows


@dataclass(frozen=True)
class DatasetSpec:
    hf_id: str       # Hugging Face dataset id
    split: str       # the split the paper's numbers use
    question: str    # column holding the problem text
    answer: str      # column holding the final answer (compared by math-verify)


DATASETS: dict[str, DatasetSpec] = {
    "math500": DatasetSpec("HuggingFaceH4/MATH-500", "test", question="problem", answer="answer"),
    "amc23": DatasetSpec("zwhe99/amc23", "test", question="question", answer="answer"),
    "aime2024": DatasetSpec("Maxwell-Jia/AIME_2024", "train", question="Problem", answer="Answer"),
    "aime2025": DatasetSpec("yentinglin/aime_2025", "train", question="problem", answer="answer"),
    "deepscaler": DatasetSpec("agentica-org/DeepScaleR-Preview-Dataset", "train", question="problem",
                              answer="answer"),
}
HF_PREFIX = "hf:"


def spec(name: str) -> DatasetSpec:
    """The registry entry ``name`` (one of :data:`DATASETS`)."""
    if name not in DATASETS:
        raise ValueError(f"dataset name must be one of {', '.join(DATASETS)}; got {name!r}")
    return DATASETS[name]


def rows_to_problems(rows: list[dict], name: str, where: str) -> list[Problem]:
    """Problems from rows in dataset ``name``'s schema (answers as strings: AIME's are ints)."""
    s = spec(name)
    problems = []
    for i, row in enumerate(rows):
        if s.question not in row or s.answer not in row:
            raise ValueError(f"{where} row {i}: dataset {name!r} needs columns {s.question!r} and {s.answer!r}; "
                             f"got {sorted(row)}")
        problems.append(Problem(prompt=str(row[s.question]), answer=str(row[s.answer]).strip()))
    if not problems:
        raise ValueError(f"{where}: holds no rows")
    return problems


def load_dataset_file(path: str, name: str) -> list[Problem]:
    """A local ``.jsonl``/``.json``/``.parquet`` copy of dataset ``name`` (same columns as on the Hub)."""
    return rows_to_problems(read_rows(path), name, path)


def load_hf(name: str) -> list[Problem]:
    """Dataset ``name`` from the Hugging Face Hub (needs ``pip install datasets`` and the network)."""
    s = spec(name)
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(f"task.data_path={HF_PREFIX}{name} needs the 'datasets' package (pip install datasets), "
                         "or a local .jsonl/.parquet copy") from exc
    table = datasets.load_dataset(s.hf_id, split=s.split)
    return rows_to_problems([dict(row) for row in table], name, f"{s.hf_id}[{s.split}]")
