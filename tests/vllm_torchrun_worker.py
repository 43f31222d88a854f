"""One rank of tests/test_rollout_vllm.py's torchrun test (run by torchrun, not collected by pytest).

Usage: torchrun --standalone --nproc-per-node 2 vllm_torchrun_worker.py MODEL_DIR NEW_WEIGHTS OUT_DIR

Each rank starts its own engine next to the trainer's gloo process group, generates greedily for
its own prompts (of its own count), loads NEW_WEIGHTS (a safetensors file) and generates again,
closes the engine and checks that the process group still works. Results go to
OUT_DIR/rank{R}.json.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from trainer_helpers import leave_distributed_run  # the script's folder is on sys.path

from pacs.rollout.vllm import VLLMRolloutEngine

PROMPTS_BY_RANK = [[[1, 2, 3, 4]], [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]]


def main() -> None:
    model_dir, new_weights, out_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    prompts = PROMPTS_BY_RANK[rank]
    engine = VLLMRolloutEngine(model_dir, max_model_len=64, dtype="float32", kv_cache_gib=0.05)
    greedy = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 8, "stop_token_ids": []}
    before = engine.generate(prompts, 1, **greedy)
    engine.sync_weights(load_file(new_weights).items())
    after = engine.generate(prompts, 1, **greedy)
    engine.close()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the trainer's group outlives the engine
    result = {"prompts": prompts, "before": before, "after": after, "all_reduce": total.item()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    leave_distributed_run()  # every rank's results are written: leave without teardown


if __name__ == "__main__":
    main()
