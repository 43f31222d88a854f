"""Causal attention over every sequence of a packed row in one kernel: PyTorch's flash varlen attention.

A packed row (pacs/model/packing.py) holds B sequences back to back; each attends to itself only. Without the
``flash_attn`` package, ``pacs_packed_sdpa`` ran ``scaled_dot_product_attention`` once per sequence and
layer: exact, O(N) memory, but on a GPU B launches per layer and direction, each too small to fill the
device when sequences are short (RL rollouts: many responses of a few hundred tokens). PyTorch ships the
flash kernel's variable-length form itself (``torch.nn.attention.varlen.varlen_attn``, CUDA, fp16/bf16):
one launch takes the whole row and the sequence offsets, ``cu_seqlens``, which the packed call already
carries. This module calls it where it is exact and falls back to the per-sequence loop everywhere else.

The same mathematics either way: for each sequence [s, e) and head h, out[t] = softmax_j<=t(q_t . k_j *
scale) v_j over j in [s, t]; the kernel's backward is its own (flash's recomputation, no (N, N) scores).

When it runs (:func:`varlen_unavailable` says why not, otherwise):
  * on CUDA, fp16/bf16 (under autocast, the inputs cast to its dtype first, as autocast casts SDPA's: with
    float32 master weights Hugging Face's RoPE hands over a float32 query and key), no dropout, head_dim
    <= 256 and a multiple of 8, query heads a multiple of the key/value heads, none of the extras the loop's
    SDPA call would handle (a position bias, attention sinks, soft-capping);
  * the installed PyTorch's ``varlen_attn`` takes causality (``is_causal=`` in 2.10, ``window_size=(-1, 0)``
    later), the scale where it is not the default 1/sqrt(D) (``scale=``), and grouped key/value heads
    (``enable_gqa=`` where the signature has it, else natively, as flash does);
  * a self-check passed: the first call for each (device, dtype, heads, head_dim, scale) runs the kernel
    and its backward, in a thread of its own, on four random sequences (one longer than a kernel tile)
    against float32 SDPA per sequence; a failure (an error, or a result off by more than the dtype's
    rounding) warns once and keeps that configuration on the loop, so an incompatible PyTorch costs speed,
    never a wrong gradient.

A layer that is not causal is refused by the callers (pacs/model/packing.py's ``require_causal``), never computed
as causal.

``PACS_PACKED_ATTENTION`` picks by hand: ``auto`` (the default, the above), ``loop`` (always the
per-sequence SDPA), ``varlen`` (an error naming the reason where the kernel cannot run).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading
import warnings

import torch

ENGINE_VARIABLE = "PACS_PACKED_ATTENTION"
ENGINES = ("auto", "loop", "varlen")
KERNEL_DEVICE_TYPES = ("cuda",)  # where varlen_attn has a kernel (tests widen these two to run it on a CPU fake)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_LOOP_ONLY_EXTRAS = ("position_bias", "s_aux", "softcap")  # Hugging Face attention keywords flash varlen lacks
_self_checks: dict[tuple, str | None] = {}  # configuration -> None (passed) or why it failed
_decisions: dict[tuple, str | None] = {}  # configuration -> None (the kernel runs) or why the loop runs
_reported: set[tuple] = set()


def requested_engine() -> str:
    """``PACS_PACKED_ATTENTION`` (``auto`` when unset); a ValueError naming the variable for any other value."""
    engine = os.environ.get(ENGINE_VARIABLE, "auto").strip().lower() or "auto"
    if engine not in ENGINES:
        raise ValueError(f"{ENGINE_VARIABLE}={os.environ[ENGINE_VARIABLE]!r}: expected one of {', '.join(ENGINES)}")
    return engine


@functools.cache
def _varlen_kernel():
    """(varlen_attn, its keyword names) from the installed PyTorch, or (None, why not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return None, f"this PyTorch ({torch.__version__}) has no torch.nn.attention.varlen ({exc})"
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _causal_keywords(params: frozenset) -> dict | None:
    if "is_causal" in params:  # PyTorch 2.10's signature
        return {"is_causal": True}
    if "window_size" in params:  # later ones: (-1, 0) is causal
        return {"window_size": (-1, 0)}
    return None


def _default_scale(scaling: float | None, head_dim: int) -> bool:
    return scaling is None or math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-6)


def _device_or_dtype_obstacle(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type not in KERNEL_DEVICE_TYPES:
        return f"no varlen kernel on {device.type} (only {', '.join(KERNEL_DEVICE_TYPES)})"
    if dtype not in KERNEL_DTYPES:
        return f"{dtype} (the flash kernel takes float16 and bfloat16)"
    return None


def check_requested_engine(device: torch.device, dtype: torch.dtype) -> None:
    """Before a run's first forward: ``PACS_PACKED_ATTENTION``'s value, and ``varlen`` where the kernel cannot
    run at all (this device or dtype); a ValueError naming the variable."""
    if requested_engine() == "varlen" and (why := _device_or_dtype_obstacle(device, dtype)):
        raise ValueError(f"{ENGINE_VARIABLE}=varlen: the packed rows' attention cannot run as one flash varlen call "
                         f"here: {why}; unset it (or set loop) to run SDPA once per sequence")


def varlen_unavailable(query: torch.Tensor, key: torch.Tensor, *, scaling: float | None = None,
                       dropout: float = 0.0, extras: dict | None = None) -> str | None:
    """Why one flash varlen call cannot compute this packed row's attention (None: it can). query
    (1, H, N, D), key (1, H_kv, N, D); ``extras``: the other keywords of a Hugging Face attention call."""
    head_dim, heads, kv_heads = query.shape[-1], query.shape[1], key.shape[1]
    why = _device_or_dtype_obstacle(query.device, query.dtype)
    if why:
        return why
    if (key.dtype, key.device) != (query.dtype, query.device):
        return f"key/value in {key.dtype} on {key.device}, query in {query.dtype} on {query.device}"
    if dropout:
        return f"attention dropout {dropout} (the varlen kernel has none)"
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} (the flash kernel takes multiples of 8 up to {MAX_HEAD_DIM})"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    extra = [name for name in _LOOP_ONLY_EXTRAS if (extras or {}).get(name) is not None]
    if extra:
        return f"the layer passes {', '.join(extra)}, which the varlen kernel does not take"
    kernel, params = _varlen_kernel()
    if kernel is None:
        return params
    if _causal_keywords(params) is None:
        return "this PyTorch's varlen_attn takes neither is_causal nor window_size"
    if not _default_scale(scaling, head_dim) and "scale" not in params:
        return f"scale {scaling} is not 1/sqrt({head_dim}) and this PyTorch's varlen_attn takes no scale"
    return None


def _run_kernel(query, key, value, cu_seqlens: torch.Tensor, max_len: int, scaling: float | None) -> torch.Tensor:
    """(1, H, N, D) x (1, H_kv, N, D) x 2 -> (1, H, N, D) (a view of the kernel's (N, H, D) output)."""
    kernel, params = _varlen_kernel()
    keywords = _causal_keywords(params)
    if "scale" in params and scaling is not None:
        keywords["scale"] = float(scaling)
    if "enable_gqa" in params and key.shape[1] != query.shape[1]:
        keywords["enable_gqa"] = True
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (N, heads, D), the last dim contiguous
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32).contiguous()
    return kernel(q, k, v, cu, cu, max_len, max_len, **keywords).transpose(0, 1).unsqueeze(0)


def loop_causal_attention(query, key, value, bounds: list[int], scaling: float | None = None,
                          dropout: float = 0.0) -> torch.Tensor:
    """The per-sequence reference: causal SDPA over each [bounds[i], bounds[i+1]) -> (1, H, N, D)."""
    gqa = key.shape[1] != query.shape[1]
    return torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, is_causal=True, scale=scaling,
            enable_gqa=gqa)
        for s, e in zip(bounds[:-1], bounds[1:]) if e > s], dim=2)


def _self_check(query, key, scaling: float | None) -> str | None:
    """Run the kernel, forward and backward, on four random sequences of this configuration (one longer than
    a kernel tile, the inputs laid out as Hugging Face's attention gets them) against per-sequence SDPA (float32
    for 16-bit kernels); None when it agrees to the dtype's rounding, else what went wrong.

    It runs in a thread of its own: autograd's thread-local state there is fresh, so the check's own graph never
    meets the caller's saved-tensor hooks (gradient checkpointing, activation offload), grad mode,
    inference mode or autocast (the first call usually comes from inside a decoder layer's forward)."""
    config = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1], scaling)
    result: list[str | None] = []
    thread = threading.Thread(target=lambda: result.append(_check_kernel(*config)), name="pacs-varlen-self-check")
    thread.start()
    thread.join()
    return result[0] if result else "the self-check's thread ended without a result"


def _check_kernel(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                  scaling: float | None) -> str | None:
    """:func:`_self_check`'s body, for a thread without autograd state; every failure is returned, as a reason."""
    bounds = [0, 5, 8, 20, 320]
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    reference_dtype = torch.float32 if sixteen_bit else dtype  # (tests run a float64 fake kernel)
    tolerance = (4 if sixteen_bit else 1000) * torch.finfo(dtype).eps
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        generator = torch.Generator(device=device).manual_seed(0)
        # (1, N, heads, D) memory seen as (1, heads, N, D): the projections' layout, after rotary embeddings too
        q, k, v, upstream = (torch.randn(1, bounds[-1], h, head_dim, device=device, dtype=dtype,
                                         generator=generator).transpose(1, 2)
                             for h in (heads, kv_heads, kv_heads, heads))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        cu = torch.tensor(bounds, device=device, dtype=torch.int32)
        with torch.enable_grad():
            try:
                out = _run_kernel(q, k, v, cu, max(e - s for s, e in zip(bounds[:-1], bounds[1:])), scaling)
                grads = torch.autograd.grad(out, (q, k, v), upstream)
            except Exception as exc:  # an incompatible PyTorch: keep the loop, say why
                return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            q_ref, k_ref, v_ref = (x.detach().to(reference_dtype).requires_grad_() for x in (q, k, v))
            ref = loop_causal_attention(q_ref, k_ref, v_ref, bounds, scaling)
            ref_grads = torch.autograd.grad(ref, (q_ref, k_ref, v_ref), upstream.to(reference_dtype))
        for name, got, want in zip(("output", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
            if tuple(got.shape) != tuple(want.shape):
                return f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            error = (got.to(reference_dtype) - want).abs().max().item()
            if not error <= tolerance * (1 + want.abs().max().item()):
                return f"{name} differs from per-sequence SDPA by {error:.3g}"
    except Exception as exc:  # the reference or the comparison failed: the kernel is not trusted either
        return f"{type(exc).__name__} while checking: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _inside_backward() -> bool:
    """Is this thread running an autograd backward (e.g. a checkpointed layer's recompute)? The self-check's
    thread would then wait for the autograd engine that this thread holds."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _configuration(query, key, scaling: float | None) -> tuple:
    """What the self-check and the report are kept by: (device, dtype, heads, key/value heads, head_dim, scale)."""
    return (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1],
            None if _default_scale(scaling, query.shape[-1]) else float(scaling))


def decision(query, key, scaling: float | None = None) -> str | None:
    """Why this configuration's packed attention runs the loop (a failed self-check included), None where the
    kernel ran for it or it has not been met yet."""
    return _decisions.get(_configuration(query, key, scaling))


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The attention's inputs in autocast's 16-bit dtype where autocast is on for their device, as autocast casts
    an SDPA call's: under bfloat16 autocast over float32 weights, Hugging Face's RoPE multiplies the 16-bit query
    and key by float32 cos/sin, so they arrive in float32 beside a 16-bit value, which the kernel would refuse."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def varlen_causal_attention(query, key, value, cu_seqlens: torch.Tensor, bounds: list[int], *,
                            scaling: float | None = None, dropout: float = 0.0,
                            extras: dict | None = None) -> torch.Tensor | None:
    """Causal attention of every packed sequence in one flash varlen call -> (1, H, N, D), or None where the
    caller's per-sequence loop must run (``PACS_PACKED_ATTENTION=loop``, :func:`varlen_unavailable`, a failed
    self-check). query (1, H, N, D), key/value (1, H_kv, N, D); ``bounds``: the row's offsets on the host
    (``cu_seqlens`` on any device, as the model got them); ``extras``: the Hugging Face call's other keywords."""
    engine = requested_engine()
    if engine == "loop":
        return None
    query, key, value = autocast_inputs(query, key, value)
    why = varlen_unavailable(query, key, scaling=scaling, dropout=dropout, extras=extras)
    config = _configuration(query, key, scaling)
    if why is None and config not in _self_checks and _inside_backward():
        return None  # first met in a backward (the check's thread would wait on this one): the loop, checked later
    if why is None:
        if config not in _self_checks:
            _self_checks[config] = _self_check(query, key, scaling)
            if _self_checks[config] is not None:
                warnings.warn(f"packed attention: PyTorch's varlen_attn failed its self-check for {config} "
                              f"({_self_checks[config]}); these layers run SDPA once per sequence instead",
                              stacklevel=2)
        why = _self_checks[config] and f"its self-check failed: {_self_checks[config]}"
    _decisions[config] = None if why is None or _decisions.get(config, why) is None else why
    if why is not None:
        if engine == "varlen":
            raise ValueError(f"{ENGINE_VARIABLE}=varlen: the packed row's attention cannot run as one flash varlen "
                             f"call: {why}; unset it (or set loop) to run SDPA once per sequence")
        return None
    max_len = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    return _run_kernel(query, key, value, cu_seqlens, max_len, scaling)


def new_decisions(device: torch.device | str) -> str | None:
    """What the packed rows' attention on ``device`` has run as, for each configuration (dtype, heads, head_dim,
    scale) met since the last call; None when there is nothing new, and on a device without the kernel (the
    CPU: always the loop, nothing to report). E.g. ``"bfloat16, 12 heads / 2 key-value heads of 128: one flash
    varlen call per layer"``; the trainers print it once per configuration."""
    device_type = torch.device(device).type
    if device_type not in KERNEL_DEVICE_TYPES:
        return None
    lines = []
    for config, why in _decisions.items():
        device, dtype, heads, kv_heads, head_dim, scale = config
        if config in _reported or device.type != device_type:
            continue
        _reported.add(config)
        what = "one flash varlen call per layer" if why is None else f"SDPA once per sequence ({why})"
        lines.append(f"{str(dtype).removeprefix('torch.')}, {heads} heads / {kv_heads} key-value heads of "
                     f"{head_dim}{'' if scale is None else f', scale {scale:g}'}: {what}")
    return "; ".join(lines) or None
