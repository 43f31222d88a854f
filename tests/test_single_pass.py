"""The single-pass (group-chunked) fused losses against float64 references, and the paths' choice.

Every PACS variant, padded and packed, chunk budgets that cut the batch into one group per chunk,
groups too large for the budget (logits kept in part and rebuilt; two passes on Triton), on-policy (old_logp=None), the
validity mask, entropy stats, bf16, autocast, a second backward, and GRPO's token-chunked pass.
"""

import itertools
import math

import pytest
import torch
from test_fused_loss import grads_of, make_batch, naive_loss

from pacs_kernels import (
    GRPO,
    PACS,
    LossOptions,
    fused_linear_grpo_loss,
    fused_linear_pacs_loss,
    grpo_loss,
    linear_logprobs,
)
from pacs_kernels.engine.plan import (
    Chunk,
    default_chunk_budget_mib,
    plan_group_chunks,
    plan_tiles,
    plan_token_chunks,
    recomputed_fraction,
)
from pacs_kernels.engine.single_pass import TINY_GRAD
from pacs_kernels.reference import naive_linear_logprobs, reference_grpo_loss, reference_pacs_loss

SCORES = ("log_ratio", "mean_logp")
ADVANTAGES = ("rloo", "grpo", "naive")
WEIGHTINGS = ("balanced", "none", "positive_only", "negative_only")


def tokens_mib(tokens: int, dtype=torch.float32):
    """A chunk budget of ``tokens`` tokens at V = 50 logits of the compute dtype."""
    return tokens * 50 * (8 if dtype == torch.float64 else 4) / 2 ** 20


def one_group_mib(dtype=torch.float32):
    """A chunk budget of 30 tokens (one group of make_batch's)."""
    return tokens_mib(30, dtype)


def to_packed(hidden, targets, mask, old):
    """Padded (B, T, ...) -> packed rows holding each response's first `mask.sum + start` tokens."""
    b = hidden.shape[0]
    lengths = mask.sum(1) + mask.int().argmax(1)
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    return [torch.cat([t[i, :lengths[i]] for i in range(b)]) for t in (hidden, targets, mask, old)], cu


def test_plan_group_chunks():
    counts = [3, 4, 5, 1, 2, 2, 9, 0]  # groups of 2: 7, 6, 4, 9 tokens
    assert plan_group_chunks(counts, 2, 13) == [Chunk(0, 4, 0, 13), Chunk(4, 8, 13, 26)]
    assert plan_group_chunks(counts, 2, 12) == [Chunk(0, 2, 0, 7), Chunk(2, 6, 7, 17), Chunk(6, 8, 17, 26)]
    assert plan_group_chunks(counts, 2, 8) is None  # the last group holds 9 tokens
    assert plan_group_chunks(counts, 2, 100) == [Chunk(0, 8, 0, 26)]
    assert plan_group_chunks([0, 0], 2, 1) == [Chunk(0, 2, 0, 0)]


def test_plan_token_chunks_cover_every_token_once():
    counts = [3, 0, 7, 2]
    chunks = plan_token_chunks(counts, 4)
    assert [(c.tok0, c.tok1) for c in chunks] == [(0, 4), (4, 8), (8, 12)]
    assert [(c.r0, c.r1) for c in chunks] == [(0, 3), (2, 3), (2, 4)]


@pytest.mark.parametrize("score,advantage,weighting", list(itertools.product(SCORES, ADVANTAGES, WEIGHTINGS)))
def test_single_pass_matches_reference_float64(score, advantage, weighting):
    hidden, weight, bias, targets, mask, old, rewards = make_batch(n_groups=3, seed=5, with_bias=True)
    hidden, weight, bias = hidden.double(), weight.double(), bias.double()
    settings = dict(beta=0.7, score=score, advantage=advantage, weighting=weighting)
    objective = PACS(**settings)
    expected, e_grads = grads_of(
        lambda h, w, b: naive_loss(h, w, b, targets, mask, old, rewards, temperature=0.8, group_size=4, **settings),
        (hidden, weight, bias))
    # one chunk; one group per chunk; 5 tokens: every group bigger than the budget, cut into tiles
    # of at most 5 tokens, the last one's logits kept, the others rebuilt
    for budget in (64.0, one_group_mib(torch.float64), tokens_mib(5, torch.float64)):
        loss, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, bias=bias, group_size=4,
                                             objective=objective,
                                             options=LossOptions(temperature=0.8, chunk_budget_mib=budget),
                                             return_stats=True)
        assert stats.path == "single_pass"
        options = LossOptions(temperature=0.8, chunk_budget_mib=budget, path="single_pass")
        loss, got = grads_of(
            lambda h, w, b: fused_linear_pacs_loss(h, w, targets, mask, old, rewards, bias=b, group_size=4,
                                                   objective=objective, options=options),
            (hidden, weight, bias))
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
        for g, e in zip(got, e_grads):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
        assert bool((got[0][~mask] == 0).all())


@pytest.mark.parametrize("score_function_term", [False, True])
def test_single_pass_equals_two_pass_and_packed(score_function_term):
    hidden, weight, _, targets, mask, old, rewards = make_batch(n_groups=3, seed=6)
    hidden, weight = hidden.double(), weight.double()
    opts = dict(group_size=4, objective=PACS(score_function_term=score_function_term))
    results = {}
    for path in ("single_pass", "two_pass"):
        options = LossOptions(path=path, chunk_budget_mib=one_group_mib(torch.float64))
        results[path] = grads_of(lambda h, w: fused_linear_pacs_loss(
            h, w, targets, mask, old, rewards, options=options, **opts),
            (hidden, weight))
    (packed_h, packed_y, packed_m, packed_old), cu = to_packed(hidden, targets, mask, old)
    budget = one_group_mib(torch.float64)
    results["packed"] = grads_of(lambda h, w: fused_linear_pacs_loss(
        h, w, packed_y, packed_m, packed_old, rewards, cu_seqlens=cu, options=LossOptions(chunk_budget_mib=budget),
        **opts),
        (packed_h, weight))
    # the two-pass path's log-probs are float32 (linear_logprobs' contract): float32-level agreement
    loss, grads = results["two_pass"]
    scale = grads[1].abs().max().item()
    for name in ("single_pass", "packed"):
        torch.testing.assert_close(results[name][0].float(), loss.float(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(results[name][1][1], grads[1], rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(results["packed"][0], results["single_pass"][0], rtol=1e-12, atol=1e-14)


def test_plan_tiles_keeps_a_last_tile_of_the_full_budget_and_rebuilds_the_rest():
    assert plan_tiles(3, 10, None) == [(3, 10, True)]
    assert plan_tiles(3, 10, 7) == [(3, 10, True)]  # within the budget: one kept tile
    # 12 tokens, budget 5: the last 5 kept, the 7 before them in 2 rebuilt tiles of 3 and 4
    assert plan_tiles(0, 12, 5) == [(0, 3, False), (3, 7, False), (7, 12, True)]
    assert plan_tiles(2, 9, 4) == [(2, 5, False), (5, 9, True)]  # 7 tokens: 3 rebuilt, 4 kept
    # a group 20% over the budget rebuilds a sixth of its tokens (equal tiles would rebuild half)
    assert plan_tiles(0, 6000, 5000) == [(0, 1000, False), (1000, 6000, True)]
    for count, budget in itertools.product(range(1, 40), range(1, 12)):
        tiles = plan_tiles(5, 5 + count, budget)
        assert [t[0] for t in tiles[1:]] == [t[1] for t in tiles[:-1]]  # consecutive
        assert tiles[0][0] == 5 and tiles[-1][1] == 5 + count  # covering the chunk
        assert all(0 < t1 - t0 <= budget for t0, t1, _ in tiles) or count <= budget
        assert [keep for *_, keep in tiles] == [False] * (len(tiles) - 1) + [True]
        assert len(tiles) == max(1, -(-count // budget))  # as few tiles as the budget allows
        rebuilt = sum(t1 - t0 for t0, t1, keep in tiles if not keep)
        assert rebuilt == max(0, count - budget)  # only what does not fit the kept tile
    chunks = [Chunk(0, 2, 0, 12), Chunk(2, 4, 12, 16)]
    assert recomputed_fraction(chunks, 5) == pytest.approx(7 / 16)
    assert recomputed_fraction(chunks, None) == 0.0
    assert plan_group_chunks([3, 4, 5, 1, 2, 2, 9, 0], 2, 8, oversized_alone=True) == [
        Chunk(0, 2, 0, 7), Chunk(2, 4, 7, 13), Chunk(4, 6, 13, 17), Chunk(6, 8, 17, 26)]


def test_default_chunk_budget_by_device():
    assert default_chunk_budget_mib(torch.device("cpu")) == 256
    assert default_chunk_budget_mib(torch.device("cuda", 0)) == 2048  # no GPU needed: a device object only


def test_group_over_budget_rebuilds_part_of_its_logits():
    """A budget smaller than every group: with eager row work (CPU) the single pass keeps what fits
    and rebuilds the rest (same loss and gradients); on the Triton backend auto falls back to two passes.
    (At these toy shapes auto's cost model prefers the eager two passes to rebuilding: the single pass is
    asked for by name.)"""
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=7)
    tiny = tokens_mib(3)  # three tokens: no group fits
    expected, e_grads = grads_of(lambda h, w: fused_linear_pacs_loss(
        h, w, targets, mask, old, rewards, group_size=4, options=LossOptions(path="two_pass")), (hidden, weight))
    rebuilding = LossOptions(path="single_pass", chunk_budget_mib=tiny)
    _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                                      options=rebuilding, return_stats=True)
    assert stats.path == "single_pass"
    loss, got = grads_of(lambda h, w: fused_linear_pacs_loss(
        h, w, targets, mask, old, rewards, group_size=4, options=rebuilding), (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    for g, e in zip(got, e_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6 * e.abs().max().item())
    _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                                      options=LossOptions(backend="triton", chunk_budget_mib=tiny), return_stats=True)
    assert stats.path == "two_pass"
    # with a soft-cap the Triton two passes cannot run (no cap in the log-prob kernels): auto rebuilds instead
    # of refusing, and matches the torch two passes
    capped = dict(chunk_budget_mib=tiny, logit_softcap=2.0)
    expected, e_grads = grads_of(lambda h, w: fused_linear_pacs_loss(
        h, w, targets, mask, old, rewards, group_size=4,
        options=LossOptions(path="two_pass", backend="torch", **capped)), (hidden, weight))
    _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                                      options=LossOptions(backend="triton", **capped), return_stats=True)
    assert stats.path == "single_pass"
    loss, got = grads_of(lambda h, w: fused_linear_pacs_loss(
        h, w, targets, mask, old, rewards, group_size=4, options=LossOptions(backend="triton", **capped)),
        (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(got, e_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * e.abs().max().item())
    for bad in (0, -1.0, float("inf"), "big", True):
        with pytest.raises(ValueError, match="chunk_budget_mib must be a finite number"):
            fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                                   options=LossOptions(chunk_budget_mib=bad))
    with pytest.raises(ValueError, match="path must be one of"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                               options=LossOptions(path="three_pass"))


@pytest.mark.parametrize("path", ["single_pass", "two_pass", "one_sweep"])
@pytest.mark.parametrize("score", SCORES)
def test_on_policy_old_logp_none(path, score):
    hidden, weight, _, targets, mask, _, rewards = make_batch(seed=8)
    hidden, weight = hidden.double(), weight.double()
    with torch.no_grad():
        current, lse = linear_logprobs(hidden, weight, targets.clamp(min=0), return_lse=True)
    opts = dict(group_size=4, objective=PACS(score=score))
    expected, e_grads = grads_of(lambda h, w: naive_loss(h, w, None, targets, mask, current, rewards, group_size=4,
                                                         score=score),
                                 (hidden, weight))
    if path == "one_sweep":
        run = lambda h, w: fused_linear_pacs_loss(h, w, targets, mask, current, rewards, old_lse=lse, **opts)  # noqa: E731
    else:
        run = lambda h, w: fused_linear_pacs_loss(h, w, targets, mask, None, rewards,  # noqa: E731
                                                  options=LossOptions(path=path), **opts)
    loss, got = grads_of(run, (hidden, weight))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-8)
    for g, e in zip(got, e_grads):  # `current` is float32: float32-level agreement
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    if score == "log_ratio":  # every score is 0 on-policy: each BCE term is ln 2, the gradient is not 0
        assert loss.item() > 0 and e_grads[1].abs().max() > 0


@pytest.mark.parametrize("path", ["single_pass", "two_pass"])
def test_valid_mask_matches_reference(path):
    hidden, weight, _, targets, mask, old, rewards = make_batch(n_groups=3, seed=9)
    hidden, weight = hidden.double(), weight.double()
    valid = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    rewards_with_nan = torch.where(valid, rewards, torch.full_like(rewards, float("nan")))
    logp_ref = lambda h, w: naive_linear_logprobs(h, w, targets.clamp(min=0))[0]  # noqa: E731
    expected, e_grads = grads_of(
        lambda h, w: reference_pacs_loss(logp_ref(h, w), old.double(), rewards, mask, group_size=4,
                                         valid=valid)[0], (hidden, weight))
    loss, got = grads_of(lambda h, w: fused_linear_pacs_loss(h, w, targets, mask, old, rewards_with_nan,
                                                             group_size=4, valid=valid,
                                                             options=LossOptions(path=path)),
                         (hidden, weight))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-8)
    for g, e in zip(got, e_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards_with_nan, group_size=4,
                                      valid=valid, options=LossOptions(path=path), return_stats=True)
    assert stats.valid_frac == pytest.approx(9 / 12)
    with pytest.raises(ValueError, match="valid must have shape"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4, valid=valid[:5])
    with pytest.raises(ValueError, match="rewards must not contain NaN"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards_with_nan, group_size=4)


@pytest.mark.parametrize("path", ["single_pass", "two_pass"])
def test_entropy_in_stats(path):
    hidden, weight, bias, targets, mask, old, rewards = make_batch(seed=10, with_bias=True)
    _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4, bias=bias,
                                      options=LossOptions(temperature=0.9, path=path), with_entropy=True,
                                      return_stats=True)
    _, entropy = naive_linear_logprobs(hidden.double(), weight.double(), targets.clamp(min=0), temperature=0.9,
                                       bias=bias.double())
    assert stats.entropy_mean == pytest.approx(entropy[mask].mean().item(), rel=1e-5)
    _, plain = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4, return_stats=True)
    assert math.isnan(plain.entropy_mean)


def test_bf16_single_pass_close_to_float64():
    hidden, weight, _, targets, mask, old, rewards = make_batch(n_groups=2, seed=11, dtype=torch.bfloat16)
    opts = dict(group_size=4)
    expected, e_grads = grads_of(lambda h, w: naive_loss(h, w, None, targets, mask, old, rewards, **opts),
                                 (hidden.double(), weight.double()))
    loss, got = grads_of(lambda h, w: fused_linear_pacs_loss(h, w, targets, mask, old, rewards,
                                                             options=LossOptions(path="single_pass"), **opts),
                         (hidden, weight))
    assert [g.dtype for g in got] == [torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(loss.double(), expected, rtol=2e-2, atol=2e-2)
    for g, e in zip(got, e_grads):
        torch.testing.assert_close(g.double(), e, rtol=2e-2, atol=2e-2 * e.abs().max().item())


def test_autocast_and_head_dtype_policy():
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=12)
    plain = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the kernels' matmuls stay in the inputs' dtype
        inside = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4)
    assert inside.item() == plain.item()
    # bf16 hidden states with a float32 head (TRL's cast_lm_head_to_fp32): hidden is upcast
    h16 = hidden.to(torch.bfloat16).requires_grad_()
    loss = fused_linear_pacs_loss(h16, weight, targets, mask, old, rewards, group_size=4)
    loss.backward()
    assert h16.grad.dtype == torch.bfloat16
    expected = fused_linear_pacs_loss(h16.detach().float(), weight, targets, mask, old, rewards, group_size=4)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def batch_at_the_old_policy(seed: int, path: str):
    """A batch whose old log-probs are the current ones, and the options that run ``path`` on it
    (one_sweep: the old-policy pass's log-sum-exp)."""
    hidden, weight, _, targets, mask, _, rewards = make_batch(seed=seed)
    with torch.no_grad():
        old, lse = linear_logprobs(hidden, weight, targets.clamp(min=0), return_lse=True)
    extra = {"old_lse": lse} if path == "one_sweep" else {"options": LossOptions(path=path)}
    return hidden, weight, targets, mask, old, rewards, extra


@pytest.mark.parametrize("path", ["single_pass", "one_sweep"])
def test_second_backward_needs_retain_graph(path):
    hidden, weight, targets, mask, old, rewards, extra = batch_at_the_old_policy(13, path)
    w = weight.clone().requires_grad_()
    loss = fused_linear_pacs_loss(hidden, w, targets, mask, old, rewards, group_size=4, **extra)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()  # retained: the same gradient again
    torch.testing.assert_close(w.grad, 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_tiny_gradients_are_flushed_not_denormal():
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=14)
    # scores so confident that sigmoid(psi) - R underflows for the right answers
    loss = fused_linear_pacs_loss(hidden, weight, targets, mask, old - 30.0, rewards, group_size=4,
                                  objective=PACS(beta=5.0, weighting="none"))
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fused_linear_pacs_loss(h, w, targets, mask, old - 30.0, rewards, group_size=4, objective=PACS(beta=5.0))
    loss.backward()
    for g in (h.grad, w.grad):
        assert bool(torch.isfinite(g).all())
        tiny = (g != 0) & (g.abs() < torch.finfo(torch.float32).tiny)
        assert not bool(tiny.any())
    assert TINY_GRAD < 1e-30


def test_empty_batch_is_refused():
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=15)
    for path in ("single_pass", "two_pass"):
        with pytest.raises(ValueError, match="at least one group of responses, got B = 0"):
            fused_linear_pacs_loss(hidden[:0], weight, targets[:0], mask[:0], old[:0], rewards[:0], group_size=4,
                                   options=LossOptions(path=path))


@pytest.mark.parametrize("backend", ["torch", "naive", "triton"])
def test_inf_hidden_gives_nan_loss_on_every_backend_and_path(backend):
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=16)
    hidden = hidden.clone()
    row = int(mask[0].nonzero()[0])
    hidden[0, row, 3] = float("inf")
    paths = ("two_pass",) if backend == "naive" else ("single_pass", "two_pass")
    for path in paths:
        h = hidden.clone().requires_grad_()
        loss = fused_linear_pacs_loss(h, weight, targets, mask, old, rewards, group_size=4,
                                      options=LossOptions(path=path, backend=backend))
        assert math.isnan(loss.item()), (backend, path)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_grpo_single_pass_matches_reference(aggregation, layout):
    hidden, weight, _, targets, mask, old, rewards = make_batch(n_groups=2, seed=17)
    hidden, weight = hidden.double(), weight.double()
    ref_lp = (old + 0.1).double()
    settings = dict(clip_eps=0.1, clip_eps_high=0.3, aggregation=aggregation, kl_coef=0.05)
    objective = GRPO(**settings)
    logp_of = lambda h, w: naive_linear_logprobs(h, w, targets.clamp(min=0))[0]  # noqa: E731
    expected, e_grads = grads_of(
        lambda h, w: reference_grpo_loss(logp_of(h, w), old, rewards, mask, ref_logp=ref_lp, group_size=4,
                                         **settings),
        (hidden, weight))
    chunk = 5 * 200 / 2 ** 20  # five tokens per chunk: responses are cut
    if layout == "padded":
        args = (hidden, targets, mask, old, ref_lp, None)
    else:
        (ph, py, pm, po), cu = to_packed(hidden, targets, mask, old)
        (_, _, _, pr), _ = to_packed(hidden, targets, mask, ref_lp)
        args = (ph, py, pm, po, pr, cu)
    for path, budget in (("single_pass", chunk), ("single_pass", 64.0), ("two_pass", 64.0)):
        options = LossOptions(path=path, chunk_budget_mib=budget)
        loss, got = grads_of(lambda h, w: fused_linear_grpo_loss(
            h, w, args[1], args[2], args[3], rewards, ref_logp=args[4], cu_seqlens=args[5], group_size=4,
            objective=objective, options=options), (args[0], weight))
        torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(got[1], e_grads[1], rtol=1e-5, atol=1e-5 * e_grads[1].abs().max().item())
    # the stats agree with grpo_loss on the same log-probs
    _, stats = fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, ref_logp=ref_lp, group_size=4,
                                      objective=objective, options=LossOptions(chunk_budget_mib=chunk),
                                      return_stats=True)
    logp = torch.where(mask, logp_of(hidden, weight), torch.zeros(()))
    _, expected_stats = grpo_loss(logp, old, rewards, mask, ref_logp=ref_lp, return_stats=True, group_size=4,
                                  **settings)
    for key, value in expected_stats.as_dict().items():
        assert stats.as_dict()[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("budget", [one_group_mib(), tokens_mib(5)])  # whole groups; groups rebuilt in part
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_row_kernels_match_the_torch_single_pass(dtype, with_bias, budget, softcap):
    """backend='triton' (here: the interpreter) runs the single pass's elementwise work in softmax_rows.py,
    the soft-cap included."""
    from pacs_kernels import triton as triton_kernels

    if not triton_kernels.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without CUDA")
    hidden, weight, bias, targets, mask, old, rewards = make_batch(seed=18, dtype=dtype, with_bias=with_bias)
    opts = dict(group_size=4, bias=bias, return_stats=True, with_entropy=True)
    knobs = dict(temperature=0.7, path="single_pass", chunk_budget_mib=2 * budget if softcap else budget,
                 logit_softcap=softcap)
    results = {}
    for backend in ("torch", "triton"):
        options = LossOptions(backend=backend, **knobs)
        results[backend] = grads_of(lambda h, w: fused_linear_pacs_loss(
            h, w, targets, mask, old, rewards, options=options, **opts)[0], (hidden, weight))
        _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, options=options, **opts)
        results[backend] += (stats,)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    (loss_t, grads_t, stats_t), (loss_k, grads_k, stats_k) = results["torch"], results["triton"]
    torch.testing.assert_close(loss_k, loss_t, rtol=tol, atol=tol)
    for g_k, g_t in zip(grads_k, grads_t):
        torch.testing.assert_close(g_k.float(), g_t.float(), rtol=tol, atol=tol * g_t.abs().max().item())
    assert stats_k.entropy_mean == pytest.approx(stats_t.entropy_mean, rel=tol)


def test_triton_row_kernels_across_vocabulary_blocks():
    """softmax_rows.py on a vocabulary of several BLOCK_V slices, against float64 PyTorch."""
    from pacs_kernels import triton as triton_kernels

    if not triton_kernels.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without CUDA")
    from pacs_kernels.triton import softmax_rows

    gen = torch.Generator().manual_seed(19)
    rows, vocab = 3, 2 * softmax_rows.BLOCK_V + 77
    z = 3 * torch.randn(rows, vocab, generator=gen)
    bias = torch.randn(vocab, generator=gen)
    y = torch.randint(0, vocab, (rows,), generator=gen)
    g = torch.randn(rows, generator=gen)
    for cap in (None, 2.0):
        lse, target, entropy = softmax_rows.row_lse(z, y, bias, 0.8, True, softcap=cap)
        x = (z.double() + bias.double()).requires_grad_(True)
        zt = (x if cap is None else cap * torch.tanh(x / cap)) / 0.8
        log_p = torch.log_softmax(zt, -1)
        torch.testing.assert_close(lse.double(), torch.logsumexp(zt, -1), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(target.double(), zt.gather(1, y[:, None]).squeeze(1), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(entropy.double(), -(log_p.exp() * log_p).sum(-1), rtol=1e-5, atol=1e-5)
        dz = softmax_rows.row_grad(z.clone(), y, bias, 0.8, lse, g, out=torch.empty(rows, vocab, dtype=torch.bfloat16),
                                   softcap=cap)
        (expected,) = torch.autograd.grad((log_p.gather(1, y[:, None]).squeeze(1) * g.double()).sum(), x)
        torch.testing.assert_close(dz.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("path", ["single_pass", "single_pass_rebuild", "two_pass", "one_sweep"])
def test_logit_softcap_matches_reference_float64(path):
    """Gemma-style soft-capping c * tanh(z / c) before the temperature, on every path of both losses."""
    hidden, weight, bias, targets, mask, old, rewards = make_batch(n_groups=2, seed=20, with_bias=True)
    hidden, weight, bias = 3 * hidden.double(), weight.double(), bias.double()  # logits large enough to cap
    cap, tau = 2.5, 0.8
    opts = dict(group_size=4, objective=PACS(beta=0.7))

    def reference(h, w, b):
        logp, _ = naive_linear_logprobs(h, w, targets.clamp(min=0), temperature=tau, bias=b, softcap=cap)
        return reference_pacs_loss(logp, old_ref, rewards, mask, group_size=4, beta=0.7)[0]

    inputs, knobs = {}, {}  # the batch's optional inputs; LossOptions fields
    if path == "one_sweep":
        with torch.no_grad():
            old_ref, lse = linear_logprobs(hidden, weight, targets.clamp(min=0), temperature=tau, bias=bias,
                                           return_lse=True, logit_softcap=cap)
        inputs = {"old_lse": lse}
    elif path == "single_pass_rebuild":  # groups bigger than the budget (the slope rows are rebuilt too)
        old_ref, knobs = old.double(), {"path": "single_pass", "chunk_budget_mib": 2 * tokens_mib(5, torch.float64)}
    else:
        old_ref, knobs = old.double(), {"path": path}
    expected, e_grads = grads_of(reference, (hidden, weight, bias))
    loss, got = grads_of(lambda h, w, b: fused_linear_pacs_loss(
        h, w, targets, mask, old_ref, rewards, bias=b, options=LossOptions(temperature=tau, logit_softcap=cap, **knobs),
        **opts, **inputs),
        (hidden, weight, bias))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-8)
    for g, e in zip(got, e_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    if path != "one_sweep":  # (there, the capped old_lse is refused for uncapped logits: stale)
        plain = fused_linear_pacs_loss(hidden, weight, targets, mask, old_ref, rewards, bias=bias,
                                       options=LossOptions(temperature=tau, **knobs), **opts, **inputs)
        assert abs(plain.item() - loss.item()) > 1e-6  # the cap changes the loss: the test is not vacuous
        # GRPO's fused loss takes it too
        logp_ref = naive_linear_logprobs(hidden, weight, targets.clamp(min=0), temperature=tau, bias=bias,
                                         softcap=cap)[0]
        expected_grpo = reference_grpo_loss(logp_ref, old, rewards, mask, group_size=4)
        grpo = fused_linear_grpo_loss(hidden, weight, targets, mask, old, rewards, group_size=4, bias=bias,
                                      options=LossOptions(temperature=tau, logit_softcap=cap, path=knobs["path"]))
        torch.testing.assert_close(grpo.double(), expected_grpo, rtol=1e-6, atol=1e-8)


def test_logit_softcap_errors():
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=21)
    for bad in (0, -1.0, float("inf"), "30", True):
        with pytest.raises(ValueError, match="logit_softcap must be None or a finite number > 0"):
            fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                                   options=LossOptions(logit_softcap=bad))
    with pytest.raises(ValueError, match="logit_softcap needs backend='torch'"):
        linear_logprobs(hidden, weight, targets.clamp(min=0), backend="triton", logit_softcap=30.0)


def test_logit_softcap_linear_logprobs_any_upstream_gradient():
    gen = torch.Generator().manual_seed(22)
    hidden = (3 * torch.randn(13, 8, generator=gen, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(37, 8, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 37, (13,), generator=gen)
    g_logp, g_ent = torch.randn(13, generator=gen, dtype=torch.float64), torch.randn(13, generator=gen,
                                                                                      dtype=torch.float64)
    results = []
    for backend, extra in (("naive", {}), ("torch", {"chunk_elements": 64})):  # several vocabulary chunks
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        logp, ent = linear_logprobs(h, w, targets, temperature=0.9, return_entropy=True, backend=backend,
                                    logit_softcap=4.0, **extra)
        (logp.double() * g_logp + ent.double() * g_ent).sum().backward()
        results.append((logp, ent, h.grad, w.grad))
    for ours, ref in zip(results[1], results[0]):
        torch.testing.assert_close(ours.double(), ref.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["single_pass", "one_sweep"])
def test_an_upstream_gradient_scales_the_gradients_computed_in_the_forward(path):
    """grad_out == 1 hands the saved gradients over as they are; any other value scales them."""
    hidden, weight, targets, mask, old, rewards, extra = batch_at_the_old_policy(24, path)
    grads = {}
    for scale in (1.0, -2.5):
        w = weight.clone().requires_grad_()
        (scale * fused_linear_pacs_loss(hidden, w, targets, mask, old, rewards, group_size=4, **extra)).backward()
        grads[scale] = w.grad
    assert grads[1.0].abs().max() > 0
    torch.testing.assert_close(grads[-2.5], -2.5 * grads[1.0])


def test_a_table_that_measured_two_passes_faster_does_not_send_a_softcap_there(monkeypatch):
    """Where the GPU dispatch table measured the Triton two passes faster (here faked on the CPU), "auto" takes
    them, but not with a soft-cap, which they cannot apply: the single pass runs instead of a refusal."""
    from pacs_kernels.engine import plan

    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=8)
    monkeypatch.setattr(plan, "measured_faster", lambda profile, shape, among: among == ("single_pass", "triton"))
    _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                                      options=LossOptions(backend="triton"), return_stats=True)
    assert stats.path == "two_pass"
    _, stats = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                                      options=LossOptions(backend="triton", logit_softcap=2.0), return_stats=True)
    assert stats.path == "single_pass"


def test_tile_buffer_lends_one_tile_at_a_time():
    from pacs_kernels.single_pass_rows import TileBuffer

    tiles = TileBuffer(vocab=7, dtype=torch.float32, device=torch.device("cpu"), max_rows=5)
    first = tiles.take(3)
    assert first.shape == (3, 7) and tiles.lent
    second = tiles.take(2)  # the first is still lent: fresh memory, never the same rows
    assert second.data_ptr() != first.data_ptr()
    tiles.give_back(second)  # not the buffer's: changes nothing
    assert tiles.lent
    tiles.give_back(first)
    again = tiles.take(5)
    assert again.data_ptr() == first.data_ptr() and again.shape == (5, 7)
    tiles.give_back(again)
    assert tiles.take(6).data_ptr() != first.data_ptr()  # more rows than the buffer holds: fresh


@pytest.mark.parametrize("tokens", [30, 3])  # one group per chunk; tiles rebuilt within each group
def test_cpu_single_pass_tiles_reuse_one_buffer(monkeypatch, tokens):
    """Every tile of a CPU single pass (held, let go, rebuilt) is built in one buffer, and the loss and
    gradients are bitwise those of fresh tiles."""
    import pacs_kernels.single_pass_rows as rows_module

    hidden, weight, _, targets, mask, old, rewards = make_batch(n_groups=3, seed=11)
    options = LossOptions(path="single_pass", backend="torch", chunk_budget_mib=tokens_mib(tokens))

    def run():
        return grads_of(lambda h, w: fused_linear_pacs_loss(h, w, targets, mask, old, rewards, group_size=4,
                                                            options=options), (hidden, weight))

    taken = []
    take = rows_module.TileBuffer.take
    monkeypatch.setattr(rows_module.TileBuffer, "take", lambda self, n: taken.append(take(self, n)) or taken[-1])
    loss, grads = run()
    assert len(taken) >= (3 if tokens == 30 else 6)
    assert len({t.data_ptr() for t in taken}) == 1

    def fresh(self, n):
        return torch.empty(n, self.vocab, dtype=self.dtype, device=self.device)

    monkeypatch.setattr(rows_module.TileBuffer, "take", fresh)
    expected, e_grads = run()
    assert torch.equal(loss, expected)
    for g, e in zip(grads, e_grads):
        assert torch.equal(g, e)
