"""An evaluation that is never lost: ``pacs eval`` journals each finished chunk of problems.

pass@k with many samples (the paper's protocol: 32 to 256 samples of up to 4096 tokens for each of
hundreds of problems) runs for hours on a GPU. ``eval_problems.partial.jsonl`` in the eval directory
holds a header line (what decides the samples: the model's files, the engine and its dtype, the
problems, sampling, seed, chunking) and then one line per finished problem, flushed and fsynced after
every chunk. A ``pacs eval`` started again with the same settings takes the finished problems from it
and generates only the rest, with the same per-chunk seeds, so the report equals that of a run never
interrupted; with other settings it starts afresh, the old journal moved aside to
``eval_problems.partial.jsonl.old`` (and says so). The journal is removed once the outputs are
written. A torn last line (a kill in the middle of a write) is dropped.
"""

from __future__ import annotations

import hashlib
import json
import os

JOURNAL_NAME = "eval_problems.partial.jsonl"


def problems_digest(problems) -> str:
    """SHA-256 of the problems' prompts and answers: a journal of other problems is not resumed."""
    digest = hashlib.sha256()
    for problem in problems:
        digest.update(json.dumps([problem.prompt, problem.answer]).encode())
    return digest.hexdigest()


def model_files(model_dir: str) -> list | str:
    """(name, size, modification time) of each file of a local model directory, the id itself for a hub
    model: a journal of other weights (a directory rewritten since) is not resumed."""
    if not os.path.isdir(model_dir):
        return model_dir
    return [[entry.name, entry.stat().st_size, entry.stat().st_mtime_ns]
            for entry in sorted(os.scandir(model_dir), key=lambda e: e.name) if entry.is_file()]


class EvalJournal:
    """The journal of one evaluation in ``out_dir`` for ``settings`` (a JSON-serialisable dict)."""

    def __init__(self, out_dir: str, settings: dict, *, say=print):
        self.path = os.path.join(out_dir, JOURNAL_NAME)
        self.settings = json.loads(json.dumps(settings))  # as it reads back
        self.done: dict[int, dict] = {}
        previous = self._read()
        os.makedirs(out_dir, exist_ok=True)
        if previous is not None and previous[0] == self.settings:
            self.done = previous[1]
            if self.done:
                say(f"[eval] resuming: {len(self.done)} problems already done ({self.path})")
        elif previous is not None:
            os.replace(self.path, self.path + ".old")
            say(f"[eval] {self.path} held an evaluation with other settings: moved to {self.path}.old, "
                "starting afresh")
        self._rewrite()  # the header and what is kept (a torn last line dropped) before anything is appended

    def _read(self) -> tuple[dict, dict[int, dict]] | None:
        if not os.path.isfile(self.path):
            return None
        with open(self.path) as handle:
            lines = handle.read().split("\n")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            return None
        done = {}
        for line in lines[1:]:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a torn write: only ever the last line
                break
            done[int(record["index"])] = record
        return header.get("settings"), done

    def _rewrite(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as handle:
            handle.write(json.dumps({"settings": self.settings}) + "\n")
            for index in sorted(self.done):
                handle.write(json.dumps(self.done[index]) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)

    def append(self, records: list[dict]) -> None:
        """Journal finished problems (one chunk), durably."""
        with open(self.path, "a") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
                self.done[int(record["index"])] = record
            handle.flush()
            os.fsync(handle.fileno())

    def finish(self) -> None:
        """The outputs are written: the journal is no longer needed."""
        if os.path.exists(self.path):
            os.remove(self.path)
