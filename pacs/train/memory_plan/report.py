"""What ``pacs plan`` prints: the report of a model and run (:func:`report`), the settings that fit
(:func:`config_lines`), and a preset's verdict and header comment."""

from __future__ import annotations

from pacs.model.profile import ModelProfile
from pacs.train.memory_plan.advice import blocker, cheapest_fitting_plan, lever_ladder, what_would_fit
from pacs.train.memory_plan.arithmetic import MemoryPlan, kv_cache_tokens, plan_memory, trainable_params
from pacs.train.memory_plan.coefficients import GiB
from pacs.train.memory_plan.inputs import PlanInputs


def config_lines(plan: MemoryPlan) -> list[str]:
    inp = plan.inputs
    lines = [f"rollout.group_size={inp.group_size}", f"rollout.prompts_per_step={inp.prompts_per_step}",
             f"rollout.max_prompt_len={inp.prompt_len}", f"rollout.max_new_tokens={inp.response_len}",
             f"optim.micro_batch_groups={inp.micro_batch_groups}", f"model.dtype={inp.compute_dtype}",
             f"optim.master_dtype={inp.master_dtype}"]
    if inp.device == "cuda":
        lines.append(f"rollout.gpu_memory_utilization={inp.gpu_memory_utilization:g}")
    if inp.lora_rank:
        every = set(inp.lora_targets) == set(PlanInputs.__dataclass_fields__["lora_targets"].default)
        lines += [f"model.lora.rank={inp.lora_rank}",
                  f"model.lora.target_modules={'all-linear' if every else ','.join(inp.lora_targets)}"]
    return lines + plan.levers.config_lines()


def describe_params(m: ModelProfile) -> str:
    """'7.62B parameters', or for a mixture of experts '30.53B parameters in total, 3.35B active per token'."""
    if not m.moe_layers:
        return f"{m.params / 1e9:.2f}B parameters"
    return (f"{m.params / 1e9:.2f}B parameters in total (weights, gradients and optimizer state), "
            f"{m.active_params / 1e9:.2f}B active per token")


def describe_mlp(m: ModelProfile) -> str:
    if not m.moe_layers:
        return f"MLP {m.intermediate}"
    shared = f" + a shared expert of {m.shared_expert_intermediate}" if m.shared_expert_intermediate else ""
    where = "" if m.moe_layers == m.layers else f" in {m.moe_layers} layers, dense MLP {m.intermediate} in the others"
    return f"{m.experts_per_token} of {m.experts} experts of {m.expert_intermediate}{shared} per token{where}"


def report(inp: PlanInputs) -> tuple[str, bool]:
    """The text ``pacs plan`` prints and whether a lever set fits."""
    plan, fits = cheapest_fitting_plan(inp)
    m = inp.model
    head = (f"{m.name}: {describe_params(m)} ({m.layers} layers, hidden {m.hidden}, {describe_mlp(m)}, "
            f"{m.heads}/{m.kv_heads} heads of {m.head_dim}, vocab {m.vocab}); "
            + (f"LoRA rank {inp.lora_rank} on {','.join(t for t in inp.lora_targets if t in m.projections())}: "
               f"{trainable_params(inp) / 1e6:.1f}M trainable; " if inp.lora_rank else "full fine-tuning; ")
            + f"{inp.gpus} x {inp.gpu_gib:g} GiB; micro-batch {plan.micro_batch_tokens} tokens "
            f"(groups of {inp.group_size} x ({inp.prompt_len} + {inp.response_len}))")
    lines = [head, "", plan.table(), "", "Every lever set, cheapest first (step time):", "",
             "| levers | micro-batch tokens | activations saved | peak GiB | fits |", "|---|---:|---:|---:|---|"]
    for tried in (plan_memory(inp, levers) for levers in lever_ladder(inp)):
        saved = tried.components["activations (saved for the backward)"] / GiB
        lines.append(f"| {tried.levers.describe()} | {tried.micro_batch_tokens} | {saved:.2f} | "
                     f"{tried.peak / GiB:.2f} | {'yes' if tried.fits else 'no'} |")
    lines.append("")
    if plan.generation_peak:
        lines += [f"Generation without vLLM (rollout.engine=hf; {inp.prompts_per_step // inp.gpus * inp.group_size} "
                  f"rows per GPU at once): {plan.generation_peak / GiB:.2f} GiB with the KV cache.", ""]
    kv = kv_cache_tokens(inp)
    if kv is not None:
        rows = kv // inp.row_tokens
        lines.append(f"vLLM ({inp.gpu_memory_utilization:g} of the GPU): its copy of the weights leaves KV cache for "
                     f"about {kv} tokens = {rows} full-length rows at once"
                     + (" -- too little: raise --gpu-memory-utilization or use rollout.engine=hf "
                        "(--gpu-memory-utilization 0)" if rows < 1 else "") + ".")
        lines.append("")
    if fits:
        lines += ["Fits with these settings (paste into pacs train):", "", "    " + " ".join(config_lines(plan))]
    else:
        term, lever = blocker(inp)
        others = what_would_fit(inp)
        lines += [f"Does not fit {inp.gpu_gib:g} GiB: {term}."
                  + (f" The lever that removes it: {lever}." if lever else "")
                  + (f" {'Other changes that' if lever else 'What'} would fit: " + "; ".join(others) + "." if others
                     else "" if lever else " Nothing the planner knows of would fit: a larger GPU.")]
    return "\n".join(lines), fits


def preset_verdict(plan: MemoryPlan) -> str:
    """What ``pacs plan --preset`` says after the table: fits, or what blocks and the lever that removes it (the
    preset's own levers not fitting: the lever set that does)."""
    inp = plan.inputs
    if plan.fits:
        return f"fits {inp.gpus} x {inp.gpu_gib:g} GiB"
    best, fits = cheapest_fitting_plan(inp)
    if fits:
        return (f"does not fit {inp.gpus} x {inp.gpu_gib:g} GiB with its own levers ({plan.peak / GiB:.2f} GiB); "
                f"these fit ({best.peak / GiB:.2f} GiB): {' '.join(best.levers.config_lines())}")
    term, lever = blocker(inp)
    return (f"does not fit {inp.gpus} x {inp.gpu_gib:g} GiB: {term}"
            + (f"; the lever that removes it: {lever}" if lever else ""))


def preset_header(plan: MemoryPlan) -> list[str]:
    """The comment lines a preset carries (configs/presets/*.yaml): the planned peak and its components."""
    inp = plan.inputs
    lines = [f"# planned peak per GPU: {plan.peak / GiB:.2f} GiB of {inp.gpu_gib:g} GiB (at {plan.phase}), "
             f"micro-batches of up to {plan.micro_batch_tokens} tokens"]
    lines += [f"#   {name}: {value / GiB:.2f} GiB" for name, value in plan.components.items()]
    largest = max(plan.transient, key=plan.transient.get)
    lines += [f"#   {name}: {value / GiB:.2f} GiB{' (counted: the larger)' if name == largest else ' (not at once)'}"
              for name, value in plan.transient.items()]
    if plan.generation_peak:
        lines.append(f"#   generation (rollout.engine=hf, KV cache included): {plan.generation_peak / GiB:.2f} GiB")
    return lines
