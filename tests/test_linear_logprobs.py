"""linear_logprobs: every backend against a float64 reference that materializes the logits."""

from __future__ import annotations

import pytest
import torch
from seeds import stable_seed

from pacs_kernels import linear_logprobs
from pacs_kernels.reference import naive_linear_logprobs

# tolerances on (logp/entropy, gradients relative to the reference's largest entry)
TOL = {torch.float32: (5e-5, 1e-4), torch.bfloat16: (2e-4, 3e-2), torch.float64: (1e-6, 1e-9)}


def _inputs(lead, d, vocab, dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) / d**0.5 * 2).to(dtype)
    bias = (torch.randn(vocab, generator=gen) * 0.5).to(dtype) if with_bias else None
    targets = torch.randint(0, vocab, lead, generator=gen)
    grad_logp = torch.randn(*lead, generator=gen)
    grad_entropy = torch.randn(*lead, generator=gen)
    return hidden, weight, bias, targets, grad_logp, grad_entropy


def _run(backend, hidden, weight, bias, targets, g_l, g_h, *, temperature, entropy, **kw):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    out = linear_logprobs(leaves[0], leaves[1], targets, temperature=temperature, bias=leaves[2],
                          return_entropy=entropy, backend=backend, **kw)
    if entropy:
        logp, ent = out
        (logp * g_l + ent * g_h).sum().backward()
    else:
        logp, ent = out, None
        (logp * g_l).sum().backward()
    grads = [t.grad if t is not None else None for t in leaves]
    return logp, ent, grads


def _reference(hidden, weight, bias, targets, g_l, g_h, *, temperature, entropy):
    return _run_ref(hidden.double(), weight.double(), None if bias is None else bias.double(),
                    targets, g_l.double(), g_h.double(), temperature=temperature, entropy=entropy)


def _run_ref(hidden, weight, bias, targets, g_l, g_h, *, temperature, entropy):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    logp, ent = naive_linear_logprobs(leaves[0], leaves[1], targets, temperature=temperature, bias=leaves[2])
    loss = (logp * g_l).sum() + ((ent * g_h).sum() if entropy else 0.0)
    loss.backward()
    return logp, ent, [t.grad if t is not None else None for t in leaves]


def _assert_close(name, got, ref, dtype, grad=False):
    value_tol, grad_tol = TOL[dtype]
    got = got.double()
    if grad:
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item()
        assert err <= grad_tol * scale + 1e-12, f"{name}: max error {err:.3g} vs scale {scale:.3g}"
    else:
        err = (got - ref).abs().max().item()
        assert err <= value_tol * (1 + ref.abs().max().item()), f"{name}: max error {err:.3g}"


CASES = [
    # backend, dtype
    ("torch", torch.float64),
    ("torch", torch.float32),
    ("torch", torch.bfloat16),
    ("triton", torch.float32),
    ("triton", torch.bfloat16),
    ("naive", torch.float32),
]


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize(
    "lead,d,vocab,with_bias,temperature,entropy",
    [
        ((37,), 48, 131, False, 0.7, True),
        ((3, 11), 40, 97, True, 1.3, True),
        ((2, 9), 33, 70, True, 1.0, False),
    ],
)
def test_matches_float64_reference(backend, dtype, lead, d, vocab, with_bias, temperature, entropy):
    seed = stable_seed(backend, str(dtype), lead, d, vocab) % 10_000
    hidden, weight, bias, targets, g_l, g_h = _inputs(lead, d, vocab, dtype, with_bias, seed)
    kw = {"chunk_elements": 300} if backend == "torch" else {}
    if backend == "triton":
        kw = {"vocab_splits": 2}
    logp, ent, grads = _run(backend, hidden, weight, bias, targets, g_l, g_h,
                            temperature=temperature, entropy=entropy, **kw)
    r_logp, r_ent, r_grads = _reference(hidden, weight, bias, targets, g_l, g_h,
                                        temperature=temperature, entropy=entropy)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # float32, float64 in float64
    assert logp.dtype == out_dtype and logp.shape == lead
    _assert_close("logp", logp, r_logp, dtype)
    if entropy:
        assert ent.dtype == out_dtype and ent.shape == lead
        _assert_close("entropy", ent, r_ent, dtype)
    for name, got, ref, inp in zip(("dhidden", "dweight", "dbias"), grads, r_grads, (hidden, weight, bias)):
        if inp is None:
            continue
        assert got.dtype == inp.dtype, f"{name} must come back in the input dtype"
        _assert_close(name, got, ref, dtype, grad=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("splits_or_chunk", [1, 3, None])
def test_vocab_splitting_and_chunking_do_not_change_results(backend, splits_or_chunk):
    hidden, weight, bias, targets, g_l, g_h = _inputs((29,), 24, 150, torch.float32, True, 7)
    if backend == "torch":
        kw = {"chunk_elements": {1: 29 * 150, 3: 64 * 50, None: None}[splits_or_chunk]}
    else:
        kw = {"vocab_splits": splits_or_chunk}
    logp, ent, grads = _run(backend, hidden, weight, bias, targets, g_l, g_h, temperature=0.9, entropy=True, **kw)
    r_logp, r_ent, r_grads = _reference(hidden, weight, bias, targets, g_l, g_h, temperature=0.9, entropy=True)
    _assert_close("logp", logp, r_logp, torch.float32)
    _assert_close("entropy", ent, r_ent, torch.float32)
    for got, ref in zip(grads, r_grads):
        _assert_close("grad", got, ref, torch.float32, grad=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradient_from_entropy_alone_and_partial_requires_grad(backend):
    hidden, weight, _, targets, _, g_h = _inputs((21,), 32, 77, torch.float32, False, 3)
    h = hidden.clone().requires_grad_()
    _, ent = linear_logprobs(h, weight, targets, return_entropy=True, backend=backend, temperature=0.8)
    (ent * g_h).sum().backward()
    h_ref = hidden.double().requires_grad_()
    _, r_ent = naive_linear_logprobs(h_ref, weight.double(), targets, temperature=0.8)
    (r_ent * g_h.double()).sum().backward()
    _assert_close("dhidden", h.grad, h_ref.grad, torch.float32, grad=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_contiguous_inputs(backend):
    hidden, weight, bias, targets, g_l, g_h = _inputs((4, 6), 40, 90, torch.float32, True, 11)
    hidden_t = hidden.transpose(0, 1).contiguous().transpose(0, 1)  # same values, odd strides
    weight_t = weight.T.contiguous().T
    assert not hidden_t.is_contiguous() and not weight_t.is_contiguous()
    logp, ent, grads = _run(backend, hidden_t, weight_t, bias, targets, g_l, g_h, temperature=1.0, entropy=True)
    r_logp, r_ent, r_grads = _reference(hidden, weight, bias, targets, g_l, g_h, temperature=1.0, entropy=True)
    _assert_close("logp", logp, r_logp, torch.float32)
    for got, ref in zip(grads, r_grads):
        _assert_close("grad", got, ref, torch.float32, grad=True)


@pytest.mark.parametrize("backend", ["torch", "triton", "naive"])
def test_no_grad_path_same_numbers_and_no_graph(backend):
    hidden, weight, bias, targets, _, _ = _inputs((13,), 24, 50, torch.float32, True, 5)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with_graph = linear_logprobs(h, w, targets, bias=bias, backend=backend, return_entropy=True)
    with torch.no_grad():
        without = linear_logprobs(h, w, targets, bias=bias, backend=backend, return_entropy=True)
    for a, b in zip(with_graph, without):
        assert a.grad_fn is not None
        assert b.grad_fn is None and not b.requires_grad
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_non_finite_hidden_only_poisons_its_own_tokens(backend):
    hidden, weight, _, targets, _, _ = _inputs((12,), 24, 60, torch.float32, False, 9)
    hidden[3, 5] = float("nan")
    hidden[7, 0] = float("inf")
    logp, ent = linear_logprobs(hidden, weight, targets, return_entropy=True, backend=backend)
    bad = torch.zeros(12, dtype=torch.bool)
    bad[[3, 7]] = True
    assert not torch.isfinite(logp[bad]).any() and not torch.isfinite(ent[bad]).any()
    r_logp, r_ent = naive_linear_logprobs(hidden.double(), weight.double(), targets)
    torch.testing.assert_close(logp[~bad].double(), r_logp[~bad], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent[~bad].double(), r_ent[~bad], rtol=1e-4, atol=1e-5)


def test_triton_gradient_filtering_skips_negligible_tiles_only():
    hidden, weight, bias, _, g_l, _ = _inputs((40,), 32, 200, torch.float32, True, 13)
    bias[64:] -= 25.0  # vocabulary tiles past 64 hold probabilities ~1e-11: filtering skips them
    targets = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1))
    exact = _run("triton", hidden, weight, bias, targets, g_l, g_l, temperature=1.0, entropy=False)
    filtered = _run("triton", hidden, weight, bias, targets, g_l, g_l, temperature=1.0, entropy=False,
                    filter_eps=1e-6)
    r = _reference(hidden, weight, bias, targets, g_l, g_l, temperature=1.0, entropy=False)
    for got, ref in zip(exact[2], r[2]):
        _assert_close("grad", got, ref, torch.float32, grad=True)
    d_weight_exact, d_weight_filtered = exact[2][1], filtered[2][1]
    # skipped tiles leave exact zeros where the exact gradient is tiny but non-zero
    assert (d_weight_filtered[64:] == 0).all() and (d_weight_exact[64:] != 0).any()
    torch.testing.assert_close(d_weight_filtered[:64], d_weight_exact[:64], rtol=1e-5, atol=1e-6)
    for got, ref in zip(filtered[2], r[2]):
        assert (got.double() - ref).abs().max().item() < 1e-5


def test_vocab_split_never_hits_grid_limits():
    from pacs_kernels.triton.launch_config import SPLIT_ALIGN, vocab_split

    for n_tokens in (1, 37, 65_536, 4_000_000):
        split_size, n_splits = vocab_split(n_tokens, 152_064, torch.device("cpu"), None)
        assert 1 <= n_splits <= 65535 and split_size % SPLIT_ALIGN == 0
        assert (n_splits - 1) * split_size < 152_064 <= n_splits * split_size  # every split starts inside V
    split_size, n_splits = vocab_split(16, 152_064, torch.device("cpu"), 10_000)
    assert n_splits <= 65535 and (n_splits - 1) * split_size < 152_064 <= n_splits * split_size
