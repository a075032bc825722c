"""fp8 (e4m3) KV quantisation with one scale per group of channels (reference).

Each row is split into groups of ``group`` channels. Two scale formats:

* ``fp32`` — a group's scale is ``amax / 448`` (the largest finite e4m3 value), an all-zero
  group gets scale 1; dequantisation multiplies back (in float32, so ``q · scale`` is
  rounded).
* ``e8m0`` — a group's scale is a power of two, ``2^k`` with ``k`` the smallest integer for
  which ``amax ≤ 448 · 2^k`` (``k`` in ``[-126, 127]``; 0 for an all-zero group), stored as
  one byte ``k + 127`` as in the OCP microscaling formats. Scaling by a power of two is
  exact, so ``dequantise(quantise(x))`` is exactly representable in float32 and bfloat16,
  and quantising it again gives back the same values (``kvledger`` stores cached state this
  way: a block read back from the cache equals the block its writer kept, bit for bit). It
  costs one byte per group instead of four.

``k`` is found from the bits of ``amax`` (``amax = f · 2^E``, ``f`` in [1, 2)): ``k = E - 8``
when ``f ≤ 1.75`` (448 = 1.75 · 2^8), else ``E - 7`` — no division, no rounding.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
SCALE_FORMATS = ("fp32", "e8m0")
#: Exponent bounds of an e8m0 scale (both scale and its inverse stay normal float32 numbers).
E8M0_MIN, E8M0_MAX = -126, 127
_F_175 = 0x600000  # the mantissa bits of 1.75


def _check(x: torch.Tensor, group: int, scale_format: str) -> tuple[int, int]:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format {scale_format!r}: use one of {', '.join(SCALE_FORMATS)}")
    N, D = x.shape
    if D % group:
        raise ValueError(f"channel count {D} is not a multiple of the quantisation group {group}")
    return N, D


def pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` as float32 for integer ``k`` in ``[-126, 127]``, built from its bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest ``k`` with ``amax ≤ 448 · 2^k`` (int32; 0 where ``amax`` is 0), clamped to
    ``[-126, 127]``."""
    b = amax.to(torch.float32).contiguous().view(torch.int32)
    E = (b >> 23) - 127
    k = E - 8 + ((b & 0x7FFFFF) > _F_175).to(torch.int32)
    k = torch.where(amax > 0, k, torch.zeros_like(k))
    return k.clamp(E8M0_MIN, E8M0_MAX)


def quantize_fp8_ref(x: torch.Tensor, group: int, scale_format: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[N, D]`` (D divisible by group) → (``[N, D]`` float8_e4m3fn, ``[N, D//group]`` scales:
    float32 for ``fp32``, uint8 ``k + 127`` for ``e8m0``)."""
    N, D = _check(x, group, scale_format)
    g = x.to(torch.float32).reshape(N, D // group, group)
    amax = g.abs().amax(dim=-1)
    if scale_format == "e8m0":
        k = e8m0_exponent(amax)
        # NOTE: multiplying by 2^-k is exact (both factors are float32, the result is normal or
        # a subnormal that keeps every bit an e4m3 code can hold); no clamp is needed: |x|/2^k ≤ 448.
        q = (g * pow2(-k).unsqueeze(-1)).to(torch.float8_e4m3fn)
        return q.reshape(N, D), (k + 127).to(torch.uint8)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(N, D), scale


def dequantize_fp8_ref(q: torch.Tensor, scale: torch.Tensor, group: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · scale`` per group, in ``dtype``. A uint8 ``scale`` is e8m0 (``2^(scale - 127)``)."""
    N, D = q.shape
    if scale.dtype == torch.uint8:
        scale = pow2(scale.to(torch.int32) - 127)
    g = q.to(torch.float32).reshape(N, D // group, group) * scale.unsqueeze(-1)
    return g.reshape(N, D).to(dtype)
