"""pacs plan (pacs/train/memory_plan/): the arithmetic on known cases, its monotonicity, the presets, the CLI."""

import glob
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from pacs.cli import main
from pacs.config import load_config, validate
from pacs.train.memory_plan import (
    Levers,
    PlanInputs,
    cheapest_fitting_plan,
    config_lines,
    layer_saved_bytes_per_token,
    load_model_shape,
    plan_memory,
    plan_preset,
    shape_from_config,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(p for p in glob.glob(os.path.join(REPO, "configs", "presets", "*.yaml"))
                 if not p.endswith(".plan.yaml"))
GiB = 2**30
MiB = 2**20


def test_parameter_counts_of_the_shipped_configs_are_the_published_ones():
    assert load_model_shape("qwen2.5-1.5b").params == 1_543_714_304
    assert load_model_shape("qwen2.5-7b").params == 7_615_616_512
    # peft's count for rank 16 on all seven projections of Qwen2.5-7B
    assert load_model_shape("qwen2.5-7b").lora_params(16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj")) == 40_370_176


@pytest.mark.parametrize("extra", [dict(model_type="qwen2", tie_word_embeddings=True),
                                   dict(model_type="llama", tie_word_embeddings=False, attention_bias=False)])
def test_parameter_count_equals_transformers_model(extra):
    import torch
    import transformers

    raw = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, head_dim=16, vocab_size=300, **extra)
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape_from_config(raw).params == sum(p.numel() for p in model.parameters())


def inputs(**kw):
    base = dict(model=load_model_shape("qwen2.5-1.5b"), gpu_gib=80, response_len=4096, gpu_memory_utilization=0.3)
    base.update(kw)
    return PlanInputs(**base)


def test_default_loss_chunk_is_the_kernels_default():
    from pacs.train.memory_plan import DEFAULT_LOSS_CHUNK_MIB
    from pacs_kernels.engine.plan import DEFAULT_CHUNK_BUDGET_MIB

    assert DEFAULT_LOSS_CHUNK_MIB == DEFAULT_CHUNK_BUDGET_MIB


def test_raised_loss_chunk_share_is_the_kernels():
    from pacs.train.memory_plan import RAISED_LOSS_CHUNK_SHARE
    from pacs_kernels.engine.device import RAISED_BUDGET_SHARE

    assert RAISED_LOSS_CHUNK_SHARE == RAISED_BUDGET_SHARE


def test_cpu_plan_counts_the_chunk_auto_may_raise_to_and_a_set_chunk_pins_it():
    """On the CPU, with no train.loss_chunk_mib, path="auto" may hold a whole group or every token in one
    chunk (up to 1/8 of the memory): the plan counts that, and a set loss_chunk_mib pins the chunk."""
    from pacs.train.memory_plan import RAISED_LOSS_CHUNK_SHARE, loss_chunk_budget

    key = "fused loss (logits chunk, LM head, hidden states)"
    cpu = inputs(device="cpu", gpu_gib=64, gpu_memory_utilization=0.0, compute_dtype="float32")
    unset, pinned = plan_memory(cpu), plan_memory(cpu, Levers(loss_chunk_mib=256))
    all_logits = unset.micro_batch_tokens * cpu.model.vocab * 4
    assert all_logits > 256 * MiB  # the default chunk would not hold them
    raised = min(RAISED_LOSS_CHUNK_SHARE * 64 * GiB, all_logits)
    assert unset.transient[key] - pinned.transient[key] == pytest.approx(raised - 256 * MiB)
    assert loss_chunk_budget(Levers(), cpu) == RAISED_LOSS_CHUNK_SHARE * 64 * GiB
    small = inputs(device="cpu", gpu_gib=1, gpu_memory_utilization=0.0, compute_dtype="float32")
    assert loss_chunk_budget(Levers(), small) == 256 * MiB  # never below the default
    gpu = inputs()  # CUDA, nothing free known: the default
    assert loss_chunk_budget(Levers(), gpu) == 2048 * MiB


def test_raised_cuda_loss_chunk_share_is_the_kernels():
    from pacs.train.memory_plan import CUDA_FREE_LOSS_CHUNK_SHARE
    from pacs_kernels.engine.device import CUDA_FREE_SHARE

    assert CUDA_FREE_LOSS_CHUNK_SHARE == CUDA_FREE_SHARE


def test_cuda_plan_counts_the_chunk_auto_may_raise_to_from_the_free_memory():
    """On CUDA, with no train.loss_chunk_mib, path="auto" may raise the chunk to hold a whole group, up to a
    quarter of the memory free when the loss runs (pacs_kernels/engine/device.py): the plan counts that most, a
    set loss_chunk_mib pins it, and the raise never makes a plan that fits with the default stop fitting."""
    from pacs.train.memory_plan import CUDA_FREE_LOSS_CHUNK_SHARE

    key = "fused loss (logits chunk, LM head, hidden states)"
    gpu = inputs(gpu_gib=80)
    unset, pinned = plan_memory(gpu), plan_memory(gpu, Levers(loss_chunk_mib=2048))
    all_logits = unset.micro_batch_tokens * gpu.model.vocab * 2  # bf16 logits on CUDA
    assert unset.transient[key] >= pinned.transient[key]
    steady = sum(pinned.components.values())
    beside = pinned.transient[key] - 2048 * MiB * 1.2
    free = 80 * GiB - steady - beside
    chunk = min(max(2048 * MiB, CUDA_FREE_LOSS_CHUNK_SHARE * free), all_logits)
    assert unset.transient[key] == pytest.approx(beside + 1.2 * chunk)
    if pinned.peak <= 80 * GiB:
        assert unset.peak <= 80 * GiB


def test_weights_gradients_and_adamw_bytes_of_a_known_config():
    p = 1_543_714_304
    plan = plan_memory(inputs())
    assert plan.components["weights (master, float32)"] == 4 * p
    assert plan.components["gradients"] == 4 * p
    assert plan.components["AdamW state (2 x float32)"] == 8 * p
    assert plan.components["vLLM engine"] == 0.3 * 80 * GiB
    sharded = plan_memory(inputs(gpus=8))
    assert sharded.components["weights (master, float32, sharded)"] == 4 * p / 8


def test_checkpointing_never_increases_the_activations():
    for name in ("qwen2.5-1.5b", "qwen2.5-7b"):
        for response in (512, 4096, 32768):
            for tiled in (False, True):
                inp = inputs(model=load_model_shape(name), response_len=response)
                plain = plan_memory(inp, Levers(tiled_mlp=tiled))
                ckpt = plan_memory(inp, Levers(tiled_mlp=tiled, gradient_checkpointing=True))
                key = "activations (saved for the backward)"
                assert ckpt.components[key] < plain.components[key]
                assert ckpt.peak <= plain.peak


def test_more_gpus_never_increase_the_sharded_states():
    keys = ("gradients", "AdamW state (2 x float32)")
    previous = None
    for gpus in (1, 2, 4, 8, 16):
        plan = plan_memory(inputs(gpus=gpus))
        states = [plan.components[k] for k in keys] + [v for k, v in plan.components.items() if "master" in k]
        if previous is not None:
            assert all(now <= before for now, before in zip(states, previous))
        previous = states


def test_lora_reduces_optimizer_state_to_the_adapters():
    shape = load_model_shape("qwen2.5-7b")
    plan = plan_memory(inputs(model=shape, lora_rank=16))
    adapters = shape.lora_params(16, PlanInputs.lora_targets)
    assert plan.components["AdamW state (2 x float32)"] == 8 * adapters
    assert plan.components["gradients"] == 4 * adapters
    full = plan_memory(inputs(model=shape))
    assert plan.components["AdamW state (2 x float32)"] < full.components["AdamW state (2 x float32)"] / 100


def test_levers_shrink_what_they_claim_to():
    inp = inputs(response_len=16384)
    none = plan_memory(inp)
    tiled = plan_memory(inp, Levers(tiled_mlp=True))
    offload = plan_memory(inp, Levers(gradient_checkpointing=True, offload_activations=True))
    budget = plan_memory(inp, Levers(max_tokens_per_micro_batch=inp.row_tokens))
    chunk = plan_memory(inp, Levers(loss_chunk_mib=64))
    key = "activations (saved for the backward)"
    assert tiled.components[key] < none.components[key]
    assert offload.components[key] == 0 and offload.host["activations (offloaded)"] > 0
    assert budget.micro_batch_tokens == inp.row_tokens < none.micro_batch_tokens and budget.peak < none.peak
    assert chunk.transient["fused loss (logits chunk, LM head, hidden states)"] < \
        none.transient["fused loss (logits chunk, LM head, hidden states)"]


def test_saved_bytes_formula_on_a_known_layer():
    # float32, hidden 256, 4/2 heads of 64, MLP 768: counted with saved_tensors_hooks on transformers' Qwen2 layer
    shape = shape_from_config(dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=1024, model_type="qwen2"))
    assert layer_saved_bytes_per_token(shape, "float32") == 22552
    assert layer_saved_bytes_per_token(shape, "autocast") == 14872


def test_full_fine_tuning_of_1_5b_does_not_fit_24_gib_and_lora_is_suggested():
    plan, fits = cheapest_fitting_plan(inputs(gpu_gib=24, response_len=16384))
    assert not fits
    result = subprocess.run([sys.executable, "-m", "pacs", "plan", "--model", "qwen2.5-1.5b", "--gpu-gib", "24",
                             "--response-len", "16384"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 1, result.stderr  # the exit code through the real entry point
    suggestions = result.stdout.split("What would fit: ", 1)[1]
    assert "Does not fit" in result.stdout and suggestions.startswith("LoRA (--lora-rank 16); 2 GPUs")


def test_cli_prints_config_lines_that_load(capsys):
    assert main(["plan", "--model", "qwen2.5-1.5b", "--gpu-gib", "80", "--response-len", "16384"]) == 0
    lines = capsys.readouterr().out.split("paste into pacs train):", 1)[1].split()
    cfg = load_config(None, lines)
    validate(cfg)
    assert cfg.rollout.max_new_tokens == 16384


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen2.5-1.5b", "--gpu-gib", "0"], "--gpu-gib must be > 0"),
    (["--model", "no-such-model", "--gpu-gib", "24"], "--model: no config.json"),
    (["--model", "qwen2.5-7b", "--gpu-gib", "24", "--lora-rank", "8", "--lora-targets", "qkv"], "--lora-targets"),
    (["--gpu-gib", "24"], "needs --model and --gpu-gib"),
])
def test_cli_errors_are_one_line_naming_the_argument(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_every_preset_loads_validates_and_fits_its_gpu(path):
    spec_gpus = plan_preset(path).inputs.gpus
    validate(load_config(path), world_size=spec_gpus)
    plan = plan_preset(path)
    assert plan.fits, f"{path}: planned {plan.peak / GiB:.2f} GiB of {plan.inputs.gpu_gib} GiB"
    stated = re.search(r"# planned peak per GPU: ([\d.]+) GiB of ([\d.]+) GiB", open(path).read())
    assert stated, f"{path}: no '# planned peak per GPU' header line"
    assert float(stated.group(1)) == pytest.approx(plan.peak / GiB, abs=0.006)
    assert float(stated.group(2)) == plan.inputs.gpu_gib


def test_cli_plans_a_preset(capsys):
    assert main(["plan", "--preset", PRESETS[0]]) == 0
    assert "fits 8 x 79 GiB" in capsys.readouterr().out


def test_presets_cover_the_issue_s_settings():
    names = {os.path.basename(p) for p in PRESETS}
    assert {"paper_qwen2.5-7b_8x80gb.yaml", "qwen2.5-1.5b_full_80gb.yaml", "qwen2.5-1.5b_lora_24gb.yaml",
            "qwen2.5-7b_lora_24gb.yaml", "qwen2.5-7b_lora_80gb.yaml"} <= names
    paper = load_config(os.path.join(REPO, "configs", "presets", "paper_qwen2.5-7b_8x80gb.yaml"))
    assert (paper.rollout.group_size, paper.optim.lr, paper.rollout.max_new_tokens) == (8, 1e-6, 4096)
    for path in PRESETS:  # the LoRA presets train LoRA in pacs train (model.lora), and are planned as such
        rank = load_config(path).model.lora.rank
        if "_lora_" in os.path.basename(path):
            assert rank > 0 and plan_preset(path).inputs.lora_rank == rank, path
            assert f"model.lora.rank={rank}" in config_lines(plan_preset(path))
        else:
            assert rank == 0 and plan_preset(path).inputs.lora_rank is None, path


def test_what_would_fit_a_7b_on_24_gib_without_room_for_vllm():
    from pacs.train.memory_plan import what_would_fit

    inp = inputs(model=load_model_shape("qwen2.5-7b"), gpu_gib=23.5, response_len=16384)
    assert not cheapest_fitting_plan(inp)[1]
    first = what_would_fit(inp)[0]
    assert first.startswith("LoRA (--lora-rank 16) with rollout.engine=hf")  # vLLM's 30% cannot hold 14 GiB of weights
    assert cheapest_fitting_plan(replace(inp, lora_rank=16, gpu_memory_utilization=0.0, prompts_per_step=1))[1]


def test_more_gpus_fit_where_one_does_not():
    one = replace(inputs(gpu_gib=24, response_len=16384))
    assert not cheapest_fitting_plan(one)[1]
    assert cheapest_fitting_plan(replace(one, gpus=2))[1]


@pytest.mark.slow
def test_planner_within_15_percent_of_measured_peaks():
    from benchmarks.plan_accuracy import run_probe

    for probe in ("none", "ckpt", "bf16_autocast_master_fp32", "lora_bf16_ckpt"):
        row = run_probe(probe, threads=2, timeout=300)
        assert abs(row["error_pct"]) <= 15, row


@pytest.mark.slow
def test_planner_counts_what_the_loss_holds_of_a_wide_lm_head():
    """Under bf16 autocast over float32 weights, a Qwen2.5-sized vocabulary over hidden 256: the fused loss
    holds the head's 16-bit copy, its 16-bit gradient and (CPU) a float32 copy for its GEMMs beside the float32
    gradient; the step (without the exactly counted weights and AdamW state) was planned 22% low before
    loss_head_bytes counted them."""
    from benchmarks.plan_accuracy import run_probe

    row = run_probe("bf16_autocast_wide_head", threads=2, timeout=300)
    step_planned = row["predicted_mib"] - row["state_mib"]
    assert abs(step_planned / row["step_increase_mib"] - 1) <= 0.08, row


@pytest.mark.slow
def test_planner_within_10_percent_of_the_old_policy_pass():
    """The no-grad old-policy pass over 16 rows in one chunk (advanced.train.old_policy_max_tokens): planned from
    a layer's forward, not its saved-for-backward bytes (2.3x too high before)."""
    from benchmarks.plan_accuracy import run_probe

    for probe in ("old_policy_pass", "old_policy_pass_tiled_mlp"):
        row = run_probe(probe, threads=2, timeout=300)
        step_planned = row["predicted_mib"] - row["state_mib"]
        assert abs(step_planned / row["step_increase_mib"] - 1) <= 0.10, row


def test_logprob_chunk_is_the_kernels():
    from pacs.train.memory_plan import LOGPROB_CHUNK_BYTES
    from pacs_kernels.torch_chunked import DEFAULT_CHUNK_ELEMENTS

    assert LOGPROB_CHUNK_BYTES == 4 * DEFAULT_CHUNK_ELEMENTS


def test_preflight_prediction_from_a_loaded_model_config():
    import transformers

    from pacs.train.memory_plan import planned_training_gib

    cfg = load_config(os.path.join(REPO, "configs", "presets", "qwen2.5-1.5b_full_80gb.yaml"))
    config = transformers.AutoConfig.for_model(**{k: v for k, v in load_model_shape_raw("qwen2.5-1.5b").items()
                                                  if k not in ("architectures", "torch_dtype")})
    planned = planned_training_gib(cfg, config, 80, 1)
    plan = plan_preset(os.path.join(REPO, "configs", "presets", "qwen2.5-1.5b_full_80gb.yaml"))
    assert planned == pytest.approx(plan.training_peak / GiB)
    assert planned < plan.peak / GiB - 24  # without vLLM's 30% of 80 GiB
    assert planned_training_gib(cfg, transformers.PretrainedConfig(), 80, 1) is None


def load_model_shape_raw(name):
    import json

    with open(os.path.join(REPO, "configs", "models", name, "config.json")) as fh:
        return json.load(fh)


def test_a_float32_engine_leaves_vllm_less_kv_cache():
    """advanced.rollout.dtype=float32 (LoRA over a bfloat16 base): vLLM's weights and KV cache take 4 bytes."""
    from pacs.train.memory_plan import kv_cache_tokens

    inp = PlanInputs(model=load_model_shape("qwen2.5-1.5b"), gpu_gib=80, gpu_memory_utilization=0.3)
    m, share = inp.model, 0.3 * 80 * GiB
    per_token = m.layers * 2 * m.kv_heads * m.head_dim
    assert kv_cache_tokens(inp) == int((share - 2 * m.params) // (2 * per_token))
    assert kv_cache_tokens(replace(inp, engine_dtype="float32")) == int((share - 4 * m.params) // (4 * per_token))
    with pytest.raises(ValueError, match="engine_dtype must be None, bfloat16, float16 or float32"):
        replace(inp, engine_dtype="fp8").check()
    cfg = load_config(None, ["advanced.rollout.dtype=float32", "model.lora.rank=8"])
    validate(cfg)
    from pacs.train.memory_plan import plan_for_config

    assert plan_for_config(cfg, m, gpu_gib=80).inputs.engine_dtype == "float32"


def test_adamw_state_is_counted_in_the_dtype_of_the_stepped_weights():
    """optim.master_dtype=bfloat16 (16-bit weights stepped directly): torch's AdamW keeps exp_avg and exp_avg_sq
    in the parameters' dtype, 2 x 2 bytes a trainable parameter, not 2 x 4."""
    import torch

    param = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones_like(param)
    optimizer.step()
    assert {optimizer.state[param][k].dtype for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    p = 1_543_714_304
    plan = plan_memory(inputs(master_dtype="bfloat16"))
    assert plan.components["AdamW state (2 x bfloat16)"] == 4 * p
    assert plan.components["gradients"] == 2 * p
    lora = plan_memory(inputs(master_dtype="bfloat16", lora_rank=16))
    adapters = load_model_shape("qwen2.5-1.5b").lora_params(16, PlanInputs.lora_targets)
    assert lora.components["AdamW state (2 x bfloat16)"] == 4 * adapters
    assert "weights (frozen base in the compute dtype, bfloat16 adapters)" in lora.components


def test_the_hf_engine_generates_on_the_policy_on_one_gpu_and_on_a_copy_of_its_own_on_several():
    """rollout.engine=hf: one process samples the policy itself (no second copy, the KV cache in the compute
    dtype); under FSDP each rank's engine holds whole weights (advanced.rollout.dtype's dtype) beside its shard."""
    m = load_model_shape("qwen2.5-7b")
    kv_per_token = m.layers * 2 * m.kv_heads * m.head_dim

    def held(plan):
        return sum(v for k, v in plan.components.items() if k.startswith(("weights", "AdamW", "CUDA")))

    one = plan_memory(inputs(model=m, gpu_gib=23.5, gpu_memory_utilization=0.0, lora_rank=16, prompts_per_step=1))
    assert one.generation_peak == held(one) + 8 * one.inputs.row_tokens * kv_per_token * 2
    for engine_dtype, size in ((None, 2), ("float32", 4)):
        two = plan_memory(inputs(model=m, gpus=2, gpu_memory_utilization=0.0, prompts_per_step=2,
                                 engine_dtype=engine_dtype))
        assert two.generation_peak == held(two) + size * m.params + 8 * two.inputs.row_tokens * kv_per_token * size


def test_fsdp_counts_the_gathered_root_unit():
    """FSDP2 keeps the root unit (embeddings, final norm, LM head) gathered in the compute dtype from the forward
    to the backward (fully_shard does not reshard the root after its forward), beside about two gathered layers;
    a LoRA run's and a float32 run's gathers count too."""
    m = load_model_shape("qwen2.5-7b")
    root = m.params - m.layers * m.layer_params
    for kw, size in (({}, 2), ({"lora_rank": 16}, 2), ({"compute_dtype": "float32"}, 4)):
        plan = plan_memory(inputs(model=m, gpus=8, **kw))
        assert plan.components["weights (compute copy)"] == size * (2 * m.layer_params + root), kw


def test_an_old_policy_pass_in_larger_chunks_than_the_training_micro_batches_is_planned():
    """advanced.train.old_policy_max_tokens above the micro-batch: the no-grad pass's chunk is its own transient
    (a layer's forward or the LM head's copies with the log-prob kernels' chunk, and the chunk's hidden states)."""
    from pacs.train.memory_plan import OLD_POLICY_PASS, plan_for_config

    m = load_model_shape("qwen2.5-1.5b")
    common = ["rollout.max_prompt_len=1024", "rollout.max_new_tokens=8192", "optim.micro_batch_groups=1",
              "model.gradient_checkpointing=true", "train.tiled_mlp=true", "train.max_tokens_per_micro_batch=9216",
              "train.loss_chunk_mib=2048"]  # (pinned: unset, the loss may take a quarter of the free memory)
    plain = plan_for_config(load_config(None, common), m, gpu_gib=79)
    assert not any(name.startswith("old-policy") for name in plain.transient)
    big = plan_for_config(load_config(None, [*common, "advanced.train.old_policy_max_tokens=147456"]), m, gpu_gib=79)
    old = big.transient[OLD_POLICY_PASS]
    assert old > plain.transient["one layer's backward (recomputed)"] and big.phase == "the old-policy pass"
    assert big.peak > plain.peak and "advanced.train.old_policy_max_tokens=147456" in big.levers.config_lines()
    # no larger than the rank's rows of a step: 32 prompts x 8 responses of 9216 tokens
    huge = plan_for_config(load_config(None, [*common, "advanced.train.old_policy_max_tokens=10000000"]), m, gpu_gib=79)
    assert huge.transient[OLD_POLICY_PASS] > old
    from pacs.train.memory_plan import old_policy_tokens

    assert old_policy_tokens(huge.inputs, huge.levers) == 32 * 8 * 9216


def test_autocast_copies_are_a_transient_of_the_forward_under_checkpointing():
    """Without checkpointing the backward keeps every layer's bf16 copy (a component); with it none is saved:
    autocast's cache holds them until the forward ends (a transient of the forward), and the recomputed layer
    makes its own in its backward (measured: plan_accuracy.py's *_wide_layers probes)."""
    from pacs.train.memory_plan import FORWARD_COPIES, layer_forward_bytes

    inp = inputs(gpu_memory_utilization=0.0)
    m = inp.model
    plain, ckpt = plan_memory(inp), plan_memory(inp, Levers(gradient_checkpointing=True))
    assert plain.components["weights (compute copy)"] == 2 * m.layers * m.layer_params
    assert FORWARD_COPIES not in plain.transient
    assert "weights (compute copy)" not in ckpt.components
    assert ckpt.transient[FORWARD_COPIES] == 2 * m.layers * m.layer_params + layer_forward_bytes(
        inp, ckpt.levers, "autocast", ckpt.micro_batch_tokens)
