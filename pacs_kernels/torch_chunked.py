"""Portable chunked backend: the fused log-prob math in plain PyTorch.

Runs on any device (the CPU path, and the fallback where Triton cannot run). It walks the
(tokens x vocabulary) plane in chunks of at most ``chunk_elements`` logits, so memory grows
with the chunk, never with N x V. What it keeps for backward is O(N): the log-sum-exp (and
the entropy, when asked for) per token.

Math (z = (h @ W.T + b) / tau are the logits of one token, p = softmax(z)):

    logp    = z[y] - lse,                lse = log sum_v exp(z_v)
    entropy = -sum_v p_v log p_v

Per vocabulary chunk c we keep its own log-sum-exp ``lse_c`` and
``B_c = sum_{v in c} softmax_c(z)_v * (z_v - lse_c)`` (its negative entropy). With
``w_c = exp(lse_c - lse)`` the chunks combine without cancellation:

    lse = logsumexp_c(lse_c),    entropy = -sum_c w_c * (B_c + log w_c)

Gradient, for upstream gradients g_l on logp and g_H on the entropy:

    dlogp/dz_k = onehot(y)_k - p_k
    dH/dz_k    = -p_k * (log p_k + H)
    dz_k       = g_l * onehot(y)_k - p_k * (g_l + g_H * (log p_k + H))
    dlogits = dz / tau;  dh = dlogits @ W;  dW = dlogits.T @ h;  dbias = sum_tokens dlogits

With a logit soft-cap c (Gemma-style, ``softcap``), z = c * tanh((h @ W.T + b) / c) / tau and the
chain rule adds one factor: dlogits *= 1 - tanh^2 = 1 - (c * tanh / c)^2, read off the capped logits.


GEMMs run in the inputs' dtype on CUDA (bf16/fp16 tensor cores, float32 results; matmul.py) and
in float32 on the CPU; the softmax and the gradient are formed in float32 in place; dW is
accumulated into one float32 buffer. Per-token upstream gradients below 2^-100 are flushed to 0
(they would only produce float32 denormals, which slow CPU GEMMs 10-100x: single_pass.py).
"""

from __future__ import annotations

import torch

from .lse_math import combine_vocab_chunks
from .matmul import addmm_f32_, compute_dtype, mm_f32, operand

DEFAULT_CHUNK_ELEMENTS = 1 << 22  # 4M logits: 16 MiB in float32 per chunk
TINY_GRAD = 2.0 ** -100


def _chunk_sizes(n_tokens: int, vocab: int, chunk_elements: int) -> tuple[int, int]:
    """Token and vocabulary chunk sizes whose product stays under ``chunk_elements``.

    Token chunks are kept large (up to 2048): the backward adds each chunk's share into the whole
    (V, d) weight gradient, so few wide token chunks beat many thin ones; the vocabulary is cut
    to fit the budget instead.
    """
    max_token_chunk = 2048
    token_chunk = max(1, min(n_tokens, max_token_chunk))
    if vocab * token_chunk <= chunk_elements:
        return max(1, min(n_tokens, chunk_elements // vocab)), vocab
    return token_chunk, max(1, min(vocab, chunk_elements // token_chunk))


def _logits(h, weight, bias, v0, v1, inv_tau, cdt, softcap=None):
    """(tokens, v1 - v0) float32 logits of a chunk, soft-capped (``c * tanh(z / c)``) when ``softcap``
    is set, then tempered; h and weight already GEMM operands (``operand``)."""
    z = mm_f32(h, weight[v0:v1].T)
    if bias is not None:
        z.add_(bias[v0:v1].to(cdt))
    if softcap is not None:
        apply_softcap_(z, softcap)
    if inv_tau != 1.0:
        z.mul_(inv_tau)
    return z


def apply_softcap_(z: torch.Tensor, softcap: float) -> torch.Tensor:
    """z <- c * tanh(z / c), in place (Gemma-style logit soft-capping)."""
    return z.div_(softcap).tanh_().mul_(softcap)


def softcap_slope(z_tempered: torch.Tensor, temperature: float, softcap: float) -> torch.Tensor:
    """d(capped)/d(raw) = 1 - tanh^2 = 1 - (capped / c)^2, from the tempered capped logits (new buffer)."""
    return (z_tempered * (temperature / softcap)).square_().neg_().add_(1.0)


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    with_entropy: bool,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """hidden (N, d), weight (V, d), targets (N,) -> (logp, entropy or None, lse), each (N,)."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype)
    inv_tau = 1.0 / temperature
    logp = torch.empty(n_tokens, dtype=cdt, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    token_chunk, vocab_chunk = _chunk_sizes(n_tokens, vocab, chunk_elements)
    starts = range(0, vocab, vocab_chunk)
    weight = operand(weight)  # widened once on the CPU; as it is (tensor cores) on CUDA
    for n0 in range(0, n_tokens, token_chunk):
        n1 = min(n0 + token_chunk, n_tokens)
        h = operand(hidden[n0:n1])
        y = targets[n0:n1].long()
        lse_parts, negent_parts = [], []
        target_logit = torch.zeros(n1 - n0, dtype=cdt, device=hidden.device)
        for v0 in starts:
            v1 = min(v0 + vocab_chunk, vocab)
            z = _logits(h, weight, bias, v0, v1, inv_tau, cdt, softcap)
            inside = (y >= v0) & (y < v1)
            local = (y - v0).clamp(0, v1 - v0 - 1)
            target_logit += torch.where(inside, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
            lse_c = torch.logsumexp(z, dim=-1)
            lse_parts.append(lse_c)
            if with_entropy:  # in place: at most two chunk-sized buffers live at once
                log_p = z.sub_(lse_c.unsqueeze(-1))
                negent_parts.append((log_p.exp() * log_p).sum(-1))
            del z
        lse_c, ent_c = combine_vocab_chunks(
            torch.stack(lse_parts, -1), torch.stack(negent_parts, -1) if with_entropy else None
        )
        lse[n0:n1] = lse_c
        logp[n0:n1] = target_logit - lse_c
        if with_entropy:
            entropy[n0:n1] = ent_c
    return logp, entropy, lse


def backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    logp_out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dhidden, dweight, dbias) in the input dtypes; accumulation in float32 (or 64).

    With ``logp_out`` ((N,)) it also writes each token's log-prob, read off the same logits chunks
    (the known-gradient fast path: forward and backward in one sweep).
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype)
    inv_tau = 1.0 / temperature
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    dev = hidden.device
    g_l = grad_logp.to(cdt) if grad_logp is not None else torch.zeros(n_tokens, dtype=cdt, device=dev)
    g_l = torch.where(g_l.abs() < TINY_GRAD, torch.zeros_like(g_l), g_l)
    g_h = grad_entropy.to(cdt) if grad_entropy is not None else None
    if g_h is not None:
        g_h = torch.where(g_h.abs() < TINY_GRAD, torch.zeros_like(g_h), g_h)
    out_weight = weight
    weight = operand(weight)
    # dh and dW are written by their first product (no zeroing pass over V x d): dh[n0:n1] by the chunk at
    # v0 = 0, dW[v0:v1] by the chunk at n0 = 0; an empty input leaves them to zero_() below
    d_hidden = torch.empty(hidden.shape, dtype=cdt, device=dev) if need_h else None
    d_weight = torch.empty(weight.shape, dtype=cdt, device=dev) if need_w else None
    d_bias = torch.zeros(vocab, dtype=cdt, device=dev) if need_b else None
    if n_tokens == 0 and need_w:
        d_weight.zero_()
    token_chunk, vocab_chunk = _chunk_sizes(n_tokens, vocab, chunk_elements)
    for n0 in range(0, n_tokens, token_chunk):
        n1 = min(n0 + token_chunk, n_tokens)
        h = operand(hidden[n0:n1])
        y = targets[n0:n1].long()
        gl = g_l[n0:n1].unsqueeze(-1)
        lse_c = lse[n0:n1].to(cdt).unsqueeze(-1)
        for v0 in range(0, vocab, vocab_chunk):
            v1 = min(v0 + vocab_chunk, vocab)
            # in place throughout: two chunk-sized buffers (log p, then dz) live at once
            log_p = _logits(h, weight, bias, v0, v1, inv_tau, cdt, softcap)
            slope = softcap_slope(log_p, temperature, softcap) if softcap is not None else None
            log_p.sub_(lse_c)
            inside = (y >= v0) & (y < v1)
            rows = inside.nonzero().squeeze(-1)
            if logp_out is not None:
                logp_out[n0 + rows] = log_p[rows, y[rows] - v0].to(logp_out.dtype)
            # dz = (g_l onehot - p (g_l + g_H (log p + H))) / tau, the -1/tau folded into the per-row
            # factor: exp and one scale over the chunk (in place without entropy)
            if g_h is not None:
                dz = log_p.exp()
                coef = log_p.add_(entropy[n0:n1].to(cdt).unsqueeze(-1)).mul_(g_h[n0:n1].unsqueeze(-1)).add_(gl)
                dz.mul_(coef.mul_(-inv_tau))
                del coef
            else:
                dz = log_p.exp_()
                dz.mul_(gl * -inv_tau)
            del log_p
            dz[rows, y[rows] - v0] += gl[rows, 0] * inv_tau
            if slope is not None:  # through c * tanh(z / c)
                dz.mul_(slope)
                del slope
            if need_b:
                d_bias[v0:v1] += dz.sum(0)
            dz = dz.to(weight.dtype) if weight.dtype != cdt else dz  # the GEMMs' dtype (bf16 on CUDA)
            if need_h:
                addmm_f32_(d_hidden[n0:n1], dz, weight[v0:v1], overwrite=v0 == 0)
            if need_w:
                addmm_f32_(d_weight[v0:v1], dz.T, h, overwrite=n0 == 0)
    return (
        d_hidden.to(hidden.dtype) if need_h else None,
        d_weight.to(out_weight.dtype) if need_w else None,
        d_bias.to(bias.dtype) if need_b else None,
    )
