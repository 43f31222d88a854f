"""Every bad input to linear_logprobs raises the documented error, naming the argument."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pacs_kernels import linear_logprobs

N, D, V = 6, 8, 20


def _ok():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randn(V, D, generator=g), torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda h, w, y: (h, w, y + V), ValueError, r"targets must lie in \[0, 20\)"),
        (lambda h, w, y: (h, w, y - V), ValueError, r"targets must lie in \[0, 20\)"),
        (lambda h, w, y: (h, w, y.float()), TypeError, "targets must have dtype"),
        (lambda h, w, y: (h[:, :5], w, y), ValueError, "hidden's last dimension must equal weight.shape"),
        (lambda h, w, y: (h, w, y[:4]), ValueError, "targets must have shape"),
        (lambda h, w, y: (h, w[None], y), ValueError, "weight must be 2-dimensional"),
        (lambda h, w, y: (h.double(), w, y), TypeError, "hidden and weight must share a dtype"),
        (lambda h, w, y: (h.int(), w, y), TypeError, "hidden must have dtype"),
        (lambda h, w, y: (h.numpy(), w, y), TypeError, "hidden must be a torch.Tensor"),
        (lambda h, w, y: (h, w.to("meta"), y), ValueError, "all tensors must be on one device"),
    ],
)
def test_bad_tensors(mutate, exc, match):
    h, w, y = mutate(*_ok())
    with pytest.raises(exc, match=match):
        linear_logprobs(h, w, y)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_value(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        linear_logprobs(*_ok(), temperature=temperature)


@pytest.mark.parametrize("temperature", ["1.0", None, True])
def test_bad_temperature_type(temperature):
    with pytest.raises(TypeError, match="temperature must be a positive number"):
        linear_logprobs(*_ok(), temperature=temperature)


def test_bad_bias():
    h, w, y = _ok()
    with pytest.raises(ValueError, match=r"bias must have shape \(V,\) = \(20,\)"):
        linear_logprobs(h, w, y, bias=torch.zeros(V + 1))
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        linear_logprobs(h, w, y, bias=torch.zeros(V, device="meta"))


def test_unknown_backend_and_bad_options():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'torch', 'naive'; got 'cuda'"):
        linear_logprobs(*_ok(), backend="cuda")
    with pytest.raises(ValueError, match="filter_eps"):
        linear_logprobs(*_ok(), filter_eps=-1.0)
    with pytest.raises(ValueError, match="chunk_elements"):
        linear_logprobs(*_ok(), chunk_elements=0)
    with pytest.raises(ValueError, match="vocab_splits"):
        linear_logprobs(*_ok(), vocab_splits=0)


def test_triton_float64_is_refused_with_advice():
    h, w, y = _ok()
    with pytest.raises(TypeError, match="use backend='torch' for float64"):
        linear_logprobs(h.double(), w.double(), y, backend="triton")


def test_triton_on_cpu_without_interpreter_says_how_to_fix():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch; from pacs_kernels import linear_logprobs\n"
        "try:\n"
        "    linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), backend='triton')\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "ERR backend='triton' needs CUDA tensors" in out.stdout, out.stdout + out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout


def test_sharded_dtensor_head_is_refused_with_the_fix():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pacs_kernels import fused_linear_pacs_loss

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.randn(11, 4), mesh, [Shard(0)])
        hidden, targets = torch.randn(2, 3, 4), torch.randint(0, 11, (2, 3))
        with pytest.raises(TypeError, match="weight is a DTensor.*full_tensor"):
            linear_logprobs(hidden, weight, targets)
        with pytest.raises(TypeError, match="weight is a DTensor"):
            fused_linear_pacs_loss(hidden, weight, targets, torch.ones(2, 3), None, torch.tensor([0.0, 1.0]),
                                   group_size=2)
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["torch", "naive", "triton"])
def test_a_non_finite_hidden_state_gives_nan_on_every_backend(backend):
    """One documented rule for inf and NaN in a hidden state (issue #26): NaN for that token's log-prob,
    entropy and lse on every backend (+inf gave -inf on torch and NaN on naive; -inf, -inf on torch and NaN
    on Triton); the other tokens keep their values."""
    h, w, y = _ok()
    w[:, 0] = 1.0
    w[y[1], 0] = -1.0  # +inf in column 0: the target's logit -inf, every other +inf
    w[y[2], 0] = 1.0
    h[1, 0], h[2, 0], h[3, 0] = float("inf"), float("-inf"), float("nan")
    logp, entropy, lse = linear_logprobs(h, w, y, backend=backend, return_entropy=True, return_lse=True)
    for out in (logp, entropy, lse):
        assert torch.isnan(out[1:4]).all(), (backend, out)
        assert torch.isfinite(out[[0, 4, 5]]).all(), (backend, out)
    finite = linear_logprobs(h[[0, 4, 5]], w, y[[0, 4, 5]], backend="torch")
    torch.testing.assert_close(logp[[0, 4, 5]], finite, rtol=1e-5, atol=1e-5)
    leaf = h.clone().requires_grad_(True)
    linear_logprobs(leaf, w, y, backend=backend)[[0, 4, 5]].sum().backward()
    assert torch.isfinite(leaf.grad[[0, 4, 5]]).all()
