"""What ``"auto"`` picks on CUDA, by measurement: the table a GPU benchmark run writes.

``benchmarks/gpu.sh`` races our implementations at real shapes and ``benchmarks/dispatch_table.py``
turns the CSV into ``dispatch.json``; committed as ``pacs_kernels/gpu_dispatch.json`` (or passed as
``LossOptions(dispatch_table=path)`` / ``linear_logprobs(dispatch_table=path)``; no environment variable
is read) it decides, on CUDA:

* the fused losses' ``path="auto"``: two passes where the run measured them faster than the single
  pass at the nearest measured size (the single pass is still only taken when the groups fit
  ``chunk_budget_mib``); and, for groups larger than the budget, the rebuilding single pass
  instead of the Triton two passes where the run measured it faster (its ``single_pass_lowmem``:
  a budget of a third of a group, each group in 3 tiles, 2 rebuilt);
* ``backend="auto"`` for the log-probs: "torch" where the run measured the torch backend faster than
  the Triton kernels, "triton" otherwise;
* the GEMM engine of the Triton backward (``grad_gemms``): the two gradient GEMMs on its staged dz
  chunk as Triton kernels or as ``torch.mm`` (cuBLAS), whichever the run measured faster (its
  ``grad_gemms`` op); cuBLAS where nothing was measured.

The packaged table is keyed by device: each GPU run's entries under its device name and compute capability; a
device it does not name (another GPU, even of the same capability) uses none of them, and gets the cost
model's defaults (engine/device.py). Entries match on (d, V) and the dtype exactly and on the nearest N (log
scale; N counts the tokens that get log-probs, as the fused losses look it up). Without a table, or for a
shape it does not hold, the defaults stand: single pass when the groups fit, Triton on CUDA, cuBLAS for the
Triton backward's gradient GEMMs.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

GRAD_GEMMS = ("torch", "triton")
PACKAGED_TABLE = Path(__file__).resolve().parent / "gpu_dispatch.json"


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple:
    """The devices of a table file: ((device_name, capability, entries), ...). A table holds one device (a GPU
    run's ``dispatch.json``: ``device_name``, ``capability``, ``entries``) or several (``devices``: a list of
    those; the packaged table)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the dispatch table {path} could not be read: {exc}") from exc
    devices = data.get("devices", [data])
    return tuple((d.get("device_name"), tuple(d["capability"]) if d.get("capability") else None,
                  tuple(d.get("entries", ()))) for d in devices)


def table_entries(table: str | None = None, *, device_name: str | None = None,
                  capability: tuple[int, int] | None = None) -> tuple:
    """The entries of the table ``table`` (a path, taken whole: the caller chose it for this device; None: the
    packaged one, of which only the entries measured on ``device_name`` with ``capability`` count: another
    GPU's timings are not this one's; no name given: the current CUDA device's, or, with no CUDA device, every
    device's, for tools). () where the table has none for the device."""
    if table:
        return tuple(e for _, _, entries in _load(str(table)) for e in entries)
    if not PACKAGED_TABLE.is_file():
        return ()
    if device_name is None:
        device_name, capability = _current_cuda_device()
    if device_name is None:  # no device named and none here (tools, tests on the CPU): every device's entries
        return tuple(e for _, _, entries in _load(str(PACKAGED_TABLE)) for e in entries)
    return tuple(e for name, cap, entries in _load(str(PACKAGED_TABLE))
                 if name == device_name and (cap is None or capability is None or cap == tuple(capability))
                 for e in entries)


def _current_cuda_device() -> tuple[str | None, tuple[int, int] | None]:
    """The current CUDA device's name and compute capability, or (None, None)."""
    import torch

    if not torch.cuda.is_available():
        return None, None
    return torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability())


def fastest(op: str, n_tokens: int, d: int, vocab: int, among: tuple[str, ...], dtype: str | None = None,
            table: str | None = None) -> str | None:
    """The fastest implementation among ``among`` measured for ``op`` at (d, V), the dtype (a name such as
    "bfloat16"; None: any) and the nearest N in ``table`` (None: the packaged one), or None."""
    candidates = [e for e in table_entries(table) if e.get("op") == op and e.get("d") == d and e.get("V") == vocab
                  and (dtype is None or e.get("dtype") == dtype) and any(k in e.get("ms", {}) for k in among)]
    if not candidates or n_tokens <= 0:
        return None
    entry = min(candidates, key=lambda e: abs(math.log(max(e["N"], 1)) - math.log(n_tokens)))
    times = {k: v for k, v in entry["ms"].items() if k in among}
    return min(times, key=times.get)


def prefer_two_pass(n_tokens: int, d: int, vocab: int, dtype: str | None = None, table: str | None = None) -> bool:
    """True where the table measured the Triton two-pass PACS loss (what the two passes run where this is
    asked) faster than the single pass."""
    return fastest("pacs_loss_fwd_bwd", n_tokens, d, vocab, ("single_pass", "triton"), dtype, table) == "triton"


def prefer_rebuild(n_tokens: int, d: int, vocab: int, dtype: str | None = None, table: str | None = None) -> bool:
    """True where the table measured the single pass rebuilding part of each group (groups larger than
    the budget) faster than the Triton two passes."""
    among = ("single_pass_lowmem", "triton")
    return fastest("pacs_loss_fwd_bwd", n_tokens, d, vocab, among, dtype, table) == "single_pass_lowmem"


def logprob_backend(n_tokens: int, d: int, vocab: int, dtype: str | None = None,
                    table: str | None = None) -> str | None:
    """"torch" or "triton" as measured for the log-probs at this shape, or None (no entry)."""
    return fastest("logprobs_fwd_bwd", n_tokens, d, vocab, ("triton", "torch"), dtype, table)


def grad_gemms(n_tokens: int, d: int, vocab: int, dtype: str | None, device_type: str,
               torch_accumulates_in_float32: bool = True, table: str | None = None) -> str:
    """The GEMMs that form dh and dW from the Triton backward's staged dz chunk: "torch" (torch.mm,
    cuBLAS on CUDA) or "triton" (grad_matmuls.py).

    The caller forces one by passing it (``LossOptions(grad_gemms=...)``). Otherwise, on CUDA: the faster
    as measured at this shape (the table's ``grad_gemms`` op), else "torch": a plain GEMM is what the
    vendor library is tuned for,
    and nothing has measured our kernels against it yet. Off CUDA (the Triton interpreter):
    "triton", the kernels the tests check. Also "triton" where torch.mm could not add a chunk's dW
    into the float32 buffer without rounding it to 16 bits first (``torch_accumulates_in_float32``
    False: a PyTorch without float32-output GEMMs, and several chunks).
    """
    if device_type != "cuda" or not torch_accumulates_in_float32:
        return "triton"
    return fastest("grad_gemms", n_tokens, d, vocab, GRAD_GEMMS, dtype, table) or "torch"


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (how the table names dtypes)."""
    return str(dtype).removeprefix("torch.")
