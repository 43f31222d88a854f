"""What is measured: the benchmark operations, their inputs, and every implementation of them.

Three operations, each on N tokens with hidden width d and vocabulary V:

    logprobs_fwd_bwd   policy log-probs: logp = log softmax(h @ W.T)[y], then backward of
                       sum(logp * g) for a random upstream gradient g (dh and dW are produced)
    logprobs_nograd    old-policy log-probs under torch.no_grad() (nothing kept for backward)
    pacs_loss_fwd_bwd  the whole PACS loss (log-ratio score, RLOO, balanced weights), forward
                       and backward, on B = 16 responses of T = N / 16 tokens, groups of 8
    objective_loss_fwd_bwd  a GRPO-family objective's loss (``Case.objective``: grpo, dapo, dr_grpo, gspo,
                       cispo at their defaults, benchmarks/grpo_family.py), forward and backward, on the
                       same inputs as pacs_loss_fwd_bwd (our impls: fused_linear_objective_loss)
    pacs_loss_first_step  the same loss on the first optimizer step after a rollout, where
                       logp == old_logp: fused_linear_pacs_loss(old_lse=...) computes the loss and
                       its gradients in one vocabulary sweep (torch/triton); single_pass needs no
                       old_lse (its one pass is the same 3 matmuls); every other impl computes that
                       step as pacs_loss_fwd_bwd does

The loss ops' old log-probs are those of the current weights plus N(0, 0.05) noise per token, as
after a few small optimizer steps: the scores psi are then O(1), as in training. (Independent random
old log-probs, used before 2026-11-30, gave |psi| ~ 100, sigmoid(psi) - R underflowed to float32
denormals, and on Intel CPUs every GEMM touching them ran 10-20x slower: 30 s instead of 2 s.)

Implementations ("impls"):

    naive          pacs_kernels reference: materializes the N x V logits in float32
                   (for the loss op: LossOptions(backend="naive"))
    torch          pacs_kernels chunked PyTorch backend (any device); loss ops: path="two_pass"
    triton         pacs_kernels Triton kernels (CUDA only; the CPU interpreter is never timed);
                   loss ops: path="two_pass"
    single_pass    loss ops only: LossOptions(path="single_pass") with a chunk budget of
                   one (longest possible) group: one logits GEMM per group, 3 matmuls in all
                   (GEMMs in the input dtype on CUDA)
    single_pass_lowmem  the same with a budget of a third of one group: no group fits, each is cut
                   into 3 tiles, the last one's logits kept and the others rebuilt (3.67 matmuls),
                   memory near the two passes'
    auto           loss ops only: fused_linear_pacs_loss with its defaults (backend="auto", path="auto",
                   no chunk budget: the path and budget pacs_kernels/engine/plan.py picks); on the first
                   step it is given old_lse, as a trainer would
    cce            Apple Cut Cross-Entropy, linear_cross_entropy(reduction="none") = -logp, with
                   its default gradient filter (filter_eps="high": skips tiny softmax entries); on the
                   CPU its impl="torch_compile" (torch.compile of logits + cross_entropy: no filter, the
                   N x V logits materialized; its Triton kernels need CUDA)
    cce_exact      the same with filter_eps=None (exact gradient, like ours)
    liger_flce     Liger-Kernel fused linear cross-entropy, reduction="none" = -logp per token
                   (its Triton path; in 0.8.x the backward recomputes chunks and folds the
                   per-token upstream gradient in), dW accumulated in float32 like ours
    liger_chunked  Liger-Kernel's chunked GRPO/PPO log-prob step,
                   LigerFusedLinearPPOBase.chunk_forward (sequence x vocabulary chunks in
                   PyTorch, custom backward that recomputes the logits)
    trl_chunked    TRL's fused LM-head log-probs (trl.kernels.ChunkedLogProbFunction, TRL 1.15+, what its
                   trainers run by default): cuBLAS tiles of 4,096 tokens x 32,768 columns folded by a
                   Triton kernel (torch ops on the CPU), the backward recomputing each tile
    naive_gemms    loss ops only, not a loss: naive's 3 GEMMs alone (the logits of all masked-in tokens
                   in one GEMM, then dh and dW from them as if they were dz), with no softmax, no loss and
                   no autograd. Naive's time less this is what its elementwise work and autograd cost,
                   the part a fused path can save; how fast a chunked path's GEMMs run depends on their
                   rows (on a CPU, more or fewer can be faster)
    liger_fused    objective op only: Liger-Kernel's whole fused linear GRPO loss
                   (LigerFusedLinearGRPOLoss: the loss_type and importance-sampling level that
                   compute the objective, grpo_family.liger_settings; its loss math under
                   torch.compile on CUDA, eager on the CPU), given our advantages

For the loss ops every impl that only gives log-probs gets the same loss on top:
``pacs_kernels.pacs_loss`` (torch backend), or the objective, on its (B, T) log-probs. Like
``fused_linear_pacs_loss``, it computes log-probs of the masked-in tokens only (their hidden
rows gathered first), so every impl does the same work. Liger's GRPO loss itself
cannot be used: it reduces each chunk of sequences on its own, while PACS couples the G
responses of a group (RLOO baseline, class weights) before any gradient exists.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

OPS = ("logprobs_fwd_bwd", "logprobs_nograd", "pacs_loss_fwd_bwd", "pacs_loss_first_step", "grad_gemms",
       "objective_loss_fwd_bwd")
LOSS_OPS = ("pacs_loss_fwd_bwd", "pacs_loss_first_step", "objective_loss_fwd_bwd")
OBJECTIVE_OP = "objective_loss_fwd_bwd"
OUR_IMPLS = ("naive", "torch", "triton", "single_pass", "single_pass_lowmem", "auto")
SINGLE_PASS_BUDGET_GROUPS = {"single_pass": 1.0, "single_pass_lowmem": 1 / 3}  # chunk budget, in groups
PEER_IMPLS = ("cce", "cce_exact", "liger_flce", "liger_chunked", "trl_chunked")  # log-prob peers
LOSS_PEER_IMPLS = ("liger_fused",)  # a peer's whole loss
NAIVE_GEMMS = "naive_gemms"  # naive's 3 GEMMs alone: a reference point, not an implementation
IMPLS = OUR_IMPLS + PEER_IMPLS + LOSS_PEER_IMPLS + (NAIVE_GEMMS,)

LOSS_RESPONSES = 16  # B: responses per micro-batch in the loss op (two groups)
LOSS_GROUP_SIZE = 8  # G, as in the PACS paper's runs
LOSS_BETA = 1.0

# the matmul floor of each op, in units of N*V*d: the logits (2NVd), then dh and dW (4NVd) for the
# ops with a backward. Designs that do not keep the N x V logits between forward and backward need
# one more (2NVd) unless they know the gradient in the forward (single pass, one sweep); the report
# divides every measured time by the 3-matmul floor at the measured matmul rate.
# grad_gemms: the Triton backward's two gradient GEMMs alone (dh and dW from the staged dz chunks, 4NVd),
# as our Triton kernels ("triton") and as torch.mm / cuBLAS ("torch"): its floor is those two GEMMs.
FLOP_FACTOR = {"logprobs_fwd_bwd": 6, "logprobs_nograd": 2, "pacs_loss_fwd_bwd": 6, "pacs_loss_first_step": 6,
               "grad_gemms": 4, "objective_loss_fwd_bwd": 6}
OLD_LOGP_NOISE = 0.05


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def loss_available() -> bool:
    """True when pacs_kernels provides the fused PACS loss (pacs_loss and fused_linear_pacs_loss)."""
    import pacs_kernels

    return hasattr(pacs_kernels, "fused_linear_pacs_loss") and hasattr(pacs_kernels, "pacs_loss")


def first_step_available() -> bool:
    """True when fused_linear_pacs_loss takes old_lse (the one-sweep first step after a rollout)."""
    if not loss_available():
        return False
    import inspect

    import pacs_kernels

    return "old_lse" in inspect.signature(pacs_kernels.fused_linear_pacs_loss).parameters


def impl_unavailable_reason(op: str, impl: str, device: str, objective: str | None = None) -> str | None:
    """None when (op, impl) can run for real on ``device``; otherwise why not (one line). ``objective``:
    the objective op's (``Case.objective``)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if op == OBJECTIVE_OP:
        from benchmarks.grpo_family import OBJECTIVES

        if objective not in OBJECTIVES:
            return f"{OBJECTIVE_OP} needs an objective of {OBJECTIVES} (loss_grid.py --objective), got {objective!r}"
    if impl == NAIVE_GEMMS and op not in LOSS_OPS:
        return f"{NAIVE_GEMMS} is naive's 3 GEMMs alone, for the loss ops ({', '.join(LOSS_OPS)})"
    if impl in LOSS_PEER_IMPLS:
        if op != OBJECTIVE_OP:
            return (f"{impl} is Liger's whole GRPO-family loss ({OBJECTIVE_OP} only); PACS couples a group's "
                    "responses before any gradient, which Liger's per-chunk reduction cannot hold")
        if not _importable("liger_kernel"):
            return "liger-kernel is not installed"
    if op == "grad_gemms":
        from pacs_kernels.dispatch import GRAD_GEMMS

        if impl not in GRAD_GEMMS:
            return "grad_gemms races the Triton backward's GEMM engines (triton kernels vs torch.mm) only"
        if not _importable("triton"):
            return "triton is not installed (the op stages dz chunks as the Triton backward does)"
    if op in LOSS_OPS and not loss_available():
        return "pacs_kernels has no fused_linear_pacs_loss yet"
    if impl in (*SINGLE_PASS_BUDGET_GROUPS, "auto") and op not in LOSS_OPS:
        return f"{impl} is a path of the fused losses (the log-prob ops have no group to keep whole)"
    if op == "pacs_loss_first_step":
        if impl not in ("torch", "triton", "auto", *SINGLE_PASS_BUDGET_GROUPS):
            return "the one-sweep first step is pacs_kernels' own path (others: see pacs_loss_fwd_bwd)"
        if not first_step_available():
            return "pacs_kernels' fused_linear_pacs_loss has no old_lse (one-sweep first step) yet"
    if impl == "triton":
        if device != "cuda":
            return "Triton runs for real only on CUDA (the CPU interpreter is not timed)"
        if not _importable("triton"):
            return "triton is not installed"
    if impl in ("cce", "cce_exact"):
        if not _importable("cut_cross_entropy"):
            return "cut-cross-entropy is not installed"
        if device != "cuda" and impl == "cce_exact":
            return "on the CPU Cut Cross-Entropy runs its torch_compile impl, which has no filter: see cce"
    if impl == "liger_flce":
        if not _importable("liger_kernel"):
            return "liger-kernel is not installed"
        if device != "cuda":
            return "Liger's fused linear cross-entropy is a Triton kernel (CUDA)"
    if impl == "liger_chunked" and not _importable("liger_kernel"):
        return "liger-kernel is not installed"
    if impl == "trl_chunked" and not trl_fused_logprobs_available():
        return "TRL's fused log-prob kernel (trl.kernels.ChunkedLogProbFunction, TRL 1.15+) is not installed"
    return None


def trl_fused_logprobs_available() -> bool:
    """True when TRL ships its fused LM-head log-prob function (trl.kernels.ChunkedLogProbFunction)."""
    if not _importable("trl"):
        return False
    try:
        from trl.kernels import ChunkedLogProbFunction  # noqa: F401
    except Exception:
        return False
    return True


@dataclass
class Case:
    """One measurement: an operation, an implementation and a size."""

    op: str
    impl: str
    n: int
    d: int
    v: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu" | "cuda"
    seed: int = 0
    objective: str | None = None  # the objective op's: one of grpo_family.OBJECTIVES

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def flops(self) -> float:
        return float(FLOP_FACTOR[self.op]) * selected_tokens(self) * self.v * self.d


def response_lengths(t: int) -> torch.Tensor:
    """The (B,) response lengths of the loss op: spread evenly over [T/2, T] (about 3/4 of N in all)."""
    b = LOSS_RESPONSES
    return torch.tensor([t - (t // 2) * i // (b - 1) for i in range(b)])


def selected_tokens(case: "Case") -> int:
    """Tokens whose log-prob the op computes: all N, or the masked-in ones for the loss op."""
    if case.op in LOSS_OPS:
        return int(response_lengths(case.n // LOSS_RESPONSES).sum())
    return case.n


def make_inputs(case: Case, generator_seed: int) -> dict:
    """Fresh random inputs for one run (never zeros). Logits have a standard deviation near 1."""
    device, dtype = torch.device(case.device), case.torch_dtype
    # random numbers are made where they are used (a CPU generator would spend seconds on the
    # 0.5 G weight entries of a real LM head); the few (B,)-sized choices use a CPU generator
    gen = torch.Generator(device=device).manual_seed(generator_seed)
    small = torch.Generator(device="cpu").manual_seed(generator_seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(scale)

    if case.op == "grad_gemms":  # one staged dz chunk (reused for every chunk, as the backward does)
        from pacs_kernels.triton.launch_config import dz_chunk_tokens

        chunk = dz_chunk_tokens(case.n, case.v, dtype.itemsize)
        return {"dz": randn(chunk, case.v, scale=1e-3), "weight": randn(case.v, case.d, scale=case.d ** -0.5),
                "hidden": randn(case.n, case.d)}
    grad = case.op != "logprobs_nograd"
    weight = randn(case.v, case.d, scale=case.d ** -0.5).requires_grad_(grad)
    if case.op in LOSS_OPS:
        if case.n % LOSS_RESPONSES:
            raise ValueError(f"N must be a multiple of {LOSS_RESPONSES} for the loss op, got {case.n}")
        b, t = LOSS_RESPONSES, case.n // LOSS_RESPONSES
        hidden = randn(b, t, case.d).requires_grad_(True)
        targets = torch.randint(0, case.v, (b, t), generator=gen, device=device)
        lengths = response_lengths(t)[torch.randperm(b, generator=small)]
        mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(device)
        from pacs_kernels import linear_logprobs

        # the rollout policy: the current weights a few small steps ago (see the module docstring)
        with torch.no_grad():
            current, lse = linear_logprobs(hidden, weight, targets, return_lse=True,
                                           backend="torch" if case.impl not in ("triton",) else "triton")
        old_logp = current + OLD_LOGP_NOISE * torch.randn(b, t, generator=gen, device=device)
        rewards = torch.tensor([1.0, 0.0] * (b // 2))[torch.randperm(b, generator=small)].to(device)
        inputs = {"hidden": hidden, "weight": weight, "targets": targets, "mask": mask,
                  "old_logp": old_logp, "rewards": rewards}
        if case.op == "pacs_loss_first_step":  # the rollout policy is the current one
            inputs["old_logp"], inputs["old_lse"] = current, lse
        return inputs
    hidden = randn(case.n, case.d).requires_grad_(grad)
    targets = torch.randint(0, case.v, (case.n,), generator=gen, device=device)
    inputs = {"hidden": hidden, "weight": weight, "targets": targets}
    if grad:
        inputs["grad_logp"] = torch.randn(case.n, generator=gen, device=device)
    return inputs


# ----------------------------------------------------------------------------- log-prob functions

# gpu.sh points this at the grad-GEMM race's table, so that the race after it runs the Triton backward
# with the engine measured faster; the library itself reads no environment variable
DISPATCH_TABLE_ENV = "PACS_BENCH_DISPATCH_TABLE"


def bench_dispatch_table() -> str | None:
    """The dispatch table this benchmark run passes to pacs_kernels (``PACS_BENCH_DISPATCH_TABLE``), or None."""
    return os.environ.get(DISPATCH_TABLE_ENV) or None



def logprob_function(impl: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """f(hidden (..., d), weight (V, d), targets (...)) -> float32 logp (...), differentiable."""
    if impl == "auto":
        raise ValueError("impl 'auto' is a path of the fused losses, not a log-prob function")
    if impl in OUR_IMPLS:
        from pacs_kernels import linear_logprobs

        table = bench_dispatch_table()
        return lambda h, w, y: linear_logprobs(h, w, y, backend=impl, dispatch_table=table)
    if impl in ("cce", "cce_exact"):
        from cut_cross_entropy import linear_cross_entropy

        filter_eps = "high" if impl == "cce" else None

        def cce_logp(h, w, y):
            if h.device.type != "cuda":  # its Triton kernels need CUDA; its own CPU implementation
                return -linear_cross_entropy(h, w, y, reduction="none", impl="torch_compile").float()
            nll = linear_cross_entropy(h, w, y, reduction="none", filter_eps=filter_eps)
            return -nll.float()

        return cce_logp
    if impl == "liger_flce":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger_flce_logp(h, w, y):
            nll = liger_fused_linear_cross_entropy(
                h.reshape(-1, h.shape[-1]), w, y.reshape(-1), reduction="none", accum_dtype=torch.float32)
            return -nll.float().reshape(y.shape)

        return liger_flce_logp
    if impl == "liger_chunked":
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

        def liger_chunked_logp(h, w, y):
            # chunk_forward takes (B, T, d) and (B, T)
            h3 = h if h.dim() == 3 else h.unsqueeze(0)
            y2 = y if y.dim() == 2 else y.unsqueeze(0)
            logp = LigerFusedLinearPPOBase.chunk_forward(h3, w, y2, None, 1.0)
            return logp.float().reshape(y.shape)

        return liger_chunked_logp
    if impl == "trl_chunked":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer import utils as trl_utils

        # the vocabulary chunk TRL's trainers use for their fused head (32,768 columns in TRL 1.16)
        chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)

        def trl_chunked_logp(h, w, y):
            logp, *_ = ChunkedLogProbFunction.apply(h.reshape(-1, h.shape[-1]), w, None, y.reshape(-1), 1.0, chunk,
                                                    None, 1.0, ())
            return logp.float().reshape(y.shape)

        return trl_chunked_logp
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def runner(case: Case) -> Callable[[dict], torch.Tensor]:
    """A function that runs the case once on its inputs and returns what it produced."""
    if case.op == "grad_gemms":
        return _grad_gemms_runner(case.impl)
    if case.impl == NAIVE_GEMMS:
        if case.op not in LOSS_OPS:
            raise ValueError(impl_unavailable_reason(case.op, case.impl, case.device))
        return _naive_gemms_runner
    gives_logprobs = case.op not in LOSS_OPS or case.impl not in OUR_IMPLS + LOSS_PEER_IMPLS
    logp_fn = logprob_function(case.impl) if gives_logprobs else None

    if case.op == "logprobs_nograd":
        def run(inputs):
            with torch.no_grad():
                return logp_fn(inputs["hidden"], inputs["weight"], inputs["targets"])
        return run

    if case.op == "logprobs_fwd_bwd":
        def run(inputs):
            logp = logp_fn(inputs["hidden"], inputs["weight"], inputs["targets"])
            logp.backward(inputs["grad_logp"])
            return logp.detach()
        return run

    if case.op == OBJECTIVE_OP:
        return _objective_runner(case, logp_fn)

    import pacs_kernels

    options = dict(group_size=LOSS_GROUP_SIZE, beta=LOSS_BETA, score="log_ratio", advantage="rloo",
                   weighting="balanced")
    if case.impl in OUR_IMPLS:
        one_sweep = case.op == "pacs_loss_first_step" and case.impl in ("torch", "triton", "auto")
        loss_options = fused_loss_options(case)
        group_size = options.pop("group_size")
        objective = pacs_kernels.PACS(**options)

        def run(inputs):
            extra = {"old_lse": inputs["old_lse"]} if one_sweep else {}
            loss = pacs_kernels.fused_linear_pacs_loss(
                inputs["hidden"], inputs["weight"], inputs["targets"], inputs["mask"], inputs["old_logp"],
                inputs["rewards"], group_size=group_size, objective=objective, options=loss_options, **extra)
            loss.backward()
            return loss.detach()
        return run

    def run(inputs):
        logp = _response_logprobs(logp_fn, inputs)  # like fused_linear_pacs_loss: the masked-in tokens only
        loss = pacs_kernels.pacs_loss(logp, inputs["old_logp"], inputs["rewards"], inputs["mask"],
                                      backend="torch", **options)
        loss.backward()
        return loss.detach()
    return run


def _naive_gemms_runner(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive's 3 GEMMs of the loss ops' masked-in tokens, all at once: z = h W^T, then z W and z^T h (z standing
    in for dz: its values do not change a GEMM's time); returns (dh, dW)."""
    mask, hidden, weight = inputs["mask"], inputs["hidden"].detach(), inputs["weight"].detach()
    with torch.no_grad():
        rows = hidden[mask]
        z = rows @ weight.T
        return z @ weight, z.T @ rows


def fused_loss_options(case: Case):
    """The LossOptions of our impl ``case.impl`` for a fused loss: auto (the library's defaults), single_pass
    (a chunk budget of one group, the longest possible: one group per chunk, 3 matmuls), single_pass_lowmem
    (a third of that: two thirds of each group's logits rebuilt), naive / torch / triton (two passes)."""
    import pacs_kernels

    table = bench_dispatch_table()
    if case.impl == "auto":
        return pacs_kernels.LossOptions(backend="auto", path="auto", dispatch_table=table)
    if case.impl in SINGLE_PASS_BUDGET_GROUPS:
        from pacs_kernels.engine.device import device_profile
        from pacs_kernels.engine.plan import budget_mib_for_tokens, row_kernels_for

        group_tokens = LOSS_GROUP_SIZE * (case.n // LOSS_RESPONSES)
        device = torch.device(case.device)
        row_kernels = row_kernels_for("auto", device_profile(device, case.torch_dtype))
        budget = budget_mib_for_tokens(math.ceil(group_tokens * SINGLE_PASS_BUDGET_GROUPS[case.impl]), case.v,
                                       device, case.torch_dtype, row_kernels=row_kernels)
        return pacs_kernels.LossOptions(backend="auto", path="single_pass", chunk_budget_mib=budget,
                                        dispatch_table=table)
    return pacs_kernels.LossOptions(backend=case.impl, path="two_pass", dispatch_table=table)


def _objective_runner(case: Case, logp_fn) -> Callable[[dict], torch.Tensor]:
    """The objective op: ours through fused_linear_objective_loss, Liger's fused GRPO loss, or a peer's
    log-probs of the response tokens followed by the objective."""
    import pacs_kernels
    from benchmarks import grpo_family

    name = case.objective
    objective = grpo_family.make_objective(name, case.n // LOSS_RESPONSES)
    if case.impl in OUR_IMPLS:
        loss_options = fused_loss_options(case)

        def run(inputs):
            loss, _ = pacs_kernels.fused_linear_objective_loss(
                inputs["hidden"], inputs["weight"], inputs["targets"], inputs["mask"], inputs["old_logp"],
                inputs["rewards"], objective=objective, group_size=LOSS_GROUP_SIZE, options=loss_options)
            loss.backward()
            return loss.detach()
        return run

    if case.impl == "liger_fused":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger_loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=case.device == "cuda",
                                              **grpo_family.liger_settings(name, objective))

        def run(inputs):
            advantages = grpo_family.advantages(name, inputs["rewards"], LOSS_GROUP_SIZE)
            loss, _metrics = liger_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["mask"].float(),
                                        advantages, old_per_token_logps=inputs["old_logp"].float())
            loss.backward()
            return loss.detach()
        return run

    def run(inputs):
        logp = _response_logprobs(logp_fn, inputs)
        loss, _ = objective(logp, inputs["old_logp"], inputs["rewards"], inputs["mask"], group_size=LOSS_GROUP_SIZE)
        loss.backward()
        return loss.detach()
    return run


def _response_logprobs(logp_fn, inputs: dict) -> torch.Tensor:
    """A log-prob impl on the response tokens only (their hidden rows gathered first, as the fused losses
    do), scattered back into (B, T) rows, zeros elsewhere."""
    mask = inputs["mask"]
    index = mask.reshape(-1).nonzero().squeeze(-1)
    hidden = inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1]).index_select(0, index)
    selected = logp_fn(hidden, inputs["weight"], inputs["targets"].reshape(-1).index_select(0, index))
    return torch.zeros(mask.numel(), device=selected.device, dtype=selected.dtype).index_put(
        (index,), selected).reshape(mask.shape)


def _grad_gemms_runner(engine: str) -> Callable[[dict], torch.Tensor]:
    """The Triton backward's GEMM phase over N tokens: per dz chunk dh = dz W and dW += dz^T h (float32
    across chunks), with the chosen engine (``logprob_backward.grad_products``)."""
    from pacs_kernels.triton.logprob_backward import grad_products

    def run(inputs):
        dz, weight, hidden = inputs["dz"], inputs["weight"], inputs["hidden"]
        n, chunk = hidden.shape[0], dz.shape[0]
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.empty(weight.shape, device=weight.device,
                               dtype=torch.float32 if chunk < n else weight.dtype)
        for index, row0 in enumerate(range(0, n, chunk)):
            rows = min(chunk, n - row0)
            grad_products(dz[:rows], weight, hidden, d_hidden, d_weight, None, row0=row0, accumulate=index > 0,
                          gemms=engine)
        return d_weight
    return run
