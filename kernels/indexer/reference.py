"""Lightning-indexer scoring and top-k selection (reference).

``score(t, n) = Σ_h w[t,h] · ReLU(q[t,h] · k[n])`` over the compressed indexer keys; an
entry is visible to query position ``t`` only if ``n < (t + 1) // ratio``. The top-k is
deterministic: higher score first, ties broken by the lower entry index, so every
implementation (and every chunk schedule) selects the same set. Slots beyond the visible
count are −1.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    visible = torch.arange(N, device=q.device).view(1, N) < ((positions.view(T, 1) + 1) // ratio)
    return _select(indexer_scores_ref(q, k, w), visible, out)


def _select(s: torch.Tensor, visible: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each row's top visible entries of scores ``s`` (overwritten) into ``out`` ``[rows, topk]``,
    −1 where fewer are visible."""
    s.masked_fill_(~visible, float("-inf"))
    # NOTE: stable descending sort = ties keep ascending index order, which is the tie-break rule.
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :out.shape[1]]
    kk = order.shape[1]
    out[:, :kk] = torch.where(torch.gather(visible, 1, order), order, torch.full_like(order, -1))
    return out


def indexer_topk_many_ref(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                          ratio: int, topk: int) -> torch.Tensor:
    """Several requests' selections in one: ``parts`` holds each request's ``(q, k, w, positions)``
    as :func:`indexer_topk_ref` takes them; the result is their rows in order, ``[ΣT, topk]``,
    each row exactly what :func:`indexer_topk_ref` selects for it.

    Each part's scores are its own product (:func:`indexer_scores_ref` on the same operands, so
    the same bits); only the selection runs once, over the scores laid side by side and padded
    to the longest key list with −inf. Padding cannot change a row's picks: a stable descending
    sort puts a row's real entries in the order its own sort would, and every padded column
    after them (−inf like a masked entry, but with a larger index); padded columns are never
    visible, so any that reaches the first ``topk`` becomes −1, as the shorter row's missing
    columns are. One fused decode forward of 32 requests had spent ~75 µs per request and CSA
    layer on the selection's small ops.
    """
    if len(parts) == 1:
        return indexer_topk_ref(*parts[0], ratio, topk)
    rows = [q.shape[0] for q, _, _, _ in parts]
    keys = [k.shape[0] for _, k, _, _ in parts]
    total, width = sum(rows), max(keys, default=0)
    device = parts[0][0].device if parts else torch.device("cpu")
    out = torch.full((total, topk), -1, dtype=torch.int64, device=device)
    if total == 0 or width == 0:
        return out
    s = torch.full((total, width), float("-inf"), dtype=torch.float32, device=device)
    limit = torch.empty(total, dtype=torch.int64, device=device)
    r = 0
    for (q, k, w, positions), T, N in zip(parts, rows, keys):
        if N:
            s[r:r + T, :N] = indexer_scores_ref(q, k, w)
        limit[r:r + T] = torch.clamp((positions.view(T) + 1) // ratio, max=N)
        r += T
    visible = torch.arange(width, device=device).view(1, width) < limit.view(total, 1)
    return _select(s, visible, out)
