"""Runs a short training (1 process, or one rank under torchrun) and records, per rank, a checksum
of every weight push into the rollout engine and of the final full parameters.

usage: python trainer_sync_worker.py OUT_DIR KEY=VALUE...

With PACS_TEST_SIGTERM_RANK0_AT_UPDATE=K in the environment, rank 0 (only) sends itself SIGTERM in its
K-th policy update, as a scheduler's preemption reaching one rank first; the run's TrainingPreempted
is then recorded (preempted_by, the step the run stopped after) instead of the results.
"""

import json
import os
import signal
import sys

import torch
from trainer_helpers import leave_distributed_run  # the script's folder is on sys.path

import pacs.train.start as start
import pacs.train.update as update
from pacs.config import load_config
from pacs.model.policy import full_named_tensors
from pacs.run import TrainingPreempted
from pacs.train import train


def checksum(named) -> dict[str, list[float]]:
    out = {}
    for name, tensor in named:
        t = tensor.detach().double().flatten()
        ramp = torch.linspace(0.5, 1.5, t.numel(), dtype=torch.float64)
        out[name] = [float(t.sum()), float((t * ramp).sum()), float(t.abs().sum())]
    return out


def tiled_mlps(policy) -> int:
    """How many decoder MLPs run in tiles (train.tiled_mlp)."""
    from pacs.model.layers import decoder_layers
    from pacs.model.tiled_mlp import is_tiled

    return sum(is_tiled(layer.mlp) for layer in decoder_layers(policy.causal_lm))


def main() -> None:
    out_dir, overrides = sys.argv[1], sys.argv[2:]
    pushes: list[dict] = []
    make_engine = start.make_rollout_engine

    def recording_engine(*args, **kwargs):
        engine = make_engine(*args, **kwargs)
        sync = engine.sync_weights

        def sync_and_record(named):
            items = list(named)
            pushes.append(checksum(items))
            sync(items)

        engine.sync_weights = sync_and_record
        return engine

    start.make_rollout_engine = recording_engine
    rank = int(os.environ.get("RANK", "0"))
    signal_at = int(os.environ.get("PACS_TEST_SIGTERM_RANK0_AT_UPDATE", "0"))
    if signal_at and rank == 0:
        real_update, calls = update.update_policy, []

        def signalled_update(*args, **kwargs):
            calls.append(1)
            if len(calls) == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag
            return real_update(*args, **kwargs)

        update.update_policy = signalled_update
    cfg = load_config(None, overrides)
    cfg.output_dir = out_dir
    try:
        result = train(cfg)
    except TrainingPreempted as stopped:
        with open(os.path.join(out_dir, f"sync_rank{rank}.json"), "w") as fh:
            json.dump({"preempted_by": stopped.signal_name, "message": str(stopped)}, fh)
        leave_distributed_run()
        return
    final = checksum(full_named_tensors(result.policy))
    with open(os.path.join(out_dir, f"sync_rank{rank}.json"), "w") as fh:
        json.dump({"pushes": pushes, "final": final, "metrics": result.metrics,
                   "world_size": int(os.environ.get("WORLD_SIZE", "1")), "tiled_mlps": tiled_mlps(result.policy)}, fh)
    leave_distributed_run()  # every rank's results are written: leave without teardown


if __name__ == "__main__":
    main()
