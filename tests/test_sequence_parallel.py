"""Sequence parallelism (pacs/sequence_parallel.py): the token split of a packed micro-batch over ranks,
and the Ulysses attention, equal to one process in float64."""

import os

import pytest
import torch
from trainer_helpers import repo_root, run_torchrun

from pacs.packing import pack_rows
from pacs.sequence_parallel import SequenceParallel, shard_packed
from pacs.trainer import build_batch


def test_shards_cover_the_row_once_padded_to_a_multiple_of_the_ranks():
    batch = build_batch([[1, 2, 3]] * 4, [[4, 5], [6], [7, 8, 9], [10, 11]], [1.0, 0.0, 1.0, 1.0], pad_token_id=0)
    whole = pack_rows(batch, 0, 4)  # 4 rows of 5, 4, 6, 5 tokens: 20
    for size in (3, 4, 7):
        parts = [shard_packed(whole, SequenceParallel(size=size, rank=r, leader=0, group=None)) for r in range(size)]
        padded = -whole.n_tokens % size
        assert {p.n_tokens for p in parts} == {(whole.n_tokens + padded) // size}
        assert torch.equal(torch.cat([p.input_ids[0] for p in parts])[:whole.n_tokens], whole.input_ids[0])
        assert torch.equal(torch.cat([p.targets for p in parts])[:whole.n_tokens], whole.targets)
        assert torch.equal(torch.cat([p.mask for p in parts]), torch.cat([whole.mask, torch.zeros(padded, dtype=bool)]))
        # positions restart for the padding, which is one more sequence of the attention's bounds
        assert torch.equal(torch.cat([p.position_ids[0] for p in parts]),
                           torch.cat([whole.position_ids[0], torch.arange(padded)]))
        expected_cu = whole.cu_seqlens.tolist() + ([whole.n_tokens + padded] if padded else [])
        assert all(p.cu_seqlens.tolist() == expected_cu for p in parts)
        # the response tokens' places in the padded batch, each once
        places = torch.cat([p.rows[p.mask] * 100 + p.cols[p.mask] for p in parts])
        assert torch.equal(places, whole.rows[whole.mask] * 100 + whole.cols[whole.mask])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence_parallel")
    run_torchrun([os.path.join(repo_root(), "tests", "sequence_parallel_worker.py"), out],
                 "the sequence-parallel worker (2 ranks)")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("layout", ["kv_split", "kv_repeated", "multi_head"])
def test_two_ranks_compute_one_process_hidden_states_loss_and_gradients(two_ranks, layout):
    ranks = [r[layout] for r in two_ranks]
    reference = ranks[0]
    n = reference["n_tokens"]
    hidden = torch.cat([r["hidden"] for r in ranks])[:n]  # the padding's hidden states are dropped
    torch.testing.assert_close(hidden, reference["hidden_reference"], rtol=1e-12, atol=1e-12)
    assert ranks[0]["loss"] == ranks[1]["loss"] == pytest.approx(reference["loss_reference"], rel=1e-12, abs=1e-13)
    assert ranks[0]["grads"].keys() == reference["grads_reference"].keys()
    for name, grad in reference["grads_reference"].items():
        assert float(grad.abs().max()) > 0 or "bias" in name, name  # not vacuous
        torch.testing.assert_close(ranks[0]["grads"][name], grad, rtol=1e-10, atol=1e-12, msg=name)
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name])
