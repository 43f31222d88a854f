"""The walk of ``hidden`` through a fused entry: every function call (in pacs_kernels) whose arguments hold the
caller's very ``hidden`` tensor, or a view of it, is a stop. At most 20 stops, and each file visited in one
contiguous run: a reader following the parameter never comes back to a file already left."""

import sys
from pathlib import Path

import pytest
import torch

import pacs_kernels
from pacs_kernels import GRPO, PACS, LossOptions

PACKAGE = str(Path(pacs_kernels.__file__).resolve().parent)
MAX_STOPS = 20


def holds(value, hidden: torch.Tensor) -> bool:
    """value is hidden, or a view of it (a reshape of the contiguous input), or a tuple/dict holding one."""
    if isinstance(value, torch.Tensor):
        return value is hidden or value._base is hidden
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) and (v is hidden or v._base is hidden) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) and (v is hidden or v._base is hidden) for v in value.values())
    return False


def walk_of_hidden(call, hidden: torch.Tensor) -> list[tuple[str, str]]:
    """(file relative to pacs_kernels, function) of each stop of ``hidden`` during ``call()``, in order."""
    stops = []

    def tracer(frame, event, arg):
        if event != "call":
            return None
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGE):
            return None
        code = frame.f_code
        n_args = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        if any(holds(frame.f_locals.get(name), hidden) for name in code.co_varnames[:n_args]):
            stops.append((str(Path(filename).relative_to(PACKAGE)), code.co_name))
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(previous)
    return stops


def files_left_and_revisited(stops) -> list[str]:
    """Files the walk comes back to after leaving them."""
    seen, revisited, last = set(), [], None
    for file, _ in stops:
        if file != last and file in seen:
            revisited.append(file)
        seen.add(file)
        last = file
    return revisited


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
@pytest.mark.parametrize("path", ["single_pass", "two_pass"])
@pytest.mark.parametrize("entry", ["pacs", "grpo"])
def test_hidden_walk_is_short_and_never_returns(entry, path, packed):
    hidden, weight, targets, mask, old, rewards, extra = inputs(packed)
    function = pacs_kernels.fused_linear_pacs_loss if entry == "pacs" else pacs_kernels.fused_linear_grpo_loss
    objective = PACS(beta=0.5) if entry == "pacs" else GRPO()
    options = LossOptions(path=path, backend="torch")
    stops = walk_of_hidden(lambda: function(hidden, weight, targets, mask, old, rewards, group_size=2,
                                            objective=objective, options=options, **extra), hidden)
    assert stops and stops[0] == ("fused.py", f"fused_linear_{entry}_loss")
    assert len(stops) <= MAX_STOPS, stops
    assert not files_left_and_revisited(stops), stops


def test_the_walk_sees_a_return_to_a_file():
    stops = [("a.py", "f"), ("b.py", "g"), ("a.py", "h")]
    assert files_left_and_revisited(stops) == ["a.py"]
