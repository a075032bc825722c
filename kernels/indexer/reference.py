"""Lightning-indexer scoring and top-k selection (reference).

``score(t, n) = Σ_h w[t,h] · ReLU(q[t,h] · k[n])`` over the compressed indexer keys; an
entry is visible to query position ``t`` only if ``n < (t + 1) // ratio``. The top-k is
deterministic: higher score first, ties broken by the lower entry index, so every
implementation (and every chunk schedule) selects the same set. Slots beyond the visible
count are −1.
"""

from __future__ import annotations

import torch

from kernels.invariant import linear


def indexer_scores_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q ``[T, nH, dI]``, k ``[N, dI]``, w ``[T, nH]`` (already scaled) → ``[T, N]`` fp32.

    Batch-invariant: a query's scores depend on its own row and the keys, not on ``T`` nor on
    ``N`` (the product goes through :func:`kernels.invariant.linear`; the head sum is an
    in-order reduction over a fixed axis).
    """
    T, nH, dI = q.shape
    s = linear(q.to(torch.float32).reshape(T * nH, dI), k.to(torch.float32)).view(T, nH, -1).relu_()
    # NOTE: heads summed as the contiguous last axis: a sum over a middle axis is vectorised
    # across the keys, and its order then changes with how many keys there are.
    return (s.transpose(1, 2).contiguous() * w.to(torch.float32).unsqueeze(1)).sum(-1)


def indexer_topk_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                     ratio: int, topk: int) -> torch.Tensor:
    """Selected entry ids ``[T, topk]`` int64, −1 where fewer than ``topk`` are visible."""
    T, N = q.shape[0], k.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    if N == 0:
        return out
    s = indexer_scores_ref(q, k, w)
    visible = torch.arange(N, device=q.device).view(1, N) < ((positions.view(T, 1) + 1) // ratio)
    s = s.masked_fill(~visible, float("-inf"))
    # NOTE: stable descending sort = ties keep ascending index order, which is the tie-break rule.
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :topk]
    kk = order.shape[1]
    picked_visible = torch.gather(visible, 1, order)
    out[:, :kk] = torch.where(picked_visible, order, torch.full_like(order, -1))
    return out
