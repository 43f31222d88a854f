"""TRL drop-in: one training micro-step of PACSTrainer against GRPOTrainer's default loss, same run.

Each case runs in a fresh subprocess (peak-RSS method and caveats: benchmarks/measure.py): a tiny
Llama with a large vocabulary (default V=32000, d=256, 2 layers) built in code, float32 (bf16=False
for both, so that both heads run in the same precision), and one fixed on-policy micro-batch
(default 8 responses x 256 completion tokens after 32 prompt tokens, 2 groups of 4, mixed 0/1
rewards) handed straight to ``trainer.compute_loss`` + ``backward`` (no generation: only the loss
step differs between the two). Measured: median wall time of ``--repeats`` steps after one warm-up
step, and the peak increase of the resident set over the state before the first measured step
(model, optimizer-free). Cases:

    trl_default   GRPOTrainer, GRPOConfig defaults (loss_type="dapo"; TRL's chunked fused LM head)
    pacs          PACSTrainer (pacs_kernels torch backend; on-policy: one-sweep first step)

    python benchmarks/trl_dropin.py                        # writes benchmarks/results/trl_dropin_cpu.csv
    python benchmarks/trl_dropin.py --vocab 8192 --completion-len 64 --out /tmp/small.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CASES = ("trl_default", "pacs")
GROUP = 4


def build_trainer(case: str, args, out_dir: str):
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from pacs.tasks.embedded import build_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.prompt_len + args.completion_len,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    common = dict(output_dir=out_dir, per_device_train_batch_size=args.responses, num_generations=GROUP,
                  max_completion_length=args.completion_len, report_to="none", save_strategy="no", use_cpu=True,
                  bf16=False, gradient_accumulation_steps=1)
    dataset = Dataset.from_dict({"prompt": ["1+1="] * 8})

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    if case == "pacs":
        from pacs.integrations.trl import PACSConfig, PACSTrainer

        trainer = PACSTrainer(model, reward, args=PACSConfig(**common), train_dataset=dataset,
                              processing_class=build_tokenizer())
    else:
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model, reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=build_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def micro_batch(args):
    """The same inputs for both cases: completions with a few padded tails, mixed 0/1 rewards."""
    import torch

    gen = torch.Generator().manual_seed(1)
    B, P, C = args.responses, args.prompt_len, args.completion_len
    completion_mask = torch.ones(B, C, dtype=torch.long)
    for i in range(0, B, 3):
        completion_mask[i, C - C // 4:] = 0
    rewards = torch.tensor([1.0, 0.0] * (B // 2))
    advantages = (rewards.view(-1, GROUP) - rewards.view(-1, GROUP).mean(1, keepdim=True)).view(-1)
    return {
        "prompt_ids": torch.randint(3, args.vocab, (B, P), generator=gen),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, args.vocab, (B, C), generator=gen) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
        "pacs_rewards": rewards,
        "pacs_valid": torch.ones(B, dtype=torch.bool),
        "pacs_group_ids": torch.arange(B) // GROUP,
    }


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

        step()  # warm-up (one-time buffers, lazy initialisation)
        trainer.model.zero_grad(set_to_none=True)
        base = reset_peak_rss()
        times, loss = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - start)
        peak = peak_rss_mib() - base
    return {"case": case, "time_ms": 1000 * statistics.median(times), "peak_rss_increase_mib": peak, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "trl_dropin_cpu.csv"))
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    args = parser.parse_args()
    if args.responses % GROUP:
        parser.error(f"--responses must be a multiple of {GROUP} (whole groups), got {args.responses}")
    if args.case:
        print(json.dumps(run_case(args.case, args)))
        return

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
           "MALLOC_TRIM_THRESHOLD_": "131072", "TOKENIZERS_PARALLELISM": "false"}
    flags = [f"--vocab={args.vocab}", f"--hidden={args.hidden}", f"--responses={args.responses}",
             f"--prompt-len={args.prompt_len}", f"--completion-len={args.completion_len}",
             f"--repeats={args.repeats}", f"--threads={args.threads}"]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    try:
        with open("/proc/cpuinfo") as info:
            name = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        device = f"cpu: {name}, {os.cpu_count()} cores"
    except (OSError, StopIteration):
        pass
    rows = []
    for case in CASES:
        done = subprocess.run([sys.executable, __file__, f"--case={case}", *flags], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"case {case} failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({**result, "device": device, "date": date, "vocab": args.vocab, "hidden": args.hidden,
                     "responses": args.responses, "prompt_len": args.prompt_len,
                     "completion_len": args.completion_len, "threads": args.threads, "repeats": args.repeats})
        print(f"{case:12s} {result['time_ms']:9.1f} ms  peak RSS +{result['peak_rss_increase_mib']:8.1f} MiB  "
              f"loss {result['loss']:.6f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"saved {args.out} ({device}, {date})")


if __name__ == "__main__":
    main()
