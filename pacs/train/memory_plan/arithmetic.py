"""The plan's arithmetic: the peak bytes per GPU of one ``pacs train`` update, by component
(:func:`plan_memory`, docs/plan.md derives the formula), and what vLLM's share leaves for its KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from pacs.model.profile import ModelProfile
from pacs.train.memory_plan.coefficients import (
    BACKWARD_LAYERS,
    CUDA_FREE_LOSS_CHUNK_SHARE,
    CUDA_RESERVE_GIB,
    DEFAULT_LOSS_CHUNK_MIB,
    FORWARD_COPIES,
    LOGPROB_CHUNK_BYTES,
    LOSS_CHUNK_COPIES,
    LOSS_HIDDEN_COPIES,
    OLD_POLICY_PASS,
    RAISED_LOSS_CHUNK_SHARE,
    SAVED_BYTES,
    GiB,
    MiB,
)
from pacs.train.memory_plan.inputs import Levers, PlanInputs


@dataclass
class MemoryPlan:
    inputs: PlanInputs
    levers: Levers
    components: dict[str, float]  # bytes per GPU at the peak
    host: dict[str, float] = field(default_factory=dict)  # bytes moved to host memory (offloads)
    micro_batch_tokens: int = 0
    phase: str = ""  # when the peak happens
    transient: dict[str, float] = field(default_factory=dict)  # working memory; only the largest at once

    @property
    def peak(self) -> float:
        return sum(self.components.values()) + max(self.transient.values(), default=0.0)

    @property
    def training_peak(self) -> float:
        """The peak without vLLM's share and the assumed CUDA reserve: what torch's allocator holds at the
        peak (comparable with the preflight's max_memory_allocated)."""
        return self.peak - sum(v for k, v in self.components.items() if k.startswith(("vLLM", "CUDA context")))

    @property
    def capacity(self) -> float:
        return self.inputs.gpu_gib * GiB

    @property
    def generation_peak(self) -> float:
        """Without a colocated vLLM (rollout.engine=hf): each rank generates its rows at once, their KV cache
        beside the weights and AdamW state (gradients are freed by then); on one GPU with the policy itself
        (pacs/rollout/hf.py ``HFGenerateEngine.on_model``), on several with a whole copy of the weights of its
        own (in advanced.rollout.dtype's dtype: the policy's are sharded). 0 with vLLM."""
        inp = self.inputs
        if inp.device != "cuda" or inp.gpu_memory_utilization > 0:
            return 0.0
        m = inp.model
        compute = 2 if inp.compute_dtype == "bfloat16" else 4
        copy_bytes = 0 if inp.gpus == 1 else (4 if (inp.engine_dtype or inp.compute_dtype) == "float32" else 2)
        rows = max(1, inp.prompts_per_step // inp.gpus) * inp.group_size
        kv = rows * inp.row_tokens * m.layers * 2 * m.kv_heads * m.head_dim * (copy_bytes or compute)
        held = sum(v for k, v in self.components.items() if k.startswith(("weights", "AdamW", "CUDA")))
        return held + m.params * copy_bytes + kv

    @property
    def fits(self) -> bool:
        """The peak (and the HF engine's generation) within the GPU, and a colocated vLLM's KV cache holding
        at least one full-length row."""
        kv = kv_cache_tokens(self.inputs)
        return (max(self.peak, self.generation_peak) <= self.capacity
                and (kv is None or kv >= self.inputs.row_tokens))

    def table(self) -> str:
        rows = ["| component | GiB per GPU |", "|---|---:|"]
        rows += [f"| {name} | {value / GiB:.2f} |" for name, value in self.components.items()]
        largest = max(self.transient, key=self.transient.get) if self.transient else None
        rows += [f"| {name}{' (the larger, counted)' if name == largest else ' (not at once with the above)'} | "
                 f"{value / GiB:.2f} |" for name, value in self.transient.items()]
        rows.append(f"| **peak** ({self.phase}) | **{self.peak / GiB:.2f}** of {self.inputs.gpu_gib:g} |")
        rows += [f"| (host memory: {name}) | {value / GiB:.2f} |" for name, value in self.host.items()]
        return "\n".join(rows)


def kv_cache_tokens(inp: PlanInputs) -> int | None:
    """Tokens vLLM's KV cache holds in its share of the GPU after its own copy of the weights (its dtype,
    the compute dtype unless ``engine_dtype``); None without a colocated engine."""
    if inp.device != "cuda" or inp.gpu_memory_utilization <= 0:
        return None
    m = inp.model
    compute = 4 if (inp.engine_dtype or inp.compute_dtype) == "float32" else 2
    per_token = m.layers * 2 * m.kv_heads * m.head_dim * compute
    free = inp.gpu_memory_utilization * inp.gpu_gib * GiB - m.params * compute
    return max(0, int(free // per_token))


def trainable_params(inp: PlanInputs) -> int:
    m = inp.model
    return m.params if inp.lora_rank is None else m.lora_params(inp.lora_rank, inp.lora_targets)


def saved_kind(inp: PlanInputs) -> str:
    if inp.compute_dtype == "float32":
        return "float32"
    return "autocast" if inp.gpus == 1 and inp.master_dtype == "float32" and inp.lora_rank is None else "16-bit"


def layer_saved_bytes_per_token(model: ModelProfile, kind: str) -> float:
    """Bytes one decoder layer saves for the backward per token (no checkpointing): SAVED_BYTES' formula."""
    c = SAVED_BYTES[kind]
    dense = c["mlp"] * model.intermediate if model.moe_layers < model.layers else 0
    moe = (c["mlp"] * model.shared_expert_intermediate
           + c["expert_mlp"] * model.experts_per_token * model.expert_intermediate
           + c["expert_hidden"] * model.experts_per_token * model.hidden + c["expert"] * model.experts
           if model.moe_layers else 0)
    return (c["hidden"] * model.hidden + c["query"] * model.heads * model.head_dim
            + c["key_value"] * model.kv_heads * model.head_dim + max(dense, moe)
            + c["head"] * model.heads + c["token"])


def micro_batch_tokens(inp: PlanInputs, levers: Levers) -> int:
    """Tokens of the largest micro-batch: whole groups of full-length rows, or the token budget's whole rows."""
    group = inp.group_size * inp.row_tokens * inp.micro_batch_groups
    if levers.max_tokens_per_micro_batch is None:
        return group
    return min(group, max(1, levers.max_tokens_per_micro_batch // inp.row_tokens) * inp.row_tokens)


def old_policy_tokens(inp: PlanInputs, levers: Levers) -> int:
    """Tokens of the largest chunk of the no-grad old-policy pass: whole rows within
    ``advanced.train.old_policy_max_tokens`` (at most the rank's rows of a step); unset, the training micro-batch's."""
    if levers.old_policy_max_tokens is None:
        return micro_batch_tokens(inp, levers)
    rank_rows = max(1, inp.prompts_per_step // inp.gpus) * inp.group_size
    return min(rank_rows, max(1, levers.old_policy_max_tokens // inp.row_tokens)) * inp.row_tokens


def loss_chunk_budget(levers: Levers, inp: PlanInputs, free_at_loss: float | None = None) -> float:
    """Bytes the fused loss's logits chunk may take: ``train.loss_chunk_mib`` where set; else the most
    ``path="auto"`` may raise the device's default to (pacs_kernels/engine/plan.py, to hold a group whole): on the
    CPU :data:`RAISED_LOSS_CHUNK_SHARE` of the memory, on CUDA :data:`CUDA_FREE_LOSS_CHUNK_SHARE` of what is free when the loss
    runs (``free_at_loss`` bytes; None: the default alone)."""
    if levers.loss_chunk_mib is not None:
        return levers.loss_chunk_mib * MiB
    default = DEFAULT_LOSS_CHUNK_MIB[inp.device] * MiB
    if inp.device == "cpu":
        return max(default, RAISED_LOSS_CHUNK_SHARE * inp.gpu_gib * GiB)
    return default if free_at_loss is None else max(default, CUDA_FREE_LOSS_CHUNK_SHARE * free_at_loss)


def loss_head_bytes(inp: PlanInputs, kind: str) -> int:
    """Bytes per LM-head parameter the fused loss holds at its peak (measured on the CPU with
    benchmarks/plan_accuracy.py's wide-head probe; on CUDA read off the code): the float32 gradient it
    accumulates (not under LoRA: the head is frozen); that gradient handed back in a 16-bit head's dtype,
    beside the accumulator; under autocast, Policy.forward's 16-bit copy of the float32 head, which the loss
    computes with; on the CPU, the float32 copy of a 16-bit head its GEMMs take (pacs_kernels/matmul.py)."""
    trains, sixteen_bit = inp.lora_rank is None, inp.compute_dtype == "bfloat16"
    return ((4 + (2 if sixteen_bit else 0) if trains else 0) + (2 if kind == "autocast" else 0)
            + (4 if sixteen_bit and inp.device == "cpu" else 0))


def layer_forward_bytes(inp: PlanInputs, levers: Levers, kind: str, tokens: int) -> float:
    """What a decoder layer's forward holds beyond what it saves (no grad, or under checkpointing) over
    ``tokens``: the larger of its MLP (three (tokens, intermediate) tensors in the compute dtype, a tile's with
    train.tiled_mlp, beside four of the residual stream) and its attention (fitted with
    :func:`old_policy_pass_bytes`)."""
    m = inp.model
    compute = 2 if inp.compute_dtype == "bfloat16" else 4
    stream = compute if kind == "16-bit" else 4
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    mlp_tokens = min(m.hidden, tokens) if levers.tiled_mlp else tokens  # train.mlp_tile_tokens' default tile
    mlp = 3 * m.mlp_width * compute * mlp_tokens + 4 * m.hidden * stream * tokens
    attention = (4 * m.hidden * stream + (2 * q + 3 * kv) * compute) * tokens
    return max(mlp, attention)


def old_policy_pass_bytes(inp: PlanInputs, levers: Levers, kind: str, tokens: int) -> float:
    """What the no-grad old-policy pass holds over a chunk of ``tokens`` at its peak: the largest of a decoder
    layer's MLP (three (tokens, intermediate) tensors in the compute dtype, a tile's with train.tiled_mlp, beside
    four of the residual stream), its attention, and the LM head's copies with the log-prob kernels' logits chunk;
    plus the chunk's final hidden states. The coefficients were fitted to benchmarks/plan_accuracy.py's
    old_policy_pass probes (float32, tiled MLP, bf16 autocast, and a wide LM head under bf16; CPU, Qwen2's
    layer)."""
    m = inp.model
    compute = 2 if inp.compute_dtype == "bfloat16" else 4
    stream = compute if kind == "16-bit" else 4
    head_copies = (2 if kind == "autocast" else 0) + (4 if compute == 2 and inp.device == "cpu" else 0)
    head = m.vocab * m.hidden * head_copies + 3 * LOGPROB_CHUNK_BYTES  # the logits, their exp, the entropy's terms
    return max(layer_forward_bytes(inp, levers, kind, tokens), head) + tokens * m.hidden * stream


def plan_memory(inp: PlanInputs, levers: Levers = Levers(), tokens: int | None = None) -> MemoryPlan:
    """The peak bytes per GPU of one ``pacs train`` update with ``levers``, by component. ``tokens``: the
    micro-batch's tokens (default: the worst case, :func:`micro_batch_tokens`); padded rows count rows x
    the longest row."""
    inp.check()
    m = inp.model
    shards = inp.gpus
    compute = 2 if inp.compute_dtype == "bfloat16" else 4
    master = 4 if inp.master_dtype == "float32" else 2
    trainable = trainable_params(inp)
    lora = inp.lora_rank is not None
    on_cpu_states = levers.fsdp_cpu_offload and inp.gpus > 1
    comp: dict[str, float] = {}
    host: dict[str, float] = {}
    # parameters: the master copy (LoRA: the frozen base in the compute dtype, the adapters in float32)
    weights = (m.params * compute + trainable * master) if lora else m.params * master
    label = (f"weights (frozen base in the compute dtype, {inp.master_dtype} adapters)" if lora
             else f"weights (master, {inp.master_dtype})")
    # torch's AdamW keeps its two moments in the dtype of the parameters it steps (the master dtype)
    states = {label[:-1] + (", sharded)" if shards > 1 else ")"): weights / shards,
              "gradients": trainable * master / shards,
              f"AdamW state (2 x {inp.master_dtype})": 2 * trainable * master / shards}
    for name, value in states.items():
        (host if on_cpu_states else comp)[name] = value
    kind = saved_kind(inp)
    # the copies the forward computes with: under autocast (one process, float32 master) every layer's 16-bit
    # copy is cached through the forward and saved for the backward (with checkpointing none is saved: a
    # transient of the forward, below); FSDP2 gathers about two layers at a time, and its root unit (embeddings,
    # final norm, LM head) stays gathered from the forward to the backward (fully_shard does not reshard the
    # root after its forward)
    root = m.params - m.all_layer_params
    autocast_copies = m.all_layer_params * compute if kind == "autocast" else 0
    if shards > 1:
        comp["weights (compute copy)"] = (2 * m.layer_params + root) * compute
    elif autocast_copies and not levers.gradient_checkpointing:
        comp["weights (compute copy)"] = autocast_copies
    tokens = micro_batch_tokens(inp, levers) if tokens is None else tokens
    layer = layer_saved_bytes_per_token(m, kind)
    stream = compute if kind == "16-bit" else 4  # the residual stream: float32 under autocast
    tile = m.hidden  # train.mlp_tile_tokens' default
    mlp_saved = SAVED_BYTES[kind]["mlp"] * m.mlp_width
    per_layer = layer - mlp_saved if levers.tiled_mlp else layer  # tiled: the MLP keeps only its input
    one_layer = per_layer * tokens + (mlp_saved * min(tile, tokens) if levers.tiled_mlp else 0)
    if levers.gradient_checkpointing:  # each layer keeps its input; its backward rebuilds the rest
        saved = m.layers * stream * m.hidden * tokens
        backward = one_layer * (1 + BACKWARD_LAYERS)
    else:
        saved = m.layers * one_layer
        backward = one_layer * BACKWARD_LAYERS
    if levers.offload_activations and inp.device == "cuda":
        host["activations (offloaded)"] = saved
        saved = 0 if levers.gradient_checkpointing else one_layer  # one layer in flight
    comp["activations (saved for the backward)"] = saved
    logit_bytes = 2 if (inp.device == "cuda" and compute == 2) else 4
    beside_chunk = m.vocab * m.hidden * loss_head_bytes(inp, kind) + LOSS_HIDDEN_COPIES * tokens * m.hidden * stream
    if inp.device == "cuda":
        comp["CUDA context, workspaces (assumed)"] = CUDA_RESERVE_GIB * GiB
    if inp.device == "cuda" and inp.gpu_memory_utilization > 0:
        comp["vLLM engine"] = inp.gpu_memory_utilization * inp.gpu_gib * GiB
    # on CUDA the loss may raise its chunk to a share of the memory free then (all but the steady parts and its own)
    free_at_loss = max(inp.gpu_gib * GiB - sum(comp.values()) - beside_chunk, 0.0)
    chunk = min(loss_chunk_budget(levers, inp, free_at_loss), tokens * m.vocab * logit_bytes)
    loss = chunk * LOSS_CHUNK_COPIES["16-bit" if logit_bytes == 2 else "float32"] + beside_chunk
    if autocast_copies and levers.gradient_checkpointing:
        backward += m.layer_params * compute  # the recomputed layer's own 16-bit copy
    transient = {"fused loss (logits chunk, LM head, hidden states)": loss,
                 "one layer's backward" + (" (recomputed)" if levers.gradient_checkpointing else ""): backward}
    if autocast_copies and levers.gradient_checkpointing:  # measured: plan_accuracy.py's *_wide_layers probes
        transient[FORWARD_COPIES] = autocast_copies + layer_forward_bytes(inp, levers, kind, tokens)
    old_tokens = old_policy_tokens(inp, levers)
    if old_tokens > tokens:  # the no-grad old-policy pass in larger chunks than the training micro-batches
        transient[OLD_POLICY_PASS] = old_policy_pass_bytes(inp, levers, kind, old_tokens)
    largest = max(transient, key=transient.get)
    phase = ("the loss" if largest.startswith("fused loss") else "the old-policy pass" if largest.startswith("old")
             else "the forward" if largest == FORWARD_COPIES else "a layer's backward")
    return MemoryPlan(inp, levers, comp, host, tokens, phase, transient)
