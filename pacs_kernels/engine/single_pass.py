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
instead of N x V. How a chunk's logits are held between the loss and its gradient is the row
engine's business (single_pass_rows.py): float32 in place (eager, CPU), or, with the Triton row
kernels on a GPU, as bf16 probabilities relative to each vocabulary slice's max, with dz written
over them: 2 bytes per logit instead of 6 (float32 logits + a bf16 dz copy). :func:`tile_memory`
says how many tokens a budget holds for each. The
gradients are produced in the forward and handed to autograd: the returned loss's backward only
scales them by the upstream gradient. Losses that are per response (GRPO) can use any chunking
that keeps responses whole; their chunk loss only needs the global normaliser, known up front.

A group bigger than the budget (long responses) cannot hold all its logits at once. It is cut
into ceil(C / budget) tiles within the budget; the last one holds the full budget and its logits are
kept, the others keep only their row statistics and are built again once g is known: 3 + (C - budget) / C
matmuls for a group of C tokens, never more than the 4 of two passes, with memory bounded by the budget
whatever the group size.

Entropy (optional, for statistics): H = lse - sum_v p_v z_v, computed with the log-sum-exp.

Per-token gradients below ``TINY_GRAD`` (2^-100) are flushed to 0 before they multiply the
probabilities: products of such values are float32 denormals, which slow every GEMM on many
x86 CPUs by 10-100x, and a gradient that small changes no optimizer step (Adam's eps is 1e-8).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..forward_grads import scaled_saved_grads
from ..matmul import addmm_f32_, compute_dtype, mm_into, operand
from ..single_pass_rows import EagerRows, TritonRows
from .plan import MAX_STRIP_ROWS, Chunk, Plan, plan_tiles, tile_dtype_for

TINY_GRAD = 2.0 ** -100



# A chunk loss: (logp of the chunk's tokens (C,) float, a leaf that requires grad; the chunk)
#   -> (its share of the total loss, 0-d; anything the caller wants back, e.g. per-response stats)
ChunkLoss = Callable[[torch.Tensor, Chunk], "tuple[torch.Tensor, Any]"]


class _SinglePass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunks, chunk_loss, results, with_entropy,
                row_kernels, softcap, budget_tokens, strip_rows, tile_dtype):
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        device, cdt = hidden.device, compute_dtype(hidden.dtype)
        weight_op = operand(weight)  # as it is on CUDA (tensor cores); widened once on the CPU
        d_hidden = torch.empty(hidden.shape, dtype=weight_op.dtype, device=device) if needs_h else None
        d_weight = torch.empty(weight.shape, dtype=cdt, device=device) if needs_w else None
        d_weight_written = [False]  # its first product writes it (no zeroing pass over V x d)
        d_bias = torch.zeros(weight.shape[0], dtype=cdt, device=device) if needs_b else None
        logp_all = torch.empty(hidden.shape[0], dtype=cdt, device=device)
        entropy_all = torch.empty_like(logp_all) if with_entropy else None
        lse_all = torch.empty_like(logp_all)  # kept for the tiles that are rebuilt
        loss = torch.zeros((), dtype=cdt, device=device)
        plans = [plan_tiles(c.tok0, c.tok1, budget_tokens) if c.tok1 > c.tok0 else [] for c in chunks]
        engine_args = (hidden, weight_op, bias, targets, temperature, softcap, (logp_all, entropy_all, lse_all), d_bias)
        if row_kernels == "triton":
            rows = TritonRows(*engine_args, tile_dtype=tile_dtype or tile_dtype_for(device, hidden.dtype, "triton"),
                              strip_rows=strip_rows or MAX_STRIP_ROWS)
        else:
            rows = EagerRows(*engine_args, max_rows=max((b - a for plan in plans for a, b, _ in plan), default=0))

        def gemms(t0: int, t1: int, dz: torch.Tensor) -> None:
            """dh = dz @ W and dW += dz^T @ h for tokens t0:t1 (dz in the GEMM operands' dtype)."""
            if needs_h:
                mm_into(d_hidden[t0:t1], dz, weight_op)
            if needs_w:
                addmm_f32_(d_weight, dz.T, operand(hidden[t0:t1]), overwrite=not d_weight_written[0])
                d_weight_written[0] = True

        tiles: list = []
        for chunk, plan in zip(chunks, plans):
            t0, t1 = chunk.tok0, chunk.tok1
            # each tile's logits once: a kept tile is held for its gradient, the others only leave
            # their log-sum-exp (lse_all) and are built again below (the last chunk's tiles are let
            # go first: a chunk without gradients keeps its tile until here)
            for tile in tiles:
                rows.release(tile[2] if tile is not None else None)
            tiles.clear()
            tiles = [(a, b, rows.kept(a, b, hold=keep)) for a, b, keep in plan]
            with torch.enable_grad():
                logp = logp_all[t0:t1].detach().requires_grad_(True)
                share, extra = chunk_loss(logp, chunk)
                grad_logp = torch.autograd.grad(share, logp)[0] if t1 > t0 and share.requires_grad else None
            loss += share.detach().to(cdt)
            results.append(extra)
            if t1 == t0 or grad_logp is None or not (needs_h or needs_w or needs_b):
                if needs_h:  # no gradient reaches these tokens (d_hidden is written, not accumulated)
                    d_hidden[t0:t1].zero_()
                continue
            g = torch.where(grad_logp.abs() < TINY_GRAD, torch.zeros_like(grad_logp), grad_logp)
            # the kept tile first (its memory goes with its gradient), then the others, rebuilt one by
            # one; each leaves the list before the next is built, so one tile is alive at a time
            for i in sorted(range(len(tiles)), key=lambda i: tiles[i][2] is None):
                (a, b, held), tiles[i] = tiles[i], None
                ga = g[a - t0:b - t0]
                dz = rows.dz(held, ga) if held is not None else rows.rebuilt_dz(a, b, ga)
                del held
                gemms(a, b, dz)
                rows.release(dz)
                del dz
        if needs_w and not d_weight_written[0]:  # no token had a gradient
            d_weight.zero_()
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
        return scaled_saved_grads(ctx.saved_tensors, grad_loss) + (None,) * 11


def single_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, bias: torch.Tensor | None,
                temperature: float, chunks: list[Chunk], chunk_loss: ChunkLoss, with_entropy: bool = False,
                row_kernels: str = "torch", softcap: float | None = None, budget_tokens: int | None = None,
                strip_rows: int | None = None, tile_dtype: torch.dtype | None = None):
    """Run ``chunk_loss`` over ``chunks`` of the selected tokens with one logits GEMM per chunk.

    Args:
        hidden: (N, d) selected tokens' hidden states; weight (V, d) in hidden's dtype; targets (N,).
        bias: optional (V,); temperature > 0 (checked by the caller).
        chunks: consecutive :class:`Chunk` s covering 0:N, each holding whatever the loss couples.
        chunk_loss: see :data:`ChunkLoss`; its share must already carry the global normaliser.
        row_kernels: "torch" (eager ops over the logits tile, in place) or "triton" (softmax_rows.py:
            two reads of the tile instead of about nine passes, the soft-cap included, the tile held
            in 16 bits on a GPU; float16/bfloat16/float32 only). See single_pass_rows.py.
        softcap: optional Gemma-style logit soft-cap c: z = c * tanh(z / c) before the temperature.
        budget_tokens: how many tokens' logits may be held at once (None: no limit). A chunk
            longer than that (one group bigger than the budget) keeps the logits of its last tile
            and builds the others again for their gradient (:func:`plan_tiles`): 3 + r matmuls,
            r the share of its tokens rebuilt (:func:`recomputed_fraction`).
        strip_rows, tile_dtype: Triton rows only (:func:`tile_memory` gives both for a budget): rows
            of one float32 GEMM strip of a 16-bit tile (None: MAX_STRIP_ROWS), and the tile's dtype
            (None: :func:`tile_dtype_for`, the GEMM operands' dtype: bf16 on a GPU, float32 elsewhere).

    Returns:
        (loss 0-d float32 (float64 for float64 inputs), differentiable in hidden, weight, bias;
         the chunk losses' extras in chunk order; logp (N,) detached; entropy (N,) or None).
    """
    extras: list = []
    with torch.autocast(hidden.device.type, enabled=False):
        loss, logp, entropy = _SinglePass.apply(hidden, weight, bias, targets, temperature, chunks, chunk_loss,
                                                extras, with_entropy, row_kernels, softcap, budget_tokens,
                                                strip_rows, tile_dtype)
    return loss, extras, logp, entropy


def run_single_pass(batch, plan: Plan, loss, options):
    """The single pass of ``plan`` over ``batch``'s selected tokens (engine/batch.py) for an engine ``loss``
    (objectives/protocol.py) -> its result ``(loss, stats)``, or None where the loss refuses the chunks' sum
    (objectives/rows.py; the caller then runs two passes)."""
    memory = plan.memory
    total, extras, logp, entropy = single_pass(
        batch.hidden, batch.weight, batch.targets, bias=batch.bias, temperature=options.temperature,
        chunks=list(plan.chunks), chunk_loss=loss.chunk_loss, with_entropy=loss.with_entropy,
        row_kernels=plan.row_kernels, softcap=options.logit_softcap, budget_tokens=memory.tokens,
        strip_rows=memory.strip_rows, tile_dtype=memory.tile_dtype)
    total = total.float() if total.dtype != torch.float64 else total
    return loss.single_pass_result(total, extras, logp, entropy)
