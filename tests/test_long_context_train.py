"""benchmarks/long_context_train.py: every variant's step computes the same training step (the
naive logits loss and the fused loss agree; packing, the levers and running the group in parts
change memory, not the result), and the search brackets the edge. Plumbing only: no memory or speed is asserted."""

import csv

import pytest
import torch

from benchmarks import long_context_train as bench
from benchmarks.long_context import doubling_bisection

CPU_VARIANTS = [v for v in bench.VARIANTS if bench.applicable(v, "cpu") is None]


def test_cpu_variants_are_the_seven_that_apply():
    assert CPU_VARIANTS == ["padded_naive", "padded_fused", "packed_fused", "packed_fused_ckpt",
                            "packed_fused_ckpt_tiled", "packed_fused_ckpt_split", "packed_fused_ckpt_split_tiled"]
    assert "CUDA only" in bench.applicable("packed_fused_ckpt_offload", "cpu")


def test_every_variant_takes_the_same_step():
    """Same random model and batch: the loss, and the weights after the AdamW step, agree across
    the naive padded step and the fused/packed/checkpointed/tiled ones."""
    losses, weights = {}, {}
    device = torch.device("cpu")
    for variant in CPU_VARIANTS:
        policy, optimizer = bench.build("tiny", bench.VARIANTS[variant], device, torch.float32)
        torch.manual_seed(3)
        batch = bench.make_batch(24, 5, bench.MODELS["tiny"]["vocab_size"], seed=4, device=device)
        assert batch.attention_mask.sum(1).tolist() == [5 + n for n in bench.response_lengths(24)]
        losses[variant] = bench.train_step(policy, optimizer, batch, bench.VARIANTS[variant], device)
        weights[variant] = {k: p.detach().clone() for k, p in policy.named_parameters()}
    reference = weights["padded_naive"]
    start, _ = bench.build("tiny", (), device, torch.float32)
    assert any((p.detach() - reference[k]).abs().max() > 1e-7 for k, p in start.named_parameters())  # it moved
    for variant in CPU_VARIANTS[1:]:
        assert losses[variant] == pytest.approx(losses["padded_naive"], rel=1e-5, abs=1e-6), variant
        for name, value in weights[variant].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-6, msg=f"{variant}: {name}")


@pytest.mark.parametrize("edge", [20, 100, 700])
def test_search_brackets_the_edge(edge):
    tried = []

    def fits(n):
        tried.append(n)
        return n <= edge

    lo, hi = doubling_bisection(fits, 16, 4096, 4)
    assert lo <= edge < hi and hi - lo <= max(4, lo // 8)
    assert all(n % 4 == 0 for n in tried)


def test_dry_run_arguments():
    args = bench.parse_args(["--dry-run"])
    assert args.model == "tiny" and args.device == "cpu" and args.budget_mib == [4.0]
    args = bench.parse_args(["--device", "cuda", "--budget-gib", "24", "80"])
    assert args.model == "qwen2.5-1.5b" and args.budget_mib == [24 * 1024.0, 80 * 1024.0]
    assert args.dtype == "bfloat16"
    assert args.variants[0] == "padded_naive" and set(args.variants) <= set(bench.VARIANTS)
    assert args.variants[-1].endswith("_liger")  # last: its RoPE patch leaks into later variants


def test_tiled_mlp_cost_dry_run_writes_every_case(tmp_path):
    from benchmarks import tiled_mlp_cost

    assert tiled_mlp_cost.main(["--dry-run", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "tiled_mlp_cost_dry.md").read_text()
    for case in tiled_mlp_cost.CASES:
        assert f"| {case} | " in text
    assert text.count("x |") == 2  # each tiled case against its untiled twin
    assert "of the largest gradient (tolerance 1e-04): ok." in text  # the tiled step's gradients checked first
    with open(tmp_path / "tiled_mlp_cost_dry.csv") as handle:
        assert all(float(row["median_step_s"]) > 0 for row in csv.DictReader(handle))


def test_tiled_mlp_cost_keeps_going_past_a_failure(tmp_path, monkeypatch):
    """A gradient check that cannot run, or one case failing, is written down (exit 1) while the other
    cases are still timed."""
    from benchmarks import tiled_mlp_cost

    def broken_check(*args):
        raise RuntimeError("kernel launch failed")

    real_time = tiled_mlp_cost.time_steps

    def time_or_fail(policy, optimizer, levers, *args):
        if levers == tiled_mlp_cost.CASES["packed_fused"]:
            raise ValueError("this lever broke")
        return real_time(policy, optimizer, levers, *args)

    monkeypatch.setattr(tiled_mlp_cost, "gradient_error", broken_check)
    monkeypatch.setattr(tiled_mlp_cost, "time_steps", time_or_fail)
    assert tiled_mlp_cost.main(["--dry-run", "--out", str(tmp_path)]) == 1
    text = (tmp_path / "tiled_mlp_cost_dry.md").read_text()
    assert "The gradient check could not run: failed: RuntimeError: kernel launch failed: FAIL." in text
    assert "| packed_fused | failed: ValueError: this lever broke |" in text
    assert text.count("x |") == 1  # the pair whose both halves ran


def test_time_shares_keep_a_slow_variant_from_starving_the_rest(tmp_path, monkeypatch):
    """--time-budget is shared equally among the searches still to run: a variant whose trials are
    slow is cut at its share (and says so), and every later variant still gets its own."""
    fake_trials(monkeypatch, lambda variant: 6.0 if variant == "padded_naive" else 1.0,
                lambda variant, longest: longest <= 64)
    assert bench.main(["--dry-run", "--variants", "padded_naive", "packed_fused", "packed_fused_ckpt",
                       "--time-budget", "30", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "long_context_train_dry.md").read_text()
    assert "| padded_naive | >= 32 (time share spent before the edge) |" in text  # 2 trials in its 10 s
    assert "| packed_fused | 64 | 72 |" in text and "| packed_fused_ckpt | 64 | 72 |" in text


def test_time_shares_label_only_searches_that_were_really_cut(tmp_path, monkeypatch):
    """A variant whose first trial does not fit reports that (no crash when its share is spent), and
    one that reached --l-max is not labelled cut even when its last trial ran past its share."""
    # padded_naive: nothing fits, 20 s a trial; the others: everything fits, 2.2 s a trial
    fake_trials(monkeypatch, lambda variant: 20.0 if variant == "padded_naive" else 2.2,
                lambda variant, longest: variant != "padded_naive")
    # l_start 16 .. l_max 256: 5 trials of 2.2 s for a variant that fits everything, the last past its 10 s share
    assert bench.main(["--dry-run", "--variants", "padded_naive", "packed_fused", "--time-budget", "30",
                       "--out", str(tmp_path)]) == 0
    text = (tmp_path / "long_context_train_dry.md").read_text()
    assert "| padded_naive | none tried fits | 16 |" in text
    assert "| packed_fused | >= 256 |  |" in text


def test_a_variant_that_fails_ends_its_search_not_the_sweep(tmp_path, monkeypatch):
    """An error other than out-of-memory inside a trial (a lever broken on this machine) is that variant's
    row; the variants after it are still searched and the report is written."""
    fake_trials(monkeypatch, lambda variant: 1.0, lambda variant, longest: longest <= 64)
    real_runner = bench.VariantRunner

    class Breaks(real_runner):
        def trial(self, longest, budget_mib):
            if self.variant == "packed_fused" and longest > 32:
                raise RuntimeError("pinned host memory could not be allocated\nmore detail")
            return super().trial(longest, budget_mib)

    monkeypatch.setattr(bench, "VariantRunner", Breaks)
    assert bench.main(["--dry-run", "--variants", "padded_naive", "packed_fused", "packed_fused_ckpt",
                       "--out", str(tmp_path)]) == 1  # every variant searched; the failure in the exit code
    text = (tmp_path / "long_context_train_dry.md").read_text()
    assert "| packed_fused | >= 32 (failed: RuntimeError: pinned host memory could not be allocated) |" in text
    assert "| padded_naive | 64 | 72 |" in text and "| packed_fused_ckpt | 64 | 72 |" in text


def fake_trials(monkeypatch, seconds, fits):
    """Trials that take ``seconds(variant)`` of a fake clock and fit when ``fits(variant, longest)``."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    class Runner:
        def __init__(self, model, variant, *args):
            self.variant = variant

        def trial(self, longest, budget_mib):
            clock[0] += seconds(self.variant)
            return {"fits": fits(self.variant, longest), "footprint_mib": 1.0, "seconds": 0.0}

        def close(self):
            pass

    monkeypatch.setattr(bench, "VariantRunner", Runner)
    monkeypatch.setattr(bench, "plot", lambda *args: None)
