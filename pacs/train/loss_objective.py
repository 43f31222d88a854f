"""The configured loss as an objective: ``optim.algo`` and its settings -> ``PACS(...)``, ``GRPO(...)``, ``DAPO(...)``,
``DrGRPO(...)``, ``GSPO(...)``, ``CISPO(...)``, or a user's objective named ``module:Class``.

Built in one place for every route a micro-batch's loss takes (pacs/train/update.py's ``policy_loss``):
the fused loss straight from hidden states, and the group loss on log-probs known or gathered first (groups
run in parts, pacs/train/update.py's known_gradients; sequence parallelism).

Each built-in objective's settings come from the config (pacs_kernels/objectives/*.py has their math):

    pacs     optim.beta, advanced.optim.score, .advantage, .weighting, .score_function_term
    grpo     advanced.optim.clip_eps (the ratio's low side, and its high side unless advanced.optim.eps_high),
             advanced.optim.aggregation
    dapo     advanced.optim.eps_low, .eps_high (None: DAPO's 0.2 and 0.28, "clip-higher")
    dr_grpo  advanced.optim.eps_low, .eps_high (None: 0.2 and 0.2); its constant length L is rollout.max_new_tokens
    gspo     advanced.optim.eps_low, .eps_high (None: GSPO's 3e-4 and 4e-4, on the sequence ratio)
    cispo    advanced.optim.eps_low, .eps_high (None: CISPO's 1.0 and 0.28, on the IS weight)

A user's objective, ``optim.algo=my_package.my_module:MyObjective`` (the module importable from where ``pacs train``
runs) or a name registered with ``pacs.registry.OBJECTIVES.register``: a class is built with no arguments (give its
fields defaults); any other callable is used as it is. It must satisfy pacs_kernels' ``Objective`` protocol
(docs/objectives.md). What the trainer needs to know of an objective it reads from the objective
(:func:`token_mean`), never from its name.
"""

from __future__ import annotations

from pacs.config import Config
from pacs.registry import OBJECTIVES
from pacs_kernels import CISPO, DAPO, GRPO, GSPO, PACS, DrGRPO


def config_settings(cfg: Config) -> dict[type, dict]:
    """Each built-in objective's class -> its keywords taken from the config (the module docstring)."""
    o = cfg.optim
    clip = {name: value for name, value in (("eps_low", o.eps_low), ("eps_high", o.eps_high)) if value is not None}
    return {PACS: dict(beta=o.beta, score=o.score, advantage=o.advantage, weighting=o.weighting,
                       score_function_term=o.score_function_term),
            GRPO: dict(clip_eps=o.clip_eps, clip_eps_high=o.eps_high, aggregation=o.aggregation),
            DAPO: clip, DrGRPO: dict(max_completion_length=cfg.rollout.max_new_tokens, **clip), GSPO: clip,
            CISPO: clip}


def loss_objective(cfg: Config):
    """The objective ``optim.algo`` names (pacs/registry.py's OBJECTIVES, or a user's ``module:Class``), a
    built-in one built from its settings (the module docstring); a ValueError naming ``optim.algo`` for a user's
    objective that cannot be imported or is not callable."""
    found = OBJECTIVES.resolve(cfg.optim.algo, "optim.algo")
    settings = config_settings(cfg)
    if isinstance(found, type) and found in settings:
        return found(**settings[found])
    return built_objective(found, cfg.optim.algo, None, "optim.algo")


def named_objective(name: str, settings: dict | None = None, *, where: str = "optim.algo"):
    """The objective ``name`` (a registered one's, or a user's ``module:Class``) built with ``settings``, the
    keywords of its class (for a built-in one: pacs_kernels/objectives/*.py); a ValueError naming ``where`` for an
    unknown name or setting. For the integrations, whose settings are a mapping (the trainer's:
    :func:`loss_objective`)."""
    found = OBJECTIVES.resolve(name, where)
    if name not in OBJECTIVES.builtin:
        return built_objective(found, name, settings, where)
    try:
        return found(**dict(settings or {}))
    except TypeError as exc:
        raise ValueError(f"{where}={name!r}: {exc}") from exc


def user_objective(spec: str, settings: dict | None = None, *, where: str = "optim.algo"):
    """``module:Name`` -> the objective: ``Name`` (dotted for a nested attribute) of the imported module, built with
    ``settings`` (none: no arguments) when it is a class."""
    return built_objective(OBJECTIVES.resolve(spec, where), spec, settings, where)


def built_objective(found, spec: str, settings: dict | None, where: str):
    """A user's objective as found (a class, built with ``settings`` or no arguments; any other callable as it
    is), checked to be callable."""
    settings = dict(settings or {})
    if isinstance(found, type):
        try:
            found = found(**settings)
        except TypeError as exc:
            raise ValueError(f"{where}={spec!r}: building the class with {settings or 'no arguments'} failed ({exc}); "
                             "give its settings defaults (or subclass it with yours)") from exc
    elif settings:
        raise ValueError(f"{where}={spec!r} is no class: it takes no settings, got {sorted(settings)}")
    if not callable(found):
        raise ValueError(f"{where}={spec!r} is a {type(found).__name__}, not an objective: it must be callable as "
                         "loss, stats = objective(logp, old_logp, rewards, mask, group_size=G) (docs/objectives.md)")
    return found


def token_mean(objective) -> bool:
    """Whether the objective's loss is one mean over its batch's response tokens (every token weighs the same,
    whichever response holds it), rather than a mean over responses: the trainer then weighs each micro-batch's
    loss by its tokens' share of the mini-batch, so that the mini-batch's gradient is its one token mean (TRL's and
    DAPO's), not a mean of the micro-batches' token means.

    Read from the objective: its ``aggregation`` attribute ("token_mean"; any other value, a mean over responses),
    which GRPO carries as a setting, DAPO and CISPO as a constant (token means by definition) and a user's objective
    declares the same way. Without a declaration: False."""
    return getattr(objective, "aggregation", None) == "token_mean"


def one_sweep_first_step(objective) -> bool:
    """Whether the objective can take the first mini-batch after a rollout (weights still the sampler's) in one
    vocabulary sweep from the rollout's log-sum-exp (``old_lse``): what its declared ``Capabilities`` say
    (``one_sweep``: a loss of the log-probs alone; PACS and the GRPO family without an entropy bonus). An objective
    that declares none is run as the engine runs it (pacs_kernels/objectives/rows.py): one sweep unless it uses
    the entropy."""
    declared = getattr(objective, "capabilities", None)
    if declared is not None:
        return bool(declared.one_sweep)
    return not getattr(objective, "uses_entropy", False)


def takes_response_validity(objective) -> bool:
    """Whether the objective takes a per-response validity mask (``valid=``: PACS's, which leaves a response out of
    its group's class counts): the rollout correction then drops a response by it and keeps its tokens; for any
    other objective it takes the response's tokens out of the mask (pacs/train/rollout_correction.py)."""
    declared = getattr(objective, "capabilities", None)
    return bool(declared is not None and declared.response_validity)
