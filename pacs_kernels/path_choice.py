"""What ``path="auto"`` runs: a cost model of the fused loss's paths, calibrated on the current device.

A path's time is modelled as its LM-head GEMMs plus its elementwise passes over the logits:

    single pass, rebuilt share r:  (3 + r) G + (SINGLE_PASS_PASSES + r REBUILD_PASSES) P
    two passes (eager torch):      4 G + TWO_PASS_PASSES P
    two passes (Triton kernels):   4 G + TRITON_TWO_PASS_PASSES P

with G = 2 N V d x (seconds per GEMM flop) and P = N V x (seconds per float32 elementwise pass element).
Not modelled: each tile's dW update streams the (V, d) float32 dW once, which makes tiles of few
tokens memory-bound (the raised budgets below keep tiles large). The two constants are a
:class:`DeviceCosts`, measured by :func:`calibrate` (a few small timed GEMMs and ``exp_`` passes, about
0.1 s on a CPU) once per device and dtype, kept in memory and, unless switched off
(:func:`set_disk_cache`), on disk under ``~/.cache/pacs_kernels/``. The pass counts are read off the
code (single_pass_rows.py, torch_chunked.py). On the CPU the eager two passes do more GEMMs and more
passes than any single pass, so the constants only matter against the Triton two passes (CUDA).

:func:`choose_path` returns the path and, for the single pass, its chunk budget. Where the caller gave
no budget (``chunk_budget_mib=None``) on the CPU, the budget may be raised from the device's default
to hold the largest group (or all the tokens; ties go to the smaller budget), up to
:data:`RAISED_BUDGET_SHARE` of the machine's memory: a group held whole is never built twice (3 GEMMs
instead of 3 + r); a group larger than that share gets the share, which rebuilds the least. On CUDA the default
budget stands (GPU memory belongs to the model) and the committed GPU table (dispatch.py) is the
calibration where it has an entry: its measured choice (two passes, or the rebuilding single pass)
overrides the model. A group larger than the budget goes to the Triton two passes where those run,
unless the table measured the rebuilding single pass faster (as before this model).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import dispatch
from .single_pass import (
    budget_mib_for_tokens,
    default_chunk_budget_mib,
    plan_group_chunks,
    recomputed_fraction,
    tile_memory,
)

# passes over each logit: eager rows (EagerRows) amax, subtract, exp, row sum, then the gradient's scale;
# Triton rows two reads. A rebuilt tile adds (eager) subtract lse and exp, (Triton) nothing: still two reads
SINGLE_PASS_PASSES = {"torch": 5.0, "triton": 2.0}
REBUILD_PASSES = {"torch": 2.0, "triton": 0.0}
TWO_PASS_PASSES = 7.0  # torch_chunked: logsumexp (max, subtract, exp, sum); backward: subtract, exp, scale
TRITON_TWO_PASS_PASSES = 2.0  # the Triton log-prob kernels read the logits in registers
RAISED_BUDGET_SHARE = 1 / 8  # the CPU single pass may hold up to this share of the machine's memory
CACHE_FILE = "path_costs.json"
CACHE_VERSION = 1
PATHS = ("single_pass", "two_pass")


@dataclass(frozen=True)
class DeviceCosts:
    """Calibrated constants of one device and dtype: seconds per GEMM flop, seconds per element of an
    elementwise pass over float32 logits."""

    gemm_s_per_flop: float
    pass_s_per_element: float

    def __post_init__(self):
        for name in ("gemm_s_per_flop", "pass_s_per_element"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"DeviceCosts.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class PathQuery:
    """What the choice depends on. ``counts``: response lengths (tokens) in order, ``group_size`` of them
    per group; ``budget_mib``: the caller's chunk budget (None: the device's default, which the choice may
    raise on the CPU); ``triton_two_pass``: whether the two passes would run the Triton log-prob kernels;
    ``row_kernels``: the single pass's row engine ("torch" | "triton"); ``dispatch_table``: another GPU run's
    table instead of the committed one (``LossOptions.dispatch_table``)."""

    device: torch.device
    dtype: torch.dtype
    d: int
    vocab: int
    counts: tuple[int, ...]
    group_size: int
    budget_mib: float | None = None
    softcap: bool = False
    triton_two_pass: bool = False
    row_kernels: str = "torch"
    dispatch_table: str | None = None

    @property
    def n_tokens(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class ModelledChoice:
    """The path, the single pass's chunk budget (MiB; None for two passes) and the modelled seconds of each
    candidate considered (for logs and benchmarks)."""

    path: str
    budget_mib: float | None
    modelled_s: dict


def largest_group_tokens(counts, group_size: int) -> int:
    """Tokens of the largest group of ``group_size`` consecutive responses."""
    counts = list(counts)
    return max((sum(counts[g:g + group_size]) for g in range(0, len(counts), group_size)), default=0)


def raised_budget_cap_mib(device: torch.device) -> float:
    """The largest budget the choice may raise an unset budget to: RAISED_BUDGET_SHARE of the CPU's memory
    (never below the default); on other devices the default (no raise)."""
    device = torch.device(device)
    default = default_chunk_budget_mib(device)
    if device.type != "cpu":
        return default
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return default
    return max(default, total * RAISED_BUDGET_SHARE / 2 ** 20)


def _single_pass_seconds(query: PathQuery, budget_mib: float | None, costs: DeviceCosts) -> float | None:
    """Modelled time of the single pass at ``budget_mib``, or None where it would not run there (a group
    larger than the budget while the Triton two passes are available and the GPU table did not measure
    the rebuilding single pass faster)."""
    memory = tile_memory(budget_mib, query.vocab, query.device, query.dtype, softcap=query.softcap,
                         row_kernels=query.row_kernels)
    counts = list(query.counts)
    fits = plan_group_chunks(counts, query.group_size, memory.tokens) is not None
    if not fits and query.triton_two_pass and not measured_rebuild_faster(
            query.device, query.n_tokens, query.d, query.vocab, query.dtype, query.dispatch_table):
        return None
    chunks = plan_group_chunks(counts, query.group_size, memory.tokens, oversized_alone=True)
    rebuilt = recomputed_fraction(chunks, memory.tokens)
    n, v, d = query.n_tokens, query.vocab, query.d
    rows = "triton" if query.row_kernels == "triton" else "torch"
    gemm = 2.0 * n * v * d * costs.gemm_s_per_flop
    passes = n * v * costs.pass_s_per_element
    return (3 + rebuilt) * gemm + (SINGLE_PASS_PASSES[rows] + rebuilt * REBUILD_PASSES[rows]) * passes


def _two_pass_seconds(query: PathQuery, costs: DeviceCosts) -> float:
    n, v, d = query.n_tokens, query.vocab, query.d
    passes = TRITON_TWO_PASS_PASSES if query.triton_two_pass else TWO_PASS_PASSES
    return 4 * 2.0 * n * v * d * costs.gemm_s_per_flop + passes * n * v * costs.pass_s_per_element


def measured_two_pass_faster(device: torch.device, n_tokens: int, d: int, vocab: int,
                             dtype: torch.dtype | None = None, table: str | None = None) -> bool:
    """On CUDA: did the committed GPU run (dispatch.py; ``table``: another run's table) measure two passes
    faster at this shape (and dtype)?"""
    name = None if dtype is None else dispatch.dtype_name(dtype)
    return device.type == "cuda" and dispatch.prefer_two_pass(n_tokens, d, vocab, name, table)


def measured_rebuild_faster(device: torch.device, n_tokens: int, d: int, vocab: int,
                            dtype: torch.dtype | None = None, table: str | None = None) -> bool:
    """On CUDA: did the committed GPU run (or ``table``) measure the rebuilding single pass (groups larger
    than the budget) faster than the Triton two passes at this shape (and dtype)?"""
    name = None if dtype is None else dispatch.dtype_name(dtype)
    return device.type == "cuda" and dispatch.prefer_rebuild(n_tokens, d, vocab, name, table)


def candidate_budgets(query: PathQuery) -> list[float | None]:
    """The single pass's budgets worth modelling: the caller's; or, with none given, the device's default
    and, on the CPU, budgets holding the largest group and all tokens, up to :func:`raised_budget_cap_mib`
    (the cap itself where the largest group needs more: its tiles then rebuild the least)."""
    if query.budget_mib is not None:
        return [query.budget_mib]

    default = default_chunk_budget_mib(query.device)
    cap = raised_budget_cap_mib(query.device)
    budgets: list[float | None] = [None]
    for tokens in (largest_group_tokens(query.counts, query.group_size), query.n_tokens):
        # past the cap, the cap: the largest budget allowed rebuilds the least of what it cannot hold
        mib = min(cap, budget_mib_for_tokens(tokens, query.vocab, query.device, query.dtype, softcap=query.softcap,
                                             row_kernels=query.row_kernels))
        if mib > default and mib not in budgets:
            budgets.append(mib)
    return budgets


def choose_path(query: PathQuery, costs: DeviceCosts | None = None) -> ModelledChoice:
    """The path of least modelled time for ``query`` (``costs``: None for :func:`device_costs`, calibrated
    and cached; tests pass their own). Deterministic given the costs: ties go to the single pass and to
    the smaller budget."""
    if query.triton_two_pass and measured_two_pass_faster(query.device, query.n_tokens, query.d, query.vocab,
                                                          query.dtype, query.dispatch_table):  # measured on this GPU
        return ModelledChoice("two_pass", None, {"two_pass": "measured faster (GPU table)"})
    costs = costs or device_costs(query.device, query.dtype)
    modelled: dict = {}
    best: tuple[float, str, float | None] | None = None
    for budget in candidate_budgets(query):
        seconds = _single_pass_seconds(query, budget, costs)
        if seconds is None:
            continue
        modelled[f"single_pass@{'default' if budget is None else f'{budget:.0f}MiB'}"] = seconds
        if best is None or seconds < best[0]:
            best = (seconds, "single_pass", budget)
    two = _two_pass_seconds(query, costs)
    modelled["two_pass"] = two
    if best is None or two < best[0]:
        best = (two, "two_pass", None)
    return ModelledChoice(best[1], best[2] if best[1] == "single_pass" else None, modelled)


# ----------------------------------------------------------------------------- calibration

CALIBRATION_ROWS, CALIBRATION_INNER, CALIBRATION_COLS = 256, 512, 8192  # one GEMM of 2.1 GFLOP
CALIBRATION_PASS_ELEMENTS = 1 << 23  # 32 MiB of float32: past the caches, as a logits tile is
CALIBRATION_REPEATS = 3

_lock = threading.Lock()
_memory: dict[str, DeviceCosts] = {}
NO_DISK_CACHE_ENV = "PACS_KERNELS_NO_DISK_CACHE"  # "1": calibrations stay in memory (tests, read-only homes)
_disk_cache: dict = {"enabled": True, "dir": None}


def set_disk_cache(enabled: bool, directory: str | os.PathLike | None = None) -> None:
    """Switch the on-disk calibration cache on or off (on by default, unless the environment variable
    ``PACS_KERNELS_NO_DISK_CACHE=1``, which child processes inherit), and optionally move it (default:
    ``$XDG_CACHE_HOME/pacs_kernels`` or ``~/.cache/pacs_kernels``)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    _disk_cache.update(enabled=enabled, dir=None if directory is None else Path(directory))


def cache_path() -> Path:
    base = _disk_cache["dir"]
    if base is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pacs_kernels"
    return Path(base) / CACHE_FILE


def device_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a calibration is valid for: the device's name, its threads (CPU) and the dtype."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        name = f"{_cpu_name()}, {torch.get_num_threads()} threads"
    else:
        name = device.type
    return f"{device.type}|{name}|{dispatch.dtype_name(dtype)}|v{CACHE_VERSION}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


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


def calibrate(device: torch.device, dtype: torch.dtype) -> DeviceCosts:
    """Measure this device's :class:`DeviceCosts` now: the best of a few (256 x 512) @ (512 x 8192) GEMMs
    in the dtype the kernels use there (float32 on the CPU, the input dtype on a GPU), and of a few in-place
    ``exp_`` passes over 8 M float32 elements (about 0.1 s on a 2-core CPU, milliseconds on a GPU)."""
    from .matmul import compute_dtype, gemm_in_input_dtype

    device = torch.device(device)
    gemm_dtype = dtype if gemm_in_input_dtype(device, dtype) else compute_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(CALIBRATION_ROWS, CALIBRATION_INNER, generator=gen, device=device).to(gemm_dtype)
    b = torch.randn(CALIBRATION_INNER, CALIBRATION_COLS, generator=gen, device=device).to(gemm_dtype)
    out = torch.empty(CALIBRATION_ROWS, CALIBRATION_COLS, device=device, dtype=gemm_dtype)
    gemm = _best_seconds(lambda: torch.mm(a, b, out=out), device)
    logits = torch.randn(CALIBRATION_PASS_ELEMENTS, generator=gen, device=device).mul_(1e-3)
    elementwise = _best_seconds(lambda: logits.exp_().sub_(1.0), device) / 2  # two passes per call
    flops = 2.0 * CALIBRATION_ROWS * CALIBRATION_INNER * CALIBRATION_COLS
    return DeviceCosts(gemm / flops, elementwise / CALIBRATION_PASS_ELEMENTS)


def _disk_enabled() -> bool:
    return _disk_cache["enabled"] and os.environ.get(NO_DISK_CACHE_ENV, "") != "1"


def _read_disk(key: str) -> DeviceCosts | None:
    if not _disk_enabled():
        return None
    try:
        entry = json.loads(cache_path().read_text()).get(key)
        return None if entry is None else DeviceCosts(**entry)
    except (OSError, ValueError, TypeError):
        return None  # a missing or unreadable cache: measure again


def _write_disk(key: str, costs: DeviceCosts) -> None:
    if not _disk_enabled():
        return
    path = cache_path()
    try:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = asdict(costs)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the in-memory cache still holds it


def device_costs(device: torch.device, dtype: torch.dtype) -> DeviceCosts:
    """This device's calibrated costs: from memory, else from the disk cache, else measured now (and stored)."""
    key = device_key(device, dtype)
    with _lock:
        costs = _memory.get(key) or _read_disk(key)
        if costs is None:
            costs = calibrate(device, dtype)
            _write_disk(key, costs)
        _memory[key] = costs
        return costs


def forget_calibrations() -> None:
    """Drop the in-memory calibrations (the disk cache stays; tests and benchmarks)."""
    with _lock:
        _memory.clear()
