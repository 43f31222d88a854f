"""How much precision the single pass's 16-bit tiles cost: dz, dh and dW against float64, for the
GPU's two ways of holding a chunk between the loss and its gradient.

    python benchmarks/tile_precision.py                       # V=32768, 256 rows, three logit scales
    python benchmarks/tile_precision.py --out benchmarks/results

* ``float32 logits``: the tile kept as float32 logits, dz computed from them in float32 and
  rounded once to bf16 for the dh/dW GEMMs (softmax_rows.row_grad: the design before 2026-12-01).
* ``bf16 probabilities``: the tile kept as bf16 e = exp(z - m_slice) with float32 slice maxima, dz
  = -(g f) e written over them in bf16, f = exp(m_slice - lse), the target's g (1 - p_y) from
  float32, 1 - p_y summed as the other entries' share (row_lse(probs_out=...) +
  row_grad_from_probs: the design now). The old design's 1 - exp(z_y - lse) cancels where p_y
  rounds to 1 in float32 (as naive float32 autograd does); the new one keeps its relative precision.

Both end with dz in bf16; dh = dz W and dW = dz^T h are formed in float64 from that dz, so the numbers
isolate what holding the tile costs (the GEMMs' own bf16 operands are the same for both). Errors are
relative Frobenius norms against float64 autograd of sum_t g_t logp_t, plus the worst relative error
on the target column. Targets are sampled from each row's softmax, as a rollout samples them.

Two sets of rows: the kernels' arithmetic in PyTorch with round-to-nearest-even conversions to bf16
(what ``.to(tl.bfloat16)`` does on a GPU), and the Triton kernels themselves in the CPU interpreter,
whose float32 -> bf16 casts truncate (round toward zero: twice the error of rounding). The
interpreter rows check that the emulation follows the kernels (``emulation_matches_kernels``); the
rounding rows are the GPU's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _to_bf16(x, truncate: bool):
    """float32 -> bfloat16 as the GPU rounds (nearest even), or as the interpreter casts (toward zero)."""
    import torch

    if not truncate:
        return x.to(torch.bfloat16)
    bits = x.contiguous().view(torch.int32) & ~0xFFFF  # drop the low 16 bits of the float32 pattern
    return bits.view(torch.float32).to(torch.bfloat16)


def emulated_dz(z, targets, grad, block: int, truncate: bool):
    """(old, new): both designs' bf16 dz, from float32 logits z (C, V) in PyTorch float32 arithmetic."""
    import torch

    lse = torch.logsumexp(z, -1, keepdim=True)
    onehot = torch.zeros_like(z).scatter_(1, targets[:, None], 1.0)
    g = grad[:, None].float()
    old = _to_bf16(g * (onehot - torch.exp(z - lse)), truncate)
    new = torch.empty_like(old)
    for v0 in range(0, z.shape[1], block):
        zs = z[:, v0:v0 + block]
        m = zs.amax(1, keepdim=True)
        e = _to_bf16(torch.exp(zs - m), truncate).float()
        new[:, v0:v0 + block] = _to_bf16((-g * torch.exp(m - lse)) * e, truncate)
    others = (torch.exp(z - lse) * (1.0 - onehot)).sum(1, keepdim=True)  # 1 - p_y as the kernel sums it
    target_dz = _to_bf16(g * others, truncate)
    new.scatter_(1, targets[:, None], target_dz)
    return old, new


def measure(n: int, vocab: int, width: int, logit_scale: float, seed: int) -> list[dict]:
    """One row per (arithmetic, design): relative errors of dz, dh, dW and the target column's worst."""
    import torch

    from pacs_kernels.triton import softmax_rows

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) * (logit_scale / width ** 0.5)
    z = hidden @ weight.T  # the float32 GEMM result both designs start from
    targets = torch.multinomial(torch.softmax(z.double(), -1), 1, generator=gen).squeeze(1)
    grad = torch.randn(n, generator=gen)
    x = z.double().requires_grad_(True)
    logp = torch.log_softmax(x, -1).gather(1, targets[:, None]).squeeze(1)
    (dz_ref,) = torch.autograd.grad((logp * grad.double()).sum(), x)
    dh_ref, dw_ref = dz_ref @ weight.double(), dz_ref.T @ hidden.double()

    lse, _, _ = softmax_rows.row_lse(z, targets, None, 1.0, False)
    kernel_old = softmax_rows.row_grad(z.clone(), targets, None, 1.0, lse, grad,
                                       out=torch.empty(n, vocab, dtype=torch.bfloat16))
    held = softmax_rows.RowProbs.empty(n, vocab, torch.bfloat16, z.device)
    lse_new, _, _ = softmax_rows.row_lse(z.clone(), targets, None, 1.0, False, probs_out=held)
    kernel_new = softmax_rows.row_grad_from_probs(held, targets, 1.0, lse_new, grad, out=held.probs)
    block = min(softmax_rows.BLOCK_V, 1 << (vocab - 1).bit_length())
    trunc_old, trunc_new = emulated_dz(z, targets, grad, block, truncate=True)
    round_old, round_new = emulated_dz(z, targets, grad, block, truncate=False)
    # the emulation follows the kernels: same values up to one bf16 step where float32 sums differ
    agree = all(bool(((a.double() - b.double()).abs() <= 2 ** -7 * b.double().abs() + 1e-30).float().mean() > 0.99)
                for a, b in ((kernel_old, trunc_old), (kernel_new, trunc_new)))

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    rows = []
    p_target = logp.detach().exp()
    designs = {"GPU (round to nearest)": (round_old, round_new),
               "interpreter (truncating casts)": (kernel_old, kernel_new)}
    for arithmetic, (old_dz, new_dz) in designs.items():
        for design, dz in (("float32 logits", old_dz), ("bf16 probabilities", new_dz)):
            dz = dz.double()
            col, col_ref = dz.gather(1, targets[:, None]), dz_ref.gather(1, targets[:, None])
            rows.append({"arithmetic": arithmetic, "design": design, "n": n, "vocab": vocab, "width": width,
                         "logit_scale": logit_scale, "p_target_median": float(p_target.median()),
                         "p_target_max": float(p_target.max()), "dz_rel": rel(dz, dz_ref),
                         "dh_rel": rel(dz @ weight.double(), dh_ref), "dw_rel": rel(dz.T @ hidden.double(), dw_ref),
                         "target_col_max_rel": float(((col - col_ref).abs() / col_ref.abs().clamp_min(1e-30)).max()),
                         "emulation_matches_kernels": agree})
    return rows


def markdown(rows: list[dict], when: str, machine: str) -> str:
    lines = [f"# Single-pass tile precision ({when}, {machine})", "",
             "Relative Frobenius errors against float64 of dz (bf16 either way) and of dh = dz W, dW = dz^T h "
             "formed in float64 from it; last column: the worst relative error on the target column. Targets "
             "sampled from each row's softmax. GPU rows: the kernels' arithmetic with round-to-nearest bf16 "
             "casts; interpreter rows: the Triton kernels on the CPU (truncating casts). "
             f"Emulation matches the kernels: {all(r['emulation_matches_kernels'] for r in rows)}.", "",
             "| logits | p(target) median / max | arithmetic | design | dz | dh | dW | target column (max) |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| N={r['n']} V={r['vocab']} d={r['width']}, std {r['logit_scale']:g} | "
                     f"{r['p_target_median']:.3f} / {r['p_target_max']:.3f} | {r['arithmetic']} | {r['design']} | "
                     f"{r['dz_rel']:.2e} | {r['dh_rel']:.2e} | {r['dw_rel']:.2e} | {r['target_col_max_rel']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=256, help="rows (tokens)")
    parser.add_argument("--v", type=int, default=32768, help="vocabulary")
    parser.add_argument("--d", type=int, default=64, help="model width")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 4.0, 10.0],
                        help="logit standard deviations (1: flat distributions, 10: sampled tokens near p = 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write tile_precision.csv/.md here")
    args = parser.parse_args(argv)
    for name in ("n", "v", "d"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU here: the kernels run in the interpreter
    import torch

    if torch.cuda.is_available():
        print("note: CUDA is available, but this study runs the row kernels on CPU tensors (interpreter)")
    rows = []
    for scale in args.scales:
        rows += measure(args.n, args.v, args.d, scale, args.seed)
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = platform.processor() or platform.machine()
    try:
        machine = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = markdown(rows, when, machine)
    print(text)
    if args.out is not None:
        import csv

        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "tile_precision.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (args.out / "tile_precision.md").write_text(text)
        print(f"wrote {args.out / 'tile_precision.csv'} and {args.out / 'tile_precision.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
