"""pacs_loss against the float64 re-implementation of the public PACS code (reference.py)."""

import itertools
import math

import pytest
import torch
from seeds import stable_seed

from pacs_kernels import PACSStats, pacs_loss
from pacs_kernels.reference import reference_pacs_loss

SCORES = ("log_ratio", "mean_logp")
ADVANTAGES = ("rloo", "grpo", "naive")
WEIGHTINGS = ("balanced", "none", "positive_only", "negative_only")
COMBOS = list(itertools.product(SCORES, ADVANTAGES, WEIGHTINGS))


def make_inputs(n_groups, group_size, length, *, seed, dtype=torch.float64, mixed_labels=True):
    gen = torch.Generator().manual_seed(seed)
    b = n_groups * group_size
    logp = -3.0 * torch.rand(b, length, generator=gen, dtype=torch.float64)
    old_logp = logp + 0.4 * torch.randn(b, length, generator=gen, dtype=torch.float64)
    # ragged responses: a random length per row (>= 1), and a few holes (prompt tokens)
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask &= torch.rand(b, length, generator=gen) > 0.1
    mask[:, 0] = True
    # garbage where the mask is 0: the loss must never see it
    logp = torch.where(mask, logp, torch.full_like(logp, -1e4))
    rewards = torch.randint(0, 2, (b,), generator=gen).to(torch.float64)
    if mixed_labels and n_groups > 1:
        rewards[:group_size] = 1.0  # one single-label group, the rest random
    return logp.to(dtype), old_logp.to(dtype), rewards, mask


SHAPES = [(1, 2, 5), (3, 4, 7), (2, 8, 33), (4, 3, 12)]


@pytest.mark.parametrize("score,advantage,weighting", COMBOS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_torch_matches_reference_float64(score, advantage, weighting, shape):
    logp, old_logp, rewards, mask = make_inputs(*shape, seed=stable_seed(score, advantage, weighting, shape) % 10**6)
    opts = dict(group_size=shape[1], beta=0.7, score=score, advantage=advantage, weighting=weighting)
    logp_ref = logp.clone().requires_grad_()
    expected, _ = reference_pacs_loss(logp_ref, old_logp, rewards, mask, **opts)
    (expected_grad,) = torch.autograd.grad(expected, logp_ref)
    logp_ours = logp.clone().requires_grad_()
    loss = pacs_loss(logp_ours, old_logp, rewards, mask, backend="torch", **opts)
    (grad,) = torch.autograd.grad(loss, logp_ours)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-13)
    assert bool((grad[~mask] == 0).all())


@pytest.mark.parametrize("score,advantage,weighting", COMBOS)
def test_triton_group_kernel_matches_reference(score, advantage, weighting):
    # G = 3 (not a power of two) and T = 70 (several token tiles of the interpreter's blocks)
    logp, old_logp, rewards, mask = make_inputs(3, 3, 70, seed=7, dtype=torch.float32)
    logp, old_logp = logp.double(), old_logp.double()  # float32 values, exactly, for the reference
    opts = dict(group_size=3, beta=1.3, score=score, advantage=advantage, weighting=weighting)
    logp_ref = logp.clone().requires_grad_()
    expected, _ = reference_pacs_loss(logp_ref, old_logp, rewards, mask, **opts)
    (expected_grad,) = torch.autograd.grad(expected, logp_ref)
    logp32 = logp.float().requires_grad_()
    loss = pacs_loss(logp32, old_logp.float(), rewards, mask, backend="triton", **opts)
    (grad,) = torch.autograd.grad(loss, logp32)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=2e-6)
    # float32 accumulation: compare on the scale of the largest gradient entry (grpo on mean_logp
    # divides by a small in-group std; the float32 torch path is off by the same amount)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=5e-5 * expected_grad.abs().max().item())
    assert bool((grad[~mask] == 0).all())


@pytest.mark.parametrize("shape", [(1, 2, 5), (2, 16, 3), (2, 5, 40)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("score,advantage,weighting", [
    ("log_ratio", "rloo", "balanced"), ("mean_logp", "grpo", "balanced"), ("log_ratio", "naive", "none")])
def test_triton_group_kernel_shapes(shape, score, advantage, weighting):
    """G = 2 and G = 16 (one tile of responses), short and tiled T, one group and several."""
    logp, old_logp, rewards, mask = make_inputs(*shape, seed=sum(shape), dtype=torch.float32)
    opts = dict(group_size=shape[1], score=score, advantage=advantage, weighting=weighting)
    lp_ref = logp.double().requires_grad_()
    expected, _ = reference_pacs_loss(lp_ref, old_logp.double(), rewards, mask, **opts)
    (expected_grad,) = torch.autograd.grad(expected, lp_ref)
    lp = logp.clone().requires_grad_()
    loss = pacs_loss(lp, old_logp, rewards, mask, backend="triton", **opts)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=2e-6)
    # (with G = 2, grpo's psi is +-1/sqrt(2) whatever the scores: its true gradient is ~0 and the
    # float32 result is cancellation noise, hence the small absolute floor)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4,
                               atol=5e-5 * expected_grad.abs().max().item() + 1e-8)


def test_triton_backend_rejects_float64():
    logp, old_logp, rewards, mask = make_inputs(1, 2, 4, seed=0)
    with pytest.raises(TypeError, match="float64"):
        pacs_loss(logp, old_logp, rewards, mask, group_size=2, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("score", SCORES)
def test_score_function_term(backend, score):
    """Eq. 6: gradient gains m w l / B; the loss value is unchanged."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    logp, old_logp, rewards, mask = make_inputs(2, 4, 9, seed=11, dtype=dtype)
    opts = dict(group_size=4, score=score, advantage="rloo", weighting="balanced", backend=backend)
    lp = logp.clone().requires_grad_()
    plain = pacs_loss(lp, old_logp, rewards, mask, **opts)
    (plain_grad,) = torch.autograd.grad(plain, lp)
    lp2 = logp.clone().requires_grad_()
    with_term = pacs_loss(lp2, old_logp, rewards, mask, score_function_term=True, **opts)
    (grad,) = torch.autograd.grad(with_term, lp2)
    assert with_term.item() == plain.item()
    _, parts = reference_pacs_loss(logp.double(), old_logp.double(), rewards, mask, group_size=4, score=score)
    extra = mask.double() * (parts["weight"] * parts["bce"])[:, None] / logp.shape[0]
    tol = dict(rtol=1e-10, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grad.double(), plain_grad.double() + extra, **tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_layout_equals_padded(backend):
    logp, old_logp, rewards, mask = make_inputs(2, 4, 11, seed=3, dtype=torch.float32)
    lengths = torch.randint(3, 12, (8,), generator=torch.Generator().manual_seed(5))
    lengths[2] = 0  # an empty response is allowed with log_ratio
    cu = torch.zeros(9, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    packed = [torch.cat([t[i, :lengths[i]] for i in range(8)]) for t in (logp, old_logp, mask)]
    padded_mask = torch.arange(11)[None, :] < lengths[:, None]
    padded_mask &= mask
    opts = dict(group_size=4, advantage="grpo", backend=backend)
    lp_packed = packed[0].clone().requires_grad_()
    loss_packed = pacs_loss(lp_packed, packed[1], rewards, packed[2], cu_seqlens=cu, **opts)
    lp_padded = logp.clone().requires_grad_()
    loss_padded = pacs_loss(lp_padded, old_logp, rewards, padded_mask, **opts)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-6, atol=1e-7)
    (g_packed,) = torch.autograd.grad(loss_packed, lp_packed)
    (g_padded,) = torch.autograd.grad(loss_padded, lp_padded)
    torch.testing.assert_close(g_packed, torch.cat([g_padded[i, :lengths[i]] for i in range(8)]),
                               rtol=1e-5, atol=1e-8)
    # (1, N) rows are accepted too
    loss_row = pacs_loss(packed[0][None], packed[1][None], rewards, packed[2][None], cu_seqlens=cu, **opts)
    torch.testing.assert_close(loss_row, loss_packed.detach())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grpo_zero_std_gradient_is_finite(backend):
    """First step after a rollout: logp == old_logp, every score 0, std 0 (torch.std's convention)."""
    logp, _, rewards, mask = make_inputs(2, 4, 6, seed=9, dtype=torch.float32)
    lp = logp.clone().requires_grad_()
    loss = pacs_loss(lp, logp.clone(), rewards, mask, group_size=4, advantage="grpo", backend=backend)
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = logp.double().requires_grad_()
    expected, _ = reference_pacs_loss(lp_ref, logp.double(), rewards, mask, group_size=4, advantage="grpo")
    (expected_grad,) = torch.autograd.grad(expected, lp_ref)
    assert bool(torch.isfinite(grad).all())
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)


def test_bfloat16_logp_triton_and_torch_agree():
    logp, old_logp, rewards, mask = make_inputs(2, 4, 20, seed=21, dtype=torch.bfloat16)
    results = []
    for backend in ("torch", "triton"):
        lp = logp.clone().requires_grad_()
        loss = pacs_loss(lp, old_logp, rewards, mask, group_size=4, score="mean_logp", backend=backend)
        (grad,) = torch.autograd.grad(loss, lp)
        assert grad.dtype == torch.bfloat16
        results.append((loss, grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-2, atol=1e-5)


def test_upstream_gradient_scales():
    logp, old_logp, rewards, mask = make_inputs(2, 4, 6, seed=4, dtype=torch.float32)
    grads = []
    for backend, scale in (("torch", 1.0), ("triton", 2.5)):
        lp = logp.clone().requires_grad_()
        (scale * pacs_loss(lp, old_logp, rewards, mask, group_size=4, backend=backend)).backward()
        grads.append(lp.grad / scale)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stats(backend):
    logp, old_logp, rewards, mask = make_inputs(3, 4, 8, seed=13, dtype=torch.float32)
    loss, stats = pacs_loss(logp, old_logp, rewards, mask, group_size=4, beta=0.5, return_stats=True,
                            backend=backend)
    assert isinstance(stats, PACSStats)
    leaf = logp.double().requires_grad_()
    ref_loss, parts = reference_pacs_loss(leaf, old_logp.double(), rewards, mask, group_size=4, beta=0.5)
    (grad,) = torch.autograd.grad(ref_loss, leaf)
    psi = parts["psi"]
    labels = rewards.reshape(3, 4)
    # dloss/dr[j] from autograd: each masked token of response j gets beta * dloss/dr[j]
    per_response = grad[torch.arange(12), mask.int().argmax(1)] / 0.5
    single = (labels == labels[:, :1]).all(1).repeat_interleave(4)
    expected = dict(
        loss=loss.item(), psi_mean=psi.mean().item(), psi_std=psi.std(unbiased=False).item(),
        sigmoid_psi_mean=torch.sigmoid(psi).mean().item(), reward_mean=rewards.mean().item(),
        score_mean=parts["score"].mean().item(), weight_mean=parts["weight"].mean().item(),
        weight_min=parts["weight"].min().item(), weight_max=parts["weight"].max().item(),
        frac_single_label_groups=(labels == labels[:, :1]).all(1).double().mean().item(),
        sigmoid_psi_correct_mean=torch.sigmoid(psi)[rewards == 1].mean().item(),
        sigmoid_psi_incorrect_mean=torch.sigmoid(psi)[rewards == 0].mean().item(),
        single_label_grad_share=(per_response[single].square().sum() / per_response.square().sum()).item(),
        valid_frac=1.0)
    got = stats.as_dict()
    assert math.isnan(got.pop("entropy_mean"))  # pacs_loss has no logits: the fused loss reports it
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert stats.frac_single_label_groups >= 1 / 3  # the first group is all-positive
    assert 0 < stats.single_label_grad_share < 1  # old_logp != logp: the single-label group pulls too
    assert stats.as_dict("pacs/")["pacs/psi_mean"] == stats.psi_mean


@pytest.mark.parametrize("advantage", ["rloo", "grpo", "naive"])
def test_single_label_grad_share_against_autograd_and_zero_at_the_reference(advantage):
    """The share of dloss/dr held by single-label groups, against autograd in float64, for every advantage;
    with logp = old_logp (psi = 0) a single-label group's gradient cancels under rloo and grpo (share 0),
    not under naive (psi = r has no baseline)."""
    logp, old_logp, rewards, mask = make_inputs(4, 3, 6, seed=31)
    rewards[3:6] = 0.0  # a second single-label group, of the other label
    labels = rewards.reshape(4, 3)
    single = (labels == labels[:, :1]).all(1).repeat_interleave(3)
    for reference in (old_logp, logp):
        leaf = logp.clone().requires_grad_()
        loss, stats = pacs_loss(leaf, reference, rewards, mask, group_size=3, beta=2.0, advantage=advantage,
                                return_stats=True, backend="torch")
        (grad,) = torch.autograd.grad(loss, leaf)
        c = grad[torch.arange(12), mask.int().argmax(1)] / 2.0
        assert stats.single_label_grad_share == pytest.approx(
            (c[single].square().sum() / c.square().sum()).item(), rel=1e-9, abs=1e-12)
    if advantage == "naive":
        assert stats.single_label_grad_share > 0.1
    else:
        assert stats.single_label_grad_share == pytest.approx(0.0, abs=1e-20)
    # every group single-label at the reference: no gradient anywhere, the share is undefined
    _, stats = pacs_loss(logp, logp, torch.ones(12, dtype=torch.float64), mask, group_size=3, advantage="rloo",
                         return_stats=True)
    assert math.isnan(stats.single_label_grad_share)


def test_auto_backend_is_torch_on_cpu_and_accepts_bool_int_masks():
    logp, old_logp, rewards, mask = make_inputs(2, 2, 5, seed=1)
    base = pacs_loss(logp, old_logp, rewards, mask, group_size=2)
    assert base.dtype == torch.float64  # float64 only on the torch path
    for m in (mask.int(), mask.float(), mask.to(torch.uint8)):
        assert pacs_loss(logp, old_logp, rewards.bool(), m, group_size=2).item() == base.item()
    assert pacs_loss(logp, old_logp, rewards.long(), mask, group_size=2).item() == base.item()


def test_group_ids():
    logp, old_logp, rewards, mask = make_inputs(3, 2, 4, seed=2)
    good = torch.tensor([7, 7, 3, 3, 9, 9])
    pacs_loss(logp, old_logp, rewards, mask, group_size=2, group_ids=good)
    with pytest.raises(ValueError, match="group_ids"):
        pacs_loss(logp, old_logp, rewards, mask, group_size=2, group_ids=torch.tensor([7, 3, 7, 3, 9, 9]))
    with pytest.raises(ValueError, match="group_ids"):
        pacs_loss(logp, old_logp, rewards, mask, group_size=2, group_ids=torch.tensor([7, 7, 3, 3, 7, 7]))
    with pytest.raises(ValueError, match="group_ids"):
        pacs_loss(logp, old_logp, rewards, mask, group_size=2, group_ids=good[:4])


# ----------------------------------------------------------------------------- bad input


def _call(**changes):
    logp, old_logp, rewards, mask = make_inputs(2, 4, 5, seed=0)
    args = dict(logp=logp, old_logp=old_logp, rewards=rewards, mask=mask)
    kwargs = dict(group_size=4)
    for key, value in changes.items():
        (args if key in args else kwargs)[key] = value
    return pacs_loss(args["logp"], args["old_logp"], args["rewards"], args["mask"], **kwargs)


@pytest.mark.parametrize("changes,match", [
    (dict(group_size=3), "group_size"),
    (dict(group_size=1), "group_size"),
    (dict(group_size=1, advantage="grpo"), "group_size"),
    (dict(rewards=torch.tensor([0, 1, 0.5, 1, 0, 0, 1, 1.0])), "rewards"),
    (dict(rewards=torch.tensor([0, 1, 2, 1, 0, 0, 1, 1.0]), weighting="positive_only"), "rewards"),
    (dict(rewards=torch.tensor([0, 1, 1.5, 1, 0, 0, 1, 1.0]), weighting="none"), "rewards"),
    (dict(rewards=torch.tensor([0, 1, float("nan"), 1, 0, 0, 1, 1.0])), "NaN"),
    (dict(rewards=torch.ones(6)), "rewards"),
    (dict(rewards=torch.ones(8, 1)), "rewards"),
    (dict(old_logp=torch.zeros(8, 6)), "old_logp"),
    (dict(mask=torch.ones(8, 4)), "mask"),
    (dict(mask=torch.full((8, 5), 0.5)), "mask"),
    (dict(logp=torch.zeros(8, 5, 2)), "logp"),
    (dict(mask=torch.ones(8, 5, device="meta")), "device"),
    (dict(rewards=torch.ones(8, device="meta")), "rewards"),
    (dict(score="sum"), "score"),
    (dict(advantage="ppo"), "advantage"),
    (dict(weighting="question"), "weighting"),
    (dict(backend="cuda"), "backend"),
    (dict(beta=float("inf")), "beta"),
    (dict(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens"),
])
def test_bad_input_raises_value_error_naming_argument(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(**changes)


def test_bad_types():
    with pytest.raises(TypeError, match="rewards"):
        _call(rewards=[0, 1, 0, 1, 0, 1, 0, 1])
    with pytest.raises(TypeError, match="logp"):
        _call(logp=torch.zeros(8, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="group_size"):
        _call(group_size=2.0)
    with pytest.raises(TypeError, match="score_function_term"):
        _call(score_function_term="yes")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_empty_mask_response_scores_0_under_mean_logp(backend):
    """mean_logp over no tokens is 0 (TRL's mask.sum(-1).clamp(min=1)), as the log-ratio's sum over none is: the
    response keeps its BCE term and its place in the group's baseline, and no gradient reaches its row."""
    logp, old_logp, rewards, mask = make_inputs(2, 4, 5, seed=0)
    mask[5] = False
    dtype = torch.float64 if backend == "torch" else torch.float32  # (the Triton kernels take up to float32)
    logp = logp.to(dtype).detach().requires_grad_()
    loss = pacs_loss(logp, old_logp.to(dtype), rewards, mask, group_size=4, score="mean_logp", backend=backend)
    expected, parts = reference_pacs_loss(logp, old_logp, rewards, mask, group_size=4, score="mean_logp")
    assert float(parts["score"][5]) == 0.0
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-7)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and not logp.grad[5].any()


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([1, 10, 20, 40]), "cu_seqlens"),
    (torch.tensor([0, 10, 5, 40]), "cu_seqlens"),
    (torch.tensor([0, 10, 20, 39]), "cu_seqlens"),
    (torch.tensor([0.0, 10, 20, 40]), "cu_seqlens"),
])
def test_bad_cu_seqlens(cu, match):
    logp = torch.randn(40)
    with pytest.raises((ValueError, TypeError), match=match):
        pacs_loss(logp, logp, torch.tensor([0, 1, 1.0]), torch.ones(40), group_size=3, cu_seqlens=cu)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch_is_one_clear_error(backend):
    logp = torch.zeros(0, 5)
    with pytest.raises(ValueError, match="at least one group of responses, got B = 0"):
        pacs_loss(logp, logp, torch.zeros(0), logp.bool(), group_size=2, backend=backend)
