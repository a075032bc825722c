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

from kernels.invariant import KEY_CHUNK, pointwise


def paged_sparse_attn_ref(
    q: torch.Tensor,            # [T, H, D]
    pool: torch.Tensor,         # [num_slots, E, D]
    block_table: torch.Tensor,  # [num_logical_blocks] int32/int64
    idx: torch.Tensor,          # [T, K] int64, logical entry ids, -1 = masked
    sink: torch.Tensor,         # [H] float32
    scale: float,
) -> torch.Tensor:
    """Batch-invariant: a query's output depends only on its own row of ``idx`` and the entries
    it names — not on ``T``, not on how many masked columns trail its keys.

    The key axis is cut into :data:`kernels.invariant.KEY_CHUNK`-wide pieces (padded with
    masked columns); each piece is reduced on its own (fixed length, fixed order) and the
    pieces are summed in order by a scan, so a piece that is wholly masked adds an exact zero.
    A decode step (one query, its own keys) therefore gives the bits the same query gets in a
    prefill unit or a batch whose key lists are longer.
    """
    E = pool.shape[1]
    idx = _padded(idx)
    safe = idx.clamp_min(0)
    phys = block_table.to(torch.int64)[safe // E] * E + safe % E
    return _attend(q, pool.reshape(-1, pool.shape[-1]), phys, idx >= 0, sink, scale)


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Unpaged form: ``kv`` is ``[N, D]`` and ``idx`` indexes it directly (the paged form with one
    block of ``N`` entries, without its address arithmetic)."""
    idx = _padded(idx)
    kv = kv if kv.shape[0] else kv.new_zeros(1, kv.shape[-1])
    return _attend(q, kv, idx.clamp_min(0), idx >= 0, sink, scale)


def _padded(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` with masked columns appended up to a whole number of KEY_CHUNK pieces (one at least)."""
    K = idx.shape[1]
    pad = (-K) % KEY_CHUNK if K else KEY_CHUNK
    return torch.cat([idx, idx.new_full((idx.shape[0], pad), -1)], 1) if pad else idx


def _attend(q: torch.Tensor, flat: torch.Tensor, phys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
            scale: float) -> torch.Tensor:
    """The attention of each query over rows ``phys`` of ``flat`` (``[R, D]``), masked where not
    ``valid``; the key axis a whole number of KEY_CHUNK pieces."""
    T, H, D = q.shape
    C = KEY_CHUNK
    nc = phys.shape[1] // C
    # NOTE: index_select, not flat[phys]: the same rows copied (no arithmetic, the same bits), and
    # 1.3-6x faster on the CPU than advanced indexing at a prefill's shapes, where this gather was
    # most of aten::index's ~13 % of a forward
    kv = flat.index_select(0, phys.reshape(-1)).view(T, -1, D).to(torch.float32)   # [T, K, D]
    s = torch.bmm(q.to(torch.float32), kv.transpose(1, 2)) * scale         # [T, H, K]
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sk = sink.to(torch.float32).view(1, H, 1).expand(T, H, 1)
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sk)                    # sink joins the max (exact)
    p = pointwise(torch.exp, s - m)
    # NOTE: sum per piece, then a scan over the pieces: the order of additions is fixed by the
    # query's own columns, and trailing masked pieces add +0 (cumsum is sequential).
    denom = p.view(T, H, nc, C).sum(-1).cumsum(-1)[..., -1:] + pointwise(torch.exp, sk - m)
    w = (p / denom).view(T, H, nc, C).transpose(1, 2).reshape(T * nc, H, C)
    o = torch.bmm(w, kv.view(T * nc, C, D)).view(T, nc, H, D).cumsum(1)[:, -1]
    return o.to(q.dtype)
