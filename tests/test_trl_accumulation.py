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
    loss = sum(trainer.training_step(model, inputs, None) for inputs in micro_batches)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads


def assert_same(loss, grads, ref_loss, ref_grads, tol=2e-5):
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert scale > 0, "the reference gradient vanished: the comparison would be vacuous"
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=tol, atol=tol * scale, msg=name)


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
    if setting == "on_policy_skipping":
        assert trainer._metrics["train"]["pacs/skipped_group_frac"][-2:] == [0.5, 0.0], "skipped in one only"
    assert_same(*accumulated, ref_loss.detach(), ref_grads)
    assert_same(*step(trainer, [batch]), ref_loss.detach(), ref_grads)
