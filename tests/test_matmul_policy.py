"""matmul.py: the GEMM dtype policy of the torch paths (CPU side; the CUDA side is checked by gpu.sh)."""

import pytest
import torch

from pacs_kernels.matmul import addmm_f32_, gemm_in_input_dtype, has_out_dtype, mm_f32, operand


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_cpu_widens_low_precision_and_returns_the_compute_dtype(dtype):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, generator=gen).to(dtype)
    b = torch.randn(5, 3, generator=gen).to(dtype)
    assert not gemm_in_input_dtype(a.device, dtype)
    assert not has_out_dtype(a.device, dtype)
    a_op, b_op = operand(a), operand(b)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert a_op.dtype == want
    product = mm_f32(a_op, b_op)
    assert product.dtype == want
    torch.testing.assert_close(product, a.to(want) @ b.to(want))
    acc = torch.randn(7, 3, generator=gen, dtype=want)
    expected = acc + a.to(want) @ b.to(want)
    addmm_f32_(acc, a_op, b_op)
    torch.testing.assert_close(acc, expected)


def test_low_precision_operands_accumulate_into_float32():
    """The fallback of addmm_f32_ for low-precision operands (the CUDA path without out_dtype)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(6, 4, generator=gen).to(torch.bfloat16)
    b = torch.randn(4, 2, generator=gen).to(torch.bfloat16)
    acc = torch.zeros(6, 2)
    addmm_f32_(acc, a, b)
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc, (a @ b).float())
    assert mm_f32(a, b).dtype == torch.float32


def test_autocast_does_not_change_the_gemm_dtype():
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        product = mm_f32(operand(a), operand(b))
    assert product.dtype == torch.float32
    torch.testing.assert_close(product, a @ b)
