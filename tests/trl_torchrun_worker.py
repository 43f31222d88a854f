"""One rank of the 2-process PACSTrainer runs of tests/test_trl_integration.py (run under torchrun, CPU, gloo).

``python trl_torchrun_worker.py MODE OUT_DIR [tied]``, MODE ``ddp`` (accelerate's DDP) or ``fsdp2``
(``fsdp=True``: accelerate's FSDP2, turned on for CPU by tests/accelerate_cpu_fsdp2.py). Both modes
train the same tiny Llama for 2 steps with the same config, plain SGD and no gradient clipping (so
the weights after training are the initial ones minus lr times the summed gradients: a gradient
error of any size or direction shows in them). Writes OUT_DIR/rank{R}.json (the wrapper type of the
model the loss was called through, the group ids and completion ids of every micro-batch, and for
``fsdp2`` how the model is sharded) and OUT_DIR/rank{R}_weights.pt (the full weights after training,
gathered from the shards under FSDP2). ``tied``: the model's LM head is its input embedding
(``tie_word_embeddings=True``, as in Qwen2.5's small models). With PACS_TEST_SIGTERM_RANK0_AT_STEP=K in
the environment, rank 0 alone sends itself SIGTERM during optimizer step K (a preemption reaching one
rank first): each rank then records the StoppedBySignal it raised ("stopped") in its JSON."""

import json
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_helpers as helpers  # noqa: E402
from trainer_helpers import full_weights, leave_distributed_run  # noqa: E402

from pacs.run.stop_signals import StoppedBySignal  # noqa: E402

MODES = ("ddp", "fsdp2")
# Plain SGD (momentum 0) without clipping: see the module doc.
TRAINING = dict(max_steps=2, optim="sgd", learning_rate=0.1, max_grad_norm=0.0)


def sharding_of(model) -> dict:
    """How FSDP2 sharded ``model``: which modules are FSDP units, the parameters that are not DTensors,
    and the placements, mesh device types and mesh sizes of those that are."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    dtensors = {name: p for name, p in params.items() if isinstance(p, DTensor)}
    return {
        "fsdp_units": sorted(name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)),
        "not_dtensor": sorted(set(params) - set(dtensors)),
        "placements": sorted({str(p.placements) for p in dtensors.values()}),
        "mesh_devices": sorted({p.device_mesh.device_type for p in dtensors.values()}),
        "mesh_sizes": sorted({p.device_mesh.size() for p in dtensors.values()}),
    }


def main(mode: str, out_dir: str, tied: bool = False) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    from pacs.integrations.trl import PACSTrainer

    if mode == "fsdp2":
        from accelerate_cpu_fsdp2 import CPUFSDP2Trainer as Base
        options = dict(fsdp=True, fsdp_config={"version": 2})
    else:
        Base, options = PACSTrainer, {}
    seen = {"micro_batch_group_ids": [], "micro_batch_completion_ids": []}

    class RecordingTrainer(Base):
        def _compute_loss(self, model, inputs):
            seen["micro_batch_group_ids"].append(inputs["pacs_group_ids"].tolist())
            seen["micro_batch_completion_ids"].append(inputs["completion_ids"].tolist())
            seen["wrapper"] = type(model).__name__
            if mode == "fsdp2":
                seen["sharding"] = sharding_of(model)
            loss = super()._compute_loss(model, inputs)
            skipped = self._metrics["train"].get("pacs/skipped_group_frac")  # (groups with a zero gradient)
            seen.setdefault("skipped_group_frac", []).append(skipped[-1] if skipped else None)
            return loss

    tok = helpers.tokenizer()
    trainer = RecordingTrainer(helpers.tiny_model(len(tok), tie_word_embeddings=tied), helpers.contains_one,
                               args=helpers.config(out_dir, **TRAINING, **options), train_dataset=helpers.prompts(),
                               processing_class=tok)
    rank = trainer.accelerator.process_index
    signal_at = int(os.environ.get("PACS_TEST_SIGTERM_RANK0_AT_STEP", "0"))
    if signal_at and rank == 0:
        from transformers import TrainerCallback

        class SignalRank0(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == signal_at - 1:
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag

        trainer.add_callback(SignalRank0())
    try:
        trainer.train()
    except StoppedBySignal as stopped:
        seen["stopped"] = {"signal": stopped.signal_name, "message": str(stopped)}
    weights = full_weights(trainer.model)
    torch.save(weights, os.path.join(out_dir, f"rank{rank}_weights.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    leave_distributed_run()  # every rank's results are written: leave without teardown


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) not in (3, 4) or sys.argv[3:] not in ([], ["tied"]):
        raise SystemExit("usage: python trl_torchrun_worker.py ddp|fsdp2 OUT_DIR [tied]")
    main(sys.argv[1], sys.argv[2], tied=sys.argv[3:] == ["tied"])
