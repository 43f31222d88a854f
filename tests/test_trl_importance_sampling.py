"""TRL's vLLM importance-sampling correction in our engine (issue 48): ``vllm_importance_sampling_*`` of
GRPOTrainer, value for value.

TRL (grpo_trainer.py, read for the formula, not copied): the log-ratio of each completion token,
``(old_per_token_logps - sampling_per_token_logps) * mask``, summed over the response for the sequence modes;
``exp``; then ``*_truncate``: ``clamp(ratio, min=clip_min, max=clip_max)``, ``*_mask``: 0 where the ratio lies
outside ``[clip_min, clip_max]``; the loss multiplies ``per_token_loss`` by it before its aggregation. The
TRL formula is written out here in plain torch, float64; our engine gets the same ratios as ``token_weights``
(``importance_weights``, and PACSTrainer's ``importance_sampling_weights`` for TRL's own ratio tensor)."""

from __future__ import annotations

import math

import pytest
import torch

from pacs.train.rollout_correction import TRL_MODES, Band, importance_weights
from pacs_kernels import GRPO, PACS, pacs_loss
from pacs_kernels.fused import fused_linear_grpo_loss, fused_linear_objective_loss
from pacs_kernels.objectives.pacs import weighted_logprobs

B, G, T, D, V = 6, 3, 5, 4, 9


def trl_ratio(old, sampler, mask, mode, clip_min, clip_max):
    """TRL's vllm_importance_sampling_ratio, (B, T) for token modes, (B, 1) for sequence modes."""
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_grpo_loss(logp, old, advantages, mask, is_ratio, *, epsilon, loss_type):
    """TRL's loss for loss_type "bnpo" (token mean) or "grpo" (mean of per-response means), beta = 0."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token_loss = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    per_token_loss = per_token_loss * is_ratio
    m = mask.to(logp.dtype)
    if loss_type == "bnpo":
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def tiny(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.6
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 4, 2, 5, 4])[:, None]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    old = logp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)  # a later mini-batch: logp != old
    sampler = old - 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # vLLM's log-probs, mismatched
    return hidden, weight, targets, mask, old, sampler, rewards


@pytest.mark.parametrize("mode", TRL_MODES)
@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 1.5)])
def test_our_weights_are_trls_ratio(mode, clip_min, clip_max):
    _, _, _, mask, old, sampler, _ = tiny()
    band = Band(c_min=clip_min or 0.0, c_max=clip_max)
    expected = trl_ratio(old, sampler, mask, mode, clip_min, clip_max).expand(B, T)
    got = importance_weights(old, sampler, mask, mode, band)
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-12, atol=0)
    assert float(got[~mask].abs().sum()) == 0.0
    if mode.endswith("mask") and clip_max == 1.5:
        assert 0 < int((got[mask] == 0).sum()) < int(mask.sum()), "the band drops some, not all"


@pytest.mark.parametrize("mode", TRL_MODES)
@pytest.mark.parametrize("loss_type, aggregation", [("bnpo", "token_mean"), ("grpo", "seq_mean")])
def test_the_engines_grpo_loss_is_trls_for_each_mode(mode, loss_type, aggregation):
    """Our fused GRPO loss with token_weights = TRL's ratio equals TRL's formula (with our advantages: TRL divides
    by std + 1e-4, we by std + 1e-6), loss and gradients, float64."""
    hidden, weight, targets, mask, old, sampler, rewards = tiny(1)
    ratio = trl_ratio(old, sampler, mask, mode, 0.5, 1.5)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_grpo_loss(h1, w1, targets, mask, old, rewards, group_size=G,
                                  objective=GRPO(clip_eps=0.2, aggregation=aggregation),
                                  token_weights=importance_weights(old, sampler, mask, mode, Band(0.5, 1.5)))
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = torch.log_softmax(h2 @ w2.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    grouped = rewards.reshape(-1, G)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)
    expected = trl_grpo_loss(logp, old, advantages, mask, ratio, epsilon=0.2, loss_type=loss_type)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-12)


def test_pacs_trainer_weights_from_trls_ratio_tensor():
    """PACSTrainer takes TRL's own ratio tensor ((B, 1) in the sequence modes, (B, T) in the token modes) as the
    loss's token_weights, 0 off the completion mask."""
    from pacs.integrations.trl import importance_sampling_weights

    _, _, _, mask, old, sampler, _ = tiny(2)
    for mode in TRL_MODES:
        ratio = trl_ratio(old, sampler, mask, mode, None, 3.0)
        weights = importance_sampling_weights(ratio, mask.long())
        assert weights.shape == (B, T) and weights.dtype == torch.float32
        torch.testing.assert_close(weights, torch.where(mask, ratio.expand(B, T), 0.0).float())
    assert importance_sampling_weights(None, mask) is None


def test_pacs_with_trls_default_mode_weighs_the_score():
    """TRL's default (sequence_mask, clip_max 3): PACS's loss with those weights is PACS on the weighted log-probs
    old + w (logp - old), the responses TRL zeroed out of ``valid`` (as PACSTrainer drops them)."""
    hidden, weight, targets, mask, old, sampler, rewards = tiny(3)
    sampler = sampler.clone()
    sampler[1] = old[1] - 0.5  # a response whose product ratio exp(1.5) > ... stays; this one:
    sampler[4] = old[4] - 0.3  # exp(5 * 0.3) = 4.5 > 3: zeroed by sequence_mask
    w = importance_weights(old, sampler, mask, "sequence_mask", Band(0.0, 3.0)).double()
    valid = (w * mask).bool().any(1)
    assert valid.tolist().count(False) >= 1
    loss, _ = fused_linear_objective_loss(hidden, weight, targets, mask, old, rewards, objective=PACS(),
                                          group_size=G, token_weights=w, valid=valid)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    expected = pacs_loss(weighted_logprobs(logp, old, w), old, rewards, mask, group_size=G, valid=valid)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)


def test_pacs_trainer_loss_with_trls_ratio(tmp_path):
    """PACSTrainer.compute_loss on a micro-batch carrying what TRL's correction puts there (old_per_token_logps and
    importance_sampling_ratio, here a sequence_mask ratio zeroing one response): the loss and gradients of PACS
    on old + w (logp - old) with that response out of valid, on naive log-probs of the same model."""
    pytest.importorskip("trl")
    import trl_helpers as helpers

    from pacs.integrations.trl import importance_sampling_weights

    trainer = helpers.trainer(tmp_path)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model, mask = trainer.model, inputs["completion_mask"]
    with torch.no_grad():
        old = helpers.naive_logp(model, inputs, 1.0) - 0.05  # the weights moved since the old-policy pass
    ratio = torch.linspace(0.5, 2.0, mask.shape[0])[:, None]
    ratio[2] = 0.0  # zeroed by TRL's mask mode: the response is dropped
    inputs = {**inputs, "old_per_token_logps": old, "importance_sampling_ratio": ratio}
    weights = importance_sampling_weights(ratio, mask)
    valid = inputs["pacs_valid"] & mask.bool().any(1) & (weights * mask).bool().any(1)
    assert not bool(valid[2])

    def reference():
        logp = helpers.naive_logp(model, inputs, 1.0)
        return pacs_loss(weighted_logprobs(logp, old, weights), old, inputs["pacs_rewards"], mask,
                         group_size=helpers.GROUP, valid=valid) / trainer.args.gradient_accumulation_steps

    def grads_of(compute):
        model.zero_grad(set_to_none=True)
        loss = compute()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    loss, grads = grads_of(lambda: trainer.compute_loss(model, inputs))
    ref_loss, ref_grads = grads_of(reference)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-5, atol=2e-5)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert scale > 0
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=2e-5, atol=2e-5 * scale, msg=name)
    # and the weights matter
    plain, _ = grads_of(lambda: trainer.compute_loss(model, {**inputs, "importance_sampling_ratio": None}))
    assert not torch.allclose(plain, loss, rtol=1e-4)
