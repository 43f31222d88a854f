"""``pacs plan``: the peak memory per GPU of a ``pacs train`` run, by component, before any download.

Only the model's ``config.json`` is read (a local Hugging Face model directory, the file itself, or the
name or Hugging Face hub id of one shipped in ``pacs/configs/models/``). :func:`plan_memory` gives one lever set's
:class:`MemoryPlan`; :func:`cheapest_fitting_plan` tries the lever sets from cheapest to dearest and
returns the first that fits, or, when none does, the one with the lowest peak; :func:`what_would_fit`
says what would make one fit.

The formula (docs/plan.md derives it): parameters, gradients and AdamW state from the parameter count
(FSDP2 shards them over the GPUs), the activations a decoder layer saves for the backward per token from
the architecture (coefficients counted on Hugging Face's Qwen2 decoder layer, bytes per token per
element of the hidden size, the query/key-value projections and the MLP), the fused loss's chunk
(``train.loss_chunk_mib``), and the vLLM engine's share of the GPU (``rollout.gpu_memory_utilization``),
which stays allocated while the policy trains.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

from pacs import configs as shipped_configs
from pacs.config import load_config, micro_batch_groups, validate

GiB = 2**30
MiB = 2**20
MODELS_DIR = os.path.join(shipped_configs.root(), "models")  # the shipped model configs (package data)

# bytes a decoder layer saves for the backward, per token, per element of: the hidden size, the query
# projection (heads x head_dim), the key and value projections together (per element of kv heads x
# head_dim), the MLP's
# intermediate size; plus per attention head (the softmax's float32 log-sum-exp) and a constant (the two
# RMSNorms' float32 inverse RMS). Counted with saved_tensors_hooks on transformers' Qwen2 decoder layer
# (docs/plan.md), for the three ways the trainer computes:
# A mixture-of-experts layer (transformers 5's Qwen3-MoE experts loop) saves, per token, its routed experts' MLP
# (expert_mlp per element of experts_per_token x moe_intermediate_size), a copy of the token's hidden state in and
# out of each routed expert (expert_hidden per element of experts_per_token x hidden) and the router's float32
# probabilities (expert, per expert); counted the same way on Qwen3-MoE layers of hidden 256 and 512 with 2 and 8
# of 16 experts (the marginal bytes per token between 512 and 1,024 tokens: docs/plan.md).
SAVED_BYTES = {
    # float32 parameters, float32 compute (the CPU's default)
    "float32": dict(hidden=24, query=12, key_value=8, mlp=16, head=4, token=8, expert_mlp=16, expert_hidden=8,
                    expert=4),
    # float32 master parameters under bf16 autocast (one process): the residual stream stays float32
    "autocast": dict(hidden=26, query=6, key_value=4, mlp=8, head=4, token=8, expert_mlp=15, expert_hidden=8,
                     expert=4),
    # 16-bit parameters in the forward (FSDP2's MixedPrecisionPolicy all-gathers bf16 copies)
    "16-bit": dict(hidden=16, query=6, key_value=4, mlp=8, head=4, token=8, expert_mlp=8, expert_hidden=4, expert=4),
}
# working memory on top of the saved tensors, calibrated against measured peaks (benchmarks/plan_accuracy.py).
# Only the larger of the two is held at once (the loss runs before the backward):
#   * a layer's backward: the gradients of its inputs and transients, in units of the layer's saved bytes
#     (with checkpointing, on top of the recomputed layer itself);
#   * the fused loss: its logits chunk (x LOSS_CHUNK_COPIES: a 16-bit GEMM's output before its float32
#     copy), what it holds of the LM head (loss_head_bytes), and LOSS_HIDDEN_COPIES copies of the (T, hidden)
#     states
BACKWARD_LAYERS = 0.5
LOSS_CHUNK_COPIES = {"float32": 1.0, "16-bit": 1.2}
LOSS_HIDDEN_COPIES = 10
# the no-grad old-policy pass's log-prob kernels hold this much of the logits at once: the torch backend's
# pacs_kernels.torch_chunked.DEFAULT_CHUNK_ELEMENTS float32 logits (a test keeps them equal; the Triton kernels less)
LOGPROB_CHUNK_BYTES = 4 * (1 << 22)
OLD_POLICY_PASS = "old-policy pass (no grad)"
FORWARD_COPIES = "forward (every layer's 16-bit copy, cached by autocast until its end)"
# CUDA's context, cuBLAS/NCCL workspaces and the caching allocator's slack: assumed (not measured here)
CUDA_RESERVE_GIB = 1.0
# pacs_kernels.single_pass.DEFAULT_CHUNK_BUDGET_MIB (a test keeps them equal; this module imports no torch)
DEFAULT_LOSS_CHUNK_MIB = {"cuda": 2048.0, "cpu": 256.0}
# pacs_kernels.path_choice.RAISED_BUDGET_SHARE (a test keeps them equal): on the CPU, with no
# train.loss_chunk_mib, path="auto" may raise the chunk to hold a whole group or every token, up to this
# share of the memory; the plan counts that most (setting train.loss_chunk_mib pins the chunk)
RAISED_LOSS_CHUNK_SHARE = 1 / 8


@dataclass(frozen=True)
class ModelShape:
    """What the planner reads from a config.json. A mixture-of-experts model (``experts`` > 0) has
    ``moe_layers`` layers whose MLP is ``experts`` routed experts of width ``expert_intermediate`` (each token
    goes through ``experts_per_token`` of them), a router, and an optional always-on shared expert; its other
    layers are dense MLPs of width ``intermediate``. Weights, gradients and optimizer state take every expert
    (:attr:`params`); a token's activations take the experts it is routed to (:attr:`mlp_width`)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False
    qk_norm: bool = False  # an RMSNorm of head_dim on the queries and one on the keys (Qwen3, Gemma 3)
    norms_per_layer: int = 2  # RMSNorms of the hidden size per layer (Gemma 2 and 3: 4)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0  # Qwen2-MoE's always-on expert, with its own sigmoid gate
    moe_layers: int = 0
    max_positions: int | None = None  # max_position_embeddings: the longest sequence the model takes

    @property
    def attention_params(self) -> int:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.o_bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0) + self.norms_per_layer * d)

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + 3 * self.hidden * self.intermediate

    def moe_layer_params(self, active: bool = False) -> int:
        """A mixture-of-experts layer: every expert (``active``: a token's ``experts_per_token``), the router
        and the shared expert."""
        d = self.hidden
        shared = 3 * d * self.shared_expert_intermediate + (d if self.shared_expert_intermediate else 0)
        routed = (self.experts_per_token if active else self.experts) * 3 * d * self.expert_intermediate
        return self.attention_params + d * self.experts + shared + routed

    @property
    def layer_params(self) -> int:
        """The largest layer's parameters (FSDP2 gathers a layer at a time; checkpointing recomputes one)."""
        return max(self.moe_layer_params() if self.moe_layers else 0,
                   self.dense_layer_params if self.moe_layers < self.layers else 0)

    @property
    def all_layer_params(self) -> int:
        return (self.layers - self.moe_layers) * self.dense_layer_params + self.moe_layers * self.moe_layer_params()

    @property
    def params(self) -> int:
        """Every parameter (all experts): what weights, gradients and optimizer state are sized by."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.all_layer_params + self.hidden

    @property
    def active_params(self) -> int:
        """The parameters one token goes through (a mixture of experts: its routed experts only)."""
        return self.params - self.moe_layers * (self.moe_layer_params() - self.moe_layer_params(active=True))

    @property
    def mlp_width(self) -> int:
        """A token's MLP width in its widest layer: what its activations are sized by (a mixture-of-experts
        layer: the experts it is routed to, and the shared expert)."""
        moe = self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate
        return max(moe if self.moe_layers else 0, self.intermediate if self.moe_layers < self.layers else 0)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear projection LoRA can adapt; a mixture of experts' MLP projections are those of
        its dense layers and shared expert (its routed experts are 3-D parameters, no linear modules)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
        widths = self._mlp_linear_widths()
        if widths:
            width = min(widths)
            out.update(gate_proj=(d, width), up_proj=(d, width), down_proj=(width, d))
        return out

    def _mlp_linear_widths(self) -> list[int]:
        """The widths of the linear MLPs, one per layer that has one."""
        return ([self.intermediate] * (self.layers - self.moe_layers)
                + [self.shared_expert_intermediate] * (self.moe_layers if self.shared_expert_intermediate else 0))

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters: rank x (in + out) per targeted projection and layer."""
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        unknown = [t for t in targets if t not in names]
        if unknown:
            raise ValueError(f"--lora-targets: unknown module(s) {', '.join(unknown)}; expected some of "
                             f"{', '.join(names)}")
        d = self.hidden
        shapes = self.projections()
        attention = sum(rank * sum(shapes[t]) for t in targets if t in ("q_proj", "k_proj", "v_proj", "o_proj"))
        mlp = sum(rank * (d + width) for t in targets if t in ("gate_proj", "up_proj", "down_proj")
                  for width in self._mlp_linear_widths())
        return self.layers * attention + mlp

    def narrowest_projection(self, targets: tuple[str, ...]) -> tuple[str, int, int] | None:
        """(name, in, out) of the targeted projection whose smaller side is the smallest; None if none exists."""
        found = [(name, a, b) for name, (a, b) in self.projections().items() if name in targets]
        return min(found, key=lambda p: min(p[1], p[2]), default=None)


def load_model_shape(model: str) -> ModelShape:
    """``model``: a directory holding config.json, a config.json path, or a shipped model config
    (pacs/configs/models/) by name (``qwen2.5-7b``) or by its Hugging Face hub id (``Qwen/Qwen2.5-7B``); another hub
    id is read from the local Hugging Face cache when its config.json is there (nothing is downloaded)."""
    candidates = [model, os.path.join(model, "config.json"), shipped_configs.model_config_path(model)]
    path = next((p for p in candidates if p and os.path.isfile(p)), None) or _cached_hub_config(model)
    if path is None:
        shipped = ", ".join(f"{name} ({shipped_configs.HUB_IDS[name]})" if name in shipped_configs.HUB_IDS else name
                            for name in shipped_configs.model_names())
        raise ValueError(f"--model: no config.json at {model!r}; expected a model directory, a config.json, or a "
                         f"shipped config by name or hub id: {shipped or 'none shipped'}")
    with open(path) as fh:
        cfg = json.load(fh)
    in_cache = path not in candidates  # the cache's folder is a snapshot hash: name it by its hub id
    return shape_from_config(cfg, name=model if in_cache else os.path.basename(os.path.dirname(os.path.abspath(path))))


def _cached_hub_config(model: str) -> str | None:
    """config.json of hub id ``model`` in the local Hugging Face cache, if huggingface_hub is installed and it is
    there (never a download)."""
    if model.count("/") != 1 or os.path.exists(model):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # an id the hub's validation refuses: not a hub id
        return None
    return found if isinstance(found, str) else None


def shape_from_config(cfg: dict, name: str = "model") -> ModelShape:
    """The planner's view of a Hugging Face config.json (a multimodal one's ``text_config``): dense decoders
    (Qwen2/2.5/3, Llama, Gemma 2/3, Mistral...) and mixtures of experts in Qwen2-MoE / Qwen3-MoE's fields
    (``num_experts``, ``moe_intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers``) or Mixtral's
    (``num_local_experts``: every layer, experts of ``intermediate_size``)."""
    cfg = cfg.get("text_config", cfg)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"--model: config.json lacks {', '.join(missing)} (a decoder-only causal LM config expected)")
    latent = [k for k in ("kv_lora_rank", "q_lora_rank", "n_routed_experts") if cfg.get(k)]
    if latent:  # DeepSeek's multi-head latent attention and expert layout
        raise ValueError(f"--model: config.json sets {', '.join(latent)} (DeepSeek's latent attention or experts), "
                         "which the planner does not count; expected a Qwen2/Qwen3/Llama/Gemma/Mixtral-style config")
    heads = cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    model_type = cfg.get("model_type", "")
    attention_bias = bool(cfg.get("attention_bias", False))
    moe = dict(experts=0, experts_per_token=0, expert_intermediate=0, shared_expert_intermediate=0, moe_layers=0)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes Qwen-MoE's as the latter
    if experts:  # Mixtral: every layer, experts of intermediate_size; Qwen-MoE: moe_intermediate_size, dense layers
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        moe.update(experts=experts, experts_per_token=cfg.get("num_experts_per_tok") or 1,
                   expert_intermediate=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                   shared_expert_intermediate=cfg.get("shared_expert_intermediate_size") or 0,
                   moe_layers=sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0))
    positions = cfg.get("max_position_embeddings")
    return ModelShape(name=name, hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
                      layers=layers, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                      head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
                      tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                      qkv_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and cfg.get("qkv_bias", True))
                                or attention_bias),
                      o_bias=attention_bias, qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
                      norms_per_layer=4 if model_type.startswith(("gemma2", "gemma3")) else 2,
                      max_positions=int(positions) if isinstance(positions, int) and positions > 0 else None, **moe)


def check_positions(m: ModelShape, prompt_len: int, response_len: int) -> None:
    """A prompt and its response within the model's positions (max_position_embeddings), or one line naming
    --response-len (--prompt-len when the prompt alone takes them all)."""
    if m.max_positions is None or prompt_len + response_len <= m.max_positions:
        return
    if prompt_len >= m.max_positions:
        raise ValueError(f"--prompt-len {prompt_len} (rollout.max_prompt_len) leaves no room for a response in "
                         f"{m.name}'s {m.max_positions} positions (max_position_embeddings)")
    raise ValueError(f"--response-len {response_len} (rollout.max_new_tokens) + --prompt-len {prompt_len} exceed "
                     f"{m.name}'s {m.max_positions} positions (max_position_embeddings): at most "
                     f"{m.max_positions - prompt_len}")


@dataclass(frozen=True)
class Levers:
    """One set of the trainer's memory settings (their ``pacs train`` keys: :meth:`config_lines`)."""

    gradient_checkpointing: bool = False
    tiled_mlp: bool = False
    offload_activations: bool = False
    packing: bool = True
    max_tokens_per_micro_batch: int | None = None  # None: one micro-batch = micro_batch_groups whole groups
    loss_chunk_mib: float | None = None  # None: the device's default
    fsdp_cpu_offload: bool = False
    old_policy_max_tokens: int | None = None  # advanced.train.old_policy_max_tokens; None: the training micro-batches

    def describe(self) -> str:
        """A short name of the lever set, e.g. 'checkpointing + tiled MLP + loss chunk 256 MiB'."""
        names = [name for name, on in (("checkpointing", self.gradient_checkpointing), ("tiled MLP", self.tiled_mlp),
                                       ("activation offload", self.offload_activations),
                                       ("padded rows", not self.packing), ("FSDP CPU offload", self.fsdp_cpu_offload))
                 if on]
        if self.max_tokens_per_micro_batch is not None:
            names.append(f"{self.max_tokens_per_micro_batch} tokens a micro-batch")
        if self.loss_chunk_mib is not None:
            names.append(f"loss chunk {self.loss_chunk_mib:g} MiB")
        if self.old_policy_max_tokens is not None:
            names.append(f"old-policy pass in {self.old_policy_max_tokens} tokens")
        return " + ".join(names) or "none"

    def config_lines(self) -> list[str]:
        lines = [f"model.gradient_checkpointing={str(self.gradient_checkpointing).lower()}",
                 f"train.tiled_mlp={str(self.tiled_mlp).lower()}",
                 f"train.offload_activations={str(self.offload_activations).lower()}"]
        if not self.packing:
            lines.append("train.packing=false")
        if self.max_tokens_per_micro_batch is not None:
            lines.append(f"train.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}")
        if self.loss_chunk_mib is not None:
            lines.append(f"train.loss_chunk_mib={self.loss_chunk_mib:g}")
        if self.fsdp_cpu_offload:
            lines.append("train.fsdp_cpu_offload=true")
        if self.old_policy_max_tokens is not None:
            lines.append(f"advanced.train.old_policy_max_tokens={self.old_policy_max_tokens}")
        return lines


@dataclass(frozen=True)
class PlanInputs:
    model: ModelShape
    gpu_gib: float
    gpus: int = 1
    prompt_len: int = 1024
    response_len: int = 8192
    group_size: int = 8
    prompts_per_step: int = 32
    micro_batch_groups: int = 1
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    compute_dtype: str = "bfloat16"  # bfloat16 | float32
    master_dtype: str = "float32"
    gpu_memory_utilization: float = 0.3  # vLLM's share, held during training; 0: no colocated engine
    engine_dtype: str | None = None  # the engine's weights (rollout.dtype); None: the compute dtype
    device: str = "cuda"  # cuda | cpu (the CPU: host memory is device memory; offload moves nothing)

    def check(self) -> None:
        for name in ("gpu_gib", "gpus", "prompt_len", "response_len", "prompts_per_step", "micro_batch_groups"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")
        if not math.isfinite(self.gpu_gib):
            raise ValueError(f"--gpu-gib must be a finite number of GiB, got {self.gpu_gib!r}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2, got {self.group_size}")
        m = self.model
        check_positions(m, self.prompt_len, self.response_len)
        if self.lora_rank is not None:
            if self.lora_rank < 1:
                raise ValueError(f"--lora-rank must be a positive integer, got {self.lora_rank}")
            m.lora_params(self.lora_rank, self.lora_targets)  # unknown names: one line naming --lora-targets
            narrowest = m.narrowest_projection(self.lora_targets)
            if narrowest is None:
                raise ValueError(f"--lora-targets: {m.name} has none of {','.join(self.lora_targets)} as a linear "
                                 f"layer (expected some of {', '.join(m.projections())})")
            name, fan_in, fan_out = narrowest
            if self.lora_rank > min(fan_in, fan_out):
                raise ValueError(f"--lora-rank {self.lora_rank} is wider than {m.name}'s {name} ({fan_in} -> "
                                 f"{fan_out}): at most {min(fan_in, fan_out)} (or leave {name} out of --lora-targets)")
        if not 0 <= self.gpu_memory_utilization < 1:
            raise ValueError(f"--gpu-memory-utilization must be in [0, 1), got {self.gpu_memory_utilization}")
        if self.engine_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"engine_dtype must be None, bfloat16, float16 or float32, got {self.engine_dtype!r}")
        for name in ("compute_dtype", "master_dtype"):
            if getattr(self, name) not in ("bfloat16", "float32"):
                raise ValueError(f"--{name.replace('_', '-')} must be bfloat16 or float32, got {getattr(self, name)!r}")

    @property
    def row_tokens(self) -> int:
        return self.prompt_len + self.response_len


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


def _trainable_params(inp: PlanInputs) -> int:
    m = inp.model
    return m.params if inp.lora_rank is None else m.lora_params(inp.lora_rank, inp.lora_targets)


def _saved_kind(inp: PlanInputs) -> str:
    if inp.compute_dtype == "float32":
        return "float32"
    return "autocast" if inp.gpus == 1 and inp.master_dtype == "float32" and inp.lora_rank is None else "16-bit"


def layer_saved_bytes_per_token(model: ModelShape, kind: str) -> float:
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


def loss_chunk_budget(levers: Levers, inp: PlanInputs) -> float:
    """Bytes the fused loss's logits chunk may take: ``train.loss_chunk_mib`` where set; else the device's
    default, or on the CPU the most ``path="auto"`` may raise it to (:data:`RAISED_LOSS_CHUNK_SHARE`)."""
    if levers.loss_chunk_mib is not None:
        return levers.loss_chunk_mib * MiB
    default = DEFAULT_LOSS_CHUNK_MIB[inp.device] * MiB
    return max(default, RAISED_LOSS_CHUNK_SHARE * inp.gpu_gib * GiB) if inp.device == "cpu" else default


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
    trainable = _trainable_params(inp)
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
    kind = _saved_kind(inp)
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
    chunk = min(loss_chunk_budget(levers, inp), tokens * m.vocab * logit_bytes)
    loss = (chunk * LOSS_CHUNK_COPIES["16-bit" if logit_bytes == 2 else "float32"]
            + m.vocab * m.hidden * loss_head_bytes(inp, kind) + LOSS_HIDDEN_COPIES * tokens * m.hidden * stream)
    if autocast_copies and levers.gradient_checkpointing:
        backward += m.layer_params * compute  # the recomputed layer's own 16-bit copy
    transient = {"fused loss (logits chunk, LM head, hidden states)": loss,
                 "one layer's backward" + (" (recomputed)" if levers.gradient_checkpointing else ""): backward}
    if autocast_copies and levers.gradient_checkpointing:  # measured: plan_accuracy.py's *_wide_layers probes
        transient[FORWARD_COPIES] = autocast_copies + layer_forward_bytes(inp, levers, kind, tokens)
    old_tokens = old_policy_tokens(inp, levers)
    if old_tokens > tokens:  # the no-grad old-policy pass in larger chunks than the training micro-batches
        transient[OLD_POLICY_PASS] = old_policy_pass_bytes(inp, levers, kind, old_tokens)
    if inp.device == "cuda":
        comp["CUDA context, workspaces (assumed)"] = CUDA_RESERVE_GIB * GiB
    if inp.device == "cuda" and inp.gpu_memory_utilization > 0:
        comp["vLLM engine"] = inp.gpu_memory_utilization * inp.gpu_gib * GiB
    largest = max(transient, key=transient.get)
    phase = ("the loss" if largest.startswith("fused loss") else "the old-policy pass" if largest.startswith("old")
             else "the forward" if largest == FORWARD_COPIES else "a layer's backward")
    return MemoryPlan(inp, levers, comp, host, tokens, phase, transient)


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


def plan_for_config(cfg, model: ModelShape, gpu_gib: float, gpus: int = 1, lora_rank: int | None = None,
                    lora_targets: tuple[str, ...] | None = None, device: str = "cuda") -> MemoryPlan:
    """The plan of a ``pacs train`` config (pacs.config.Config) exactly as set: its lengths, group size,
    micro-batches, precision, vLLM share and memory levers (what the trainer's preflight could print)."""
    r, tr = cfg.rollout, cfg.train
    if lora_rank is None and cfg.model.lora.rank > 0:  # model.lora.*: all-linear = every projection
        lora_rank = cfg.model.lora.rank
        names = tuple(name.strip() for name in cfg.model.lora.target_modules.split(",") if name.strip())
        lora_targets = lora_targets or (None if names == ("all-linear",) else names)
    compute = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    engine_share = 0.0 if r.engine == "hf" else r.gpu_memory_utilization
    inp = PlanInputs(model=model, gpu_gib=gpu_gib, gpus=gpus, prompt_len=r.max_prompt_len,
                     response_len=r.max_new_tokens, group_size=r.group_size, prompts_per_step=r.prompts_per_step,
                     micro_batch_groups=micro_batch_groups(cfg), lora_rank=lora_rank,
                     **({"lora_targets": tuple(lora_targets)} if lora_targets else {}), compute_dtype=compute,
                     master_dtype=cfg.optim.master_dtype, gpu_memory_utilization=engine_share, device=device,
                     engine_dtype=None if r.dtype == "auto" else r.dtype)
    levers = Levers(gradient_checkpointing=cfg.model.gradient_checkpointing, tiled_mlp=tr.tiled_mlp,
                    offload_activations=tr.offload_activations, packing=tr.packing is not False,
                    max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch, loss_chunk_mib=tr.loss_chunk_mib,
                    fsdp_cpu_offload=tr.fsdp_cpu_offload, old_policy_max_tokens=tr.old_policy_max_tokens)
    return plan_memory(inp, levers)


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


def describe_params(m: ModelShape) -> str:
    """'7.62B parameters', or for a mixture of experts '30.53B parameters in total, 3.35B active per token'."""
    if not m.moe_layers:
        return f"{m.params / 1e9:.2f}B parameters"
    return (f"{m.params / 1e9:.2f}B parameters in total (weights, gradients and optimizer state), "
            f"{m.active_params / 1e9:.2f}B active per token")


def describe_mlp(m: ModelShape) -> str:
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
               f"{_trainable_params(inp) / 1e6:.1f}M trainable; " if inp.lora_rank else "full fine-tuning; ")
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


# pacs plan's flags that --preset applies over the preset: the .plan.yaml's inputs, and the YAML's settings
PRESET_PLAN_FLAGS = ("model", "gpu_gib", "gpus")
PRESET_CONFIG_FLAGS = {"prompt_len": "rollout.max_prompt_len", "response_len": "rollout.max_new_tokens",
                       "group_size": "rollout.group_size", "prompts_per_step": "rollout.prompts_per_step",
                       "micro_batch_groups": "optim.micro_batch_groups", "lora_rank": "model.lora.rank",
                       "lora_targets": "model.lora.target_modules", "compute_dtype": "model.dtype",
                       "master_dtype": "optim.master_dtype",
                       "gpu_memory_utilization": "rollout.gpu_memory_utilization"}


def find_preset(preset: str) -> str:
    """The YAML of ``preset``: a path, or the name of one shipped in pacs/configs/presets/ (with or without .yaml)."""
    if os.path.isfile(preset):
        return preset
    shipped = shipped_configs.preset_path(os.path.basename(preset)) if not os.path.dirname(preset) else None
    if shipped is None:
        raise ValueError(f"--preset: no file {preset!r}; expected a preset YAML or a shipped preset's name: "
                         f"{', '.join(shipped_configs.preset_names()) or 'none shipped'}")
    return shipped


def plan_preset(path: str, flags: dict | None = None) -> MemoryPlan:
    """Plan a preset: ``path`` is a ``pacs train`` YAML (or a shipped preset's name); its sibling
    ``<name>.plan.yaml`` holds what the YAML cannot say: ``model`` (a config.json, model directory or shipped
    name), ``gpu_gib``, ``gpus`` (and ``lora_rank`` / ``lora_targets`` to plan LoRA the YAML does not set; the
    YAML's ``model.lora`` is read). ``flags``: pacs plan's flags given beside --preset, by their dest
    (``gpu_gib``, ``response_len``...), applied over the .plan.yaml (:data:`PRESET_PLAN_FLAGS`) and the YAML
    (:data:`PRESET_CONFIG_FLAGS`: each sets the ``pacs train`` key a run would take)."""
    import yaml

    path = find_preset(path)
    flags = dict(flags or {})
    unknown_flags = sorted(set(flags) - set(PRESET_PLAN_FLAGS) - set(PRESET_CONFIG_FLAGS))
    if unknown_flags:
        raise ValueError(f"--preset: cannot apply {', '.join('--' + f.replace('_', '-') for f in unknown_flags)}")
    stem = path[:-len(".yaml")] if path.endswith(".yaml") else path
    sidecar = stem + ".plan.yaml"
    if not os.path.isfile(sidecar):
        raise ValueError(f"--preset: no {sidecar} beside {path} (the planner's inputs: model, gpu_gib, gpus)")
    with open(sidecar) as fh:
        spec = yaml.safe_load(fh) or {}
    known = {"model", "gpu_gib", "gpus", "lora_rank", "lora_targets"}
    unknown = sorted(set(spec) - known)
    if unknown or "model" not in spec or "gpu_gib" not in spec:
        raise ValueError(f"{sidecar}: expected keys model, gpu_gib (and optionally gpus, lora_rank, lora_targets); "
                         f"got {', '.join(sorted(spec)) or 'none'}")
    beside = os.path.join(os.path.dirname(sidecar), str(spec["model"]))  # a model path relative to the preset
    if not os.path.isabs(str(spec["model"])) and os.path.exists(beside):
        spec["model"] = beside
    spec.update({name: flags[name] for name in PRESET_PLAN_FLAGS if name in flags})
    cfg = load_config(path)
    for name, key in PRESET_CONFIG_FLAGS.items():
        if name not in flags:
            continue
        value = flags[name]
        if name == "gpu_memory_utilization":  # 0: no colocated vLLM, i.e. Hugging Face generate on the policy
            if value == 0:
                cfg.rollout.engine = "hf"
                continue
            if cfg.rollout.engine == "hf":
                cfg.rollout.engine = "vllm"
        if name == "micro_batch_groups":
            cfg.optim.micro_batch_responses = None
        if name == "lora_rank":  # the YAML's LoRA replaced: the .plan.yaml's LoRA inputs no longer apply
            spec.pop("lora_rank", None)
        section, _, field_name = key.rpartition(".")
        owner = cfg
        for part in section.split("."):
            owner = getattr(owner, part)
        setattr(owner, field_name, value)
    if "lora_targets" in flags and cfg.model.lora.rank == 0 and not spec.get("lora_rank"):
        raise ValueError("--lora-targets needs LoRA: --lora-rank, or a preset that sets model.lora.rank")
    gpus = spec.get("gpus", 1)
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {gpus!r}")
    try:
        gpu_gib = float(spec["gpu_gib"])
    except (TypeError, ValueError):
        raise ValueError(f"--gpu-gib must be a number of GiB, got {spec['gpu_gib']!r}") from None
    model = load_model_shape(str(spec["model"]))
    if cfg.rollout.max_prompt_len is not None:  # before validate's micro-batch checks: the model's limit first
        check_positions(model, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens)
    validate(cfg, world_size=gpus)
    return plan_for_config(cfg, model, gpu_gib, gpus, spec.get("lora_rank"), spec.get("lora_targets"))


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


def planned_training_gib(cfg, model_config, gpu_gib: float, gpus: int) -> float | None:
    """The planned training peak (GiB, :attr:`MemoryPlan.training_peak`) of ``cfg`` for a loaded model's
    Hugging Face config, or None when its config is not one the planner reads (the preflight prints it
    beside the measured peak when it can)."""
    try:
        shape = shape_from_config(model_config.to_dict(), name=getattr(model_config, "model_type", "model"))
        return plan_for_config(cfg, shape, gpu_gib, gpus).training_peak / GiB
    except (ValueError, KeyError, TypeError):
        return None
