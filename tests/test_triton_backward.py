"""The atomic-free Triton backward (dz kernel + dh/dW matmul kernels) against float64 autograd.

Runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1): tiles are 16 tokens x 32
vocabulary columns there, so the shapes below have ragged edges, several vocabulary tiles,
several token blocks and, with ``chunk_tokens``, several dz chunks.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pacs_kernels import dispatch
from pacs_kernels.reference import naive_linear_logprobs
from pacs_kernels.triton import grad_matmuls, launch_config, logprob_backward
from pacs_kernels.triton.grad_matmuls import grouped_tile

GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the reference's largest entry


def _problem(n, d, vocab, dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) / d**0.5 * 2).to(dtype)
    bias = (torch.randn(vocab, generator=gen) * 0.5).to(dtype) if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    grad_logp = torch.randn(n, generator=gen)
    grad_entropy = torch.randn(n, generator=gen)
    return hidden, weight, bias, targets, grad_logp, grad_entropy


def _reference(hidden, weight, bias, targets, grad_logp, grad_entropy, temperature):
    """float64 autograd through the materialized logits: (logp, lse, entropy, [dh, dW, db])."""
    leaves = [None if t is None else t.double().requires_grad_() for t in (hidden, weight, bias)]
    logp, entropy = naive_linear_logprobs(leaves[0], leaves[1], targets, temperature=temperature, bias=leaves[2])
    loss = (logp * grad_logp.double()).sum()
    if grad_entropy is not None:
        loss = loss + (entropy * grad_entropy.double()).sum()
    loss.backward()
    with torch.no_grad():
        logits = leaves[0] @ leaves[1].T + (0 if bias is None else leaves[2])
        lse = torch.logsumexp(logits / temperature, -1)
    return logp.detach(), lse, entropy.detach(), [None if t is None else t.grad for t in leaves]


def _assert_grad(name, got, ref, dtype):
    assert got.dtype == dtype, f"{name} must come back in the input dtype {dtype}, got {got.dtype}"
    scale = ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= GRAD_TOL[dtype] * scale + 1e-12, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


CASES = [
    # n, d, vocab, dtype, bias, temperature, entropy grads, chunk_tokens
    (37, 48, 131, torch.float32, True, 0.7, True, None),
    (37, 48, 131, torch.bfloat16, False, 0.7, False, None),
    (70, 40, 150, torch.float32, True, 1.3, True, 32),
    (70, 40, 150, torch.bfloat16, True, 1.0, True, 16),
    # every tile full (d, V and the chunks multiples of the interpreter's tiles): the unmasked loops
    (64, 48, 96, torch.float32, True, 0.9, True, 32),
    (64, 48, 96, torch.bfloat16, False, 1.0, True, None),
]


@pytest.mark.parametrize("gemms", ["triton", "torch"])
@pytest.mark.parametrize("n,d,vocab,dtype,with_bias,temperature,with_entropy,chunk_tokens", CASES)
def test_backward_matches_float64_autograd(n, d, vocab, dtype, with_bias, temperature, with_entropy, chunk_tokens,
                                           gemms):
    """Both GEMM engines on the staged dz chunks: the Triton kernels, and torch.mm (cuBLAS on CUDA)."""
    hidden, weight, bias, targets, g_l, g_h = _problem(n, d, vocab, dtype, with_bias, seed=n + d + vocab)
    g_h = g_h if with_entropy else None
    r_logp, r_lse, r_ent, r_grads = _reference(hidden, weight, bias, targets, g_l, g_h, temperature)
    logp_out = torch.full((n,), float("nan"))
    grads = logprob_backward(hidden, weight, targets, bias, temperature, r_lse.float(),
                             r_ent.float() if with_entropy else None, g_l, g_h,
                             needs=(True, True, True), logp_out=logp_out, chunk_tokens=chunk_tokens, gemms=gemms)
    for name, got, ref, inp in zip(("dhidden", "dweight", "dbias"), grads, r_grads, (hidden, weight, bias)):
        if inp is None:
            assert got is None
            continue
        _assert_grad(name, got, ref, dtype)
    value_tol = 5e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logp_out.double(), r_logp, rtol=0, atol=value_tol * (1 + r_logp.abs().max().item()))


@pytest.mark.parametrize("gemms", ["triton", "torch"])
@pytest.mark.parametrize("needs", [(False, True, False), (True, False, False), (False, False, True),
                                   (True, True, False)])
def test_partial_needs_compute_only_what_is_asked(needs, gemms):
    hidden, weight, bias, targets, g_l, g_h = _problem(45, 24, 100, torch.float32, True, seed=5)
    _, r_lse, r_ent, r_grads = _reference(hidden, weight, bias, targets, g_l, g_h, 0.9)
    grads = logprob_backward(hidden, weight, targets, bias, 0.9, r_lse.float(), r_ent.float(), g_l, g_h,
                             needs=needs, chunk_tokens=16, gemms=gemms)
    for name, need, got, ref in zip(("dhidden", "dweight", "dbias"), needs, grads, r_grads):
        if need:
            _assert_grad(name, got, ref, torch.float32)
        else:
            assert got is None, f"{name} was not asked for"


def test_entropy_gradient_alone():
    hidden, weight, _, targets, _, g_h = _problem(33, 24, 90, torch.float32, False, seed=8)
    _, r_lse, r_ent, r_grads = _reference(hidden, weight, None, targets, torch.zeros(33), g_h, 1.1)
    grads = logprob_backward(hidden, weight, targets, None, 1.1, r_lse.float(), r_ent.float(), None, g_h,
                             needs=(True, True, False))
    _assert_grad("dhidden", grads[0], r_grads[0], torch.float32)
    _assert_grad("dweight", grads[1], r_grads[1], torch.float32)


def test_no_upstream_gradient_gives_zeros_and_still_writes_logp():
    hidden, weight, bias, targets, _, _ = _problem(21, 16, 70, torch.float32, True, seed=2)
    r_logp, r_lse, _, _ = _reference(hidden, weight, bias, targets, torch.zeros(21), None, 1.0)
    logp_out = torch.full((21,), float("nan"))
    d_h, d_w, d_b = logprob_backward(hidden, weight, targets, bias, 1.0, r_lse.float(), None, None, None,
                                     needs=(True, True, True), logp_out=logp_out)
    assert (d_h == 0).all() and (d_w == 0).all() and (d_b == 0).all()
    assert d_h.shape == hidden.shape and d_w.shape == weight.shape and d_b.shape == bias.shape
    torch.testing.assert_close(logp_out.double(), r_logp, rtol=0, atol=1e-5)


def test_two_runs_are_bitwise_equal():
    hidden, weight, bias, targets, g_l, g_h = _problem(70, 40, 150, torch.bfloat16, True, seed=3)
    _, r_lse, r_ent, _ = _reference(hidden, weight, bias, targets, g_l, g_h, 0.8)
    runs = [logprob_backward(hidden, weight, targets, bias, 0.8, r_lse.float(), r_ent.float(), g_l, g_h,
                             needs=(True, True, True), chunk_tokens=32) for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_chunking_changes_only_the_summation_order():
    hidden, weight, bias, targets, g_l, g_h = _problem(70, 40, 150, torch.float32, True, seed=4)
    _, r_lse, r_ent, r_grads = _reference(hidden, weight, bias, targets, g_l, g_h, 1.0)
    one = logprob_backward(hidden, weight, targets, bias, 1.0, r_lse.float(), r_ent.float(), g_l, g_h)
    many = logprob_backward(hidden, weight, targets, bias, 1.0, r_lse.float(), r_ent.float(), g_l, g_h,
                            chunk_tokens=16)
    torch.testing.assert_close(one[0], many[0], rtol=0, atol=0)  # dh: one owner, same order either way
    for a, b, ref in zip(one[1:], many[1:], r_grads[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_filtering_skips_whole_tiles_across_chunks():
    hidden, weight, bias, _, g_l, _ = _problem(50, 24, 160, torch.float32, True, seed=6)
    bias[64:] -= 25.0  # probabilities ~1e-11 past column 64: those dz tiles are negligible
    targets = torch.randint(0, 64, (50,), generator=torch.Generator().manual_seed(1))
    _, r_lse, _, r_grads = _reference(hidden, weight, bias, targets, g_l, None, 1.0)
    exact = logprob_backward(hidden, weight, targets, bias, 1.0, r_lse.float(), None, g_l, None, chunk_tokens=32)
    filtered = logprob_backward(hidden, weight, targets, bias, 1.0, r_lse.float(), None, g_l, None,
                                chunk_tokens=32, filter_eps=1e-6)
    assert (filtered[1][64:] == 0).all() and (exact[1][64:] != 0).any()
    assert (filtered[2][64:] == 0).all() and (exact[2][64:] != 0).any()
    torch.testing.assert_close(filtered[1][:64], exact[1][:64], rtol=0, atol=0)
    for got, ref in zip(filtered, r_grads):
        assert (got.double() - ref).abs().max().item() < 1e-5


def test_filtering_always_runs_the_triton_gemms_and_a_bad_engine_is_named():
    """Only the Triton GEMMs skip the flagged tiles: asking for torch.mm with filter_eps gets them anyway."""
    hidden, weight, bias, _, g_l, _ = _problem(50, 24, 160, torch.float32, True, seed=6)
    bias[64:] -= 25.0
    targets = torch.randint(0, 64, (50,), generator=torch.Generator().manual_seed(1))
    _, r_lse, _, _ = _reference(hidden, weight, bias, targets, g_l, None, 1.0)
    runs = [logprob_backward(hidden, weight, targets, bias, 1.0, r_lse.float(), None, g_l, None, chunk_tokens=32,
                             filter_eps=1e-6, gemms=gemms) for gemms in ("triton", "torch")]
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    assert (runs[1][1][64:] == 0).all()
    with pytest.raises(ValueError, match="gemms must be None or one of .*got 'cublas'"):
        logprob_backward(hidden, weight, targets, bias, 1.0, r_lse.float(), None, g_l, None, gemms="cublas")


def test_the_engine_comes_from_dispatch_when_not_given(monkeypatch):
    """gemms=None asks dispatch.grad_gemms (here faked to pick each engine): that engine's results."""
    hidden, weight, bias, targets, g_l, g_h = _problem(70, 40, 150, torch.bfloat16, True, seed=9)
    _, r_lse, r_ent, _ = _reference(hidden, weight, bias, targets, g_l, g_h, 1.0)
    args = (hidden, weight, targets, bias, 1.0, r_lse.float(), r_ent.float(), g_l, g_h)
    by_engine = {gemms: logprob_backward(*args, chunk_tokens=32, gemms=gemms) for gemms in ("triton", "torch")}
    assert not torch.equal(by_engine["triton"][1], by_engine["torch"][1])  # bf16 roundings differ: distinguishable
    for gemms in ("triton", "torch"):
        monkeypatch.setattr(dispatch, "grad_gemms", lambda *args, chosen=gemms, **kwargs: chosen)
        for got, expected in zip(logprob_backward(*args, chunk_tokens=32), by_engine[gemms]):
            assert torch.equal(got, expected)


def test_gpu_tiles_fit_the_kernels_constraints(monkeypatch):
    """Every GPU candidate's matmul tile divides the dz tile (filter flags), and every forward
    BLOCK_V divides the split alignment; checked on the CPU by switching the config lists over."""
    monkeypatch.setattr(launch_config, "INTERPRETED", False)
    dz_n, dz_v = launch_config.DZ_TILE_GPU
    for cfg in launch_config.grad_matmul_configs():
        assert dz_n % cfg.kwargs["BLOCK_M"] == 0 and dz_v % cfg.kwargs["BLOCK_M"] == 0
        assert dz_n % cfg.kwargs["BLOCK_K"] == 0 and dz_v % cfg.kwargs["BLOCK_K"] == 0
    for cfg in launch_config.forward_configs():
        assert launch_config.SPLIT_ALIGN % cfg.kwargs["BLOCK_V"] == 0
    assert len(launch_config.dz_configs()) > 1
    monkeypatch.setattr(launch_config, "INTERPRETED", True)
    for get in (launch_config.forward_configs, launch_config.dz_configs, launch_config.grad_matmul_configs):
        assert len(get()) == 1  # the interpreter never autotunes
    cfg = launch_config.grad_matmul_configs()[0].kwargs
    dz_n, dz_v = launch_config.DZ_TILE_INTERPRETER
    assert dz_n % cfg["BLOCK_M"] == 0 and dz_v % cfg["BLOCK_M"] == 0 and dz_n % cfg["BLOCK_K"] == 0


def test_chunk_size_respects_the_budget():
    from pacs_kernels.triton.launch_config import DZ_BLOCK_N, DZ_CHUNK_BYTES, dz_chunk_tokens

    chunk = dz_chunk_tokens(65_536, 152_064, 2)
    assert chunk % DZ_BLOCK_N == 0 and chunk * 152_064 * 2 <= DZ_CHUNK_BYTES
    assert dz_chunk_tokens(37, 131, 4) == 37  # everything fits: one chunk of all tokens
    assert dz_chunk_tokens(100, 10, 4, chunk_tokens=1) == DZ_BLOCK_N  # at least one token block
    assert dz_chunk_tokens(100, 10, 4, chunk_tokens=3 * DZ_BLOCK_N + 1) == 3 * DZ_BLOCK_N


def test_views_with_strides_too_large_for_int32_tile_offsets_are_copied_not_misaddressed(monkeypatch):
    """Offsets inside a tile are int32 on the GPU: a hidden-state view whose row stride times a block
    overflows them (a slice of a much wider buffer) is copied first, by both kernels' wrappers, and
    gives the same log-probs and gradients. (The interpreter computes offsets without overflow, so
    the guard itself is checked directly, and the wrappers are checked to call it.)"""
    import importlib

    from pacs_kernels import linear_logprobs
    from pacs_kernels.triton import launch_config

    forward_module = importlib.import_module("pacs_kernels.triton.logprob_forward")
    backward_module = importlib.import_module("pacs_kernels.triton.logprob_backward")

    n, d, vocab, row_stride = 3, 24, 40, 2**24  # 255 * 2**24 > 2**31
    gen = torch.Generator().manual_seed(5)
    storage = torch.zeros((n - 1) * row_stride + d, dtype=torch.bfloat16)
    wide = storage.as_strided((n, d), (row_stride, 1))
    wide.copy_(torch.randn(n, d, generator=gen).to(torch.bfloat16))
    weight = (torch.randn(vocab, d, generator=gen) / d**0.5).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), generator=gen)

    copied = launch_config.with_int32_tile_offsets("hidden", wide)
    assert copied.is_contiguous() and torch.equal(copied, wide)
    assert launch_config.with_int32_tile_offsets("weight", weight) is weight  # no copy when it fits

    guarded = []
    for module in (forward_module, backward_module):
        def spy(name, tensor, module=module):
            guarded.append((module.__name__.rsplit(".", 1)[-1], name, tensor.stride(0)))
            return launch_config.with_int32_tile_offsets(name, tensor)
        monkeypatch.setattr(module, "with_int32_tile_offsets", spy)
    results = []
    for hidden in (wide, wide.contiguous()):
        leaf = hidden.detach().requires_grad_()
        logp = linear_logprobs(leaf, weight, targets, backend="triton")
        logp.sum().backward()
        results.append((logp.detach(), leaf.grad))
    assert {("logprob_forward", "hidden", row_stride), ("logprob_backward", "hidden", row_stride),
            ("logprob_forward", "weight", d), ("logprob_backward", "weight", d)} <= set(guarded)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def test_a_width_beyond_int32_tile_offsets_is_refused_by_name():
    from pacs_kernels.triton.launch_config import with_int32_tile_offsets

    too_wide = torch.empty(2, 2**31 // 255 + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight of shape .* too wide for the Triton kernels' int32 offsets"):
        with_int32_tile_offsets("weight", too_wide)


def test_autotuner_hooks_keep_accumulated_outputs_and_skip_absent_ones():
    """The dW kernel adds into dW and db; while the autotuner races candidates (GPU only) each timed launch
    must leave them as they were. Its hooks copy and put back what is there and skip an output that is None
    (a head without bias: Triton 3.6's restore_value would call None.clone() at the first backward)."""
    from pacs_kernels.triton.grad_matmuls import dw_kernel

    assert dw_kernel.user_defined_pre_hook and dw_kernel.user_defined_post_hook and not dw_kernel.restore_value
    for db in (None, torch.randn(5)):
        dw = torch.randn(5, 3)
        args = {"dz_ptr": torch.randn(4, 5), "hidden_ptr": torch.randn(4, 3), "dw_ptr": dw, "db_ptr": db}
        before_dw, before_db = dw.clone(), None if db is None else db.clone()
        dw_kernel.pre_hook(args)                     # what Triton's _bench does around each timed launch
        dw.add_(1.0)                                 # the candidate's accumulation into the buffers
        if db is not None:
            db.add_(1.0)
        dw_kernel.post_hook(args, exception=None)
        torch.testing.assert_close(dw, before_dw, rtol=0, atol=0)
        if db is not None:
            torch.testing.assert_close(db, before_db, rtol=0, atol=0)
        dw_kernel.pre_hook(args, reset_only=True)    # after the race, before the winner's real launch
        dw.add_(1.0)
        dw_kernel.post_hook(args, exception=None)    # nothing saved: the real launch's result stays
        torch.testing.assert_close(dw, before_dw + 1.0, rtol=0, atol=0)
    dw_kernel.pre_hook({"dw_ptr": None, "db_ptr": None})  # dW not wanted and no bias: nothing to keep
    dw_kernel.post_hook({"dw_ptr": None, "db_ptr": None}, exception=None)


@triton.jit
def _tile_order_kernel(out_ptr, n_rows, n_cols, GROUP_ROWS: tl.constexpr):
    row, col = grouped_tile(tl.program_id(0), n_rows, n_cols, GROUP_ROWS)
    tl.store(out_ptr + 2 * tl.program_id(0), row)
    tl.store(out_ptr + 2 * tl.program_id(0) + 1, col)


@pytest.mark.parametrize("n_rows,n_cols,group", [(10, 4, 3), (7, 5, 8), (1, 3, 2), (9, 1, 3), (8, 28, 8)])
def test_gradient_matmuls_walk_their_tiles_in_bands_of_rows(n_rows, n_cols, group):
    """Program p of the dh / dW grids owns tile grouped_tile(p): every tile exactly once, bands of ``group``
    rows (the last may be narrower), the row fastest inside a band: the programs sharing a row's operand
    strip (dW: the d tiles of one dz strip) run close together."""
    order = torch.full((n_rows * n_cols, 2), -1, dtype=torch.int32)
    _tile_order_kernel[(n_rows * n_cols,)](order, n_rows, n_cols, GROUP_ROWS=group)
    expected = []
    for first in range(0, n_rows, group):
        rows = range(first, min(first + group, n_rows))
        expected += [(row, col) for col in range(n_cols) for row in rows]
    assert [tuple(pair) for pair in order.tolist()] == expected
    assert sorted(expected) == [(row, col) for row in range(n_rows) for col in range(n_cols)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_program_order_leaves_the_gradients_bitwise_unchanged(monkeypatch, dtype):
    """The band width only decides which program runs when: dh, dW and db (several chunks, so dW and db
    accumulate in float32) are bitwise the same for bands of 1 row (columns fastest), the default and
    more rows than the grid has (rows fastest: the order before bands), and match float64 autograd."""
    hidden, weight, bias, targets, grad_logp, _ = _problem(70, 40, 150, dtype, True, seed=7)
    ref_logp, ref_lse, _, ref_grads = _reference(hidden, weight, bias, targets, grad_logp, None, 1.0)
    results = {}
    for group in (1, launch_config.GRAD_GROUP_ROWS, 1000):
        monkeypatch.setattr(grad_matmuls, "GRAD_GROUP_ROWS", group)
        results[group] = logprob_backward(hidden, weight, targets, bias, 1.0, ref_lse.float(), None, grad_logp,
                                          None, chunk_tokens=32, gemms="triton")
    first, *others = results.values()
    for other in others:
        for got, expected in zip(other, first):
            assert torch.equal(got, expected)
    for name, got, ref in zip(("dh", "dW", "db"), first, ref_grads):
        _assert_grad(name, got, ref, dtype)
