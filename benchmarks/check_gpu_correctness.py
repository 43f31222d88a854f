"""Correctness of the Triton kernels at real model shapes, against a float32 chunked reference.

    python benchmarks/check_gpu_correctness.py                      # CUDA, real shapes
    python benchmarks/check_gpu_correctness.py --device cpu --small # dry run: Triton interpreter

For each case it prints the largest errors of logp, entropy, dh and dW (dh and dW for both GEMM engines
of the Triton backward: torch.mm / cuBLAS and the Triton kernels; and of the fused PACS
loss and its gradients, when pacs_kernels has it) and exits with status 1 if any is over its
tolerance. On one real case and the dry run's bf16 one (``OBJECTIVE_CASES``) it also checks the GRPO-family
objectives (GRPO, DAPO, Dr. GRPO, GSPO, CISPO at their defaults, off-policy, 0/1 rewards) through
``fused_linear_objective_loss`` on the Triton backend: the single pass (a group a chunk) and the two
passes on padded rows, and the single pass on the packed layout, each against the objective itself on
the float32 reference log-probs (its dloss/dlogp by autograd, then dh and dW in closed form).

The reference walks the tokens in chunks, computing each chunk's logits in float32
from the (bf16 or fp32) inputs upcast to float32, with TF32 off, and forms the gradient in
closed form (z = h W^T / tau, p = softmax z, H the entropy, g_l and g_H upstream gradients):

    dz = g_l * (onehot(y) - p) - g_H * p * (log p + H),   dh = dz W / tau,   dW = dz^T h / tau

Errors: logp, entropy, loss: max |ours - ref|. dh, dW: max |ours - ref| / max |ref|. Where
pacs_kernels has it, the one-sweep first step after a rollout (``old_lse=``) is checked too.
At the end it prints which tiles the autotuner picked and each loaded kernel's registers and
spills (``pacs_kernels/triton/kernel_report.py``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path

# (name, N, d, V, dtype, temperature): the real shapes (Qwen2.5-7B, a 2048-wide model, and the other heads
# the race times: Qwen2.5-1.5B, Llama 3 8B, Gemma 2 with its 256k vocabulary) and, for the dry run, small ones
# with ragged edges
REAL_CASES = [
    ("qwen7b-bf16", 4096, 3584, 152064, "bfloat16", 1.0),
    ("qwen7b-bf16-ragged-tau0.7", 4093, 3584, 152064, "bfloat16", 0.7),
    ("d2048-bf16", 4096, 2048, 151936, "bfloat16", 1.0),
    ("qwen1.5b-bf16", 4096, 1536, 151936, "bfloat16", 1.0),
    ("llama3-8b-bf16", 4096, 4096, 128256, "bfloat16", 1.0),
    ("gemma2-2b-bf16-v256k", 4096, 2304, 256000, "bfloat16", 1.0),
    ("qwen7b-fp32", 512, 3584, 152064, "float32", 1.0),
]
SMALL_CASES = [
    ("small-bf16", 70, 48, 300, "bfloat16", 1.0),
    ("small-fp32-tau0.7", 53, 40, 257, "float32", 0.7),
]
# (logp/entropy/loss absolute, dh/dW relative to the largest reference entry)
TOLERANCE = {"bfloat16": (2e-3, 2e-2), "float32": (2e-4, 2e-4)}
LOSS_RESPONSES, LOSS_GROUP_SIZE = 16, 8
# the cases that also check the GRPO-family objectives (15 fused losses and 6 reference sweeps more each); in the
# dry run the bf16 one only (tests/test_objectives_fused.py checks them in float32 and float64 in the interpreter)
OBJECTIVE_CASES = ("qwen7b-bf16", "small-bf16")
# off-policy log-ratios logp - old_logp: uniform in +-OFF_POLICY_SPAN per token, kept CLIP_MARGIN away from every
# clip boundary, so that the kernels' rounding (about 1e-5 in a log-prob) cannot flip a token between the clipped
# and the unclipped branch, whose gradients differ; GSPO's sequence ratios are set per response (GSPO_LOG_RATIOS)
OFF_POLICY_SPAN, CLIP_MARGIN = 0.3, 0.01
GSPO_LOG_RATIOS = (0.0, 5e-5, -1e-4, 2e-3, -2e-3, 5e-2, -5e-2, 1e-4)  # inside (-3e-4, 4e-4) and outside, >= 2e-4 off


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu runs the Triton interpreter (TRITON_INTERPRET=1): use with --small")
    parser.add_argument("--small", action="store_true", help="small shapes (the CPU dry run)")
    parser.add_argument("--chunk", type=int, default=512, help="reference: tokens per chunk")
    parser.add_argument("--cases", nargs="+", default=None, help="names of the cases to run (default: all)")
    parser.add_argument("--peers", choices=("with", "without", "only"), default="with",
                        help="the (informational) check of the peers' log-probs on the first case: with "
                             "ours (default), without it, or only it (ours are not checked then)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    import pacs_kernels
    from pacs_kernels import dispatch, linear_logprobs

    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu --small for the dry run", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    cases = SMALL_CASES if args.small else REAL_CASES
    if args.cases:
        cases = [case for case in cases if case[0] in args.cases]
    has_loss = hasattr(pacs_kernels, "fused_linear_pacs_loss") and hasattr(pacs_kernels, "pacs_loss")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"[check] {name}; torch {torch.__version__}; fused loss: {'yes' if has_loss else 'not in pacs_kernels'}")
    if args.peers != "only":
        print_tile_memory(device)

    failures = []
    for case_name, n, d, v, dtype_name, tau in cases:
        dtype = getattr(torch, dtype_name)
        atol, rtol = TOLERANCE[dtype_name]
        gen = torch.Generator(device="cpu").manual_seed(1234)  # small choices
        dgen = torch.Generator(device=device).manual_seed(1234)  # big tensors, made on the device
        hidden = torch.randn(n, d, generator=dgen, device=device).to(dtype)
        weight = (torch.randn(v, d, generator=dgen, device=device) * (d ** -0.5 * 2.0)).to(dtype)
        targets = torch.randint(0, v, (n,), generator=dgen, device=device)
        grad_logp = torch.randn(n, generator=dgen, device=device)
        grad_entropy = torch.randn(n, generator=dgen, device=device)

        if args.peers == "only":
            if tau == 1.0:
                check_peers(hidden, weight, targets, grad_logp, args.chunk, args.device)
                return 0
            continue

        start = time.perf_counter()
        ref = reference(hidden, weight, targets, tau, grad_logp, grad_entropy, args.chunk)
        errors = {}
        # the backward's two gradient GEMMs on its staged dz chunks: both engines (grad_gemms=),
        # whichever the dispatch picks later
        for gemms in dispatch.GRAD_GEMMS:
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            logp, entropy = linear_logprobs(h, w, targets, temperature=tau, return_entropy=True, backend="triton",
                                            grad_gemms=gemms)
            torch.autograd.backward([logp, entropy], [grad_logp, grad_entropy])
            errors.update({  # (the forward is the same for both: its errors once)
                "logp": (max(_abs_err(logp, ref["logp"]), errors.get("logp", (0.0,))[0]), atol),
                "entropy": (max(_abs_err(entropy, ref["entropy"]), errors.get("entropy", (0.0,))[0]), atol),
                f"dh[{gemms}]": (_rel_err(h.grad, ref["dh"]), rtol),
                f"dW[{gemms}]": (_rel_err(w.grad, ref["dW"]), rtol),
            })
            del h, w, logp, entropy
        with torch.no_grad():
            logp_nograd = linear_logprobs(hidden, weight, targets, temperature=tau, backend="triton")
        errors["logp_nograd"] = (_abs_err(logp_nograd, ref["logp"]), atol)
        del ref
        if has_loss and n >= LOSS_RESPONSES:
            errors.update(check_loss(pacs_kernels, hidden, weight, targets, tau, gen, args.chunk, atol, rtol))
        if case_name in OBJECTIVE_CASES and hasattr(pacs_kernels, "fused_linear_objective_loss"):
            errors.update(check_objectives(pacs_kernels, hidden, weight, targets, tau, gen, args.chunk, atol, rtol))
        if tau == 1.0 and args.peers == "with" and case_name == cases[0][0]:
            check_peers(hidden, weight, targets, grad_logp, args.chunk, args.device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        bad = [key for key, (err, tol) in errors.items() if not err <= tol]
        verdict = "FAIL " + ",".join(bad) if bad else "ok"
        print(f"[check] {case_name:28s} N={n} d={d} V={v} {dtype_name:8s} tau={tau}: {verdict} ({seconds:.1f}s)")
        for key, (err, tol) in errors.items():
            print(f"          {key:14s} max err {err:.3e}  (tolerance {tol:.0e})")
        if bad:
            failures.append(case_name)
        del hidden, weight, targets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    from pacs_kernels.triton.kernel_report import print_report

    print_report()
    if failures:
        print(f"[check] FAILED: {', '.join(failures)}")
        return 1
    print("[check] all cases within tolerance")
    return 0


def reference(hidden, weight, targets, tau, grad_logp, grad_entropy, chunk):
    """float32 chunked reference: logp, entropy (N,), dh (N, d), dW (V, d), all float32."""
    import torch

    w32 = weight.float()
    n = hidden.shape[0]
    logp = torch.empty(n, device=hidden.device)
    entropy = torch.empty(n, device=hidden.device)
    dh = torch.empty(hidden.shape, device=hidden.device)
    dw = torch.zeros(w32.shape, device=hidden.device)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        h32 = hidden[rows].float()
        log_p = torch.log_softmax((h32 @ w32.T) / tau, dim=-1)
        p = log_p.exp()
        ent = -(p * log_p).sum(-1)
        y = targets[rows].long().unsqueeze(-1)
        logp[rows] = log_p.gather(-1, y).squeeze(-1)
        entropy[rows] = ent
        g_l, g_h = grad_logp[rows].float().unsqueeze(-1), grad_entropy[rows].float().unsqueeze(-1)
        dz = -p * (g_l + g_h * (log_p + ent.unsqueeze(-1)))
        dz.scatter_add_(-1, y, g_l)
        dz /= tau
        dh[rows] = dz @ w32
        dw += dz.T @ h32
        del log_p, p, dz
    return {"logp": logp, "entropy": entropy, "dh": dh, "dW": dw}


def check_peers(hidden, weight, targets, grad_logp, chunk, device) -> None:
    """Print how far each importable peer's log-probs and gradients are from the reference.

    Informational (the peers are not ours to fix): it shows that the benchmark times the same
    computation for every impl, and surfaces a broken peer install before the benchmark runs.
    """
    import torch

    from benchmarks.ops import PEER_IMPLS, impl_unavailable_reason, logprob_function

    ref = None
    for impl in PEER_IMPLS:
        reason = impl_unavailable_reason("logprobs_fwd_bwd", impl, device)
        if reason:
            print(f"          peer {impl:13s} not checked: {reason}")
            continue
        if ref is None:
            ref = reference(hidden, weight, targets, 1.0, grad_logp, torch.zeros_like(grad_logp), chunk)
        try:
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            logp = logprob_function(impl)(h, w, targets)
            logp.backward(grad_logp)
            print(f"          peer {impl:13s} logp {_abs_err(logp, ref['logp']):.3e}"
                  f"  dh {_rel_err(h.grad, ref['dh']):.3e}  dW {_rel_err(w.grad, ref['dW']):.3e}")
        except Exception as exc:  # report, do not fail: the benchmark records the peer's error too
            print(f"          peer {impl:13s} FAILED to run: {type(exc).__name__}: {str(exc)[:200]}")


def check_loss(pacs_kernels, hidden, weight, targets, tau, gen, chunk, atol, rtol) -> dict:
    """Fused PACS loss (triton) against pacs_loss on the float32 reference log-probs."""
    import torch

    n, d = hidden.shape
    t = n // LOSS_RESPONSES
    used = LOSS_RESPONSES * t
    device = hidden.device
    h = hidden[:used].reshape(LOSS_RESPONSES, t, d)
    y = targets[:used].reshape(LOSS_RESPONSES, t)
    lengths = torch.randint(max(1, t // 2), t + 1, (LOSS_RESPONSES,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(device)
    rewards = torch.tensor([1.0, 0.0] * (LOSS_RESPONSES // 2))[torch.randperm(LOSS_RESPONSES, generator=gen)]
    rewards = rewards.to(device)
    options = dict(group_size=LOSS_GROUP_SIZE, temperature=tau, beta=1.0, score="log_ratio", advantage="rloo",
                   weighting="balanced")

    # reference: float32 log-probs, the loss by autograd on them, then the closed-form gradient
    ref = reference(h.reshape(used, d), weight, y.reshape(used), tau, torch.zeros(used, device=device),
                    torch.zeros(used, device=device), chunk)
    ref_logp = ref["logp"].reshape(LOSS_RESPONSES, t).clone().requires_grad_(True)
    # old_logp near logp, as after a rollout, so that psi is O(1) and the sigmoid does not saturate
    old_logp = ref["logp"].reshape(LOSS_RESPONSES, t) + 0.05 * torch.randn(LOSS_RESPONSES, t, generator=gen).to(device)
    loss_options = {k: v for k, v in options.items() if k != "temperature"}
    ref_loss = pacs_kernels.pacs_loss(ref_logp, old_logp, rewards, mask, backend="torch", **loss_options)
    ref_loss.backward()
    grads = reference(h.reshape(used, d), weight, y.reshape(used), tau, ref_logp.grad.reshape(used),
                      torch.zeros(used, device=device), chunk)

    scale = max(1.0, abs(ref_loss.item()))
    errors = {}
    # every path of the fused loss: two passes (Triton kernels), single pass with the Triton row kernels
    # and with eager PyTorch around the GEMMs (budget: the whole batch in one chunk), and the single pass
    # with a budget of a third of the largest group (each group in 3+ tiles, all but the last rebuilt)
    from pacs_kernels.engine.plan import budget_mib_for_tokens

    largest_group = int(mask.reshape(-1, options["group_size"] * t).sum(1).max())
    third = budget_mib_for_tokens(-(-largest_group // 3), weight.shape[0], weight.device, weight.dtype,
                                  row_kernels="triton")
    for label, path, backend, budget in (("loss", "two_pass", "triton", 16384),
                                         ("single_pass", "single_pass", "triton", 16384),
                                         ("single_pass_torch", "single_pass", "torch", 16384),
                                         ("single_pass_rebuild", "single_pass", "triton", third)):
        hh = h.clone().requires_grad_(True)
        ww = weight.clone().requires_grad_(True)
        loss = pacs_kernels.fused_linear_pacs_loss(
            hh, ww, y, mask, old_logp, rewards, group_size=options["group_size"], objective=pacs_objective(options),
            options=pacs_kernels.LossOptions(backend=backend, path=path, chunk_budget_mib=budget,
                                             temperature=options["temperature"]))
        loss.backward()
        errors[label] = (abs(loss.item() - ref_loss.item()) / scale, atol * 10)
        errors[f"{label}_dh"] = (_rel_err(hh.grad.reshape(used, d), grads["dh"]), rtol)
        errors[f"{label}_dW"] = (_rel_err(ww.grad, grads["dW"]), rtol)
        del hh, ww, loss
    del grads
    if "old_lse" in inspect.signature(pacs_kernels.fused_linear_pacs_loss).parameters:
        errors.update(check_first_step(pacs_kernels, h, weight, y, mask, rewards, options, ref, chunk, atol, rtol))
    return errors


def check_objectives(pacs_kernels, hidden, weight, targets, tau, gen, chunk, atol, rtol) -> dict:
    """Each GRPO-family objective, fused (Triton backend), against the objective on float32 reference log-probs.

    16 responses of up to N/16 tokens (padded rows, ragged lengths), groups of 8 with four 0 and four 1 rewards,
    old_logp off-policy (:func:`off_policy_old_logp`). Paths: ``single_pass`` (a chunk budget of one group:
    two chunks, so the engine's per-chunk shares of the objective are exercised), ``two_pass``, and
    ``packed`` (the single pass on the same tokens packed back to back with cu_seqlens)."""
    import torch

    from benchmarks.grpo_family import OBJECTIVES, make_objective
    from pacs_kernels.engine.plan import budget_mib_for_tokens

    started = time.perf_counter()
    n, d = hidden.shape
    b, t = LOSS_RESPONSES, n // LOSS_RESPONSES
    used, device = b * t, hidden.device
    h, y = hidden[:used].reshape(b, t, d), targets[:used].reshape(b, t)
    lengths = torch.randint(max(1, t // 2), t + 1, (b,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(device)
    rewards = torch.cat([torch.tensor([1.0] * 4 + [0.0] * 4)[torch.randperm(LOSS_GROUP_SIZE, generator=gen)]
                         for _ in range(b // LOSS_GROUP_SIZE)]).to(device)
    zeros = torch.zeros(used, device=device)
    ref_logp = reference(h.reshape(used, d), weight, y.reshape(used), tau, zeros, zeros, chunk)["logp"].reshape(b, t)
    largest_group = int(mask.reshape(-1, LOSS_GROUP_SIZE * t).sum(1).max())
    one_group = budget_mib_for_tokens(largest_group, weight.shape[0], weight.device, weight.dtype, row_kernels="triton")
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    selected = mask.reshape(-1)

    errors = {}
    for name in OBJECTIVES:
        objective = make_objective(name, t)
        old_logp = off_policy_old_logp(objective, ref_logp, mask, gen)
        logp = ref_logp.clone().requires_grad_(True)
        ref_loss, _ = objective(logp, old_logp, rewards, mask, group_size=LOSS_GROUP_SIZE)
        ref_loss.backward()
        grads = reference(h.reshape(used, d), weight, y.reshape(used), tau, logp.grad.reshape(used), zeros, chunk)
        scale = max(1.0, abs(ref_loss.item()))
        for label, path, packed in (("single_pass", "single_pass", False), ("two_pass", "two_pass", False),
                                    ("packed", "single_pass", True)):
            key = f"{name}_{label}"
            hh = (h[mask] if packed else h).clone().requires_grad_(True)
            ww = weight.clone().requires_grad_(True)
            inputs = dict(old_logp=old_logp[mask] if packed else old_logp,
                          cu_seqlens=cu_seqlens if packed else None)
            try:
                loss, _ = pacs_kernels.fused_linear_objective_loss(
                    hh, ww, y[mask] if packed else y, mask[mask] if packed else mask, rewards=rewards,
                    objective=objective, group_size=LOSS_GROUP_SIZE, options=pacs_kernels.LossOptions(
                        backend="triton", path=path, chunk_budget_mib=one_group, temperature=tau), **inputs)
                loss.backward()
            except Exception as exc:  # a failing path is a failed check, not the end of the run
                print(f"          {key}: {type(exc).__name__}: {str(exc)[:300]}")
                errors[key] = (float("inf"), atol * 10)
                continue
            d_hidden = hh.grad if packed else hh.grad.reshape(used, d)[selected]
            errors[key] = (abs(loss.item() - ref_loss.item()) / scale, atol * 10)
            errors[f"{key}_dh"] = (_rel_err(d_hidden, grads["dh"][selected]), rtol)
            errors[f"{key}_dW"] = (_rel_err(ww.grad, grads["dW"]), rtol)
            del hh, ww, loss
        del grads
    print(f"          (the {len(OBJECTIVES)} objectives x 3 paths took {time.perf_counter() - started:.1f}s)")
    return errors


def off_policy_old_logp(objective, logp, mask, gen):
    """old_logp = logp - r for ``objective``: r uniform in +-OFF_POLICY_SPAN, each token's r at least CLIP_MARGIN
    from the log of each clip boundary (1 - eps_low, 1 + eps_high); for GSPO, whose ratio is a response's mean,
    r has the mean GSPO_LOG_RATIOS[i % 8] over response i's tokens instead."""
    import math

    import torch

    import pacs_kernels

    r = (torch.rand(logp.shape, generator=gen) * 2 - 1).to(logp.device) * OFF_POLICY_SPAN
    if isinstance(objective, pacs_kernels.GSPO):
        counts = mask.sum(-1, keepdim=True).clamp_min(1)
        noise = r * (0.05 / OFF_POLICY_SPAN) * mask
        wanted = torch.tensor([GSPO_LOG_RATIOS[i % len(GSPO_LOG_RATIOS)] for i in range(logp.shape[0])],
                              device=logp.device, dtype=logp.dtype)
        r = noise - noise.sum(-1, keepdim=True) / counts + wanted[:, None]
        return (logp - r).detach()
    low, high = clip_range(objective)
    for bound in ([math.log(1 - low)] if low < 1 else []) + [math.log(1 + high)]:
        near = (r - bound).abs() < CLIP_MARGIN
        r = torch.where(near, bound + CLIP_MARGIN * torch.where(r >= bound, 1.0, -1.0), r)
    return (logp - r).detach()


def clip_range(objective) -> tuple[float, float]:
    """(eps_low, eps_high) of a clipped objective (GRPO's clip_eps / clip_eps_high, the others' eps_low / eps_high)."""
    if hasattr(objective, "clip_eps"):
        high = objective.clip_eps if objective.clip_eps_high is None else objective.clip_eps_high
        return objective.clip_eps, high
    return objective.eps_low, objective.eps_high


def print_tile_memory(device) -> None:
    """How the single pass holds its chunks on this device at Qwen2.5-7B's head and the default budget
    (single_pass.tile_memory), so the run's log says which row engine its single-pass numbers used."""
    import torch

    try:
        from pacs_kernels.engine.device import device_profile
        from pacs_kernels.engine.plan import default_chunk_budget_mib, row_kernels_for, tile_memory
    except ImportError:  # an older pacs_kernels
        return
    vocab = 152064
    rows = row_kernels_for("auto", device_profile(device, torch.bfloat16))
    memory = tile_memory(None, vocab, device, torch.bfloat16, row_kernels=rows)
    held = "its own float32 buffer" if memory.tile_dtype is None else str(memory.tile_dtype).replace("torch.", "")
    print(f"[check] single pass here (bf16, V={vocab}, default budget {default_chunk_budget_mib(device):g} MiB): "
          f"{rows} rows, tile in {held}, {memory.bytes_per_token / vocab:g} B a logit, {memory.tokens} tokens "
          f"a chunk, float32 strip of {memory.strip_rows} rows")


def check_first_step(pacs_kernels, h, weight, y, mask, rewards, options, ref, chunk, atol, rtol) -> dict:
    """The one-sweep first step after a rollout (old_lse given, logp == old_logp) vs the reference."""
    import torch

    from pacs_kernels import linear_logprobs

    b, t, d = h.shape
    used = b * t
    with torch.no_grad():  # the rollout policy's pass, by our kernels: the step must accept its output
        old_logp, old_lse = linear_logprobs(h, weight, y, temperature=options["temperature"], return_lse=True,
                                            backend="triton")
    ref_logp = ref["logp"].reshape(b, t).clone().requires_grad_(True)
    loss_options = {k: v for k, v in options.items() if k != "temperature"}
    ref_loss = pacs_kernels.pacs_loss(ref_logp, ref["logp"].reshape(b, t), rewards, mask, backend="torch",
                                      **loss_options)
    ref_loss.backward()
    grads = reference(h.reshape(used, d), weight, y.reshape(used), options["temperature"],
                      ref_logp.grad.reshape(used), torch.zeros(used, device=h.device), chunk)
    hh = h.clone().requires_grad_(True)
    ww = weight.clone().requires_grad_(True)
    loss = pacs_kernels.fused_linear_pacs_loss(
        hh, ww, y, mask, old_logp, rewards, group_size=options["group_size"], objective=pacs_objective(options),
        options=pacs_kernels.LossOptions(backend="triton", temperature=options["temperature"]), old_lse=old_lse)
    loss.backward()
    scale = max(1.0, abs(ref_loss.item()))
    return {
        "first_step_loss": (abs(loss.item() - ref_loss.item()) / scale, atol * 10),
        "first_step_dh": (_rel_err(hh.grad.reshape(used, d), grads["dh"]), rtol),
        "first_step_dW": (_rel_err(ww.grad, grads["dW"]), rtol),
    }


def pacs_objective(options: dict):
    """PACS(...) from this script's loss options (group_size and temperature left out)."""
    import pacs_kernels

    return pacs_kernels.PACS(**{k: v for k, v in options.items() if k not in ("group_size", "temperature")})


def _abs_err(ours, ref) -> float:
    return (ours.float() - ref.float()).abs().max().item()


def _rel_err(ours, ref) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


if __name__ == "__main__":
    sys.exit(main())
