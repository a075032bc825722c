"""What every Triton kernel module shares: the import guard, the dtypes the kernels take, the
bf16 rounding both paths must agree on, and the check that a tensor can reach a Triton kernel.

Importing this module raises :class:`kernels.dispatch.KernelUnavailable` when triton is missing,
so a kernel module that imports it fails the same clear way.
"""

from __future__ import annotations

import torch

from kernels.dispatch import KernelUnavailable, triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - triton is a hard dependency of the project
    raise KernelUnavailable("triton is not installed; use the reference backend") from e

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def round_bf16(x):
    """fp32 → the nearest-even bf16 value, still as fp32 (exactly representable in bf16).

    NOTE: a following ``.to(tl.bfloat16)`` is then exact everywhere. The GPU would round to
    nearest-even by itself, but triton 3.9's interpreter truncates fp32 → bf16, so the
    rounding is done here in integer arithmetic to keep both paths bit-identical.
    """
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even also under the interpreter."""
    if dtype == tl.bfloat16:
        return round_bf16(x.to(tl.float32)).to(tl.bfloat16)
    else:
        return x.to(dtype)


def require_runnable(name: str, t: torch.Tensor) -> None:
    """Raise :class:`KernelUnavailable` unless ``t`` can reach a Triton kernel here: a CUDA tensor,
    or a CPU tensor under ``TRITON_INTERPRET=1``."""
    if t.is_cuda:
        return
    if t.device.type == "cpu" and triton_interpreting():
        return
    raise KernelUnavailable(
        f"{name} is on {t.device}: the Triton kernel needs a CUDA tensor, or a CPU tensor with "
        "TRITON_INTERPRET=1 set before triton is imported; use the reference backend instead")


__all__ = ["FLOAT_DTYPES", "INDEX_DTYPES", "cast_to", "require_runnable", "round_bf16", "tl", "triton"]
