"""Interleaved (GPT-J style) partial rotary embedding on the trailing ``rope_dims``.

DeepSeek-V4 rotates pairs ``(2i, 2i+1)`` of the last ``rope_dims`` channels; the leading
channels ("nope") are untouched. ``inverse=True`` rotates by the conjugate, which V4 applies
to the attention output because V shares the rotated storage with K.
"""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x``.

    x: ``[..., T, (heads,) D]``; cos/sin: ``[T, rope_dims // 2]`` (broadcast over heads when
    ``x`` has one more dimension than they do besides the channel axis). Returns a new tensor.
    """
    half = cos.shape[-1]
    rd = 2 * half
    if rd == 0:  # no rotary channels (x[..., :-0] would be empty, not the whole tensor)
        return x.clone()
    nope, rot = x[..., :-rd], x[..., -rd:]
    if x.dim() == cos.dim() + 1:  # [T, H, D] against [T, half]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if cos.dtype != x.dtype:   # the tables are float32; a bfloat16 model rotates in bfloat16
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if inverse:
        sin = -sin
    x1 = rot[..., 0::2]
    x2 = rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x1 * sin + x2 * cos
    out_rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((nope, out_rot), dim=-1)
