"""Single pass: a group-coupled loss and its gradients from ONE logits GEMM per chunk.

The two-pass design (``linear_logprobs`` then its backward) builds every logits tile twice:
4 (N x V x d) matmuls. But the PACS loss of a response depends only on the log-probs of its own
group, so a chunk of tokens that holds WHOLE groups can do everything from one logits tile:

    z    = (h @ W.T + b) / tau                 one GEMM, float32 result        (C, V)
    lse  = log sum_v exp(z_v);   logp = z[y] - lse
    g    = dloss_chunk / dlogp                 the small group loss, by autograd on C scalars
    dz   = g * (onehot(y) - softmax(z)) / tau  in place over the logits buffer
    dh   = dz @ W;   dW += dz.T @ h;   db += sum_tokens dz       two more GEMMs

three matmuls in all, the count of the naive implementation, with memory bounded by the chunk
(C x V float32, plus a low-precision copy of dz for the GEMMs on a GPU) instead of N x V. The
gradients are produced in the forward and handed to autograd: the returned loss's backward only
scales them by the upstream gradient. Losses that are per response (GRPO) can use any chunking
that keeps responses whole; their chunk loss only needs the global normaliser, known up front.

A group bigger than the budget (long responses) cannot hold all its logits at once. It is cut
into n tiles within the budget; the last tile's logits are kept, the others keep only their row
statistics and are built again once g is known: 3 + (n - 1) / n matmuls, never more than the 4 of
two passes, with memory bounded by the budget whatever the group size.

Entropy (optional, for statistics): H = lse - sum_v p_v z_v, computed in row slices before the
logits buffer is turned into probabilities.

Per-token gradients below ``TINY_GRAD`` (2^-100) are flushed to 0 before they multiply the
probabilities: products of such values are float32 denormals, which slow every GEMM on many
x86 CPUs by 10-100x, and a gradient that small changes no optimizer step (Adam's eps is 1e-8).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .forward_grads import scaled_saved_grads
from .matmul import addmm_f32_, compute_dtype, gemm_in_input_dtype, mm_f32, mm_into, operand
from .torch_chunked import apply_softcap_, softcap_slope

TINY_GRAD = 2.0 ** -100
DEFAULT_CHUNK_BUDGET_MIB = {"cpu": 256.0, "cuda": 2048.0}  # by device type; others: the CPU's


def default_chunk_budget_mib(device: torch.device) -> float:
    """The chunk budget when the caller gives none: 256 MiB on the CPU, 2 GiB on CUDA. A GPU chunk
    must hold enough tokens (about 2,300 at V = 152k, float32 logits + a bf16 copy) for its GEMMs to
    outweigh streaming W and the float32 dW once per chunk: benchmarks/roofline.py predicts 1.5x the
    3-matmul floor at 256 MiB on an H200 (memory-bound) and 1.17x from about 1.5 GiB."""
    return DEFAULT_CHUNK_BUDGET_MIB.get(torch.device(device).type, DEFAULT_CHUNK_BUDGET_MIB["cpu"])
ENTROPY_ROWS = 64  # rows per slice of the optional entropy pass (bounds its temporary)


@dataclass(frozen=True)
class Chunk:
    """Tokens tok0:tok1 of the selected-token layout; r0:r1 the responses that own them (whole
    responses for group chunks, possibly cut at the ends for token chunks)."""

    r0: int
    r1: int
    tok0: int
    tok1: int


def bytes_per_token(vocab: int, device: torch.device, dtype: torch.dtype, softcap: bool = False) -> int:
    """Working memory of one token of a chunk: its row of float32 logits (float64 for float64),
    plus a low-precision copy of its dz row where the GEMMs run in the input dtype, plus the
    soft-cap's slope row when the logits are soft-capped."""
    per_logit = torch.finfo(compute_dtype(dtype)).bits // 8
    if softcap:
        per_logit *= 2
    if gemm_in_input_dtype(device, dtype):
        per_logit += torch.finfo(dtype).bits // 8
    return vocab * per_logit


def max_chunk_tokens(budget_mib: float | None, vocab: int, device: torch.device, dtype: torch.dtype,
                     softcap: bool = False) -> int:
    """How many tokens one chunk may hold within ``budget_mib`` MiB of working memory (None: the
    device's default, :func:`default_chunk_budget_mib`)."""
    if budget_mib is None:
        budget_mib = default_chunk_budget_mib(device)
    return int(budget_mib * 2 ** 20) // bytes_per_token(vocab, device, dtype, softcap)


def plan_group_chunks(counts: list[int], group_size: int, max_tokens: int, *,
                      oversized_alone: bool = False) -> list[Chunk] | None:
    """Chunks of whole groups (``group_size`` contiguous responses), greedy up to ``max_tokens``
    tokens each; None when one group alone holds more than ``max_tokens`` tokens, unless
    ``oversized_alone``: such a group is then a chunk of its own, whose logits the single pass
    keeps only in part (:func:`plan_tiles`)."""
    chunks, r0, tok0, tokens = [], 0, 0, 0
    for g0 in range(0, len(counts), group_size):
        group_tokens = sum(counts[g0:g0 + group_size])
        if group_tokens > max_tokens and not oversized_alone:
            return None
        if tokens + group_tokens > max_tokens and g0 > r0:
            chunks.append(Chunk(r0, g0, tok0, tok0 + tokens))
            r0, tok0, tokens = g0, tok0 + tokens, 0
        tokens += group_tokens
    if len(counts) > r0 or not chunks:
        chunks.append(Chunk(r0, len(counts), tok0, tok0 + tokens))
    return chunks


def plan_token_chunks(counts: list[int], max_tokens: int) -> list[Chunk]:
    """Chunks of at most ``max_tokens`` consecutive tokens, for losses that are per token given
    quantities known up front (GRPO: advantages and normalisers): responses may be cut."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    total, step = offsets[-1], max(1, max_tokens)
    chunks = []
    for t0 in range(0, max(total, 1), step):
        t1 = min(t0 + step, total)
        r0 = bisect.bisect_right(offsets, t0) - 1
        r1 = bisect.bisect_left(offsets, t1) if t1 > t0 else r0
        chunks.append(Chunk(max(r0, 0), max(r1, r0), t0, t1))
    return chunks


# A chunk loss: (logp of the chunk's tokens (C,) float, a leaf that requires grad; the chunk)
#   -> (its share of the total loss, 0-d; anything the caller wants back, e.g. per-response stats)
ChunkLoss = Callable[[torch.Tensor, Chunk], "tuple[torch.Tensor, Any]"]


def _entropy_rows(shifted: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of logits already shifted by their max (slices bound the temporary)."""
    out = torch.empty(shifted.shape[0], dtype=shifted.dtype, device=shifted.device)
    for r0 in range(0, shifted.shape[0], ENTROPY_ROWS):
        rows = shifted[r0:r0 + ENTROPY_ROWS]
        e = rows.exp()
        total = e.sum(1)
        out[r0:r0 + ENTROPY_ROWS] = total.log() - (e * rows).sum(1) / total
    return out


def _triton_rows():
    from .triton import softmax_rows

    return softmax_rows


@dataclass
class _Tile:
    """Logits of tokens t0:t1 of a chunk, from the loss to its gradient. Eager rows: ``z`` holds
    exp(z - max) with its ``row_sum``, or, rebuilt, the probabilities exp(z - lse) (row_sum None);
    Triton rows: the raw logits, with their ``lse``."""

    t0: int
    t1: int
    z: torch.Tensor
    lse: torch.Tensor
    row_sum: torch.Tensor | None
    slope: torch.Tensor | None


def plan_tiles(tok0: int, tok1: int, budget_tokens: int | None) -> list[tuple[int, int, bool]]:
    """Tiles (t0, t1, keep) of a chunk's tokens. A chunk within ``budget_tokens`` is one kept tile.
    A longer one (a group bigger than the budget) is cut into n = ceil(C / budget) tiles of nearly
    equal size, each within the budget: the last one's logits are kept for the gradient, the others
    keep only their row statistics and are built again (one more logits GEMM for (n - 1) / n of the
    tokens). Few, large tiles: every tile's GEMMs stream all of W and the float32 dW once, so many
    small tiles would turn the pass memory-bound."""
    count = tok1 - tok0
    if budget_tokens is None or count <= budget_tokens:
        return [(tok0, tok1, True)]
    n = -(-count // max(1, budget_tokens))
    bounds = [tok0 + count * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1], i == n - 1) for i in range(n)]


def recomputed_fraction(chunks: list[Chunk], budget_tokens: int | None) -> float:
    """Share of the tokens whose logits the single pass builds twice (0.0 when every chunk fits)."""
    total = sum(c.tok1 - c.tok0 for c in chunks)
    again = sum(t1 - t0 for c in chunks for t0, t1, keep in plan_tiles(c.tok0, c.tok1, budget_tokens) if not keep)
    return again / total if total else 0.0


class _SinglePass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunks, chunk_loss, results, with_entropy,
                row_kernels, softcap, budget_tokens):
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        device, cdt = hidden.device, compute_dtype(hidden.dtype)
        inv_tau = 1.0 / temperature
        weight_op = operand(weight)  # as it is on CUDA (tensor cores); widened once on the CPU
        low_precision_gemm = weight_op.dtype != cdt
        d_hidden = torch.empty(hidden.shape, dtype=weight_op.dtype, device=device) if needs_h else None
        d_weight = torch.zeros(weight.shape, dtype=cdt, device=device) if needs_w else None
        d_bias = torch.zeros(weight.shape[0], dtype=cdt, device=device) if needs_b else None
        logp_all = torch.empty(hidden.shape[0], dtype=cdt, device=device)
        entropy_all = torch.empty_like(logp_all) if with_entropy else None
        lse_all = torch.empty_like(logp_all)  # kept for the tiles that are rebuilt
        loss = torch.zeros((), dtype=cdt, device=device)
        rows = _triton_rows() if row_kernels == "triton" else None

        def tempered_logits(t0, t1):
            """One logits GEMM for tokens t0:t1 -> (z float32 (C, V), the soft-cap's slope or None):
            the raw logits for the Triton rows (which add the bias and the temperature themselves),
            else (soft-capped (z + b)) / tau in place."""
            z = mm_f32(operand(hidden[t0:t1]), weight_op.T)
            if rows is not None:
                return z, None
            if bias is not None:
                z.add_(bias.to(cdt))
            if softcap is not None:  # c * tanh(z / c), before the temperature
                apply_softcap_(z, softcap)
            if inv_tau != 1.0:
                z.mul_(inv_tau)
            return z, (softcap_slope(z, temperature, softcap) if softcap is not None else None)

        def logits_tile(t0, t1) -> _Tile:
            """The tile's logits and row statistics; its log-probs (entropies) into logp_all
            (entropy_all), its log-sum-exp into lse_all."""
            z, slope = tempered_logits(t0, t1)
            y = targets[t0:t1].long()
            if rows is not None:  # one Triton pass over the tile (softmax_rows.py)
                lse, target_logit, entropy = rows.row_lse(z, y, bias, temperature, with_entropy, softcap)
                if with_entropy:
                    entropy_all[t0:t1] = entropy
                logp_all[t0:t1] = target_logit - lse
                lse_all[t0:t1] = lse
                return _Tile(t0, t1, z, lse, None, None)
            target_logit = z.gather(1, y.unsqueeze(1)).squeeze(1)
            row_max = z.amax(1, keepdim=True)
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
            z.sub_(row_max)
            if with_entropy:
                entropy_all[t0:t1] = _entropy_rows(z)
            z.exp_()  # z now holds exp(z - max): probabilities up to the row sum
            row_sum = z.sum(1, keepdim=True)
            lse = row_max.squeeze(1) + row_sum.squeeze(1).log()
            logp_all[t0:t1] = target_logit - lse
            lse_all[t0:t1] = lse
            return _Tile(t0, t1, z, lse, row_sum, slope)

        def rebuilt_tile(t0, t1) -> _Tile:
            """The logits of a tile that was not kept, built again for its gradient: its log-sum-exp
            is known, so the probabilities are exp(z - lse) directly (no max, no row sum)."""
            z, slope = tempered_logits(t0, t1)
            lse = lse_all[t0:t1]
            if rows is not None:
                return _Tile(t0, t1, z, lse, None, None)
            z.sub_(lse.unsqueeze(1)).exp_()
            return _Tile(t0, t1, z, lse, None, slope)

        def backprop_tile(tile: _Tile, g: torch.Tensor) -> None:
            """dz of the tile (over its logits buffer), then dh, dW and db from it."""
            nonlocal d_bias
            y = targets[tile.t0:tile.t1].long()
            z, slope = tile.z, tile.slope
            tile.z = tile.slope = None
            if rows is not None:  # one read of z, one write of dz (in place when the dtypes agree)
                dz = z if not low_precision_gemm else torch.empty(z.shape, dtype=weight_op.dtype, device=device)
                rows.row_grad(z, y, bias, temperature, tile.lse, g, out=dz, softcap=softcap)
                del z
                if needs_b:
                    d_bias += dz.sum(0, dtype=cdt)
            else:  # dz = g * (onehot(y) - p) / tau, in place over the logits buffer
                g = g * inv_tau
                z.mul_((-g).unsqueeze(1) if tile.row_sum is None else (-g).unsqueeze(1) / tile.row_sum)
                z[torch.arange(tile.t1 - tile.t0, device=device), y] += g
                if slope is not None:  # through the soft-cap: d(c tanh(x / c))/dx = 1 - tanh^2
                    z.mul_(slope)
                    del slope
                if needs_b:
                    d_bias += z.sum(0)
                dz = z.to(weight_op.dtype) if low_precision_gemm else z
                del z
            if needs_h:
                mm_into(d_hidden[tile.t0:tile.t1], dz, weight_op)
            if needs_w:
                addmm_f32_(d_weight, dz.T, operand(hidden[tile.t0:tile.t1]))

        for chunk in chunks:
            t0, t1 = chunk.tok0, chunk.tok1
            tiles: list = []  # a _Tile whose logits are kept, or the (t0, t1) of one to rebuild
            for a, b, keep in plan_tiles(t0, t1, budget_tokens) if t1 > t0 else []:
                tile = logits_tile(a, b)
                tiles.append(tile if keep else (a, b))
                del tile
            with torch.enable_grad():
                logp = logp_all[t0:t1].detach().requires_grad_(True)
                share, extra = chunk_loss(logp, chunk)
                grad_logp = torch.autograd.grad(share, logp)[0] if t1 > t0 and share.requires_grad else None
            loss += share.detach().to(cdt)
            results.append(extra)
            if t1 == t0 or grad_logp is None or not (needs_h or needs_w or needs_b):
                continue
            g = torch.where(grad_logp.abs() < TINY_GRAD, torch.zeros_like(grad_logp), grad_logp)
            # the kept tile first (its memory goes with its gradient), then the others, rebuilt one by one
            order = sorted(range(len(tiles)), key=lambda i: not isinstance(tiles[i], _Tile))
            for i in order:
                tile, tiles[i] = tiles[i], None
                if not isinstance(tile, _Tile):
                    tile = rebuilt_tile(*tile)
                backprop_tile(tile, g[tile.t0 - t0:tile.t1 - t0])
                del tile
        grads = (None if d_hidden is None else d_hidden.to(hidden.dtype),
                 None if d_weight is None else d_weight.to(weight.dtype),
                 None if d_bias is None else d_bias.to(bias.dtype))
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(logp_all)
        if entropy_all is not None:
            ctx.mark_non_differentiable(entropy_all)
        return loss, logp_all, entropy_all

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        # autograd frees the saved gradients after one backward (retain_graph keeps them)
        return scaled_saved_grads(ctx.saved_tensors, grad_loss) + (None,) * 9


def single_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, bias: torch.Tensor | None,
                temperature: float, chunks: list[Chunk], chunk_loss: ChunkLoss, with_entropy: bool = False,
                row_kernels: str = "torch", softcap: float | None = None, budget_tokens: int | None = None):
    """Run ``chunk_loss`` over ``chunks`` of the selected tokens with one logits GEMM per chunk.

    Args:
        hidden: (N, d) selected tokens' hidden states; weight (V, d) in hidden's dtype; targets (N,).
        bias: optional (V,); temperature > 0 (checked by the caller).
        chunks: consecutive :class:`Chunk` s covering 0:N, each holding whatever the loss couples.
        chunk_loss: see :data:`ChunkLoss`; its share must already carry the global normaliser.
        row_kernels: "torch" (eager ops over the logits tile, in place) or "triton" (softmax_rows.py:
            two passes over the tile instead of about nine, the soft-cap included; float16/bfloat16/
            float32 only).
        softcap: optional Gemma-style logit soft-cap c: z = c * tanh(z / c) before the temperature.
        budget_tokens: how many tokens' logits may be held at once (None: no limit). A chunk
            longer than that (one group bigger than the budget) keeps the logits of its last tile
            and builds the others again for their gradient (:func:`plan_tiles`): 3 + r matmuls,
            r the share of its tokens rebuilt (:func:`recomputed_fraction`).

    Returns:
        (loss 0-d float32 (float64 for float64 inputs), differentiable in hidden, weight, bias;
         the chunk losses' extras in chunk order; logp (N,) detached; entropy (N,) or None).
    """
    extras: list = []
    with torch.autocast(hidden.device.type, enabled=False):
        loss, logp, entropy = _SinglePass.apply(hidden, weight, bias, targets, temperature, chunks, chunk_loss,
                                                extras, with_entropy, row_kernels, softcap, budget_tokens)
    return loss, extras, logp, entropy
