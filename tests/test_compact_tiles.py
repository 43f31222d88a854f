"""The single pass's Triton rows holding a tile in 16 bits (what they do on a GPU), run here through
Triton's interpreter: the row kernels' probabilities-by-slice form against float64, the strips and
rebuilt tiles of single_pass(), the whole fused PACS loss with GPU-style tiles, and the memory
accounting (tile_memory) that decides how many tokens a budget holds."""

import pytest
import torch
from test_fused_loss import grads_of, make_batch, naive_loss

from pacs_kernels import GRPO, PACS, LossOptions, fused_linear_pacs_loss
from pacs_kernels.engine import plan as plan_module
from pacs_kernels.engine import single_pass as single_pass_module
from pacs_kernels.engine.plan import MAX_STRIP_ROWS, STRIP_SHARE, Chunk, budget_mib_for_tokens, tile_memory
from pacs_kernels.engine.single_pass import single_pass
from pacs_kernels.reference import naive_linear_logprobs


def needs_interpreter():
    from pacs_kernels import triton as triton_kernels

    if not triton_kernels.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without CUDA")


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_row_kernels_probabilities_by_slice(probs_dtype, softcap):
    """row_lse(probs_out=...) then row_grad_from_probs = the float64 gradient of g * logp, over several
    vocabulary slices, with a slice of -inf logits (a bias masking tokens) and a target of probability
    ~0.99 (1 - p_y would cancel in 16 bits: it is kept in float32)."""
    needs_interpreter()
    from pacs_kernels.triton import softmax_rows

    gen = torch.Generator().manual_seed(31)
    rows, vocab = 4, 2 * softmax_rows.BLOCK_V + 77
    z = 3 * torch.randn(rows, vocab, generator=gen)
    bias = torch.randn(vocab, generator=gen)
    bias[10:softmax_rows.BLOCK_V + 20] = -float("inf")  # one whole slice and parts of two masked
    y = torch.randint(softmax_rows.BLOCK_V + 20, vocab, (rows,), generator=gen)
    if softcap is None:  # row 0: p_y = 0.99, where bf16 storage of p_y alone would err by ~20% on 1 - p_y
        others = torch.cat([z[0, :y[0]], z[0, y[0] + 1:]]) + torch.cat([bias[:y[0]], bias[y[0] + 1:]])
        z[0, y[0]] = 0.8 * (torch.logsumexp(others.double() / 0.8, 0) + torch.log(torch.tensor(99.0))) - bias[y[0]]
    g = torch.randn(rows, generator=gen)
    x = (z.double() + bias.double()).requires_grad_(True)
    zt = (x if softcap is None else softcap * torch.tanh(x / softcap)) / 0.8
    log_p = torch.log_softmax(zt, -1)
    (expected,) = torch.autograd.grad((log_p.gather(1, y[:, None]).squeeze(1) * g.double()).sum(), x)
    expected = torch.nan_to_num(expected)  # d/dx at -inf logits: 0

    logits = z.clone()
    held = softmax_rows.RowProbs.empty(rows, vocab, probs_dtype, z.device,
                                       probs=logits if probs_dtype == torch.float32 else None)  # fp32: in place
    lse, target, entropy = softmax_rows.row_lse(logits, y, bias, 0.8, True, softcap=softcap, probs_out=held)
    p = log_p.exp()
    torch.testing.assert_close(lse.double(), torch.logsumexp(zt, -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(target.double(), zt.gather(1, y[:, None]).squeeze(1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -torch.where(p > 0, p * log_p, 0).sum(-1), rtol=1e-5, atol=1e-5)
    dz = softmax_rows.row_grad_from_probs(held, y, 0.8, lse, g, out=held.probs)
    assert dz.data_ptr() == held.probs.data_ptr() and dz.dtype == probs_dtype
    tol = 1e-5 if probs_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dz.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert bool((dz[:, 10:softmax_rows.BLOCK_V + 20] == 0).all())
    # the target column to 16-bit rounding of its own value, however close p_y is to 1
    got_y, want_y = dz.double().gather(1, y[:, None]), expected.gather(1, y[:, None])
    torch.testing.assert_close(got_y, want_y, rtol=max(2 * tol, 1e-4), atol=0.0)


def linear_chunk_loss(weights):
    """A per-token loss sum_t c_t logp_t (its gradient is c): the single pass without a group loss."""
    def chunk_loss(logp, chunk):
        return (logp * weights[chunk.tok0:chunk.tok1]).sum(), None
    return chunk_loss


@pytest.mark.parametrize("tile_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("budget_tokens,strip_rows", [(None, 3), (None, 1000), (4, 3)])
def test_single_pass_with_sixteen_bit_tiles_matches_float64(tile_dtype, softcap, budget_tokens, strip_rows):
    """single_pass(row_kernels="triton", tile_dtype=16-bit): strips of float32 logits (3 rows: several
    per tile; 1000: one), tiles held as 16-bit probabilities, tiles rebuilt (a 4-token budget on
    7- and 6-token chunks), against float64 autograd of the naive log-probs."""
    needs_interpreter()
    gen = torch.Generator().manual_seed(32)
    n, d, vocab = 13, 24, 1100  # two vocabulary slices, the second ragged
    hidden = torch.randn(n, d, generator=gen)
    weight = 0.5 * torch.randn(vocab, d, generator=gen)
    bias = 0.1 * torch.randn(vocab, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    coef = torch.randn(n, generator=gen, dtype=torch.float64).float()
    chunks = [Chunk(0, 1, 0, 7), Chunk(1, 2, 7, 13)]

    def expected(h, w, b):
        logp, entropy = naive_linear_logprobs(h, w, targets, temperature=0.7, bias=b, softcap=softcap)
        return (logp * coef.double()).sum(), logp, entropy

    leaves = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    want, want_logp, want_entropy = expected(*leaves)
    want_grads = torch.autograd.grad(want, leaves)
    got_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss, _, logp, entropy = single_pass(*got_leaves[:2], targets, bias=got_leaves[2], temperature=0.7, chunks=chunks,
                                         chunk_loss=linear_chunk_loss(coef), with_entropy=True, row_kernels="triton",
                                         softcap=softcap, budget_tokens=budget_tokens, strip_rows=strip_rows,
                                         tile_dtype=tile_dtype)
    got_grads = torch.autograd.grad(loss, got_leaves)
    # log-probs and entropy come from the float32 strips: float32-exact whatever the tile holds
    torch.testing.assert_close(logp.double(), want_logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    for got, ref in zip(got_grads, want_grads):  # dz went through 16 bits
        torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("budget_groups", [1.0, 1 / 3])
def test_fused_pacs_loss_with_gpu_style_tiles(monkeypatch, budget_groups):
    """The whole fused PACS loss as it runs on a GPU (bf16 tiles, strips sized from the budget by
    tile_memory), here with the interpreter: the budget of one group, and a third of one (each group
    in tiles, all but the last rebuilt), against float64 naive logits + the reference loss."""
    needs_interpreter()
    for module in (plan_module, single_pass_module):  # the plan's tile memory and the rows' tiles
        monkeypatch.setattr(module, "tile_dtype_for", lambda device, dtype, rows: torch.bfloat16)
    seen = []

    class RecordingRows(single_pass_module.TritonRows):
        def kept(self, t0, t1, hold=True):
            seen.append(("kept" if hold else "stats", self.tile_dtype, self.in_place))
            return super().kept(t0, t1, hold)

        def rebuilt_dz(self, t0, t1, g):
            seen.append(("rebuilt", self.tile_dtype, self.in_place))
            return super().rebuilt_dz(t0, t1, g)

    monkeypatch.setattr(single_pass_module, "TritonRows", RecordingRows)
    hidden, weight, bias, targets, mask, old, rewards = make_batch(n_groups=3, seed=33, with_bias=True)
    opts = dict(group_size=4, beta=0.8)
    largest = int(mask.reshape(3, -1).sum(1).max())
    budget = budget_mib_for_tokens(-(-int(largest * budget_groups) // 1), weight.shape[0], weight.device,
                                   weight.dtype, row_kernels="triton")
    memory = tile_memory(budget, weight.shape[0], weight.device, weight.dtype, row_kernels="triton")
    assert memory.tile_dtype == torch.bfloat16 and memory.strip_rows >= 1
    want, want_grads = grads_of(lambda h, w, b: naive_loss(h, w, b, targets, mask, old, rewards, temperature=0.7,
                                                           **opts), (hidden, weight, bias))
    options = LossOptions(temperature=0.7, backend="triton", path="single_pass", chunk_budget_mib=budget)
    got, got_grads = grads_of(lambda h, w, b: fused_linear_pacs_loss(
        h, w, targets, mask, old, rewards, bias=b, group_size=4, objective=PACS(beta=0.8), options=options),
        (hidden, weight, bias))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
    for g, e in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), e.double(), rtol=2e-2, atol=2e-2 * e.abs().max().item())
    assert {(dtype, in_place) for _, dtype, in_place in seen} == {(torch.bfloat16, False)}
    assert ("rebuilt" in {kind for kind, _, _ in seen}) == (budget_groups < 1)


def test_tile_memory_on_a_gpu_holds_over_twice_the_tokens():
    """Accounting only (a CUDA device object, no GPU needed): Qwen2.5-7B's head in bf16 at the default
    2 GiB budget. Eager rows: float32 logits + a bf16 dz copy, 6 bytes per logit. Triton rows: the bf16
    tile, 2 bytes per logit, after a float32 strip of 1/4 of the budget."""
    cuda, vocab = torch.device("cuda", 0), 152064
    eager = tile_memory(None, vocab, cuda, torch.bfloat16, row_kernels="torch")
    compact = tile_memory(None, vocab, cuda, torch.bfloat16, row_kernels="triton")
    assert (eager.bytes_per_token, eager.strip_rows, eager.tokens) == (6 * vocab, 0, 2 ** 31 // (6 * vocab))
    assert compact.bytes_per_token == 2 * vocab and compact.tile_dtype == torch.bfloat16
    assert compact.strip_rows == 2 ** 31 // STRIP_SHARE // (4 * vocab)  # 882 rows
    assert compact.tokens == (2 ** 31 - compact.strip_rows * 4 * vocab) // (2 * vocab)
    assert compact.tokens > 2.2 * eager.tokens  # 5,297 vs 2,353
    # soft-capping costs the eager rows a float32 slope row; the Triton rows fold it into the tile
    capped = tile_memory(None, vocab, cuda, torch.bfloat16, softcap=True, row_kernels="torch")
    assert capped.bytes_per_token == 10 * vocab
    assert tile_memory(None, vocab, cuda, torch.bfloat16, softcap=True, row_kernels="triton") == compact
    # large budgets cap the strip; float32 models and the CPU hold float32 logits in place, no strip
    assert tile_memory(65536, vocab, cuda, torch.bfloat16, row_kernels="triton").strip_rows == MAX_STRIP_ROWS
    for device, dtype in ((cuda, torch.float32), (torch.device("cpu"), torch.bfloat16)):
        m = tile_memory(256, vocab, device, dtype, row_kernels="triton")
        assert (m.bytes_per_token, m.strip_rows, m.tile_dtype) == (4 * vocab, 0, torch.float32)


@pytest.mark.parametrize("row_kernels,device,dtype", [
    ("torch", "cpu", torch.float32), ("triton", "cuda", torch.bfloat16), ("torch", "cuda", torch.bfloat16),
    ("triton", "cpu", torch.float64)])
def test_budget_for_tokens_is_the_smallest_that_holds_them(row_kernels, device, dtype):
    for tokens, vocab in ((1, 50), (30, 50), (2300, 152064), (70000, 32000)):
        mib = budget_mib_for_tokens(tokens, vocab, torch.device(device), dtype, row_kernels=row_kernels)
        holds = tile_memory(mib, vocab, torch.device(device), dtype, row_kernels=row_kernels).tokens
        short = tile_memory(mib - 2 ** -10, vocab, torch.device(device), dtype, row_kernels=row_kernels).tokens
        assert holds >= tokens > short


def test_fused_grpo_loss_with_gpu_style_tiles(monkeypatch):
    """GRPO's token-chunked single pass on bf16 tiles (strips from the budget), against float64."""
    needs_interpreter()
    from pacs_kernels import fused_linear_grpo_loss
    from pacs_kernels.reference import reference_grpo_loss

    for module in (plan_module, single_pass_module):  # the plan's tile memory and the rows' tiles
        monkeypatch.setattr(module, "tile_dtype_for", lambda device, dtype, rows: torch.bfloat16)
    hidden, weight, _, targets, mask, old, rewards = make_batch(n_groups=2, seed=34)
    settings = dict(clip_eps=0.1, clip_eps_high=0.3, kl_coef=0.05)
    ref_lp = old + 0.1
    budget = budget_mib_for_tokens(7, weight.shape[0], weight.device, weight.dtype, row_kernels="triton")

    def expected(h, w):
        logp = naive_linear_logprobs(h.double(), w.double(), targets.clamp(min=0))[0]
        return reference_grpo_loss(logp, old.double(), rewards, mask, ref_logp=ref_lp.double(), group_size=4,
                                   **settings)

    want, want_grads = grads_of(expected, (hidden, weight))
    got, got_grads = grads_of(lambda h, w: fused_linear_grpo_loss(
        h, w, targets, mask, old, rewards, ref_logp=ref_lp, group_size=4, objective=GRPO(**settings),
        options=LossOptions(backend="triton", path="single_pass", chunk_budget_mib=budget)), (hidden, weight))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
    for g, e in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), e.double(), rtol=2e-2, atol=2e-2 * e.abs().max().item())


def test_target_coefficient_keeps_its_precision_where_p_rounds_to_one():
    """1 - p_y is summed as the other entries' share, so a target whose probability rounds to 1 in
    float32 (1 - exp(z_y - lse) == 0 there) still gets its true gradient coefficient."""
    needs_interpreter()
    from pacs_kernels.triton import softmax_rows

    vocab = 3000
    z = torch.zeros(2, vocab)
    z[:, 7] = torch.tensor([20.0, 12.0])  # 1 - p_y ~ 6e-6 and ~ 1.8e-2 (a float32 1 - exp(...) loses 1e-2 and all)
    y = torch.tensor([7, 7])
    held = softmax_rows.RowProbs.empty(2, vocab, torch.bfloat16, z.device)
    lse, _, _ = softmax_rows.row_lse(z.clone(), y, None, 1.0, False, probs_out=held)
    exact = 1.0 - torch.softmax(z.double(), -1)[:, 7]
    torch.testing.assert_close(held.target_coef.double(), exact, rtol=1e-5, atol=0.0)
    naive = 1.0 - torch.exp(z[:, 7] - lse)  # what the float32 formula gives: off by over 1% at p ~ 1
    assert float((naive.double() - exact).abs().div(exact)[0]) > 1e-2


def test_tile_precision_study_runs_and_the_new_tiles_cost_no_precision():
    """benchmarks/tile_precision.py at a small shape: its PyTorch emulation follows the kernels, and with
    the GPU's rounding the 16-bit tiles' dz, dh, dW errors stay within 10% of the float32-logits design's,
    the target column no worse."""
    needs_interpreter()
    from benchmarks.tile_precision import measure

    for scale in (1.0, 10.0):
        rows = {(r["arithmetic"], r["design"]): r for r in measure(16, 2100, 32, scale, seed=3)}
        assert all(r["emulation_matches_kernels"] for r in rows.values())
        gpu = "GPU (round to nearest)"
        old, new = rows[(gpu, "float32 logits")], rows[(gpu, "bf16 probabilities")]
        for key in ("dz_rel", "dh_rel", "dw_rel"):
            assert new[key] <= 1.1 * old[key] and new[key] < 5e-3, (scale, key, old[key], new[key])
        assert new["target_col_max_rel"] <= old["target_col_max_rel"] + 1e-12
