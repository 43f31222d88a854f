"""Hugging Face generate on the trainer's policy itself (HFGenerateEngine.on_model; rollout.engine=hf on one
process): the samples of a private copy of the same weights, no copy held, training mode kept, and every change of
the weights (LoRA's adapters, unmerged) in the next samples without a sync."""

import pytest
import torch
import transformers
from tiny_models import save_tiny_qwen2

from pacs.model.policy import full_named_tensors, load_policy
from pacs.rollout import HFGenerateEngine, make_rollout_engine

PROMPTS = [[1, 5, 13, 6, 16], [1, 7, 8, 13, 9, 16], [1, 4, 13, 4, 16]]
SAMPLE = dict(temperature=1.0, top_p=0.9, max_new_tokens=8, stop_token_ids=[2], seed=100)
GREEDY = dict(temperature=0.0, top_p=1.0, max_new_tokens=8, stop_token_ids=[2])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny_qwen2(tmp_path_factory.mktemp("on_policy"), vocab_size=40)
    transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), pad_token="<pad>").save_pretrained(path)
    return path


def _tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<pad>": 0} | {f"t{i}": i for i in range(1, 40)}, unk_token="<pad>"))


def test_generating_on_the_policy_samples_what_a_copy_of_its_weights_does(model_dir):
    policy = load_policy(model_dir, gradient_checkpointing=True)
    copy = HFGenerateEngine(model_dir, max_model_len=32, seed=0)
    shared = make_rollout_engine("hf", model_dir, max_model_len=32, seed=0, policy=policy)
    assert shared.shares_model and shared.model is policy.causal_lm and not copy.shares_model
    assert policy.training
    assert shared.generate(PROMPTS, 3, **SAMPLE) == copy.generate(PROMPTS, 3, **SAMPLE)
    assert shared.generate(PROMPTS, 1, **GREEDY) == copy.generate(PROMPTS, 1, **GREEDY)
    assert policy.training and policy.causal_lm.training  # put back for the update
    # a training step's change is in the next samples at once; sync_weights has nothing to do (and reads nothing)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    shared.sync_weights(iter(()))
    copy.sync_weights(full_named_tensors(policy))
    assert shared.generate(PROMPTS, 3, **SAMPLE) == copy.generate(PROMPTS, 3, **SAMPLE)


def test_a_lora_policy_samples_its_adapters_unmerged(model_dir):
    import types

    policy = load_policy(model_dir, lora=types.SimpleNamespace(rank=4, alpha=8.0, target_modules="all-linear"))
    shared = make_rollout_engine("hf", model_dir, max_model_len=32, seed=0, policy=policy)
    before = shared.generate(PROMPTS, 1, **GREEDY)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p))
    after = shared.generate(PROMPTS, 1, **GREEDY)
    assert after != before  # the adapters' change, without a sync
    copy = HFGenerateEngine(model_dir, max_model_len=32, seed=0)
    copy.sync_weights(full_named_tensors(policy))  # the merged weights, float32
    assert after == copy.generate(PROMPTS, 1, **GREEDY)


def test_float32_master_weights_generate_in_the_compute_dtype(model_dir):
    """model.dtype=bfloat16 on one process: float32 parameters, the forward under autocast; so is generation."""
    policy = load_policy(model_dir, dtype="bfloat16")
    assert policy.autocast_dtype == torch.bfloat16 and next(policy.parameters()).dtype == torch.float32
    shared = make_rollout_engine("hf", model_dir, max_model_len=32, seed=0, policy=policy)
    seen = []
    hook = policy.causal_lm.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    groups = shared.generate(PROMPTS, 2, **SAMPLE)
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert [len(group) for group in groups] == [2, 2, 2] and all(1 <= len(r) <= 8 for g in groups for r in g)
