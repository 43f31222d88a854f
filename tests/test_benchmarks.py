"""The benchmark harness end to end at tiny sizes: files, columns, plots (its plumbing, not speed)."""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch

from benchmarks import long_context, run
from benchmarks.ops import Case, first_step_available, impl_unavailable_reason, make_inputs, runner
from benchmarks.report import COLUMNS

REQUIRED = {"device", "op", "impl", "N", "d", "V", "dtype", "median_ms", "peak_mem_mib"}


def test_cpu_benchmark_writes_csv_markdown_and_plots(tmp_path):
    n, d, v = 512, 16, 2048
    rc = run.main(["--set", "cpu", "--d", str(d), "--v", str(v), "--n", str(n), "--out", str(tmp_path),
                   "--ops", "logprobs_fwd_bwd", "pacs_loss_fwd_bwd",
                   "--impls", "naive", "torch", "triton", "--warmup", "0", "--repeats", "1", "--name", "tiny"])
    assert rc == 0
    with open(tmp_path / "tiny.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        assert REQUIRED <= set(reader.fieldnames) and tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    # triton never runs on the CPU: 2 ops x (naive, torch)
    assert sorted((r["op"], r["impl"]) for r in rows) == sorted(
        (op, impl) for op in ("logprobs_fwd_bwd", "pacs_loss_fwd_bwd")
        for impl in ("naive", "torch"))
    for row in rows:
        assert row["status"] == "ok", row
        assert (row["device"], row["dtype"], int(row["N"]), int(row["d"]), int(row["V"])) == (
            "cpu", "float32", n, d, v)
        assert float(row["median_ms"]) > 0 and float(row["tflops"]) > 0
        assert row["flop_fraction"] == ""  # the matmul floor is measured on the GPU only
        assert row["date"] and row["device_name"]
    # the naive backward holds at least one N x V float32 buffer: the RSS method must see it
    naive = next(r for r in rows if r["op"] == "logprobs_fwd_bwd" and r["impl"] == "naive")
    assert float(naive["peak_mem_mib"]) >= n * v * 4 / 2**20
    table = (tmp_path / "tiny.md").read_text()
    assert "| N | naive | torch |" in table and "Device:" in table
    plots = sorted(p.name for p in (tmp_path / "plots_tiny").glob("*.png"))
    assert plots == [f"{op}_d{d}_V{v}_float32.png" for op in ("logprobs_fwd_bwd", "pacs_loss_fwd_bwd")]
    assert all((tmp_path / "plots_tiny" / p).stat().st_size > 5000 for p in plots)


def test_long_context_sweep_writes_csv_markdown_and_plot(tmp_path):
    rc = long_context.main(["--device", "cpu", "--d", "16", "--v", "512", "--budget-mib", "1024",
                            "--n-start", "256", "--n-max", "512", "--impls", "torch", "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "long_context_cpu.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    # a budget far above these sizes: every trial fits, the answer is ">= n_max"
    assert [(r["impl"], int(r["N"]), r["fits"]) for r in rows] == [("torch", 256, "True"), ("torch", 512, "True")]
    assert all(0 < float(r["footprint_mib"]) < 1024 for r in rows)
    assert ">= 512" in (tmp_path / "long_context_cpu.md").read_text()
    assert (tmp_path / "long_context_cpu.png").stat().st_size > 5000


def test_a_failing_trial_ends_its_impls_search_not_the_sweep(monkeypatch, tmp_path):
    """An error other than out-of-memory (a kernel failing on the GPU) stops that impl's search with the
    error in its row; the other impls are still searched and the report is written."""
    def fake_trial(case, budget_mib, timeout_s):
        if case.impl == "torch" and case.n >= 1024:
            return {"fits": False, "footprint_mib": None, "seconds": 0.0, "error": "AttributeError: broken kernel"}
        return {"fits": case.n <= 2048, "footprint_mib": case.n / 100, "seconds": 0.0}

    monkeypatch.setattr(long_context, "trial", fake_trial)
    args = long_context.parse_args(["--device", "cpu", "--n-start", "256", "--n-max", "65536"])
    lo, hi, trials = long_context.largest_fitting("torch", args, "cpu", lambda line: None)
    assert (lo, hi) == (512, None) and trials[-1]["error"] == "AttributeError: broken kernel"
    monkeypatch.setattr(long_context, "plot", lambda *a, **k: None)
    assert long_context.main(["--device", "cpu", "--n-start", "256", "--n-max", "65536", "--impls", "torch",
                              "naive", "--out", str(tmp_path)]) == 1  # all searched; the failure in the exit code
    report = (tmp_path / "long_context_cpu.md").read_text()
    assert "| torch | >= 512 (then failed: AttributeError: broken kernel) |  |" in report
    assert "| naive | 2048 | 2304 |" in report
    rows = list(csv.DictReader(open(tmp_path / "long_context_cpu.csv")))
    assert [r["note"] for r in rows if r["impl"] == "torch"][-1] == "AttributeError: broken kernel"


@pytest.mark.parametrize("edge", [300, 1000, 5000, 70_000])
def test_long_context_search_brackets_the_largest_fitting_n(monkeypatch, edge):
    """Doubling then bisection, with a fake step that fits exactly when N <= edge."""
    calls = []

    def fake_trial(case, budget_mib, timeout_s):
        calls.append(case.n)
        return {"fits": case.n <= edge, "footprint_mib": case.n / 100, "seconds": 0.0}

    monkeypatch.setattr(long_context, "trial", fake_trial)
    args = long_context.parse_args(["--device", "cpu", "--n-start", "256", "--n-max", "65536"])
    lo, hi, trials = long_context.largest_fitting("torch", args, "cpu", lambda line: None)
    assert len(trials) == len(calls) == len(set(calls))  # no size is tried twice
    if edge >= 65536:
        assert (lo, hi) == (65536, None)  # everything up to n_max fits
        return
    assert lo <= edge < hi
    assert hi - lo <= max(256, lo // 8)
    assert all(n % 256 == 0 for n in calls)


@pytest.mark.parametrize("op", ["logprobs_fwd_bwd", "logprobs_nograd", "pacs_loss_fwd_bwd", "pacs_loss_first_step"])
def test_every_op_runs_on_fresh_inputs(op):
    if op == "pacs_loss_first_step" and not first_step_available():
        pytest.skip("this pacs_kernels has no one-sweep first step (fused_linear_pacs_loss(old_lse=...))")
    case = Case(op=op, impl="torch", n=64, d=8, v=32, dtype="float32", device="cpu")
    first, second = make_inputs(case, 1), make_inputs(case, 2)
    assert not (first["hidden"] == second["hidden"]).all()
    assert (first["hidden"] != 0).all()
    produced = runner(case)(first)
    assert produced.isfinite().all()
    if op != "logprobs_nograd":
        assert first["hidden"].grad is not None and first["weight"].grad is not None


@pytest.mark.parametrize("engine", ["torch", "triton"])
def test_grad_gemms_op_runs_the_backward_gemm_phase_over_chunks(engine, monkeypatch):
    """grad_gemms: per staged dz chunk dh = dz W and dW += dz^T h; here 3 chunks (a small chunk budget),
    each engine (the Triton kernels in the interpreter) against the plain product."""
    from pacs_kernels.triton import launch_config

    monkeypatch.setattr(launch_config, "DZ_CHUNK_BYTES", 32 * 40 * 4)  # 32 tokens of V = 40, float32
    case = Case(op="grad_gemms", impl=engine, n=80, d=24, v=40, dtype="float32", device="cpu")
    inputs = make_inputs(case, 3)
    assert inputs["dz"].shape == (32, 40) and (inputs["dz"] != 0).all()
    d_weight = runner(case)(inputs)
    dz, hidden = inputs["dz"].double(), inputs["hidden"].double()
    expected = sum(dz[:rows].T @ hidden[row0:row0 + rows] for row0, rows in ((0, 32), (32, 32), (64, 16)))
    assert d_weight.dtype == torch.float32
    torch.testing.assert_close(d_weight.double(), expected, rtol=1e-5, atol=1e-6)
    assert impl_unavailable_reason("grad_gemms", "naive", "cpu").startswith("grad_gemms races")


def test_unavailable_impls_say_why_and_bad_names_raise():
    assert "CUDA" in impl_unavailable_reason("logprobs_fwd_bwd", "triton", "cpu")
    with pytest.raises(ValueError, match="impl must be one of"):
        impl_unavailable_reason("logprobs_fwd_bwd", "fast", "cpu")
    with pytest.raises(ValueError, match="op must be one of"):
        impl_unavailable_reason("softmax", "naive", "cpu")


def test_zero_gradient_groups_benchmark_runs_both_settings_and_writes_its_table(tmp_path):
    """benchmarks/zero_gradient_groups.py end to end at 2 steps (tiny task settings, the HF engine): a run with
    the skipping and one without, and the table that compares them."""
    from benchmarks import zero_gradient_groups

    rc = zero_gradient_groups.main(["--dry-run", "--tasks", "addition", "--out", str(tmp_path), "--cache-dir",
                                    str(tmp_path / "cache"), "rollout.engine=hf", "advanced.task.digits=1",
                                    "advanced.task.warmup_steps=300", "advanced.task.warmup_target_accuracy=0.3",
                                    "rollout.prompts_per_step=8", "rollout.group_size=4", "eval.num_problems=8"])
    assert rc == 0
    with open(tmp_path / "zero_gradient_groups_cpu.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(r["skip"] for r in rows) == ["False", "True"]
    assert all(int(r["steps"]) == 2 and float(r["update_s"]) > 0 for r in rows)
    assert float(next(r for r in rows if r["skip"] == "False")["skipped_frac"]) == 0.0
    table = (tmp_path / "zero_gradient_groups_cpu.md").read_text()
    assert "| addition | 0 |" in table and "rollout.engine=hf" in table


def test_rollout_correction_benchmark_runs_both_modes_and_writes_its_results(tmp_path):
    """benchmarks/rollout_correction.py end to end at 2 steps (tiny task settings, the HF engine): an uncorrected
    and a corrected run with the mismatched sampler, and the JSON, plot and table."""
    from benchmarks import rollout_correction

    rc = rollout_correction.main(["--dry-run", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                                  "rollout.engine=hf", "advanced.task.digits=1", "advanced.task.warmup_steps=300",
                                  "advanced.task.warmup_target_accuracy=0.3", "rollout.prompts_per_step=8",
                                  "rollout.group_size=4"])
    assert rc == 0
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert sorted(run["mode"] for run in runs) == ["none", "sequence_truncate"]
    assert all(run["steps"] == 2 and run["mismatch_kl_mean"] > 1e-4 for run in runs)  # the sampler differs
    assert (tmp_path / "heldout_accuracy.png").stat().st_size > 0
    assert "| 0 |" in (tmp_path / "README.md").read_text()


def test_tile_buffer_benchmark_pairs_shared_and_fresh_tiles(tmp_path, capsys):
    """benchmarks/tile_buffer.py at a tiny point: both sides timed each round, the table written, and
    TileBuffer.take as it was afterwards; a malformed point is refused by name."""
    from benchmarks import tile_buffer
    from pacs_kernels.single_pass_rows import TileBuffer

    take = TileBuffer.take
    tile_buffer.main(["--points", "4096,64,256", "--rounds", "2", "--out", str(tmp_path)])
    assert TileBuffer.take is take
    with open(tmp_path / "tile_buffer_cpu.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert (row["V"], row["d"], row["N"], row["rounds"]) == ("4096", "64", "256", "2")
    assert int(row["tiles"]) >= 1 and float(row["shared_ms"]) > 0 and float(row["fresh_ms"]) > 0
    assert float(row["ratio_min"]) <= float(row["ratio"]) <= float(row["ratio_max"])
    assert "| 4096 | 64 | 256 |" in (tmp_path / "tile_buffer_cpu.md").read_text()
    with pytest.raises(SystemExit):
        tile_buffer.main(["--points", "4096,64", "--out", str(tmp_path)])
    assert "--points: each point is V,d,N" in capsys.readouterr().err


def test_tile_buffer_benchmark_fresh_side_allocates_every_tile():
    """The benchmark's fresh side hands out new memory for each tile; the shared side the buffer's."""
    from benchmarks.tile_buffer import tiles_counted
    from pacs_kernels.single_pass_rows import TileBuffer

    buffer, counted = TileBuffer(vocab=5, dtype=torch.float32, device=torch.device("cpu"), max_rows=4), []
    with tiles_counted(False, counted):
        first = buffer.take(3)
        buffer.give_back(first)
        assert buffer.take(4).data_ptr() == first.data_ptr()
    buffer = TileBuffer(vocab=5, dtype=torch.float32, device=torch.device("cpu"), max_rows=4)
    with tiles_counted(True, counted):
        first = buffer.take(3)
        buffer.give_back(first)
        assert buffer.take(4).data_ptr() != first.data_ptr() and buffer.buffer is None
    assert counted == [3, 4, 3, 4]


@pytest.mark.slow
def test_sequence_parallel_memory_benchmark_compares_one_process_with_two_ranks(tmp_path):
    """benchmarks/sequence_parallel_memory.py at two short lengths: one process and 2 ranks (torchrun, gloo)
    ran the same step (the same loss: checked by the script), and the table has both."""
    from benchmarks import sequence_parallel_memory

    rc = sequence_parallel_memory.main(["--lengths", "32", "64", "--variants", "packed", "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "sequence_parallel_memory_cpu.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["longest"]) for r in rows] == [32, 64]
    assert all(float(r["saved_mib_per_rank_2_ranks"]) > 0 and float(r["seconds_2_ranks"]) > 0 for r in rows)
    assert all(float(r["saved_ratio"]) < 1 for r in rows)  # each rank saves less than the one process
    assert "| packed | 64 |" in (tmp_path / "sequence_parallel_memory_cpu.md").read_text()


def test_trl_dropin_single_label_groups_reach_the_loss_inputs():
    """benchmarks/trl_dropin.py --single-label-groups K: the first K groups all 1 / all 0 (alternating), the rest
    mixed as before (K = 0: the rewards of the committed CSV); they are the trainer's pacs_rewards, and the
    groups PACSTrainer's skipping would leave out are exactly those K."""
    from benchmarks import trl_dropin
    from pacs.train.single_label_groups import groups_that_must_run

    assert torch.equal(trl_dropin.make_rewards(8), torch.tensor([1.0, 0.0] * 4))
    args = trl_dropin.parse_args(["--responses", "16", "--single-label-groups", "2", "--vocab", "64",
                                  "--completion-len", "8", "--prompt-len", "4"])
    inputs = trl_dropin.micro_batch(args)
    expected = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0, 0.0] * 4)
    assert torch.equal(inputs["pacs_rewards"], expected)
    assert torch.equal(inputs["pacs_group_ids"], torch.arange(16) // 4)
    assert torch.equal(inputs["advantages"][:8], torch.zeros(8))  # GRPO's advantages from the same rewards
    run = groups_that_must_run(inputs["pacs_rewards"], inputs["pacs_valid"], 4)
    assert run.tolist() == [False, False, True, True]
    assert torch.equal(trl_dropin.make_rewards(8, 2), torch.tensor([1.0] * 4 + [0.0] * 4))


@pytest.mark.parametrize("argv", [["--single-label-groups", "3"], ["--single-label-groups", "-1"],
                                  ["--responses", "16", "--single-label-groups", "5"]])
def test_trl_dropin_refuses_more_single_label_groups_than_groups(argv, capsys):
    from benchmarks import trl_dropin

    with pytest.raises(SystemExit) as exc:
        trl_dropin.parse_args(argv)
    assert exc.value.code == 2 and "--single-label-groups must be in [0, " in capsys.readouterr().err
    with pytest.raises(ValueError, match="--single-label-groups"):
        trl_dropin.make_rewards(8, 3)


def test_trl_dropin_stops_when_skipping_changes_the_loss():
    from benchmarks import trl_dropin

    rows = [{"case": "pacs", "loss": 0.6931472, "grad_norm": 1.0},
            {"case": "pacs_no_skip", "loss": 0.6931472 * (1 + 3e-6), "grad_norm": 1.0}]
    trl_dropin.check_losses(rows)  # within 1e-5 relative
    rows[1]["loss"] = 0.6931472 * (1 + 3e-5)
    with pytest.raises(SystemExit, match="pacs and pacs_no_skip losses differ"):
        trl_dropin.check_losses(rows)


def test_trl_dropin_pacs_skips_the_single_label_groups_with_the_same_loss_and_gradient():
    """The two PACSTrainer cases in process at a tiny size (no subprocess): with 1 of 2 groups single-label,
    skipping runs 1 group and gives the loss and gradient norm of running both."""
    pytest.importorskip("trl")
    from benchmarks import trl_dropin

    args = trl_dropin.parse_args(["--vocab", "256", "--hidden", "32", "--completion-len", "8", "--prompt-len", "4",
                                  "--single-label-groups", "1", "--repeats", "1",
                                  "--threads", str(torch.get_num_threads())])
    skip, no_skip = (trl_dropin.run_case(case, args) for case in ("pacs", "pacs_no_skip"))
    assert (skip["groups_run"], no_skip["groups_run"]) == (1, 2)
    assert skip["loss"] == pytest.approx(no_skip["loss"], rel=1e-6)
    assert skip["grad_norm"] == pytest.approx(no_skip["grad_norm"], rel=1e-5) and skip["grad_norm"] > 0


def test_trl_dropin_varied_lengths_pad_prompts_left_and_completions_right():
    """--varied-lengths: prompts of P..P/2 tokens left-padded, completions of C..C/8 right-padded, every group
    holding different lengths; the default keeps the committed CSVs' layout (full prompts, a quarter of every
    third completion padded)."""
    from benchmarks import trl_dropin

    args = trl_dropin.parse_args(["--responses", "8", "--vocab", "64", "--completion-len", "16", "--prompt-len", "6",
                                  "--varied-lengths"])
    inputs = trl_dropin.micro_batch(args)
    prompt_lens, completion_lens = inputs["prompt_mask"].sum(1), inputs["completion_mask"].sum(1)
    assert sorted(completion_lens.tolist()) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert set(prompt_lens.tolist()) == {6, 5, 4, 3}
    assert bool((inputs["prompt_mask"][:, -1] == 1).all()) and bool((inputs["completion_mask"][:, 0] == 1).all())
    assert all(len(set(completion_lens[g:g + 4].tolist())) == 4 for g in (0, 4))
    assert torch.equal(inputs["prompt_ids"] == 0, inputs["prompt_mask"] == 0)
    default = trl_dropin.micro_batch(trl_dropin.parse_args(["--vocab", "64", "--completion-len", "16"]))
    assert bool(default["prompt_mask"].all())
    assert default["completion_mask"].sum(1).tolist() == [12, 16, 16, 12, 16, 16, 12, 16]


@pytest.mark.slow
def test_trl_dropin_padding_free_and_padded_give_one_loss(tmp_path):
    """The two PACSTrainer cases, tiny, each in its own process: the script checks their losses agree."""
    from benchmarks import trl_dropin

    out = tmp_path / "padding_free.csv"
    trl_dropin.main(["--cases", "pacs", "pacs_padded", "--varied-lengths", "--vocab", "128", "--hidden", "32",
                     "--completion-len", "24", "--prompt-len", "6", "--repeats", "1", "--threads", "1",
                     "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [row["case"] for row in rows] == ["pacs", "pacs_padded"]
    assert float(rows[0]["loss"]) == pytest.approx(float(rows[1]["loss"]), rel=1e-5)
    assert float(rows[0]["grad_norm"]) == pytest.approx(float(rows[1]["grad_norm"]), rel=1e-4)


# ----------------------------------------------------------------------------- benchmarks/trl_long_context.py


@pytest.mark.parametrize("edge", [0, 1, 24, 100, 255, 256, 257, 3000, 4863, 65535, 65536, 10**6])
def test_trl_long_context_search_doubles_then_bisects_to_the_resolution(edge):
    """On a fake probe that fits up to ``edge`` tokens: doubling from the start (halving when the start does not
    fit), then bisection; the answer fits, the first failure does not, and the bracket between them is at most
    min(resolution, longest/8) tokens (never over the cap); no length is probed twice."""
    from benchmarks.trl_long_context import search_longest, tolerance

    calls = []

    def fits(length):
        calls.append(length)
        return length <= edge

    result = search_longest(fits, start=256, resolution=128, max_len=65536)
    assert result.complete and len(set(calls)) == len(calls) == len(result.probes)
    assert result.longest == min(edge, 65536) or result.longest <= edge < result.first_failing
    if edge >= 65536:
        assert (result.longest, result.first_failing) == (65536, None)
    else:
        assert result.longest <= edge < result.first_failing
        assert result.first_failing - result.longest <= tolerance(result.longest, 128)
        assert result.first_failing - result.longest <= 128
    if edge >= 256:  # the doubling phase: 256, 512, ... up to the first length over the edge (or the cap)
        doubling = [256 * 2**k for k in range(9) if 256 * 2**k <= 65536]
        n = next((i for i, c in enumerate(doubling) if c > edge), len(doubling) - 1) + 1
        assert calls[:n] == doubling[:n]
    else:  # halving down from the start
        assert calls[0] == 256 and calls[1] == 128


def test_trl_long_context_search_stops_at_max_probes():
    from benchmarks.trl_long_context import search_longest

    result = search_longest(lambda c: c <= 3000, start=256, resolution=128, max_len=65536, max_probes=2)
    assert [c for c, _ in result.probes] == [256, 512] and result.longest == 512 and not result.complete
    result = search_longest(lambda c: c <= 3000, start=256, resolution=128, max_len=65536, max_probes=6)
    assert [c for c, _ in result.probes] == [256, 512, 1024, 2048, 4096, 3072] and not result.complete
    assert (result.longest, result.first_failing) == (2048, 3072)


def test_trl_long_context_flags_probes_against_a_growing_peak():
    from benchmarks.trl_long_context import disagreements

    rows = [{"completion_len": 1024, "peak_rss_increase_mib": 300.0, "fits": True},
            {"completion_len": 2048, "peak_rss_increase_mib": 200.0, "fits": True},
            {"completion_len": 4096, "peak_rss_increase_mib": None, "fits": False}]
    assert disagreements(rows) == ["peak fell from 300 MiB at C=1024 to 200 MiB at C=2048"]
    rows[0]["fits"] = False
    assert "C=1024 did not fit but C=2048 did" in disagreements(rows)
    rows[1]["peak_rss_increase_mib"] = 295.0  # within 5%: rounding, not a contradiction
    assert disagreements(rows) == ["C=1024 did not fit but C=2048 did"]


def test_trl_long_context_dry_run_writes_every_case(monkeypatch, tmp_path):
    """--dry-run's search, CSV, Markdown and plot for every case, on fake probes (a real probe is a subprocess
    that imports TRL, ~10 s: the next test runs one): 2 probes per case, every probe a CSV row with the
    expected columns, a summary row per case with its ratio to trl_default."""
    from benchmarks import trl_long_context as tlc

    slope = {"trl_default": 0.1, "pacs_padded": 0.05, "pacs": 0.03, "pacs_ckpt": 0.02, "pacs_ckpt_tiled": 0.01}

    def fake_probe(case, length, args):
        peak = slope[case] * length
        return {"case": case, "completion_len": length, "peak_rss_increase_mib": peak,
                "fits": peak <= args.budget_mib, "seconds": 0.5, "status": "ok", "step_ms": 1.0, "cpu_util": 1.0,
                "loadavg_1min": 0.1, "loss": 0.69, "completion_tokens": length, "padded_completion_tokens": length,
                "max_rss_mib": 700.0, "note": ""}

    monkeypatch.setattr(tlc, "probe_case", fake_probe)
    assert tlc.main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "trl_long_context_dry_run.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == tlc.COLUMNS
        rows = list(reader)
    for name in ("case", "completion_len", "peak_rss_increase_mib", "fits", "seconds", "device", "date"):
        assert name in tlc.COLUMNS
    assert [r["case"] for r in rows] == [case for case in tlc.CASES for _ in range(2)]
    assert [int(r["completion_len"]) for r in rows[:2]] == [16, 8]  # trl_default: 16 is over 1 MiB, 8 fits
    assert all(r["device"].startswith("cpu: ") and r["date"].endswith("UTC") for r in rows)
    markdown = (tmp_path / "trl_long_context_dry_run.md").read_text()
    assert "| case | longest C that fits | x vs trl_default | peak at that C (MiB) |" in markdown
    assert "| trl_default | 8 (search cut short) | 1.0x | 1 | 16 | 2 |" in markdown
    assert "| pacs_padded | 16 (search cut short) | 2.0x | 1 | 32 | 2 |" in markdown
    assert "| pacs_ckpt_tiled | 32 (search cut short) | 4.0x | 0 | none probed | 2 |" in markdown
    assert all(f"| {case} |" in markdown for case in tlc.CASES)
    assert (tmp_path / "trl_long_context_dry_run.png").stat().st_size > 0


@pytest.mark.slow
def test_trl_long_context_probe_runs_one_case_in_a_fresh_process(tmp_path):
    """One real probe (a fresh subprocess, trl_dropin's worker): its peak RSS increase, time and loss reach the
    CSV; the probe's process gets the checkpointed, tiled case."""
    pytest.importorskip("trl")
    from benchmarks import trl_long_context as tlc

    assert tlc.main(["--dry-run", "--cases", "pacs_ckpt_tiled", "--max-probes", "1", "--budget-mib", "1000",
                     "--no-plot", "--out-dir", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "trl_long_context_dry_run.csv").open()))
    assert len(rows) == 1 and rows[0]["case"] == "pacs_ckpt_tiled" and rows[0]["status"] == "ok"
    assert rows[0]["fits"] == "True" and 0 <= float(rows[0]["peak_rss_increase_mib"]) <= 1000
    assert float(rows[0]["loss"]) == pytest.approx(0.6931472, rel=1e-5)  # on-policy PACS: log 2 per response
    assert "| pacs_ckpt_tiled | 16 (search cut short) |  |" in (tmp_path / "trl_long_context_dry_run.md").read_text()


@pytest.mark.slow  # importing TRL: ~5 s alone
def test_trl_dropin_checkpointing_cases_recompute_the_layers_and_tile_the_mlp(tmp_path):
    """pacs_ckpt / pacs_ckpt_tiled switch gradient checkpointing on as Trainer.train() does (each decoder layer
    runs again in the backward: its attention's forward is called twice) and pacs_ckpt_tiled tiles every MLP;
    the loss and gradient equal pacs's."""
    pytest.importorskip("trl")
    from benchmarks import trl_dropin
    from pacs.model.tiled_mlp import is_tiled

    args = trl_dropin.parse_args(["--vocab", "256", "--hidden", "32", "--completion-len", "12", "--prompt-len", "4",
                                  "--varied-lengths", "--repeats", "1", "--threads", str(torch.get_num_threads())])
    inputs = trl_dropin.micro_batch(args)
    losses, norms = {}, {}
    for case in ("pacs", "pacs_ckpt", "pacs_ckpt_tiled"):
        trainer = trl_dropin.build_trainer(case, args, str(tmp_path / case))
        assert trainer.model.is_gradient_checkpointing == (case != "pacs")
        layers = trainer.model.model.layers
        assert all(is_tiled(layer.mlp) for layer in layers) == (case == "pacs_ckpt_tiled")
        calls = []
        layers[0].self_attn.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        loss = trainer.compute_loss(trainer.model, inputs)
        forward_calls = len(calls)
        loss.backward()
        assert (forward_calls, len(calls)) == ((1, 1) if case == "pacs" else (1, 2))  # recomputed in the backward
        losses[case] = loss.item()
        norms[case] = float(torch.stack([p.grad.double().pow(2).sum() for p in trainer.model.parameters()
                                         if p.grad is not None]).sum().sqrt())
    assert losses["pacs_ckpt"] == pytest.approx(losses["pacs"], rel=1e-6) == losses["pacs_ckpt_tiled"]
    assert norms["pacs_ckpt"] == pytest.approx(norms["pacs"], rel=1e-6)
    assert norms["pacs_ckpt_tiled"] == pytest.approx(norms["pacs"], rel=1e-5) and norms["pacs"] > 0
    rows = [{"case": case, "loss": losses[case], "grad_norm": norms[case]} for case in losses]
    trl_dropin.check_losses(rows)  # the script's own check covers the new cases against pacs
    rows[2]["loss"] *= 1 + 1e-4
    with pytest.raises(SystemExit, match="pacs and pacs_ckpt_tiled losses differ"):
        trl_dropin.check_losses(rows)


def test_packed_attention_dry_run_checks_loop_and_padded_and_says_why_varlen_cannot_run(tmp_path):
    """benchmarks/packed_attention.py --dry-run (CPU, tiny shapes): every layout has a loop and a padded row,
    timed and within float32's tolerance of the float32 per-sequence reference (output and q/k/v gradients);
    varlen, CUDA only, is marked unavailable with the reason; the Markdown carries the verdict."""
    from benchmarks import packed_attention

    assert packed_attention.main(["--dry-run", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "packed_attention_dry.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    layouts = [layout for layout, _ in packed_attention.LAYOUTS["cpu"][1]]
    assert [(r["layout"], r["engine"]) for r in rows] == [(lay, e) for lay in layouts for e in packed_attention.ENGINES]
    for row in rows:
        assert (row["device"], row["dtype"], int(row["tokens"])) == ("cpu", "float32", 512) and row["commit"], row
        if row["engine"] == "varlen":
            assert row["status"] == "unavailable" and row["note"].startswith("no varlen kernel on cpu"), row
            assert row["median_ms"] == row["max_err"] == "", row
        else:
            assert row["status"] == "ok" and row["within_tolerance"] == "True", row
            assert float(row["median_ms"]) > 0 and float(row["max_err"]) <= packed_attention.TOLERANCE["float32"]
            assert all(float(row[f"err_{name}"]) <= float(row["max_err"]) for name in ("out", "dq", "dk", "dv"))
    assert {int(r["sequences"]) for r in rows} == {16, 4}  # 16 x 32, 16 of random lengths, 4 x 128
    table = (tmp_path / "packed_attention_dry.md").read_text()
    assert "tolerance 1e-04): ok" in table and "| varlen | unavailable: no varlen kernel on cpu" in table


def test_packed_attention_times_varlen_where_the_kernel_runs(monkeypatch, tmp_path):
    """The varlen engine's own path (self-check, errors, speedups) through a fake kernel on the CPU (the one of
    tests/test_varlen_attention.py, float32 allowed here); a kernel that fails its self-check is unavailable,
    with the self-check's reason, and the others are still measured."""
    from test_varlen_attention import FakeKernel

    from benchmarks import packed_attention
    from pacs.model import varlen_attention as va

    monkeypatch.setattr(va, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(va, "KERNEL_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.delenv(va.ENGINE_VARIABLE, raising=False)
    for wrong in (None, "raise"):
        fake = FakeKernel("2.13", wrong)
        monkeypatch.setattr(va, "_varlen_kernel", lambda fake=fake: (fake, fake.params))
        for name, state in list(vars(va).items()):  # its caches (the self-checks' results) start empty
            if name.startswith("_") and isinstance(state, (dict, set)):
                monkeypatch.setattr(va, name, type(state)())
        assert packed_attention.main(["--dry-run", "--out", str(tmp_path)]) == 0
        rows = list(csv.DictReader((tmp_path / "packed_attention_dry.csv").open(newline="")))
        varlen = [r for r in rows if r["engine"] == "varlen"]
        assert len(varlen) == 3 and all(r["status"] == "ok" for r in rows if r["engine"] != "varlen")
        if wrong is None:
            assert fake.calls and all(r["status"] == "ok" and r["within_tolerance"] == "True" for r in varlen)
            assert all(float(r["speedup_vs_loop"]) > 0 and float(r["speedup_vs_padded"]) > 0 for r in varlen)
        else:
            assert all(r["status"] == "unavailable" and "self-check failed: RuntimeError: FlashAttention" in r["note"]
                       for r in varlen)


def test_loss_grid_dry_run_writes_csv_markdown_and_plot(tmp_path):
    """benchmarks/loss_grid.py end to end at one tiny point (fresh worker processes, as on the CPU)."""
    from benchmarks import loss_grid

    assert loss_grid.main(["--grid", "dry", "--columns", "naive", "single_pass", "auto", "--out",
                           str(tmp_path)]) == 0
    with open(tmp_path / "loss_grid_dry.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["column"] for r in rows] == ["naive", "single_pass", "auto"]
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 and r["date"] and r["device_name"] for r in rows)
    assert float(rows[0]["x_naive"]) == 1.0
    table = (tmp_path / "loss_grid_dry.md").read_text()
    assert "| V | d | N | naive | single_pass | auto | auto / fastest |" in table and "Device:" in table
    assert (tmp_path / "loss_grid_dry.png").stat().st_size > 5000


def test_naive_gemms_runs_naives_three_gemms_of_the_response_tokens_and_nothing_else():
    """The naive_gemms column's work, checked in float64: z = h W^T of the masked-in rows, then z W and z^T h;
    for the loss ops only."""
    from benchmarks.ops import NAIVE_GEMMS, runner

    case = Case("pacs_loss_fwd_bwd", NAIVE_GEMMS, 64, 24, 37, "float64", "cpu")
    inputs = make_inputs(case, 5)
    h, w, mask = inputs["hidden"].detach(), inputs["weight"].detach(), inputs["mask"]
    rows = h[mask]
    d_hidden, d_weight = (rows @ w.T) @ w, (rows @ w.T).T @ rows
    produced_dh, produced_dw = runner(case)(inputs)
    torch.testing.assert_close(produced_dh, d_hidden)
    torch.testing.assert_close(produced_dw, d_weight)
    assert produced_dh.shape == (int(mask.sum()), 24) and inputs["weight"].grad is None
    assert "naive's 3 GEMMs alone" in impl_unavailable_reason("logprobs_fwd_bwd", NAIVE_GEMMS, "cpu")
    assert impl_unavailable_reason("objective_loss_fwd_bwd", NAIVE_GEMMS, "cpu", "dapo") is None
    with pytest.raises(ValueError, match="loss ops"):
        runner(Case("logprobs_fwd_bwd", NAIVE_GEMMS, 16, 8, 32, "float32", "cpu"))


def test_loss_grid_table_skips_and_ratios(tmp_path, monkeypatch):
    """The grid's table from given rows (no timing): times relative to naive, auto over the fastest of our
    paths, the skipped impls listed with their reason; the grids hold issue 29's points; the plot's title
    names the objective (a skipped cell's status once took its place)."""
    from benchmarks import loss_grid

    titles = []
    monkeypatch.setattr(loss_grid, "plot", lambda by_point, columns, path, title, paired=None: titles.append(title))

    assert len(loss_grid.GRIDS["cpu"]["points"]) == 27
    assert (151936, 896, 2048) in loss_grid.GRIDS["cpu-quick"]["points"]
    big = Case("pacs_loss_fwd_bwd", "naive", 16384, 896, 151936, "float32", "cpu")
    assert "GiB" in loss_grid.skip_reason("naive", big, memory=24 * 2 ** 30)
    gemms = Case("pacs_loss_fwd_bwd", "naive_gemms", 16384, 896, 151936, "float32", "cpu")  # one copy: 7 GiB
    assert loss_grid.skip_reason("naive_gemms", gemms, memory=24 * 2 ** 30) is None
    assert "GiB" in loss_grid.skip_reason("naive_gemms", gemms, memory=8 * 2 ** 30)
    assert loss_grid.skip_reason("single_pass", Case("pacs_loss_fwd_bwd", "single_pass", 16384, 896, 151936,
                                                     "float32", "cpu"), memory=24 * 2 ** 30) is None
    base = dict(date="2026-01-01 00:00 UTC", device="cpu", device_name="test CPU", dtype="float32", op="x", impl="x")
    rows = [dict(base, column=c, V=1024, d=64, N=256, median_ms=ms, status="ok")
            for c, ms in (("naive", 100.0), ("single_pass", 50.0), ("two_pass", 80.0), ("auto", 52.0))]
    rows += [dict(base, column="naive", V=4096, d=64, N=256, status="skipped", note="too big"),
             dict(base, column="auto", V=4096, d=64, N=256, median_ms=10.0, status="ok")]
    loss_grid.write(rows, "t", tmp_path)
    table = (tmp_path / "loss_grid_t.md").read_text()
    assert "| 1024 | 64 | 256 | 100 (1.00) | 50 (0.50) | 80 (0.80) | 52 (0.52) | 1.04 |" in table
    assert "| 4096 | 64 | 256 | skipped |  |  | 10 |  |" in table
    assert "- naive at V=4096 d=64 N=256: too big" in table
    assert titles == ["PACS loss grid t: test CPU, 2026-01-01 00:00 UTC"]
    assert loss_grid.estimate_seconds("cpu-quick", "cpu", list(loss_grid.COLUMNS), 150e9) > 60


def test_loss_grid_plot_gives_each_column_one_colour_and_no_legend_to_a_column_without_bars(tmp_path, monkeypatch):
    """A column never timed against naive (one_sweep under an objective: skipped) draws no bar and takes no
    legend entry; every column has its own colour, the same in every grid's plot."""
    import matplotlib.axes

    from benchmarks import loss_grid

    drawn = []
    real_bar = matplotlib.axes.Axes.bar

    def bar(self, xs, ys, *args, **kwargs):
        if "label" in kwargs and kwargs["label"] != "separate runs":
            drawn.append((kwargs["label"], kwargs.get("color")))
        return real_bar(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    base = dict(date="2026-01-01 00:00 UTC", device="cpu", device_name="test CPU", dtype="float32", op="x", impl="x",
                V=1024, d=64, N=256)
    rows = [dict(base, column=c, median_ms=ms, status="ok")
            for c, ms in (("naive", 100.0), ("single_pass", 50.0), ("two_pass", 80.0), ("auto", 52.0))]
    rows.append(dict(base, column="one_sweep", status="skipped", note="not for this objective"))
    loss_grid.write(rows, "t", tmp_path)
    assert (tmp_path / "loss_grid_t.png").stat().st_size > 0
    order = list(dict.fromkeys([*loss_grid.COLUMNS, *loss_grid.OBJECTIVE_COLUMNS]))
    assert drawn == [(c, f"C{order.index(c)}") for c in ("single_pass", "two_pass", "auto")]


def test_loss_grid_runs_the_cheapest_point_first_and_estimates_one_run_for_long_cases(monkeypatch):
    from benchmarks import loss_grid

    sizes = [case.v * case.d * case.n for _, case, _ in loss_grid.cases("cpu", "cpu", ["auto"])]
    assert sizes == sorted(sizes) and len(sizes) == 27
    # at 1 GFLOP/s every case takes minutes: run once (its warm-up timed), not warm-up + one timed run
    overhead = 27 * loss_grid.RUN_OVERHEAD_S
    once = loss_grid.estimate_seconds("cpu", "cpu", ["single_pass"], 1e9) - overhead
    monkeypatch.setitem(loss_grid.TIMING, "cpu", dict(loss_grid.TIMING["cpu"], long_run_s=float("inf")))
    twice = loss_grid.estimate_seconds("cpu", "cpu", ["single_pass"], 1e9) - overhead
    assert twice == pytest.approx(2 * once)


def test_a_long_warmup_is_timed_once_and_says_so():
    """measure.py's long_run_s: a first warm-up run over it is the timed run (CPU); below it, warm-up then timed."""
    from benchmarks.measure import measure_in_process

    case = Case("pacs_loss_fwd_bwd", "single_pass", 64, 32, 512, "float32", "cpu")
    counted = measure_in_process(case, warmup=1, repeats=3, max_seconds=0.0, long_run_s=0.0)
    assert counted["repeats"] == 1 and "warm-up run took over 0 s and was timed" in counted["note"]
    assert counted["median_ms"] > 0 and counted["peak_mem_mib"] >= 0
    usual = measure_in_process(case, warmup=1, repeats=2, long_run_s=1e9)
    assert usual["repeats"] == 2 and "note" not in usual


def test_loss_grid_resume_keeps_measured_cases_and_times_only_the_rest(tmp_path, monkeypatch):
    """--resume: the CSV's measured cases are kept with their date (other columns too), the rest are
    timed; a point whose ratio mixes runs is marked; a CSV of another device or objective is refused."""
    from benchmarks import loss_grid

    base = dict(date="2026-01-01 00:00 UTC", device="cpu", device_name="test CPU", objective="pacs",
                dtype="float32", op="x", impl="x", V=512, d=32, N=64)
    steady = dict(repeats=3, cpu_util=1.98, threads=2)  # no min_ms: runs not spread
    earlier = [dict(base, **steady, column="naive", median_ms=10.0, status="ok"),
               dict(base, **steady, column="single_pass", median_ms=5.0, status="ok"),
               dict(base, **dict(steady, cpu_util=1.2), column="two_pass", median_ms=8.0, status="ok"),  # busy
               dict(base, **dict(steady, min_ms=5.0), column="auto", median_ms=9.0, status="ok"),  # runs spread
               dict(base, column="one_sweep", status="timeout", note="over 900s"),
               dict(base, **steady, column="cce", median_ms=7.0, status="ok"),
               dict(base, column="liger_chunked", status="skipped", note="liger-kernel is not installed")]
    loss_grid.write(earlier, "dry", tmp_path)
    table = (tmp_path / "loss_grid_dry.md").read_text()
    assert "- two_pass at V=512 d=32 N=64: a busy machine (CPU use 1.20 of 2 threads)" in table
    assert "- auto at V=512 d=32 N=64: runs spread from 5 to a median of 9 ms" in table and "9 (0.90)†" in table
    timed = []
    monkeypatch.setattr(loss_grid, "measure_case", lambda case, **kw: timed.append(case.impl) or
                        dict(median_ms=10.5 if case.impl == "naive" else 6.0, min_ms=6.0, repeats=1, status="ok"))
    rows = loss_grid.run_grid("dry", "cpu", ["naive", "single_pass", "two_pass", "one_sweep", "auto"], tmp_path,
                              resume=True)
    # naive (the cheapest kept case, timed again: 10.5 ms against 10, the same machine), then two_pass and auto
    # (unsteady), one_sweep (timed out) again
    assert timed == ["naive", "torch", "torch", "auto"]
    by_column = {r["column"]: r for r in rows}
    # cce and liger_chunked: not in this run, kept as they were (the skipped one too)
    assert set(by_column) == {"naive", "single_pass", "two_pass", "one_sweep", "auto", "cce", "liger_chunked"}
    assert by_column["liger_chunked"]["status"] == "skipped" and "not installed" in by_column["liger_chunked"]["note"]
    assert by_column["naive"]["date"] == base["date"] and by_column["auto"]["date"] != base["date"]
    table = (tmp_path / "loss_grid_dry.md").read_text()
    assert "runs of 2026-01-01 00:00 UTC, " in table and "| 1.20* |" in table  # auto 6 over single_pass 5
    loss_grid.write([dict(r, device="cuda") for r in earlier], "dry", tmp_path)  # the same stem, other rows
    with pytest.raises(ValueError, match="--resume: .* holds pacs rows measured on cuda, not pacs on cpu"):
        loss_grid.run_grid("dry", "cpu", ["naive"], tmp_path, resume=True)
    loss_grid.write([dict(r, objective="dapo") for r in earlier], "dry", tmp_path)
    with pytest.raises(ValueError, match="holds dapo rows"):
        loss_grid.run_grid("dry", "cpu", ["naive"], tmp_path, resume=True)


def test_loss_grid_resume_stops_where_the_machine_changed_unless_told_to_go_on(tmp_path, monkeypatch):
    """--resume times the cheapest kept case again first: off by more than DRIFT (another host, a busy
    neighbour) the run stops before timing anything, naming the case and both times; --accept-drift goes on
    and the Markdown says so; with nothing left to time there is no check."""
    from benchmarks import loss_grid

    base = dict(date="2026-01-01 00:00 UTC", device="cpu", device_name="test CPU", objective="pacs",
                dtype="float32", op="x", impl="x", d=32, N=64, repeats=3, cpu_util=1.98, threads=2, status="ok")
    earlier = [dict(base, column="naive", V=1024, median_ms=20.0), dict(base, column="naive", V=512, median_ms=10.0)]
    loss_grid.write(earlier, "dry", tmp_path)
    timed = []
    monkeypatch.setattr(loss_grid, "measure_case", lambda case, **kw: timed.append((case.impl, case.v)) or
                        dict(median_ms=13.0, repeats=1, status="ok"))
    with pytest.raises(RuntimeError, match=r"naive at V=512 d=32 N=64 ran 13 ms against the kept 10 ms \(1.30x\)"):
        loss_grid.run_grid("dry", "cpu", ["naive", "auto"], tmp_path, resume=True)
    assert timed == [("naive", 512)]  # the cheapest kept case, and nothing else
    assert [r["column"] for r in loss_grid.earlier_rows(tmp_path / "loss_grid_dry.csv", "cpu", "pacs")] == \
        ["naive", "naive"]  # the CSV as it was
    timed.clear()
    rows = loss_grid.run_grid("dry", "cpu", ["naive", "auto"], tmp_path, resume=True, accept_drift=True)
    assert timed == [("naive", 512), ("auto", 512)]
    assert {r["column"] for r in rows} == {"naive", "auto"}
    assert re.search(r"--accept-drift: timed again before this run \(\d{4}-\d\d-\d\d \d\d:\d\d UTC\), naive at "
                     r"V=512 d=32 N=64 ran 13 ms against the kept 10 ms \(1\.30x\)\.",
                     (tmp_path / "loss_grid_dry.md").read_text())
    timed.clear()
    loss_grid.run_grid("dry", "cpu", ["naive", "auto"], tmp_path, resume=True)  # nothing left to time: no check
    assert timed == []
    # within DRIFT the run goes on, and the Markdown still gives the agreement its cross-run ratios rest on
    monkeypatch.setattr(loss_grid, "measure_case", lambda case, **kw: timed.append((case.impl, case.v)) or
                        dict(median_ms=11.0, repeats=1, status="ok"))
    loss_grid.run_grid("dry", "cpu", ["naive", "auto", "two_pass"], tmp_path, resume=True)
    assert timed == [("naive", 512), ("torch", 512)]  # the check, then two_pass (its impl: the torch two passes)
    assert "--resume: timed again before this run" in (tmp_path / "loss_grid_dry.md").read_text()
    assert "ran 11 ms against the kept 10 ms (1.10x)." in (tmp_path / "loss_grid_dry.md").read_text()
    with pytest.raises(SystemExit):
        loss_grid.parse_args(["--accept-drift"])


def test_auto_is_a_loss_path_only():
    assert impl_unavailable_reason("pacs_loss_fwd_bwd", "auto", "cpu") is None
    assert "path of the fused losses" in impl_unavailable_reason("logprobs_fwd_bwd", "auto", "cpu")


# --- the GRPO-family objectives: the objective op, the grid's --objective, the GPU check's dry run -------------

OBJECTIVE_NAMES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")


@pytest.mark.parametrize("objective", OBJECTIVE_NAMES)
def test_objective_op_gives_naives_loss_and_gradients_on_every_impl(objective):
    """ops.py's objective op, float32, tiny: our fused impls and every importable peer (CCE + the objective,
    Liger's chunked log-probs + the objective, Liger's fused GRPO loss with grpo_family's mapping) give the loss
    and the gradients of naive (materialized logits + the objective)."""
    results = {}
    for impl in ("naive", "single_pass", "torch", "auto", "cce", "liger_chunked", "liger_fused"):
        case = Case("objective_loss_fwd_bwd", impl, 64, 8, 32, "float32", "cpu", objective=objective)
        if impl_unavailable_reason(case.op, impl, "cpu", objective):
            continue
        inputs = make_inputs(case, 7)
        loss = runner(case)(inputs)
        results[impl] = (loss.double(), inputs["hidden"].grad.double(), inputs["weight"].grad.double())
    assert {"naive", "single_pass", "torch", "auto"} <= set(results)
    want_loss, want_hidden, want_weight = results.pop("naive")
    assert want_loss.abs() > 1e-4 and want_weight.abs().max() > 1e-4
    for impl, (loss, d_hidden, d_weight) in results.items():
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7, msg=lambda m: f"{impl}: {m}")
        torch.testing.assert_close(d_hidden, want_hidden, rtol=1e-4, atol=1e-7, msg=lambda m: f"{impl}: {m}")
        torch.testing.assert_close(d_weight, want_weight, rtol=1e-4, atol=1e-7, msg=lambda m: f"{impl}: {m}")


def test_objective_op_needs_an_objective_and_liger_fused_is_for_objectives_only():
    assert "needs an objective" in impl_unavailable_reason("objective_loss_fwd_bwd", "naive", "cpu")
    assert "needs an objective" in impl_unavailable_reason("objective_loss_fwd_bwd", "naive", "cpu", "pacs")
    assert "couples a group" in impl_unavailable_reason("pacs_loss_fwd_bwd", "liger_fused", "cpu")


def test_liger_settings_map_each_objective_to_its_loss_type():
    from benchmarks import grpo_family

    settings = {name: grpo_family.liger_settings(name, grpo_family.make_objective(name, 100))
                for name in grpo_family.OBJECTIVES}
    assert settings["grpo"] == dict(loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2)
    assert settings["dapo"] == dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28)
    assert settings["dr_grpo"]["max_completion_length"] == 100 and settings["dr_grpo"]["loss_type"] == "dr_grpo"
    assert settings["gspo"]["importance_sampling_level"] == "sequence" and settings["gspo"]["loss_type"] == "grpo"
    assert settings["cispo"]["epsilon_high"] == pytest.approx(1.28)  # Liger's bound is the weight itself
    with pytest.raises(ValueError, match="objective must be one of"):
        grpo_family.make_objective("ppo", 10)


def test_loss_grid_objective_dry_run_names_its_files_and_skips_one_sweep(tmp_path):
    """--objective dapo end to end at the dry point: loss_grid_dry_dapo.*, one_sweep skipped as PACS's own."""
    from benchmarks import loss_grid

    assert loss_grid.main(["--grid", "dry", "--objective", "dapo", "--columns", "naive", "single_pass", "one_sweep",
                           "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "loss_grid_dry.csv").exists()
    with open(tmp_path / "loss_grid_dry_dapo.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["column"], r["op"], r["objective"], r["status"]) for r in rows] == [
        ("naive", "objective_loss_fwd_bwd", "dapo", "ok"), ("single_pass", "objective_loss_fwd_bwd", "dapo", "ok"),
        ("one_sweep", "pacs_loss_first_step", "dapo", "skipped")]
    assert "PACS's own" in rows[2]["note"] and float(rows[1]["median_ms"]) > 0
    table = (tmp_path / "loss_grid_dry_dapo.md").read_text()
    assert table.startswith("## dapo loss grid `dry`") and "DAPO at its defaults" in table
    assert "loss_type='dapo'" in table and (tmp_path / "loss_grid_dry_dapo.png").stat().st_size > 5000


def test_loss_grid_columns_per_objective_and_the_time_budget(tmp_path):
    """Which column times what for PACS and for an objective; a spent time budget starts no case."""
    from benchmarks import loss_grid

    assert loss_grid.default_columns("pacs") == list(loss_grid.COLUMNS)
    assert loss_grid.default_columns("gspo") == ["naive", "single_pass", "two_pass", "one_sweep", "auto", "cce",
                                                 "liger_fused", "naive_gemms"]
    case, reason = loss_grid.column_case("two_pass", "cispo", (512, 32, 64), "bfloat16", "cuda")
    assert (case.op, case.impl, case.objective, reason) == ("objective_loss_fwd_bwd", "triton", "cispo", None)
    assert "PACS" in loss_grid.column_case("liger_fused", "pacs", (512, 32, 64), "float32", "cpu")[1]
    assert "liger_fused" in loss_grid.column_case("liger_chunked", "dapo", (512, 32, 64), "float32", "cpu")[1]
    rows = loss_grid.run_grid("dry", "cpu", ["naive", "one_sweep"], tmp_path, objective="grpo", time_budget=0.0)
    assert [(r["column"], r["status"]) for r in rows] == [("naive", "budget"), ("one_sweep", "skipped")]
    assert (tmp_path / "loss_grid_dry_grpo.md").exists()
    assert loss_grid.estimate_seconds("cpu-quick", "cpu", loss_grid.default_columns("dapo"), 150e9, "dapo") > 60


def test_gpu_correctness_dry_run_checks_every_objective_on_both_paths_and_packed(capsys):
    """benchmarks/check_gpu_correctness.py --device cpu --small (Triton interpreter), its bf16 case: the kernels,
    the fused PACS loss and each GRPO-family objective (single pass, two passes, packed) within tolerance."""
    from benchmarks import check_gpu_correctness

    argv = ["--device", "cpu", "--small", "--cases", "small-bf16", "--peers", "without"]
    assert check_gpu_correctness.main(argv) == 0
    out = capsys.readouterr().out
    assert "[check] small-bf16" in out and ": ok (" in out and "all cases within tolerance" in out
    for name in OBJECTIVE_NAMES:
        for label in ("single_pass", "two_pass", "packed"):
            assert f"{name}_{label}_dh " in out and f"{name}_{label}_dW " in out


def test_gpu_correctness_check_of_the_objectives_fails_a_wrong_loss(monkeypatch):
    """The objective check flags a fused loss 1% off (its gradients; the loss error is relative to
    max(1, |loss|), as PACS's), and its off-policy old log-probs keep every log-ratio off the clip boundaries
    while clipping some tokens."""
    import math
    from types import SimpleNamespace

    import pacs_kernels
    from benchmarks import check_gpu_correctness, grpo_family

    monkeypatch.setattr(grpo_family, "OBJECTIVES", ("dapo", "gspo"))

    def one_percent_off(*args, **kwargs):
        loss, stats = pacs_kernels.fused_linear_objective_loss(*args, **kwargs)
        return loss * 1.01, stats

    wrong = SimpleNamespace(fused_linear_objective_loss=one_percent_off, LossOptions=pacs_kernels.LossOptions)
    gen = torch.Generator().manual_seed(3)
    hidden, weight, targets = torch.randn(48, 8), torch.randn(40, 8), torch.randint(0, 40, (48,))
    errors = check_gpu_correctness.check_objectives(wrong, hidden, weight, targets, 1.0, gen, 512, 2e-4, 2e-4)
    assert len(errors) == 2 * 3 * 3
    assert all(err > tol for key, (err, tol) in errors.items() if key.endswith(("_dh", "_dW")))

    logp = -torch.rand(16, 40) * 3
    mask = torch.ones(16, 40, dtype=torch.bool)
    r = logp - check_gpu_correctness.off_policy_old_logp(pacs_kernels.DAPO(), logp, mask, gen)
    for bound in (math.log(0.8), math.log(1.28)):
        assert (r - bound).abs().min() >= check_gpu_correctness.CLIP_MARGIN - 1e-6
        assert ((r > bound).float().mean() - 0.5).abs() < 0.45  # both sides of every boundary are hit
    r = logp - check_gpu_correctness.off_policy_old_logp(pacs_kernels.GSPO(), logp, mask, gen)
    torch.testing.assert_close(r.mean(-1), torch.tensor(check_gpu_correctness.GSPO_LOG_RATIOS * 2), atol=1e-6,
                               rtol=0)


def test_measure_pair_alternates_two_cases_on_the_same_inputs_in_a_worker():
    """measure.measure_pair: one worker, the two cases in alternation, the ratio the median of per-round ratios;
    max_seconds stops after the first round; a failing case comes back as a status."""
    from benchmarks.measure import measure_pair, measure_pair_in_process

    auto = Case("pacs_loss_fwd_bwd", "auto", 64, 32, 512, "float32", "cpu")
    single = Case("pacs_loss_fwd_bwd", "single_pass", 64, 32, 512, "float32", "cpu")
    pair = measure_pair(auto, single, rounds=3, timeout_s=300.0)
    assert pair["status"] == "ok" and pair["rounds"] == 3 and len(pair["first_ms"]) == len(pair["second_ms"]) == 3
    ratios = sorted(a / b for a, b in zip(pair["first_ms"], pair["second_ms"]))
    assert pair["ratio"] == pytest.approx(ratios[1]) and pair["cpu_util"] > 0
    assert (pair["ratio_min"], pair["ratio_max"]) == (pytest.approx(ratios[0]), pytest.approx(ratios[2]))
    assert measure_pair_in_process(auto, single, rounds=3, max_seconds=0.0)["rounds"] == 1
    assert measure_pair_in_process(auto, single, rounds=5, max_seconds=0.0, min_rounds=2)["rounds"] == 2
    bad = Case("pacs_loss_fwd_bwd", "single_pass", 63, 32, 512, "float32", "cpu")  # N not a multiple of 16
    failed = measure_pair(auto, bad, rounds=1, timeout_s=300.0)
    assert failed["status"] == "error" and "multiple of 16" in failed["note"]


def test_alternate_flips_the_order_each_round_and_gives_each_run_its_own_inputs():
    """measure.alternate: the first run first in even rounds and second in odd ones, each on the inputs made
    for its (round, side); one ratio per round; max_seconds stops after min_rounds."""
    from benchmarks.measure import alternate

    calls, made = [], []

    def make(i, which):
        made.append((i, which))
        return {"round": i, "side": which}

    def side(name):
        def run(inputs):
            calls.append((name, inputs["round"], inputs["side"]))
        return run

    result = alternate((side("a"), side("b")), make, rounds=3, device="cpu")
    assert calls == [("a", 0, 0), ("b", 0, 1), ("b", 1, 1), ("a", 1, 0), ("a", 2, 0), ("b", 2, 1)]
    assert made == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
    assert result["rounds"] == 3 and len(result["first_ms"]) == len(result["second_ms"]) == 3
    assert result["ratio_min"] <= result["ratio"] <= result["ratio_max"] and "cpu_util" in result
    calls.clear()
    assert alternate((side("a"), side("b")), make, rounds=9, device="cpu", max_seconds=0.0, min_rounds=2)[
        "rounds"] == 2 and len(calls) == 4


def test_loss_grid_paired_times_auto_against_our_faster_path_and_keeps_what_it_paired(tmp_path, monkeypatch):
    from benchmarks import loss_grid

    with pytest.raises(FileNotFoundError, match="--paired: no grid results"):
        loss_grid.run_paired("dry", "cpu", tmp_path)
    base = dict(date="2026-01-01 00:00 UTC", device="cpu", device_name="test CPU", objective="pacs",
                dtype="float32", op="x", impl="x", V=512, d=32, N=64, repeats=3, cpu_util=1.98, threads=2)
    loss_grid.write([dict(base, column="naive", median_ms=10.0, status="ok"),
                     dict(base, column="single_pass", median_ms=6.0, status="ok"),
                     dict(base, column="two_pass", median_ms=5.0, status="ok"),
                     dict(base, column="auto", median_ms=5.5, status="ok")], "dry", tmp_path)
    pairs = []
    monkeypatch.setattr(loss_grid, "measure_pair", lambda first, second, **kw: pairs.append(
        (first.impl, second.impl, kw["rounds"], kw["min_rounds"])) or dict(
        first_ms=[5.0, 5.2, 5.1], second_ms=[5.0, 5.0, 5.0], ratio=1.02, ratio_min=1.0, ratio_max=1.04, rounds=3,
        status="ok", threads=2, cpu_util=1.9, loadavg=2.0))
    done = loss_grid.run_paired("dry", "cpu", tmp_path)
    # two_pass (torch on the CPU) measured faster than single_pass; 3 to 9 rounds
    assert pairs == [("auto", "torch", loss_grid.PAIRED_ROUNDS, loss_grid.PAIRED_MIN_ROUNDS)]
    assert "| 1.020 | 1.00-1.04 | 3 | ok |" in (tmp_path / "loss_grid_dry_paired.md").read_text()
    assert done[0]["against"] == "two_pass" and done[0]["auto_ms"] == pytest.approx(5.1)
    table = (tmp_path / "loss_grid_dry.md").read_text()
    assert "| auto / fastest | paired |" in table and "| 1.10 | 1.02 |" in table
    assert "paired: median 1.02, worst 1.02, within 1.05 at 1 of 1 points" in table
    assert "within 1.05 at 0 of 1 points" in table  # the separate runs: 5.5 / 5.0
    assert loss_grid.run_paired("dry", "cpu", tmp_path) and len(pairs) == 1  # kept, not timed again
    assert loss_grid.main(["--grid", "dry", "--paired", "--out", str(tmp_path)]) == 0 and len(pairs) == 1
    # against a column the grid measured (naive), kept apart from the ours pair; one it did not (cce): nothing
    assert loss_grid.main(["--grid", "dry", "--paired", "--against", "naive", "cce", "--out", str(tmp_path)]) == 0
    assert pairs[1:] == [("auto", "naive", loss_grid.PAIRED_ROUNDS, loss_grid.PAIRED_MIN_ROUNDS)]
    table = (tmp_path / "loss_grid_dry.md").read_text()
    assert "| 1.10 | 1.02 |" in table  # the paired column stays auto against ours
    assert "auto / naive, paired: median 1.02, worst 1.02, best 1.02 at 1 points" in table
    from benchmarks.report import read_csv

    assert [r["against"] for r in read_csv(tmp_path / "loss_grid_dry_paired.csv")] == ["two_pass", "naive"]


def test_loss_grid_paired_again_replaces_a_pair_only_when_timed_anew_and_keeps_its_old_ratio(tmp_path, monkeypatch):
    from benchmarks import loss_grid
    from benchmarks.report import read_csv

    base = dict(date="2026-01-01 00:00 UTC", device="cpu", device_name="test CPU", objective="pacs",
                dtype="float32", op="x", impl="x", V=512, d=32, N=64, repeats=3, cpu_util=1.98, threads=2)
    loss_grid.write([dict(base, column="single_pass", median_ms=5.0, status="ok"),
                     dict(base, column="auto", median_ms=5.5, status="ok")], "dry", tmp_path)
    calls, results = [], [dict(first_ms=[5.4] * 3, second_ms=[5.0] * 3, ratio=1.08, ratio_min=1.06, ratio_max=1.1,
                               rounds=3, status="ok", threads=2, cpu_util=1.9, loadavg=2.0),
                          dict(status="timeout", note="over 3600s"),
                          dict(first_ms=[5.0] * 9, second_ms=[5.0] * 9, ratio=0.99, ratio_min=0.97, ratio_max=1.02,
                               rounds=9, status="ok", threads=2, cpu_util=1.9, loadavg=2.0)]
    monkeypatch.setattr(loss_grid, "measure_pair", lambda first, second, **kw: calls.append(kw["max_seconds"])
                        or results[len(calls) - 1])
    loss_grid.run_paired("dry", "cpu", tmp_path)
    assert calls == [loss_grid.PAIRED_SECONDS["cpu"]]
    # timed again but it failed: the old pair stays, untouched
    assert loss_grid.main(["--grid", "dry", "--paired", "--again", "512,32,64", "--paired-seconds", "300",
                           "--out", str(tmp_path)]) == 1
    assert calls[1] == 300.0
    assert [(r["ratio"], r["note"]) for r in read_csv(tmp_path / "loss_grid_dry_paired.csv")] == [("1.08", "")]
    # timed again and measured: the new pair replaces the old, and its note keeps the old ratio
    assert loss_grid.main(["--grid", "dry", "--paired", "--again", "512,32,64", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "loss_grid_dry_paired.csv")
    assert len(rows) == 1 and rows[0]["ratio"] == "0.99" and rows[0]["rounds"] == "9"
    assert re.fullmatch(r"timed again \(\d{4}-\d\d-\d\d \d\d:\d\d UTC: 1\.08, 1\.06-1\.10, 3 rounds\)", rows[0]["note"])
    assert "| 1.10 | 0.99 |" in (tmp_path / "loss_grid_dry.md").read_text()
    for bad in (["--again", "512,32"], ["--again", "a,b,c"], ["--paired-seconds", "-1"], ["--paired-seconds", "nan"]):
        with pytest.raises(SystemExit):
            loss_grid.main(["--grid", "dry", "--paired", *bad, "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # --again without --paired
        loss_grid.main(["--grid", "dry", "--again", "512,32,64", "--out", str(tmp_path)])


def test_gemm_rows_times_the_three_lm_head_gemms_per_row_count_and_refuses_bad_sizes(tmp_path):
    from benchmarks import gemm_rows
    from benchmarks.report import read_csv

    assert gemm_rows.main(["--vocab", "67", "--d", "9", "--rows", "8", "3", "8", "--repeats", "1",
                           "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "gemm_rows_cpu.csv")
    assert [r["rows"] for r in rows] == ["3", "8"] and all(r["V"] == "67" and r["d"] == "9" for r in rows)
    assert all(float(r[f"{g}_gflops"]) > 0 for r in rows for g in gemm_rows.GEMMS) and rows[0]["date"]
    table = (tmp_path / "gemm_rows_cpu.md").read_text()
    assert "V=67, d=9, float32" in table and "| 3 |" in table and "| 8 |" in table
    assert " 1.00 |" in table  # the fastest row count, over itself
    for bad in (["--rows", "0"], ["--vocab", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            gemm_rows.main([*bad, "--out", str(tmp_path)])
