"""add_pacs_forward in one process: the patched forward is copy-safe, and clearly refused where it cannot be right
(no LM head, a LoRA adapter on the head, a head swapped after patching). Under FSDP2: test_model_forward_fsdp.py."""

import copy

import pytest
import torch
import trl_helpers as helpers

from pacs.model.model_forward import PACSBatch, add_pacs_forward
from pacs_kernels import PACSLoss, pacs_loss
from pacs_kernels.reference import naive_linear_logprobs

V, G = 17, 2


def batch(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (2 * G, 9), generator=gen)
    targets, mask = input_ids[:, -4:], torch.ones(2 * G, 4)
    rewards, valid = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.ones(2 * G, dtype=torch.bool)
    old = torch.randn(2 * G, 4, generator=gen) - 3.0
    return input_ids, PACSBatch(targets, mask, rewards, valid, old_logp=old, return_stats=False)


def expected_loss(model, input_ids, pacs_batch):
    with torch.no_grad():
        hidden = model.model(input_ids).last_hidden_state[:, -5:-1]
        logp, _ = naive_linear_logprobs(hidden, model.lm_head.weight, pacs_batch.targets)
    return pacs_loss(logp, pacs_batch.old_logp, pacs_batch.rewards, pacs_batch.mask, group_size=G)


def test_a_deep_copy_of_a_patched_model_runs_its_own_weights():
    """copy.deepcopy rebinds the patched methods to the copy (TRL and others copy models, e.g. a reference
    model): the copy's logits and loss come from the copy's weights, not the original's."""
    model = helpers.tiny_model(V)
    add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(0.5)
    input_ids, pacs_batch = batch()
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids).logits, 0.5 * model(input_ids).logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(twin(input_ids, pacs_batch=pacs_batch).loss,
                                   expected_loss(twin, input_ids, pacs_batch), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(input_ids, pacs_batch=pacs_batch).loss,
                                   expected_loss(model, input_ids, pacs_batch), rtol=1e-5, atol=1e-6)


def test_a_model_without_an_lm_head_is_refused():
    model = helpers.tiny_model(V)
    model.get_output_embeddings = lambda: None
    with pytest.raises(ValueError, match=r"get_output_embeddings\(\) returned None"):
        add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0)


def test_lora_on_the_lm_head_is_refused_modules_to_save_is_not():
    """A LoRA adapter on lm_head: the loss reads the head's weight and would leave the adapter out (its
    gradient None, the other adapters' gradients wrong), so it is refused; modules_to_save trains the head."""
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(helpers.tiny_model(V), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="PEFT adapter layer.*target_modules"):
        add_pacs_forward(adapted.base_model.model, PACSLoss(group_size=G), temperature=1.0)
    saved = peft.get_peft_model(helpers.tiny_model(V), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                          modules_to_save=["lm_head"]))
    add_pacs_forward(saved.base_model.model, PACSLoss(group_size=G), temperature=1.0)
    input_ids, pacs_batch = batch()
    saved(input_ids=input_ids, pacs_batch=pacs_batch).loss.backward()
    trained = [name for name, p in saved.named_parameters() if p.grad is not None and p.grad.abs().max() > 0]
    assert any("modules_to_save" in name and "lm_head" in name for name in trained), trained


def test_a_head_replaced_after_patching_is_a_clear_error():
    model = helpers.tiny_model(V)
    add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, V, bias=False)
    input_ids, pacs_batch = batch()
    with pytest.raises(ValueError, match="replaced after add_pacs_forward"):
        model(input_ids, pacs_batch=pacs_batch)
