"""The loss engine's pieces (pacs_kernels/pieces.py): a call holding part of a batch whose loss is completed
elsewhere gives, summed over the pieces, the whole batch's loss gradient, in float64 against autograd through
the materialized logits. The trainer's routes (groups in parts, sequence parallelism) are these two pieces."""

import pytest
import torch

from pacs_kernels import (
    GRPO,
    PACS,
    GatheredLogprobs,
    KnownGradient,
    LossOptions,
    fused_linear_grpo_loss,
    fused_linear_objective_loss,
    fused_linear_pacs_loss,
    grpo_loss,
    known_gradient_on_rows,
    pacs_loss,
)

B, T, D, V, G = 4, 6, 8, 41, 4
OPTIONS = LossOptions(backend="torch", temperature=0.8)


def inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64) / D ** 0.5
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.8
    mask[:, 0] = True
    old_logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 * mask
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    return hidden, weight, targets, mask, old_logp, rewards


def logprobs(hidden, weight, targets):
    return torch.log_softmax(hidden @ weight.T / OPTIONS.temperature, -1).gather(-1, targets[..., None])[..., 0]


def group_loss(objective, logp, old_logp, rewards, mask):
    if isinstance(objective, PACS):
        return pacs_loss(logp, old_logp, rewards, mask, group_size=G, **objective.group_settings(), backend="torch")
    return grpo_loss(logp, old_logp, rewards, mask, group_size=G, clip_eps=objective.clip_eps)


def whole_batch(objective, hidden, weight, targets, mask, old_logp, rewards):
    """The reference: autograd through the materialized logits of the whole batch."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = group_loss(objective, logprobs(h, w, targets) * mask, old_logp, rewards, mask)
    loss.backward()
    return loss.detach(), h.grad, w.grad


FUSED = {PACS: fused_linear_pacs_loss, GRPO: fused_linear_grpo_loss}
PARTS = [(0, 1), (1, 3), (3, 4)]  # rows of one group of 4, in three parts


@pytest.mark.parametrize("objective", [PACS(beta=0.7), GRPO(clip_eps=0.2)], ids=["pacs", "grpo"])
def test_known_gradient_parts_add_up_to_the_whole_group(objective):
    hidden, weight, targets, mask, old_logp, rewards = inputs(1)
    want_loss, want_dh, want_dw = whole_batch(objective, hidden, weight, targets, mask, old_logp, rewards)
    # phases 1-2: the group's log-probs, its loss, and g = dloss/dlogp (what a trainer computes first)
    with torch.no_grad():
        logits = hidden @ weight.T / OPTIONS.temperature
        current, lse = logprobs(hidden, weight, targets), torch.logsumexp(logits, -1)
    at = (current * mask).requires_grad_()
    loss_value = group_loss(objective, at, old_logp, rewards, mask)
    (grad_logp,) = torch.autograd.grad(loss_value, at)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for lo, hi in PARTS:  # phase 3: each part, one call with its piece
        piece = KnownGradient(grad_logp[lo:hi], lse[lo:hi], loss_value.detach(), {"part": float(lo)},
                              expected_logp=current[lo:hi])
        loss, stats = FUSED[type(objective)](h[lo:hi], w, targets[lo:hi], mask[lo:hi], old_logp[lo:hi],
                                             rewards[lo:hi], group_size=G, objective=objective, options=OPTIONS,
                                             piece=piece, return_stats=True)
        assert stats == {"part": float(lo)}
        torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-12, atol=1e-12)
        loss.backward()
    torch.testing.assert_close(h.grad, want_dh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("objective", [PACS(beta=0.7), GRPO(clip_eps=0.2)], ids=["pacs", "grpo"])
def test_known_gradient_on_rows_gives_phases_one_and_two(objective):
    """pacs_kernels.known_gradient_on_rows: the loss of whole groups on their log-prob rows and g = dloss/dlogp
    (0 off the mask, no graph left), which the parts' pieces turn into the whole group's gradient (float64)."""
    hidden, weight, targets, mask, old_logp, rewards = inputs(3)
    want_loss, want_dh, want_dw = whole_batch(objective, hidden, weight, targets, mask, old_logp, rewards)
    with torch.no_grad():
        current = logprobs(hidden, weight, targets) * mask
        lse = torch.logsumexp(hidden @ weight.T / OPTIONS.temperature, -1)
    loss, grad_logp, stats = known_gradient_on_rows(objective, current, old_logp, rewards, mask, group_size=G)
    assert not loss.requires_grad and not grad_logp.requires_grad and not current.requires_grad
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    assert grad_logp.shape == current.shape and bool((grad_logp[~mask] == 0).all())
    assert float(stats["loss"]) == pytest.approx(float(want_loss))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for lo, hi in PARTS:
        piece = KnownGradient(grad_logp[lo:hi], lse[lo:hi], loss, stats if lo == 0 else {})
        FUSED[type(objective)](h[lo:hi], w, targets[lo:hi], mask[lo:hi], old_logp[lo:hi], rewards[lo:hi],
                               group_size=G, objective=objective, options=OPTIONS, piece=piece).backward()
    torch.testing.assert_close(h.grad, want_dh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-9, atol=1e-12)
    if isinstance(objective, PACS):  # a response that does not count: PACS's valid= (weight 0, still in baselines)
        valid = torch.tensor([True, False, True, True])
        value, with_valid, _ = known_gradient_on_rows(objective, current, old_logp, rewards, mask, group_size=G,
                                                      valid=valid)
        at = current.clone().requires_grad_()
        want = pacs_loss(at, old_logp, rewards, mask, group_size=G, **objective.group_settings(), valid=valid)
        torch.testing.assert_close(value, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(with_valid, torch.autograd.grad(want, at)[0] * mask, rtol=1e-12, atol=1e-14)
        assert not torch.equal(with_valid, grad_logp)
    else:
        with pytest.raises(ValueError, match="valid"):
            known_gradient_on_rows(objective, current, old_logp, rewards, mask, group_size=G,
                                   valid=torch.ones(B, dtype=torch.bool))


@pytest.mark.parametrize("objective", [PACS(beta=0.7), GRPO(clip_eps=0.2)], ids=["pacs", "grpo"])
def test_gathered_pieces_add_up_to_the_whole_batch(objective):
    """Two "ranks" each hold some tokens of every response (alternate tokens); each gathers its own log-probs
    with the other's (constants here, as another rank's are) into the rows the loss sees."""
    hidden, weight, targets, mask, old_logp, rewards = inputs(2)
    want_loss, want_dh, want_dw = whole_batch(objective, hidden, weight, targets, mask, old_logp, rewards)
    with torch.no_grad():
        current = logprobs(hidden, weight, targets) * mask
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    columns = torch.arange(T)
    for rank in (0, 1):
        mine = mask & (columns % 2 == rank)

        def gather(logp, mine=mine):
            return current.masked_scatter(mine, logp)  # this piece's tokens live, the other's constant

        piece = GatheredLogprobs(gather, old_logp, mask, rewards)
        loss = FUSED[type(objective)](h, w, targets, mine, old_logp, rewards, group_size=G, objective=objective,
                                      options=OPTIONS, piece=piece)
        torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-10, atol=1e-12)
        loss.backward()
    torch.testing.assert_close(h.grad, want_dh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-9, atol=1e-12)


def test_any_objective_takes_a_gathered_piece():
    from pacs_kernels import DAPO

    hidden, weight, targets, mask, old_logp, rewards = inputs(3)
    objective = DAPO()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = objective(logprobs(h, w, targets) * mask, old_logp, rewards, mask, group_size=G)[0]
    piece = GatheredLogprobs(lambda logp: torch.zeros_like(old_logp).masked_scatter(mask, logp), old_logp, mask,
                             rewards)
    got, _ = fused_linear_objective_loss(hidden, weight, targets, mask, None, rewards, objective=objective, group_size=G,
                                         options=OPTIONS, piece=piece)
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)


def test_a_moved_weight_is_caught_and_every_process_agrees_first():
    hidden, weight, targets, mask, old_logp, rewards = inputs(4)
    with torch.no_grad():
        current = logprobs(hidden, weight, targets)
        lse = torch.logsumexp(hidden @ weight.T / OPTIONS.temperature, -1)
    seen = []

    def agree(drift):
        seen.append(float(drift))
        return drift

    piece = KnownGradient(torch.zeros_like(current), lse, 0.0, {}, expected_logp=current, agree=agree)
    moved = weight + 0.5
    with pytest.raises(RuntimeError, match="more than rounding"):
        fused_linear_pacs_loss(hidden, moved, targets, mask, old_logp, rewards, group_size=G, options=OPTIONS,
                               piece=piece)
    assert seen and seen[0] > 1e-3
    fused_linear_pacs_loss(hidden, weight, targets, mask, old_logp, rewards, group_size=G, options=OPTIONS,
                           piece=piece)  # the same weights: within rounding
    assert seen[1] < 1e-6  # the drift is measured in float32


def test_a_piece_without_tokens_still_reaches_hidden():
    """A sequence-parallel rank may hold only prompt tokens: its backward must still run through hidden."""
    hidden, weight, targets, mask, old_logp, rewards = inputs(5)
    h = hidden.clone().requires_grad_()
    none = torch.zeros_like(mask)
    piece = GatheredLogprobs(lambda logp: torch.zeros_like(old_logp).masked_scatter(none, logp) + old_logp,
                             old_logp, mask, rewards)
    loss = fused_linear_pacs_loss(h, weight, targets, none, old_logp, rewards, group_size=G, options=OPTIONS,
                                  piece=piece)
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h))


@pytest.mark.parametrize("change,error,match", [
    (dict(piece="rows"), TypeError, "piece must be a KnownGradient or a GatheredLogprobs"),
    (dict(cu_seqlens=torch.tensor([0, 6])), ValueError, "cu_seqlens= cannot go with piece="),
    (dict(old_lse=torch.zeros(B, T)), ValueError, "old_lse= cannot go with piece="),
    (dict(bad_grad=True), ValueError, r"piece.grad_logp must be laid out like targets"),
    (dict(mask_scale=0.5), ValueError, r"mask must hold only 0 and 1"),  # it ran, 0.5 read as 1
    (dict(mask_scale=2.0), ValueError, r"mask must hold only 0 and 1"),
])
def test_bad_pieces_are_named(change, error, match):
    hidden, weight, targets, mask, old_logp, rewards = inputs(6)
    if "mask_scale" in change:
        mask = mask.double() * change.pop("mask_scale")
    grad = torch.zeros(B, T - 1 if change.pop("bad_grad", False) else T, dtype=torch.float64)
    piece = change.pop("piece", KnownGradient(grad, torch.zeros(B, T, dtype=torch.float64), 0.0, {}))
    with pytest.raises(error, match=match):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old_logp, rewards, group_size=G, options=OPTIONS,
                               piece=piece, **change)
