"""The GPU dispatch table: written from a benchmark CSV, read by "auto" on CUDA (dispatch.py)."""

import csv
import json
from pathlib import Path

import pytest
import torch

from benchmarks import dispatch_table
from pacs_kernels import dispatch
from pacs_kernels.engine.batch import BatchShape
from pacs_kernels.engine.device import DEFAULT_COSTS, DeviceProfile, device_profile
from pacs_kernels.engine.plan import measured_faster
from pacs_kernels.logprobs import resolve_backend


def _profile(device: str, dtype=torch.bfloat16):
    """A device profile holding the (patched) packaged table's entries, as device_profile builds one on a GPU."""
    return DeviceProfile(torch.device(device), dtype, "NVIDIA H200", (9, 0), DEFAULT_COSTS["cuda"], False,
                         dispatch.table_entries(device_name="NVIDIA H200", capability=(9, 0)), 0.0)


def measured_two_pass_faster(device, n_tokens, d, vocab, dtype=torch.bfloat16):
    shape = BatchShape((n_tokens,), n_tokens, d, vocab, dtype, torch.device(device).type, 1)
    return measured_faster(_profile(device, dtype), shape, ("single_pass", "triton"))


def measured_rebuild_faster(device, n_tokens, d, vocab, dtype=torch.bfloat16):
    shape = BatchShape((n_tokens,), n_tokens, d, vocab, dtype, torch.device(device).type, 1)
    return measured_faster(_profile(device, dtype), shape, ("triton", "single_pass_lowmem"))


def _row(op, impl, n, ms, status="ok"):
    return {"date": "2026-11-30", "device": "cuda", "device_name": "NVIDIA H200", "op": op, "impl": impl, "N": n,
            "d": 3584, "V": 152064, "dtype": "bfloat16", "median_ms": ms, "status": status}


@pytest.fixture()
def table(tmp_path, monkeypatch):
    rows = [
        _row("pacs_loss_fwd_bwd", "single_pass", 8192, 20.0), _row("pacs_loss_fwd_bwd", "triton", 8192, 25.0),
        _row("pacs_loss_fwd_bwd", "single_pass", 65536, 300.0), _row("pacs_loss_fwd_bwd", "triton", 65536, 250.0),
        # groups larger than the budget: the rebuilding single pass slower than two passes at 8k, faster at 64k
        _row("pacs_loss_fwd_bwd", "single_pass_lowmem", 8192, 27.0),
        _row("pacs_loss_fwd_bwd", "single_pass_lowmem", 65536, 240.0),
        _row("pacs_loss_fwd_bwd", "naive", 65536, 1.0, status="oom"),
        _row("pacs_loss_fwd_bwd", "cce_exact", 8192, 90.0),
        _row("logprobs_fwd_bwd", "triton", 8192, 30.0), _row("logprobs_fwd_bwd", "torch", 8192, 28.0),
    ]
    # the Triton backward's GEMM engines, raced in a run of their own (gpu.sh's step 2b): Triton's
    # kernels faster at 32k tokens, cuBLAS at 8k
    gemm_rows = [_row("grad_gemms", "triton", 8192, 12.0), _row("grad_gemms", "torch", 8192, 10.0),
                 _row("grad_gemms", "triton", 32768, 40.0), _row("grad_gemms", "torch", 32768, 41.0)]
    paths = [tmp_path / "gpu.csv", tmp_path / "gpu_grad_gemms.csv"]
    for path, written in zip(paths, (rows, gemm_rows)):
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(written[0]))
            writer.writeheader()
            writer.writerows(written)
    assert dispatch_table.main([*map(str, paths), "--out", str(tmp_path)]) == 0
    monkeypatch.setattr(dispatch, "PACKAGED_TABLE", tmp_path / "dispatch.json")  # as if committed
    dispatch._load.cache_clear()
    yield json.loads((tmp_path / "dispatch.json").read_text()), tmp_path
    dispatch._load.cache_clear()


def test_table_written_from_the_csv(table):
    data, out = table
    # N: the tokens that get log-probs (how the fused losses look it up), about 3/4 of the loss op's positions
    best = {(e["op"], e["N"], e["positions"]): e["best"] for e in data["entries"]}
    assert best == {("logprobs_fwd_bwd", 8192, 8192): "torch", ("pacs_loss_fwd_bwd", 6151, 8192): "single_pass",
                    ("pacs_loss_fwd_bwd", 49159, 65536): "single_pass_lowmem",
                    ("grad_gemms", 8192, 8192): "torch", ("grad_gemms", 32768, 32768): "triton"}
    measured = list(csv.DictReader(open(out / "measured_for_roofline.csv")))
    variants = {r["variant"] for r in measured}
    assert {"single_pass_compact", "triton_two_pass", "cce"} <= variants
    # N in the roofline file counts the tokens that get log-probs (about 3/4 of the loss op's positions)
    assert {int(r["n"]) for r in measured if r["op"] == "pacs_loss_fwd_bwd"} == {6151, 49159}


def test_auto_follows_the_table_on_cuda_only(table):
    assert dispatch.prefer_two_pass(60000, 3584, 152064)
    assert not dispatch.prefer_two_pass(7000, 3584, 152064)
    assert not dispatch.prefer_two_pass(7000, 4096, 152064)  # no entry for that width: defaults
    assert measured_two_pass_faster(torch.device("cuda"), 60000, 3584, 152064)
    assert not measured_two_pass_faster(torch.device("cpu"), 60000, 3584, 152064)
    # the Triton backward's GEMM engine: as measured at the nearest N on CUDA, cuBLAS where unmeasured,
    # the Triton kernels in the interpreter (the kernels under test)
    assert dispatch.grad_gemms(30000, 3584, 152064, "bfloat16", "cuda") == "triton"
    assert dispatch.grad_gemms(9000, 3584, 152064, "bfloat16", "cuda") == "torch"
    assert dispatch.grad_gemms(30000, 3584, 152064, "float16", "cuda") == "torch"
    assert dispatch.grad_gemms(30000, 4096, 152064, "bfloat16", "cuda") == "torch"
    assert dispatch.grad_gemms(30000, 3584, 152064, "bfloat16", "cpu") == "triton"
    assert dispatch.logprob_backend(8000, 3584, 152064) == "torch"
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16, shape=(8000, 3584, 152064)) == "torch"
    # groups larger than the budget: rebuild where measured faster than the Triton two passes
    assert dispatch.prefer_rebuild(60000, 3584, 152064) and not dispatch.prefer_rebuild(7000, 3584, 152064)
    assert measured_rebuild_faster(torch.device("cuda"), 60000, 3584, 152064)
    assert not measured_rebuild_faster(torch.device("cpu"), 60000, 3584, 152064)
    assert not dispatch.prefer_rebuild(60000, 4096, 152064)  # no entry for that width
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16, shape=(8000, 3584, 152064)) == "torch"
    # the dtype must match: a bfloat16 measurement does not decide for float16
    assert dispatch.prefer_two_pass(60000, 3584, 152064, "bfloat16")
    assert not dispatch.prefer_two_pass(60000, 3584, 152064, "float16")
    assert measured_two_pass_faster(torch.device("cuda"), 60000, 3584, 152064, dtype=torch.bfloat16)
    assert not measured_two_pass_faster(torch.device("cuda"), 60000, 3584, 152064, dtype=torch.float16)
    assert dispatch.logprob_backend(8000, 3584, 152064, "float16") is None
    assert resolve_backend("auto", torch.device("cuda"), torch.float16, shape=(8000, 3584, 152064)) == "triton"


def test_two_passes_are_preferred_only_where_the_triton_ones_beat_the_single_pass(tmp_path, monkeypatch):
    """The torch two passes being fastest says nothing for the path that runs the Triton ones."""
    entry = {"op": "pacs_loss_fwd_bwd", "d": 64, "V": 512, "dtype": "bfloat16", "N": 1000, "positions": 1333,
             "ms": {"torch": 1.0, "single_pass": 2.0, "triton": 3.0}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": [entry]}))
    dispatch._load.cache_clear()
    try:
        assert not dispatch.prefer_two_pass(1000, 64, 512, table=str(path))
        entry["ms"]["triton"] = 1.5
        path.write_text(json.dumps({"entries": [entry]}))
        dispatch._load.cache_clear()
        assert dispatch.prefer_two_pass(1000, 64, 512, table=str(path))
        assert not dispatch.prefer_two_pass(1000, 64, 512)  # the packaged table has no such entry
    finally:
        dispatch._load.cache_clear()


def test_no_table_means_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr(dispatch, "PACKAGED_TABLE", tmp_path / "absent.json")
    assert dispatch.table_entries() == ()
    assert not dispatch.prefer_two_pass(8192, 3584, 152064)
    assert not dispatch.prefer_rebuild(8192, 3584, 152064)
    assert dispatch.logprob_backend(8192, 3584, 152064) is None
    assert dispatch.grad_gemms(8192, 3584, 152064, "bfloat16", "cuda") == "torch"


def test_grad_gemms_is_an_option_and_a_bad_value_is_named():
    from pacs_kernels import LossOptions, linear_logprobs

    assert LossOptions(grad_gemms="triton").grad_gemms == "triton"
    with pytest.raises(ValueError, match="grad_gemms must be one of .*got 'cublas'"):
        LossOptions(grad_gemms="cublas")
    with pytest.raises(ValueError, match="grad_gemms must be one of .*got 'cublas'"):
        linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), grad_gemms="cublas")


def test_unreadable_table_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    dispatch._load.cache_clear()
    with pytest.raises(ValueError, match="the dispatch table .* could not be read"):
        dispatch.table_entries(str(bad))
    dispatch._load.cache_clear()


def test_the_library_reads_no_environment_variable_for_dispatch(monkeypatch, tmp_path):
    """The benchmarks' PACS_BENCH_DISPATCH_TABLE (and the old names) decide nothing in pacs_kernels: only the
    options do; no module of the package reads os.environ except for Triton's own TRITON_INTERPRET and, in
    engine/device.py, where a calibrated device profile is stored (never which path)."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for name in ("PACS_DISPATCH_TABLE", "PACS_BENCH_DISPATCH_TABLE", "PACS_GRAD_GEMMS"):
        monkeypatch.setenv(name, str(bad))
    assert dispatch.grad_gemms(8192, 3584, 152064, "bfloat16", "cpu") == "triton"
    dispatch.table_entries()  # the packaged table, not the bad file
    package = Path(dispatch.__file__).resolve().parent
    for path in package.rglob("*.py"):
        for line in path.read_text().splitlines():
            if "os.environ" in line or "getenv" in line:
                allowed = ["TRITON_INTERPRET"]
                if path.name == "device.py":
                    allowed += ["XDG_CACHE_HOME", "PROFILE_DIR_ENV"]
                if path.name == "compile_check.py":  # the sm_90 compile report names Triton's own setting
                    allowed += ["TRITON_DEFAULT_FP_FUSION"]
                assert any(name in line for name in allowed), f"{path.name}: {line.strip()}"


def test_auto_sends_float32_log_prob_matmuls_to_cublas_on_cuda():
    """The Triton log-prob kernels are built for 16-bit tensor-core tiles; float32 multiplies exactly on
    CUDA cores, where cuBLAS is faster: auto picks torch for them, Triton for 16-bit inputs; elementwise
    Triton kernels (the group loss, the single pass's rows) keep float32."""
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, torch.float32, matmul_kernels=True) == "torch"
    assert resolve_backend("auto", cuda, torch.bfloat16, matmul_kernels=True) == "triton"
    assert resolve_backend("auto", cuda, torch.float16, matmul_kernels=True) == "triton"
    assert resolve_backend("auto", cuda, torch.float32) == "triton"
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16, matmul_kernels=True) == "torch"


def test_groups_larger_than_the_budget_go_two_pass_only_onto_triton_log_prob_kernels():
    """path="auto" with a group bigger than the chunk budget: two passes where they would run the Triton
    log-prob kernels (CUDA, 16-bit weights), the rebuilding single pass elsewhere (CPU, torch, and float32
    on CUDA, whose two passes would be cuBLAS + eager work)."""
    from pacs_kernels.engine.plan import two_pass_runs_triton

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert two_pass_runs_triton("auto", cuda, torch.bfloat16)
    assert not two_pass_runs_triton("auto", cuda, torch.float32)
    assert not two_pass_runs_triton("torch", cuda, torch.bfloat16)
    assert not two_pass_runs_triton("auto", cpu, torch.float32)
    assert two_pass_runs_triton("triton", cpu, torch.float32)  # explicit, in the interpreter (the tests)
    # a soft-cap never runs on the Triton log-prob kernels: the single pass's row kernels take such groups
    assert not two_pass_runs_triton("auto", cuda, torch.bfloat16, softcap=True)
    assert not two_pass_runs_triton("triton", cpu, torch.float32, softcap=True)


def test_the_committed_gpu_table_is_the_h200_run_and_ships_with_the_package():
    """pacs_kernels/gpu_dispatch.json: benchmarks/gpu.sh's table from the H200 run (benchmarks/results/gpu/), in the
    wheel's package data; at Qwen2.5-7B's head in bfloat16 it keeps the single pass, rebuilds groups larger than the
    budget rather than run two passes, and gives the Triton backward's gradient GEMMs to cuBLAS (all measured)."""
    data = json.loads(dispatch.PACKAGED_TABLE.read_text())
    assert [(d["device_name"], d["capability"]) for d in data["devices"]] == [("NVIDIA H200", [9, 0])]
    dispatch._load.cache_clear()
    try:
        assert dispatch.table_entries()  # read from the package directory when no table is named
        assert not dispatch.prefer_two_pass(12295, 3584, 152064, "bfloat16")
        assert dispatch.prefer_rebuild(12295, 3584, 152064, "bfloat16")
        assert dispatch.logprob_backend(8192, 3584, 152064, "bfloat16") == "triton"
        assert dispatch.grad_gemms(32768, 3584, 152064, "bfloat16", "cuda") == "torch"
        assert not dispatch.prefer_two_pass(12295, 896, 151936, "bfloat16")  # another shape: no entry, defaults
    finally:
        dispatch._load.cache_clear()
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'pacs_kernels = ["gpu_dispatch.json"]' in pyproject


def test_the_packaged_table_is_keyed_by_device_name_and_capability():
    """Another GPU, even of the same compute capability, uses none of the H200's measurements (the cost model's
    defaults for its class decide); the H200 gets its own; a CPU profile holds no table."""
    dispatch._load.cache_clear()
    try:
        assert dispatch.table_entries(device_name="NVIDIA H200", capability=(9, 0))
        assert dispatch.table_entries(device_name="NVIDIA H100 80GB HBM3", capability=(9, 0)) == ()
        assert dispatch.table_entries(device_name="NVIDIA H200", capability=(8, 0)) == ()
        assert device_profile(torch.device("cpu"), torch.float32).table == ()
    finally:
        dispatch._load.cache_clear()
