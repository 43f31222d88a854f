"""Padding-free PACS forwards (add_pacs_forward(..., padding_free=...), PACSTrainer's pacs_padding_free) and
where packed rows are exact at all (pacs.model.packing.packing_obstacle, also used by ``pacs train``'s packing):
the packed forward's loss and gradients equal the padded forward's in float64 with left-padded prompts and
right-padded completions; models where packing cannot be exact are left padded by default and refused when
it is asked for."""

import pytest
import torch
import transformers
import trl_helpers as helpers

from pacs.config import load_config
from pacs.model.model_forward import PACSBatch, add_pacs_forward
from pacs.model.packed_attention import PACKED_ATTENTION
from pacs.model.packing import packing_obstacle, use_packing
from pacs_kernels import LossOptions, PACSLoss

V, G = 23, 3
TORCH_BACKEND = LossOptions(backend="torch")


def tiny_llama(seed: int = 0):
    return helpers.tiny_model(V, seed=seed, max_position_embeddings=128).double()


def left_right_padded(seed: int, n_groups: int = 2, prompt_len: int = 7, completion_len: int = 9):
    """TRL's layout: prompts left-padded to prompt_len, completions right-padded to completion_len, every
    row's lengths different; a mask that is 0 on one real completion token; mixed 0/1 rewards."""
    gen = torch.Generator().manual_seed(seed)
    B = n_groups * G
    prompt_lens = torch.randint(1, prompt_len + 1, (B,), generator=gen)
    completion_lens = torch.randint(1, completion_len + 1, (B,), generator=gen)
    completion_lens[0] = completion_len  # one row without padding
    cols_p, cols_c = torch.arange(prompt_len), torch.arange(completion_len)
    prompt_mask = (cols_p[None] >= prompt_len - prompt_lens[:, None]).long()
    completion_mask = (cols_c[None] < completion_lens[:, None]).long()
    input_ids = torch.randint(3, V, (B, prompt_len + completion_len), generator=gen)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    input_ids = input_ids * attention_mask  # padding is token 0
    loss_mask = completion_mask.double()
    loss_mask[1, 0] = 0.0  # a real token left out of the loss
    rewards = torch.tensor([float(i % 2) for i in range(B)])
    old = torch.randn(B, completion_len, generator=gen, dtype=torch.float64) - 2.0
    return input_ids, attention_mask, PACSBatch(
        targets=input_ids[:, prompt_len:], mask=loss_mask, rewards=rewards, valid=torch.ones(B, dtype=torch.bool),
        old_logp=old, return_stats=True)


def positions_from_the_first_real_token(attention_mask):
    """(B, L) position ids counting from each row's first real token, as a packed row counts (negative on the
    left padding, so that every row still counts up by one). Hugging Face's Llama computes RoPE's angles in
    float32, so a padded row whose positions start at its padding (TRL's call, no position_ids) differs from
    the packed row by float32 rounding of the angles (about 1e-8 here), not by anything else."""
    first_real = (attention_mask != 0).to(torch.int8).argmax(1)
    return torch.arange(attention_mask.shape[1])[None, :] - first_real[:, None]


def loss_and_grads(model, input_ids, attention_mask, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, attention_mask=attention_mask, pacs_batch=batch, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out.stats


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padding_free_loss_and_gradients_equal_the_padded_forward_in_float64(on_policy, attention):
    """The padded reference runs sdpa (Hugging Face's eager attention gives NaN on left-padded float64 rows);
    the padding-free model starts from ``attention`` and runs pacs_packed_sdpa either way."""
    input_ids, attention_mask, batch = left_right_padded(0)
    if on_policy:
        batch.old_logp = None
    padded, packed = tiny_llama(), tiny_llama()
    packed.set_attn_implementation(attention)
    assert add_pacs_forward(padded, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=0.7) is False
    assert add_pacs_forward(packed, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=0.7,
                            padding_free=True) is True
    assert packed.config._attn_implementation == PACKED_ATTENTION
    loss, grads, stats = loss_and_grads(packed, input_ids, attention_mask, batch)
    positions = positions_from_the_first_real_token(attention_mask)
    ref_loss, ref_grads, ref_stats = loss_and_grads(padded, input_ids, attention_mask, batch, position_ids=positions)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-13)
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(packed.parameters()))
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert scale > 1e-6, "the reference gradient vanished: the comparison would be vacuous"
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12 * scale, msg=name)
    for key in ("entropy_mean", "psi_std", "loss"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-10, abs=1e-13), key
    # TRL's padded call (positions counted from the padding): the same up to RoPE's float32 angles
    trl_loss, trl_grads, _ = loss_and_grads(padded, input_ids, attention_mask, batch)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-6, atol=1e-8)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], trl_grads[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    # calls without pacs_batch (logits, generation) are the padded model's
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=input_ids, attention_mask=attention_mask).logits,
                                   padded(input_ids=input_ids, attention_mask=attention_mask).logits,
                                   rtol=1e-10, atol=1e-10)


def test_padding_free_takes_positional_inputs_and_no_attention_mask():
    input_ids, attention_mask, batch = left_right_padded(1)
    full = torch.ones_like(attention_mask)
    batch.mask = torch.ones_like(batch.mask)  # every completion token real
    padded, packed = tiny_llama(), tiny_llama()
    add_pacs_forward(padded, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=1.0)
    add_pacs_forward(packed, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=1.0, padding_free=True)
    with torch.no_grad():
        expected = padded(input_ids, full, pacs_batch=batch).loss
        torch.testing.assert_close(packed(input_ids, pacs_batch=batch).loss, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(packed(input_ids, full, pacs_batch=batch).loss, expected, rtol=1e-10, atol=1e-12)


def test_a_loss_mask_on_padding_is_refused():
    """The padded forward would silently train on a padding position's hidden state; the packed one has none."""
    input_ids, attention_mask, batch = left_right_padded(2)
    short = int((attention_mask[:, 7:].sum(1) < 9).nonzero()[0])
    batch.mask[short] = 1.0
    model = tiny_llama()
    add_pacs_forward(model, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=1.0, padding_free=True)
    with pytest.raises(ValueError, match="pacs_batch.mask selects completion tokens that attention_mask marks"):
        model(input_ids=input_ids, attention_mask=attention_mask, pacs_batch=batch)
    with pytest.raises(ValueError, match="not \\['position_ids'\\]"):
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=torch.zeros_like(input_ids),
              pacs_batch=batch)


# ----------------------------------------------------------------------------- where packing is exact


def test_packing_obstacles_of_real_model_configs():
    assert packing_obstacle(transformers.Qwen2Config(), PACKED_ATTENTION) is None
    assert packing_obstacle(transformers.LlamaConfig(), PACKED_ATTENTION) is None
    assert "sliding window of 4096 tokens" in packing_obstacle(transformers.MistralConfig(), PACKED_ATTENTION)
    assert packing_obstacle(transformers.MistralConfig(sliding_window=None), PACKED_ATTENTION) is None
    gemma2 = transformers.Gemma2Config()
    assert "sliding window" in packing_obstacle(gemma2, PACKED_ATTENTION)
    gemma2.layer_types = ["full_attention"] * gemma2.num_hidden_layers
    assert "attn_logit_softcapping=50.0" in packing_obstacle(gemma2, PACKED_ATTENTION)
    assert packing_obstacle(gemma2, "flash_attention_2") is None  # flash's varlen kernel does both
    hybrid = transformers.Qwen3NextConfig()
    assert "not attention (linear_attention; Qwen3NextConfig.layer_types)" in packing_obstacle(
        hybrid, "flash_attention_2")
    # RecurrentGemma lists its recurrent blocks in block_types (they were missed: packed with flash attention,
    # each sequence's convolution state leaked into the next)
    assert "not attention (recurrent;" in packing_obstacle(transformers.RecurrentGemmaConfig(), "flash_attention_2")
    # Phi-3's long/short rotary factors and dynamic NTK follow the call's largest position, which a left-padded
    # batch counts from its padding (TRL's layout: hidden states 1e-2 apart); right-padded rows share it
    phi3_long = transformers.Phi3Config(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48,
                                                      "long_factor": [2.0] * 48, "factor": 32.0,
                                                      "original_max_position_embeddings": 4096},
                                        max_position_embeddings=131072, sliding_window=None)
    assert "rope_type='longrope'" in packing_obstacle(phi3_long, PACKED_ATTENTION, left_padded=True)
    assert packing_obstacle(phi3_long, PACKED_ATTENTION) is None
    dynamic = transformers.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "rope_type='dynamic'" in packing_obstacle(dynamic, "flash_attention_2", left_padded=True)


def test_padding_free_none_is_off_where_packing_cannot_be_exact_and_true_is_refused():
    model = tiny_llama()
    model.config.layer_types = ["linear_attention", "full_attention"]  # as a hybrid model declares its layers
    assert add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0, padding_free=None) is False
    assert model.config._attn_implementation == "sdpa"  # left as it was
    with pytest.raises(ValueError, match=r"pacs_padding_free=True cannot be exact for this model: .*linear_attention"):
        add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0, padding_free=True,
                         setting="pacs_padding_free")
    with pytest.raises(ValueError, match="padding_free must be True, False or None"):
        add_pacs_forward(tiny_llama(), PACSLoss(group_size=G), temperature=1.0, padding_free="yes")
    plain = tiny_llama()
    assert add_pacs_forward(plain, PACSLoss(group_size=G), temperature=1.0, padding_free=None) is True


def test_a_flash_attention_model_keeps_its_attention():
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"  # as loaded on a GPU with flash_attn (not run here)
    assert add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0, padding_free=None) is True
    assert model.config._attn_implementation == "flash_attention_2"


def test_pacs_train_packing_follows_the_model():
    """``pacs train``: train.packing unset packs wherever exact, so a hybrid or sliding-window model trains on
    padded rows; train.packing=true for one is refused, saying why."""
    cfg = load_config(None, [])
    assert use_packing(cfg, transformers.Qwen2Config(), PACKED_ATTENTION)
    assert not use_packing(cfg, transformers.MistralConfig(), PACKED_ATTENTION)
    assert use_packing(cfg, transformers.MistralConfig(), "flash_attention_2")
    assert not use_packing(cfg, transformers.Qwen3NextConfig(), "flash_attention_2")
    with pytest.raises(ValueError, match="train.packing=true cannot be exact for this model: .*sliding window"):
        use_packing(load_config(None, ["train.packing=true"]), transformers.MistralConfig(), PACKED_ATTENTION)


# ----------------------------------------------------------------------------- models that cannot be packed


def tiny(config_class, model_class, **config):
    torch.manual_seed(0)
    return model_class(config_class(**config)).double()


def test_models_attending_by_code_of_their_own_or_without_rotary_positions_are_not_packed():
    """Falcon, Bloom, MPT attend by their own code (no attention interface): the packed row's sequences would
    attend to each other (transformers only warns when asked to switch); GPT-2's absolute positions count from
    a left-padded row's padding; a model transformers does not know (code of its own) cannot be told."""
    assert "attends by code of its own" in packing_obstacle(transformers.FalconConfig(), PACKED_ATTENTION)
    assert "attends by code of its own" in packing_obstacle(transformers.BloomConfig(), "flash_attention_2")
    assert packing_obstacle(transformers.GPT2Config(), PACKED_ATTENTION) is None  # right-padded rows (pacs train)
    assert "no rotary position embeddings" in packing_obstacle(transformers.GPT2Config(), PACKED_ATTENTION,
                                                               left_padded=True)
    assert packing_obstacle(transformers.Qwen2Config(), PACKED_ATTENTION, left_padded=True) is None

    class RemoteConfig(transformers.PretrainedConfig):
        model_type = "remote_code_model"

    assert "not a transformers model class" in packing_obstacle(RemoteConfig(), PACKED_ATTENTION)
    falcon = tiny(transformers.FalconConfig, transformers.FalconForCausalLM, vocab_size=V, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=4)
    before = falcon.config._attn_implementation
    assert add_pacs_forward(falcon, PACSLoss(group_size=G), temperature=1.0, padding_free=None) is False
    assert falcon.config._attn_implementation == before
    with pytest.raises(ValueError, match="padding_free=True cannot be exact for this model: FalconForCausalLM "
                                         "attends by code of its own"):
        add_pacs_forward(falcon, PACSLoss(group_size=G), temperature=1.0, padding_free=True)
    gpt2 = tiny(transformers.GPT2Config, transformers.GPT2LMHeadModel, vocab_size=V, n_embd=32, n_layer=2, n_head=4)
    assert add_pacs_forward(gpt2, PACSLoss(group_size=G), temperature=1.0, padding_free=None) is False


def test_a_model_that_keeps_its_attention_when_asked_to_switch_is_not_packed(monkeypatch):
    """transformers may only warn and keep the old attention: padding-free then stays off (None) or is refused
    (True), and the model keeps the attention it had."""
    model = tiny_llama()
    monkeypatch.setattr(model, "set_attn_implementation", lambda name: None)  # keeps sdpa, like a warning would
    assert add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0, padding_free=None) is False
    with pytest.raises(ValueError, match=r"padding_free=True needs an attention that keeps packed sequences apart.*"
                                         r"transformers kept sdpa"):
        add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0, padding_free=True)
    assert model.config._attn_implementation == "sdpa"


def test_a_refused_head_leaves_the_attention_as_it_was():
    model = tiny_llama()
    model.get_output_embeddings = lambda: None
    with pytest.raises(ValueError, match=r"get_output_embeddings\(\) returned None"):
        add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0, padding_free=True)
    assert model.config._attn_implementation == "sdpa"


def test_a_packed_row_with_an_attention_mask_or_images_is_refused():
    from pacs.model.packed_attention import packed_call, packed_sdpa_attention

    q = torch.randn(1, 2, 4, 8)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    with packed_call([0, 2, 4]), pytest.raises(ValueError, match="built an attention mask for a packed row"):
        packed_sdpa_attention(module, q, q, q, torch.zeros(1, 1, 4, 4), cu_seq_lens_q=torch.tensor([0, 2, 4]))
    input_ids, attention_mask, batch = left_right_padded(4)
    model = tiny_llama()
    add_pacs_forward(model, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=1.0, padding_free=True)
    with pytest.raises(ValueError, match=r"text only\), not \['pixel_values'\]"):
        model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=torch.zeros(1, 3, 4, 4),
              pacs_batch=batch)


@pytest.mark.parametrize("padding_free", [True, False])
def test_a_logprob_request_returns_the_completion_log_probs(padding_free):
    """pacs_batch=LogprobRequest(targets): the completion tokens' log-probs at the loss's temperature from the
    same forward (padded or packed), equal to the model's own logits' log-softmax on the real tokens (float64)."""
    from pacs.model.model_forward import LogprobRequest

    input_ids, attention_mask, batch = left_right_padded(5)
    model = tiny_llama()
    add_pacs_forward(model, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=0.7, padding_free=padding_free)
    with torch.no_grad():
        logp = model(input_ids=input_ids, attention_mask=attention_mask,
                     pacs_batch=LogprobRequest(batch.targets)).logp
        positions = positions_from_the_first_real_token(attention_mask)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
        expected = torch.log_softmax(logits[:, -10:-1] / 0.7, -1).gather(-1, batch.targets[..., None])[..., 0]
    real = attention_mask[:, -9:].bool()
    # linear_logprobs' output dtype: float32, or float64 for this float64 model
    assert logp.shape == batch.targets.shape and logp.dtype == model.lm_head.weight.dtype == torch.float64
    torch.testing.assert_close(logp[real].double(), expected[real], rtol=1e-6, atol=1e-6)


def test_pacs_train_refuses_packing_a_sliding_window_model_before_any_work(tmp_path):
    """``pacs train``'s config check reads the model's config and class: train.packing=true for a model with a
    sliding window (no flash attention here) is refused, naming the setting; unset, it is accepted (padded
    rows); sequence parallelism, which needs packed rows, is refused for it."""
    from pacs.run.run_setup import check_config

    model_dir = tmp_path / "mistral"
    tiny(transformers.MistralConfig, transformers.MistralForCausalLM, vocab_size=V, hidden_size=32,
         intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=256, sliding_window=16).save_pretrained(model_dir)
    base = [f"model.path={model_dir}", "rollout.max_prompt_len=16", "rollout.max_new_tokens=16"]
    check_config(load_config(None, base))
    with pytest.raises(ValueError, match="train.packing=true cannot be exact for this model: .*sliding window of 16"):
        check_config(load_config(None, [*base, "train.packing=true"]))
    with pytest.raises(ValueError, match="sequence_parallel_size=2 splits packed micro-batches, which cannot be exact"):
        check_config(load_config(None, [*base, "train.sequence_parallel_size=2"]), world_size=2)


def test_a_model_whose_layers_drop_the_sequence_bounds_is_refused_not_attended_across(monkeypatch):
    """Nemotron's decoder layer calls its attention without the keyword arguments, so a packed row's sequence
    bounds never arrive: plain SDPA over the row let every sequence attend to the ones before it (hidden states
    off by their own size, silently). It is not packed (padding_free=None: padded rows); a model like it that
    the list misses stops at its first packed forward, naming the setting that turns packing off."""
    model = tiny(transformers.NemotronConfig, transformers.NemotronForCausalLM, vocab_size=V, hidden_size=32,
                 intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, partial_rotary_factor=0.5, pad_token_id=0)
    assert "decoder layers do not pass a packed row's sequence bounds" in packing_obstacle(model.config,
                                                                                           PACKED_ATTENTION)
    assert add_pacs_forward(model, PACSLoss(group_size=G), temperature=1.0, padding_free=None) is False
    # a model the list does not know: the attention itself refuses what never reached it
    from pacs.model import profile

    input_ids, attention_mask, batch = left_right_padded(4)
    monkeypatch.setattr(profile, "BOUNDS_NOT_PASSED_ON", ())
    add_pacs_forward(model, PACSLoss(group_size=G, options=TORCH_BACKEND), temperature=1.0, padding_free=True)
    with pytest.raises(ValueError, match=r"NemotronAttention: a packed row's sequence bounds \(cu_seq_lens_q\) did "
                                         r"not reach this attention layer.*set train.packing=false"):
        model(input_ids=input_ids, attention_mask=attention_mask, pacs_batch=batch)
