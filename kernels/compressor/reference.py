"""The DeepSeek-V4 compressor: tail-state save and entry emission (reference).

The compressor keeps, per token ``j``, a projected row ``c_j`` and a score row
``z_j + B[j mod m]``. When a window closes it pools the window's rows *per channel* with a
softmax over the window axis, then RMS-normalises and rotates the result at the window's
first position. CSA windows have 2m slots (previous window's a-halves, current window's
b-halves); HCA windows have m slots. Slots with score −inf weigh nothing (the zero/−inf
sentinel that stands in for rows before position 0).
"""

from __future__ import annotations

import torch

from kernels.rope import apply_rope


def compress_entries_ref(
    kv: torch.Tensor,          # [n, S, C] rows of the n closing windows (S = slots per window)
    score: torch.Tensor,       # [n, S, C] matching scores (bias already added), -inf = empty
    norm_weight: torch.Tensor, # [C]
    eps: float,
    cos: torch.Tensor,         # [n, rope_dims // 2] at each entry's first position
    sin: torch.Tensor,
) -> torch.Tensor:
    """Emit ``n`` compressed entries ``[n, C]`` (float32)."""
    w = torch.softmax(score.to(torch.float32), dim=1)
    pooled = (w * kv.to(torch.float32)).sum(dim=1)                                    # [n, C]
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(torch.float32)
    return apply_rope(normed, cos, sin)


def save_state_ref(
    state_kv: torch.Tensor,     # [R, C] ring, row = position % R
    state_score: torch.Tensor,  # [R, C]
    kv_rows: torch.Tensor,      # [T, C]
    score_rows: torch.Tensor,   # [T, C]
    positions: torch.Tensor,    # [T] int64 absolute positions
) -> None:
    """Write rows into the position-addressed ring, in place (later rows win)."""
    R = state_kv.shape[0]
    slot = positions % R
    state_kv[slot] = kv_rows.to(state_kv.dtype)
    state_score[slot] = score_rows.to(state_score.dtype)
