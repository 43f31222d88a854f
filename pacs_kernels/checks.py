"""Input validation shared by every public entry point.

Every error names the argument, what was expected and what was received, so that a
user never meets a crash deep inside a kernel or a silently wrong answer.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
BACKENDS = ("auto", "triton", "torch", "naive")


def check_tensor(name: str, value, *, dtypes=None, ndim=None, min_ndim=None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(value.dtype).replace('torch.', '')}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    return value


def check_same_device(**tensors) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for k, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"all tensors must be on one device: {first_name} is on {first}, but {k} is on {dev}"
            )
    return first


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a positive number, got {temperature!r}")
    temperature = float(temperature)
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def check_targets_in_range(targets: torch.Tensor, vocab_size: int, name: str = "targets") -> None:
    """Targets must index the vocabulary. One reduction (a device sync on GPU)."""
    if targets.numel() == 0:
        return
    lo = int(targets.min())
    hi = int(targets.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"{name} must lie in [0, {vocab_size}) (the rows of weight), got values in [{lo}, {hi}]; "
            "padding positions need a valid token id (their log-probs are masked out by the loss)"
        )


def check_no_inf_where(name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    """No +-inf in ``values`` where the bool ``mask`` (same shape) is set: an infinite log-prob of a loss token
    gives a ratio of 0 or inf, which some losses turn into a silently zero gradient (NaN is left to show in the
    loss). One reduction (a device sync on GPU)."""
    bad = mask & torch.isinf(values)
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} must be finite on every token the mask selects (mask == 1), got "
                         f"{float(values[where])} at {where} ({int(bad.sum())} such tokens); a sampler's -inf for a "
                         "token outside its top-k/top-p, or padding left in the mask?")


def check_not_sharded(**tensors) -> None:
    """A DTensor (e.g. an FSDP2-sharded LM head read outside its module's forward) holds only this
    rank's shard: the kernels need the whole tensor, so refuse it with the fix rather than fail deep."""
    for name, value in tensors.items():
        if value is not None and type(value).__name__ == "DTensor":
            raise TypeError(
                f"{name} is a DTensor (sharded, e.g. by FSDP2's fully_shard): the kernels need the full tensor. "
                f"Read it inside the forward of the module FSDP wraps (where it is gathered), or pass "
                f"{name}.full_tensor()")


def check_linear_inputs(hidden, weight, targets, bias) -> tuple[int, int]:
    """Validate the (hidden, weight, targets, bias) quadruple; return (d, V)."""
    check_not_sharded(hidden=hidden, weight=weight, bias=bias)
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, min_ndim=1)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("targets", targets, dtypes=INT_DTYPES)
    vocab, d = weight.shape
    if hidden.shape[-1] != d:
        raise ValueError(
            f"hidden's last dimension must equal weight.shape[1] = {d} (the model width), "
            f"got hidden of shape {tuple(hidden.shape)}"
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    if vocab == 0 or d == 0:
        raise ValueError(f"weight must be non-empty (V, d), got shape {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden and weight must share a dtype, got hidden {hidden.dtype} and weight {weight.dtype}"
        )
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != vocab:
            raise ValueError(f"bias must have shape (V,) = ({vocab},), got {tuple(bias.shape)}")
    check_same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)
    return d, vocab
