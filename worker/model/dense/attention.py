"""Batch-invariant grouped-query attention over a request's own K/V rows: the padded, chunked
form, for where the compiled kernel does not serve (``kernels.invariant.attention``: not built,
``KVL_CPU_ATTENTION=0``, float16, CUDA). The dense and YOCO layers call the kernel first.

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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, key_lo: torch.Tensor,
           window: int, scale: float) -> torch.Tensor:
    """Attention of ``S`` requests' queries at once, each over its own keys.

    ``q`` ``[S, n, H, D]`` at absolute ``positions`` ``[S, n]``; ``k``, ``v`` ``[S, L, kvh, D]``:
    request ``s``'s keys for the positions ``key_lo[s] + [0, L)`` (each ``key_lo`` a multiple of
    ``KEY_CHUNK``; rows past a request's own keys may hold anything finite — every query masks
    keys after its position). ``window`` > 0 limits a query at ``t`` to keys ``(t - window, t]``.
    Returns ``[S, n, H, D]`` in ``q``'s dtype. Each request's rows are computed exactly as they
    are with ``S = 1`` and only its own keys (see the module docstring).
    """
    S, n, H, D = q.shape
    L, kvh = k.shape[1], k.shape[2]
    g, C = H // kvh, KEY_CHUNK
    pad = (-L) % C
    if pad:
        k = torch.cat([k, k.new_zeros(S, pad, kvh, D)], 1)
        v = torch.cat([v, v.new_zeros(S, pad, kvh, D)], 1)
    Lp = k.shape[1]
    nc, rows, B = Lp // C, n * g, S * kvh
    qg = q.view(S, n, kvh, g, D).permute(0, 2, 1, 3, 4).reshape(B, rows, D)
    s = bmm_rows(qg, k.permute(0, 2, 3, 1).reshape(B, D, Lp)).float() * scale        # [B, rows, Lp]
    t = positions.view(S, 1, n, 1).expand(S, kvh, n, g).reshape(B, rows, 1)
    kp = (key_lo.view(S, 1) + torch.arange(Lp, device=q.device)).repeat_interleave(kvh, 0).unsqueeze(1)
    valid = kp <= t
    if window:
        valid &= kp > t - window
    s = s.masked_fill(~valid, float("-inf"))
    p = pointwise(torch.exp, s - s.amax(-1, keepdim=True))
    # NOTE: per-piece sums, then a scan over the pieces: the order of additions is fixed by the
    # query's own position, and masked pieces add exact zeros.
    denom = p.view(B, rows, nc, C).sum(-1).cumsum(-1)[..., -1:]
    w = (p / denom).to(v.dtype).view(B, rows, nc, C).transpose(1, 2).reshape(B * nc, rows, C)
    o = bmm_rows(w, v.permute(0, 2, 1, 3).reshape(B * nc, C, D)).view(B, nc, rows, D)
    o = o.float().cumsum(1)[:, -1]                                                    # [B, rows, D]
    return o.view(S, kvh, n, g, D).permute(0, 2, 1, 3, 4).reshape(S, n, H, D).to(q.dtype)
