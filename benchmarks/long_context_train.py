"""How long can I train here? The longest response whose full training step fits a memory budget.

    python benchmarks/long_context_train.py --device cpu                        # small model, 192 MiB
    python benchmarks/long_context_train.py --device cuda --budget-gib 24 80    # Qwen2.5-1.5B shapes
    python benchmarks/long_context_train.py --dry-run                           # tiny, CPU, seconds

One step is what the trainer does for one micro-batch: one group of G = 4 responses after a
shared prompt, response lengths L, 3L/4, L/2, L/4 (the longest at the cap, the others spread, as
RL rollouts are); the backbone's forward and backward, the PACS loss (old log-probs given), and
one AdamW step. The model is randomly initialised (no download). Variants (each a set of the
trainer's switches; pacs/model/packing.py, pacs/model/memory.py):

  padded_naive               padded rows; the usual loss: full logits (B, T, V), float32
                             log-softmax, gather, then pacs_loss (what a plain HF trainer does)
  padded_fused               padded rows; fused_linear_pacs_loss (no logits)
  packed_fused               packed row (train.packing), fused loss
  packed_fused_ckpt          + activation checkpointing (model.gradient_checkpointing)
  ..._tiled                  + the tiled MLP (train.tiled_mlp: each decoder MLP over tiles of d
                             tokens, only its input kept for the backward: pacs/model/tiled_mlp.py)
  packed_fused_ckpt_offload  + checkpointed activations offloaded to host (train.offload_activations)
  packed_fused_ckpt_split    + the group run in parts, one response each (a token budget below the
                             group: pacs/train/update.py's known_gradients): a no-grad pass over the parts (as on a
                             later mini-batch; free on the first), then each part's forward and
                             backward with its tokens' gradients fixed: the peak is one response's
                             step, not the group's
  ..._liger                  + Liger-Kernel RMSNorm/SwiGLU/RoPE (train.liger_patches; CUDA)
  ..._fsdp_cpu               + FSDP2 CPU offload of parameters, gradients and AdamW state
                             (train.fsdp_cpu_offload; one process, CUDA)

On the CPU host memory is the device memory, so the offload variants do not apply there (and
Liger needs CUDA): CPU sweeps run the first seven. The footprint of a step:

  * CPU: each variant runs in a fresh subprocess (glibc returning freed blocks to the kernel, as
    in benchmarks/measure.py): a warm-up step at a tiny length creates the AdamW state and pages
    in the code; before each trial the resident set's high-water mark is reset
    (/proc/self/clear_refs); the footprint is the bytes of parameters + optimizer state plus the
    peak resident-set increase of the step. It fits when that is within the budget.
  * CUDA: one process; the caching allocator is capped at the budget
    (set_per_process_memory_fraction) and the footprint is max_memory_allocated of the step
    (parameters, gradients, optimizer state and activations together). It fits when it runs
    without running out of memory.

The fused loss's logits working memory (train.loss_chunk_mib, the kernels' chunk_budget_mib) is
set to 1/64 of the budget, as a user on that budget would: the CPU default (256 MiB) alone would
exceed a 192 MiB budget. (Sweeps before 2026-12-01 ran the fused loss as two passes, whose memory
does not depend on that setting.)

L doubles from --l-start until a step does not fit, then bisection narrows the edge to 1/8.
Writes OUT/long_context_train_<device>.csv, .md, .png (rows written after every trial).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.long_context import doubling_bisection
from benchmarks.measure import REPO_ROOT, WORKER_ENV, error_line, peak_rss_mib, reset_peak_rss

GROUP = 4
MODELS = {
    # Qwen2.5-1.5B: 28 layers, d=1536, 12 query / 2 KV heads of 128, MLP 8960, V=151936, tied embeddings
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True,
                         rope_theta=1e6),
    "cpu-small": dict(vocab_size=16384, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
}
LEVERS = ("packed", "fused", "ckpt", "tiled", "split", "offload", "liger", "fsdp_cpu")
VARIANTS = {
    "padded_naive": (),
    "padded_fused": ("fused",),
    "packed_fused": ("packed", "fused"),
    "packed_fused_ckpt": ("packed", "fused", "ckpt"),
    "packed_fused_ckpt_tiled": ("packed", "fused", "ckpt", "tiled"),
    "packed_fused_ckpt_split": ("packed", "fused", "ckpt", "split"),
    "packed_fused_ckpt_split_tiled": ("packed", "fused", "ckpt", "split", "tiled"),
    "packed_fused_ckpt_offload": ("packed", "fused", "ckpt", "offload"),
    "packed_fused_ckpt_offload_split": ("packed", "fused", "ckpt", "offload", "split"),
    "packed_fused_ckpt_offload_split_tiled": ("packed", "fused", "ckpt", "offload", "split", "tiled"),
    "packed_fused_ckpt_offload_fsdp_cpu": ("packed", "fused", "ckpt", "offload", "fsdp_cpu"),
    # last: Liger's RoPE patch replaces a module-level function, so it would leak into later variants
    "packed_fused_ckpt_offload_liger": ("packed", "fused", "ckpt", "offload", "liger"),
}
CUDA_ONLY = {"offload", "liger", "fsdp_cpu"}
DEFAULTS = {
    "cpu": dict(model="cpu-small", dtype="float32", budgets_mib=[192.0], prompt_len=32, l_start=32, l_max=1 << 16),
    # on a GPU the time is short (one call of gpu.sh): the baseline, then the levers that matter most
    "cuda": dict(model="qwen2.5-1.5b", dtype="bfloat16", budgets_mib=[24 * 1024.0, 80 * 1024.0], prompt_len=256,
                 l_start=512, l_max=1 << 17,
                 variants=["padded_naive", "packed_fused_ckpt", "packed_fused_ckpt_tiled",
                           "packed_fused_ckpt_offload_split", "packed_fused_ckpt_offload_split_tiled",
                           "packed_fused_ckpt_offload_fsdp_cpu", "packed_fused_ckpt_offload_liger"]),
    "dry": dict(model="tiny", dtype="float32", budgets_mib=[4.0], prompt_len=8, l_start=16, l_max=256),
}


# ----------------------------------------------------------------------------- one step


def trial_loss_chunk_mib(budget_mib: float) -> float:
    """The fused loss's logits working memory in a trial: 1/64 of the memory budget (3 MiB of 192,
    384 MiB of 24 GiB), as a user training long responses on that budget would set
    train.loss_chunk_mib; the default (256 MiB on the CPU) would be more than the whole CPU budget."""
    return budget_mib / 64


def response_lengths(longest: int) -> list[int]:
    """G lengths: L, 3L/4, L/2, L/4 (at least 1 token each)."""
    return [max(1, longest * (GROUP - i) // GROUP) for i in range(GROUP)]


def make_batch(longest: int, prompt_len: int, vocab: int, seed: int, device):
    from pacs.train.batch import build_batch

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in response_lengths(longest)]
    rewards = [float(i % 2) for i in range(GROUP)]  # both labels: the loss has a gradient
    return build_batch([prompt] * GROUP, responses, rewards, pad_token_id=0).to(device)


def build(model: str | dict, levers: tuple[str, ...], device: torch.device, dtype: torch.dtype, precision=None):
    """(policy, optimizer) with the variant's switches applied the way the trainer applies them. ``model``: a
    name in MODELS or a Qwen2 config's fields; ``precision`` (pacs.model.mixed_precision.Precision): float32 master
    weights under 16-bit autocast, as pacs train on one process."""
    import transformers

    from pacs.model.layers import decoder_layers
    from pacs.model.memory import apply_liger_patches, fsdp_kwargs
    from pacs.model.packing import enable_packed_attention
    from pacs.model.policy import Policy
    from pacs.model.tiled_mlp import tile_mlp

    fields = MODELS[model] if isinstance(model, str) else {
        key: value for key, value in model.items() if key in transformers.Qwen2Config().to_dict()}
    config = transformers.Qwen2Config(**{**fields, "max_position_embeddings": 1 << 20, "use_sliding_window": False})
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype, on its device: no float32 copy on the way
    try:
        with torch.device(device):
            causal_lm = transformers.Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if "ckpt" in levers:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "packed" in levers:
        enable_packed_attention(causal_lm, device)
    else:
        causal_lm.set_attn_implementation("sdpa")
    if "liger" in levers:
        apply_liger_patches(causal_lm, device)
    if "tiled" in levers:
        tile_mlp(causal_lm)  # the trainer's default tile: the hidden size
    policy = Policy(causal_lm, precision, autocast=precision is not None).train()
    if "fsdp_cpu" in levers:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29581", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))
        for layer in decoder_layers(causal_lm):
            fully_shard(layer, mesh=mesh, **fsdp_kwargs(True))
        fully_shard(policy, mesh=mesh, **fsdp_kwargs(True))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    return policy, optimizer


def train_step(policy, optimizer, batch, levers: tuple[str, ...], device: torch.device,
               loss_chunk_mib: float | None = None) -> float:
    """One micro-batch = one group: forward, loss, backward, AdamW step (the fused loss's logits
    within ``loss_chunk_mib``: train.loss_chunk_mib). Returns the loss. ``optimizer=None``: no
    step, the gradients stay in the parameters' ``.grad``."""
    from pacs.config import Config
    from pacs.model.memory import activation_offload
    from pacs.model.packing import forward_micro_batch, slice_micro_batch, to_layout
    from pacs.train.update import policy_loss
    from pacs_kernels import pacs_loss

    gen = torch.Generator().manual_seed(1)
    old_logp = (torch.rand(batch.targets.shape, generator=gen) * -4.0).to(device)
    packed = "packed" in levers
    cfg = Config()
    cfg.rollout.group_size = GROUP
    cfg.train.loss_chunk_mib = loss_chunk_mib
    if "split" in levers:  # one response per part; the group's per-token gradients first
        from pacs.train.loss_objective import loss_objective
        from pacs.train.old_policy import old_policy_logprobs
        from pacs.train.update import micro_batch
        from pacs.train.update_batch import update_batch
        from pacs_kernels import KnownGradient, known_gradient_on_rows

        parts = [(row, row + 1) for row in range(GROUP)]
        logp, lse, _ = old_policy_logprobs(policy, batch, parts, cfg.rollout.temperature, cfg.optim.logprob_backend,
                                           packed=packed)
        data = update_batch(cfg, batch, old_logp, lse, packed=packed)
        group_loss, grad_logp, stats = known_gradient_on_rows(  # the group is the whole batch
            loss_objective(cfg), logp, data.old_logp, batch.rewards, batch.mask, group_size=GROUP, valid=data.valid)
        for lo, hi in parts:
            with activation_offload("offload" in levers, device):
                micro = micro_batch(data, lo, hi)  # the part's piece, as the trainer's loss_piece builds it
                piece = KnownGradient(grad_logp[micro.index], lse[micro.index], float(group_loss),
                                      stats if lo == 0 else {})
                surrogate, _ = policy_loss(cfg, policy, micro.part, micro.old_logp, piece=piece)
            surrogate.backward()
            del surrogate
        loss_value = float(group_loss)
    else:
        part = slice_micro_batch(batch, 0, GROUP, packed)
        with activation_offload("offload" in levers, device):
            if "fused" in levers:
                loss, _ = policy_loss(cfg, policy, part, to_layout(part, 0, old_logp))
            else:  # the usual way: logits of every position, float32 log-softmax, gather
                hidden, weight, bias = forward_micro_batch(policy, part)
                logits = torch.nn.functional.linear(hidden, weight, bias).float()
                logp = torch.log_softmax(logits, dim=-1).gather(-1, part.targets.unsqueeze(-1)).squeeze(-1)
                loss = pacs_loss(logp, to_layout(part, 0, old_logp), part.rewards, part.mask, group_size=GROUP)
        loss.backward()
        loss_value = float(loss.detach())
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_value


def state_mib(policy, optimizer) -> float:
    """Bytes of parameters and optimizer state (local tensors), MiB."""
    tensors = list(policy.parameters()) + [t for s in optimizer.state.values() for t in s.values()
                                           if isinstance(t, torch.Tensor)]
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total / 2**20


# ----------------------------------------------------------------------------- trials


class VariantRunner:
    """One variant's model and optimizer, reused across its trials (one process)."""

    def __init__(self, model: str, variant: str, dtype: str, prompt_len: int, device: torch.device):
        self.levers = tuple(VARIANTS[variant])
        self.device = device
        self.vocab = MODELS[model]["vocab_size"]
        self.prompt_len = prompt_len
        self.policy, self.optimizer = build(model, self.levers, device, getattr(torch, dtype))
        # the first step creates the AdamW state (every trial carries it, as training does) and, on
        # the CPU, pages in the code that the resident set would otherwise count
        train_step(self.policy, self.optimizer, make_batch(8, 4, self.vocab, 3, device), self.levers, device)

    def trial(self, longest: int, budget_mib: float) -> dict:
        start = time.perf_counter()
        batch = make_batch(longest, self.prompt_len, self.vocab, 7, self.device)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                train_step(self.policy, self.optimizer, batch, self.levers, self.device,
                           trial_loss_chunk_mib(budget_mib))
                torch.cuda.synchronize()
                footprint = torch.cuda.max_memory_allocated() / 2**20
                result = {"fits": footprint <= budget_mib, "footprint_mib": footprint}
            except torch.OutOfMemoryError:
                result = {"fits": False, "footprint_mib": None, "note": "out of memory"}
            self.optimizer.zero_grad(set_to_none=True)
            batch = None
            gc.collect()
            torch.cuda.empty_cache()
        else:
            base = reset_peak_rss()
            train_step(self.policy, self.optimizer, batch, self.levers, self.device,
                       trial_loss_chunk_mib(budget_mib))
            footprint = state_mib(self.policy, self.optimizer) + peak_rss_mib() - base
            result = {"fits": footprint <= budget_mib, "footprint_mib": footprint}
        return {**result, "seconds": time.perf_counter() - start}

    def close(self):
        self.policy = self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def search(runner: VariantRunner, budget_mib: float, l_start: int, l_max: int, deadline: float | None, emit) -> bool:
    """Doubling then bisection over the longest response L; ``emit(longest, result)`` per trial.
    Returns whether the deadline cut the search short (before the edge was bracketed)."""

    def fits(longest: int) -> bool:
        result = runner.trial(longest, budget_mib)
        emit(longest, result)
        return result["fits"]

    cut = []

    def out_of_time() -> bool:
        if deadline is not None and time.perf_counter() > deadline:
            cut.append(True)
        return bool(cut)

    doubling_bisection(fits, l_start, l_max, GROUP, out_of_time)
    return bool(cut)


def cpu_worker(request: dict) -> None:
    """Subprocess body (CPU): one variant's whole search, one JSON line per trial. A fresh process
    per variant keeps one variant's allocations out of the next one's resident set."""
    if request.get("threads"):
        torch.set_num_threads(request["threads"])
    runner = VariantRunner(request["model"], request["variant"], request["dtype"], request["prompt_len"],
                           torch.device("cpu"))
    deadline = None if request["seconds"] is None else time.perf_counter() + request["seconds"]

    def emit(longest, result):
        print(json.dumps({"longest": longest, **result}), flush=True)

    cut = search(runner, request["budget_mib"], request["l_start"], request["l_max"], deadline, emit)
    print(json.dumps({"cut": cut}), flush=True)


def run_cpu_variant(request: dict, timeout_s: float, emit) -> bool:
    """Run :func:`cpu_worker` in a fresh subprocess, passing its trials to ``emit`` as they come.
    Returns whether the search was cut short (its time share, or ``timeout_s``)."""
    env = dict(os.environ)
    env.update(WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    import tempfile

    errors = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty worker cannot block on it
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.long_context_train", "--worker", json.dumps(request)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
    start = time.perf_counter()
    cut = True  # unless the worker says it finished
    try:
        for line in proc.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                if "cut" in result:
                    cut = result["cut"]
                else:
                    emit(result.pop("longest"), result)
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                break
        proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.returncode not in (0, None) and proc.returncode != -9:
        errors.seek(0)
        tail = errors.read().strip().splitlines()[-1:] or ["no output"]
        print(f"[train-long] {request['variant']}: worker exit {proc.returncode}: {tail[0][:200]}", flush=True)
    return cut


# ----------------------------------------------------------------------------- the sweep


def applicable(variant: str, device: str) -> str | None:
    """None when the variant runs on ``device``, else why not."""
    levers = set(VARIANTS[variant])
    if device == "cpu" and levers & CUDA_ONLY:
        return "CUDA only (host memory is device memory on the CPU; Liger is Triton on GPU)"
    if "liger" in levers:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "liger-kernel not installed"
    return None


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny model and budget on the CPU (plumbing check)")
    parser.add_argument("--model", choices=sorted(MODELS), default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--budget-mib", type=float, nargs="+", default=None)
    parser.add_argument("--budget-gib", type=float, nargs="+", default=None)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--l-start", type=int, default=None)
    parser.add_argument("--l-max", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads per trial")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole sweep, shared equally among the (budget, variant) searches "
                        "still to run: no trial starts after its search's share")
    parser.add_argument("--timeout", type=float, default=300.0, help="CPU: seconds per variant's search")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "long_context_train")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args
    if args.dry_run and args.device != "cpu":
        parser.error("--dry-run runs on the CPU")
    defaults = DEFAULTS["dry" if args.dry_run else args.device]
    for key in ("model", "dtype", "prompt_len", "l_start", "l_max"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.budget_gib is not None:
        args.budget_mib = [g * 1024.0 for g in args.budget_gib]
    if args.budget_mib is None:
        args.budget_mib = list(defaults["budgets_mib"])
    if args.variants is None:
        args.variants = list(defaults.get("variants", VARIANTS))
    if args.l_start % GROUP:
        parser.error(f"--l-start must be a multiple of {GROUP}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        cpu_worker(json.loads(args.worker))
        return 0
    device = args.device
    if device == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before the first allocation
        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available here", file=sys.stderr)
            return 2
    from benchmarks.run import device_name as describe

    name = describe(device)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"long_context_train_{'dry' if args.dry_run else device}"
    print(f"[train-long] {name}; model {args.model} ({args.dtype}), group of {GROUP}, prompt {args.prompt_len}, "
          f"budgets {', '.join(f'{b:.0f} MiB' for b in args.budget_mib)}", flush=True)
    deadline = None if args.time_budget is None else time.perf_counter() + args.time_budget
    pairs_left = sum(applicable(v, device) is None for v in args.variants) * len(args.budget_mib)
    rows, summary = [], []
    for budget in sorted(args.budget_mib):
        if device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory / 2**20
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        for variant in args.variants:
            reason = applicable(variant, device)
            if reason is not None:
                summary.append((budget, variant, None, None, reason))
                continue
            if deadline is not None and time.perf_counter() > deadline:
                summary.append((budget, variant, None, None, "time budget spent"))
                continue
            # an equal share of the time left for each (budget, variant) still to run, so that a slow
            # variant cannot starve the later ones (a search cut short reports ">= L")
            share = None if deadline is None else time.perf_counter() + (deadline - time.perf_counter()) / pairs_left
            pairs_left -= 1
            trials: list[tuple[int, bool]] = []

            def emit(longest, result, budget=budget, variant=variant, trials=trials):
                trials.append((longest, result["fits"]))
                lengths = response_lengths(longest)
                rows.append({"date": date, "device": device, "device_name": name, "model": args.model,
                             "dtype": args.dtype, "variant": variant, "budget_mib": budget, "longest_response": longest,
                             "packed_tokens": GROUP * args.prompt_len + sum(lengths),
                             "padded_tokens": GROUP * (args.prompt_len + longest), "fits": result["fits"],
                             "footprint_mib": result["footprint_mib"], "seconds": round(result["seconds"], 2),
                             "note": result.get("note", "")})
                write_csv(rows, stem.with_suffix(".csv"))
                shown = "n/a" if result["footprint_mib"] is None else f"{result['footprint_mib']:.0f} MiB"
                print(f"[train-long] budget {budget:.0f} MiB {variant:36s} L={longest:<7d} "
                      f"{'fits' if result['fits'] else 'does not fit'} ({shown}, {result['seconds']:.1f}s) "
                      f"{result.get('note', '')}", flush=True)

            failed = ""
            if device == "cuda" or args.dry_run:  # the dry run: in this process, for speed (plumbing check only)
                cut = False
                try:
                    runner = VariantRunner(args.model, variant, args.dtype, args.prompt_len, torch.device(device))
                    try:
                        cut = search(runner, budget, args.l_start, args.l_max, share, emit)
                    finally:
                        runner.close()
                except Exception as exc:  # out of memory inside a trial is a result; anything else ends
                    # this variant's search, not the sweep (a lever that breaks on this machine)
                    failed = f"failed: {error_line(exc, 160)}"
                    print(f"[train-long] budget {budget:.0f} MiB {variant}: {failed}; the next variant runs",
                          flush=True)
                if failed:  # outside the except block: the traceback's tensors are gone now
                    runner = None
                    gc.collect()
                    if device == "cuda":
                        torch.cuda.empty_cache()
            else:
                left = None if share is None else max(0.0, share - time.perf_counter())
                request = dict(variant=variant, model=args.model, dtype=args.dtype, prompt_len=args.prompt_len,
                               budget_mib=budget, l_start=args.l_start, l_max=args.l_max, threads=args.threads,
                               seconds=left)
                cut = run_cpu_variant(request, args.timeout, emit)
            fitting = [n for n, ok in trials if ok]
            failing = [n for n, ok in trials if not ok]
            lo = max(fitting) if fitting else None
            hi = min(failing) if failing else None
            summary.append((budget, variant, lo, hi, failed or ("time share spent before the edge" if cut else "")))
    write_csv(rows, stem.with_suffix(".csv"))
    stem.with_suffix(".md").write_text(report(summary, args, name, date))
    plot(rows, summary, args, name, date, stem.with_suffix(".png"))
    print(report(summary, args, name, date), flush=True)
    print(f"[train-long] wrote {stem}.csv, .md, .png", flush=True)
    failed = [variant for _, variant, _, _, note in summary if note.startswith("failed")]
    if failed:  # every variant was still searched; the exit code says that some could not be
        print(f"[train-long] failed (not out of memory): {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


COLUMNS = ["date", "device", "device_name", "model", "dtype", "variant", "budget_mib", "longest_response",
           "packed_tokens", "padded_tokens", "fits", "footprint_mib", "seconds", "note"]


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def report(summary, args, name: str, date: str) -> str:
    lines = [f"## Longest trainable response ({args.device}{', dry run' if args.dry_run else ''})", "",
             f"Device: {name}; date: {date}. Model: `{args.model}` shapes, random init, {args.dtype}. One step = "
             f"one group of {GROUP} responses (lengths L, 3L/4, L/2, L/4) after a {args.prompt_len}-token prompt: "
             "forward, PACS loss, backward, AdamW step. The fused loss's logits working memory "
             "(train.loss_chunk_mib) is 1/64 of the budget; the split variants run the group one response "
             "at a time (pacs/train/update.py's known_gradients).", "",
             "| budget | variant | longest response L that fits | smallest L tried that does not | vs padded_naive |",
             "|---:|---|---:|---:|---:|"]
    base = {b: lo for b, v, lo, _, _ in summary if v == "padded_naive"}
    for budget, variant, lo, hi, note in summary:
        if note and lo is None:
            lines.append(f"| {budget:.0f} MiB | {variant} | {note} | | |")
            continue
        text = "none tried fits" if lo is None else (f">= {lo}" if hi is None else str(lo))
        text += f" ({note})" if note else ""
        ratio = f"{lo / base[budget]:.1f}x" if lo and base.get(budget) else ""
        lines.append(f"| {budget:.0f} MiB | {variant} | {text} | {'' if hi is None else hi} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(rows, summary, args, name: str, date: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({b for b, *_ in summary})
    fig, axes = plt.subplots(1, len(budgets), figsize=(7 * len(budgets), 4.8), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for _, variant, lo, _, _ in [s for s in summary if s[0] == budget]:
            points = sorted((r["longest_response"], r["footprint_mib"]) for r in rows
                            if r["variant"] == variant and r["budget_mib"] == budget and r["footprint_mib"] is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        label=f"{variant}: L <= {lo if lo is not None else 'none'}")
        ax.axhline(budget, color="black", linestyle="--", label=f"budget {budget:.0f} MiB")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("longest response L (tokens)")
        ax.set_ylabel("footprint of the training step (MiB)")
        ax.set_title(f"{args.model}, {args.dtype}, budget {budget:.0f} MiB\n{name}, {date}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
