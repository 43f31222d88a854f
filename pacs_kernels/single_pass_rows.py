"""The single pass's row work: from one logits GEMM to the log-probs, and later to dz.

engine/plan.py plans the chunks and tiles and engine/single_pass.py runs the loss; a row engine here turns a tile of
tokens t0:t1 into

    kept(t0, t1, hold)     z = (h W^T + b) / tau by one GEMM; logp, entropy and lse of its rows
                           written out; with hold, the tile held in some form until its gradient
                           is known (else None: it will be rebuilt)
    dz(tile, g)            dz = g (onehot(y) - softmax(z)) / tau from the held tile
    rebuilt_dz(t0, t1, g)  dz of a tile that was not held (a group bigger than the budget): one
                           more GEMM, its lse known, so exp(z - lse) directly

and hands dz (in the GEMM operands' dtype) to engine/single_pass.py, which multiplies out dh and dW.
Each engine adds the bias gradient (sum over tokens of dz) into ``d_bias`` itself.

Two engines:

* ``EagerRows``: eager PyTorch, in place over a float32 (float64) logits buffer: exp(z - max) and
  its row sum are held; a low-precision copy of dz is made for the GEMMs on a GPU. Bytes per
  logit: 4 (+ 4 for the soft-cap's slope, + 2 for the bf16 dz copy on a GPU). On the CPU the
  tiles of one call take turns in one buffer (:class:`TileBuffer`).
* ``TritonRows``: the row kernels of triton/softmax_rows.py. Where the GEMMs run in 16 bits (a
  GPU), the tile is held as bf16/fp16 probabilities relative to each vocabulary slice's max
  (float32 GEMM output only for a strip of ``strip_rows`` rows at a time), and dz is written over
  them: 2 bytes per logit. Elsewhere the float32 logits buffer is overwritten in place: 4 bytes.
"""

from __future__ import annotations

import torch

from .matmul import compute_dtype, mm_f32, mm_into, operand
from .torch_chunked import apply_softcap_, softcap_slope

ENTROPY_ROWS = 64  # rows per slice of the eager entropy pass (bounds its temporary)


def _entropy_rows(shifted: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of logits already shifted by their max (slices bound the temporary)."""
    out = torch.empty(shifted.shape[0], dtype=shifted.dtype, device=shifted.device)
    for r0 in range(0, shifted.shape[0], ENTROPY_ROWS):
        rows = shifted[r0:r0 + ENTROPY_ROWS]
        e = rows.exp()
        total = e.sum(1)
        out[r0:r0 + ENTROPY_ROWS] = total.log() - (e * rows).sum(1) / total
    return out


class TileBuffer:
    """One (rows, V) logits buffer that the tiles of one call take in turn, on the CPU.

    PyTorch's CPU allocator hands a freed block this large back to the OS, so every new tile's GEMM
    faults its pages in again: about 150 ms per 470 MB tile (770 tokens x 151,936) on a 2-core VM,
    a tenth of that tile's logits GEMM. (The CUDA caching allocator already reuses its blocks: there a
    tile is a plain allocation.) A tile is lent until :meth:`give_back`; asked for while one is lent,
    the buffer hands out a fresh allocation instead, so two live tiles never share memory. Allocated at
    the first tile, with ``max_rows`` rows: no more than the largest tile would have taken.
    """

    def __init__(self, vocab: int, dtype: torch.dtype, device: torch.device, max_rows: int):
        self.vocab, self.dtype, self.device, self.max_rows = vocab, dtype, device, max_rows
        self.buffer: torch.Tensor | None = None
        self.lent = False

    def take(self, rows: int) -> torch.Tensor:
        """An uninitialised (rows, V) tile: a view of the buffer where it is free and large enough."""
        if self.device.type != "cpu" or self.lent or rows > self.max_rows:
            return torch.empty(rows, self.vocab, dtype=self.dtype, device=self.device)
        if self.buffer is None:
            self.buffer = torch.empty(self.max_rows, self.vocab, dtype=self.dtype, device=self.device)
        self.lent = True
        return self.buffer[:rows]

    def give_back(self, tile: torch.Tensor | None) -> None:
        """The caller is done with ``tile`` (its memory may be written by the next :meth:`take`)."""
        if tile is not None and self.buffer is not None and tile.data_ptr() == self.buffer.data_ptr():
            self.lent = False


class _RowEngine:
    """What both engines share: the inputs, the per-token outputs they fill, the logits GEMM."""

    def __init__(self, hidden, weight_op, bias, targets, temperature, softcap, outputs, d_bias):
        self.hidden, self.weight_op, self.bias, self.targets = hidden, weight_op, bias, targets
        self.temperature, self.inv_tau, self.softcap = temperature, 1.0 / temperature, softcap
        self.logp, self.entropy, self.lse = outputs  # (N,) each; entropy may be None
        self.d_bias = d_bias
        self.cdt = compute_dtype(hidden.dtype)
        self.vocab = weight_op.shape[0]
        self.device = hidden.device

    def raw_logits(self, t0: int, t1: int) -> torch.Tensor:
        """h[t0:t1] @ W^T: one GEMM in the operands' dtype, float32 (float64) result (t1 - t0, V)."""
        return mm_f32(operand(self.hidden[t0:t1]), self.weight_op.T)

    def release(self, held) -> None:
        """The caller is done with what :meth:`kept` held (or None), or with a dz: its memory may be reused."""

    def for_gemm(self, dz: torch.Tensor) -> torch.Tensor:
        """dz in the GEMM operands' dtype (a copy only where they differ)."""
        return dz if dz.dtype == self.weight_op.dtype else dz.to(self.weight_op.dtype)

    def add_bias_grad(self, dz: torch.Tensor) -> None:
        if self.d_bias is not None:
            self.d_bias += dz.sum(0, dtype=self.cdt)


class EagerRows(_RowEngine):
    """Eager PyTorch over the float32 (float64) logits tile, in place."""

    def __init__(self, *args, max_rows: int):
        super().__init__(*args)
        self.tiles = TileBuffer(self.vocab, self.cdt, self.device, max_rows)

    def tile_logits(self, t0: int, t1: int) -> torch.Tensor:
        """:meth:`raw_logits` written into a tile of :attr:`tiles` (handed back by :meth:`release`)."""
        a = operand(self.hidden[t0:t1])
        if a.dtype != self.cdt:  # a 16-bit GEMM (CUDA): its float32 result is a fresh tensor anyway
            return mm_f32(a, self.weight_op.T)
        out = self.tiles.take(t1 - t0)
        mm_into(out, a, self.weight_op.T)
        return out

    def release(self, held) -> None:
        if held is not None:
            self.tiles.give_back(held if isinstance(held, torch.Tensor) else held[2])

    def _tempered(self, t0, t1):
        """(soft-capped (z + b)) / tau in place over one GEMM's result, and the cap's slope or None."""
        z = self.tile_logits(t0, t1)
        if self.bias is not None:
            z.add_(self.bias.to(self.cdt))
        if self.softcap is not None:  # c * tanh(z / c), before the temperature
            apply_softcap_(z, self.softcap)
        if self.inv_tau != 1.0:
            z.mul_(self.inv_tau)
        return z, (softcap_slope(z, self.temperature, self.softcap) if self.softcap is not None else None)

    def kept(self, t0: int, t1: int, hold: bool = True):
        """Holds exp(z - max) with its row sum (and the slope)."""
        z, slope = self._tempered(t0, t1)
        y = self.targets[t0:t1].long()
        target_logit = z.gather(1, y.unsqueeze(1)).squeeze(1)
        row_max = z.amax(1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        z.sub_(row_max)
        if self.entropy is not None:
            self.entropy[t0:t1] = _entropy_rows(z)
        z.exp_()  # z now holds exp(z - max): probabilities up to the row sum
        row_sum = z.sum(1, keepdim=True)
        lse = row_max.squeeze(1) + row_sum.squeeze(1).log()
        self.logp[t0:t1] = target_logit - lse
        self.lse[t0:t1] = lse
        if not hold:
            self.tiles.give_back(z)
            return None
        return t0, t1, z, row_sum, slope

    def dz(self, tile, g: torch.Tensor) -> torch.Tensor:
        """dz = g * (onehot(y) - p) / tau, in place over the held buffer."""
        t0, t1, z, row_sum, slope = tile
        g = g * self.inv_tau
        z.mul_((-g).unsqueeze(1) if row_sum is None else (-g).unsqueeze(1) / row_sum)
        z[torch.arange(t1 - t0, device=self.device), self.targets[t0:t1].long()] += g
        if slope is not None:  # through the soft-cap: d(c tanh(x / c))/dx = 1 - tanh^2
            z.mul_(slope)
        self.add_bias_grad(z)
        return self.for_gemm(z)

    def rebuilt_dz(self, t0: int, t1: int, g: torch.Tensor) -> torch.Tensor:
        """The probabilities exp(z - lse) from one more GEMM (no max, no row sum), then dz."""
        z, slope = self._tempered(t0, t1)
        z.sub_(self.lse[t0:t1].unsqueeze(1)).exp_()
        return self.dz((t0, t1, z, None, slope), g)


class TritonRows(_RowEngine):
    """softmax_rows.py's kernels; the tile in ``tile_dtype`` (16 bits: float32 GEMM strips)."""

    def __init__(self, *args, tile_dtype: torch.dtype, strip_rows: int):
        super().__init__(*args)
        from .triton import softmax_rows

        self.kernels = softmax_rows
        self.tile_dtype = tile_dtype
        # a float32 tile is the GEMM's own output, overwritten in place: no strips
        self.in_place = tile_dtype == self.cdt
        self.strip_rows = max(1, int(strip_rows))

    def _strips(self, t0: int, t1: int, whole: bool):
        """(s0, s1) spans of one GEMM each: the whole tile (written in place), or strips of float32 logits."""
        return [(t0, t1)] if whole else [(s0, min(s0 + self.strip_rows, t1)) for s0 in range(t0, t1, self.strip_rows)]

    def kept(self, t0: int, t1: int, hold: bool = True):
        """Holds the tile as its gradient will read it (softmax_rows.RowProbs); without ``hold``
        only the row statistics, strip by strip (never a whole tile)."""
        rows = self.kernels
        in_place = self.in_place and hold
        held = rows.RowProbs.empty(t1 - t0, self.vocab, self.tile_dtype, self.device) \
            if hold and not in_place else None
        for s0, s1 in self._strips(t0, t1, whole=in_place):
            z = self.raw_logits(s0, s1)
            if not hold:
                out = None
            elif in_place:  # the float32 logits become the held tile
                out = held = rows.RowProbs.empty(s1 - s0, self.vocab, z.dtype, self.device, probs=z)
            else:
                out = held.rows(s0 - t0, s1 - t0)
            lse, target_logit, entropy = rows.row_lse(z, self.targets[s0:s1], self.bias, self.temperature,
                                                      self.entropy is not None, self.softcap, probs_out=out)
            del z
            if entropy is not None:
                self.entropy[s0:s1] = entropy
            self.logp[s0:s1] = target_logit - lse
            self.lse[s0:s1] = lse
        return (t0, t1, held) if hold else None

    def dz(self, tile, g: torch.Tensor) -> torch.Tensor:
        """dz over the held probabilities (one read, one write)."""
        t0, t1, held = tile
        dz = self.kernels.row_grad_from_probs(held, self.targets[t0:t1], self.temperature, self.lse[t0:t1], g,
                                              out=held.probs)
        self.add_bias_grad(dz)
        return self.for_gemm(dz)

    def rebuilt_dz(self, t0: int, t1: int, g: torch.Tensor) -> torch.Tensor:
        """One more GEMM per strip, dz straight from its float32 logits and the known lse."""
        dz = None if self.in_place else torch.empty(t1 - t0, self.vocab, dtype=self.tile_dtype, device=self.device)
        for s0, s1 in self._strips(t0, t1, whole=self.in_place):
            z = self.raw_logits(s0, s1)
            out = z if self.in_place else dz[s0 - t0:s1 - t0]
            self.kernels.row_grad(z, self.targets[s0:s1], self.bias, self.temperature, self.lse[s0:s1],
                                  g[s0 - t0:s1 - t0], out=out, softcap=self.softcap)
            if self.in_place:
                dz = z
            del z
        self.add_bias_grad(dz)
        return self.for_gemm(dz)
