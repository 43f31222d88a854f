"""Device profiles: what the planner knows of the device a loss runs on (engine/plan.py reads one).

A :class:`DeviceProfile` holds, for one device and dtype: its class ("cpu", "cuda", ...), name and compute
capability, the cost model's two constants (:class:`DeviceCosts`), the GPU table entries measured on THIS
device (pacs_kernels/gpu_dispatch.json is keyed by device name and compute capability: another GPU's
measurements are not this one's), the chunk budget's default and the largest budget the planner may
raise it to.

:func:`device_profile` is what a loss call uses: it reads (from memory, or a stored profile file) and
never measures or writes. A device nobody calibrated gets the cost model's defaults for its class
(:data:`DEFAULT_COSTS`). Measuring happens only when asked, in :func:`calibrate_device_profile`
(``pacs bench calibrate``), which may store the result for later processes (:func:`profile_path`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import dispatch

PROFILE_FILE = "device_profiles.json"
PROFILE_VERSION = 2
RAISED_BUDGET_SHARE = 1 / 8  # the CPU single pass may hold up to this share of the machine's memory
CUDA_FREE_SHARE = 1 / 4  # on CUDA, up to this share of the free memory (what the model left) to hold a group
PROFILE_DIR_ENV = "PACS_KERNELS_PROFILE_DIR"  # where calibrated profiles are stored (default ~/.cache/pacs_kernels)


@dataclass(frozen=True)
class DeviceCosts:
    """Constants of one device and dtype: seconds per GEMM flop, seconds per element of an elementwise pass
    over float32 logits."""

    gemm_s_per_flop: float
    pass_s_per_element: float

    def __post_init__(self):
        for name in ("gemm_s_per_flop", "pass_s_per_element"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"DeviceCosts.{name} must be a finite number > 0, got {value!r}")


# the cost model's defaults by device class, for a device nobody calibrated: a few-core CPU (about 100 GFLOP/s,
# 1 ns an element) and a data-centre GPU (about 500 TFLOP/s in 16 bits, 3 TB/s). On the CPU the eager two
# passes do more GEMMs and more passes than any single pass, so there the constants only weigh budgets.
DEFAULT_COSTS = {"cpu": DeviceCosts(1e-11, 1e-9), "cuda": DeviceCosts(2e-15, 1.5e-12)}


@dataclass(frozen=True)
class DeviceProfile:
    """What the planner reads of a device (see the module docstring). ``table``: GPU table entries measured
    on this device (name and capability), () where none; ``max_budget_mib``: the most the planner may raise the
    chunk budget to (from the device's default, engine/plan.py) so as to hold a whole group;
    ``calibrated``: the costs were measured on this device (else its class's defaults)."""

    device: torch.device
    dtype: torch.dtype
    name: str
    capability: tuple[int, int] | None
    costs: DeviceCosts
    calibrated: bool
    table: tuple
    max_budget_mib: float

    @property
    def kind(self) -> str:
        return self.device.type


_lock = threading.Lock()
_profiles: dict[str, DeviceCosts | None] = {}  # by profile_key: calibrated costs, or None (none stored: defaults)


def device_profile(device: torch.device, dtype: torch.dtype, *, dispatch_table: str | None = None) -> DeviceProfile:
    """The profile of ``device`` for ``dtype`` (what a loss call uses): calibrated costs from memory or the
    stored profile file, else the defaults of the device's class; the GPU table entries of this device
    (``dispatch_table``: another run's table, taken as this device's). Measures nothing, writes nothing."""
    device = torch.device(device)
    name, capability = device_name(device), _capability(device)
    key = profile_key(device, dtype, name)
    with _lock:  # the stored profiles are read once per process and device (no file access per loss call)
        if key not in _profiles:
            _profiles[key] = _read_stored(key)
        costs = _profiles[key]
    calibrated = costs is not None
    costs = costs or DEFAULT_COSTS.get(device.type, DEFAULT_COSTS["cpu"])
    table = dispatch.table_entries(dispatch_table, device_name=None if dispatch_table else name,
                                   capability=capability) if device.type == "cuda" else ()
    return DeviceProfile(device, dtype, name, capability, costs, calibrated, tuple(table), _max_budget_mib(device))


def _max_budget_mib(device: torch.device) -> float:
    """The largest budget the planner may raise an unset budget to: RAISED_BUDGET_SHARE of the CPU's memory, on
    CUDA CUDA_FREE_SHARE of the memory free now (what the model left); 0 elsewhere (the planner then keeps the
    device's default)."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * RAISED_BUDGET_SHARE / 2 ** 20
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return free * CUDA_FREE_SHARE / 2 ** 20
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return 0.0


def device_name(device: torch.device) -> str:
    """The device's name: the GPU's (e.g. "NVIDIA H200"), or the CPU's model with its threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{_cpu_name()}, {torch.get_num_threads()} threads"
    return device.type


def _capability(device: torch.device) -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def profile_key(device: torch.device, dtype: torch.dtype, name: str | None = None) -> str:
    """What a calibration is valid for: the device's class, its name (threads on the CPU) and the dtype."""
    name = device_name(device) if name is None else name
    return f"{device.type}|{name}|{dispatch.dtype_name(dtype)}|v{PROFILE_VERSION}"


def profile_path() -> Path:
    """Where calibrated profiles are stored: $PACS_KERNELS_PROFILE_DIR, else $XDG_CACHE_HOME/pacs_kernels or
    ~/.cache/pacs_kernels, file device_profiles.json."""
    base = os.environ.get(PROFILE_DIR_ENV)
    if not base:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pacs_kernels"
    return Path(base) / PROFILE_FILE


def _read_stored(key: str) -> DeviceCosts | None:
    try:
        entry = json.loads(profile_path().read_text()).get(key)
        return None if entry is None else DeviceCosts(**entry)
    except (OSError, ValueError, TypeError):
        return None  # none stored, or unreadable: the class defaults


# ----------------------------------------------------------------------------- calibration (explicit only)

CALIBRATION_ROWS, CALIBRATION_INNER, CALIBRATION_COLS = 256, 512, 8192  # one GEMM of 2.1 GFLOP
CALIBRATION_PASS_ELEMENTS = 1 << 23  # 32 MiB of float32: past the caches, as a logits tile is
CALIBRATION_REPEATS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(CALIBRATION_REPEATS):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_costs(device: torch.device, dtype: torch.dtype) -> DeviceCosts:
    """Measure this device's :class:`DeviceCosts` now: the best of a few (256 x 512) @ (512 x 8192) GEMMs in the
    dtype the kernels use there (float32 on the CPU, the input dtype on a GPU), and of a few in-place ``exp_``
    passes over 8 M float32 elements (about 0.1 s on a 2-core CPU, milliseconds on a GPU)."""
    device = torch.device(device)
    low = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    gemm_dtype = dtype if low else (torch.float64 if dtype == torch.float64 else torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(CALIBRATION_ROWS, CALIBRATION_INNER, generator=gen, device=device).to(gemm_dtype)
    b = torch.randn(CALIBRATION_INNER, CALIBRATION_COLS, generator=gen, device=device).to(gemm_dtype)
    out = torch.empty(CALIBRATION_ROWS, CALIBRATION_COLS, device=device, dtype=gemm_dtype)
    gemm = _best_seconds(lambda: torch.mm(a, b, out=out), device)
    logits = torch.randn(CALIBRATION_PASS_ELEMENTS, generator=gen, device=device).mul_(1e-3)
    elementwise = _best_seconds(lambda: logits.exp_().sub_(1.0), device) / 2  # two passes per call
    flops = 2.0 * CALIBRATION_ROWS * CALIBRATION_INNER * CALIBRATION_COLS
    return DeviceCosts(gemm / flops, elementwise / CALIBRATION_PASS_ELEMENTS)


def calibrate_device_profile(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                             store: bool = True) -> DeviceProfile:
    """Measure ``device``'s costs for ``dtype`` (:func:`measure_costs`), keep them for this process and, with
    ``store``, write them to :func:`profile_path` for later ones; -> the device's profile with them. The only
    place that times the device or writes a profile (``pacs bench calibrate``); loss calls only read."""
    device = torch.device(device)
    costs = measure_costs(device, dtype)
    key = profile_key(device, dtype)
    with _lock:
        _profiles[key] = costs
    if store:
        path = profile_path()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = asdict(costs)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    return device_profile(device, dtype)


def set_device_costs(device: torch.device | str, dtype: torch.dtype, costs: DeviceCosts | None) -> None:
    """Use ``costs`` for ``device`` and ``dtype`` in this process (None: forget them; tests and benchmarks)."""
    key = profile_key(torch.device(device), dtype)
    with _lock:
        if costs is None:
            _profiles.pop(key, None)
        else:
            _profiles[key] = costs


def forget_calibrations() -> None:
    """Drop the in-memory calibrations and what was read of the stored profiles (the file stays)."""
    with _lock:
        _profiles.clear()
