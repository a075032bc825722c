"""Helpers shared by the kernel tests (a plain module: ``tests/kernels`` is on sys.path)."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]

# Outputs in the input dtype: fp32 differs from the reference only in summation order;
# bf16 outputs are allowed a couple of bf16 ulps (2^-8 relative) on values of order 1.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

cpu_only = pytest.mark.skipif(CUDA, reason="checks behaviour of CPU (interpreter) tensors")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``, for bit-exact comparisons of any dtype (fp8 included)."""
    return t.contiguous().view(torch.uint8)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bytes; NaNs only need to sit in the same places (their payload
    bits are not portable: GPUs return a canonical NaN from arithmetic)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.is_floating_point() and actual.element_size() > 1:
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), "NaNs in different places"
        actual, expected = actual[~nan], expected[~nan]
    mismatch = bits(actual) != bits(expected)
    assert not mismatch.any(), f"{int(mismatch.sum())} bytes differ"
