"""fp8 (e4m3) KV quantisation with one scale per group of channels (reference).

Each row is split into groups of ``group`` channels; a group's scale is ``amax / 448`` (the
largest finite e4m3 value), an all-zero group gets scale 1. Dequantisation multiplies back.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def quantize_fp8_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[N, D]`` (D divisible by group) → (``[N, D]`` float8_e4m3fn, ``[N, D//group]`` fp32)."""
    N, D = x.shape
    if D % group:
        raise ValueError(f"channel count {D} is not a multiple of the quantisation group {group}")
    g = x.to(torch.float32).reshape(N, D // group, group)
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(N, D), scale


def dequantize_fp8_ref(q: torch.Tensor, scale: torch.Tensor, group: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, D = q.shape
    g = q.to(torch.float32).reshape(N, D // group, group) * scale.unsqueeze(-1)
    return g.reshape(N, D).to(dtype)
