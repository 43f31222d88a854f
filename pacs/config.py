"""One dataclass tree for every setting of a run; YAML files and command-line overrides fill it.

Precedence (later wins): the dataclass defaults (a real model's settings, the paper's; the built-in tasks
"embedded" and "wordmath" add their toy settings, :data:`BUILTIN_TASK_SETTINGS`), the YAML file given with
``--config``, ``key.path=value`` overrides, then the named flags (``--model``, ``--max-steps``, ...).
:func:`validate` rejects configs that cannot work before any work starts.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclass
class LoraConfig:
    """LoRA adapters instead of full fine-tuning (pacs/model/lora.py); rank 0: off."""

    rank: int = 0                   # adapter rank; 0: full fine-tuning
    alpha: float = 16.0             # the adapters' output is scaled by alpha / rank
    target_modules: str = "all-linear"  # every linear layer but the LM head, or comma-separated names (q_proj,v_proj)


@dataclass
class ModelConfig:
    path: str = "embedded"          # "embedded" (the task builds a tiny model) or an HF dir / hub id
    dtype: str = "auto"             # auto: bfloat16 on GPU, float32 on CPU | float32 | bfloat16 | float16
    gradient_checkpointing: bool = False  # each decoder layer keeps only its input; the rest is recomputed
    trust_remote_code: bool = False  # let transformers run the model repository's own code
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TaskConfig:
    name: str = "embedded"          # embedded | wordmath (generated word problems) | math (jsonl/parquet)
    data_path: str | None = None    # math: training file
    eval_path: str | None = None    # math: held-out file (default: the last eval_size rows of data_path)
    eval_size: int = 200            # held-out problems
    prompt_template: str = "{prompt}"  # each problem's prompt text; {prompt}: the problem (braces doubled)
    use_chat_template: bool = False  # wrap the prompt in the tokenizer's chat template (a user turn)
    # embedded task: multi-digit addition "a+b=" -> "c"
    digits: int = 3
    reverse: bool = True            # numbers written least-significant digit first
    word_steps: int = 2             # wordmath task: changes to the starting count per problem
    cache_dir: str | None = None    # warm-up cache; default $PACS_CACHE_DIR or ~/.cache/pacs
    hidden_size: int = 64           # the built-in tasks' tiny model: its hidden size
    num_layers: int = 2             # ... its decoder layers
    num_heads: int = 2              # head_dim = hidden_size / num_heads (>= 32 for vLLM CPU)
    intermediate_size: int = 256    # its MLP width
    warmup_steps: int = 3000        # at most this many supervised steps (the warm-up is cached)
    warmup_target_accuracy: float = 0.1  # ... stopping once validation accuracy reaches this
    warmup_batch_size: int = 64     # the supervised warm-up's batch size
    warmup_lr: float = 1e-3         # ... and learning rate


@dataclass
class RolloutConfig:
    engine: str = "auto"            # auto (vLLM if importable, else HF generate) | vllm | hf
    group_size: int = 8             # responses per prompt (G >= 2)
    prompts_per_step: int = 32      # prompts per rollout step (all ranks together)
    temperature: float = 1.0        # sampling temperature of the training rollouts (> 0)
    top_p: float = 1.0              # nucleus sampling of the training rollouts; 1: off
    max_new_tokens: int = 4096      # the paper's response budget (the built-in tasks: 6)
    max_prompt_len: int | None = None  # None: the longest prompt of the task's data, tokenized as the run will
                                       # (pacs/train/prompt_lengths.py; the built-in tasks: 32); a prompt longer than a
                                       # number set here is refused before any work, unless truncate_prompts
    truncate_prompts: bool = False  # cut prompts longer than max_prompt_len to their last max_prompt_len tokens
    gpu_memory_utilization: float = 0.5  # vLLM's share of the GPU (the built-in tasks: 0.3)
    kv_cache_gib: float = 1.0       # vLLM on a CPU: the KV cache it reserves up front
    enforce_eager: bool = True      # vLLM without CUDA graphs / torch.compile (faster start, slower decode)
    # the engine's weights: auto (model.dtype's) | float32 | bfloat16 | float16. float32 under LoRA over a 16-bit
    # base: the merged weights unrounded, so small adapter changes reach the rollouts (twice the engine's weights)
    dtype: str = "auto"


@dataclass
class OptimConfig:
    # the objective: pacs | grpo | dapo | dr_grpo | gspo | cispo, or a user's as module:Class
    # (pacs/train/loss_objective.py)
    algo: str = "pacs"
    lr: float = 1e-6                # the paper's (the built-in tasks: 2e-4)
    weight_decay: float = 0.0       # AdamW's
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's
    lr_schedule: str = "cosine"     # constant | cosine | linear (decays to 0 at max_steps)
    lr_warmup_steps: int = 0        # optimizer steps
    mini_batches_per_step: int = 2  # optimizer steps per rollout step (whole groups each)
    micro_batch_groups: int = 4     # groups per micro-batch (gradient accumulation)
    micro_batch_responses: int | None = None  # alternative to micro_batch_groups; must be a multiple of G
    max_grad_norm: float = 1.0      # gradients clipped to this global norm before each optimizer step
    # the dtype of the weights AdamW steps (pacs/model/mixed_precision.py): float32 master weights under a 16-bit
    # model.dtype; a 16-bit name equal to model.dtype steps those weights directly (warns: small updates round away)
    master_dtype: str = "float32"   # float32 | bfloat16 | float16
    # PACS (docs/pacs-algorithm.md)
    beta: float = 1.0               # the score's scale: psi = beta * score, made relative to the group
    score: str = "log_ratio"        # log_ratio (sum of log-probs minus the reference's) | mean_logp
    advantage: str = "rloo"         # rloo | grpo | naive: how a score is made relative to its group
    weighting: str = "balanced"     # BCE class weights: balanced | none | positive_only | negative_only
    score_function_term: bool = False  # add Eq. 6's score-function term (its value 0, its gradient not)
    # the reference of the log-ratio score: the policy at rollout steps 1, 1 + k, 1 + 2k, ... (k = this);
    # 1 (the public code's): the policy that generated each rollout (pacs/model/reference_policy.py)
    ref_reset_every: int = 1
    # PACS only: groups whose responses all got the same reward weigh 0 in the loss (pacs/train/single_label_groups.py;
    # with a reset every rollout step they add no gradient on the first mini-batch anyway)
    drop_single_label_groups: bool = False
    # GRPO baseline
    clip_eps: float = 0.2           # the ratio is clipped to [1 - clip_eps, 1 + clip_eps] (high side: eps_high if set)
    aggregation: str = "token_mean"  # token_mean (over the mini-batch's tokens) | seq_mean (of response means)
    # the GRPO family's clip range [1 - eps_low, 1 + eps_high] (of the token ratio; GSPO's sequence ratio, CISPO's
    # IS weight); None: the objective's own (low/high: dapo 0.2/0.28, dr_grpo 0.2/0.2, gspo 3e-4/4e-4, cispo 1/0.28)
    eps_low: float | None = None    # dapo, dr_grpo, gspo, cispo (grpo's low side is clip_eps)
    eps_high: float | None = None   # dapo, dr_grpo, gspo, cispo, grpo (unset for grpo: clip_eps)
    logprob_backend: str = "auto"   # the log-prob kernels: auto | triton | torch | naive (logits materialized)
    # PACS only: on the first mini-batch after each rollout (weights unchanged since the old-policy
    # pass), get loss and gradients in one vocabulary sweep (fused_linear_pacs_loss(old_lse=...))
    one_sweep_first_step: bool = True


@dataclass
class TrainConfig:
    """Long responses on limited memory (pacs/model/packing.py, pacs/model/memory.py)."""

    packing: bool | None = None     # padding-free packed micro-batches; None: on wherever packed rows compute
                                    # what padded rows do for the model (every objective's loss takes that layout)
    max_tokens_per_micro_batch: int | None = None  # token budget per micro-batch (whole groups, packed
                                                   # greedily); None: optim.micro_batch_groups counts
    old_policy_max_tokens: int | None = None  # token budget of each no-grad old-policy chunk; None: the
                                              # training micro-batches
    loss_chunk_mib: float | None = None  # the fused loss's logits working memory (chunk_budget_mib);
                                         # None: 2 GiB on CUDA; 256 MiB on the CPU, which path="auto" may
                                         # raise to hold a group (up to 1/8 of the memory); lower it for long
                                         # responses on little memory (a group over it is rebuilt in part)
    offload_activations: bool = False  # tensors saved for the backward go to host memory
    fsdp_cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: params, grads, optimizer state on the host
    liger_patches: bool = False     # CUDA: Liger-Kernel RMSNorm, SwiGLU, RoPE in the model (never its loss)
    # each decoder MLP over tiles of tokens, only its input kept (pacs/model/tiled_mlp.py)
    tiled_mlp: bool = False
    mlp_tile_tokens: int | None = None  # tokens per MLP tile; None: the model's hidden size
    skip_zero_gradient_groups: bool = True  # PACS: no forward/backward for groups whose gradient is exactly 0
                                    # (single-label groups on the first mini-batch after a reset; every
                                    # mini-batch with optim.drop_single_label_groups): pacs/train/single_label_groups.py
    preflight: bool | None = None   # run the longest step the settings allow before the first rollout
                                    # (pacs/train/preflight.py); None: on CUDA
    sequence_parallel_size: int = 1  # ranks that split each packed micro-batch's tokens (Ulysses attention,
                                     # pacs/model/sequence_parallel.py): the longest response grows with it
    distributed_timeout_minutes: float | None = None  # how long a rank waits in a collective for the others
                                     # (torchrun); None: torch's default (NCCL 10 min); raise it when one rank's
                                     # generation may outlast another's by more


@dataclass
class EvalConfig:
    every: int = 25                 # rollout steps between held-out evaluations (0: start and end only)
    num_problems: int = 200         # held-out problems per evaluation (at most task.eval_size)
    n_samples: int = 1              # > 1 with temperature > 0 gives pass@k
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0              # nucleus sampling of the evaluation; 1: off
    ks: tuple[int, ...] = (1,)      # the k of each pass@k reported (each <= n_samples)


@dataclass
class RolloutCorrectionConfig:
    """The sampler is not the trainer (pacs/train/rollout_correction.py, docs/rollout-correction.md): every step
    logs the mismatch of their log-probs; a mode drops what lies outside [c_min, c_max] of the ratio
    pi_trainer / pi_sampler, for any objective."""

    mode: str = "none"              # none | token_mask (tokens out of the band) | sequence_mask (whole responses)
                                    # | token_truncate / sequence_truncate (each token's term x its clamped ratio)
    c_min: float = 0.0              # the band's low end (0: none; the ratio is > 0)
    c_max: float = 3.0              # the band's high end (TRL's vllm_importance_sampling_clip_max default)
    # a response's ratio: product (exp of the summed log-ratios, TRL's sequence modes) | geometric (exp of their mean)
    sequence_ratio: str = "product"
    # sample the training rollouts at this temperature instead of rollout.temperature, the trainer's log-probs
    # staying at rollout.temperature: a deliberately mismatched sampler, for experiments (None: the same)
    sampler_temperature: float | None = None


@dataclass
class Config:
    seed: int = 0                   # the seed of data order, sampling and the built-in model's initialization
    output_dir: str = "runs/embedded"  # the run directory: config, metrics, checkpoints, final_model/
    max_steps: int = 600            # rollout steps
    max_minutes: float | None = None  # end the run (checkpoint, eval, export) past this wall time (per process)
    checkpoint_every: int = 50      # rollout steps between checkpoints (0: by checkpoint_minutes and at the end)
    checkpoint_minutes: float | None = 30.0  # also checkpoint once this long has passed since the last one
                                             # (or the start), at a step's end: a crash loses at most this
                                             # much plus one step; None: by step count only
    resume: bool = False            # continue OUTPUT_DIR's run from its newest verified checkpoint (--resume)
    overwrite: bool = False         # move a run already in OUTPUT_DIR aside (OUTPUT_DIR.replaced-<time>; --overwrite)
    max_consecutive_nan: int = 3    # non-finite updates in a row (each skipped) that stop the run
    torch_threads: int | None = None  # None: 1 on CPU for the embedded model (tiny ops; more threads
                                      # only spin, 20x slower on a busy 2-core machine), else torch's
    plot: bool = True               # write the metrics' and evaluations' plots (PNG) to the run directory
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


# Keys only an expert, an ablation or a test should set (kernel knobs, the algorithm's ablation switches, thresholds,
# timeouts, the built-in tasks' toy model); every other key is a user's (at most 45: tests/test_config.py counts
# them). YAML files and KEY=VALUE overrides write these under ``advanced:``, in their section
# (``advanced: {train: {preflight: false}}``, ``advanced.train.preflight=false``); the code reads each where it is
# declared (``cfg.train.preflight``), and the same key at that spot in a YAML file or an override is refused.
ADVANCED_KEYS = (
    "checkpoint_minutes", "max_consecutive_nan", "torch_threads", "plot", "resume", "overwrite",
    "model.trust_remote_code",
    "task.digits", "task.reverse", "task.word_steps", "task.cache_dir", "task.hidden_size", "task.num_layers",
    "task.num_heads", "task.intermediate_size", "task.warmup_steps", "task.warmup_target_accuracy",
    "task.warmup_batch_size", "task.warmup_lr",
    "rollout.top_p", "rollout.kv_cache_gib", "rollout.enforce_eager", "rollout.dtype",
    "optim.weight_decay", "optim.betas", "optim.lr_warmup_steps", "optim.micro_batch_responses",
    "optim.max_grad_norm", "optim.score", "optim.advantage", "optim.weighting", "optim.score_function_term",
    "optim.ref_reset_every", "optim.drop_single_label_groups", "optim.clip_eps", "optim.aggregation",
    "optim.eps_low", "optim.eps_high",
    "optim.logprob_backend", "optim.one_sweep_first_step",
    "train.old_policy_max_tokens", "train.mlp_tile_tokens", "train.skip_zero_gradient_groups", "train.preflight",
    "train.distributed_timeout_minutes",
    "eval.top_p",
    "rollout_correction.mode", "rollout_correction.c_min", "rollout_correction.c_max",
    "rollout_correction.sequence_ratio", "rollout_correction.sampler_temperature",
)
ADVANCED = "advanced"  # the section of a YAML file (and the first part of an override's key) that holds them

# The built-in tasks (embedded, wordmath: tiny models, prompts of a few tokens) start from these toy settings
# instead of the dataclass defaults above, which are a real model's (the paper's); configs/default.yaml
# lists the built-in run's every value. Applied by load_config under the YAML file and the overrides.
BUILTIN_TASKS = ("embedded", "wordmath")
BUILTIN_TASK_SETTINGS = {"optim": {"lr": 2e-4},
                         "rollout": {"max_prompt_len": 32, "max_new_tokens": 6, "gpu_memory_utilization": 0.3}}


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) for YAML/JSON."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def user_key(key: str) -> str:
    """The dotted key ``key`` (as declared: ``train.preflight``) as a user writes it (``advanced.train.preflight``)."""
    return f"{ADVANCED}.{key}" if key in ADVANCED_KEYS else key


def declared_key(key: str) -> str:
    """The inverse of :func:`user_key`: ``advanced.train.preflight`` -> ``train.preflight``."""
    return key[len(ADVANCED) + 1:] if key.startswith(f"{ADVANCED}.") else key


def to_user_dict(cfg: Config) -> dict:
    """:func:`to_dict` in the layout a user writes: the advanced keys moved under ``advanced:``, in their sections."""
    data, advanced = to_dict(cfg), {}
    for key in ADVANCED_KEYS:
        *sections, name = key.split(".")
        holder = data
        for section in sections:
            holder = holder[section]
        _put(advanced, key, holder.pop(name))
    data[ADVANCED] = advanced
    return data


def from_user_layout(data: dict) -> dict:
    """A config mapping as a user writes it (a YAML file, an override) in the layout of the dataclasses: each key
    under ``advanced:`` moved to its section. An advanced key outside ``advanced:``, or a user's key inside it, is a
    ValueError naming the spelling to use. A mapping saved by a run before the ``advanced:`` section existed
    (:func:`saved_before_advanced`) is that layout already: returned as it is, so an old run directory resumes."""
    if not isinstance(data, dict):
        raise TypeError(f"config must be a mapping, got {type(data).__name__}")
    if saved_before_advanced(data):
        return data
    declared = {key: value for key, value in data.items() if key != ADVANCED}
    for key, _ in _leaves(declared):
        if key in ADVANCED_KEYS:
            raise ValueError(f"{key} is an advanced key now: write {ADVANCED}.{key}")
    advanced = data.get(ADVANCED) or {}
    if not isinstance(advanced, dict):
        raise TypeError(f"{ADVANCED} must be a mapping of sections, got {type(advanced).__name__}")
    declared = copy.deepcopy(declared)  # the caller's mapping stays as it was
    for key, value in _leaves(advanced):
        if key in dict(config_keys()) and key not in ADVANCED_KEYS:
            raise ValueError(f"{ADVANCED}.{key} is not an advanced key: write {key}")
        if key not in ADVANCED_KEYS:
            written = f"{ADVANCED}.{key}"
            raise ValueError(f"unknown config key {written!r}; {_did_you_mean(written)}{_advanced_keys_near(key)}")
        _put(declared, key, value)
    return declared


def known_keys() -> set[str]:
    """Every dotted key and section a user may write, in both spellings (as declared and as written)."""
    known = set()
    for key, _ in config_keys():
        for spelling in (key, user_key(key)):
            parts = spelling.split(".")
            known.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return known


def closest_key(name: str) -> str | None:
    """The key a typo'd ``name`` most likely meant, as a user writes it (None when nothing is close): a section
    for a name without a dot; in a known section, its key whose name is closest (else the key of that name in
    another section); in an unknown one, the closest whole key."""
    leaves = [user_key(key) for key, _ in config_keys()]
    if "." not in name:
        return _closest(name, sorted(known_keys()))
    section, _, leaf = name.rpartition(".")
    if section not in known_keys():
        return _closest(name, leaves)
    near = _closest(leaf, [key[len(section) + 1:] for key in leaves if key.startswith(f"{section}.")])
    if near is not None:
        return f"{section}.{near}"
    elsewhere = [key for key in leaves if key.rpartition(".")[2] == leaf]  # the right name in the wrong section
    return elsewhere[0] if len(elsewhere) == 1 else None


def _closest(name: str, candidates: list[str]) -> str | None:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _did_you_mean(name: str) -> str:
    close = closest_key(name)
    return "" if close is None else f"did you mean {close}? "


def _advanced_keys_near(key: str) -> str:
    """The advanced keys in the section of dotted ``key`` (or in ``key``, a section), else the top level's."""
    for section in (key, key.rpartition(".")[0]):
        names = [k[len(section) + 1:] for k in ADVANCED_KEYS if section and k.startswith(f"{section}.")]
        if names:
            return f"known under {ADVANCED}.{section}: {', '.join(names)}"
    top = dict.fromkeys(k.split(".")[0] for k in ADVANCED_KEYS)
    return f"known under {ADVANCED}: {', '.join(top)}"


# what only a run's saved config holds at its top level: where and how the run started (written as false)
_SAVED_ONLY = ("resume", "overwrite")


def saved_before_advanced(data: dict) -> bool:
    """Whether ``data`` is a run's config.yaml (or config_history.jsonl entry) written before the ``advanced:``
    section: every section, and ``resume`` and ``overwrite`` at the top level, which only such a saved config
    held there, and no ``advanced:``."""
    sections = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(Config(), f.name))]
    return ADVANCED not in data and all(key in data for key in (*_SAVED_ONLY, *sections))


def _leaves(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of each value of nested mapping ``data`` that is not itself a mapping."""
    leaves = []
    for key, value in data.items():
        if isinstance(value, dict):
            leaves += _leaves(value, f"{prefix}{key}.")
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves


def _put(data: dict, key: str, value: Any) -> None:
    """Set dotted ``key`` of nested mapping ``data`` to ``value``, making the mappings on its way."""
    *sections, name = key.split(".")
    for section in sections:
        data = data.setdefault(section, {})
        if not isinstance(data, dict):
            raise TypeError(f"{section} must be a mapping, got {type(data).__name__}")
    data[name] = value


def config_hash(obj: Any, length: int = 12) -> str:
    data = obj if isinstance(obj, dict) else to_dict(obj)
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:length]


def _coerce(name: str, value: Any, current: Any, type_hint: Any) -> Any:
    """Turn a YAML/CLI value into the type of the field it sets."""
    hint = str(type_hint)
    if isinstance(value, str) and not hint.startswith("str"):
        text = value.strip()
        if text.lower() in ("none", "null", "~"):
            value = None
        elif hint.startswith("float") and _FLOAT.fullmatch(text):
            value = float(text)  # YAML 1.1 reads "2e-4" as a string
        else:
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ValueError(f"{name}: cannot parse {value!r} ({exc})") from exc
    if value is None:
        if "None" in hint:
            return None
        raise ValueError(f"{name} cannot be None (expected {hint})")
    if hint.startswith("tuple"):
        if isinstance(value, (int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list, got {value!r}")
        return tuple(value)
    if hint == "bool" or isinstance(current, bool) and "bool" in hint:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, got {value!r}")
        return value
    if hint.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return value
    if hint.startswith("float"):
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        return float(value)
    if hint.startswith("str"):
        return str(value)
    return value


def apply_dict(cfg: Any, data: dict, prefix: str = "") -> Any:
    """Set fields of the dataclass ``cfg`` from a nested dict; unknown keys are errors."""
    if not isinstance(data, dict):
        raise TypeError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:  # a user's keys by their spelling: an advanced one under advanced.
            full = [f"{prefix}{k}" for k in sorted(fields)]
            known = ([k for k in full if k not in ADVANCED_KEYS]
                     + [f"{ADVANCED}.{k}" for k in full if k in ADVANCED_KEYS])
            raise ValueError(f"unknown config key {name!r}; {_did_you_mean(name)}known: {', '.join(known)}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            apply_dict(current, value, prefix=f"{name}.")
        else:
            setattr(cfg, key, _coerce(name, value, current, fields[key].type))
    return cfg


def apply_override(cfg: Config, assignment: str) -> Config:
    """Apply one ``a.b.c=value`` override (an advanced key spelled ``advanced.a.b=value``)."""
    if "=" not in assignment:
        raise ValueError(f"override must look like key.path=value, got {assignment!r}")
    path, value = assignment.split("=", 1)
    keys = path.strip().split(".")
    nested: Any = value
    for key in reversed(keys):
        nested = {key: nested}
    return apply_dict(cfg, from_user_layout(nested))


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides (both in the layout a user writes,
    :func:`from_user_layout`). The defaults are the dataclasses' (a real model's) or, when the resulting
    ``task.name`` is a built-in task, those plus :data:`BUILTIN_TASK_SETTINGS`."""
    data = from_user_layout(read_yaml(path))
    cfg = _layered(Config(), data, overrides)
    if cfg.task.name in BUILTIN_TASKS:
        cfg = _layered(apply_dict(Config(), BUILTIN_TASK_SETTINGS), data, overrides)
    return cfg


def _layered(cfg: Config, data: dict, overrides: list[str] | None) -> Config:
    apply_dict(cfg, data)
    for assignment in overrides or []:
        apply_override(cfg, assignment)
    return cfg


def read_yaml(path: str | None) -> dict:
    """The mapping in the YAML file at ``path`` ({} for None), or in the shipped preset of that name
    (pacs/configs/presets/, e.g. ``qwen2.5-1.5b_lora_24gb``) when no such file exists."""
    data: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            from pacs import configs as shipped_configs

            shipped = None if os.path.dirname(path) else shipped_configs.preset_path(path)
            if shipped is None:
                raise ValueError(f"--config: no such file {path!r} (nor a shipped preset: "
                                 f"{', '.join(shipped_configs.preset_names())})")
            path = shipped
        with open(path) as fh:
            try:
                data = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"--config: {path!r} is not valid YAML ({exc})") from exc
    return data


def save_config(cfg: Config, path: str) -> None:
    """``cfg`` as a YAML file in the layout a user writes (advanced keys under ``advanced:``): ``load_config``
    reads it back equal."""
    with open(path, "w") as fh:
        yaml.safe_dump(to_user_dict(cfg), fh, sort_keys=False)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None or value != value or value < 0 or (value == 0 and not allow_zero):  # (value != value: NaN)
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def validate_rollout_correction(cfg: Config) -> None:
    c = cfg.rollout_correction
    _choice("advanced.rollout_correction.mode", c.mode, ("none", "token_mask", "sequence_mask", "token_truncate",
                                                         "sequence_truncate"))
    _choice("advanced.rollout_correction.sequence_ratio", c.sequence_ratio, ("product", "geometric"))
    if not 0 <= c.c_min < 1 < c.c_max:
        raise ValueError("advanced.rollout_correction needs 0 <= c_min < 1 < c_max (a band around the on-policy "
                         f"ratio 1), got c_min={c.c_min}, c_max={c.c_max}")
    t = c.sampler_temperature
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
        raise ValueError(f"advanced.rollout_correction.sampler_temperature must be a number > 0 or null, got {t!r}")


def micro_batch_groups(cfg: Config) -> int:
    """Groups per micro-batch, from micro_batch_groups or micro_batch_responses."""
    group = cfg.rollout.group_size
    if cfg.optim.micro_batch_responses is not None:
        return cfg.optim.micro_batch_responses // group
    return cfg.optim.micro_batch_groups


def validate(cfg: Config, world_size: int = 1) -> None:
    """Reject configs that cannot work, with the offending setting named. No model needed."""
    r, o, e, t = cfg.rollout, cfg.optim, cfg.eval, cfg.task
    check_algo(o.algo)
    _choice("rollout.engine (--rollout)", r.engine, ("auto", "vllm", "hf"))
    _choice("task.name", t.name, ("embedded", "wordmath", "math"))
    _choice("model.dtype", cfg.model.dtype, ("auto", "float32", "bfloat16", "float16"))
    _choice("advanced.rollout.dtype", cfg.rollout.dtype, ("auto", "float32", "bfloat16", "float16"))
    _choice("optim.master_dtype", cfg.optim.master_dtype, ("float32", "bfloat16", "float16"))
    _positive("model.lora.rank", cfg.model.lora.rank, allow_zero=True)
    _positive("model.lora.alpha", cfg.model.lora.alpha)
    if not cfg.model.lora.target_modules.strip(" ,"):
        raise ValueError("model.lora.target_modules must name modules ('all-linear' or e.g. 'q_proj,v_proj'), got ''")
    if cfg.optim.master_dtype != "float32" and cfg.model.dtype not in ("auto", cfg.optim.master_dtype):
        raise ValueError(f"optim.master_dtype={cfg.optim.master_dtype!r} (16-bit weights stepped directly) needs "
                         f"model.dtype={cfg.optim.master_dtype!r}, got model.dtype={cfg.model.dtype!r}; "
                         "optim.master_dtype=float32 keeps float32 master weights (the default)")
    _choice("optim.lr_schedule", o.lr_schedule, ("constant", "cosine", "linear"))
    validate_rollout_correction(cfg)
    validate_train(cfg, world_size)
    if o.one_sweep_first_step and o.logprob_backend == "naive":
        raise ValueError("optim.one_sweep_first_step needs optim.logprob_backend 'auto', 'torch' or 'triton', "
                         "got 'naive'; set advanced.optim.one_sweep_first_step=false to use the naive backend")
    if r.group_size < 2:
        raise ValueError(
            f"rollout.group_size must be >= 2 (PACS and GRPO compare responses within a group), "
            f"got {r.group_size}")
    _positive("rollout.prompts_per_step", r.prompts_per_step)
    _positive("rollout.max_new_tokens", r.max_new_tokens)
    if r.max_prompt_len is not None:
        _positive("rollout.max_prompt_len", r.max_prompt_len)
    if not r.temperature > 0:
        raise ValueError(f"rollout.temperature must be > 0 for training rollouts, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        raise ValueError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    data_ranks = world_size // cfg.train.sequence_parallel_size  # (validate_train: a divisor)
    if r.prompts_per_step % data_ranks:
        raise ValueError(
            f"rollout.prompts_per_step ({r.prompts_per_step}) must be divisible by the number of "
            f"processes ({world_size})" + (f" over train.sequence_parallel_size ({cfg.train.sequence_parallel_size})"
                                           if data_ranks != world_size else ""))
    per_rank = r.prompts_per_step // data_ranks
    _positive("optim.mini_batches_per_step", o.mini_batches_per_step)
    if per_rank % o.mini_batches_per_step:
        raise ValueError(
            f"optim.mini_batches_per_step ({o.mini_batches_per_step}) must divide the prompts per "
            f"rank and step ({per_rank}) so that every mini-batch holds whole groups")
    if o.micro_batch_responses is not None and o.micro_batch_responses % r.group_size:
        raise ValueError(
            f"optim.micro_batch_responses ({o.micro_batch_responses}) splits groups: it must be a "
            f"multiple of rollout.group_size ({r.group_size})")
    groups = micro_batch_groups(cfg)
    _positive("optim.micro_batch_groups", groups)
    mini = per_rank // o.mini_batches_per_step
    if mini % groups:
        raise ValueError(
            f"optim.micro_batch_groups ({groups}) must divide the groups per mini-batch ({mini}); "
            "micro-batches hold whole groups")
    _positive("optim.lr", o.lr)
    if o.lr > 1:  # AdamW moves each weight by about lr a step: above 1 it diverges (1e300 overflowed its update)
        raise ValueError(f"optim.lr must be in (0, 1] (AdamW moves each weight by about lr per step), got {o.lr!r}")
    _positive("optim.max_grad_norm", o.max_grad_norm)
    _positive("optim.beta", o.beta)
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("optim.lr_warmup_steps", o.lr_warmup_steps, allow_zero=True)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ValueError(f"optim.betas must be two numbers in [0, 1), got {list(o.betas)}")
    _choice("optim.score", o.score, ("log_ratio", "mean_logp"))
    _choice("optim.advantage", o.advantage, ("rloo", "grpo", "naive"))
    _choice("optim.weighting", o.weighting, ("balanced", "none", "positive_only", "negative_only"))
    _choice("optim.aggregation", o.aggregation, ("token_mean", "seq_mean"))
    _choice("optim.logprob_backend", o.logprob_backend, ("auto", "triton", "torch", "naive"))
    if isinstance(o.ref_reset_every, bool) or not isinstance(o.ref_reset_every, int) or o.ref_reset_every < 1:
        raise ValueError(f"optim.ref_reset_every must be an integer >= 1 (rollout steps), got {o.ref_reset_every!r}")
    if o.ref_reset_every > 1 and (o.algo != "pacs" or o.score != "log_ratio"):
        raise ValueError(
            f"optim.ref_reset_every={o.ref_reset_every} keeps PACS's reference for several rollout steps: it needs "
            f"optim.algo=pacs and optim.score=log_ratio (the only score that uses a reference), got "
            f"algo={o.algo}, score={o.score}; GRPO's old policy must be the one that sampled")
    if o.drop_single_label_groups and o.algo != "pacs":
        raise ValueError(f"optim.drop_single_label_groups is a PACS option, got optim.algo={o.algo}; GRPO's "
                         "single-label groups have advantage 0 already")
    if not 0 < o.clip_eps < 1:
        raise ValueError(f"optim.clip_eps must be in (0, 1), got {o.clip_eps}")
    validate_objective_settings(o)
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {r.gpu_memory_utilization}")
    _positive("rollout.kv_cache_gib", r.kv_cache_gib)
    if cfg.max_minutes is not None:
        _positive("max_minutes", cfg.max_minutes)
    if cfg.checkpoint_minutes is not None:
        _positive("checkpoint_minutes", cfg.checkpoint_minutes)
    if cfg.torch_threads is not None:
        _positive("torch_threads", cfg.torch_threads)
    _positive("seed (--seed)", cfg.seed, allow_zero=True)
    if not cfg.output_dir:
        raise ValueError("output_dir (--output-dir) must be a directory path, got an empty string")
    if not e.temperature >= 0:
        raise ValueError(f"eval.temperature must be >= 0, got {e.temperature}")
    _positive("task.eval_size", t.eval_size)
    _positive("max_steps (--max-steps)", cfg.max_steps, allow_zero=True)
    _positive("checkpoint_every", cfg.checkpoint_every, allow_zero=True)
    _positive("max_consecutive_nan", cfg.max_consecutive_nan)
    _positive("eval.every", e.every, allow_zero=True)
    _positive("eval.n_samples", e.n_samples)
    _positive("eval.num_problems", e.num_problems)
    if not 0 < e.top_p <= 1:
        raise ValueError(f"eval.top_p must be in (0, 1], got {e.top_p}")
    for k in e.ks:
        if not 1 <= k <= e.n_samples:
            raise ValueError(f"eval.ks entries must be in [1, eval.n_samples={e.n_samples}], got {k}")
    if e.n_samples > 1 and e.temperature == 0:
        raise ValueError("eval.n_samples > 1 needs eval.temperature > 0 (greedy samples are identical)")
    if t.name == "math" and not t.data_path:
        raise ValueError("task.name='math' needs task.data_path (a .jsonl or .parquet file)")
    for key in ("data_path", "eval_path"):  # else the file would be silently ignored
        if getattr(t, key) and t.name != "math":
            raise ValueError(f"task.{key} is read by task.name=math only (task.name is {t.name!r}): add task.name=math")
    if t.name == "wordmath":
        _positive("task.word_steps", t.word_steps)
    if t.name in ("embedded", "wordmath"):
        _positive("task.digits", t.digits)
        if e.num_problems > t.eval_size:
            raise ValueError(
                f"eval.num_problems ({e.num_problems}) must be <= task.eval_size ({t.eval_size}), the "
                "held-out set the training stream excludes")
        for key in ("hidden_size", "num_heads", "intermediate_size", "warmup_batch_size", "warmup_lr"):
            _positive(f"task.{key}", getattr(t, key))
        if t.hidden_size % t.num_heads:
            raise ValueError(
                f"task.hidden_size ({t.hidden_size}) must be divisible by task.num_heads ({t.num_heads})")
        if t.num_layers < 1:
            raise ValueError(f"task.num_layers must be >= 1, got {t.num_layers}")
        _positive("task.warmup_steps", t.warmup_steps, allow_zero=True)
        if not 0 <= t.warmup_target_accuracy <= 1:
            raise ValueError(f"task.warmup_target_accuracy must be in [0, 1], got {t.warmup_target_accuracy}")


# the objectives ``optim.algo`` names (pacs/train/loss_objective.py builds them); a user's is named module:Class
BUILTIN_OBJECTIVES = ("pacs", "grpo", "dapo", "dr_grpo", "gspo", "cispo")
CLIPPED_OBJECTIVES = ("dapo", "dr_grpo", "gspo", "cispo")  # their clip range: optim.eps_low, optim.eps_high


def check_algo(algo: str) -> None:
    """``optim.algo``: a built-in objective's name, or ``module:Class`` (dotted names; imported when the run
    starts: pacs/train/loss_objective.py)."""
    module, sep, attribute = algo.partition(":") if isinstance(algo, str) else ("", "", "")
    dotted = all(part.isidentifier() for part in module.split(".") + attribute.split("."))
    if algo in BUILTIN_OBJECTIVES or (sep and dotted):
        return
    raise ValueError(f"optim.algo (--algo) must be one of {', '.join(BUILTIN_OBJECTIVES)}, or a user's objective as "
                     f"module:Class (e.g. my_objectives:MyLoss); got {algo!r}")


def validate_objective_settings(o: OptimConfig) -> None:
    """The objective's own settings: each set only for an objective that reads it, in its range."""
    if o.eps_low is not None and not (isinstance(o.eps_low, (int, float)) and 0 <= o.eps_low <= 1):
        raise ValueError(f"optim.eps_low must be in [0, 1] (the ratio is clipped below at 1 - eps_low), "
                         f"got {o.eps_low!r}")
    if o.eps_high is not None and not (isinstance(o.eps_high, (int, float)) and 0 <= o.eps_high < float("inf")):
        raise ValueError(f"optim.eps_high must be >= 0 (the ratio is clipped above at 1 + eps_high), "
                         f"got {o.eps_high!r}")
    readers = {"eps_low": CLIPPED_OBJECTIVES, "eps_high": ("grpo", *CLIPPED_OBJECTIVES)}
    for key, algos in readers.items():
        if getattr(o, key) is not None and o.algo not in algos:
            why = ("GRPO's low side is advanced.optim.clip_eps" if o.algo == "grpo" else
                   "a user's objective is built with its own defaults" if o.algo not in BUILTIN_OBJECTIVES else
                   "PACS clips no ratio")
            raise ValueError(f"optim.{key} is read by optim.algo {', '.join(algos)}, got optim.algo={o.algo} ({why}); "
                             f"leave advanced.optim.{key} unset")
    if o.aggregation != "token_mean" and o.algo != "grpo":
        raise ValueError(f"optim.aggregation={o.aggregation!r} is GRPO's, got optim.algo={o.algo}; each other "
                         "objective has its own aggregation (docs/objectives.md)")


def use_packing(cfg: Config, model_config=None, attention: str = "pacs_packed_sdpa") -> bool:
    """train.packing resolved: None means packed wherever that is exact: the configured loss takes the
    layout and, given the model's (Hugging Face) config, packed rows run with the attention implementation
    ``attention`` compute what padded rows do (:func:`pacs.model.packing.packing_obstacle`). ``train.packing=true``
    for a model that cannot be packed exactly is a ValueError saying why."""
    requested = cfg.train.packing
    if requested is False:  # (every objective's fused loss takes the packed layout)
        return False
    if model_config is None:
        return True
    from pacs.model.packing import packing_obstacle

    why = packing_obstacle(model_config, attention)
    if why is not None and requested:
        raise ValueError(f"train.packing=true cannot be exact for this model: {why}; set train.packing=false")
    return why is None


def validate_train(cfg: Config, world_size: int = 1) -> None:
    """The ``train`` section (long-context settings)."""
    tr = cfg.train
    for name in ("max_tokens_per_micro_batch", "old_policy_max_tokens", "mlp_tile_tokens"):
        value = getattr(tr, name)
        if value is not None and value <= 0:
            raise ValueError(f"train.{name} must be a positive number of tokens or None, got {value!r}")
    # a sequence's forward cannot be cut: a budget below the longest sequence the rollouts may give
    # would stop the run at the first one that long, perhaps hours in; say so before any work
    longest = (cfg.rollout.max_prompt_len or 1) + cfg.rollout.max_new_tokens  # (None: checked once measured)
    for name in ("max_tokens_per_micro_batch", "old_policy_max_tokens"):
        value = getattr(tr, name)
        if value is not None and value < longest:
            raise ValueError(
                f"train.{name}={value} is smaller than the longest sequence the rollouts may give: "
                f"rollout.max_prompt_len + rollout.max_new_tokens = {longest} tokens, and a sequence's forward "
                f"cannot be cut into parts; raise train.{name} to at least {longest}, or lower "
                "rollout.max_new_tokens or rollout.max_prompt_len (prompts are cut to it)")
    if tr.loss_chunk_mib is not None and not (isinstance(tr.loss_chunk_mib, (int, float))
                                              and 0 < tr.loss_chunk_mib < float("inf")):
        raise ValueError(f"train.loss_chunk_mib must be a positive number of MiB or None, got {tr.loss_chunk_mib!r}")
    timeout = tr.distributed_timeout_minutes
    if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                    and 0 < timeout < float("inf")):
        raise ValueError(f"train.distributed_timeout_minutes must be a positive number of minutes or None, "
                         f"got {timeout!r}")
    sp = tr.sequence_parallel_size
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"train.sequence_parallel_size must be a positive integer, got {sp!r}")
    if sp > 1 and world_size % sp:
        raise ValueError(
            f"train.sequence_parallel_size={sp} must divide the number of processes ({world_size}): each group of "
            f"{sp} ranks splits the tokens of its micro-batches (launch with torchrun --nproc-per-node a multiple "
            f"of {sp})")
    if sp > 1 and not use_packing(cfg):
        raise ValueError(
            f"train.sequence_parallel_size={sp} splits packed micro-batches: it needs train.packing (got "
            f"{tr.packing!r}); set train.packing=true or "
            "leave it unset")
    if tr.fsdp_cpu_offload and world_size < 2:
        raise ValueError("train.fsdp_cpu_offload needs FSDP, i.e. torchrun with >= 2 processes; got "
                         f"{world_size} process(es)")


def check_lengths(cfg: Config, max_positions: int | None) -> None:
    """Prompt + response must fit the model's positions (checked once the model config is known, again once
    an unset ``rollout.max_prompt_len`` is measured)."""
    need = (cfg.rollout.max_prompt_len or 1) + cfg.rollout.max_new_tokens
    if max_positions is not None and need > max_positions:
        raise ValueError(
            f"rollout.max_prompt_len + rollout.max_new_tokens = {need} exceeds the model's "
            f"max_position_embeddings ({max_positions})")


def config_keys(cfg: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every setting, in declaration order (defaults when ``cfg`` is None)."""
    cfg = Config() if cfg is None else cfg
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(config_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append((f"{prefix}{f.name}", list(value) if isinstance(value, tuple) else value))
    return keys
