"""A checkpoint holds data, never code: every file of one is read with ``torch.load(weights_only=True)``, so a
pickled object planted in a run directory (a shared one, one on a shared filesystem) is refused on ``--resume``
in one line naming the file, before anything in it runs."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch
from test_run_errors import TINY_RUN, one_error_line, run_cli, tiny_model  # noqa: F401  (a fixture)

import pacs.run.checkpoint as ck


class _RunsACommand:
    """Unpickling this calls ``os.system`` (what a crafted checkpoint does): it leaves a file if it ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(checkpoint: str, name: str, payload) -> None:
    """Replace ``name`` in ``checkpoint`` by ``payload`` pickled as torch.save does, and rewrite the manifest to
    match (what someone who can write the run directory can do)."""
    torch.save(payload, os.path.join(checkpoint, name))
    ck.write_manifest(checkpoint, int(os.path.basename(checkpoint).split("_")[1]))


@pytest.mark.parametrize("name", ["scheduler.pt", "optimizer.pt", "rng_rank0.pt"])
def test_a_planted_pickle_is_refused_on_resume_and_runs_nothing(tmp_path, capsys, tiny_model, name):  # noqa: F811
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "1",
                           *TINY_RUN)
    assert code == 0, err
    checkpoint = ck.latest_checkpoint(str(out))
    marker = tmp_path / "it_ran"
    _plant(checkpoint, name, {"state": _RunsACommand(str(marker))})
    assert ck.verify_checkpoint(checkpoint) is None  # the manifest matches: only the loader stands in the way

    code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--resume",
                           "--max-steps", "2", *TINY_RUN)
    assert not marker.exists(), "unpickling the planted object ran its command"
    assert code == 2
    line = one_error_line(err)
    assert f"checkpoint file {os.path.join(checkpoint, name)} holds something other than tensors" in line
    assert "nothing in it ran" in line


def test_rng_states_round_trip_as_data(tmp_path):
    """The RNG file is plain data (numpy's key array as a tensor) and restores every generator exactly."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    ck.save_torch(ck.rng_state(), str(tmp_path / "rng_rank0.pt"))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ck.set_rng_state(torch.load(tmp_path / "rng_rank0.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_an_rng_file_of_an_earlier_version_still_loads(tmp_path):
    """RNG files written before this change hold numpy's state as an ndarray: those still resume (the array is
    rebuilt from bytes; no other object is allowed), and restore the generators."""
    np.random.seed(5)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(state, tmp_path / "rng_rank0.pt")
    expected = np.random.rand()
    np.random.seed(0)
    ck.set_rng_state(ck._load(str(tmp_path), "rng_rank0.pt"))
    assert np.random.rand() == expected
    with open(tmp_path / "rng_rank0.pt", "wb") as fh:  # ... but nothing beside the array is allowed there
        pickle.dump(_RunsACommand(str(tmp_path / "it_ran")), fh)
    with pytest.raises(ValueError, match="rng_rank0.pt"):
        ck._load(str(tmp_path), "rng_rank0.pt")
    assert not (tmp_path / "it_ran").exists()
