"""path="auto": the plan (pacs_kernels/engine/plan.py) is a pure function of a batch's shape, the options, the
objective's capabilities and a device profile (engine/device.py); the profile is read, never measured, in a loss
call; measuring is an explicit command that stores it; no loss call writes a file."""

from __future__ import annotations

import json
import os

import pytest
import torch

import pacs_kernels
from pacs_kernels import GRPO, PACS, LossOptions
from pacs_kernels.engine import device as device_module
from pacs_kernels.engine.batch import BatchShape
from pacs_kernels.engine.device import (
    DEFAULT_COSTS,
    DeviceCosts,
    DeviceProfile,
    calibrate_device_profile,
    device_profile,
)
from pacs_kernels.engine.plan import budget_mib_for_tokens, model_paths, plan_loss
from pacs_kernels.objectives import Capabilities

CPU = torch.device("cpu")
# a CPU like the 2-core Xeon of the issue: 150 GFLOP/s GEMMs, an exp_ pass at 1.3 G elements/s
CPU_COSTS = DeviceCosts(gemm_s_per_flop=1 / 150e9, pass_s_per_element=1 / 1.3e9)
# the Qwen2.5-0.5B case: 16 responses of up to 128 tokens, groups of 8
COUNTS = tuple([128, 124, 120, 116, 111, 107, 103, 99, 94, 90, 86, 81, 77, 73, 69, 64])


def profile(costs=CPU_COSTS, *, device=CPU, dtype=torch.float32, max_budget_mib=3072.0, table=()):
    return DeviceProfile(torch.device(device), dtype, "test device", None, costs, True, table, max_budget_mib)


def shape(**changes):
    fields = dict(counts=COUNTS, n_tokens=sum(COUNTS), d=896, vocab=151936, dtype=torch.float32, device_type="cpu",
                  group_size=8)
    fields.update(changes)
    return BatchShape(**fields)


def test_an_unset_cpu_budget_is_raised_to_hold_whole_groups():
    choice = model_paths(shape(), None, profile())
    assert choice.path == "single_pass"
    # the default 256 MiB holds 441 tokens of V = 152k: each group (about 850 tokens) would be half rebuilt
    assert choice.budget_mib >= budget_mib_for_tokens(850, 151936, CPU, torch.float32)
    assert choice.modelled_s["single_pass@default"] > min(choice.modelled_s.values())
    assert model_paths(shape(), None, profile()) == choice  # deterministic


def test_a_budget_the_caller_set_is_kept_and_no_raise_past_the_cap():
    small = budget_mib_for_tokens(300, 151936, CPU, torch.float32)
    choice = model_paths(shape(), small, profile())
    assert (choice.path, choice.budget_mib) == ("single_pass", small)  # rebuilding beats two eager passes
    assert model_paths(shape(), None, profile(max_budget_mib=256.0)).budget_mib is None  # nothing larger allowed


def test_a_group_larger_than_the_cap_gets_the_cap_which_rebuilds_the_least():
    """V = 128k, 16 responses of up to 1,024 tokens (the CPU grid's N = 16,384): a group of about 7,200
    tokens needs about 3.5 GiB; under a 3 GiB cap the default 256 MiB would rebuild over 9/10 of it."""
    counts = tuple(1024 - 512 * i // 15 for i in range(16))
    group = budget_mib_for_tokens(sum(counts[:8]), 128256, CPU, torch.float32)
    assert group > 3072.0
    choice = model_paths(shape(vocab=128256, d=512, counts=counts, n_tokens=sum(counts)), None, profile())
    assert (choice.path, choice.budget_mib) == ("single_pass", 3072.0)
    assert choice.modelled_s["single_pass@3072MiB"] < choice.modelled_s["single_pass@default"]


def test_groups_too_big_for_the_budget_go_to_the_triton_two_passes_where_they_run():
    small = budget_mib_for_tokens(300, 151936, CPU, torch.float32)
    assert model_paths(shape(), small, profile(), triton_two_pass=True).path == "two_pass"
    # the groups fit: one logits GEMM fewer than the two passes
    assert model_paths(shape(), 4096.0, profile(), triton_two_pass=True).path == "single_pass"


def test_the_choice_follows_the_constants():
    """Eager single-pass rows (5 passes over the logits) against the Triton two passes (2 passes, one GEMM
    more): where elementwise passes cost far more than GEMMs, the two passes; where GEMMs dominate, the
    single pass. On the CPU (eager two passes, 7 passes) the single pass wins at the CPU's constants even with
    most of each group rebuilt, and whatever the constants where the groups fit the budget."""
    slow_passes = DeviceCosts(gemm_s_per_flop=1e-15, pass_s_per_element=1e-6)
    cheap_passes = DeviceCosts(gemm_s_per_flop=1e-9, pass_s_per_element=1e-15)
    assert model_paths(shape(), 4096.0, profile(slow_passes), triton_two_pass=True).path == "two_pass"
    assert model_paths(shape(), 4096.0, profile(cheap_passes), triton_two_pass=True).path == "single_pass"
    small = budget_mib_for_tokens(100, 151936, CPU, torch.float32)  # 8/9 of each group rebuilt
    assert model_paths(shape(), small, profile()).path == "single_pass"
    for costs in (slow_passes, cheap_passes):
        assert model_paths(shape(), 4096.0, profile(costs)).path == "single_pass"


def test_fewer_chunks_where_the_budget_allows_them():
    """The CPU grid's point V = 128,256, d = 2,048, N = 1,024 (2 groups, 768 tokens): two chunks of one group
    stream the weight and its gradient twice (about 0.25 s more than one chunk, measured on a 2-core Xeon), so
    with room for every token the plan holds them in one chunk, for a group-coupled objective and a
    token-separable one alike; with no room it stays at the default budget."""
    counts = tuple(64 - 32 * i // 15 for i in range(16))
    grid = shape(vocab=128256, d=2048, counts=counts, n_tokens=sum(counts))
    for capabilities in (Capabilities(chunking="groups"), Capabilities(chunking="tokens")):
        plan = plan_loss(grid, capabilities, LossOptions(), profile(DEFAULT_COSTS["cpu"]))
        assert plan.path == "single_pass" and len(plan.chunks) == 1 and plan.rebuilt == 0
        tight = plan_loss(grid, capabilities, LossOptions(), profile(DEFAULT_COSTS["cpu"], max_budget_mib=256.0))
        assert tight.budget_mib is None and len(tight.chunks) == 2
    choice = model_paths(grid, None, profile(DEFAULT_COSTS["cpu"]))
    assert budget_mib_for_tokens(sum(counts[:8]), 128256, CPU, torch.float32) < 256  # the default holds a group
    one_group = "single_pass@default"
    every_token = f"single_pass@{budget_mib_for_tokens(sum(counts), 128256, CPU, torch.float32):.0f}MiB"
    stream = 128256 * 2048 * DEFAULT_COSTS["cpu"].pass_s_per_element  # one more pass over V x d
    assert choice.modelled_s[one_group] - choice.modelled_s[every_token] == pytest.approx(stream)


def test_the_plan_reads_the_capabilities_not_the_objective_type():
    groups, tokens = Capabilities(chunking="groups"), Capabilities(chunking="tokens")
    budget = budget_mib_for_tokens(100, 151936, CPU, torch.float32)
    options = LossOptions(path="single_pass", chunk_budget_mib=budget)
    by_groups = plan_loss(shape(), groups, options, profile())
    by_tokens = plan_loss(shape(), tokens, options, profile())
    assert all((c.r1 - c.r0) % 8 == 0 for c in by_groups.chunks) and by_groups.rebuilt > 0  # whole groups
    assert by_tokens.rebuilt == 0 and max(c.tok1 - c.tok0 for c in by_tokens.chunks) <= by_tokens.memory.tokens
    assert plan_loss(shape(), Capabilities(uses_entropy=True), LossOptions(), profile()).path == "two_pass"
    with_lse = plan_loss(shape(has_old_lse=True), groups, LossOptions(), profile())
    assert with_lse.path == "one_sweep" and with_lse.fallback.path == "single_pass"
    with pytest.raises(ValueError, match="old_lse"):
        plan_loss(shape(has_old_lse=True), Capabilities(uses_entropy=True, one_sweep=False), LossOptions(), profile())
    assert plan_loss(shape(), groups, LossOptions(), profile()) == plan_loss(shape(), groups, LossOptions(), profile())


def test_on_cuda_the_budget_is_raised_to_hold_a_whole_group_where_free_memory_allows():
    """A profile of a GPU (no GPU needed: the plan reads numbers): 16 responses of 1,024 tokens at V = 152k in
    bf16 need more than the 2 GiB default for a group; with 40 GiB free the plan holds each group whole."""
    counts = (1024,) * 16
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    big = shape(counts=counts, n_tokens=sum(counts), dtype=torch.bfloat16, device_type="cuda")
    roomy = plan_loss(big, Capabilities(chunking="groups"), LossOptions(backend="torch"),
                      profile(DEFAULT_COSTS["cuda"], max_budget_mib=40960.0, **cuda))
    tight = plan_loss(big, Capabilities(chunking="groups"), LossOptions(backend="torch"),
                      profile(DEFAULT_COSTS["cuda"], max_budget_mib=0.0, **cuda))
    assert roomy.path == "single_pass" and roomy.rebuilt == 0 and roomy.budget_mib > 2048
    assert tight.budget_mib is None and tight.rebuilt > 0


def test_device_costs_reject_nonsense():
    with pytest.raises(ValueError, match="gemm_s_per_flop"):
        DeviceCosts(gemm_s_per_flop=0.0, pass_s_per_element=1e-9)
    with pytest.raises(ValueError, match="pass_s_per_element"):
        DeviceCosts(gemm_s_per_flop=1e-12, pass_s_per_element=float("inf"))


def test_an_uncalibrated_device_gets_its_class_defaults_and_nothing_is_measured(monkeypatch, tmp_path):
    monkeypatch.setenv(device_module.PROFILE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(device_module, "measure_costs", lambda *a: pytest.fail("a loss call measured the device"))
    device_module.forget_calibrations()
    found = device_profile(CPU, torch.float32)
    assert found.costs == DEFAULT_COSTS["cpu"] and not found.calibrated and found.table == ()


def test_calibration_is_an_explicit_command_that_stores_the_profile(monkeypatch, tmp_path):
    monkeypatch.setenv(device_module.PROFILE_DIR_ENV, str(tmp_path))
    device_module.forget_calibrations()
    try:
        measured = calibrate_device_profile(CPU, torch.float32)
        costs = measured.costs
        assert measured.calibrated and 0 < costs.gemm_s_per_flop < 1e-8 and 0 < costs.pass_s_per_element < 1e-6
        stored = json.loads((tmp_path / device_module.PROFILE_FILE).read_text())
        assert stored[device_module.profile_key(CPU, torch.float32)] == {
            "gemm_s_per_flop": costs.gemm_s_per_flop, "pass_s_per_element": costs.pass_s_per_element}
        device_module.forget_calibrations()
        assert device_profile(CPU, torch.float32).costs == costs  # read back by a later process
        (tmp_path / device_module.PROFILE_FILE).write_text("not json")
        device_module.forget_calibrations()
        assert device_profile(CPU, torch.float32).costs == DEFAULT_COSTS["cpu"]  # unreadable: the defaults
    finally:
        device_module.forget_calibrations()


def files_under(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


@pytest.mark.parametrize("objective", [PACS(), GRPO()], ids=["pacs", "grpo"])
@pytest.mark.parametrize("path", ["auto", "single_pass", "two_pass"])
def test_a_loss_call_writes_no_file(objective, path, monkeypatch, tmp_path):
    """A first loss call in a fresh process (no calibration in memory): the home, the cache folders and the working
    directory stay as they were."""
    for name in ("HOME", "XDG_CACHE_HOME", device_module.PROFILE_DIR_ENV):
        monkeypatch.setenv(name, str(tmp_path / name))
        os.makedirs(tmp_path / name)
    monkeypatch.delenv("PACS_KERNELS_NO_DISK_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    device_module.forget_calibrations()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 6, 16, generator=gen, requires_grad=True)
    weight = torch.randn(32, 16, generator=gen, requires_grad=True)
    targets, mask = torch.randint(0, 32, (4, 6), generator=gen), torch.rand(4, 6, generator=gen) > 0.3
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    loss, _ = pacs_kernels.fused_linear_objective_loss(hidden, weight, targets, mask, None, rewards,
                                                       objective=objective, group_size=2,
                                                       options=LossOptions(path=path))
    loss.backward()
    assert files_under(tmp_path) == []


def test_pacs_bench_calibrate_measures_and_stores_the_profile(monkeypatch, tmp_path, capsys):
    from benchmarks import run

    monkeypatch.setenv(device_module.PROFILE_DIR_ENV, str(tmp_path))
    device_module.forget_calibrations()
    try:
        assert run.main(["calibrate", "--device", "cpu", "--dtype", "float32"]) == 0
        assert "stored in" in capsys.readouterr().out
        stored = json.loads((tmp_path / device_module.PROFILE_FILE).read_text())
        assert list(stored) == [device_module.profile_key(CPU, torch.float32)]
        device_module.forget_calibrations()
        assert device_profile(CPU, torch.float32).calibrated  # a later process reads it
    finally:
        device_module.forget_calibrations()
