"""The fused entries' public shape: every input an explicit parameter (no ``*args``/``**kwargs`` in any public
signature of pacs_kernels), the fused entries' shared arguments in one order, tuning knobs in one frozen
LossOptions, the loss's knobs in its objective; a keyword that moved still works with a DeprecationWarning
naming its new home, an unknown one is a TypeError naming it."""

import dataclasses
import inspect
import re
import warnings

import pytest
import torch

import pacs_kernels
from pacs_kernels import GRPO, PACS, LossOptions, PACSLoss, fused_linear_grpo_loss, fused_linear_pacs_loss


def public_callables():
    """Every public function of pacs_kernels and every public method of its public classes."""
    for name in pacs_kernels.__all__:
        value = getattr(pacs_kernels, name)
        if inspect.isfunction(value):
            yield name, value
        elif inspect.isclass(value):
            for attr, member in vars(value).items():
                if inspect.isfunction(member) and (not attr.startswith("_") or attr == "__init__") \
                        and member.__module__.startswith("pacs_kernels"):
                    yield f"{name}.{attr}", member


@pytest.mark.parametrize("name,function", list(public_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_no_hidden_inputs_in_public_signatures(name, function):
    """The signature as written in the source (a compatibility decorator's wrapper is not it)."""
    function = inspect.unwrap(function)
    kinds = {p.kind for p in inspect.signature(function, follow_wrapped=False).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds, name


def test_the_fused_entries_share_one_argument_order():
    """hidden, weight, targets, mask first; then each entry's per-response inputs; the optional per-token and
    per-batch inputs keyword-only under the same names."""
    shared = ["hidden", "weight", "targets", "mask"]
    for entry in (fused_linear_pacs_loss, fused_linear_grpo_loss, pacs_kernels.fused_linear_objective_loss):
        parameters = inspect.signature(entry).parameters
        assert list(parameters)[:4] == shared, entry.__name__
        for name in ("group_size", "options", "cu_seqlens", "bias", "piece"):
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, (entry.__name__, name)


def test_options_are_frozen_and_checked():
    options = LossOptions(path="two_pass", chunk_budget_mib=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.path = "single_pass"
    for bad, match in [(dict(path="fast"), "path"), (dict(backend="cuda"), "backend"),
                       (dict(chunk_budget_mib=0), "chunk_budget_mib"), (dict(temperature=0.0), "temperature"),
                       (dict(logit_softcap=-1.0), "logit_softcap"), (dict(grad_gemms="cublas"), "grad_gemms"),
                       # the two-pass knobs, checked here whatever path runs (the single pass ignored them)
                       (dict(chunk_elements=0), "chunk_elements"), (dict(chunk_elements=True), "chunk_elements"),
                       (dict(vocab_splits=-1), "vocab_splits"), (dict(filter_eps=-1.0), "filter_eps"),
                       (dict(filter_eps=float("nan")), "filter_eps"), (dict(filter_eps=True), "filter_eps")]:
        with pytest.raises(ValueError, match=match):
            LossOptions(**bad)


def batch():
    gen = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(4, 5, 8, generator=gen), torch.randn(13, 8, generator=gen)
    targets, mask = torch.randint(0, 13, (4, 5), generator=gen), torch.ones(4, 5, dtype=torch.bool)
    old = -torch.rand(4, 5, generator=gen)
    return hidden, weight, targets, mask, old, torch.tensor([1.0, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("function,old_keywords,new_keywords,homes", [
    (fused_linear_pacs_loss, dict(beta=0.5, score="mean_logp", path="two_pass", temperature=0.7),
     dict(objective=PACS(beta=0.5, score="mean_logp"), options=LossOptions(path="two_pass", temperature=0.7)),
     [r"options=LossOptions\(path='two_pass', temperature=0.7\)", r"objective=PACS\(beta=0.5, score='mean_logp'\)"]),
    (fused_linear_grpo_loss, dict(clip_eps=0.1, aggregation="seq_mean", chunk_budget_mib=1.0),
     dict(objective=GRPO(clip_eps=0.1, aggregation="seq_mean"), options=LossOptions(chunk_budget_mib=1.0)),
     [r"options=LossOptions\(chunk_budget_mib=1.0\)", r"objective=GRPO\(clip_eps=0.1, aggregation='seq_mean'\)"]),
])
def test_moved_keywords_warn_and_give_the_same_loss(function, old_keywords, new_keywords, homes):
    hidden, weight, targets, mask, old, rewards = batch()
    with pytest.warns(DeprecationWarning) as caught:
        before = function(hidden, weight, targets, mask, old, rewards, group_size=2, **old_keywords)
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    for home in homes:
        assert any(re.search(home, m) for m in messages), (home, messages)
    assert all(w.filename == __file__ for w in caught)  # pointed at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        after = function(hidden, weight, targets, mask, old, rewards, group_size=2, **new_keywords)
    torch.testing.assert_close(before, after)


def test_pacs_module_takes_the_old_keywords_with_a_warning():
    hidden, weight, targets, mask, old, rewards = batch()
    with pytest.warns(DeprecationWarning) as caught:
        old_style = PACSLoss(group_size=2, beta=0.5, temperature=0.7)
    assert sorted(str(w.message).split(": pass ")[1] for w in caught) == [
        "objective=PACS(beta=0.5)", "options=LossOptions(temperature=0.7)"]
    new_style = PACSLoss(group_size=2, objective=PACS(beta=0.5), options=LossOptions(temperature=0.7))
    assert old_style.objective == new_style.objective and old_style.options == new_style.options
    assert new_style.temperature == 0.7 and new_style.beta == 0.5
    new_style.temperature = 0.5  # the model-forward integration folds the logit scale in after construction
    assert new_style.options.temperature == 0.5
    torch.testing.assert_close(old_style(hidden, weight, targets, mask, old, rewards),
                               PACSLoss(group_size=2, objective=PACS(beta=0.5),
                                        options=LossOptions(temperature=0.7))(hidden, weight, targets, mask, old,
                                                                               rewards))


@pytest.mark.parametrize("call", [
    lambda args: fused_linear_pacs_loss(*args, group_size=2, betta=0.5),
    lambda args: fused_linear_grpo_loss(*args, group_size=2, clip_epsilon=0.1),
    lambda args: PACSLoss(group_size=2, temprature=1.0),
    lambda args: PACSLoss(group_size=2)(*args, retrun_stats=True),
])
def test_an_unknown_keyword_is_a_type_error_naming_it(call):
    with pytest.raises(TypeError, match=r"unexpected keyword argument '(betta|clip_epsilon|temprature|retrun_stats)'"):
        call(batch())


def test_objectives_of_the_wrong_kind_are_refused():
    args = batch()
    with pytest.raises(TypeError, match="objective must be a PACS"):
        fused_linear_pacs_loss(*args, group_size=2, objective=GRPO())
    with pytest.raises(TypeError, match="objective must be a GRPO"):
        fused_linear_grpo_loss(*args, group_size=2, objective=PACS())
    with pytest.raises(ValueError, match="fused_linear_objective_loss"):
        fused_linear_pacs_loss(*args, group_size=2, objective=PACS(kl_coef=0.1))
    with pytest.raises(TypeError, match="options must be a LossOptions"):
        fused_linear_pacs_loss(*args, group_size=2, options=dict(path="two_pass"))
