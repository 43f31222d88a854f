"""benchmarks/roofline.py: counts checked by hand on a small shape, the CLI's files and the join."""

from __future__ import annotations

import csv
import math

import pytest

from benchmarks import roofline

N, D, V = 256, 64, 1024  # bf16: itemsize 2


def test_matmul_flops_are_two_n_v_d_per_matmul():
    gemm = 2 * N * V * D
    for variant in roofline.VARIANTS:
        c = roofline.cost(variant, N, D, V, "bfloat16")
        assert c.flops == roofline.MATMULS[variant] * gemm, variant
    filtered = roofline.Options(cce_live_fraction=0.25)
    assert roofline.cost("cce", N, D, V, options=filtered).flops == 2.5 * gemm  # lse + recompute + 2 x 0.25


def test_one_sweep_bytes_and_memory_by_hand():
    # one dz chunk holds every token: the dz kernel reads W and h and writes dz; dh reads dz and W and
    # writes dh; dW reads dz and h and writes dW: three times (N V + N d + V d) elements of 2 bytes
    c = roofline.cost("triton_one_sweep", N, D, V, "bfloat16")
    assert c.hbm_bytes == 3 * (N * V + N * D + V * D) * 2
    assert c.atomic_bytes == 0
    assert c.peak_extra_bytes == N * V * 2  # the dz chunk, no float32 dW buffer with one chunk
    two_pass = roofline.cost("triton_two_pass", N, D, V, "bfloat16")
    assert two_pass.hbm_bytes - c.hbm_bytes == N * D * 2 + V * D * 2 + 12 * N  # the forward: h, W once, 3 floats/token


def test_atomic_design_counts_every_token_block_adding_all_of_dw():
    c = roofline.cost("triton_two_pass_atomic", N, D, V, "bfloat16", sms=132)
    blocks = N // 64  # 4 token blocks of 64
    splits = math.ceil(2 * 132 / blocks)  # the old launcher's vocabulary split: 66
    assert c.atomic_bytes == 4 * (blocks * V * D + splits * N * D)
    assert c.peak_extra_bytes == 4 * (N * D + V * D)


def test_chunked_single_pass_reads_w_per_chunk_and_accumulates_dw_in_float32():
    options = roofline.Options(chunk_mib=64 * V * 4 / 2**20)  # 64-token chunks: 4 chunks
    c = roofline.cost("chunked_single_pass", N, D, V, "bfloat16", options=options)
    nv, nd, vd, s = N * V, N * D, V * D, 2
    expected = ((nd * s + 4 * vd * s + nv * 4) + nv * (4 + 8 + 4 + s) + (nv * s + 4 * vd * s + nd * s)
                + (nv * s + nd * s + 4 * 8 * vd))
    assert c.hbm_bytes == expected
    assert c.peak_extra_bytes == 64 * V * (4 + s) + 4 * vd


def test_compact_single_pass_streams_float32_strips_and_holds_two_bytes_a_logit():
    # a budget of 100 rows of float32 logits: the strip takes a quarter (25 rows), the bf16 tile the
    # rest (150 tokens): 11 strips and 2 tiles for 256 tokens
    options = roofline.Options(compact_budget_mib=100 * V * 4 / 2**20)
    c = roofline.cost("single_pass_compact", N, D, V, "bfloat16", options=options)
    nv, nd, vd, s = N * V, N * D, V * D, 2
    strips, tiles = math.ceil(N / 25), math.ceil(N / 150)
    expected = ((nd * s + strips * vd * s + nv * 4) + nv * (4 + s) + nv * (s + s)
                + (nv * s + tiles * vd * s + nd * s) + (nv * s + nd * s + tiles * 8 * vd))
    assert c.hbm_bytes == expected
    assert c.peak_extra_bytes == 150 * V * s + 25 * V * 4 + 4 * vd
    # at the default 2 GiB, Qwen2.5-7B's head: fewer bytes moved than the eager rows, closer to the floor
    rates, n, (d, v) = roofline.Rates(), 32768, roofline.QWEN_7B
    compact, eager = (roofline.cost(name, n, d, v) for name in ("single_pass_compact", "chunked_single_pass"))
    assert compact.hbm_bytes < eager.hbm_bytes and compact.predict_ms(rates) < eager.predict_ms(rates)


def test_prediction_is_the_matmul_floor_when_compute_bound():
    rates = roofline.Rates()
    n, (d, v) = 32768, roofline.QWEN_7B
    floor = roofline.matmul_floor_ms(n, d, v, 3, rates.matmul_tflops)
    assert floor == pytest.approx(3 * 2 * n * v * d / 989e12 * 1e3)
    sweep = roofline.cost("triton_one_sweep", n, d, v)
    assert sweep.bound(rates) == "matmul"
    assert sweep.predict_ms(rates) == pytest.approx(floor)
    atomic = roofline.cost("triton_two_pass_atomic", n, d, v)
    assert atomic.bound(rates) == "atomic"
    assert atomic.predict_ms(rates) > 5 * roofline.cost("triton_two_pass", n, d, v).predict_ms(rates)
    # a memory-bound phase is timed by bandwidth: halving the bandwidth slows the naive variant
    slow = roofline.Rates(hbm_tbps=rates.hbm_tbps / 2)
    assert roofline.cost("naive", n, d, v).predict_ms(slow) > roofline.cost("naive", n, d, v).predict_ms(rates)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="variant must be one of"):
        roofline.cost("fast", N, D, V)
    with pytest.raises(ValueError, match="dtype must be one of"):
        roofline.cost("naive", N, D, V, "int8")
    with pytest.raises(ValueError, match="n must be a positive int"):
        roofline.cost("naive", 0, D, V)
    with pytest.raises(ValueError, match="matmuls must be 3 or 4"):
        roofline.matmul_floor_ms(N, D, V, 5)


def test_cli_writes_table_and_joins_measured_times(tmp_path, capsys):
    measured = tmp_path / "measured.csv"
    measured.write_text("variant,n,d,v,ms\ntriton_two_pass,512,64,1024,2.5\nunknown_impl,512,64,1024,1.0\n")
    out = tmp_path / "out"
    assert roofline.main(["--n", "512", "1024", "--d", "64", "--v", "1024", "--out", str(out),
                          "--matmul-tflops", "500", "--hbm-tbps", "3", "--measured", str(measured)]) == 0
    with open(out / "roofline.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * len(roofline.VARIANTS)
    assert tuple(rows[0]) == roofline.CSV_COLUMNS
    assert {r["variant"] for r in rows} == set(roofline.VARIANTS)
    assert all(float(r["predicted_ms"]) > 0 and r["rates"] == "from the command line" for r in rows)
    text = (out / "roofline.md").read_text()
    assert "| triton_two_pass | 512 | 64 | 1024 |" in text and "Measured vs predicted" in text
    with open(out / "roofline_measured.csv", newline="") as handle:
        joined = list(csv.DictReader(handle))
    rates = roofline.Rates(matmul_tflops=500, hbm_tbps=3)
    predicted = roofline.cost("triton_two_pass", 512, 64, 1024).predict_ms(rates)
    assert float(joined[0]["measured_over_predicted"]) == pytest.approx(2.5 / predicted, rel=1e-2)
    assert joined[1]["predicted_ms"] == ""  # a variant the model does not know
    assert "Roofline cost model" in capsys.readouterr().out


def test_default_table_covers_qwen_shapes_and_the_cpu_shape():
    rows = roofline.table()
    shapes = {(r["n"], r["d"], r["v"], r["dtype"]) for r in rows}
    assert shapes == {(n, 3584, 152064, "bfloat16") for n in (8192, 16384, 32768, 65536)} | {
        (2048, 512, 32768, "float32")}
    assert all(r["rates"] == "H200 spec, not measured" for r in rows)
