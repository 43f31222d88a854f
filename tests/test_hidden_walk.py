"""The walk of ``hidden`` through a fused entry, as it runs: every call of a pacs_kernels function whose arguments
hold the caller's ``hidden`` or a copy of it (a view, a gather of its rows, a cast: ``hidden[selected]``,
``hidden.index_select``, ``hidden.to(dtype)`` ...; an object such as the checked batch holding one counts too) is a
stop. Consecutive stops in one file are one stay. The walk ends where the tensor enters a kernel (an autograd
Function's forward: below it is kernel code, checked by the kernel tests); the compatibility layer for moved
keywords (keywords.py) only forwards the caller's arguments and is not a stop.

Bound (issue 45): at most 12 stays, in at most 6 files, at most 4 returns to a file already left.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import pacs_kernels
from pacs_kernels import GRPO, PACS, LossOptions

PACKAGE = str(Path(pacs_kernels.__file__).resolve().parent)
MAX_STAYS, MAX_FILES, MAX_RETURNS = 12, 6, 4
NOT_STOPS = ("keywords.py",)
# ops whose result holds the values of their input (copies and views), not something computed from them
COPY_OPS = {"__getitem__", "index_select", "reshape", "view", "to", "contiguous", "clone", "detach", "flatten",
            "squeeze", "unsqueeze", "narrow", "float", "double", "half", "bfloat16", "expand", "t", "T",
            "requires_grad_", "as_strided", "select", "masked_select", "gather"}


class FollowCopies(TorchFunctionMode):
    """Tracks the copies of a tensor: the result of a copy-like op on a tracked tensor is tracked."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.kept = [tensor]  # held, so that no id is reused while the walk runs
        self.ids = {id(tensor)}

    def holds(self, value, depth: int = 0) -> bool:
        if isinstance(value, torch.Tensor):
            return id(value) in self.ids
        if depth > 1:
            return False
        if isinstance(value, (tuple, list)):
            return any(self.holds(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return any(self.holds(v, depth + 1) for v in value.values())
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return any(self.holds(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in COPY_OPS and self.holds(args) | self.holds(kwargs or {}):
            for out in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(out, torch.Tensor):
                    self.kept.append(out)
                    self.ids.add(id(out))
        return result


def walk_of_hidden(call, hidden: torch.Tensor) -> list[tuple[str, str]]:
    """(file relative to pacs_kernels, function) of each stop of ``hidden`` (or a copy) during ``call()``."""
    stops, inside_kernel = [], [None]
    mode = FollowCopies(hidden)

    def tracer(frame, event, arg):
        if event != "call" or inside_kernel[0] is not None:
            return None
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGE):
            return None
        code = frame.f_code
        n_args = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        file = str(Path(filename).relative_to(PACKAGE))
        if file.endswith(NOT_STOPS) or not any(mode.holds(frame.f_locals.get(name))
                                                for name in code.co_varnames[:n_args]):
            return None
        stops.append((file, code.co_qualname))
        first = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if code.co_name in ("forward", "backward") and type(first).__name__ in ("FunctionCtx", "BackwardCFunction") \
                or hasattr(first, "save_for_backward"):
            inside_kernel[0] = frame  # the kernel boundary: nothing below it is a stop

            def local(frame_, event_, arg_):
                if event_ == "return" and frame_ is inside_kernel[0]:
                    inside_kernel[0] = None
                return local
            return local
        return None

    previous = sys.gettrace()
    with mode:
        sys.settrace(tracer)
        try:
            call()
        finally:
            sys.settrace(previous)
    return stops


def stays_of(stops) -> list[str]:
    """The files of the walk, consecutive stops in one file merged."""
    stays = []
    for file, _ in stops:
        if not stays or stays[-1] != file:
            stays.append(file)
    return stays


def files_left_and_revisited(stops) -> list[str]:
    """Files the walk comes back to after leaving them."""
    stays = stays_of(stops)
    return [file for i, file in enumerate(stays) if file in stays[:i]]


def inputs(packed: bool):
    gen = torch.Generator().manual_seed(3)
    b, t, d, v = 4, 5, 8, 11
    hidden = torch.randn(b, t, d, generator=gen)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, -1] = False
    targets = torch.randint(0, v, (b, t), generator=gen)
    old = -torch.rand(b, t, generator=gen)
    extra = {}
    if packed:
        hidden, targets, old, mask = hidden.reshape(b * t, d), targets.reshape(-1), old.reshape(-1), mask.reshape(-1)
        extra["cu_seqlens"] = torch.arange(0, b * t + 1, t)
    return hidden, torch.randn(v, d, generator=gen), targets, mask, old, torch.tensor([1.0, 0.0, 0.0, 1.0]), extra


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("path", ["single_pass", "two_pass", "one_sweep"])
@pytest.mark.parametrize("entry", ["pacs", "grpo", "objective"])
def test_hidden_walk_is_short(entry, path, packed):
    hidden, weight, targets, mask, old, rewards, extra = inputs(packed)
    options = LossOptions(path="auto" if path == "one_sweep" else path, backend="torch")
    if path == "one_sweep":
        if entry == "grpo":
            pytest.skip("fused_linear_grpo_loss takes no old_lse (fused_linear_objective_loss does)")
        with torch.no_grad():
            old, lse = pacs_kernels.linear_logprobs(hidden, weight, targets, return_lse=True)
        extra["old_lse"] = lse
    if entry == "objective":
        def call():
            pacs_kernels.fused_linear_objective_loss(hidden, weight, targets, mask, old, rewards, objective=GRPO(),
                                                     group_size=2, options=options, **extra)
    else:
        function = pacs_kernels.fused_linear_pacs_loss if entry == "pacs" else pacs_kernels.fused_linear_grpo_loss
        objective = PACS(beta=0.5) if entry == "pacs" else GRPO()

        def call():
            function(hidden, weight, targets, mask, old, rewards, group_size=2, objective=objective, options=options,
                     **extra)
    stops = walk_of_hidden(call, hidden)
    stays = stays_of(stops)
    assert stops and stops[0][0] == "fused.py", stops
    assert any(file == "engine/batch.py" for file, _ in stops), stops  # the copy hidden[selected] is followed
    assert len(stays) <= MAX_STAYS, stops
    assert len(set(stays)) <= MAX_FILES, stops
    assert len(files_left_and_revisited(stops)) <= MAX_RETURNS, stops


def test_the_walk_follows_copies_and_sees_a_return_to_a_file():
    stops = [("a.py", "f"), ("b.py", "g"), ("a.py", "h"), ("a.py", "k")]
    assert stays_of(stops) == ["a.py", "b.py", "a.py"] and files_left_and_revisited(stops) == ["a.py"]
    hidden = torch.randn(3, 4)
    mode = FollowCopies(hidden)
    with mode:
        picked = hidden[torch.tensor([0, 2])].to(torch.float64).reshape(-1)
        computed = hidden @ hidden.T
    assert mode.holds(picked) and not mode.holds(computed)
