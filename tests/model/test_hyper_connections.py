"""The hyper-connections' Sinkhorn normalisation in place keeps the bits of the plain formula.

The model's arithmetic may not change without a ``KERNEL_ABI_VERSION`` bump (caches computed
by the old arithmetic would be reused); ``sinkhorn_`` writes into buffers instead of allocating
each result, and for up to 4 streams runs on a planar copy (each sum over contiguous rows of the
batch); this holds both to the expression they replaced, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from worker.model.hyper_connections import sinkhorn_


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 33, 256, 1024])
@pytest.mark.parametrize("n,iters", [(4, 20), (2, 1), (3, 20), (4, 2), (8, 5)])
def test_sinkhorn_in_place_is_bit_identical_to_the_formula(rows: int, n: int, iters: int) -> None:
    g = torch.Generator().manual_seed(rows * 100 + n * 10 + iters)
    eps = 1e-6
    for scale in (0.1, 1.0, 30.0):
        comb = torch.softmax(torch.randn(rows, n, n, generator=g) * scale, dim=-1) + eps
        want = sinkhorn_reference(comb, iters, eps)
        got = comb.clone()
        sinkhorn_(got, iters, eps)
        assert torch.equal(got, want)


@pytest.mark.parametrize("n", [4, 8])
def test_a_row_keeps_its_bits_in_any_batch(n: int) -> None:
    g = torch.Generator().manual_seed(7)
    comb = torch.softmax(torch.randn(1100, n, n, generator=g), dim=-1) + 1e-6
    whole = comb.clone()
    sinkhorn_(whole, 20, 1e-6)
    for lo, hi in ((0, 1), (5, 6), (3, 40), (63, 64), (17, 1050), (1099, 1100)):
        part = comb[lo:hi].clone()
        sinkhorn_(part, 20, 1e-6)
        assert torch.equal(part, whole[lo:hi])
