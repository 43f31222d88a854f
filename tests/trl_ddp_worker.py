"""One rank of tests/test_trl_integration.py::test_two_processes_stay_in_sync (run under torchrun).

Trains PACSTrainer for 2 steps and writes OUT_DIR/rank{R}.json: a digest of the weights before
and after, the wrapper type of the trained model, and the group ids of every micro-batch."""

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_helpers as helpers  # noqa: E402
from trainer_helpers import leave_distributed_run  # noqa: E402


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def main(out_dir: str) -> None:
    from pacs.integrations.trl import PACSTrainer

    seen = []

    class RecordingTrainer(PACSTrainer):
        def _compute_loss(self, model, inputs):
            seen.append(inputs["pacs_group_ids"].tolist())
            self.wrapper = type(model).__name__
            return super()._compute_loss(model, inputs)

    tok = helpers.tokenizer()
    model = helpers.tiny_model(len(tok))
    initial = digest(model)
    trainer = RecordingTrainer(model, helpers.contains_one, args=helpers.config(out_dir, max_steps=2),
                               train_dataset=helpers.prompts(), processing_class=tok)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"params": digest(trainer.model), "initial_params": initial, "wrapper": trainer.wrapper,
                   "micro_batch_group_ids": seen}, f)
    leave_distributed_run()  # every rank's results are written: leave without teardown


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
