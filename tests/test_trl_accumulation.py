"""PACSTrainer under gradient accumulation: an optimizer step's gradient is PACS's mean over all the step's
responses, whatever the micro-batches hold.

TRL's GRPOTrainer declares its loss already scaled for accumulation (``loss_is_scaled_for_ga = True``:
transformers' Trainer.training_step does not divide it, accelerate's backward neither, its plugin's num_steps
being 1); PACSTrainer divides each micro-batch's loss, a mean over its rows (PACS divides by B, invalid rows
included), by ``current_gradient_accumulation_steps``. Every micro-batch holds per_device_train_batch_size
rows, so the sum over the step is the mean over all its rows: the same as one micro-batch of all of them, and
as float64 ``reference_pacs_loss`` on the whole step. The micro-batches here differ in what a per-micro-batch
normaliser would weigh wrongly: invalid responses (none in one, two in the other) and single-label groups
(skipped on-policy in one only). Under DDP / FSDP2 the ranks' gradients are averaged, the same arithmetic
over equal-sized ranks (the 2-process runs in test_trl_integration.py check the ranks stay in sync).
"""

import pytest
import torch

pytest.importorskip("trl")

import trl_helpers as helpers  # noqa: E402
from test_trl_integration import assert_same  # noqa: E402

from pacs_kernels.reference import reference_pacs_loss  # noqa: E402

G = helpers.GROUP
ROWS = 2 * G  # per_device_train_batch_size in trl_helpers.config
# group 0 single-label (all valid: skipped on-policy), the others mixed; micro-batch 2 holds both invalid rows
REWARDS = [1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0]
INVALID = [11, 14]


def generation_batch(trainer):
    """The step's generation batch (2 micro-batches of ROWS rows), made as train() makes it, with REWARDS and
    INVALID put in."""
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert batch["completion_ids"].shape[0] == 2 * ROWS
    batch["pacs_rewards"] = torch.tensor(REWARDS, dtype=torch.float32)
    batch["pacs_valid"] = torch.ones(2 * ROWS, dtype=torch.bool)
    batch["pacs_valid"][INVALID] = False
    assert bool(batch["completion_mask"].bool().any(1).all()), "every response has loss tokens"
    return batch


def rows(batch, start, stop):
    return {key: value[start:stop] if torch.is_tensor(value) and value.dim() > 0 else value
            for key, value in batch.items()}


def step(trainer, micro_batches):
    """One optimizer step's backward as train() runs it: transformers' training_step (its accumulation scaling
    decision and accelerate's backward) on each micro-batch, gradients accumulated. Returns (the summed loss
    values, the gradients)."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = len(micro_batches)  # as train() sets it for each step
    trainer._prepare_inputs = lambda inputs: inputs  # the micro-batches are given, not generated
    loss = 0
    for i, inputs in enumerate(micro_batches):  # train() marks the step's last micro-batch (the optimizer's)
        trainer.accelerator.gradient_state._set_sync_gradients(i == len(micro_batches) - 1)
        loss = loss + trainer.training_step(model, inputs, None)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["on_policy_skipping", "on_policy_padded", "old_logprobs"])
def test_accumulated_step_is_the_mean_over_all_its_responses(tmp_path, setting):
    """2 accumulation steps give the gradient of one micro-batch of both (accumulation 1) and of float64
    reference_pacs_loss over the step's 16 responses: on-policy with single-label groups skipped (packed
    rows), on-policy with nothing skipped (padded rows), and with TRL's old log-probs (num_iterations=2,
    after the weights moved: psi != 0)."""
    overrides = {"on_policy_skipping": {},
                 "on_policy_padded": dict(pacs_skip_zero_gradient_groups=False, pacs_padding_free=False),
                 "old_logprobs": dict(num_iterations=2)}[setting]
    trainer = helpers.trainer(tmp_path, **overrides)
    batch = generation_batch(trainer)
    model = trainer.model
    if setting == "old_logprobs":
        torch.manual_seed(1)
        with torch.no_grad():  # an optimizer step happened since the rollout
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    old = batch.get("old_per_token_logps")
    assert (old is None) is (setting != "old_logprobs")
    mask = batch["completion_mask"]
    valid = batch["pacs_valid"]

    def reference():
        logp = helpers.naive_logp(model, batch, 1.0).double()
        loss, _ = reference_pacs_loss(logp, logp.detach() if old is None else old.double(),
                                      batch["pacs_rewards"].double(), mask, group_size=G, valid=valid)
        return loss.float()

    model.zero_grad(set_to_none=True)
    ref_loss = reference()
    ref_loss.backward()
    ref_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    if setting == "old_logprobs":
        assert abs(ref_loss.item() - 0.6931) > 1e-3, "psi != 0: the old log-probs really differ"

    accumulated = step(trainer, [rows(batch, 0, ROWS), rows(batch, ROWS, 2 * ROWS)])
    if setting == "on_policy_skipping":  # half the first micro-batch's groups, none of the second's: logged once
        assert trainer._metrics["train"]["pacs/skipped_group_frac"] == [0.25]
    assert_same(*accumulated, ref_loss.detach(), ref_grads)
    assert_same(*step(trainer, [batch]), ref_loss.detach(), ref_grads)


def pacs_metrics(trainer):
    """TRL's PACS metrics so far (``pacs/...`` and ``entropy``), emptied."""
    metrics = trainer._metrics["train"]
    return {key: list(metrics.pop(key)) for key in list(metrics) if key.startswith("pacs/") or key == "entropy"}


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["on_policy_skipping", "old_logprobs"])
def test_an_accumulated_step_logs_the_statistics_of_its_whole_batch(tmp_path, setting):
    """The PACS statistics and the entropy are appended to TRL's metrics once per optimizer step, as the
    statistics of the step's whole batch: those of one micro-batch holding both accumulation micro-batches,
    which a plain mean of the two micro-batches' values is not (psi's standard deviation, the extremes, the
    token-mean entropy over micro-batches of different lengths, the means over the groups that ran when the
    first micro-batch runs half of its)."""
    trainer = helpers.trainer(tmp_path, **({} if setting == "on_policy_skipping" else dict(num_iterations=2)))
    batch = generation_batch(trainer)
    torch.manual_seed(1)
    with torch.no_grad():  # the random model's next-token distributions are near uniform: peaked here, so
        trainer.model.lm_head.weight.mul_(8)  # that the entropy differs from token to token
        if setting == "old_logprobs":  # psi != 0: its standard deviation is not 0
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    halves = [rows(batch, 0, ROWS), rows(batch, ROWS, 2 * ROWS)]
    assert int(halves[0]["completion_mask"].sum()) != int(halves[1]["completion_mask"].sum()), \
        "micro-batches of different token counts: a token mean weighs them unequally"
    pacs_metrics(trainer)
    step(trainer, [batch])  # one micro-batch of the whole step
    whole = pacs_metrics(trainer)
    step(trainer, halves)
    accumulated = pacs_metrics(trainer)
    separate = []
    for half in halves:  # each micro-batch its own step
        step(trainer, [half])
        separate.append(pacs_metrics(trainer))
    assert whole.keys() == accumulated.keys() and "entropy" in whole and "pacs/psi_std" in whole
    for key, values in accumulated.items():
        assert len(values) == 1 == len(whole[key]), f"{key}: appended once per optimizer step"
        if key == "pacs/single_label_grad_share":  # a ratio of sums over the batch: LossStatistics weighs each
            continue  # micro-batch's ratio by its rows, not the step's ratio
        assert values[0] == pytest.approx(whole[key][0], rel=1e-6, abs=1e-7, nan_ok=True), key
    # on-policy, the first micro-batch runs half its groups: the ran groups' means weigh its 4 rows against 8
    telling = ["entropy", "pacs/weight_min"] + (["pacs/reward_mean", "pacs/valid_frac"]
                                                if setting == "on_policy_skipping" else
                                                ["pacs/psi_std", "pacs/weight_max"])
    for key in telling:  # what the per-micro-batch metrics, averaged, would have said
        plain = sum(part[key][0] for part in separate) / 2
        assert plain != pytest.approx(whole[key][0], rel=1e-5), f"{key}: the test could not tell"
