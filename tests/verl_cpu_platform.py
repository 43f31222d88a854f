"""A CPU platform for verl 0.9, test-only: lets verl's own actor update (FSDP engine, gloo) run on CPU.

verl 0.9 resolves its device through ``verl.plugin.platform`` and ships CUDA, NPU and ROCm platforms only;
with no accelerator it falls back to CUDA (``platform_manager._detect_platform_name``), and its FSDP engine
then moves every micro-batch to ``cuda:0``. This module uses verl's documented extension point instead of
patching verl: it registers a ``PlatformBase`` subclass under the name ``"cpu"``, selected with
``VERL_PLATFORM=cpu``. It must be imported before anything calls ``verl.plugin.platform.get_platform``
(the FSDP engine module reads the device name at import), e.g. through
``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform,...``.

The FSDP language-model engine is registered for ``cuda`` and ``npu`` only; ``VERL_ENGINE_DEVICE=cuda``
(verl's own override in ``EngineRegistry.get_engine_cls``) selects it; nothing in it is CUDA-specific
once the platform answers ``cpu``.
"""

from contextlib import contextmanager
from types import SimpleNamespace

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _no_memory(*args, **kwargs) -> int:
    return 0


# What verl's actor path calls on ``get_torch_device()`` (memory logging, cache clearing, synchronising),
# answered for the CPU: memory counters read 0, cache and synchronisation are no-ops.
CPU_DEVICE_MODULE = SimpleNamespace(
    is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, set_device=lambda *a: None,
    synchronize=lambda *a: None, empty_cache=lambda: None, ipc_collect=lambda: None,
    memory_allocated=_no_memory, memory_reserved=_no_memory, max_memory_allocated=_no_memory,
    max_memory_reserved=_no_memory, mem_get_info=lambda *a: (0, 0), manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed, get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    get_device_name=lambda *a: "cpu")


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface answered for the CPU (device ``cpu``, gloo, no profiling)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

    def current_device(self):
        # verl moves tensors with ``.to(get_device_id())``; an index would mean cuda:<index>.
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
