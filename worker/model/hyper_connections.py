"""Manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` streams.

Before each sub-block (attention, MoE) a small projection of the RMS-normalised, flattened
streams gives three mixings:

* ``pre``  ``[n]``   — sigmoid + eps: collapses the streams into the sub-block's input;
* ``post`` ``[n]``   — 2·sigmoid: spreads the sub-block's output over the streams;
* ``comb`` ``[n, n]`` — row softmax + eps, then Sinkhorn normalisation (columns first, then
  ``iters − 1`` rounds of rows and columns) towards a doubly-stochastic matrix.

New streams: ``y_j = post_j · f(input) + Σ_i comb[i, j] · x_i`` — ``comb`` enters transposed
(it is not symmetric). The final head uses ``pre`` only.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.invariant import linear, pointwise
from worker.model.norms import as_dtype, as_float32, f32, rms_normalize


#: Largest ``hc_mult`` whose sums :func:`sinkhorn_` takes over the planar layout: up to 4 terms
#: ATen adds a reduced axis in order whichever axis it is; at 8 the innermost axis is summed with
#: several accumulators, so the planar sums would round differently (tests/model/test_hyper_connections.py).
PLANAR_MAX_N = 4


def sinkhorn_(comb: torch.Tensor, iters: int, eps: float) -> None:
    """Sinkhorn normalisation of ``comb`` ``[T, n, n]`` in place: columns, then ``iters − 1``
    rounds of rows and columns, each divided by its sum + ``eps``.

    NOTE: the same sums, additions and divisions as ``comb = comb / (comb.sum(...) + eps)``, so
    the same bits, but into two small buffers and ``comb`` itself: ~115 ops a call, twelve calls
    a forward, where allocating each result cost about a third of the loop. For ``n`` ≤
    :data:`PLANAR_MAX_N` the loop runs on a planar copy ``[n, n, T]``: each sum then adds whole
    contiguous rows of ``T`` values (vectorised across the rows of the batch) where over
    ``[T, n, n]`` it reduced runs of ``n`` floats one by one — 2.9 → 0.7 ms a call at 1,024 rows,
    0.38 → 0.40 ms at one row (the copy in and out) — and a sum of up to 4 terms is added in
    order on either layout.
    ``comb`` must be a fresh float32 tensor (no autograd, nobody else holding it).
    """
    T, n = comb.shape[0], comb.shape[-1]
    planar = n <= PLANAR_MAX_N
    c = comb.permute(1, 2, 0).contiguous() if planar else comb     # [i, j, T] or [T, i, j]
    i_ax, j_ax = (0, 1) if planar else (-2, -1)
    cols = c.new_empty((1, n, T) if planar else (T, 1, n))
    rows = c.new_empty((n, 1, T) if planar else (T, n, 1))
    # NOTE: eps as a kept float32 tensor (norms.f32: the same bits for this float32 op): with a
    # Python scalar each add_ first copied it into a tensor (~4 us), ~470 times a decode step
    e = f32(eps, c)
    torch.sum(c, dim=i_ax, keepdim=True, out=cols)
    c.div_(cols.add_(e))
    for _ in range(iters - 1):
        torch.sum(c, dim=j_ax, keepdim=True, out=rows)
        c.div_(rows.add_(e))
        torch.sum(c, dim=i_ax, keepdim=True, out=cols)
        c.div_(cols.add_(e))
    if planar:
        comb.copy_(c.permute(2, 0, 1))


class HyperConnection(nn.Module):
    def __init__(self, hidden: int, n: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams ``[T, n, hidden]`` → (post ``[T, n]``, comb ``[T, n, n]``, collapsed ``[T, hidden]``)."""
        n = self.n
        mixes = linear(rms_normalize(as_float32(streams.flatten(1)), self.norm_eps), as_float32(self.fn))
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        eps = f32(self.eps, mixes)                                             # mixes are float32
        pre = pointwise(torch.sigmoid, pre_w * s_pre + pre_b) + eps
        post = f32(2.0, mixes) * pointwise(torch.sigmoid, post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + eps
        sinkhorn_(comb, self.iters, self.eps)
        collapsed = as_dtype((pre.unsqueeze(-1) * streams).sum(dim=1), streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """New streams from the old ones and the sub-block output ``out`` ``[T, hidden]``."""
        dtype = streams.dtype
        return as_dtype(post, dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            as_dtype(comb, dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the streams before the last norm and the LM head."""

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = linear(rms_normalize(as_float32(streams.flatten(1)), self.norm_eps), as_float32(self.hc_fn))
        pre = (pointwise(torch.sigmoid, mixes * as_float32(self.hc_scale) + as_float32(self.hc_base))
               + f32(self.eps, mixes))
        return as_dtype((pre.unsqueeze(-1) * streams).sum(dim=1), streams.dtype)
