"""Public entry points of the quant op: dispatch to Triton or the reference."""

from __future__ import annotations

from kernels.dispatch import backend_for
from kernels.quant import reference


def quantize_fp8(*args, **kwargs):
    """See :func:`kernels.quant.reference.quantize_fp8_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.quant import triton_impl
        return triton_impl.quantize_fp8(*args, **kwargs)
    return reference.quantize_fp8_ref(*args, **kwargs)


def dequantize_fp8(*args, **kwargs):
    """See :func:`kernels.quant.reference.dequantize_fp8_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.quant import triton_impl
        return triton_impl.dequantize_fp8(*args, **kwargs)
    return reference.dequantize_fp8_ref(*args, **kwargs)
