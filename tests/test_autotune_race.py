"""The autotuner's race, which only a GPU runs, run here: two candidates per kernel, in the interpreter.

On CUDA every Triton kernel is wrapped in ``triton.autotune`` over several candidates, and the first call
at a new (d, V, dtype) launches each candidate under the autotuner's hooks before the winner computes the
result. Under ``TRITON_INTERPRET=1`` each kernel has one candidate, so none of that runs in the other
tests: a hook that fails on an absent output (Triton 3.6's ``restore_value`` on a head without bias) or a
candidate that changes the result would first show on the GPU. Here each kernel gets two interpreter-sized
candidates and a stand-in timer (it launches the candidate, as Triton's benchmark does, and makes the
second one win, so the result is computed by a candidate other than the first); the operations must
still equal float64 references. What this covers: the hooks and launches of the race itself (an absent
output, a candidate's launch failing) and the winner's result. Not whether the hooks put the outputs back:
the race always runs on a first dz chunk, which the winner's launch overwrites (the hooks' restoring is
tested on its own in tests/test_triton_backward.py). ``scripts/check_gpu_stack.sh`` runs this file with
the GPU's Triton too.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton

from pacs_kernels import LossOptions, fused_linear_pacs_loss, linear_logprobs
from pacs_kernels.reference import naive_linear_logprobs
from pacs_kernels.triton import grad_matmuls, launch_config

# the modules (the package re-exports functions of the same names)
forward_module = importlib.import_module("pacs_kernels.triton.logprob_forward")
backward_module = importlib.import_module("pacs_kernels.triton.logprob_backward")

pytestmark = pytest.mark.skipif(not launch_config.INTERPRETED, reason="the interpreter's race (conftest sets it)")

TWO_CANDIDATES = {  # interpreter-sized; each second candidate divides the dz tile (16 x 32) and SPLIT_ALIGN
    forward_module._logprob_forward_kernel: [{"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_D": 16},
                                             {"BLOCK_N": 32, "BLOCK_V": 64, "BLOCK_D": 32}],
    backward_module._dz_kernel: [{"BLOCK_D": 16}, {"BLOCK_D": 32}],
    grad_matmuls.dh_kernel: [{"BLOCK_M": 16, "BLOCK_D": 16, "BLOCK_K": 16},
                             {"BLOCK_M": 16, "BLOCK_D": 32, "BLOCK_K": 16}],
    grad_matmuls.dw_kernel: [{"BLOCK_M": 16, "BLOCK_D": 16, "BLOCK_K": 16},
                             {"BLOCK_M": 32, "BLOCK_D": 32, "BLOCK_K": 16}],
}


@pytest.fixture
def racing_kernels(monkeypatch):
    """Every autotuned kernel with two candidates, an empty cache and a timer that runs the candidate;
    yields {kernel: [launches timed]} to check that the race ran."""
    timed = {}
    for kernel, tiles in TWO_CANDIDATES.items():
        configs = [triton.Config(dict(tile), num_warps=4, num_stages=1) for tile in tiles]
        monkeypatch.setattr(kernel, "configs", configs)
        monkeypatch.setattr(kernel, "cache", {})
        timed[kernel] = []

        def time_candidate(kernel_call, quantiles=None, launches=timed[kernel]):
            kernel_call()  # the candidate's launch, between the autotuner's pre- and post-hooks
            launches.append(1)
            ms = 2.0 if len(launches) % 2 else 1.0  # the second candidate of each race wins
            return [ms, ms, ms] if quantiles is not None else ms

        # do_bench is a cached_property over _do_bench (both Triton versions): the cached value is the timer
        kernel.__dict__["do_bench"] = time_candidate
    yield timed
    for kernel in TWO_CANDIDATES:
        kernel.__dict__.pop("do_bench", None)  # the real timer again, should a later call race
    for kernel, tiles in TWO_CANDIDATES.items():
        for winner in kernel.cache.values():
            assert winner.kwargs == tiles[1], f"{kernel.base_fn.__name__}: the second candidate must win the race"


def _leaves(n, d, vocab, dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen) / d**0.5 * 2).to(dtype).requires_grad_()
    bias = (torch.randn(vocab, generator=gen) * 0.5).to(dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    return hidden, weight, bias, targets


# (n, d, V): ragged tiles everywhere; and gpu.sh's trainer smoke run (the built-in model: d = 64, V = 17,
# a vocabulary smaller than any tile)
SHAPES = [(70, 40, 150), (37, 64, 17)]


@pytest.mark.parametrize("n,d,vocab", SHAPES)
@pytest.mark.parametrize("dtype,with_bias", [(torch.bfloat16, False), (torch.float32, True), (torch.float32, False)])
def test_log_probs_and_gradients_after_a_race(racing_kernels, dtype, with_bias, n, d, vocab):
    """linear_logprobs on Triton, forward and backward (entropy too), bias or none."""
    hidden, weight, bias, targets = _leaves(n, d, vocab, dtype, with_bias, seed=3)
    gen = torch.Generator().manual_seed(4)
    g_logp, g_entropy = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    logp, entropy = linear_logprobs(hidden, weight, targets, temperature=0.8, bias=bias, return_entropy=True,
                                    backend="triton")
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    reference = [t.detach().double().requires_grad_() for t in leaves]
    r_logp, r_entropy = naive_linear_logprobs(reference[0], reference[1], targets, temperature=0.8,
                                              bias=reference[2] if with_bias else None)
    ((r_logp * g_logp.double()).sum() + (r_entropy * g_entropy.double()).sum()).backward()
    tol = 5e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(logp.double(), r_logp.detach(), rtol=0, atol=tol * (1 + r_logp.abs().max().item()))
    torch.testing.assert_close(entropy.double(), r_entropy.detach(), rtol=0, atol=tol * (1 + r_entropy.max().item()))
    for name, got, ref in zip(("hidden", "weight", "bias"), leaves, reference):
        scale = ref.grad.abs().max().item()
        assert (got.grad.double() - ref.grad).abs().max().item() <= tol * scale, name
    for kernel, launches in racing_kernels.items():
        assert launches, f"{kernel.base_fn.__name__} was never raced"


@pytest.mark.parametrize("d,vocab", [(24, 100), (64, 17)])
@pytest.mark.parametrize("path", ["two_pass", "single_pass", "one_sweep"])
def test_the_pacs_loss_on_triton_after_a_race(racing_kernels, path, d, vocab):
    """The fused PACS loss's Triton paths (two passes; the single pass with the Triton row kernels; the one
    sweep of the first step) equal naive."""
    from pacs_kernels import pacs_loss

    first_step = path == "one_sweep"
    B, T, G = 4, 9, 2
    hidden, weight, _, targets = _leaves(B * T, d, vocab, torch.float32, False, seed=7)
    hidden = hidden.detach().view(B, T, d).requires_grad_()
    targets = targets.view(B, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T
        old_logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].float()
        old_lse = torch.logsumexp(logits, -1).float()
        if not first_step:
            old_logp = old_logp + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(8))
    if first_step:
        loss, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old_logp, rewards, old_lse=old_lse,
                                             group_size=G, options=LossOptions(backend="triton"),
                                             return_stats=True)
    else:
        loss, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old_logp, rewards, group_size=G,
                                             options=LossOptions(backend="triton", path=path), return_stats=True)
    assert stats.path == path
    loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp64 = torch.log_softmax(h64 @ w64.T, -1).gather(-1, targets[..., None])[..., 0]
    ref = pacs_loss(logp64, old_logp.double(), rewards.double(), mask, group_size=G)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    if path != "single_pass":  # (the single pass's row kernels have one fixed tile and its GEMMs are torch's)
        assert racing_kernels[grad_matmuls.dw_kernel], "the dW kernel was never raced"
