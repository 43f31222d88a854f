"""TRL drop-in: one training micro-step of PACSTrainer against GRPOTrainer's default loss, same run.

Each case runs in a fresh subprocess (peak-RSS method and caveats: benchmarks/measure.py): a tiny
Llama with a large vocabulary (default V=32000, d=256, 2 layers: ``--layers``) built in code, float32 (bf16=False
for both, so that both heads run in the same precision), and one fixed on-policy micro-batch
(default 8 responses x 256 completion tokens after 32 prompt tokens, 2 groups of 4, mixed 0/1
rewards) handed straight to ``trainer.compute_loss`` + ``backward`` (no generation: only the loss
step differs between the cases). Measured: median wall time of ``--repeats`` steps after one warm-up
step (also recorded: the fastest step, the median process CPU time per step, and cpu_util = CPU time /
wall time over the measured steps, about --threads on an idle machine, lower when other processes take
the cores), and the peak increase of the resident set over the state before the first measured step
(model, optimizer-free). Cases:

    trl_default   GRPOTrainer, GRPOConfig defaults (loss_type="dapo"; TRL's chunked fused LM head)
    pacs          PACSTrainer (pacs_kernels torch backend; on-policy: one-sweep first step;
                  pacs_skip_zero_gradient_groups on, its default)
    pacs_no_skip  the same with pacs_skip_zero_gradient_groups=False (every group runs)
    pacs_padded   PACSTrainer with pacs_padding_free=False: the loss's forward on TRL's padded rows
                  (``pacs`` runs it on the real tokens packed into one row, its default)
    pacs_ckpt     ``pacs`` with gradient_checkpointing=True (switched on as Trainer.train() does it: the
                  micro-step bypasses train()); each decoder layer recomputed in the backward
    pacs_ckpt_tiled  ``pacs_ckpt`` with pacs_tiled_mlp=True (each decoder MLP run in tiles of d tokens)

``--single-label-groups K`` (default 0) makes the first K groups single-label (all rewards 1 in the
first, all 0 in the next, alternating), the others mixed as by default: ``pacs`` leaves those out of
the forward and backward (their gradient is exactly 0 on-policy; one group still runs when all are
single-label), ``pacs_no_skip`` runs them. Both must give the same loss: the script stops with an
error when their losses differ by more than 1e-5 relative. Each row records ``groups_run`` (the
groups PACSTrainer put through the model, from its ``pacs/skipped_group_frac`` metric). ``pacs_padded``
must give ``pacs``'s loss too (up to the float32 rounding of RoPE's angles at other positions), and so must
``pacs_ckpt`` and ``pacs_ckpt_tiled`` (the same forward, recomputed or tiled).

``--varied-lengths`` gives the rows lengths as a rollout does: prompts of P/2 to P tokens (left-padded),
completions of C/8 to C tokens (right-padded), spread over the rows; by default every prompt is P tokens
and every third completion C - C/4.

    python benchmarks/trl_dropin.py                        # writes benchmarks/results/trl_dropin_cpu.csv
    python benchmarks/trl_dropin.py --vocab 8192 --completion-len 64 --out /tmp/small.csv
    python benchmarks/trl_dropin.py --cases pacs pacs_no_skip --responses 16 --single-label-groups 2 \
        --out /tmp/skip.csv                                # 4 groups of 4, 2 of them single-label
    python benchmarks/trl_dropin.py --cases pacs pacs_padded --varied-lengths --completion-len 1024 \
        --out benchmarks/results/trl_padding_free_cpu.csv  # padding-free vs padded rows
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CASES = ("trl_default", "pacs", "pacs_no_skip", "pacs_padded", "pacs_ckpt", "pacs_ckpt_tiled")
LOSS_RTOL = 1e-5  # pacs vs pacs_no_skip / pacs_padded / pacs_ckpt*: the same loss up to float rounding
SAME_LOSS_AS_PACS = ("pacs_no_skip", "pacs_padded", "pacs_ckpt", "pacs_ckpt_tiled")
CHECKPOINTED = ("pacs_ckpt", "pacs_ckpt_tiled")
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # with benchmarks/measure.py's malloc settings
GROUP = 4


def build_trainer(case: str, args, out_dir: str):
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from pacs.tasks.embedded import build_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=args.prompt_len + args.completion_len,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    common = dict(output_dir=out_dir, per_device_train_batch_size=args.responses, num_generations=GROUP,
                  max_completion_length=args.completion_len, report_to="none", save_strategy="no", use_cpu=True,
                  bf16=False, gradient_accumulation_steps=1)
    dataset = Dataset.from_dict({"prompt": ["1+1="] * 8})

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    if case.startswith("pacs"):
        from pacs.integrations.trl import PACSConfig, PACSTrainer

        config = PACSConfig(**common, pacs_skip_zero_gradient_groups=case != "pacs_no_skip",
                            pacs_padding_free=False if case == "pacs_padded" else None,
                            gradient_checkpointing=case in CHECKPOINTED, pacs_tiled_mlp=case == "pacs_ckpt_tiled")
        trainer = PACSTrainer(model, reward, args=config, train_dataset=dataset, processing_class=build_tokenizer())
    else:
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model, reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=build_tokenizer())
    if trainer.args.gradient_checkpointing:  # what Trainer.train() does with it (the micro-step bypasses train())
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)
        if not trainer.model.is_gradient_checkpointing:
            raise RuntimeError(f"{case}: gradient checkpointing did not switch on")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def make_rewards(responses: int, single_label_groups: int = 0):
    """(responses,) float32 0/1 rewards in groups of GROUP: the first ``single_label_groups`` groups
    single-label (all 1, then all 0, alternating), every other group mixed (1, 0, 1, 0)."""
    import torch

    n_groups = responses // GROUP
    if responses % GROUP or not 0 <= single_label_groups <= n_groups:
        raise ValueError(f"--single-label-groups must be in [0, {n_groups}] (the number of groups of {GROUP} "
                         f"in {responses} responses), got {single_label_groups}")
    mixed = torch.tensor([1.0, 0.0] * (GROUP // 2) + [1.0] * (GROUP % 2))
    groups = [torch.full((GROUP,), float(g % 2 == 0)) if g < single_label_groups else mixed
              for g in range(n_groups)]
    return torch.cat(groups)


def micro_batch(args):
    """The same inputs for every case: completions with a few padded tails (or, with --varied-lengths, prompts
    and completions of lengths spread over the rows: :func:`row_lengths`), 0/1 rewards (mixed, or the first
    --single-label-groups groups single-label). ``pacs_rewards`` is what PACSTrainer's loss reads (the reward
    function is never called: no generation); ``advantages`` (GRPO's) are derived from the same."""
    import torch

    gen = torch.Generator().manual_seed(1)
    B, P, C = args.responses, args.prompt_len, args.completion_len
    prompt_lens, completion_lens = row_lengths(B, P, C, args.varied_lengths)
    prompt_mask = (torch.arange(P)[None, :] >= P - torch.tensor(prompt_lens)[:, None]).long()  # left-padded
    completion_mask = (torch.arange(C)[None, :] < torch.tensor(completion_lens)[:, None]).long()
    rewards = make_rewards(B, args.single_label_groups)
    advantages = (rewards.view(-1, GROUP) - rewards.view(-1, GROUP).mean(1, keepdim=True)).view(-1)
    return {
        "prompt_ids": torch.randint(3, args.vocab, (B, P), generator=gen) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(3, args.vocab, (B, C), generator=gen) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
        "pacs_rewards": rewards,
        "pacs_valid": torch.ones(B, dtype=torch.bool),
        "pacs_group_ids": torch.arange(B) // GROUP,
    }


def row_lengths(responses: int, prompt_len: int, completion_len: int, varied: bool) -> tuple[list, list]:
    """(prompt lengths, completion lengths) of the rows. Default: every prompt ``prompt_len`` tokens, every third
    completion ``completion_len - completion_len // 4`` and the others ``completion_len``. ``varied``: prompts
    of P, 5P/6, 2P/3, P/2 tokens in turn, and completions from C down to C/8 in even steps, given to the rows
    in a fixed random order (each group holds long and short ones)."""
    if not varied:
        return ([prompt_len] * responses,
                [completion_len - completion_len // 4 if i % 3 == 0 else completion_len for i in range(responses)])
    import torch

    order = torch.randperm(responses, generator=torch.Generator().manual_seed(2)).tolist()
    span = max(responses - 1, 1)
    prompts = [prompt_len - (prompt_len // 2) * (i % 4) // 3 for i in range(responses)]
    completions = [max(1, completion_len - (7 * completion_len // 8) * k // span) for k in order]
    return prompts, completions


def run_case(case: str, args) -> dict:
    import torch

    from benchmarks.measure import peak_rss_mib, reset_peak_rss

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_trainer(case, args, out_dir)
        inputs = micro_batch(args)

        def step():
            trainer.model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(trainer.model, inputs)
            loss.backward()
            return loss.item()

        def groups_run():  # the groups the last step put through the model (PACSTrainer's metric)
            metrics = getattr(trainer, "_metrics", {}).get("train", {})
            skipped = metrics.get("pacs/skipped_group_frac")
            n_groups = args.responses // GROUP
            if case == "trl_default" or not skipped:  # no skipping: every group ran
                return n_groups
            return round(n_groups * (1.0 - skipped[-1]))

        step()  # warm-up (one-time buffers, lazy initialisation)
        trainer.model.zero_grad(set_to_none=True)
        base = reset_peak_rss()
        times, cpu_times, loss = [], [], None
        for _ in range(args.repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = step()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        # the kernel updates the high-water mark lazily: a step that allocates nothing new (a tiny model, the
        # warm-up's memory reused) can read a page below its base; an increase is never below 0
        peak = max(0.0, peak_rss_mib() - base)
        ran = groups_run()
        grads = [p.grad.double().pow(2).sum() for p in trainer.model.parameters() if p.grad is not None]
        grad_norm = float(torch.stack(grads).sum().sqrt()) if grads else 0.0  # the last step's, all parameters
    return {"case": case, "time_ms": 1000 * statistics.median(times), "peak_rss_increase_mib": peak, "loss": loss,
            "time_min_ms": 1000 * min(times), "cpu_time_ms": 1000 * statistics.median(cpu_times),
            "cpu_util": sum(cpu_times) / sum(times), "grad_norm": grad_norm, "groups_run": ran,
            "loadavg_1min": os.getloadavg()[0]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny Llama (default 2)")
    parser.add_argument("--responses", type=int, default=8, help=f"responses, in groups of {GROUP}")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single-label-groups", type=int, default=0, metavar="K",
                        help="make the first K groups single-label (all 1, all 0, alternating); default 0")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES[:3]),
                        help="the cases to run, in this order (default: trl_default pacs pacs_no_skip)")
    parser.add_argument("--varied-lengths", action="store_true",
                        help="prompts of P/2..P and completions of C/8..C tokens, spread over the rows")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "trl_dropin_cpu.csv"))
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    args = parser.parse_args(argv)
    if args.responses <= 0 or args.responses % GROUP:
        parser.error(f"--responses must be a positive multiple of {GROUP} (whole groups), got {args.responses}")
    n_groups = args.responses // GROUP
    if not 0 <= args.single_label_groups <= n_groups:
        parser.error(f"--single-label-groups must be in [0, {n_groups}] (the number of groups of {GROUP} in "
                     f"--responses {args.responses}), got {args.single_label_groups}")
    return args


def check_losses(rows: list[dict]) -> None:
    """pacs (skipping, padding-free) and pacs_no_skip / pacs_padded / pacs_ckpt / pacs_ckpt_tiled must give one
    loss up to float rounding;
    SystemExit otherwise. (On-policy every response's PACS loss term is taken at psi = 0, so the loss checks
    that the skipped groups' values are added back with the right divisor; the gradient norms, printed, check
    the rest.)"""
    by_case = {row["case"]: row for row in rows}
    for other in SAME_LOSS_AS_PACS:
        if "pacs" not in by_case or other not in by_case:
            continue
        a, b = by_case["pacs"]["loss"], by_case[other]["loss"]
        if not math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=0.0):
            sys.exit(f"pacs and {other} losses differ: {a!r} vs {b!r} "
                     f"(relative {abs(a - b) / max(abs(a), abs(b)):.3g} > {LOSS_RTOL:g})")
        ga, gb = by_case["pacs"]["grad_norm"], by_case[other]["grad_norm"]
        print(f"pacs vs {other}: loss relative difference {abs(a - b) / max(abs(a), abs(b), 1e-300):.3g}, "
              f"gradient norm {ga:.9g} vs {gb:.9g} (relative {abs(ga - gb) / max(ga, gb, 1e-300):.3g})")


def worker_env() -> dict:
    """The environment of a case's subprocess (the malloc settings of benchmarks/measure.py's RSS method)."""
    from benchmarks.measure import WORKER_ENV as MALLOC_SETTINGS

    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), **MALLOC_SETTINGS, **WORKER_ENV}


def worker_command(case: str, args) -> list[str]:
    """The command line that runs ``case`` alone in a fresh process and prints its row as one JSON line."""
    flags = [f"--vocab={args.vocab}", f"--hidden={args.hidden}", f"--layers={args.layers}",
             f"--responses={args.responses}",
             f"--prompt-len={args.prompt_len}", f"--completion-len={args.completion_len}",
             f"--repeats={args.repeats}", f"--threads={args.threads}",
             f"--single-label-groups={args.single_label_groups}"]
    flags += ["--varied-lengths"] if args.varied_lengths else []
    return [sys.executable, __file__, f"--case={case}", *flags]


def device_name() -> str:
    """The CPU's model name (/proc/cpuinfo) and core count, e.g. "cpu: Intel(R) Xeon(R) Processor, 2 cores"."""
    from benchmarks.run import cpu_model

    return f"cpu: {cpu_model()}, {os.cpu_count()} cores"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args)))
        return

    env = worker_env()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = device_name()
    rows = []
    for case in dict.fromkeys(args.cases):
        done = subprocess.run(worker_command(case, args), cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"case {case} failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({**result, "device": device, "date": date, "vocab": args.vocab, "hidden": args.hidden,
                     "layers": args.layers,
                     "responses": args.responses, "prompt_len": args.prompt_len,
                     "completion_len": args.completion_len, "threads": args.threads, "repeats": args.repeats,
                     "groups": args.responses // GROUP, "single_label_groups": args.single_label_groups,
                     "varied_lengths": args.varied_lengths})
        print(f"{case:15s} {result['time_ms']:9.1f} ms (min {result['time_min_ms']:.1f}, "
              f"CPU {result['cpu_time_ms']:.1f}, "
              f"util {result['cpu_util']:.2f})  peak RSS +{result['peak_rss_increase_mib']:8.1f} MiB  "
              f"loss {result['loss']:.9f}  groups run {result['groups_run']}/{args.responses // GROUP}  "
              f"load {result['loadavg_1min']:.2f}", flush=True)
    check_losses(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"saved {args.out} ({device}, {date})")


if __name__ == "__main__":
    main()
