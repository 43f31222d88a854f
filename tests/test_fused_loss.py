"""fused_linear_pacs_loss / PACSLoss against naive logits + the float64 reference loss."""


import pytest
import torch
from torch import nn

from pacs_kernels import PACS, LossOptions, PACSLoss, fused_linear_pacs_loss, pacs_loss
from pacs_kernels.reference import naive_linear_logprobs, reference_pacs_loss

VOCAB, WIDTH = 50, 16


def make_batch(n_groups=2, group_size=4, length=9, *, seed=0, dtype=torch.float32, with_bias=False):
    gen = torch.Generator().manual_seed(seed)
    b = n_groups * group_size
    hidden = torch.randn(b, length, WIDTH, generator=gen).to(dtype)
    weight = (0.3 * torch.randn(VOCAB, WIDTH, generator=gen)).to(dtype)
    bias = (0.1 * torch.randn(VOCAB, generator=gen)).to(dtype) if with_bias else None
    targets = torch.randint(0, VOCAB, (b, length), generator=gen)
    # prompt-like holes at the start, ragged ends
    starts = torch.randint(0, 3, (b,), generator=gen)
    ends = torch.randint(4, length + 1, (b,), generator=gen)
    pos = torch.arange(length)[None, :]
    mask = (pos >= starts[:, None]) & (pos < ends[:, None])
    targets = torch.where(mask, targets, torch.full_like(targets, -100))  # padding ids never looked up
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T
        old = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        old = (old + 0.2 * torch.randn(b, length, generator=gen, dtype=torch.float64)).float()
    rewards = torch.randint(0, 2, (b,), generator=gen).float()
    return hidden, weight, bias, targets, mask, old, rewards


def naive_loss(hidden, weight, bias, targets, mask, old, rewards, *, temperature=1.0, **opts):
    """float64 logits, float64 public-code loss."""
    logp, _ = naive_linear_logprobs(hidden.double(), weight.double(), targets.clamp(min=0),
                                    temperature=temperature, bias=None if bias is None else bias.double())
    loss, _ = reference_pacs_loss(logp, old.double(), rewards, mask, **opts)
    return loss


def grads_of(loss_fn, tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    loss = loss_fn(*leaves)
    return loss, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("backend", ["torch", "triton", "naive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_matches_naive(backend, dtype):
    hidden, weight, bias, targets, mask, old, rewards = make_batch(seed=1, dtype=dtype, with_bias=True)
    settings = dict(beta=0.8, score="log_ratio", advantage="rloo", weighting="balanced")
    expected, expected_grads = grads_of(
        lambda h, w, b: naive_loss(h, w, b, targets, mask, old, rewards, temperature=0.7, group_size=4,
                                   **settings),
        (hidden, weight, bias))
    loss, got = grads_of(
        lambda h, w, b: fused_linear_pacs_loss(h, w, targets, mask, old, rewards, bias=b, group_size=4,
                                               objective=PACS(**settings),
                                               options=LossOptions(temperature=0.7, backend=backend)),
        (hidden, weight, bias))
    assert loss.dtype == torch.float32
    assert [g.dtype for g in got] == [dtype] * 3
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.double(), expected, rtol=tol, atol=tol)
    for g, e in zip(got, expected_grads):
        torch.testing.assert_close(g.double(), e.double(), rtol=tol, atol=tol * e.abs().max().item())
    assert bool((got[0][~mask] == 0).all())  # prompt/padding rows get no gradient


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("objective", [
    PACS(score="mean_logp", advantage="grpo", weighting="none"),
    PACS(score="log_ratio", advantage="naive", weighting="positive_only", score_function_term=True),
])
def test_packed_matches_padded(backend, objective):
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=2)
    b = hidden.shape[0]
    lengths = mask.sum(1) + torch.arange(b) % 2  # each response's slice also holds one masked-out token
    lengths = torch.minimum(lengths + 2, torch.full_like(lengths, hidden.shape[1]))
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    packed = [torch.cat([t[i, :lengths[i]] for i in range(b)]) for t in (hidden, targets, mask, old)]
    padded_mask = mask & (torch.arange(hidden.shape[1])[None, :] < lengths[:, None])
    common = dict(group_size=4, objective=objective, options=LossOptions(backend=backend))
    loss_padded, g_padded = grads_of(
        lambda h, w: fused_linear_pacs_loss(h, w, targets, padded_mask, old, rewards, **common), (hidden, weight))
    loss_packed, g_packed = grads_of(
        lambda h, w: fused_linear_pacs_loss(h, w, packed[1], packed[2], packed[3], rewards, cu_seqlens=cu,
                                            **common), (packed[0], weight))
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_packed[1], g_padded[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_packed[0], torch.cat([g_padded[0][i, :lengths[i]] for i in range(b)]),
                               rtol=1e-4, atol=1e-6)
    # the (1, N, d) row form is the same thing
    loss_row = fused_linear_pacs_loss(packed[0][None], weight, packed[1][None], packed[2][None],
                                      packed[3][None], rewards, cu_seqlens=cu, **common)
    torch.testing.assert_close(loss_row, loss_packed.detach())


def test_packed_matches_reference_float64():
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=3)
    hidden, weight = hidden.double(), weight.double()
    b = hidden.shape[0]
    lengths = mask.sum(1) + mask.int().argmax(1)  # the leading prompt tokens belong to the slice too
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    packed = [torch.cat([t[i, :lengths[i]] for i in range(b)]) for t in (hidden, targets, mask, old)]
    settings = dict(score="mean_logp", advantage="rloo", weighting="balanced")
    expected, e_grads = grads_of(lambda h, w: naive_loss(h, w, None, targets, mask, old, rewards, group_size=4,
                                                         **settings),
                                 (hidden, weight))
    loss, got = grads_of(lambda h, w: fused_linear_pacs_loss(h, w, packed[1], packed[2], packed[3], rewards,
                                                             cu_seqlens=cu, group_size=4, objective=PACS(**settings),
                                                             options=LossOptions(backend="torch")),
                         (packed[0], weight))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-7)  # logp comes back float32
    torch.testing.assert_close(got[1], e_grads[1], rtol=1e-5, atol=1e-6)


class TinyTiedLM(nn.Module):
    """Embedding -> small backbone -> norm; the LM head is the embedding matrix (tied)."""

    def __init__(self, vocab=VOCAB, width=WIDTH):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.norm = nn.LayerNorm(width)

    def hidden_states(self, input_ids):
        x = self.embed(input_ids)
        return self.norm(x + self.block(x))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tied_embeddings_gradient(backend):
    torch.manual_seed(0)
    model = TinyTiedLM()
    _, _, _, targets, mask, old, rewards = make_batch(seed=4)
    input_ids = torch.randint(0, VOCAB, targets.shape)
    loss_fn = PACSLoss(group_size=4, options=LossOptions(temperature=0.9, backend=backend))
    loss = loss_fn(model.hidden_states(input_ids), model.embed.weight, targets, mask, old, rewards)
    loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    hidden = model.hidden_states(input_ids)
    logits = hidden @ model.embed.weight.T / 0.9  # naive: full logits, plain autograd
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    expected = pacs_loss(logp, old, rewards, mask, group_size=4, backend="torch")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the embedding gradient has both parts: rows looked up as inputs, and every row as LM head
    assert bool((got["embed.weight"] != 0).all())


def test_module_matches_function_and_reports_stats():
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=5)
    objective = PACS(beta=2.0, score="mean_logp", advantage="grpo", weighting="negative_only")
    options = LossOptions(temperature=1.3, backend="torch")
    module = PACSLoss(group_size=4, objective=objective, options=options)
    assert "group_size=4" in repr(module) and "mean_logp" in repr(module)
    loss, stats = module(hidden, weight, targets, mask, old, rewards, return_stats=True)
    direct = fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4, objective=objective,
                                    options=options)
    assert loss.item() == direct.item() == stats.loss
    assert 0 <= stats.sigmoid_psi_mean <= 1 and stats.weight_min == 0.0


def test_drop_in_trainer_snippet():
    """The "Drop it into your trainer" snippet of docs/pytorch.md (run as it stands by
    tests/test_docs_code_blocks.py), with one response padded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    G, prompt_len, resp_len = 4, 5, 7
    input_ids = torch.randint(0, 64, (2 * G, prompt_len + resp_len))   # prompt + sampled response
    response_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    response_mask[:, prompt_len:] = True
    response_mask[0, -2:] = False                                        # a shorter response (padding)
    rewards = torch.randint(0, 2, (2 * G,)).float()                     # verifier: 1 = correct
    # --- snippet starts here -------------------------------------------------------------------
    from pacs_kernels import PACS, LossOptions, PACSLoss, linear_logprobs

    loss_fn = PACSLoss(group_size=G, objective=PACS(beta=1.0),           # configure once
                       options=LossOptions(temperature=1.0))

    targets = input_ids[:, 1:]                                           # position t predicts token t+1
    mask = response_mask[:, 1:]                                          # 1 on response tokens only
    lm_head = model.lm_head.weight                                       # (V, d), tied to the embedding here
    with torch.no_grad():                                                # rollout-time policy, once per rollout
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
        old_logp = linear_logprobs(hidden, lm_head, targets)

    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # backbone only: no logits
    loss, stats = loss_fn(hidden, lm_head, targets, mask, old_logp, rewards, return_stats=True)
    loss.backward()
    # --- snippet ends here ---------------------------------------------------------------------
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.grad is not None and bool(torch.isfinite(model.lm_head.weight.grad).all())
    # on the first step logp == old_logp: every psi is 0, the loss is sum_i w_i log 2 / B
    assert stats.psi_mean == pytest.approx(0.0, abs=1e-5)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item() * stats.weight_mean, rel=1e-5)


# ----------------------------------------------------------------------------- bad input


def test_fused_bad_inputs():
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=6)
    call = dict(group_size=4, options=LossOptions(backend="torch"))
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_pacs_loss(hidden[0], weight, targets[0], mask[0], old[0], rewards, **call)
    with pytest.raises(ValueError, match="targets"):
        fused_linear_pacs_loss(hidden, weight, targets[:, :-1], mask, old, rewards, **call)
    with pytest.raises(ValueError, match="old_logp"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old[:-1], rewards, **call)
    with pytest.raises(ValueError, match="rewards"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards[:-1], **call)
    with pytest.raises(ValueError, match="group_size"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=3)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_pacs_loss(hidden, weight[:, :-1], targets, mask, old, rewards, **call)
    with pytest.raises(ValueError, match="targets"):  # a masked token with an id outside the vocabulary
        fused_linear_pacs_loss(hidden, weight, targets.masked_fill(mask, VOCAB), mask, old, rewards, **call)
    with pytest.raises(ValueError, match="backend"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, group_size=4,
                               options=LossOptions(backend="cuda"))
    with pytest.raises(ValueError, match="device"):
        fused_linear_pacs_loss(hidden, weight, targets, mask.to("meta"), old, rewards, **call)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (hidden, targets, mask, old)]
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_linear_pacs_loss(flat[0], weight, flat[1], flat[2], flat[3], rewards,
                               cu_seqlens=torch.arange(9) * 8, **call)
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_pacs_loss(hidden, weight, targets, mask, old, rewards, cu_seqlens=torch.arange(9) * 9,
                               **call)


@pytest.mark.parametrize("configure,error,match", [
    (lambda: PACSLoss(group_size=1), ValueError, "group_size"),
    (lambda: PACSLoss(group_size=4, objective=PACS(score="x")), ValueError, "score"),
    (lambda: PACSLoss(group_size=4, options=LossOptions(temperature=0.0)), ValueError, "temperature"),
    (lambda: PACSLoss(group_size=4, objective=PACS(beta=float("nan"))), ValueError, "beta"),
    (lambda: PACSLoss(group_size=4, options=LossOptions(backend="gpu")), ValueError, "backend"),
    (lambda: PACSLoss(group_size=4, objective=PACS(score_function_term=1)), TypeError, "score_function_term"),
], ids=["group_size", "score", "temperature", "beta", "backend", "score_function_term"])
def test_module_bad_config(configure, error, match):
    with pytest.raises(error, match=match):
        configure()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_all_tokens_selected(backend):
    """A full mask skips the gather; the result is the same as the naive computation."""
    hidden, weight, _, targets, mask, old, rewards = make_batch(seed=7)
    full = torch.ones_like(mask)
    targets = targets.clamp(min=0)
    settings = dict(score="mean_logp", advantage="rloo", weighting="balanced")
    expected, e_grads = grads_of(lambda h, w: naive_loss(h, w, None, targets, full, old, rewards, group_size=4,
                                                         **settings),
                                 (hidden, weight))
    loss, got = grads_of(lambda h, w: fused_linear_pacs_loss(h, w, targets, full.float(), old, rewards, group_size=4,
                                                             objective=PACS(**settings),
                                                             options=LossOptions(backend=backend)),
                         (hidden, weight))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(got, e_grads):
        torch.testing.assert_close(g, e.float(), rtol=1e-4, atol=1e-6)
