"""One actor update through verl 0.9's own code on CPU (run by tests/test_verl_actor_update.py).

    python tests/verl_actor_worker.py RUN_DIR                                   # one rank
    python -m torch.distributed.run --nproc-per-node=2 tests/verl_actor_worker.py RUN_DIR   # 2 FSDP2 ranks

RUN_DIR holds ``model/`` (a Hugging Face causal LM and tokenizer), ``batch.pt`` (a rollout batch in
verl's left/right-padded layout) and ``settings.json`` (config overrides). Each rank builds verl's actor
the way a PPO job's worker does (``ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")``,
``init_model()``: verl's FSDP2 engine, its optimizer, its ``ppo_loss`` calling the "pacs" policy loss; the
plugin is imported by verl itself, through ``model.external_lib`` of the project's example config),
computes the advantages with verl's ``compute_advantage`` ("pacs_label", uids) and runs the trainer's own
``RayPPOTrainer._update_actor``: ``global_batch_size = ppo_mini_batch_size * rollout.n``, padding removal,
then (in the worker) mini-batch iteration, micro-batches, backward, gradient averaging over the ranks,
optimizer step. The worker group that Ray would provide is replaced by a local one that gives each rank
its contiguous share of the batch, as verl's dispatch does. Rank 0 writes
``result.pt``: the actor's full weights after the update, verl's returned metrics, the advantages.

What differs from a GPU job, all test-only and none of it a change to verl:
- verl's platform is the CPU one of tests/verl_cpu_platform.py (``VERL_PLATFORM=cpu``), and
  ``VERL_ENGINE_DEVICE=cuda`` selects verl's FSDP language-model engine (registered for cuda/npu only);
- the gloo process group is created here: verl's worker would ask for "cpu:gloo,cpu:gloo", which torch
  refuses (it keeps a group that exists);
- TRL is hidden from verl (see below).
"""

import json
import os
import sys
from types import SimpleNamespace

# verl 0.9.1's apply_monkey_patch (verl/models/transformers/monkey_patch.py, "if is_trl_available():") imports
# TRL's AutoModelForCausalLMWithValueHead from trl.experimental.ppo or trl, and TRL 1.16 (this project's
# TRL integration) has neither: building any verl FSDP model fails with ImportError when TRL 1.16 is
# installed. The patch only concerns value-head (critic) models, so this process hides TRL from verl:
# a None entry in sys.modules makes importlib.util.find_spec("trl") answer None.
sys.modules["trl"] = None
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VERL_PLATFORM"] = "cpu"
os.environ["VERL_ENGINE_DEVICE"] = "cuda"
if "RANK" not in os.environ:  # one process, not started by torchrun
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import verl_cpu_platform  # noqa: E402,F401  (registers the "cpu" platform before verl resolves its platform)
from trainer_helpers import full_weights, leave_distributed_run  # noqa: E402


def actor_config(run_dir: str, settings: dict):
    """verl's ppo_trainer config (through the project's example config) with the test's overrides."""
    from hydra import compose, initialize_config_dir

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    overrides = [f"actor_rollout_ref.model.path={os.path.join(run_dir, 'model')}", *settings["overrides"]]
    with initialize_config_dir(config_dir=os.path.join(repo, "configs"), version_base=None):
        return compose(config_name="verl_pacs_qwen2.5_7b", overrides=overrides)


class LocalWorkerGroup:
    """The part of a Ray worker group that ``_update_actor`` uses: this rank's share of the batch to
    this rank's worker. verl's nd-compute dispatch chunks the batch into dp contiguous pieces with
    ``chunk_tensordict`` (then consolidates them for transfer, which locks them; Ray hands a worker an
    unlocked copy), so each rank takes its piece of ``chunk_tensordict``."""

    def __init__(self, worker, rank: int, world_size: int):
        self.worker, self.rank, self.world_size = worker, rank, world_size

    def update_actor(self, batch_td):
        from verl.utils.tensordict_utils import chunk_tensordict

        return self.worker.update_actor(chunk_tensordict(batch_td, self.world_size)[self.rank])


def main(run_dir: str) -> None:
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.workers.engine_workers import ActorRolloutRefWorker

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    single = f"file://{os.path.join(run_dir, 'process_group')}"  # one process: no port to pick
    torch.distributed.init_process_group(backend="gloo", init_method=None if world_size > 1 else single,
                                         rank=rank, world_size=world_size)
    settings = json.load(open(os.path.join(run_dir, "settings.json")))
    config = actor_config(run_dir, settings)
    assert "pacs.integrations.verl" not in sys.modules
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    assert "pacs.integrations.verl" in sys.modules, "verl did not import the plugin through model.external_lib"

    saved = torch.load(os.path.join(run_dir, "batch.pt"))
    batch = DataProto.from_dict(tensors=saved["tensors"], non_tensors={"uid": np.array(saved["uid"], dtype=object)})
    batch = compute_advantage(batch, adv_estimator=config.algorithm.adv_estimator, gamma=config.algorithm.gamma,
                              lam=config.algorithm.lam, num_repeat=config.actor_rollout_ref.rollout.n,
                              config=config.algorithm)

    trainer = SimpleNamespace(config=config, distillation_config=None,
                              actor_rollout_wg=LocalWorkerGroup(worker, rank, world_size))
    output = RayPPOTrainer._update_actor(trainer, batch)
    weights = full_weights(worker.actor.engine.module)  # collective on every rank
    if rank == 0:
        torch.save({"weights": weights, "advantages": batch.batch["advantages"],
                    "metrics": output.meta_info["metrics"]}, os.path.join(run_dir, "result.pt"))
    print("VERL_ACTOR_UPDATE_OK", rank)
    leave_distributed_run()


if __name__ == "__main__":
    main(sys.argv[1])
