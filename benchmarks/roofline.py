"""A cost model on paper: matmul FLOPs, HBM bytes, atomic bytes and peak extra memory of each
way to compute per-token log-probs and their gradients (the LM-head part of one PACS loss
step, forward + backward), and the H200 time they predict.

    python benchmarks/roofline.py                          # table for the default shapes
    python benchmarks/roofline.py --out benchmarks/results # also roofline.csv / roofline.md
    python benchmarks/roofline.py --matmul-tflops 700 --hbm-tbps 4.0 --measured gpu.csv

Model. Each variant is a list of phases (a GEMM, a softmax sweep, a fused kernel); a phase
takes ``max(flops / matmul_rate, hbm_bytes / hbm_bandwidth)`` (it is either compute- or
memory-bound), plus ``atomic_bytes / atomic_rate`` for contended read-modify-writes (atomics or
lock-protected adds), which do not overlap well with anything. The variant's time is the sum over
its phases. Bytes are compulsory traffic (each operand once per pass that reads it) plus the
rereads a design forces: a tiled kernel rereads W once per wave of concurrently running token
blocks (tiles shared by a wave hit in L2), a chunked design reads W once per chunk and GEMM.
Inputs h (N, d) and W (V, d) and the outputs dh, dW in the input dtype are not counted as extra
memory. Launch overheads, the O(N) loss math and the group loss are ignored.

The default rates are H200 spec-sheet numbers, NOT measurements: dense bf16 989 TFLOP/s (67 for
float32 inputs, which the Triton kernels multiply exactly, without TF32), HBM3e 4.8 TB/s,
132 SMs; the atomic rate (1 TB/s of fp32 adds) is an assumption. Pass measured rates
(``--matmul-tflops`` from benchmarks/run.py's matmul probe) and join measured times
(``--measured``) so the first GPU run corrects the model.

Variants (names shared with the GPU benchmark):

    naive                   materialize N x V logits (bf16), fp32 softmax, autograd backward: 3 matmuls
    triton_two_pass_atomic  the old Triton design: forward (1 matmul), backward recompute + dh + dW
                            per (token block, vocab split) with fp32 atomic adds: 4 matmuls
    triton_two_pass         pacs_kernels.triton now: forward, then per dz chunk a dz kernel
                            (recompute) and two atomic-free matmul kernels (dh, dW): 4 matmuls
    triton_one_sweep        known-gradient first step: the backward alone, logp read off the same
                            tiles (lse known from the rollout's no-grad pass): 3 matmuls
    chunked_single_pass     group-chunked path with eager row ops (backend="torch" on CUDA): per
                            chunk, logits GEMM (bf16 in, fp32 out), in-place fp32 softmax/gradient,
                            dz cast to bf16, dh GEMM, dW addmm into one fp32 (V, d) buffer: 3 matmuls
    single_pass_compact     the same with the Triton row kernels (the default on a GPU): logits GEMM
                            in float32 strips, one lse pass writing the tile as bf16 probabilities,
                            one pass writing dz over them, dh GEMM, dW addmm: 3 matmuls, 2 bytes a
                            logit held (a 2 GiB budget: tiles of 5,297 tokens at V = 152k)
    torch_two_pass          the same chunked math in two passes (log-probs, then recompute): 4 matmuls
    liger_chunked           Liger-Kernel's chunked PPO/GRPO step: per chunk of sequences, bf16
                            logits, fp32 log_softmax, autograd gradient in the forward: 3 matmuls
    cce                     Cut Cross-Entropy: lse kernel, then a backward kernel that recomputes
                            each tile and adds dh and dW tiles with locked fp32 read-modify-writes:
                            4 matmuls (fewer with its gradient filter: --cce-live-fraction)
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pacs_kernels.engine.plan import tile_memory

SPEC_MATMUL_TFLOPS = 989.0  # H200 SXM dense bf16, spec sheet (not measured)
SPEC_HBM_TBPS = 4.8  # H200 HBM3e, spec sheet (not measured)
SPEC_FP32_TFLOPS = 67.0  # H200 SXM FP32 without tensor cores (the Triton kernels' exact fp32 dots), spec
ASSUMED_ATOMIC_TBPS = 1.0  # fp32 atomic/locked-add throughput: an assumption, not a spec
SPEC_SMS = 132  # H200 SXM streaming multiprocessors
SPEC_HBM_GIB = 141.0

VARIANTS = ("naive", "triton_two_pass_atomic", "triton_two_pass", "triton_one_sweep",
            "chunked_single_pass", "single_pass_compact", "torch_two_pass", "liger_chunked", "cce")
MATMULS = {"naive": 3, "triton_two_pass_atomic": 4, "triton_two_pass": 4, "triton_one_sweep": 3,
           "chunked_single_pass": 3, "single_pass_compact": 3, "torch_two_pass": 4, "liger_chunked": 3, "cce": 4}
QWEN_7B = (3584, 152064)
DEFAULT_SHAPES = [(n, *QWEN_7B, "bfloat16") for n in (8192, 16384, 32768, 65536)] + [(2048, 512, 32768, "float32")]
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CSV_COLUMNS = ("variant", "n", "d", "v", "dtype", "matmuls", "gflop", "hbm_gb", "atomic_gb", "peak_extra_gib",
               "fits", "predicted_ms", "floor_ms", "predicted_over_floor", "bound", "matmul_tflops", "hbm_tbps",
               "atomic_tbps", "rates")


@dataclass(frozen=True)
class Rates:
    """Throughputs the prediction uses; ``source`` says where they come from."""

    matmul_tflops: float = SPEC_MATMUL_TFLOPS
    fp32_tflops: float = SPEC_FP32_TFLOPS
    hbm_tbps: float = SPEC_HBM_TBPS
    atomic_tbps: float = ASSUMED_ATOMIC_TBPS
    sms: int = SPEC_SMS
    source: str = "H200 spec, not measured"

    def for_dtype(self, dtype: str) -> float:
        """Matmul TFLOP/s for inputs of ``dtype`` (float32 inputs use the fp32 rate)."""
        return self.fp32_tflops if dtype == "float32" else self.matmul_tflops


@dataclass(frozen=True)
class Options:
    """Design parameters of the variants (defaults follow the code as written, or the peers' docs)."""

    chunk_mib: float = 1024.0  # chunked torch paths: budget of the fp32 (C, V) logits chunk
    compact_budget_mib: float = 2048.0  # single_pass_compact: the chunk budget (pacs_kernels' CUDA default)
    triton_dz_chunk_mib: float = 1024.0  # pacs_kernels.triton: DZ_CHUNK_BYTES, the (C, V) dz chunk
    liger_chunk_tokens: int = 4096  # Liger's chunked loss: chunk_size=1 sequence of up to 4096 tokens
    cce_live_fraction: float = 1.0  # share of (token, vocab) tiles CCE's gradient filter keeps
    atomic_block_n: int = 64  # the old Triton backward's token block
    cce_block: int = 128  # CCE's backward tile (tokens and vocabulary)


@dataclass
class Phase:
    name: str
    flops: float
    hbm_bytes: float
    atomic_bytes: float = 0.0


@dataclass
class Cost:
    """Counts for one (variant, shape); ``predict_ms`` turns them into time."""

    variant: str
    n: int
    d: int
    v: int
    dtype: str
    matmuls: int
    peak_extra_bytes: float
    phases: list[Phase] = field(default_factory=list)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.phases)

    @property
    def hbm_bytes(self) -> float:
        return sum(p.hbm_bytes for p in self.phases)

    @property
    def atomic_bytes(self) -> float:
        return sum(p.atomic_bytes for p in self.phases)

    def predict_ms(self, rates: Rates) -> float:
        total = 0.0
        rate = rates.for_dtype(self.dtype)
        for p in self.phases:
            total += max(p.flops / (rate * 1e12), p.hbm_bytes / (rates.hbm_tbps * 1e12))
            total += p.atomic_bytes / (rates.atomic_tbps * 1e12)
        return total * 1e3

    def bound(self, rates: Rates) -> str:
        """Which term dominates the predicted time: matmul, hbm or atomic."""
        terms = {"matmul": 0.0, "hbm": 0.0, "atomic": 0.0}
        rate = rates.for_dtype(self.dtype)
        for p in self.phases:
            t_mm, t_hbm = p.flops / (rate * 1e12), p.hbm_bytes / (rates.hbm_tbps * 1e12)
            terms["matmul" if t_mm >= t_hbm else "hbm"] += max(t_mm, t_hbm)
            terms["atomic"] += p.atomic_bytes / (rates.atomic_tbps * 1e12)
        return max(terms, key=terms.get)


def matmul_floor_ms(n: int, d: int, v: int, matmuls: int = 3, matmul_tflops: float = SPEC_MATMUL_TFLOPS) -> float:
    """Time of ``matmuls`` (N x V x d) matmuls at ``matmul_tflops``: the floor a fused loss step
    divides by (3 for the single-pass designs, 4 for two passes)."""
    if matmuls not in (3, 4):
        raise ValueError(f"matmuls must be 3 or 4, got {matmuls!r}")
    if matmul_tflops <= 0:
        raise ValueError(f"matmul_tflops must be > 0, got {matmul_tflops!r}")
    return matmuls * 2.0 * n * v * d / (matmul_tflops * 1e12) * 1e3


def _waves(programs: float, sms: int) -> int:
    return max(1, math.ceil(programs / sms))


def cost(variant: str, n: int, d: int, v: int, dtype: str = "bfloat16", *,
         options: Options = Options(), sms: int = SPEC_SMS) -> Cost:
    """Count FLOPs, bytes and extra memory of ``variant`` at N tokens, width d, vocabulary V."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {tuple(ITEMSIZE)}, got {dtype!r}")
    for name, value in (("n", n), ("d", d), ("v", v)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    s = ITEMSIZE[dtype]
    gemm = 2.0 * n * v * d  # FLOPs of one (N x V x d) matmul
    nv, nd, vd = float(n) * v, float(n) * d, float(v) * d
    phases: list[Phase] = []

    if variant == "naive":
        # logits (bf16) = h @ W.T; .float(); log_softmax; gather. Backward: dense scatter of the
        # upstream gradient, log_softmax backward, cast to bf16, dh and dW GEMMs.
        phases += [Phase("logits gemm", gemm, nd * s + vd * s + nv * s),
                   Phase("cast + log_softmax", 0.0, nv * (s + 4 + 4 + 4)),
                   Phase("softmax backward + cast", 0.0, nv * (4 + 4 + 4 + 4 + 4 + s)),
                   Phase("dh gemm", gemm, nv * s + vd * s + nd * s),
                   Phase("dW gemm", gemm, nv * s + nd * s + vd * s)]
        peak = nv * (s + 4 + 4 + 4)  # bf16 logits, fp32 copy, saved log-probs, the gradient
    elif variant in ("triton_two_pass_atomic", "triton_two_pass", "triton_one_sweep"):
        fwd_blocks = math.ceil(n / 128)
        forward = Phase("forward (lse kernel)", gemm, nd * s + vd * s * _waves(fwd_blocks, sms) + 12.0 * n)
        if variant == "triton_two_pass_atomic":
            blocks = math.ceil(n / options.atomic_block_n)
            splits = max(1, math.ceil(2 * sms / blocks))
            phases += [forward, Phase("backward (recompute + dh + dW, atomics)", 3 * gemm,
                                      nd * s + vd * s * _waves(blocks * splits, sms) + (nd + vd) * (4 + s),
                                      atomic_bytes=4.0 * (blocks * vd + splits * nd))]
            peak = 4.0 * (nd + vd)  # float32 dh and dW buffers
        else:
            chunk = min(n, max(128, int(options.triton_dz_chunk_mib * 2**20 // (v * s)) // 128 * 128))
            chunks = math.ceil(n / chunk)
            dw_rmw = 8.0 * vd * (chunks - 1) + (4.0 + s) * vd * (chunks > 1)  # fp32 re-reads + final cast
            if variant == "triton_two_pass":
                phases.append(forward)
            phases += [Phase("dz kernel (recompute)", gemm, chunks * vd * s + nd * s + nv * s),
                       Phase("dh kernel", gemm, nv * s + chunks * vd * s + nd * s),
                       Phase("dW kernel", gemm, nv * s + nd * s + vd * s + dw_rmw)]
            peak = chunk * v * s + (4.0 * vd if chunks > 1 else 0.0)
    elif variant in ("chunked_single_pass", "torch_two_pass"):
        chunk = min(n, max(1, int(options.chunk_mib * 2**20 // (v * 4))))
        chunks = math.ceil(n / chunk)
        two_pass = variant == "torch_two_pass"
        if two_pass:
            phases += [Phase("pass 1: logits gemm (fp32 out)", gemm, nd * s + chunks * vd * s + nv * 4),
                       Phase("pass 1: logsumexp", 0.0, nv * 4)]
        phases += [Phase("logits gemm (fp32 out)", gemm, nd * s + chunks * vd * s + nv * 4),
                   # softmax (read), gradient in place (read + write), cast dz to bf16 (read + write)
                   Phase("in-place softmax/gradient + cast", 0.0, nv * (4 + 8 + 4 + s)),
                   Phase("dh gemm", gemm, nv * s + chunks * vd * s + nd * s),
                   Phase("dW addmm (fp32 buffer)", gemm, nv * s + nd * s + chunks * 8.0 * vd)]
        peak = chunk * v * (4 + s) + 4.0 * vd
    elif variant == "single_pass_compact":
        # the tile layout pacs_kernels picks on a GPU (a float32 model writes its tile in place: no strip)
        memory = tile_memory(options.compact_budget_mib, v, torch.device("cuda"), TORCH_DTYPE[dtype],
                             row_kernels="triton")
        tile = max(1, memory.tokens)
        strip = memory.strip_rows or tile
        strips, tiles = math.ceil(n / strip), math.ceil(n / min(n, tile))
        phases += [Phase("logits gemm, float32 strips", gemm, nd * s + strips * vd * s + nv * 4),
                   Phase("lse rows: read the strip, write bf16 probabilities", 0.0, nv * (4 + s)),
                   Phase("gradient rows: dz over the probabilities", 0.0, nv * (s + s)),
                   Phase("dh gemm", gemm, nv * s + tiles * vd * s + nd * s),
                   Phase("dW addmm (fp32 buffer)", gemm, nv * s + nd * s + tiles * 8.0 * vd)]
        peak = min(n, tile) * v * s + (min(n, strip) * v * 4 if s < 4 else 0.0) + 4.0 * vd
    elif variant == "liger_chunked":
        chunk = min(n, options.liger_chunk_tokens)
        chunks = math.ceil(n / chunk)
        phases += [Phase("logits gemm (bf16)", gemm, nd * s + chunks * vd * s + nv * s),
                   # .float(), log_softmax, gather; autograd: dense scatter, softmax backward, cast
                   Phase("fp32 log_softmax + its backward", 0.0, nv * (s + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + s)),
                   Phase("dh gemm", gemm, nv * s + chunks * vd * s + nd * s),
                   Phase("dW gemm + accumulate", gemm, nv * s + nd * s + chunks * vd * (s + s + 8.0))]
        peak = chunk * v * (s + 4 * 3) + 4.0 * vd
    else:  # cce
        live = min(max(options.cce_live_fraction, 0.0), 1.0)
        blocks = math.ceil(n / options.cce_block)
        vtiles = math.ceil(v / options.cce_block)
        phases += [Phase("lse kernel", gemm, nd * s + vd * s * _waves(blocks, sms) + 8.0 * n),
                   Phase("backward (recompute, locked dh/dW adds)", gemm * (1 + 2 * live),
                         nd * s + vd * s * _waves(blocks, sms) + (nd + vd) * (4 + s),
                         atomic_bytes=live * 8.0 * (blocks * vd + vtiles * nd))]
        peak = 4.0 * (nd + vd)
    return Cost(variant, n, d, v, dtype, MATMULS[variant], peak, phases)


def _sig(x: float) -> float:
    """x to 4 significant digits (tiny shapes predict microseconds)."""
    return float(f"{x:.4g}")


def table(shapes=DEFAULT_SHAPES, variants=VARIANTS, rates: Rates = Rates(), options: Options = Options(),
          hbm_gib: float = SPEC_HBM_GIB) -> list[dict]:
    """One row per (shape, variant): counts, predicted ms and the matching matmul floor."""
    rows = []
    for n, d, v, dtype in shapes:
        for variant in variants:
            c = cost(variant, n, d, v, dtype, options=options, sms=rates.sms)
            predicted = c.predict_ms(rates)
            floor = matmul_floor_ms(n, d, v, 3 if c.matmuls <= 3 else 4, rates.for_dtype(dtype))
            inputs = (n * d + v * d) * 2 * ITEMSIZE[dtype]  # h, W, dh, dW
            rows.append({
                "variant": variant, "n": n, "d": d, "v": v, "dtype": dtype, "matmuls": c.matmuls,
                "gflop": round(c.flops / 1e9, 1), "hbm_gb": round(c.hbm_bytes / 1e9, 2),
                "atomic_gb": round(c.atomic_bytes / 1e9, 2),
                "peak_extra_gib": round(c.peak_extra_bytes / 2**30, 3),
                "fits": (c.peak_extra_bytes + inputs) / 2**30 <= hbm_gib,
                "predicted_ms": _sig(predicted), "floor_ms": _sig(floor),
                "predicted_over_floor": round(predicted / floor, 3), "bound": c.bound(rates),
                "matmul_tflops": rates.for_dtype(dtype), "hbm_tbps": rates.hbm_tbps,
                "atomic_tbps": rates.atomic_tbps, "rates": rates.source,
            })
    return rows


def read_measured(path: Path) -> list[dict]:
    """Rows of a CSV with columns variant, n, d, v, ms (and optionally dtype, default bfloat16)."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"variant", "n", "d", "v", "ms"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"--measured {path} must have columns variant, n, d, v, ms; missing {sorted(missing)}")
        return [{"variant": r["variant"], "n": int(r["n"]), "d": int(r["d"]), "v": int(r["v"]),
                 "dtype": r.get("dtype") or "bfloat16", "ms": float(r["ms"])} for r in reader]


def join_measured(measured: list[dict], rates: Rates, options: Options) -> list[dict]:
    """Measured next to predicted: adds predicted_ms and measured_over_predicted to each row
    (rows whose variant the model does not know get no prediction)."""
    out = []
    for row in measured:
        row = dict(row)
        if row["variant"] in VARIANTS:
            c = cost(row["variant"], row["n"], row["d"], row["v"], row["dtype"], options=options, sms=rates.sms)
            predicted = c.predict_ms(rates)
            row["predicted_ms"] = _sig(predicted)
            row["measured_over_predicted"] = _sig(row["ms"] / predicted)
        else:
            row["predicted_ms"] = row["measured_over_predicted"] = ""
        out.append(row)
    return out


def markdown(rows: list[dict], rates: Rates, measured: list[dict] | None = None) -> str:
    lines = [f"# Roofline cost model ({dt.date.today().isoformat()})", "",
             f"Rates: {rates.matmul_tflops:g} TFLOP/s matmul ({rates.fp32_tflops:g} for float32 inputs), "
             f"{rates.hbm_tbps:g} TB/s HBM, "
             f"{rates.atomic_tbps:g} TB/s atomics, {rates.sms} SMs ({rates.source}). Predicted time = sum over "
             "phases of max(matmul, HBM) + atomics; floor = 3 (or 4) matmuls at the matmul rate. "
             "Extra memory excludes h, W, dh, dW.", "",
             "| variant | N | d | V | dtype | matmuls | GFLOP | HBM GB | atomic GB | extra GiB | fits | "
             "predicted ms | floor ms | pred/floor | bound |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['n']} | {r['d']} | {r['v']} | {r['dtype']} | {r['matmuls']} | "
                     f"{r['gflop']:g} | {r['hbm_gb']:g} | {r['atomic_gb']:g} | {r['peak_extra_gib']:g} | "
                     f"{'yes' if r['fits'] else 'NO'} | {r['predicted_ms']:g} | {r['floor_ms']:g} | "
                     f"{r['predicted_over_floor']:g} | {r['bound']} |")
    if measured:
        lines += ["", "## Measured vs predicted", "", "| variant | N | d | V | measured ms | predicted ms | "
                  "measured / predicted |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in measured:
            lines.append(f"| {r['variant']} | {r['n']} | {r['d']} | {r['v']} | {r['ms']:g} | {r['predicted_ms']} | "
                         f"{r['measured_over_predicted']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matmul-tflops", type=float, default=None,
                        help=f"dense matmul rate (default {SPEC_MATMUL_TFLOPS:g}: H200 bf16 spec, not measured)")
    parser.add_argument("--fp32-tflops", type=float, default=None,
                        help=f"matmul rate for float32 inputs (default {SPEC_FP32_TFLOPS:g}: H200 FP32 spec)")
    parser.add_argument("--hbm-tbps", type=float, default=None,
                        help=f"HBM bandwidth (default {SPEC_HBM_TBPS:g}: H200 HBM3e spec, not measured)")
    parser.add_argument("--atomic-tbps", type=float, default=ASSUMED_ATOMIC_TBPS,
                        help="fp32 atomic-add throughput (default: an assumption)")
    parser.add_argument("--sms", type=int, default=SPEC_SMS)
    parser.add_argument("--hbm-gib", type=float, default=SPEC_HBM_GIB, help="device memory for the 'fits' column")
    parser.add_argument("--n", type=int, nargs="+", default=None, help="token counts (with --d and --v)")
    parser.add_argument("--d", type=int, default=None)
    parser.add_argument("--v", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bfloat16")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--chunk-mib", type=float, default=Options.chunk_mib,
                        help="chunked torch paths: the fp32 (C, V) logits chunk budget")
    parser.add_argument("--cce-live-fraction", type=float, default=Options.cce_live_fraction,
                        help="share of tiles CCE's gradient filter keeps (1.0 = exact, no filtering)")
    parser.add_argument("--measured", type=Path, default=None,
                        help="CSV with columns variant, n, d, v, ms (dtype optional): print measured / predicted")
    parser.add_argument("--out", type=Path, default=None, help="write roofline.csv and roofline.md here")
    args = parser.parse_args(argv)
    if (args.d is None) != (args.v is None) or (args.n is not None and args.d is None):
        parser.error("--n, --d and --v go together (--n needs --d and --v)")
    for name in ("matmul_tflops", "fp32_tflops", "hbm_tbps", "atomic_tbps", "chunk_mib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    measured_rates = any(x is not None for x in (args.matmul_tflops, args.fp32_tflops, args.hbm_tbps))
    rates = Rates(matmul_tflops=args.matmul_tflops or SPEC_MATMUL_TFLOPS,
                  fp32_tflops=args.fp32_tflops or SPEC_FP32_TFLOPS, hbm_tbps=args.hbm_tbps or SPEC_HBM_TBPS,
                  atomic_tbps=args.atomic_tbps, sms=args.sms,
                  source="from the command line" if measured_rates else "H200 spec, not measured")
    options = Options(chunk_mib=args.chunk_mib, cce_live_fraction=args.cce_live_fraction)
    shapes = DEFAULT_SHAPES
    if args.d is not None:
        shapes = [(n, args.d, args.v, args.dtype) for n in (args.n or [8192])]
    rows = table(shapes, args.variants, rates, options, args.hbm_gib)
    measured = join_measured(read_measured(args.measured), rates, options) if args.measured else None
    text = markdown(rows, rates, measured)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "roofline.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        (args.out / "roofline.md").write_text(text)
        if measured:
            with open(args.out / "roofline_measured.csv", "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=("variant", "n", "d", "v", "dtype", "ms", "predicted_ms",
                                                            "measured_over_predicted"))
                writer.writeheader()
                writer.writerows(measured)
        print(f"wrote {args.out / 'roofline.csv'} and {args.out / 'roofline.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
