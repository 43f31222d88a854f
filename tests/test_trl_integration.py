"""PACSTrainer (TRL GRPOTrainer subclass) on CPU: training steps, loss and gradients against
``pacs_loss`` on naive log-probs, whole groups per micro-batch, refused options, 2 processes under
DDP and under FSDP2 (equal weights after training)."""

import json
import math
import os
import signal
import warnings

import pytest
import torch

pytest.importorskip("trl")

import trl_helpers as helpers  # noqa: E402
from trainer_helpers import repo_root, run_torchrun  # noqa: E402

from pacs_kernels import pacs_loss  # noqa: E402
from pacs_kernels.reference import reference_pacs_loss  # noqa: E402


def first_micro_batch(trainer):
    """The trainer's first micro-batch, made exactly as train() makes it (generation included)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    generation_batch = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(generation_batch)


def labels_from_text(tokenizer, inputs, reward):
    texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"])]
    return torch.tensor(reward(texts), dtype=torch.float32)


def loss_and_grads(model, compute):
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def first_step_against_a_plain_copy(trainer):
    """The trainer's first micro-batch (on-policy, temperature 1): its loss and gradients through the trainer,
    and pacs_loss's on naive log-probs of a plain copy of the trainer's model (the same weights, no memory
    lever, padded rows): ((loss, grads), (ref_loss, ref_grads))."""
    plain = helpers.tiny_model(len(trainer.processing_class))  # the trainer's model before any step
    plain.load_state_dict(trainer.model.state_dict())
    inputs = first_micro_batch(trainer)
    rewards = labels_from_text(trainer.processing_class, inputs, helpers.contains_one)
    assert 0 < rewards.sum() < len(rewards), "mixed labels keep the gradient from vanishing"

    def reference():
        logp = helpers.naive_logp(plain, inputs, 1.0)
        return pacs_loss(logp, logp.detach(), rewards, inputs["completion_mask"], group_size=helpers.GROUP) / 2

    return (loss_and_grads(trainer.model, lambda: trainer.compute_loss(trainer.model, inputs)),
            loss_and_grads(plain, reference))


def assert_same(loss, grads, ref_loss, ref_grads, tol=2e-5):
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert scale > 0, "the reference gradient vanished: the comparison would be vacuous"
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=tol, atol=tol * scale, msg=name)


@pytest.mark.slow
def test_three_training_steps_log_pacs_metrics(tmp_path):
    """TRL's defaults (bf16 autocast on the backbone): 3 optimizer steps, PACS stats in the logs."""
    trainer = helpers.trainer(tmp_path, bf16=True)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 3
    for row in rows:
        assert torch.isfinite(torch.tensor(row["loss"]))
        for key in ("pacs/psi_std", "pacs/sigmoid_psi_mean", "pacs/weight_mean", "pacs/frac_single_label_groups",
                    "entropy", "reward"):
            assert key in row, key
        assert row["entropy"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("padding_free", [None, False])
def test_on_policy_loss_and_gradients_equal_pacs_loss(tmp_path, padding_free):
    """TRL's default (one iteration, aligned generation): no old log-probs; PACSTrainer's one-sweep
    step gives pacs_loss(logp, logp.detach(), ...) / accumulation steps, value and gradients, with its
    forward on the packed real tokens (pacs_padding_free, on by default) or on TRL's padded rows
    (left-padded prompts of different lengths, right-padded completions)."""
    trainer = helpers.trainer(tmp_path, varied_prompts=True, pacs_padding_free=padding_free)
    assert trainer.pacs_padding_free is (padding_free is None)
    inputs = first_micro_batch(trainer)
    assert "old_per_token_logps" not in inputs
    assert not bool(inputs["prompt_mask"].all()) and not bool(inputs["completion_mask"].all()), "padding on both sides"
    model, G = trainer.model, helpers.GROUP
    rewards = labels_from_text(trainer.processing_class, inputs, helpers.contains_one)
    assert torch.equal(inputs["pacs_rewards"], rewards)
    assert 0 < rewards.sum() < len(rewards), "mixed labels keep the gradient from vanishing"
    mask = inputs["completion_mask"]

    def reference():
        logp = helpers.naive_logp(model, inputs, 1.0)
        return pacs_loss(logp, logp.detach(), rewards, mask, group_size=G) / 2

    loss, grads = loss_and_grads(model, lambda: trainer.compute_loss(model, inputs))
    assert_same(loss, grads, *loss_and_grads(model, reference))


@pytest.mark.slow
def test_padding_free_with_gradient_checkpointing_equals_pacs_loss(tmp_path):
    """TRL's gradient_checkpointing=True recomputes each decoder layer in the backward; the packed row's
    arguments (positions, sequence bounds) reach the recomputed attention too: the loss and gradients are
    still pacs_loss's on naive log-probs of an un-checkpointed copy."""
    trainer = helpers.trainer(tmp_path, varied_prompts=True, gradient_checkpointing=True)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)  # what train() does with it
    assert trainer.pacs_padding_free and trainer.model.is_gradient_checkpointing
    ours, reference = first_step_against_a_plain_copy(trainer)
    assert_same(*ours, *reference)


@pytest.mark.slow
def test_on_policy_steps_skip_single_label_groups_with_the_whole_loss_and_gradients(tmp_path):
    """pacs_skip_zero_gradient_groups (on by default): a group whose responses are all valid with one reward
    has a gradient of exactly 0 on-policy and is not run; the loss (its value added back) and the gradients
    are the whole micro-batch's, as with the option off; a micro-batch of such groups only runs one."""
    import math

    trainer = helpers.trainer(tmp_path)
    inputs = first_micro_batch(trainer)
    model, G = trainer.model, helpers.GROUP
    rewards, valid = inputs["pacs_rewards"], inputs["pacs_valid"]
    rewards[:G], valid[:G] = 1.0, True  # group 0: one label, every response valid
    rewards[G], rewards[G + 1] = 1.0, 0.0  # group 1: both labels
    mask = inputs["completion_mask"]

    def reference():
        logp = helpers.naive_logp(model, inputs, 1.0)
        return pacs_loss(logp, logp.detach(), rewards, mask, group_size=G, valid=valid & mask.bool().any(1)) / 2

    expected = loss_and_grads(model, reference)
    for skip in (True, False):
        trainer.args.pacs_skip_zero_gradient_groups = skip
        assert_same(*loss_and_grads(model, lambda: trainer.compute_loss(model, inputs)), *expected)
        metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        assert metrics["pacs/loss"] == pytest.approx(2 * expected[0].item(), rel=1e-5)  # the whole micro-batch's
        assert metrics["pacs/frac_single_label_groups"] == 0.5
        if skip:
            assert metrics["pacs/skipped_group_frac"] == 0.5
    trainer.args.pacs_skip_zero_gradient_groups = True
    rewards[:] = 0.0
    valid[:] = True
    loss, grads = loss_and_grads(model, lambda: trainer.compute_loss(model, inputs))
    assert loss.item() == pytest.approx(math.log(2.0) / 2, rel=1e-6)  # every term ln 2, over 2 accumulation steps
    assert grads and max(g.abs().max().item() for g in grads.values()) < 1e-9  # one group ran: zero gradients
    assert trainer._metrics["train"]["pacs/skipped_group_frac"][-1] == 0.5


@pytest.mark.slow
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(tmp_path):
    """pacs_tiled_mlp=True: every decoder MLP runs in tiles of 3 tokens; the loss and gradients of the
    first micro-batch equal pacs_loss on an untiled copy of the same weights."""
    trainer = helpers.trainer(tmp_path, pacs_tiled_mlp=True, pacs_mlp_tile_tokens=3)
    assert all(layer.mlp.tiled_mlp_tokens == 3 for layer in trainer.model.model.layers)
    ours, (ref_loss, ref_grads) = first_step_against_a_plain_copy(trainer)
    assert any(".mlp." in name for name in ref_grads)
    assert_same(*ours, ref_loss, ref_grads)


@pytest.mark.slow
def test_activation_offload_moves_the_saved_tensors_and_keeps_the_loss_and_gradients(tmp_path, monkeypatch):
    """pacs_activation_offload=True with gradient checkpointing: the loss's forward saves its tensors through
    the offload hooks (here a counting stand-in for save_on_cpu that moves them the same way), and the loss
    and gradients still equal pacs_loss on a plain copy."""
    import pacs.integrations.trl as trl_module
    from pacs.model.memory import activation_offload

    moved = []

    def counting_offload(enabled, device):
        assert enabled and device.type == "cpu"
        real = activation_offload(enabled, device)

        def pack(tensor):
            moved.append(tensor.numel())
            return real.pack_hook(tensor)
        return torch.autograd.graph.saved_tensors_hooks(pack, real.unpack_hook)

    monkeypatch.setattr(trl_module, "activation_offload", counting_offload)
    trainer = helpers.trainer(tmp_path, varied_prompts=True, gradient_checkpointing=True, pacs_activation_offload=True)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)  # what train() does with it
    ours, reference = first_step_against_a_plain_copy(trainer)
    assert moved, "nothing went through the offload hooks"
    assert_same(*ours, *reference)


@pytest.mark.slow
def test_the_packed_attention_kernel_is_reported_once_and_keeps_the_loss(tmp_path, monkeypatch, capsys):
    """Where the flash varlen kernel runs (a stand-in on the CPU here, tests/test_varlen_attention.py), the padding-free
    forward takes it, PACSTrainer prints what its packed rows ran as, once, and the loss and gradients are still
    pacs_loss's on a plain copy."""
    from test_varlen_attention import FakeKernel

    from pacs.model import varlen_attention as va

    fake = FakeKernel("2.13")
    monkeypatch.setattr(va, "_varlen_kernel", lambda: (fake, fake.params))
    monkeypatch.setattr(va, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(va, "KERNEL_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    for name in ("_self_checks", "_decisions", "_reported"):
        monkeypatch.setattr(va, name, type(getattr(va, name))())
    monkeypatch.delenv(va.ENGINE_VARIABLE, raising=False)
    trainer = helpers.trainer(tmp_path, varied_prompts=True)
    ours, reference = first_step_against_a_plain_copy(trainer)
    assert fake.calls, "the padding-free forward did not reach the kernel"
    assert_same(*ours, *reference)
    printed = capsys.readouterr().out
    assert printed.count("[PACSTrainer] packed attention: float32, ") == 1, printed
    assert "one flash varlen call per layer" in printed
    assert va.new_decisions("cpu") is None  # reported: a later micro-batch prints nothing


@pytest.mark.slow
@pytest.mark.parametrize("padding_free", [None, False])
def test_multi_iteration_uses_trl_old_logprobs(tmp_path, padding_free, monkeypatch):
    """num_iterations=2: TRL computes old log-probs at generation, through the loss's own forward (packed or
    padded) and fused log-probs: they are the generating weights' (naive float32 log-probs), so psi = 0 before
    the weights move; after they move, the loss and gradients equal pacs_loss(logp, TRL's old_logp, ...)
    (temperature 0.7, float32)."""
    trainer = helpers.trainer(tmp_path, num_iterations=2, temperature=0.7, varied_prompts=True,
                              pacs_padding_free=padding_free)
    assert trainer.pacs_padding_free is (padding_free is None)
    from pacs.integrations import trl as pacs_trl

    requests = []

    class CountedRequest(pacs_trl.LogprobRequest):
        def __init__(self, targets):
            super().__init__(targets)
            requests.append(targets.shape)

    monkeypatch.setattr(pacs_trl, "LogprobRequest", CountedRequest)
    inputs = first_micro_batch(trainer)
    old = inputs["old_per_token_logps"]
    model, mask = trainer.model, inputs["completion_mask"]
    assert len(requests) == 2  # fused passes (16 rows in 8s), not TRL's
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(old[real], helpers.naive_logp(model, inputs, 0.7)[real], rtol=1e-5, atol=1e-5)
        assert trainer.compute_loss(model, inputs).item() == pytest.approx(math.log(2.0) / 2, abs=1e-6)  # psi = 0
    torch.manual_seed(1)
    with torch.no_grad():  # an optimizer step happened since the rollout
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rewards = labels_from_text(trainer.processing_class, inputs, helpers.contains_one)

    def reference():
        return pacs_loss(helpers.naive_logp(model, inputs, 0.7), old, rewards, mask, group_size=helpers.GROUP) / 2

    loss, grads = loss_and_grads(model, lambda: trainer.compute_loss(model, inputs))
    ref_loss, ref_grads = loss_and_grads(model, reference)
    assert abs(ref_loss.item() - 0.6931 / 2) > 1e-3, "psi != 0: the old log-probs really differ"
    assert_same(loss, grads, ref_loss, ref_grads)


@pytest.mark.slow
def test_none_reward_makes_a_response_invalid(tmp_path):
    """A reward function returning None: the response is invalid (valid=False in the batch), gives
    no loss term and leaves the class counts, but its score stays in its group's baseline: loss and
    gradients equal the float64 reference with that validity mask (after the weights moved)."""
    trainer = helpers.trainer(tmp_path, reward=helpers.contains_one_or_none, num_iterations=2)
    inputs = first_micro_batch(trainer)
    texts = [trainer.processing_class.decode(ids[m.bool()], skip_special_tokens=True)
             for ids, m in zip(inputs["completion_ids"], inputs["completion_mask"])]
    valid = torch.tensor(["7" not in text for text in texts])
    assert torch.equal(inputs["pacs_valid"], valid)
    assert 0 < valid.sum() < len(valid), "the batch needs valid and invalid responses"
    labels = torch.tensor([1.0 if "1" in text else 0.0 for text in texts])
    model, mask, old = trainer.model, inputs["completion_mask"], inputs["old_per_token_logps"]
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def reference():
        logp = helpers.naive_logp(model, inputs, 1.0).double()
        loss, _ = reference_pacs_loss(logp, old.double(), labels.double(), mask, group_size=helpers.GROUP, valid=valid)
        return loss.float() / 2

    loss, grads = loss_and_grads(model, lambda: trainer.compute_loss(model, inputs))
    assert_same(loss, grads, *loss_and_grads(model, reference))


@pytest.mark.slow
def test_masked_truncated_completions_do_not_count(tmp_path):
    """mask_truncated_completions=True: TRL zeroes the mask of truncated completions; those responses
    are invalid for PACS (no loss term, out of the class counts): loss and gradients equal the
    float64 reference with that validity."""
    trainer = helpers.trainer(tmp_path, mask_truncated_completions=True, max_completion_length=4)
    inputs = first_micro_batch(trainer)
    mask = inputs["completion_mask"]
    valid = mask.bool().any(dim=1)
    assert 0 < valid.sum() < len(valid), "the batch needs truncated and finished completions"
    rewards = labels_from_text(trainer.processing_class, inputs, helpers.contains_one)
    model = trainer.model

    def reference():
        logp = helpers.naive_logp(model, inputs, 1.0).double()
        loss, _ = reference_pacs_loss(logp, logp.detach(), rewards.double(), mask, group_size=helpers.GROUP,
                                      valid=valid)
        return loss.float() / 2

    loss, grads = loss_and_grads(model, lambda: trainer.compute_loss(model, inputs))
    assert_same(loss, grads, *loss_and_grads(model, reference))


@pytest.mark.slow
@pytest.mark.parametrize("padding_free", [None, False])
def test_multi_iteration_in_bf16_starts_from_psi_zero(tmp_path, padding_free):
    """num_iterations=2 under bf16 autocast: the old log-probs come from the loss's own forward and kernels, so
    psi is exactly 0 before the weights move (TRL's own pass rounds its logits to bf16: psi_std 0.01 and the
    loss 8e-4 off ln 2 / 2 on this model, padded, where it was used before)."""
    tok = helpers.tokenizer()
    model = helpers.tiny_model(len(tok)).to(torch.bfloat16)
    trainer = helpers.trainer(tmp_path, model=model, bf16=True, num_iterations=2, varied_prompts=True,
                              pacs_padding_free=padding_free)
    inputs = first_micro_batch(trainer)
    assert inputs["old_per_token_logps"] is not None
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs).item()
    assert loss == pytest.approx(math.log(2.0) / 2, abs=1e-6)  # psi = 0: the loss of each group is ln 2 / 2


@pytest.mark.slow
def test_bf16_model_with_float32_head(tmp_path):
    """TRL's cast_lm_head_to_fp32 on a bf16 model: bf16 hidden states meet a float32 head; the loss
    equals pacs_loss on float32 log-probs of the same hidden states, and the head's gradient too."""
    tok = helpers.tokenizer()
    model = helpers.tiny_model(len(tok)).to(torch.bfloat16)
    trainer = helpers.trainer(tmp_path, model=model, bf16=True, cast_lm_head_to_fp32=True)
    inputs = first_micro_batch(trainer)
    model = trainer.model
    assert model.lm_head.weight.dtype == torch.float32 and model.model.norm.weight.dtype == torch.bfloat16
    rewards = labels_from_text(tok, inputs, helpers.contains_one)
    C = inputs["completion_ids"].shape[1]

    def reference():
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, -C - 1:-1]
        assert hidden.dtype == torch.bfloat16
        logits = hidden.float() @ model.lm_head.weight.T
        logp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
        return pacs_loss(logp, logp.detach(), rewards, inputs["completion_mask"], group_size=helpers.GROUP) / 2

    loss, grads = loss_and_grads(model, lambda: trainer.compute_loss(model, inputs))
    ref_loss, ref_grads = loss_and_grads(model, reference)
    assert_same(loss, {"lm_head.weight": grads["lm_head.weight"]}, ref_loss,
                {"lm_head.weight": ref_grads["lm_head.weight"]}, tol=1e-4)


@pytest.mark.slow
def test_lora_adapters_get_the_pacs_gradients_and_only_they_train(tmp_path):
    """A PEFT LoRA model (TRL's usual set-up for large models): the fused loss runs through the
    PeftModel's forward; loss and adapter gradients equal pacs_loss on the LoRA model's own logits;
    training moves the adapters and leaves every base weight (the LM head included) untouched."""
    peft = pytest.importorskip("peft")
    tok = helpers.tokenizer()
    lora = peft.get_peft_model(helpers.tiny_model(len(tok)), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    trainer = helpers.trainer(tmp_path, model=lora)
    inputs = first_micro_batch(trainer)
    model = trainer.model
    rewards = labels_from_text(tok, inputs, helpers.contains_one)
    assert 0 < rewards.sum() < len(rewards), "mixed labels keep the gradient from vanishing"

    def reference():
        logp = helpers.naive_logp(model, inputs, 1.0)
        return pacs_loss(logp, logp.detach(), rewards, inputs["completion_mask"], group_size=helpers.GROUP) / 2

    loss, grads = loss_and_grads(model, lambda: trainer.compute_loss(model, inputs))
    assert grads and all("lora_" in name for name in grads), sorted(grads)
    assert any(g.abs().max() > 0 for name, g in grads.items() if "lora_B" in name)
    assert_same(loss, grads, *loss_and_grads(model, reference))

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all("lora_" in name for name in moved), sorted(moved)


@pytest.mark.slow
def test_micro_batches_hold_whole_groups(tmp_path):
    trainer = helpers.trainer(tmp_path, gradient_accumulation_steps=4, per_device_train_batch_size=helpers.GROUP)
    first_micro_batch(trainer)
    seen = []
    for chunk in trainer._buffered_inputs:
        ids = chunk["pacs_group_ids"]
        assert torch.equal(ids, ids[0].repeat(helpers.GROUP)), ids  # one whole group, rows in order
        prompts = chunk["prompt_ids"]
        assert all(torch.equal(prompts[i], prompts[0]) for i in range(len(prompts)))
        seen.append(int(ids[0]))
    assert sorted(seen) == list(range(4))


def test_shuffle_groups_and_split_keeps_groups():
    from pacs.integrations.trl import shuffle_groups_and_split

    torch.manual_seed(3)
    rows = torch.arange(24)
    batch = {"x": rows * 10, "y": [f"r{i}" for i in range(24)], "n": torch.tensor(7), "z": None}
    chunks = shuffle_groups_and_split(batch, group_size=3, n_chunks=4)
    assert len(chunks) == 4
    order = torch.cat([c["x"] for c in chunks]) // 10
    assert sorted(order.tolist()) == rows.tolist()
    assert not torch.equal(order, rows), "groups were permuted"
    assert torch.equal(order.reshape(-1, 3) - order.reshape(-1, 3)[:, :1], torch.arange(3).expand(8, 3))
    assert [c["y"] for c in chunks][0] == [f"r{i}" for i in order[:6].tolist()]
    assert all(c["n"].item() == 7 and c["z"] is None for c in chunks)
    with pytest.raises(ValueError, match="whole groups"):
        shuffle_groups_and_split(batch, group_size=5, n_chunks=1)


@pytest.mark.parametrize("overrides, match", [
    (dict(per_device_train_batch_size=6), "multiple of num_generations"),
    (dict(beta=0.04), "beta"),
    (dict(top_entropy_quantile=0.2), "top_entropy_quantile"),
    (dict(entropy_coef=0.01), "entropy_coef"),
    (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
    (dict(loss_type="dapo"), "loss_type must be 'pacs'"),
    (dict(num_generations_eval=2), "num_generations_eval"),
    (dict(vllm_importance_sampling_mode="sequence_clip"), "vllm_importance_sampling_mode must be one of"),
    (dict(pacs_tiled_mlp=True, pacs_mlp_tile_tokens=0), "pacs_mlp_tile_tokens must be a positive integer"),
    (dict(pacs_checkpoint_minutes=0), "pacs_checkpoint_minutes must be a number of minutes > 0"),
])
def test_refused_options(tmp_path, overrides, match):
    from pacs.integrations.trl import check_pacs_config

    with pytest.raises(ValueError, match=match):
        check_pacs_config(helpers.config(tmp_path, **overrides))


def test_continuous_batching_generation_keeps_padded_rows(tmp_path):
    """transformers' continuous batching refuses pacs_packed_sdpa for generation: with it, pacs_padding_free
    None means padded rows (the model keeps its attention) and True is refused at construction."""
    from pacs.integrations.trl import check_pacs_config

    with pytest.raises(ValueError, match="pacs_padding_free=True switches.*continuous batching"):
        check_pacs_config(helpers.config(tmp_path, use_transformers_continuous_batching=True, pacs_padding_free=True))
    trainer = helpers.trainer(tmp_path, use_transformers_continuous_batching=True)
    assert trainer.pacs_padding_free is False and trainer.model.config._attn_implementation == "sdpa"


def test_use_vllm_keeps_trls_importance_sampling_defaults(tmp_path):
    """PACSConfig keeps GRPOConfig's vLLM importance-sampling settings and their defaults (on, sequence_mask,
    clip_max 3.0, no clip_min): use_vllm=True alone is accepted, with the correction on, as in GRPOTrainer."""
    from dataclasses import fields

    from trl import GRPOConfig

    from pacs.integrations.trl import PACSConfig, check_pacs_config

    names = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
    trl_defaults = {f.name: f.default for f in fields(GRPOConfig) if f.name in names}
    assert trl_defaults == {f.name: f.default for f in fields(PACSConfig) if f.name in names}
    assert trl_defaults == dict(zip(names, (True, "sequence_mask", None, 3.0)))
    args = helpers.config(tmp_path, use_vllm=True)
    assert args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode == "sequence_mask"
    check_pacs_config(args)


def test_grpo_only_options_warn(tmp_path):
    from pacs.integrations.trl import check_pacs_config

    with pytest.warns(UserWarning, match="epsilon=0.3"):
        check_pacs_config(helpers.config(tmp_path, epsilon=0.3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_pacs_config(helpers.config(tmp_path))


def test_softcapped_model_gets_the_cap_in_the_kernels(tmp_path):
    from pacs.model.model_forward import PACSBatch, add_pacs_forward, check_supported_head
    from pacs.model.profile import ModelProfile
    from pacs_kernels import PACSLoss, pacs_loss
    from pacs_kernels.reference import naive_linear_logprobs

    model = helpers.tiny_model(17).double()
    model.config.final_logit_softcapping = 0.5  # small: the tiny model's logits are small
    check_supported_head(model.config)
    loss_fn = PACSLoss(group_size=2)
    add_pacs_forward(model, loss_fn, temperature=0.9)
    assert loss_fn.logit_softcap == 0.5
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 17, (4, 9), generator=gen)
    targets, mask = input_ids[:, -4:], torch.ones(4, 4)
    rewards, valid = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.ones(4, dtype=torch.bool)
    old = torch.randn(4, 4, generator=gen, dtype=torch.float64) - 3.0
    out = model(input_ids, pacs_batch=PACSBatch(targets, mask, rewards, valid, old_logp=old, return_stats=False))
    hidden = model.model(input_ids).last_hidden_state[:, -5:-1]
    logp, _ = naive_linear_logprobs(hidden, model.lm_head.weight, targets, temperature=0.9, softcap=0.5)
    expected = pacs_loss(logp, old, rewards, mask, group_size=2)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-8)
    model.config.logits_scaling = 4.0  # a scale and a cap together: refused
    assert ModelProfile.from_config(model.config).logit_scale == 0.25
    with pytest.raises(ValueError, match="both scales .* and soft-caps"):
        check_supported_head(model.config)


@pytest.mark.slow
def test_non_binary_reward_refused(tmp_path):
    trainer = helpers.trainer(tmp_path, reward=lambda completions, **kw: [0.5] * len(completions))
    with pytest.raises(ValueError, match="0/1 rewards"):
        first_micro_batch(trainer)


def two_rank_run(out_dir, mode: str, tied: bool = False):
    """tests/trl_torchrun_worker.py under torchrun, 2 CPU ranks -> ([rank records], [rank full weights])."""
    worker = os.path.join(repo_root(), "tests", "trl_torchrun_worker.py")
    run_torchrun([worker, mode, out_dir] + (["tied"] if tied else []), f"the 2-process TRL worker ({mode})")
    return ([json.load(open(out_dir / f"rank{r}.json")) for r in range(2)],
            [torch.load(out_dir / f"rank{r}_weights.pt") for r in range(2)])


def initial_weights(tied: bool = False) -> dict:
    """The weights both 2-rank runs start from (helpers.tiny_model is seeded)."""
    model = helpers.tiny_model(len(helpers.tokenizer()), tie_word_embeddings=tied)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return two_rank_run(tmp_path_factory.mktemp("trl_ddp"), "ddp")


@pytest.mark.slow
def test_two_processes_stay_in_sync(ddp_run):
    """torchrun, 2 CPU ranks (DDP over gloo): the weights after 2 steps are identical on both ranks,
    they moved, and every micro-batch each rank saw held whole groups."""
    records, weights = ddp_run
    initial = initial_weights()
    assert weights[0].keys() == weights[1].keys() == initial.keys()
    for name in initial:
        assert torch.equal(weights[0][name], weights[1][name]), name
    assert any(not torch.equal(weights[0][name], initial[name]) for name in initial)
    assert records[0]["wrapper"] == "DistributedDataParallel"
    for rank in records:
        assert len(rank["micro_batch_group_ids"]) == 4  # 2 steps x 2 accumulation steps
        for ids in rank["micro_batch_group_ids"]:
            groups = torch.tensor(ids).reshape(-1, helpers.GROUP)
            assert torch.equal(groups, groups[:, :1].expand_as(groups))
    seen = [set(sum(rank["micro_batch_group_ids"], [])) for rank in records]
    assert not seen[0] & seen[1], "each rank trains on its own groups"
    # on-policy: groups with a zero gradient were skipped (pacs_skip_zero_gradient_groups), and the ranks agree
    # (logged once per optimizer step: None where a step's first micro-batch found nothing logged yet)
    assert max(f for rank in records for f in rank["skipped_group_frac"] if f is not None) > 0


@pytest.mark.slow
def test_fsdp2_training_equals_ddp(ddp_run, tmp_path):
    """torchrun, 2 CPU ranks, fsdp=True (accelerate's FSDP2; on CPU turned on by
    tests/accelerate_cpu_fsdp2.py): the loss is called through the FSDP2 model (every parameter a
    Shard(0) DTensor on the 2-rank CPU mesh; each decoder layer, the embedding, the final norm with
    the LM head, and the root are FSDP units); each rank's first rollout is exactly DDP's (same seed,
    same initial weights: the comparison is valid), its second too (the first step trained alike), and
    the full weights after the 2 SGD steps equal DDP's (float32, 1e-5 relative) on both ranks, every
    tensor moved well beyond that tolerance, the LM head included (its PACS gradient arrived through
    FSDP2's reduce-scatter)."""
    assert_fsdp2_run_equals_ddp(two_rank_run(tmp_path, "fsdp2"), ddp_run, initial_weights())


@pytest.mark.slow
def test_fsdp2_with_tied_embeddings_equals_ddp(tmp_path):
    """As above with the LM head tied to the input embedding (Qwen2.5's small models): accelerate puts the
    final norm, the embedding and the head in one FSDP2 group (the shared parameter in one group only);
    the PACS gradient of the head and the embedding's own add up on it as under DDP."""
    ddp = two_rank_run(tmp_path / "ddp", "ddp", tied=True)
    assert_fsdp2_run_equals_ddp(two_rank_run(tmp_path / "fsdp2", "fsdp2", tied=True), ddp, initial_weights(tied=True))


def assert_fsdp2_run_equals_ddp(fsdp2_run, ddp_run, initial):
    records, weights = fsdp2_run
    ddp_records, ddp_weights = ddp_run
    for rank, (record, ddp_record) in enumerate(zip(records, ddp_records)):
        assert record["wrapper"] == "FSDPLlamaForCausalLM", record["wrapper"]
        sharding = record["sharding"]
        assert sharding["not_dtensor"] == [], sharding
        assert sharding["placements"] == ["(Shard(dim=0),)"], sharding
        assert sharding["mesh_devices"] == ["cpu"] and sharding["mesh_sizes"] == [2], sharding
        assert sharding["fsdp_units"] == ["<root>", "lm_head", "model.embed_tokens", "model.layers.0",
                                          "model.layers.1", "model.norm"], sharding
        assert record["micro_batch_group_ids"] == ddp_record["micro_batch_group_ids"], f"rank {rank}"
        completions, ddp_completions = record["micro_batch_completion_ids"], ddp_record["micro_batch_completion_ids"]
        assert len(completions) == 4  # 2 steps x 2 accumulation steps, one rollout per step
        assert completions[:2] == ddp_completions[:2], (
            f"rank {rank}: the first rollout (initial weights) differs from DDP's: the runs sample differently, the "
            "comparison below would not be valid")
        assert completions[2:] == ddp_completions[2:], (
            f"rank {rank}: the second rollout differs from DDP's: the first step trained the FSDP2 model differently")
    assert weights[0].keys() == weights[1].keys() == ddp_weights[0].keys() == initial.keys()
    rtol, atol = 1e-5, 1e-7
    for name, expected in ddp_weights[0].items():
        tolerance = atol + rtol * expected.abs().max()
        # every tensor moved several times the tolerance (measured: 14x and more untied, 9.9x tied)
        assert (expected - initial[name]).abs().max() > 5 * tolerance, f"{name} barely moved: the check is weak"
        for rank in range(2):
            torch.testing.assert_close(weights[rank][name], expected, rtol=rtol, atol=atol, msg=f"rank {rank}: {name}")


@pytest.mark.slow
def test_evaluate_logs_pacs_metrics(tmp_path):
    """trainer.evaluate(): TRL's eval loop generates groups and computes the PACS loss without gradients."""
    from pacs.integrations.trl import PACSTrainer

    tok = helpers.tokenizer()
    args = helpers.config(tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2 * helpers.GROUP)
    trainer = PACSTrainer(helpers.tiny_model(len(tok)), helpers.contains_one, args=args,
                          train_dataset=helpers.prompts(), eval_dataset=helpers.prompts(8), processing_class=tok)
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    assert {"eval_pacs/psi_std", "eval_pacs/weight_mean", "eval_entropy"} <= metrics.keys()


def parameters(trainer):
    """Every weight of the trained model, flattened into one tensor."""
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


@pytest.mark.slow
def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """A run stopped after a checkpoint and resumed with TRL's resume_from_checkpoint ends with the weights
    (and the logged losses and rewards) of the run that was never stopped: nothing PACSTrainer adds (the
    forward patch, the group shuffle, the raw rewards in the batch) is lost across a restart."""
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2)
    whole = helpers.trainer(tmp_path / "whole", **settings)
    initial = parameters(whole)
    whole.train()
    assert (tmp_path / "whole" / "checkpoint-2").is_dir()

    resumed = helpers.trainer(tmp_path / "resumed", **settings)
    generated = []
    generate_and_score = resumed._generate_and_score_completions
    resumed._generate_and_score_completions = lambda inputs: generated.append(1) or generate_and_score(inputs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert len(generated) == 2, "the resumed run should generate for steps 3 and 4 only"
    assert (parameters(whole) - initial).abs().max() > 1e-3, "the weights did not move: the check would be vacuous"
    torch.testing.assert_close(parameters(resumed), parameters(whole), rtol=1e-6, atol=1e-7)

    def logged_after_the_checkpoint(trainer):  # steps 1-2 of the resumed run's history come from the checkpoint
        return [value for row in trainer.state.log_history if "loss" in row and row["step"] > 2
                for value in (row["step"], row["loss"], row["reward"])]
    assert logged_after_the_checkpoint(whole)[::3] == [3, 4]
    assert logged_after_the_checkpoint(resumed) == pytest.approx(logged_after_the_checkpoint(whole), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, stop_signal):
    """SIGTERM (a scheduler's preemption) or Ctrl-C during step 2 of 4, no checkpoint scheduled: PACSTrainer
    finishes the optimizer step, saves checkpoint-2 and raises StoppedBySignal saying how to resume; resumed
    from it, the run ends with the uninterrupted run's weights. The handlers are put back."""
    from transformers import TrainerCallback

    from pacs.run.stop_signals import StoppedBySignal

    whole = helpers.trainer(tmp_path / "whole", max_steps=4)
    whole.train()

    class SignalDuringStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), stop_signal)  # the handler only sets a flag

    before = signal.getsignal(stop_signal)
    stopped = helpers.trainer(tmp_path / "stopped", max_steps=4)
    stopped.add_callback(SignalDuringStep2())
    with pytest.raises(StoppedBySignal, match=f"{stop_signal.name} received: stopped after step 2, its checkpoint "
                                              "saved in .*checkpoint-2; resume with trainer.train"):
        stopped.train()
    assert signal.getsignal(stop_signal) is before
    assert (tmp_path / "stopped" / "checkpoint-2").is_dir()

    resumed = helpers.trainer(tmp_path / "stopped", max_steps=4)
    resumed.train(resume_from_checkpoint=True)
    torch.testing.assert_close(parameters(resumed), parameters(whole), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("on_signal", [True, False])
def test_checkpoints_by_time_whatever_the_save_strategy(tmp_path, monkeypatch, on_signal):
    """pacs_checkpoint_minutes: a step that ends that long after the last save (or the start) is saved
    although save_strategy is "no", and the clock restarts at each save. A fake clock moves 60 s each time
    it is read (construction, train begin, every step end, every save), the limit is 90 s: step 2 is due,
    step 3 is not. Without it nothing is saved. Also with the signal handlers off."""
    import pacs.integrations.trl as pacs_trl

    reads = iter(range(0, 10**6, 60))
    monkeypatch.setattr(pacs_trl, "checkpoint_clock", lambda: next(reads))
    by_time = helpers.trainer(tmp_path / "by_time", pacs_checkpoint_minutes=1.5, pacs_checkpoint_on_signal=on_signal)
    by_time.train()
    assert sorted(p.name for p in (tmp_path / "by_time").glob("checkpoint-*")) == ["checkpoint-2"]
    plain = helpers.trainer(tmp_path / "plain", pacs_checkpoint_on_signal=on_signal)
    plain.train()
    assert not list((tmp_path / "plain").glob("checkpoint-*"))


@pytest.mark.slow
def test_sigterm_to_one_ddp_rank_stops_both_after_the_same_step(tmp_path, monkeypatch):
    """torchrun, 2 CPU ranks (DDP): SIGTERM to rank 0 alone during step 1 of 2: both ranks save checkpoint-1
    together and raise StoppedBySignal (the flag is all-reduced; otherwise rank 1 would wait in a collective)."""
    monkeypatch.setenv("PACS_TEST_SIGTERM_RANK0_AT_STEP", "1")
    records, _ = two_rank_run(tmp_path, "ddp")
    for rank in records:
        assert rank["stopped"]["signal"] == "SIGTERM", rank.get("stopped")
        assert "stopped after step 1" in rank["stopped"]["message"]
        assert len(rank["micro_batch_group_ids"]) == 2  # one step of 2 accumulation micro-batches, not 4
    assert (tmp_path / "checkpoint-1").is_dir()


@pytest.mark.slow
def test_a_signal_in_the_last_step_lets_training_end_as_usual(tmp_path):
    from transformers import TrainerCallback

    class SignalInTheLastStep(TrainerCallback):
        sent = False

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == state.max_steps - 1:
                os.kill(os.getpid(), signal.SIGTERM)
                SignalInTheLastStep.sent = True

    trainer = helpers.trainer(tmp_path, max_steps=2)
    trainer.add_callback(SignalInTheLastStep())
    trainer.train()  # no StoppedBySignal: training was done anyway
    assert SignalInTheLastStep.sent and trainer.state.global_step == 2
    assert not any(p.name.startswith("checkpoint-") for p in tmp_path.iterdir())  # save_strategy="no" kept
