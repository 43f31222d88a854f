"""Known-gradient fast path vs the usual forward + backward (time), on whatever device is given.

    python benchmarks/bench_known_grad.py [--device cpu|cuda] [--backend torch|triton] [--out DIR]

Prints a table and writes DIR/known_grad_<device>.csv with the device name and the date.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import time

import torch

from pacs_kernels import linear_logprobs, linear_logprobs_known_grad


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    for line in open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    return platform.processor() or "cpu"


def _time(fn, device, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sizes", default="1024x256x32768,2048x256x32768",
                        help="comma-separated NxdxV")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for size in args.sizes.split(","):
        n, d, v = (int(x) for x in size.split("x"))
        g = torch.Generator(device=args.device).manual_seed(0)
        hidden = torch.randn(n, d, device=args.device, generator=g).to(dtype).requires_grad_()
        weight = (torch.randn(v, d, device=args.device, generator=g) / d**0.5).to(dtype).requires_grad_()
        targets = torch.randint(0, v, (n,), device=args.device, generator=g)
        grad_logp = torch.randn(n, device=args.device, generator=g)
        with torch.no_grad():
            _, lse = linear_logprobs(hidden, weight, targets, backend=args.backend, return_lse=True)

        def usual():
            hidden.grad = weight.grad = None
            (linear_logprobs(hidden, weight, targets, backend=args.backend) * grad_logp).sum().backward()

        def one_sweep():
            hidden.grad = weight.grad = None
            linear_logprobs_known_grad(hidden, weight, targets, grad_logp, lse, backend=args.backend)[0].backward()

        t_usual = _time(usual, args.device, args.repeats)
        t_fast = _time(one_sweep, args.device, args.repeats)
        rows.append(dict(device=_device_name(args.device), date=datetime.date.today().isoformat(),
                         backend=args.backend, dtype=args.dtype, N=n, d=d, V=v,
                         usual_fwd_bwd_ms=round(t_usual, 2), one_sweep_ms=round(t_fast, 2),
                         speedup=round(t_usual / t_fast, 3)))
        print(rows[-1])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"known_grad_{args.device}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
