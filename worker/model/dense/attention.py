"""Batch-invariant grouped-query attention over a request's own K/V rows.

``attend`` computes softmax(q·kᵀ·scale + causal/window mask)·v for the queries of ONE request,
with keys taken from that request's state. Why its layout keeps a row's bits independent of
its company (the same argument as ``kernels.sparse_attention.reference``, for separate K and V
and several KV heads):

* scores are one product per KV head, ``[rows, D] × [D, keys]``, whose reduction is over the
  head dim (fixed) — a row's scores do not depend on how many rows or keys share the product
  (``kernels.invariant``: rows padded to ``MIN_ROWS``, keys padded to whole ``KEY_CHUNK`` pieces);
* the key axis is cut into ``KEY_CHUNK`` pieces anchored at absolute positions (``key_lo`` is a
  multiple of the piece width); each piece is reduced on its own and the pieces are added in
  order by a scan, so a piece wholly masked for this query (a later position, or before its
  window) adds an exact zero. A decode step, a prefill unit and a batch therefore give a query
  the same bits, and so do a cold run and a resumed one.

The softmax runs in float32 whatever the model's dtype (as transformers' eager attention does);
the weighted sum of V runs in the model's dtype, its per-piece partial sums accumulate in float32.
"""

from __future__ import annotations

import torch

from kernels.invariant import KEY_CHUNK, bmm_rows, pointwise


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, key_lo: int,
           window: int, scale: float) -> torch.Tensor:
    """``q`` ``[n, H, D]`` at absolute ``positions`` ``[n]``; ``k``, ``v`` ``[L, kvh, D]`` for the
    positions ``[key_lo, key_lo + L)`` (``key_lo`` a multiple of ``KEY_CHUNK``; every query's own
    position among them). ``window`` > 0 limits a query at ``t`` to keys ``(t - window, t]``.
    Returns ``[n, H, D]`` in ``q``'s dtype."""
    assert key_lo % KEY_CHUNK == 0, "key pieces must start at absolute multiples of KEY_CHUNK"
    n, H, D = q.shape
    L, kvh = k.shape[0], k.shape[1]
    g, C = H // kvh, KEY_CHUNK
    pad = (-L) % C
    if pad:
        k = torch.cat([k, k.new_zeros(pad, kvh, D)], 0)
        v = torch.cat([v, v.new_zeros(pad, kvh, D)], 0)
    nc = k.shape[0] // C
    rows = n * g
    qg = q.view(n, kvh, g, D).transpose(0, 1).reshape(kvh, rows, D)
    s = bmm_rows(qg, k.permute(1, 2, 0).contiguous()).float() * scale          # [kvh, rows, Lp]
    t = positions.repeat_interleave(g).unsqueeze(1)                              # [rows, 1]
    kp = key_lo + torch.arange(k.shape[0], device=q.device).unsqueeze(0)         # [1, Lp]
    valid = kp <= t
    if window:
        valid &= kp > t - window
    s = s.masked_fill(~valid, float("-inf"))
    p = pointwise(torch.exp, s - s.amax(-1, keepdim=True))
    # NOTE: per-piece sums, then a scan over the pieces: the order of additions is fixed by the
    # query's own position, and masked pieces add exact zeros.
    denom = p.view(kvh, rows, nc, C).sum(-1).cumsum(-1)[..., -1:]
    w = (p / denom).to(v.dtype).view(kvh, rows, nc, C).transpose(1, 2).reshape(kvh * nc, rows, C)
    o = bmm_rows(w, v.transpose(0, 1).reshape(kvh * nc, C, D)).view(kvh, nc, rows, D)
    o = o.float().cumsum(1)[:, -1]                                                # [kvh, rows, D]
    return o.view(kvh, n, g, D).transpose(0, 1).reshape(n, H, D).to(q.dtype)
