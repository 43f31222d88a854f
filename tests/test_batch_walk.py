"""The walk of a rollout step's batch through the update, as it runs (issue 49): from ``update_step`` to the loss
engine, every call of a function of ``pacs`` whose arguments hold the batch in one of its forms is a stop: the
step's rows (:class:`~pacs.train.batch.Batch`), the :class:`~pacs.train.update_batch.UpdateBatch` that carries them
from the old-policy pass to the loss, a micro-batch cut from them (:class:`~pacs.train.update.MicroBatch`, and its
model inputs: padded rows, or a :class:`~pacs.model.packing.PackedMicroBatch`). Consecutive stops in one file are one
stay. The walk ends where the first micro-batch enters the loss engine (``fused_linear_objective_loss``).

The batch is carried by one type from the old-policy pass to the loss and its layout (packed or padded) is decided
once, so it stays in few files. Bound (issue 49): at most 15 stays in at most 6 files, padded and packed; held
here at what the route measures now (12 stays in 6 files padded, 9 in 5 packed), so that it does not grow back.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from test_packing import GROUP, config, random_batch, tiny_policy

import pacs
from pacs.model.packing import PackedMicroBatch
from pacs.model.policy import DistInfo
from pacs.train.batch import Batch
from pacs.train.training import Training
from pacs.train.update import MicroBatch, update_step
from pacs.train.update_batch import UpdateBatch

PACKAGE = Path(pacs.__file__).resolve().parent
LOSS_ENTRY = "fused_linear_objective_loss"
MAX_STAYS, MAX_FILES = 12, 6
FORMS = (Batch, UpdateBatch, MicroBatch, PackedMicroBatch)


def walk_of_the_batch(call) -> tuple[list[tuple[str, str]], bool]:
    """(file relative to pacs, function) of each stop during ``call()``, and whether the walk reached the loss."""
    stops, reached = [], [False]

    def tracer(frame, event, arg):
        if event != "call" or reached[0]:
            return None
        code = frame.f_code
        if code.co_name == LOSS_ENTRY:
            reached[0] = True
            return None
        path = Path(code.co_filename)
        if not path.is_absolute() or PACKAGE not in path.resolve().parents:
            return None
        n_args = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        if any(isinstance(frame.f_locals.get(name), FORMS) for name in code.co_varnames[:n_args]):
            stops.append((str(path.resolve().relative_to(PACKAGE)), code.co_qualname))
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return stops, reached[0]


def stays_of(stops: list[tuple[str, str]]) -> list[str]:
    stays = []
    for file, _ in stops:
        if not stays or stays[-1] != file:
            stays.append(file)
    return stays


def one_step(packed: bool) -> Training:
    cfg = config("rollout.prompts_per_step=2", "optim.mini_batches_per_step=1", "optim.micro_batch_groups=2")
    policy = tiny_policy(5)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    return Training(cfg=cfg, dist_info=DistInfo(device=torch.device("cpu")), say=lambda *a, **k: None, run=None,
                    run_dir=None, packed=packed, policy=policy, optimizer=optimizer,
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), reference=None,
                    engine=None, metrics=None, state={"consecutive_nan": 0, "skipped_updates": 0}, start_time=0.0)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_batch_reaches_the_loss_in_at_most_12_stays_in_6_files(packed):
    batch = random_batch(1)
    assert batch.rewards.numel() == 2 * GROUP
    batch = dataclasses.replace(batch, sampler_logp=torch.zeros(batch.mask.shape))  # as the rollout engine gives it
    t = one_step(packed)
    stops, reached = walk_of_the_batch(lambda: update_step(t, 1, batch))
    stays = stays_of(stops)
    route = " -> ".join(f"{file}:{function}" for file, function in stops)
    assert reached, f"the walk never reached {LOSS_ENTRY}: {route}"
    assert stops[0] == ("train/update.py", "update_step")
    assert len(stays) <= MAX_STAYS and len(set(stays)) <= MAX_FILES, (
        f"{len(stays)} stays in {len(set(stays))} files (at most {MAX_STAYS} in {MAX_FILES}): {route}")
    # the measurement is not vacuous: the batch is followed into its layout, through the update, to the loss
    assert {"train/old_policy.py", "model/packing.py", "train/update_batch.py", "train/update.py"} <= set(stays)
    assert ("train/update.py", "policy_loss") in stops
