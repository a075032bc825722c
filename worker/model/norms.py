"""RMS normalisation, weighted and unweighted, computed in float32."""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops import cast_rms_norm


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, without a (no-op) dispatch when it already is: the tiny model is
    bound by per-op overhead, and these casts sit on every hot path."""
    return x if x.dtype == torch.float32 else x.float()


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


_F32: dict[tuple[float, torch.device], torch.Tensor] = {}


def f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-dim float32 tensor on ``like``'s device, made once and kept.

    NOTE: an op with a Python scalar first copies the scalar into a tensor of its own
    (aten::_to_copy, ~4 us here), and the tiny model's decode step is bound by per-op overhead.
    For float32 operands only: the op rounds the Python float to float32 either way (the same
    bits); a reduced-precision op reads a Python scalar at float32 precision but a bfloat16
    tensor at its own, so there the scalar stays."""
    key = (value, like.device)
    t = _F32.get(key)
    if t is None:
        # an ordinary tensor even when first asked for inside the forward's inference mode: an
        # inference tensor kept here would break any later caller that runs with autograd on
        with torch.inference_mode(False):
            t = _F32[key] = torch.tensor(value, dtype=torch.float32, device=like.device)
    return t


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim, no weight (V4's per-head q norm, mHC input)."""
    ms = as_float32(x).square().mean(-1, keepdim=True)                  # float32
    return x * as_dtype(torch.rsqrt(ms + f32(eps, ms)), x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight multiplies the normalised value (both float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = as_float32(x)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + f32(self.eps, xf))
        return as_dtype(self.weight * normed, x.dtype)


class CastRMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm``: normalise in float32, cast back to the input's dtype, then
    the weight (in the weight's dtype) — the dense and YOCO families' norm and the vision
    encoder's (``kernels.layer_ops.cast_rms_norm``: one compiled call with the torch expression's
    bits, whose row's bits do not depend on how many rows are normalised together)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast_rms_norm(x, self.weight, self.eps)
