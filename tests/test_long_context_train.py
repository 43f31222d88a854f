"""benchmarks/long_context_train.py: every variant's step computes the same training step (the
naive logits loss and the fused loss agree; packing, the levers and running the group in parts
change memory, not the result), and the search brackets the edge. Plumbing only: no memory or speed is asserted."""

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
