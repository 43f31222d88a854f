"""The gradient buffers of the fused paths start uninitialized (no zeroing pass over V x d): the first
product writes them. Where no product runs (no token has a gradient, or no token at all), they must still
come back as zeros, never as whatever memory held; garbage is planted first so that a missed write shows."""

import pytest
import torch

from pacs_kernels import LossOptions, fused_linear_objective_loss, linear_logprobs


def constant_objective(logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
    """A loss that does not depend on the log-probs: no token has a gradient."""
    return torch.tensor(0.5, dtype=logp.dtype), {}


def plant_garbage():
    """Fill freed allocator memory with NaN so that an unwritten torch.empty is likely to show it."""
    for _ in range(4):
        torch.full((1 << 16,), float("nan")).sum()


@pytest.mark.parametrize("path", ["single_pass", "two_pass"])
def test_no_gradient_anywhere_gives_zero_gradients(path):
    torch.manual_seed(0)
    hidden = torch.randn(4, 5, 8, requires_grad=True)
    weight = torch.randn(37, 8, requires_grad=True)
    targets = torch.randint(0, 37, (4, 5))
    plant_garbage()
    loss, _ = fused_linear_objective_loss(hidden, weight, targets, torch.ones(4, 5), None,
                                          torch.tensor([1., 0., 1., 0.]), objective=constant_objective, group_size=2,
                                          options=LossOptions(path=path, backend="torch", chunk_budget_mib=0.001))
    assert float(loss) == 0.5
    if loss.requires_grad:
        loss.backward()
    for name, grad in (("hidden", hidden.grad), ("weight", weight.grad)):
        assert grad is None or torch.equal(grad, torch.zeros_like(grad)), f"d{name} is not zero"


def test_two_passes_with_no_tokens_give_zero_weight_gradient():
    weight = torch.randn(37, 8, requires_grad=True)
    plant_garbage()
    logp = linear_logprobs(torch.zeros(0, 8, requires_grad=True), weight, torch.zeros(0, dtype=torch.long),
                           backend="torch")
    logp.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("chunk_elements", [37 * 3, 37 * 40])  # several token chunks, or one
def test_two_passes_accumulate_after_the_first_write(chunk_elements):
    """dW is written by the first token chunk and added to by the others: equal to float64 autograd."""
    torch.manual_seed(1)
    hidden = torch.randn(23, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (23,))
    upstream = torch.randn(23, dtype=torch.float64)
    plant_garbage()
    logp = linear_logprobs(hidden, weight, targets, backend="torch", chunk_elements=chunk_elements)
    (logp * upstream).sum().backward()
    h_ref, w_ref = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp_ref = torch.log_softmax(h_ref @ w_ref.T, -1).gather(1, targets[:, None])[:, 0]
    (logp_ref * upstream).sum().backward()
    torch.testing.assert_close(hidden.grad, h_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, w_ref.grad, rtol=1e-10, atol=1e-12)
