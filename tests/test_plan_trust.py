"""pacs plan that users can trust (pacs/train/memory_plan/, the plan part of pacs/cli.py): mixtures of experts
counted (every expert in weights, gradients and optimizer state; the routed ones in the activations), the blocking
term named with the lever that removes it, every impossible input refused in one line naming its flag, the flags
beside --preset applied, shipped model configs found by name and by hub id, and presets found by name."""

import os
import re
from dataclasses import replace

import pytest

from pacs import configs as shipped_configs
from pacs.cli import main
from pacs.train.memory_plan import (
    GiB,
    PlanInputs,
    blocker,
    cheapest_fitting_plan,
    load_model_shape,
    plan_memory,
    plan_preset,
    shape_from_config,
    what_would_fit,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_plan(argv, capsys):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(argv, capsys) -> str:
    """The one stderr line of a refused ``pacs plan``, exit code 2."""
    code, out, err = run_plan(argv, capsys)
    assert code == 2, out
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- mixtures of experts ------------------------------------------------------------------------------------------

def test_qwen3_30b_a3b_counts_every_expert_and_shows_total_and_active(capsys):
    m = load_model_shape("qwen3-30b-a3b")
    assert round(m.params / 1e9, 1) == 30.5  # the published "30.5B in total"
    assert 3.3e9 <= m.active_params < 3.4e9  # "3.3B activated"
    assert (m.experts, m.experts_per_token, m.expert_intermediate, m.moe_layers) == (128, 8, 768, 48)
    assert m.mlp_width == 8 * 768  # a token's activations: its 8 routed experts
    # weights, gradients and AdamW state by the total: float32 master, sharded over 8 GPUs -> 56.9 GiB per GPU
    plan = plan_memory(PlanInputs(model=m, gpu_gib=80, gpus=8, response_len=4096))
    states = sum(v for k, v in plan.components.items() if k.startswith(("weights (master", "gradients", "AdamW")))
    assert states == 16 * m.params / 8 and round(states / GiB, 1) == 56.9
    code, out, _ = run_plan(["--model", "qwen3-30b-a3b", "--gpu-gib", "80", "--gpus", "8"], capsys)
    assert "30.53B parameters in total" in out and "3.35B active per token" in out
    assert "8 of 128 experts of 768" in out
    assert "tiled MLP" not in out  # pacs/model/tiled_mlp.py cannot tile experts: never offered
    # LoRA adapts the attention projections only (the experts are 3-D parameters, no linear layers)
    code, out, _ = run_plan(["--model", "qwen3-30b-a3b", "--gpu-gib", "80", "--gpus", "8", "--lora-rank", "16"], capsys)
    assert "LoRA rank 16 on q_proj,k_proj,v_proj,o_proj: 13.4M trainable" in out


def test_saved_bytes_of_a_mixture_of_experts_layer():
    """Counted with saved_tensors_hooks on transformers 5.19's Qwen3-MoE layer (hidden 512, 8 of 16 experts of
    96; the bytes per token between 512 and 1,024 tokens): 62,352 (float32), 60,032 (bf16 autocast), 35,200
    (bfloat16); the dense formula's error on the same layer without experts is -1.8%, -1.3%, -11%."""
    from pacs.train.memory_plan import layer_saved_bytes_per_token

    raw = dict(hidden_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               vocab_size=512, model_type="qwen3_moe", intermediate_size=768, num_experts=16, num_experts_per_tok=8,
               moe_intermediate_size=96)
    moe = shape_from_config(raw)
    for kind, counted, within in (("float32", 62352, 0.02), ("autocast", 60032, 0.02), ("16-bit", 35200, 0.12)):
        assert layer_saved_bytes_per_token(moe, kind) == pytest.approx(counted, rel=within), kind
    # the routed experts' hidden copies make it more than the dense formula at the routed width says
    dense = replace(moe, moe_layers=0, intermediate=8 * 96)
    assert layer_saved_bytes_per_token(moe, "16-bit") > layer_saved_bytes_per_token(dense, "16-bit") + 4 * 8 * 512


@pytest.mark.parametrize("raw", [
    dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=200,
         tie_word_embeddings=False),
    dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=200,
         decoder_sparse_step=2, mlp_only_layers=[0], tie_word_embeddings=False),
    dict(model_type="qwen2_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, intermediate_size=200,
         shared_expert_intermediate_size=56, tie_word_embeddings=False),
    dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=72,
         tie_word_embeddings=False),
    dict(model_type="qwen3", intermediate_size=200, tie_word_embeddings=True),
    dict(model_type="gemma2", intermediate_size=200, tie_word_embeddings=True),
], ids=["qwen3_moe", "qwen3_moe_sparse_step", "qwen2_moe_shared", "mixtral", "qwen3", "gemma2"])
def test_parameter_counts_equal_transformers_models(raw):
    """Total parameters equal the model's own count; active ones equal it with the routed experts scaled by
    experts_per_tok / experts."""
    import torch
    import transformers

    raw = dict(hidden_size=96, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
               vocab_size=300, **raw)
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict())
    assert shape.params == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters()
                 if ".experts." in name or name.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 1  # (transformers 5 writes the latter)
    share = raw.get("num_experts_per_tok", 1) / experts if routed else 1
    assert shape.active_params == sum(p.numel() for p in model.parameters()) - routed + routed * share


# -- impossible inputs: one line each, naming the flag ------------------------------------------------------------

def test_a_lora_rank_wider_than_a_layer_is_refused(capsys):
    err = refused(["--model", "qwen2.5-1.5b", "--gpu-gib", "80", "--lora-rank", "5000"], capsys)
    assert "--lora-rank 5000 is wider than qwen2.5-1.5b's k_proj (1536 -> 256): at most 256" in err
    code, _, _ = run_plan(["--model", "qwen2.5-1.5b", "--gpu-gib", "80", "--lora-rank", "256"], capsys)
    assert code in (0, 1)  # as wide as the narrowest layer: planned
    # leaving the narrow projections out allows more
    code, _, _ = run_plan(["--model", "qwen2.5-1.5b", "--gpu-gib", "80", "--lora-rank", "1024",
                           "--lora-targets", "q_proj,o_proj"], capsys)
    assert code in (0, 1)


def test_responses_longer_than_the_model_s_positions_are_refused(capsys):
    err = refused(["--model", "qwen2.5-1.5b", "--gpu-gib", "80", "--response-len", "200000"], capsys)
    assert "--response-len 200000" in err and "131072 positions" in err and "at most 130048" in err
    err = refused(["--model", "qwen2.5-1.5b", "--gpu-gib", "80", "--prompt-len", "131072"], capsys)
    assert "--prompt-len 131072" in err
    # a preset's responses too (its YAML's rollout.max_new_tokens, or --response-len beside it)
    err = refused(["--preset", "qwen2.5-1.5b_lora_24gb", "--response-len", "140000"], capsys)
    assert "--response-len 140000" in err and "131072 positions" in err


def test_suggested_responses_never_exceed_the_model_s_positions():
    m = replace(load_model_shape("qwen2.5-1.5b"), max_positions=32768)
    inp = PlanInputs(model=m, gpu_gib=24, prompt_len=1024, response_len=31744)
    assert not cheapest_fitting_plan(inp)[1]
    for line in what_would_fit(inp):
        for tokens in re.findall(r"rollout\.max_new_tokens=(\d+)", line):
            assert int(tokens) + inp.prompt_len <= m.max_positions, line


@pytest.mark.parametrize("flag, value", [
    ("--gpu-gib", "-8"), ("--gpus", "-1"), ("--prompt-len", "-5"), ("--response-len", "-1"), ("--group-size", "-2"),
    ("--prompts-per-step", "-1"), ("--micro-batch-groups", "-1"), ("--lora-rank", "-4"),
    ("--gpu-memory-utilization", "-0.1"),
])
def test_negative_sizes_are_refused(flag, value, capsys):
    argv = ["--model", "qwen2.5-1.5b", "--gpu-gib", "80", flag, value]
    assert flag in refused(argv, capsys)


@pytest.mark.parametrize("value", ["inf", "nan", "=-inf"])
def test_gpu_gib_that_is_not_a_finite_size_is_refused(value, capsys):
    gpu_gib = ["--gpu-gib" + value] if value.startswith("=") else ["--gpu-gib", value]  # argparse: -inf is no option
    argv = ["--model", "qwen2.5-1.5b", *gpu_gib]
    assert "--gpu-gib" in refused(argv, capsys)


def test_flags_beside_a_preset_are_applied_never_ignored(capsys):
    base = plan_preset("qwen2.5-1.5b_lora_24gb")
    plan = plan_preset("qwen2.5-1.5b_lora_24gb", dict(gpu_gib=40.0, gpus=2, response_len=2048))
    assert (plan.inputs.gpu_gib, plan.inputs.gpus, plan.inputs.response_len) == (40.0, 2, 2048)
    assert (base.inputs.gpu_gib, base.inputs.gpus, base.inputs.response_len) == (23.5, 1, 16384)
    code, out, _ = run_plan(["--preset", "qwen2.5-1.5b_lora_24gb", "--gpu-gib", "40", "--gpus", "2",
                             "--response-len", "2048"], capsys)
    assert code == 0 and "applied over the preset: --gpu-gib 40.0 --gpus 2 --response-len 2048" in out
    assert "fits 2 x 40 GiB" in out
    # every other flag reaches the plan too
    plan = plan_preset("qwen2.5-1.5b_lora_24gb", dict(lora_rank=8, prompt_len=512, group_size=4,
                                                      gpu_memory_utilization=0.0, compute_dtype="float32"))
    inp = plan.inputs
    assert (inp.lora_rank, inp.prompt_len, inp.group_size, inp.gpu_memory_utilization, inp.compute_dtype) == (
        8, 512, 4, 0.0, "float32")
    # and a flag beside a preset that cannot work is refused in one line
    assert "--gpus" in refused(["--preset", "qwen2.5-1.5b_lora_24gb", "--gpus", "0"], capsys)
    # LoRA targets with no LoRA to apply them to: refused, not ignored (with a preset and without)
    assert "--lora-targets needs" in refused(["--preset", "qwen2.5-1.5b_full_80gb", "--lora-targets", "q_proj"], capsys)
    assert "--lora-targets needs" in refused(["--model", "qwen2.5-1.5b", "--gpu-gib", "80", "--lora-targets", "q_proj"],
                                             capsys)


# -- the blocking term and its lever ------------------------------------------------------------------------------

def test_too_small_a_vllm_share_names_raising_it():
    inp = PlanInputs(model=load_model_shape("qwen2.5-7b"), gpu_gib=40, lora_rank=16, response_len=4096)
    term, lever = blocker(inp)
    assert term.startswith("vLLM's share (0.3 of the GPU") and "less than one full-length row" in term
    assert lever.startswith("raise vLLM's share to 0.4: --gpu-memory-utilization 0.4")
    assert cheapest_fitting_plan(replace(inp, gpu_memory_utilization=0.4))[1]


def test_a_vllm_share_that_crowds_training_out_names_lowering_it(capsys):
    inp = PlanInputs(model=load_model_shape("qwen2.5-1.5b"), gpu_gib=40, response_len=4096,
                     gpu_memory_utilization=0.5)
    term, lever = blocker(inp)
    assert term.startswith("vLLM's share (0.5 of the GPU: 20.0 GiB) beside training's")
    assert lever.startswith("lower vLLM's share to 0.3: --gpu-memory-utilization 0.3")
    assert cheapest_fitting_plan(replace(inp, gpu_memory_utilization=0.3))[1]
    code, out, _ = run_plan(["--model", "qwen2.5-1.5b", "--gpu-gib", "40", "--response-len", "4096",
                             "--gpu-memory-utilization", "0.5"], capsys)
    assert code == 1 and "The lever that removes it: lower vLLM's share to 0.3" in out
    assert "the least any lever set needs" not in out


def test_generation_without_vllm_names_fewer_prompts_per_step():
    inp = PlanInputs(model=load_model_shape("qwen2.5-7b"), gpu_gib=24, lora_rank=16, response_len=8192,
                     gpu_memory_utilization=0.0)
    term, lever = blocker(inp)
    assert term.startswith("generation without vLLM (rollout.engine=hf) holds 256 rows")
    prompts = int(re.search(r"--prompts-per-step (\d+)", lever).group(1))
    assert lever.startswith("fewer prompts per step")
    assert cheapest_fitting_plan(replace(inp, prompts_per_step=prompts))[1]


def test_training_itself_blocking_names_its_largest_part():
    inp = PlanInputs(model=load_model_shape("qwen2.5-7b"), gpu_gib=80, response_len=8192)
    term, lever = blocker(inp)
    assert term.startswith("training needs") and "AdamW state" in term and lever is None
    assert what_would_fit(inp)[0].startswith("LoRA (--lora-rank 16)")


# -- shipped configs by name and hub id ---------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-7B", "qwen2.5-1.5b", "qwen/qwen2.5-1.5b", "Qwen/Qwen3-30B-A3B"])
def test_shipped_configs_plan_by_name_and_hub_id(model, capsys):
    code, out, err = run_plan(["--model", model, "--gpu-gib", "80"], capsys)
    assert code in (0, 1) and not err, err
    assert load_model_shape(model).name == shipped_configs.model_config_path(model).split(os.sep)[-2]


def test_every_shipped_model_config_has_its_hub_id():
    assert set(shipped_configs.HUB_IDS) == set(shipped_configs.model_names())
    for name, hub_id in shipped_configs.HUB_IDS.items():
        assert shipped_configs.model_config_path(hub_id) == shipped_configs.model_config_path(name)


def test_an_unknown_hub_id_is_refused_with_the_shipped_ones(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = refused(["--model", "Qwen/Qwen2.5-14B-No-Such", "--gpu-gib", "80"], capsys)
    assert "--model" in err and "qwen2.5-7b (Qwen/Qwen2.5-7B)" in err


def test_presets_are_found_by_name_and_by_path(capsys):
    by_name = plan_preset("qwen2.5-1.5b_lora_24gb")
    by_path = plan_preset(os.path.join(REPO, "configs", "presets", "qwen2.5-1.5b_lora_24gb.yaml"))
    assert by_name.peak == by_path.peak
    assert set(shipped_configs.preset_names()) >= {"paper_qwen2.5-7b_8x80gb", "qwen2.5-1.5b_lora_24gb"}
    assert "--preset" in refused(["--preset", "no-such-preset"], capsys)


def test_pacs_train_takes_a_shipped_preset_by_name():
    from pacs.config import load_config

    path = os.path.join(REPO, "configs", "presets", "qwen2.5-1.5b_lora_24gb.yaml")
    assert load_config("qwen2.5-1.5b_lora_24gb") == load_config(path)
    assert load_config("qwen2.5-1.5b_lora_24gb.yaml") == load_config(path)
    with pytest.raises(ValueError, match=r"--config: no such file 'no-such-preset' \(nor a shipped preset: paper_"):
        load_config("no-such-preset")
