"""path="auto"'s cost model (pacs_kernels/path_choice.py): deterministic given its constants, cached, measured."""

from __future__ import annotations

import json

import pytest
import torch

from pacs_kernels import path_choice
from pacs_kernels.path_choice import DeviceCosts, PathQuery, choose_path
from pacs_kernels.single_pass import budget_mib_for_tokens

CPU = torch.device("cpu")
# a CPU like the 2-core Xeon of the issue: 150 GFLOP/s GEMMs, an exp_ pass at 1.3 G elements/s
CPU_COSTS = DeviceCosts(gemm_s_per_flop=1 / 150e9, pass_s_per_element=1 / 1.3e9)
# the Qwen2.5-0.5B case: 16 responses of up to 128 tokens, groups of 8
COUNTS = tuple([128, 124, 120, 116, 111, 107, 103, 99, 94, 90, 86, 81, 77, 73, 69, 64])


def query(**changes):
    fields = dict(device=CPU, dtype=torch.float32, d=896, vocab=151936, counts=COUNTS, group_size=8)
    fields.update(changes)
    return PathQuery(**fields)


def test_an_unset_cpu_budget_is_raised_to_hold_whole_groups(monkeypatch):
    monkeypatch.setattr(path_choice, "raised_budget_cap_mib", lambda device: 3072.0)
    choice = choose_path(query(), CPU_COSTS)
    assert choice.path == "single_pass"
    # the default 256 MiB holds 441 tokens of V = 152k: each group (about 850 tokens) would be half rebuilt
    assert choice.budget_mib >= budget_mib_for_tokens(850, 151936, CPU, torch.float32)
    assert choice.modelled_s["single_pass@default"] > min(choice.modelled_s.values())
    assert choose_path(query(), CPU_COSTS) == choice  # deterministic


def test_a_budget_the_caller_set_is_kept_and_no_raise_past_the_cap(monkeypatch):
    small = budget_mib_for_tokens(300, 151936, CPU, torch.float32)
    choice = choose_path(query(budget_mib=small), CPU_COSTS)
    assert (choice.path, choice.budget_mib) == ("single_pass", small)  # rebuilding beats two eager passes
    monkeypatch.setattr(path_choice, "raised_budget_cap_mib", lambda device: 256.0)
    assert choose_path(query(), CPU_COSTS).budget_mib is None  # the default: nothing larger allowed


def test_a_group_larger_than_the_cap_gets_the_cap_which_rebuilds_the_least(monkeypatch):
    """V = 128k, 16 responses of up to 1,024 tokens (the CPU grid's N = 16,384): a group of about 7,200
    tokens needs about 3.5 GiB; under a 3 GiB cap the default 256 MiB would rebuild over 9/10 of it."""
    counts = tuple(1024 - 512 * i // 15 for i in range(16))
    group = budget_mib_for_tokens(sum(counts[:8]), 128256, CPU, torch.float32)
    monkeypatch.setattr(path_choice, "raised_budget_cap_mib", lambda device: 3072.0)
    assert group > 3072.0
    choice = choose_path(query(vocab=128256, d=512, counts=counts), CPU_COSTS)
    assert (choice.path, choice.budget_mib) == ("single_pass", 3072.0)
    assert choice.modelled_s["single_pass@3072MiB"] < choice.modelled_s["single_pass@default"]


def test_groups_too_big_for_the_budget_go_to_the_triton_two_passes_where_they_run():
    small = budget_mib_for_tokens(300, 151936, CPU, torch.float32)
    assert choose_path(query(budget_mib=small, triton_two_pass=True), CPU_COSTS).path == "two_pass"
    # the groups fit: one logits GEMM fewer than the two passes
    assert choose_path(query(triton_two_pass=True, budget_mib=4096.0), CPU_COSTS).path == "single_pass"


def test_the_choice_follows_the_constants():
    """Eager single-pass rows (5 passes over the logits) against the Triton two passes (2 passes, one GEMM
    more): where elementwise passes cost far more than GEMMs, the two passes; where GEMMs dominate, the
    single pass. On the CPU (eager two passes, 7 passes) the single pass wins whatever the constants."""
    slow_passes = DeviceCosts(gemm_s_per_flop=1e-15, pass_s_per_element=1e-6)
    cheap_passes = DeviceCosts(gemm_s_per_flop=1e-9, pass_s_per_element=1e-15)
    mixed = dict(budget_mib=4096.0, triton_two_pass=True, row_kernels="torch")
    assert choose_path(query(**mixed), slow_passes).path == "two_pass"
    assert choose_path(query(**mixed), cheap_passes).path == "single_pass"
    small = budget_mib_for_tokens(100, 151936, CPU, torch.float32)  # 8/9 of each group rebuilt
    for costs in (slow_passes, cheap_passes):
        assert choose_path(query(budget_mib=small), costs).path == "single_pass"


def test_device_costs_reject_nonsense():
    with pytest.raises(ValueError, match="gemm_s_per_flop"):
        DeviceCosts(gemm_s_per_flop=0.0, pass_s_per_element=1e-9)
    with pytest.raises(ValueError, match="pass_s_per_element"):
        DeviceCosts(gemm_s_per_flop=1e-12, pass_s_per_element=float("inf"))


def test_calibration_measures_and_is_cached_in_memory_and_on_disk(tmp_path, monkeypatch):
    calls = []
    real = path_choice.calibrate

    def counted(device, dtype):
        calls.append((device, dtype))
        return real(device, dtype)

    monkeypatch.setattr(path_choice, "calibrate", counted)
    monkeypatch.delenv(path_choice.NO_DISK_CACHE_ENV, raising=False)
    path_choice.forget_calibrations()
    path_choice.set_disk_cache(True, tmp_path)
    try:
        costs = path_choice.device_costs(CPU, torch.float32)
        assert 0 < costs.gemm_s_per_flop < 1e-8 and 0 < costs.pass_s_per_element < 1e-6  # > 100 MFLOP/s, ...
        assert path_choice.device_costs(CPU, torch.float32) is costs and len(calls) == 1  # memory
        stored = json.loads((tmp_path / path_choice.CACHE_FILE).read_text())
        assert stored[path_choice.device_key(CPU, torch.float32)] == {
            "gemm_s_per_flop": costs.gemm_s_per_flop, "pass_s_per_element": costs.pass_s_per_element}
        path_choice.forget_calibrations()
        assert path_choice.device_costs(CPU, torch.float32) == costs and len(calls) == 1  # from disk
        path_choice.forget_calibrations()
        (tmp_path / path_choice.CACHE_FILE).write_text("not json")
        path_choice.device_costs(CPU, torch.float32)  # an unreadable cache: measured again
        assert len(calls) == 2
    finally:
        path_choice.set_disk_cache(False)
        path_choice.forget_calibrations()


def test_without_the_disk_cache_nothing_is_written(tmp_path, monkeypatch):
    path_choice.set_disk_cache(False, tmp_path)
    path_choice.forget_calibrations()
    path_choice.device_costs(CPU, torch.float32)
    assert not (tmp_path / path_choice.CACHE_FILE).exists()
    path_choice.set_disk_cache(True, tmp_path)  # on, but switched off by the environment (as in these tests)
    monkeypatch.setenv(path_choice.NO_DISK_CACHE_ENV, "1")
    path_choice.forget_calibrations()
    path_choice.device_costs(CPU, torch.float32)
    assert not (tmp_path / path_choice.CACHE_FILE).exists()
    path_choice.set_disk_cache(False)
    path_choice.forget_calibrations()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        path_choice.set_disk_cache("no")
