"""Sparse attention with an attention sink over a paged pool of K=V entries (reference).

DeepSeek-V4 attends each query to a *set* of 512-dim entries that serve as both key and
value: its sliding-window rows plus the compressed entries its indexer selected. The sink
is a learned per-head logit that enters the softmax denominator only.

    o[t,h] = Σ_j exp(s_j − M) v_j / (Σ_j exp(s_j − M) + exp(sink_h − M)),  s_j = scale·q[t,h]·k_j

Entries live in a paged pool ``[num_slots, E, D]``; a query's index is *logical*
(entry number in its own sequence) and is translated through ``block_table``:
``physical = block_table[idx // E] * E + idx % E``. Index −1 means "no key" (contributes
nothing), which is how causal masking and short histories are expressed.
"""

from __future__ import annotations

import torch


def paged_sparse_attn_ref(
    q: torch.Tensor,            # [T, H, D]
    pool: torch.Tensor,         # [num_slots, E, D]
    block_table: torch.Tensor,  # [num_logical_blocks] int32/int64
    idx: torch.Tensor,          # [T, K] int64, logical entry ids, -1 = masked
    sink: torch.Tensor,         # [H] float32
    scale: float,
) -> torch.Tensor:
    T, H, D = q.shape
    E = pool.shape[1]
    flat = pool.reshape(-1, D)
    valid = idx >= 0
    safe = idx.clamp_min(0)
    phys = block_table.to(torch.int64)[safe // E] * E + safe % E
    kv = flat[phys].to(torch.float32)                                      # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.to(torch.float32), kv) * scale      # [T, H, K]
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sk = sink.to(torch.float32).view(1, H, 1).expand(T, H, 1)
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sk)                    # sink joins the max
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sk - m)
    o = torch.einsum("thk,tkd->thd", p / denom, kv)
    return o.to(q.dtype)


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Unpaged form: ``kv`` is ``[N, D]`` and ``idx`` indexes it directly."""
    N = kv.shape[0]
    table = torch.zeros(1, dtype=torch.int64, device=kv.device)
    return paged_sparse_attn_ref(q, kv.reshape(1, max(N, 1), -1) if N else kv.new_zeros(1, 1, kv.shape[-1]),
                                 table, idx, sink, scale)
