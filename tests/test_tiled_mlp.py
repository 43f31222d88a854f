"""Tiled MLP (pacs/model/tiled_mlp.py): the same loss and gradients as the untiled model in float64 (padded
and packed, with checkpointing and activation offload, tiles that do not divide the tokens), only
the MLP's input kept for the backward, 16-bit parameters and autocast, LoRA adapters inside the MLP,
no-grad passes, unchanged parameter names, deep copies, and clear errors."""

import copy

import pytest
import torch
import transformers
from test_packing import ARCH, GROUP, config, random_batch, tiny_policy

from pacs.config import load_config, validate
from pacs.model.memory import activation_offload
from pacs.model.packing import pack_rows
from pacs.model.policy import Policy
from pacs.model.tiled_mlp import is_tiled, tile_mlp
from pacs.train.update import policy_loss


def loss_and_grads(policy, batch, old_logp, packed: bool, offload: bool = False):
    policy.zero_grad(set_to_none=True)
    n = batch.input_ids.shape[0]
    part = pack_rows(batch, 0, n) if packed else batch.rows(0, n)
    old = part.take(old_logp) if packed else old_logp[:, :part.targets.shape[1]]
    with activation_offload(offload, torch.device("cpu")):
        loss, _ = policy_loss(config(), policy, part, old)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed,checkpointing,offload", [
    (True, None, False), (False, None, False), (True, "non-reentrant", False), (True, "non-reentrant", True),
    (False, "reentrant", False)])  # reentrant: what HF Trainer (TRL) picks unless told otherwise
def test_tiled_mlp_gives_the_same_loss_and_gradients(packed, checkpointing, offload):
    policy = tiny_policy(41)
    tiled = copy.deepcopy(policy)
    assert tile_mlp(tiled.causal_lm, 5) == ARCH["num_hidden_layers"]  # 5 divides neither row lengths nor totals
    for p in (policy, tiled):
        if checkpointing:
            p.causal_lm.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
            p.causal_lm.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    batch = random_batch(42)
    old_logp = torch.randn(batch.targets.shape, dtype=torch.float64) * 0.1 - 3.0
    loss_ref, grads_ref = loss_and_grads(policy, batch, old_logp, packed)
    loss, grads = loss_and_grads(tiled, batch, old_logp, packed, offload)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0.0)
    assert grads.keys() == grads_ref.keys()
    mlp_weights = [k for k in grads_ref if ".mlp." in k]
    assert len(mlp_weights) == 3 * ARCH["num_hidden_layers"]
    assert all(grads_ref[k].abs().max() > 1e-6 for k in mlp_weights)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-10, atol=1e-14, msg=name)


def saved_bytes(policy, x) -> int:
    """Bytes of every tensor the forward saves for the backward (each save counted)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden, _, _ = policy(x, None)
    hidden.sum().backward()
    return total[0]


def test_tiled_mlp_keeps_only_the_mlp_input_for_the_backward():
    policy = tiny_policy(43, attn="sdpa")
    tiled = copy.deepcopy(policy)
    tile_mlp(tiled.causal_lm, 4)
    tokens = 2 * 37
    x = torch.randint(0, ARCH["vocab_size"], (2, 37))
    untiled_bytes, tiled_bytes = saved_bytes(policy, x), saved_bytes(tiled, x)
    per_layer = tokens * 8  # float64
    # untiled, each layer's MLP saves gate(x), up(x), act(gate(x)) and their product: 4 (T, I) tensors (and x);
    # tiled, x alone
    saved_less = untiled_bytes - tiled_bytes
    layers = ARCH["num_hidden_layers"]
    assert saved_less >= layers * per_layer * (4 * ARCH["intermediate_size"] - ARCH["hidden_size"]) * 0.99, (
        untiled_bytes, tiled_bytes)


def test_no_grad_passes_run_in_tiles_and_agree():
    policy = tiny_policy(44, attn="sdpa")
    tiled = copy.deepcopy(policy)
    tile_mlp(tiled.causal_lm, 3)
    x = torch.randint(0, ARCH["vocab_size"], (3, 11))
    with torch.no_grad():
        ref, _, _ = policy(x, None)
        calls = []
        mlp = tiled.causal_lm.model.layers[0].mlp
        handle = mlp.down_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
        out, _, _ = tiled(x, None)
        handle.remove()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    assert calls == [3] * 11  # 33 tokens, tiles of 3


@pytest.mark.parametrize("mode", ["bfloat16", "autocast"])
def test_tiled_mlp_in_16_bits_matches_the_untiled_model(mode):
    """bfloat16 parameters (per-tile parameter gradients summed in float32), or float32 parameters
    under bf16 autocast (the tiles recomputed under the forward's autocast): within bf16 rounding of
    the untiled model, and both within the same distance of the float64 gradients."""
    reference = tiny_policy(45, attn="sdpa")
    base = copy.deepcopy(reference).to(torch.bfloat16 if mode == "bfloat16" else torch.float32)
    tiled = copy.deepcopy(base)
    tile_mlp(tiled.causal_lm, 6)
    x = torch.randint(0, ARCH["vocab_size"], (2, 29))
    upstream = torch.randn(2, 29, ARCH["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def grads(policy):
        policy.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            hidden, _, _ = policy(x, None)  # the final hidden states
        (hidden.double() * upstream).sum().backward()
        return {k: p.grad.double() for k, p in policy.named_parameters() if p.grad is not None}

    exact, untiled = grads(reference), grads(base)
    dtypes = []  # the MLP's matmuls, in the tiled forward and in the backward's recompute
    handle = tiled.causal_lm.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    got = grads(tiled)
    handle.remove()
    assert dtypes == [torch.bfloat16] * 20  # 58 tokens in tiles of 6: 10 tiles forward, 10 recomputed
    assert exact.keys() == untiled.keys() == got.keys()
    for name in exact:
        scale = float(exact[name].abs().max())
        err_untiled = float((untiled[name] - exact[name]).abs().max())
        err_tiled = float((got[name] - exact[name]).abs().max())
        assert err_tiled <= 2 * err_untiled + 0.02 * scale, (name, err_tiled, err_untiled, scale)
        assert float((got[name] - untiled[name]).abs().max()) <= 0.05 * scale, name
    gate = tiled.causal_lm.model.layers[0].mlp.gate_proj.weight
    assert gate.grad.dtype == gate.dtype


def test_lora_adapters_inside_the_mlp_train_through_the_tiles():
    peft = pytest.importorskip("peft")
    policy = tiny_policy(46, attn="sdpa")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=0.0,
                           init_lora_weights=False)
    plain = peft.get_peft_model(copy.deepcopy(policy.causal_lm), lora)
    tiled = peft.get_peft_model(copy.deepcopy(policy.causal_lm), lora)
    tiled.load_state_dict(plain.state_dict())
    tile_mlp(tiled.base_model.model, 7)
    x = torch.randint(0, ARCH["vocab_size"], (2, 19))

    def grads(model):
        model(x).logits.sum().backward()
        return {k: p.grad for k, p in model.named_parameters() if p.requires_grad}

    ref, got = grads(plain), grads(tiled)
    assert ref.keys() == got.keys() and any("lora_A" in k and ".mlp." in k for k in ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-14, msg=name)
    assert all(p.grad is None for p in tiled.parameters() if not p.requires_grad)


def test_parameters_names_copies_and_saved_models_are_unchanged(tmp_path):
    policy = tiny_policy(47, attn="sdpa")
    names = list(policy.state_dict())
    tile_mlp(policy.causal_lm)  # default tile: the hidden size
    assert policy.causal_lm.model.layers[0].mlp.tiled_mlp_tokens == ARCH["hidden_size"]
    assert list(policy.state_dict()) == names
    tile_mlp(policy.causal_lm, 9)  # again: only the tile size changes, no double wrapping
    mlp = policy.causal_lm.model.layers[1].mlp
    assert mlp.tiled_mlp_tokens == 9
    copied = copy.deepcopy(policy)
    with torch.no_grad():
        copied.causal_lm.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    x = torch.randint(0, ARCH["vocab_size"], (1, 12))
    assert not torch.allclose(copied(x, None)[0], policy(x, None)[0])  # the copy runs its own weights
    policy.causal_lm.save_pretrained(tmp_path / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float64)
    loaded.set_attn_implementation("sdpa")
    torch.testing.assert_close(Policy(loaded)(x, None)[0], policy(x, None)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tile", [0, -3, True, 2.5, "8"])
def test_bad_tile_sizes_name_the_setting(tile):
    with pytest.raises(ValueError, match="train.mlp_tile_tokens must be a positive integer"):
        tile_mlp(tiny_policy(48).causal_lm, tile)


def test_models_without_a_tileable_mlp_are_refused():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = torch.nn.Linear(4, 4)

    model = decoder_model([Block(), Block()], hidden_size=4)
    with pytest.raises(ValueError, match="have no `mlp` submodule"):
        tile_mlp(model, 2)

    class RoutedMLP(torch.nn.Module):  # returns (output, router logits), as mixture-of-experts blocks do
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x), x.sum(-1)

    for block in model.decoder.layers:
        block.mlp = RoutedMLP()
    tile_mlp(model, 2)
    x = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(ValueError, match="cannot be tiled: turn the tiled MLP off"):
        model.decoder.layers[0].mlp(x)


def test_config_checks_the_tile_size():
    cfg = load_config(None, [f"rollout.group_size={GROUP}", "train.tiled_mlp=true", "advanced.train.mlp_tile_tokens=0"])
    with pytest.raises(ValueError, match="train.mlp_tile_tokens must be a positive number of tokens"):
        validate(cfg)
    validate(load_config(None, [f"rollout.group_size={GROUP}", "train.tiled_mlp=true",
                                "advanced.train.mlp_tile_tokens=64"]))


def test_a_tiled_model_under_the_plain_loop_forward_patch():
    """tile_mlp then add_pacs_forward (what a TRL or plain-loop user does): the fused loss and every
    gradient are the untiled patched model's."""
    import trl_helpers as helpers

    from pacs.model.model_forward import PACSBatch, add_pacs_forward
    from pacs_kernels import PACSLoss

    plain = helpers.tiny_model(17).double()
    tiled = copy.deepcopy(plain)
    tile_mlp(tiled, 3)
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, 17, (4, 11), generator=gen)
    pacs_batch = PACSBatch(input_ids[:, -5:], torch.ones(4, 5), torch.tensor([1.0, 0.0, 0.0, 1.0]),
                           torch.ones(4, dtype=torch.bool), old_logp=torch.randn(4, 5, generator=gen) - 3.0,
                           return_stats=False)
    results = []
    for model in (plain, tiled):
        add_pacs_forward(model, PACSLoss(group_size=2), temperature=1.0)
        loss = model(input_ids, pacs_batch=pacs_batch).loss
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss, grads) = results
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0.0)
    assert any(".mlp." in k and g.abs().max() > 1e-8 for k, g in grads_ref.items())
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-10, atol=1e-14, msg=name)


class DropoutMLP(torch.nn.Module):
    """A token-wise MLP with dropout inside, as a LoRA adapter with lora_dropout has."""

    def __init__(self, d=8, hidden=24):
        super().__init__()
        self.up, self.down, self.drop = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d), torch.nn.Dropout(0.3)

    def forward(self, x):
        return self.down(self.drop(torch.nn.functional.silu(self.up(x))))


def one_layer_model(mlp):
    layer = torch.nn.Module()
    layer.mlp = mlp
    return decoder_model([layer])


def decoder_model(layers, hidden_size=8):
    """The least a model needs for tile_mlp: get_decoder() with a ModuleList of ``layers``, a config."""
    class Model(torch.nn.Module):
        config = transformers.PretrainedConfig(hidden_size=hidden_size)

        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList(layers)

        def get_decoder(self):
            return self.decoder

    return Model()


def test_dropout_inside_the_mlp_gets_the_gradient_of_the_masks_its_forward_drew():
    """The backward replays the forward's random state: the recomputed tiles draw the same dropout
    masks, so the gradient is that of the output actually computed (here: the same tiles run one by
    one under autograd from the same seed), and the random streams continue as without tiling."""
    torch.manual_seed(0)
    mlp = DropoutMLP().double().train()
    model = one_layer_model(mlp)
    x = torch.randn(2, 13, 8, dtype=torch.float64)
    upstream = torch.randn(2, 13, 8, dtype=torch.float64)

    torch.manual_seed(7)
    ref_x = x.clone().requires_grad_(True)
    ref_out = torch.cat([type(mlp).forward(mlp, tile) for tile in ref_x.reshape(-1, 8).split(4)]).reshape(2, 13, 8)
    (ref_out * upstream).sum().backward()
    ref_grads = {k: p.grad.clone() for k, p in mlp.named_parameters()}
    after_reference = torch.rand(1)
    mlp.zero_grad(set_to_none=True)

    tile_mlp(model, 4)
    torch.manual_seed(7)
    tiled_x = x.clone().requires_grad_(True)
    out = mlp(tiled_x)
    torch.testing.assert_close(out, ref_out.detach(), rtol=0, atol=0)
    (out * upstream).sum().backward()
    torch.testing.assert_close(torch.rand(1), after_reference)  # the stream goes on as it would have
    torch.testing.assert_close(tiled_x.grad, ref_x.grad, rtol=1e-12, atol=1e-14)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(mlp.get_parameter(name).grad, grad, rtol=1e-12, atol=1e-14, msg=name)


def test_a_pickled_or_repatched_mlp_is_tiled_again():
    import io

    policy = tiny_policy(49, attn="sdpa")
    tile_mlp(policy.causal_lm, 3)
    buffer = io.BytesIO()
    torch.save(policy, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    mlp = loaded.causal_lm.model.layers[0].mlp
    assert not is_tiled(mlp)  # pickle keeps the class's forward
    tile_mlp(loaded.causal_lm, 3)
    mlp.forward = type(mlp).forward.__get__(mlp)  # as a later patch (Liger's) would replace it
    tile_mlp(loaded.causal_lm, 3)
    calls = []
    handle = mlp.down_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    with torch.no_grad():
        loaded(torch.randint(0, ARCH["vocab_size"], (1, 7)), None)
    handle.remove()
    assert calls == [3, 3, 1]


def test_many_tiles_of_16_bit_gradients_are_summed_in_float32():
    """1,024 tokens in tiles of 4: 256 bf16 partial gradients per weight. Summed in float32 the
    tiled gradient is as close to float64's as the untiled one (summed in bf16 it is about 10x off)."""
    reference = tiny_policy(50, attn="sdpa")
    base = copy.deepcopy(reference).to(torch.bfloat16)
    tiled = copy.deepcopy(base)
    tile_mlp(tiled.causal_lm, 4)
    x = torch.randint(0, ARCH["vocab_size"], (2, 512), generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(2, 512, ARCH["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def mlp_grads(policy):
        hidden, _, _ = policy(x, None)
        (hidden.double() * upstream).sum().backward()
        return {k: p.grad.double() for k, p in policy.named_parameters() if ".mlp." in k}

    exact, untiled, got = mlp_grads(reference), mlp_grads(base), mlp_grads(tiled)
    for name in exact:
        scale = float(exact[name].abs().max())
        err_untiled = float((untiled[name] - exact[name]).abs().max()) / scale
        err_tiled = float((got[name] - exact[name]).abs().max()) / scale
        assert err_tiled <= 1.5 * err_untiled + 1e-3, (name, err_tiled, err_untiled)


def test_default_tile_reads_a_multimodal_models_text_config():
    mlp = DropoutMLP()
    model = one_layer_model(mlp)

    class Config:  # no top-level hidden_size, as Gemma 3's or Qwen2.5-VL's config
        def get_text_config(self):
            return transformers.PretrainedConfig(hidden_size=6)

    model.config = Config()
    tile_mlp(model)
    assert mlp.tiled_mlp_tokens == 6


def test_double_backward_is_refused_clearly():
    mlp = DropoutMLP().eval()
    tile_mlp(one_layer_model(mlp), 2)
    x = torch.randn(5, 8, requires_grad=True)
    (grad,) = torch.autograd.grad(mlp(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="twice|once|double"):
        grad.sum().backward()
