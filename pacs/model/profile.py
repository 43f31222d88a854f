"""What the trainer, the planner, the exporter and the rollout engines know of a model's architecture, read in one
place from its Hugging Face configuration (``config.json``'s dict, or a transformers ``PretrainedConfig``).

:class:`ModelProfile` holds the decoder's shape (hidden size, layers, heads, key/value heads, head size, MLP and
mixture-of-experts widths, vocabulary, tied embeddings), its LM head's logit transforms (the logit scale folded
into the temperature, Gemma's final-logit soft-cap), its position limit, and the attention facts that decide
whether packed (padding-free) rows compute what padded rows do (:meth:`ModelProfile.packing_obstacle`).
:meth:`ModelProfile.from_config` reads any config (a multimodal one's text config); a field the config lacks is
left at its "unknown" value (0, None), so that the trainer reads models the planner cannot count.
:func:`load_profile` finds a config.json by path, by shipped name or hub id, or in the Hugging Face cache.

No other module of ``pacs`` reads these keys of a model's configuration (tests/test_model_profile.py checks).
This module imports neither torch nor transformers (``pacs plan`` reads configs without them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pacs import configs as shipped_configs

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the keys a decoder-only config must have for its parameters to be counted (:meth:`ModelProfile.check_countable`)
COUNTED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# DeepSeek's multi-head latent attention and expert layout: keys whose parameters the counts here do not know
UNCOUNTED_KEYS = ("kv_lora_rank", "q_lora_rank", "n_routed_experts")
# where a config may give its position limit, the first one set wins
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")
# where a config may give the factor its logits are multiplied by (Cohere, Falcon-H1)
LOGIT_SCALE_KEYS = ("logit_scale", "output_multiplier", "lm_head_multiplier")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")  # the layer kinds that attend
LAYER_KIND_FIELDS = ("layer_types", "block_types", "layers_block_type")  # where configs list their layers' kinds
# rotary frequencies computed from the call's largest position (dynamic NTK, Phi-3's long/short factors)
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
# classes whose decoder layers call their attention without the forward's keyword arguments, so a packed row's
# sequence bounds never reach it (transformers 5.19; pacs_packed_sdpa also stops any other such model at its
# first packed forward)
BOUNDS_NOT_PASSED_ON = ("NemotronForCausalLM",)


@dataclass(frozen=True)
class ModelProfile:
    """A model's architecture as its configuration gives it. A mixture-of-experts model (``experts`` > 0) has
    ``moe_layers`` layers whose MLP is ``experts`` routed experts of width ``expert_intermediate`` (each token
    goes through ``experts_per_token`` of them), a router, and an optional always-on shared expert; its other
    layers are dense MLPs of width ``intermediate``. Weights, gradients and optimizer state take every expert
    (:attr:`params`); a token's activations take the experts it is routed to (:attr:`mlp_width`). Sizes the
    configuration does not give are 0 (:attr:`missing` names them)."""

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
    max_positions: int | None = None  # the longest sequence the model takes (max_position_embeddings)
    model_type: str = ""  # the (text) config's model_type
    config_class: str = "config.json"  # the configuration read: its class name, or "config.json" for a dict
    explicit_head_dim: bool = False  # the config gives head_dim (else hidden / heads)
    logit_scale: float = 1.0  # the factor the model multiplies its logits by (folded into the temperature)
    logit_softcap: float | None = None  # final_logit_softcapping: logits = c * tanh(logits / c) (Gemma 2/3)
    attention_softcap: float | None = None  # attn_logit_softcapping of the attention scores (Gemma 2)
    sliding_window: int | None = None  # the window some layer attends within; None: every layer sees it all
    rotary: bool = False  # rotary position embeddings (rope_parameters): attention sees only distances
    position_dependent_rope: str | None = None  # a rope_type whose frequencies follow the call's largest position
    non_attention_layers: tuple[str, ...] = ()  # layer kinds that mix tokens other than by attention, sorted
    missing: tuple[str, ...] = ()  # COUNTED_KEYS the configuration lacks
    uncounted: tuple[str, ...] = ()  # UNCOUNTED_KEYS the configuration sets

    @classmethod
    def from_config(cls, config, name: str = "model") -> ModelProfile:
        """The profile of ``config``: a config.json's dict or a transformers ``PretrainedConfig`` (a multimodal
        one's text config is read). Dense decoders (Qwen2/2.5/3, Llama, Gemma 2/3, Mistral...) and mixtures of
        experts in Qwen2-MoE / Qwen3-MoE's fields (``num_experts``, ``moe_intermediate_size``,
        ``decoder_sparse_step``, ``mlp_only_layers``) or Mixtral's (``num_local_experts``: every layer, experts
        of ``intermediate_size``)."""
        if isinstance(config, dict):
            text = config.get("text_config") or config
            get, config_class = text.get, "config.json"
        else:  # a PretrainedConfig, or any object with the config's fields as attributes
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            get, config_class = (lambda key, default=None: getattr(text, key, default)), type(config).__name__
        hidden, heads = _size(get("hidden_size")), _size(get("num_attention_heads"))
        layers, intermediate = _size(get("num_hidden_layers")), _size(get("intermediate_size"))
        model_type = get("model_type") or ""
        attention_bias = bool(get("attention_bias", False))
        experts = _size(get("num_experts")) or _size(get("num_local_experts"))  # transformers 5: Qwen-MoE's too
        moe = {}
        if experts:  # Mixtral: every layer, experts of intermediate_size; Qwen-MoE: moe_intermediate_size
            step = get("decoder_sparse_step") or 1
            dense = set(get("mlp_only_layers") or [])
            moe = dict(experts=experts, experts_per_token=_size(get("num_experts_per_tok")) or 1,
                       expert_intermediate=_size(get("moe_intermediate_size")) or intermediate,
                       shared_expert_intermediate=_size(get("shared_expert_intermediate_size")),
                       moe_layers=sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0))
        head_dim = _size(get("head_dim"))
        rope = get("rope_parameters") or get("rope_scaling") or {}
        layer_kinds = [t for field in LAYER_KIND_FIELDS for t in (get(field) or ()) if isinstance(t, str)]
        return cls(
            name=name, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
            kv_heads=_size(get("num_key_value_heads")) or heads, head_dim=head_dim or (hidden // heads if heads else 0),
            vocab=_size(get("vocab_size")), tied_embeddings=bool(get("tie_word_embeddings", True)),
            qkv_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and get("qkv_bias", True))
                      or attention_bias),
            o_bias=attention_bias, qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            norms_per_layer=4 if model_type.startswith(("gemma2", "gemma3")) else 2, **moe,
            max_positions=next((value for value in map(get, POSITION_LIMIT_KEYS) if _size(value)), None),
            model_type=model_type, config_class=config_class, explicit_head_dim=bool(head_dim),
            logit_scale=_logit_scale(get, model_type), logit_softcap=_number_or_none(get("final_logit_softcapping")),
            attention_softcap=_number_or_none(get("attn_logit_softcapping")),
            sliding_window=_sliding_window(get),
            rotary=get("rope_parameters") is not None or get("rope_theta") is not None,
            position_dependent_rope=next((entry.get("rope_type") for entry in _rope_entries(rope)
                                          if entry.get("rope_type") in POSITION_DEPENDENT_ROPE), None),
            non_attention_layers=tuple(sorted({t for t in layer_kinds if t not in ATTENTION_LAYER_TYPES})),
            missing=tuple(key for key in COUNTED_KEYS if get(key) is None),
            uncounted=tuple(key for key in UNCOUNTED_KEYS if get(key)))

    def check_countable(self) -> None:
        """ValueError naming ``--model`` unless this is a decoder-only config whose parameters are counted here."""
        if self.missing:
            raise ValueError(f"--model: config.json lacks {', '.join(self.missing)} (a decoder-only causal LM config "
                             "expected)")
        if self.uncounted:
            raise ValueError(f"--model: config.json sets {', '.join(self.uncounted)} (DeepSeek's latent attention or "
                             "experts), which the planner does not count; expected a "
                             "Qwen2/Qwen3/Llama/Gemma/Mixtral-style config")

    def packing_obstacle(self, attention: str, model_class, left_padded: bool = False) -> str | None:
        """Why packed rows, run with the attention implementation ``attention``, would not compute what padded
        rows compute for this model; None when they would.

        ``model_class``: the model's class (None: unknown, a model with code of its own, is an obstacle). Its
        attention must go through Hugging Face's attention interface (``_supports_attention_backend``), which
        hands ``attention`` the packed row's sequence bounds; a model that attends by code of its own (ALiBi
        models, older ports) would attend across them. No attention keeps a state-space or linear-attention
        layer from carrying state from one packed sequence into the next. Flash-attention's varlen kernels
        honour sliding windows and attention soft-caps; ``pacs_packed_sdpa`` (and the sequence-parallel
        attention) neither. ``left_padded``: the padded rows compared against are left-padded (TRL's prompts)
        without position ids, so a model with absolute position embeddings counts their positions from the
        padding while the packed row counts from the first token; rotary embeddings see only distances."""
        if self.non_attention_layers:
            return (f"the model has layers that are not attention ({', '.join(self.non_attention_layers)}; "
                    f"{self.config_class}.layer_types), which would carry state from one packed sequence into the "
                    "next")
        if model_class is None:
            return (f"{self.config_class} is not a transformers model class (code of its own): cannot tell whether "
                    "its attention keeps packed sequences apart")
        if not getattr(model_class, "_supports_attention_backend", False):
            return (f"{model_class.__name__} attends by code of its own, not through transformers' attention "
                    "interface, so a packed row's sequences would attend to each other")
        if model_class.__name__ in BOUNDS_NOT_PASSED_ON:
            return (f"{model_class.__name__}'s decoder layers do not pass a packed row's sequence bounds on to their "
                    "attention, so its sequences would attend to each other")
        if left_padded and not self.rotary:
            return (f"{model_class.__name__} has no rotary position embeddings: a left-padded row counts positions "
                    "from its padding, a packed row from its first token")
        if left_padded and self.position_dependent_rope is not None:
            return (f"its rotary frequencies (rope_type={self.position_dependent_rope!r}) follow the largest position "
                    "of the call: a left-padded batch's counts its padding, a packed row's does not")
        if "flash" in attention:
            return None
        if self.sliding_window is not None:
            return (f"the model attends within a sliding window of {self.sliding_window} tokens, which {attention} "
                    "does not implement (flash_attention_2 does: CUDA with flash_attn installed)")
        if self.attention_softcap is not None:
            return (f"the model soft-caps its attention scores (attn_logit_softcapping={self.attention_softcap}), "
                    f"which {attention} does not (flash_attention_2 does: CUDA with flash_attn installed)")
        return None

    # ------------------------------------------------------------------------- parameter counts

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
        widths = self.mlp_linear_widths()
        if widths:
            width = min(widths)
            out.update(gate_proj=(d, width), up_proj=(d, width), down_proj=(width, d))
        return out

    def mlp_linear_widths(self) -> list[int]:
        """The widths of the linear MLPs, one per layer that has one."""
        return ([self.intermediate] * (self.layers - self.moe_layers)
                + [self.shared_expert_intermediate] * (self.moe_layers if self.shared_expert_intermediate else 0))

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters: rank x (in + out) per targeted projection and layer."""
        unknown = [t for t in targets if t not in LORA_PROJECTIONS]
        if unknown:
            raise ValueError(f"--lora-targets: unknown module(s) {', '.join(unknown)}; expected some of "
                             f"{', '.join(LORA_PROJECTIONS)}")
        d = self.hidden
        shapes = self.projections()
        attention = sum(rank * sum(shapes[t]) for t in targets if t in ("q_proj", "k_proj", "v_proj", "o_proj"))
        mlp = sum(rank * (d + width) for t in targets if t in ("gate_proj", "up_proj", "down_proj")
                  for width in self.mlp_linear_widths())
        return self.layers * attention + mlp

    def narrowest_projection(self, targets: tuple[str, ...]) -> tuple[str, int, int] | None:
        """(name, in, out) of the targeted projection whose smaller side is the smallest; None if none exists."""
        found = [(name, a, b) for name, (a, b) in self.projections().items() if name in targets]
        return min(found, key=lambda p: min(p[1], p[2]), default=None)


def load_profile(model: str) -> ModelProfile:
    """The profile of ``model``: a directory holding config.json, a config.json path, or a shipped model config
    (pacs/configs/models/) by name (``qwen2.5-7b``) or by its Hugging Face hub id (``Qwen/Qwen2.5-7B``); another
    hub id is read from the local Hugging Face cache when its config.json is there (nothing is downloaded). Named
    after its folder (a cached hub id: the id)."""
    candidates = [model, os.path.join(model, "config.json"), shipped_configs.model_config_path(model)]
    path = next((p for p in candidates if p and os.path.isfile(p)), None) or _cached_hub_config(model)
    if path is None:
        shipped = ", ".join(f"{name} ({shipped_configs.HUB_IDS[name]})" if name in shipped_configs.HUB_IDS else name
                            for name in shipped_configs.model_names())
        raise ValueError(f"--model: no config.json at {model!r}; expected a model directory, a config.json, or a "
                         f"shipped config by name or hub id: {shipped or 'none shipped'}")
    with open(path) as fh:
        config = json.load(fh)
    in_cache = path not in candidates  # the cache's folder is a snapshot hash: name it by its hub id
    return ModelProfile.from_config(config, name=model if in_cache else os.path.basename(
        os.path.dirname(os.path.abspath(path))))


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


def _size(value) -> int:
    """A positive int the config gives, else 0 (unknown)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _number_or_none(value) -> float | None:
    return None if value is None else float(value)


def _logit_scale(get, model_type: str) -> float:
    """The factor the logits are multiplied by, read like the model code does: ``logit_scale`` (Cohere),
    ``output_multiplier``, ``lm_head_multiplier`` (Falcon-H1), ``logits_scaling`` (Granite divides by it,
    HyperCLOVA X multiplies)."""
    for key in LOGIT_SCALE_KEYS:
        value = get(key)
        if value is not None:
            return float(value)
    scaling = get("logits_scaling")
    if scaling is None:
        return 1.0
    return float(scaling) if model_type == "hyperclovax" else 1.0 / float(scaling)


def _sliding_window(get) -> int | None:
    """``layer_types`` where the config has them, else ``sliding_window`` unless ``use_sliding_window`` is False."""
    window, types = get("sliding_window"), get("layer_types")
    if types is not None:
        return window if "sliding_attention" in types else None
    return None if get("use_sliding_window", True) is False else window


def _rope_entries(rope) -> list[dict]:
    """The rope parameters and, for a config with them per layer type, each layer type's."""
    if not isinstance(rope, dict):
        return []
    return [rope, *(value for value in rope.values() if isinstance(value, dict))]
