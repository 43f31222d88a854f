"""The one-sweep known-gradient path equals the usual forward + backward."""

from __future__ import annotations

import pytest
import torch
from seeds import stable_seed

from pacs_kernels import linear_logprobs, linear_logprobs_known_grad


def _inputs(dtype, seed=0, lead=(3, 13), d=40, vocab=101):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, d, generator=g).to(dtype)
    weight = (torch.randn(vocab, d, generator=g) / d**0.5 * 2).to(dtype)
    bias = (torch.randn(vocab, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, vocab, lead, generator=g)
    grad_logp = torch.randn(*lead, generator=g)
    return hidden, weight, bias, targets, grad_logp


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("torch", torch.float32),
                                           ("triton", torch.float32), ("triton", torch.bfloat16)])
def test_one_sweep_equals_forward_then_backward(backend, dtype):
    hidden, weight, bias, targets, grad_logp = _inputs(dtype, seed=stable_seed(backend, str(dtype)) % 1000)
    temperature = 0.8
    with torch.no_grad():
        old_logp, lse = linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                        backend=backend, return_lse=True)
    # the usual path
    h1, w1, b1 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp = linear_logprobs(h1, w1, targets, bias=b1, temperature=temperature, backend=backend)
    (logp * grad_logp).sum().backward()
    # the fast path, with an upstream gradient of 2 on the surrogate
    h2, w2, b2 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    surrogate, fast_logp = linear_logprobs_known_grad(h2, w2, targets, grad_logp, lse, bias=b2,
                                                      temperature=temperature, backend=backend)
    (2 * surrogate).backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast_logp, old_logp, **tol)
    torch.testing.assert_close(fast_logp, logp.detach(), **tol)
    torch.testing.assert_close(surrogate, (grad_logp * logp.detach()).sum(), rtol=1e-4, atol=1e-3)
    for fast, slow in ((h2.grad, h1.grad), (w2.grad, w1.grad), (b2.grad, b1.grad)):
        assert fast.dtype == dtype
        scale = slow.abs().max()
        torch.testing.assert_close(fast.double() / scale, 2 * slow.double() / scale,
                                   rtol=0, atol=3e-2 if dtype == torch.bfloat16 else 1e-5)


def test_return_lse_matches_the_logsumexp_of_the_logits():
    hidden, weight, bias, targets, _ = _inputs(torch.float64)
    for backend in ("torch", "triton", "naive"):
        h, w, b = (t.float() for t in (hidden, weight, bias))
        logp, entropy, lse = linear_logprobs(h, w, targets, bias=b, temperature=1.3, backend=backend,
                                             return_entropy=True, return_lse=True)
        expected = torch.logsumexp((hidden @ weight.T + bias) / 1.3, -1)
        torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-5)
        assert not lse.requires_grad


def test_bad_inputs_name_the_argument():
    hidden, weight, bias, targets, grad_logp = _inputs(torch.float32)
    lse = torch.zeros_like(grad_logp)
    with pytest.raises(ValueError, match="lse must have the shape of targets"):
        linear_logprobs_known_grad(hidden, weight, targets, grad_logp, lse[:, :4])
    with pytest.raises(ValueError, match="grad_logp must have the shape of targets"):
        linear_logprobs_known_grad(hidden, weight, targets, grad_logp.reshape(-1), lse)
    with pytest.raises(TypeError, match="lse must have dtype"):
        linear_logprobs_known_grad(hidden, weight, targets, grad_logp, lse.long())
    with pytest.raises(ValueError, match="backend='naive' has no known-gradient fast path"):
        linear_logprobs_known_grad(hidden, weight, targets, grad_logp, lse, backend="naive")
    with pytest.raises(ValueError, match="targets must lie in"):
        linear_logprobs_known_grad(hidden, weight, targets + 1000, grad_logp, lse)
