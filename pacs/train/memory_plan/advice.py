"""What to change when a plan does not fit: the lever sets from cheapest to dearest (:func:`lever_ladder`), the
first that fits (:func:`cheapest_fitting_plan`), what blocks and the lever that removes it (:func:`blocker`),
and the larger changes that would fit (:func:`what_would_fit`)."""

from __future__ import annotations

from dataclasses import replace

from pacs.train.memory_plan.arithmetic import MemoryPlan, kv_cache_tokens, plan_memory
from pacs.train.memory_plan.coefficients import GiB
from pacs.train.memory_plan.inputs import Levers, PlanInputs


def lever_ladder(inp: PlanInputs) -> list[Levers]:
    """Lever sets from cheapest (in step time) to dearest (no tiled MLP for a mixture of experts: pacs/model/
    tiled_mlp.py tiles token-wise MLPs only)."""
    small_chunk = 256.0 if inp.device == "cuda" else 64.0
    rows_budget = inp.row_tokens  # one full-length row per micro-batch: a group runs in parts
    tiled = not inp.model.moe_layers
    ladder = [Levers(), Levers(loss_chunk_mib=small_chunk),
              Levers(gradient_checkpointing=True, loss_chunk_mib=small_chunk)]
    if tiled:
        ladder.append(Levers(gradient_checkpointing=True, tiled_mlp=True, loss_chunk_mib=small_chunk))
    if inp.device == "cuda":
        ladder.append(Levers(gradient_checkpointing=True, tiled_mlp=tiled, offload_activations=True,
                             loss_chunk_mib=small_chunk))
    last = ladder[-1]
    group = inp.group_size * inp.row_tokens
    budget = group // 2 // inp.row_tokens * inp.row_tokens
    while budget >= rows_budget:
        ladder.append(replace(last, max_tokens_per_micro_batch=budget))
        if budget == rows_budget:
            break
        budget = max(rows_budget, budget // 2 // inp.row_tokens * inp.row_tokens)
    if inp.gpus > 1 and inp.device == "cuda":
        ladder.append(replace(ladder[-1], fsdp_cpu_offload=True))
    return ladder


def cheapest_fitting_plan(inp: PlanInputs) -> tuple[MemoryPlan, bool]:
    """(the first plan of :func:`lever_ladder` that fits, True), or (the one with the lowest peak, False)."""
    plans = [plan_memory(inp, levers) for levers in lever_ladder(inp)]
    for plan in plans:
        if plan.fits:
            return plan, True
    return min(plans, key=lambda p: p.peak), False


def what_would_fit(inp: PlanInputs) -> list[str]:
    """When no lever set fits: the first changes (up to three) that make one fit: LoRA, generating with Hugging
    Face on the policy instead of a colocated vLLM (one prompt per GPU at a time: the policy's KV cache holds
    the rows it generates), more GPUs, shorter responses; [] when none does."""
    engines = [("", lambda c: c)]
    if inp.gpu_memory_utilization > 0:
        engines.append((" with rollout.engine=hf, one prompt per GPU and step (--gpu-memory-utilization 0 "
                        "--prompts-per-step <GPUs>)",
                        lambda c: replace(c, gpu_memory_utilization=0.0, prompts_per_step=c.gpus)))
    candidates = []  # (kind, text, inputs), smallest change of each kind first
    for engine, switch in engines:
        if engine:
            candidates.append(("hf", engine.removeprefix(" with "), switch(inp)))
        if inp.lora_rank is None:
            candidates.append(("lora" + engine, f"LoRA (--lora-rank 16){engine}", switch(replace(inp, lora_rank=16))))
        for gpus in (2, 4, 8, 16):
            if gpus > inp.gpus:
                candidates.append(("gpus" + engine, f"{gpus} GPUs (torchrun --nproc-per-node {gpus}: FSDP2 shards "
                                   f"weights, gradients and AdamW state){engine}", switch(replace(inp, gpus=gpus))))
        response = inp.response_len
        while response > 256:
            response //= 2
            candidates.append(("response" + engine, f"responses of {response} tokens "
                               f"(rollout.max_new_tokens={response}){engine}",
                               switch(replace(inp, response_len=response))))
    out, found = [], set()
    for kind, text, candidate in candidates:
        if kind in found:
            continue
        try:
            plan, fits = cheapest_fitting_plan(candidate)
        except ValueError:  # e.g. LoRA rank 16 wider than a toy model's layers
            continue
        if fits:
            found.add(kind)
            out.append(text + (" and train.fsdp_cpu_offload=true" if plan.levers.fsdp_cpu_offload else ""))
        if len(out) == 3:
            break
    return out


def _lever_fits(inp: PlanInputs, flags: str) -> str | None:
    """``flags`` and the cheapest lever set that then fits, or None when none does."""
    plan, fits = cheapest_fitting_plan(inp)
    return f"{flags}; then {plan.levers.describe()} fits" if fits else None


def blocker(inp: PlanInputs) -> tuple[str, str | None]:
    """When no lever set fits: (what blocks, in words with its GiB; the lever that removes it, or None). The
    blocking term is vLLM's KV cache (its share cannot hold a full-length row beside its copy of the weights),
    vLLM's share itself (training would fit beside a smaller one, or without it), generation without vLLM (its
    rows' KV cache), or training's own peak (then :func:`what_would_fit` says what would). The levers tried:
    vLLM's share (rollout.gpu_memory_utilization, in steps of 0.05), generating with Hugging Face on the policy
    (rollout.engine=hf), fewer prompts per step (a multiple of the GPUs)."""
    plan = min((plan_memory(inp, levers) for levers in lever_ladder(inp)), key=lambda p: p.peak)
    capacity, m, share = plan.capacity, inp.model, inp.gpu_memory_utilization
    shares = [round(0.05 * i, 2) for i in range(1, 20)]

    def fewer_prompts(base: PlanInputs, flags: str) -> str | None:
        for prompts in range(base.prompts_per_step - base.gpus, 0, -base.gpus):
            found = _lever_fits(replace(base, prompts_per_step=prompts), f"{flags}--prompts-per-step {prompts}")
            if found:
                return found
        return None

    def without_vllm() -> str | None:
        hf = replace(inp, gpu_memory_utilization=0.0)
        return (_lever_fits(hf, "generate with Hugging Face on the policy instead of vLLM (rollout.engine=hf): "
                                "--gpu-memory-utilization 0")
                or fewer_prompts(hf, "generate with Hugging Face on the policy instead of vLLM (rollout.engine=hf), "
                                     "fewer rows at once: --gpu-memory-utilization 0 "))

    def other_share(candidates: list[float], verb: str) -> str | None:
        for u in candidates:
            found = _lever_fits(replace(inp, gpu_memory_utilization=u), f"{verb} vLLM's share to {u:g}: "
                                f"--gpu-memory-utilization {u:g}")
            if found:
                return found
        return None

    kv = kv_cache_tokens(inp)
    training = plan.peak - plan.components.get("vLLM engine", 0.0)
    if kv is not None and kv < inp.row_tokens:
        compute = 4 if (inp.engine_dtype or inp.compute_dtype) == "float32" else 2
        return (f"vLLM's share ({share:g} of the GPU: {share * inp.gpu_gib:.1f} GiB) holds its copy of the weights "
                f"({m.params * compute / GiB:.1f} GiB) and KV cache for {kv} tokens, less than one full-length row "
                f"({inp.row_tokens} tokens)"), (other_share([u for u in shares if u > share], "raise")
                                               or without_vllm())
    if kv is not None and training <= capacity:
        return (f"vLLM's share ({share:g} of the GPU: {share * inp.gpu_gib:.1f} GiB) beside training's "
                f"{training / GiB:.1f} GiB at its least ({plan.levers.describe()})"), (
            other_share([u for u in reversed(shares) if u < share], "lower") or without_vllm())
    if plan.generation_peak > capacity and plan.peak <= capacity:
        rows = max(1, inp.prompts_per_step // inp.gpus) * inp.group_size
        return (f"generation without vLLM (rollout.engine=hf) holds {rows} rows of {inp.row_tokens} tokens per GPU "
                f"at once: {plan.generation_peak / GiB:.1f} GiB with their KV cache"), fewer_prompts(
            inp, "fewer prompts per step, so fewer rows generated at once: ")
    largest = max(plan.components, key=plan.components.get)
    return (f"training needs {training / GiB:.1f} GiB at its least ({plan.levers.describe()}), the largest part "
            f"{largest}: {plan.components[largest] / GiB:.1f} GiB"), None
