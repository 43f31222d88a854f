"""fused_linear_objective_loss against naive logits + each objective's float64 reference: the loss and
its gradients with respect to hidden, weight and bias, padded and packed, on the engine's single pass and
two passes, float32 and float64, torch and triton (interpreter, tiny odd shapes: V and d no multiple of a
tile), and a user's own objective (a plain function)."""

import dataclasses

import pytest
import torch
from seeds import stable_seed

from pacs_kernels import LossOptions, fused_linear_objective_loss
from pacs_kernels import fused as fused_module
from pacs_kernels.engine.plan import budget_mib_for_tokens
from pacs_kernels.objectives import CISPO, DAPO, GRPO, GSPO, PACS, DrGRPO
from pacs_kernels.objectives.cispo import reference_cispo_loss
from pacs_kernels.objectives.dapo import reference_dapo_loss
from pacs_kernels.objectives.dr_grpo import reference_dr_grpo_loss
from pacs_kernels.objectives.grpo import reference_grpo_objective
from pacs_kernels.objectives.gspo import reference_gspo_loss
from pacs_kernels.objectives.pacs import reference_pacs_objective
from pacs_kernels.reference import naive_linear_logprobs

B, T, D, V, G = 8, 6, 13, 37, 4
TEMPERATURE = 0.8


def reinforce_with_group_baseline(logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
    """A user's objective: -(1/B) sum_i (R_i - mean_group R) * mean_t logp[i, t] (REINFORCE, group baseline)."""
    grouped = rewards.to(logp.dtype).reshape(-1, group_size)
    advantage = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    mean_logp = torch.where(mask, logp, 0.0).sum(-1) / mask.sum(-1)
    return -(advantage * mean_logp).mean(), {}


def reference_reinforce(_objective, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
    terms = []
    for i in range(logp.shape[0]):
        group = rewards[(i // group_size) * group_size:(i // group_size + 1) * group_size].double()
        terms.append(-(rewards[i].double() - group.mean()) * logp[i][mask[i]].double().mean())
    return torch.stack(terms).mean()


CASES = [
    ("grpo", GRPO(clip_eps_high=0.25, aggregation="seq_mean", kl_coef=0.05, entropy_coef=0.02),
     reference_grpo_objective, False),
    ("dapo", DAPO(kl_coef=0.05, entropy_coef=0.02), reference_dapo_loss, False),
    ("dr_grpo", DrGRPO(max_completion_length=8, kl_coef=0.05, entropy_coef=0.02), reference_dr_grpo_loss, False),
    ("gspo", GSPO(eps_low=0.05, eps_high=0.06, kl_coef=0.05, entropy_coef=0.02), reference_gspo_loss, False),
    ("cispo", CISPO(eps_low=0.1, eps_high=0.1, kl_coef=0.05, entropy_coef=0.02), reference_cispo_loss, False),
    ("pacs", PACS(beta=0.5, kl_coef=0.05, entropy_coef=0.02), reference_pacs_objective, True),
    ("custom", reinforce_with_group_baseline, reference_reinforce, False),
]
BY_NAME = {case[0]: case for case in CASES}


def make_inputs(seed, binary_rewards):
    """Padded rows whose responses end at different lengths (the padding after them masked out)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen)
    weight = 0.4 * torch.randn(V, D, generator=gen)
    bias = 0.5 * torch.randn(V, generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.25) & (torch.arange(T)[None, :] < lengths[:, None])
    mask[:, 0] = True
    targets = targets.masked_fill(~mask, -1)  # never read
    with torch.no_grad():
        logp, _ = naive_linear_logprobs(hidden.double(), weight.double(), targets.clamp(min=0),
                                        temperature=TEMPERATURE, bias=bias.double())
    old = (logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float().masked_fill(~mask, 50.0)
    ref = (logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float().masked_fill(~mask, -50.0)
    if binary_rewards:
        rewards = (torch.arange(B) % 3 == 0).float()
    else:
        rewards = torch.randn(B, generator=gen)
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, mask=mask, old=old, ref=ref, rewards=rewards,
                lengths=lengths)


def expected_loss_and_grads(case, data, on_policy):
    _, objective, reference, _ = case
    hidden, weight = data["hidden"].double().requires_grad_(), data["weight"].double().requires_grad_()
    bias = data["bias"].double().requires_grad_()
    logp, entropy = naive_linear_logprobs(hidden, weight, data["targets"].clamp(min=0), temperature=TEMPERATURE,
                                          bias=bias)
    old = None if on_policy else data["old"]
    loss = reference(objective, logp, old, data["rewards"], data["mask"], group_size=G, ref_logp=data["ref"],
                     entropy=entropy)
    loss.backward()
    return loss, hidden.grad, weight.grad, bias.grad


def without_entropy(case):
    """The case with entropy_coef = 0 (an entropy bonus needs the two passes: the single pass's entropy has no
    gradient)."""
    name, objective, reference, binary = case
    if dataclasses.is_dataclass(objective):
        objective = dataclasses.replace(objective, entropy_coef=0.0)
    return name, objective, reference, binary


def one_group_budget(data):
    """A chunk budget of about one group's tokens: several chunks, and a group larger than it rebuilt in part."""
    group_tokens = data["mask"].sum(-1).reshape(-1, G).sum(-1)
    return budget_mib_for_tokens(int(group_tokens.float().mean()), V, torch.device("cpu"), torch.float32)


@pytest.fixture
def paths_run(monkeypatch):
    """The paths the engine planned (engine/plan.py's plan_loss, as the fused entries call it), in call order."""
    chosen = []
    original = fused_module.plan_loss

    def spy(*args, **kwargs):
        plan = original(*args, **kwargs)
        chosen.append(plan.path)
        return plan

    monkeypatch.setattr(fused_module, "plan_loss", spy)
    return chosen


def fused(case, data, on_policy, backend, packed=False, path="auto", dtype=torch.float32, chunk_budget_mib=None):
    hidden = data["hidden"].to(dtype).clone().requires_grad_()
    weight = data["weight"].to(dtype).clone().requires_grad_()
    bias = data["bias"].to(dtype).clone().requires_grad_()
    inputs = dict(hidden=hidden, targets=data["targets"], mask=data["mask"], old=data["old"].to(dtype),
                  ref=data["ref"].to(dtype))
    cu_seqlens = None
    if packed:  # each response's first `length` tokens, back to back: no padding at all
        keep = torch.arange(T)[None, :] < data["lengths"][:, None]
        inputs = {key: value[keep] for key, value in inputs.items()}
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), data["lengths"].cumsum(0)])
    loss, stats = fused_linear_objective_loss(
        inputs["hidden"], weight, inputs["targets"], inputs["mask"], None if on_policy else inputs["old"],
        data["rewards"], objective=case[1], group_size=G,
        options=LossOptions(temperature=TEMPERATURE, backend=backend, path=path, chunk_budget_mib=chunk_budget_mib),
        ref_logp=inputs["ref"], bias=bias, cu_seqlens=cu_seqlens)
    loss.backward()
    return loss, stats, hidden.grad, weight.grad, bias.grad


def assert_matches(got, expected, float64=False):
    loss, _, d_hidden, d_weight, d_bias = got
    want_loss, want_hidden, want_weight, want_bias = expected
    rtol, atol = (1e-9, 1e-11) if float64 else (1e-4, 1e-6)
    torch.testing.assert_close(loss.double(), want_loss, rtol=rtol / 10, atol=atol)
    torch.testing.assert_close(d_hidden.double(), want_hidden, rtol=rtol, atol=atol)
    torch.testing.assert_close(d_weight.double(), want_weight, rtol=rtol, atol=atol)
    torch.testing.assert_close(d_bias.double(), want_bias, rtol=rtol, atol=atol)
    assert want_weight.abs().sum() > 0


@pytest.mark.parametrize("on_policy", [False, True], ids=["off_policy", "on_policy"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_fused_torch_padded_matches_reference(name, on_policy):
    case = BY_NAME[name]
    data = make_inputs(stable_seed("padded", name, on_policy), case[3])
    got = fused(case, data, on_policy, "torch")
    assert_matches(got, expected_loss_and_grads(case, data, on_policy))
    assert bool((got[2][~data["mask"]] == 0).all())  # prompt/padding rows of hidden get no gradient


@pytest.mark.parametrize("name", list(BY_NAME))
def test_fused_torch_packed_matches_reference(name):
    case = BY_NAME[name]
    data = make_inputs(stable_seed("packed", name), case[3])
    # the packed hidden is a gather of the padded leaf: its gradient comes back in the padded layout
    assert_matches(fused(case, data, False, "torch", packed=True), expected_loss_and_grads(case, data, False))


@pytest.mark.parametrize("name", list(BY_NAME))
def test_fused_triton_interpreter_matches_reference(name):
    case = BY_NAME[name]
    data = make_inputs(stable_seed("triton", name), case[3])
    assert_matches(fused(case, data, False, "triton"), expected_loss_and_grads(case, data, False))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("path", ["single_pass", "two_pass"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_float64_every_objective_layout_and_path(name, path, packed, paths_run):
    """Float64 end to end against the objective's float64 reference: each objective on each layout and each
    of the engine's paths (the single pass with a budget of about one group: several chunks, some rebuilt)."""
    case = without_entropy(BY_NAME[name]) if path == "single_pass" else BY_NAME[name]
    data = make_inputs(stable_seed("float64", name, path, packed), case[3])
    got = fused(case, data, False, "torch", packed=packed, path=path, dtype=torch.float64,
                chunk_budget_mib=one_group_budget(data))
    assert paths_run == [path]
    assert_matches(got, expected_loss_and_grads(case, data, False), float64=True)


@pytest.mark.parametrize("name", ["grpo", "gspo", "pacs", "custom"])
def test_single_pass_on_policy_float32(name, paths_run):
    """On-policy (old_logp None) on the single pass, float32, several chunks."""
    case = without_entropy(BY_NAME[name])
    data = make_inputs(stable_seed("single_on_policy", name), case[3])
    got = fused(case, data, True, "torch", path="single_pass", chunk_budget_mib=one_group_budget(data))
    assert paths_run == ["single_pass"]
    assert_matches(got, expected_loss_and_grads(case, data, True))


@pytest.mark.parametrize("name", ["gspo", "pacs"])
def test_single_pass_triton_row_kernels(name, paths_run):
    """The single pass with the Triton row kernels (interpreter), several chunks."""
    case = without_entropy(BY_NAME[name])
    data = make_inputs(stable_seed("single_triton", name), case[3])
    got = fused(case, data, False, "triton", path="single_pass", chunk_budget_mib=one_group_budget(data))
    assert paths_run == ["single_pass"]
    assert_matches(got, expected_loss_and_grads(case, data, False))


def batch_normalized_objective(logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
    """Couples groups through their log-probs (the batch-wide variance of the responses' mean log-probs)."""
    mean_logp = torch.where(mask, logp, 0.0).sum(-1) / mask.sum(-1)
    return (mean_logp - mean_logp.mean()).pow(2).mean(), {}


def test_single_pass_refuses_an_objective_that_couples_groups():
    data = make_inputs(8, False)
    case = ("coupled", batch_normalized_objective, None, False)
    with pytest.raises(ValueError, match="couples groups"):
        fused(case, data, False, "torch", path="single_pass", chunk_budget_mib=one_group_budget(data))
    with pytest.warns(RuntimeWarning, match="couples groups.*two passes instead"):
        got = fused(case, data, False, "torch", path="auto", chunk_budget_mib=one_group_budget(data))
    want = fused(case, data, False, "torch", path="two_pass")
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[3], want[3])


def test_entropy_objective_on_single_pass_is_refused():
    data = make_inputs(9, False)
    with pytest.raises(ValueError, match="entropy"):
        fused(BY_NAME["dapo"], data, False, "torch", path="single_pass")


def test_moved_keywords_warn_and_unknown_ones_fail():
    data = make_inputs(10, False)
    args = (data["hidden"], data["weight"], data["targets"], data["mask"], None, data["rewards"])
    with pytest.warns(DeprecationWarning, match=r"options=LossOptions\(temperature=0.8, backend='torch'\)"):
        old_style, _ = fused_linear_objective_loss(*args, objective=DAPO(), group_size=G, temperature=TEMPERATURE,
                                                   backend="torch")
    new_style, _ = fused_linear_objective_loss(*args, objective=DAPO(), group_size=G,
                                               options=LossOptions(temperature=TEMPERATURE, backend="torch"))
    torch.testing.assert_close(old_style, new_style)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        fused_linear_objective_loss(*args, group_size=G, temprature=TEMPERATURE)


def test_fused_stats_are_the_objectives():
    case = BY_NAME["dapo"]
    data = make_inputs(5, False)
    _, stats, _, _, _ = fused(case, data, False, "torch")
    assert set(stats) >= {"loss", "clip_frac", "ratio_mean", "kl_mean", "entropy_mean"}
    assert stats["clip_frac"] > 0 and stats["entropy_mean"] > 0


@pytest.mark.parametrize("changes,error,match", [
    (dict(objective="dapo"), TypeError, "objective"),
    (dict(objective=lambda *a, **k: 1.0), TypeError, "objective must return"),
    (dict(group_size=3), ValueError, "group_size"),
    (dict(rewards=torch.ones(B - 1)), ValueError, "rewards"),
    (dict(rewards=[0.0] * B), TypeError, "rewards"),
    (dict(ref_logp=torch.zeros(B, T - 1)), ValueError, "ref_logp"),
    (dict(old_logp=torch.zeros(B, T + 1)), ValueError, "old_logp"),
    (dict(mask=torch.zeros(B, T, dtype=torch.bool)), ValueError, "mask"),
    (dict(hidden=torch.zeros(B * T, D)), ValueError, "hidden"),
    (dict(weight=torch.zeros(V, D + 1)), ValueError, "weight|hidden"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(objective=PACS()), ValueError, "0/1"),  # PACS needs labels; real rewards refused
])
def test_fused_bad_inputs(changes, error, match):
    data = make_inputs(6, False)
    args = dict(hidden=data["hidden"], weight=data["weight"], targets=data["targets"], mask=data["mask"],
                rewards=data["rewards"], objective=DAPO(), group_size=G, old_logp=None, ref_logp=None,
                temperature=1.0, backend="torch")
    args.update(changes)
    options = dict(temperature=args.pop("temperature"), backend=args.pop("backend"))
    with pytest.raises(error, match=match):
        args["options"] = LossOptions(**options)
        fused_linear_objective_loss(args.pop("hidden"), args.pop("weight"), args.pop("targets"), args.pop("mask"),
                                    args.pop("old_logp", None), args.pop("rewards"), **args)


def test_grpo_and_pacs_objectives_equal_the_existing_fused_losses():
    """The plug-in path (rows) gives what fused_linear_grpo_loss / fused_linear_pacs_loss give."""
    from pacs_kernels import fused_linear_grpo_loss, fused_linear_pacs_loss

    for name, existing, options in [
        ("grpo", fused_linear_grpo_loss, dict(clip_eps_high=0.25, aggregation="seq_mean", kl_coef=0.05)),
        ("pacs", fused_linear_pacs_loss, dict(beta=0.5)),
    ]:
        data = make_inputs(stable_seed("existing", name), name == "pacs")
        objective = GRPO(**options) if name == "grpo" else PACS(**options)
        got = fused((name, objective, None, None), data, False, "torch")
        hidden, weight = data["hidden"].clone().requires_grad_(), data["weight"].clone().requires_grad_()
        extra = dict(ref_logp=data["ref"]) if name == "grpo" else {}
        loss = existing(hidden, weight, data["targets"], data["mask"], data["old"], data["rewards"], group_size=G,
                        objective=objective, options=LossOptions(temperature=TEMPERATURE, backend="torch"),
                        bias=data["bias"], **extra)
        loss.backward()
        torch.testing.assert_close(got[0], loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2], hidden.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got[3], weight.grad, rtol=1e-4, atol=1e-6)


def test_every_fused_entry_takes_one_argument_order():
    """The fused entries share their leading arguments, in one order, and the objective is a keyword everywhere:
    going from PACS to DAPO changes only ``objective=``."""
    import inspect

    import pacs_kernels

    order = ["hidden", "weight", "targets", "mask", "old_logp", "rewards"]
    for entry in (pacs_kernels.fused_linear_pacs_loss, pacs_kernels.fused_linear_grpo_loss,
                  pacs_kernels.fused_linear_objective_loss):
        parameters = inspect.signature(entry).parameters
        assert list(parameters)[:6] == order, entry.__name__
        assert parameters["objective"].kind is inspect.Parameter.KEYWORD_ONLY, entry.__name__
    forward = list(inspect.signature(pacs_kernels.PACSLoss.forward).parameters)[1:7]
    assert forward == ["hidden", "lm_head_weight", *order[2:]]
    data = make_inputs(5, True)
    common = (data["hidden"], data["weight"], data["targets"], data["mask"], None, data["rewards"])
    pacs, _ = pacs_kernels.fused_linear_objective_loss(*common, objective=PACS(), group_size=G)
    torch.testing.assert_close(pacs, pacs_kernels.fused_linear_pacs_loss(*common, objective=PACS(), group_size=G))


def test_the_objective_entrys_earlier_order_still_runs_with_a_warning():
    data = make_inputs(6, False)
    head, old = (data["hidden"], data["weight"], data["targets"], data["mask"]), data["old"]
    want, _ = fused_linear_objective_loss(*head, old, data["rewards"], objective=DAPO(), group_size=G)
    with pytest.warns(DeprecationWarning, match=r"takes \(hidden, weight, targets, mask, old_logp, rewards"):
        got, _ = fused_linear_objective_loss(*head, data["rewards"], DAPO(), group_size=G, old_logp=old)
    torch.testing.assert_close(got, want)
    with pytest.warns(DeprecationWarning, match=r"old_logp=None is on-policy"):
        got, _ = fused_linear_objective_loss(*head, data["rewards"], objective=DAPO(), group_size=G, old_logp=old)
    torch.testing.assert_close(got, want)
