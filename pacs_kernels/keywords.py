"""The fused entries' keyword arguments: the batch's optional inputs pass through; a knob that moved to the
options object or to the objective still works, with a DeprecationWarning naming its new home; anything
else is a TypeError naming it."""

from __future__ import annotations

import warnings
from dataclasses import fields, replace

from .options import OPTION_FIELDS, LossOptions


def sort_keywords(function: str, keywords: dict, *, inputs: tuple[str, ...], objective, options: LossOptions | None):
    """-> (objective with its moved fields, LossOptions with its moved fields, the inputs given).

    ``inputs``: the keyword names ``function`` takes as batch inputs; ``objective``: the objective in force
    (a frozen dataclass instance) whose fields may also come as keywords."""
    if options is not None and not isinstance(options, LossOptions):
        raise TypeError(f"{function}(): options must be a LossOptions, got {type(options).__name__}")
    objective_fields = {f.name for f in fields(objective)} if objective is not None else set()
    given, moved_options, moved_objective = {}, {}, {}
    for name, value in keywords.items():
        if name in inputs:
            given[name] = value
        elif name in OPTION_FIELDS:
            moved_options[name] = value
        elif name in objective_fields:
            moved_objective[name] = value
        else:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    options = options or LossOptions()
    if moved_options:
        _warn(function, moved_options, f"options=LossOptions({_spelled(moved_options)})")
        options = replace(options, **moved_options)
    if moved_objective:
        _warn(function, moved_objective, f"objective={type(objective).__name__}({_spelled(moved_objective)})")
        objective = replace(objective, **moved_objective)
    return objective, options, given


def _spelled(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _warn(function: str, values: dict, new_home: str) -> None:
    warnings.warn(f"{function}({', '.join(f'{k}=...' for k in values)}) is deprecated: pass {new_home}",
                  DeprecationWarning, stacklevel=4)


def moved_keywords(function: str, *, default_objective=None):
    """Decorator: ``function``'s keywords that moved to ``options=LossOptions(...)`` or to its objective (``beta=``,
    ``path=``, ``temperature=``, ...) still work, with a DeprecationWarning naming their new home. The decorated
    function's signature (``inspect.signature``) is its own: every input an explicit parameter; only a moved
    keyword is caught here, anything else unknown is a TypeError naming it."""
    import functools
    import inspect

    def wrap(fn):
        signature = inspect.signature(fn)
        names = set(signature.parameters)

        @functools.wraps(fn)
        def wrapper(*args, **keywords):
            moved = {k: v for k, v in keywords.items() if k not in names}
            if not moved:
                return fn(*args, **keywords)
            bound = signature.bind_partial(*args, **{k: v for k, v in keywords.items() if k in names})
            objective = bound.arguments.get("objective")
            if objective is None and default_objective is not None:
                objective = default_objective()
            objective_fields = objective if objective is not None and hasattr(objective, "__dataclass_fields__") \
                else None
            objective, options, _ = sort_keywords(function, moved, inputs=(), objective=objective_fields,
                                                  options=bound.arguments.get("options"))
            bound.arguments["options"] = options
            if objective is not None:
                bound.arguments["objective"] = objective
            return fn(*bound.args, **bound.kwargs)

        return wrapper

    return wrap
