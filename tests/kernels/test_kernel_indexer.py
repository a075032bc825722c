"""Lightning indexer: scores and the deterministic top-k, Triton against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_testing import DTYPES

from kernels.dispatch import force_backend
from kernels.indexer import indexer_scores, indexer_topk
from kernels.indexer.reference import indexer_scores_ref, indexer_topk_ref


def _random(T, NH, DI, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, NH, DI, generator=g).to(dtype)
    k = torch.randn(N, DI, generator=g).to(dtype)
    w = torch.randn(T, NH, generator=g) * (DI * NH) ** -0.5
    return q, k, w


def _exact(scores: torch.Tensor):
    """Inputs whose indexer score is exactly ``scores[t, n]`` in any summation order:
    two heads of one channel, q = (1, -1), w = (1, -1), k = s → relu(s) - relu(-s) = s."""
    T, N = scores.shape
    q = torch.tensor([[1.0], [-1.0]]).expand(T, 2, 1).contiguous()
    w = torch.tensor([1.0, -1.0]).expand(T, 2).contiguous()
    assert N == 0 or scores.std(0).max() == 0, "one score per entry: rows differ by visibility only"
    return q, scores[:1].T.contiguous() if T else torch.empty(N, 1), w


def _topk_both(q, k, w, positions, ratio, topk, device):
    with force_backend("triton"):
        out = indexer_topk(q.to(device), k.to(device), w.to(device), positions.to(device), ratio, topk)
    return out.cpu(), indexer_topk_ref(q, k, w, positions, ratio, topk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 3, 19, 23), (3, 65, 16, 70)], ids=["odd", "two-head-blocks"])
def test_scores_match_reference(shape, dtype, device):
    q, k, w = _random(*shape, dtype, seed=11)
    with force_backend("triton"):
        s = indexer_scores(q.to(device), k.to(device), w.to(device))
    assert s.dtype == torch.float32 and s.shape == (shape[0], shape[3])
    # Inputs are upcast exactly; only the summation order differs.
    torch.testing.assert_close(s.cpu(), indexer_scores_ref(q, k, w), atol=1e-5, rtol=1e-5)


def test_mixed_dtypes_and_int_like_arguments(device):
    """bf16 queries against fp32 keys (the model stores entries in fp32); numpy/tensor ints."""
    q, k, w = _random(5, 4, 12, 17, torch.float32, seed=17)
    q = q.bfloat16()
    with force_backend("triton"):
        s = indexer_scores(q.to(device), k.to(device), w.to(device))
        out = indexer_topk(q.to(device), k.to(device), w.to(device), torch.tensor([80] * 5, device=device),
                           np.int64(4), torch.tensor(6))
    torch.testing.assert_close(s.cpu(), indexer_scores_ref(q, k, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(out.cpu(), indexer_topk_ref(q, k, w, torch.tensor([80] * 5), 4, 6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_matches_reference(dtype, device):
    q, k, w = _random(7, 3, 19, 23, dtype, seed=12)
    positions = torch.tensor([0, 3, 10, 40, 95, 60, 7])  # nothing, one, some, and all 23 visible
    for topk in (5, 30):                                  # fewer and more than the entries
        out, ref = _topk_both(q, k, w, positions, 4, topk, device)
        assert torch.equal(out, ref), (topk, out, ref)


def test_topk_with_many_ties_across_chunks(device):
    """600 entries (3 selection chunks), scores in {-2..2}: the threshold falls inside a tie."""
    g = torch.Generator().manual_seed(13)
    scores = torch.randint(-2, 3, (1, 600), generator=g).float().expand(4, 600)
    q, k, w = _exact(scores)
    positions = torch.tensor([2399, 1000, 403, 3])  # 600, 250, 101 and 1 visible (ratio 4)
    out, ref = _topk_both(q, k, w, positions, 4, 40, device)
    assert torch.equal(out, ref)
    # Sanity of the oracle itself: the 40 picks of row 0 are the 2s, then the 1s, lowest index first.
    s0 = scores[0]
    expected = torch.cat([(s0 == 2).nonzero().flatten(), (s0 == 1).nonzero().flatten()])[:40]
    assert torch.equal(ref[0], expected)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_relu_zero_ties_go_to_lower_index(backend, device):
    """q·k < 0 everywhere: every score is ReLU's 0, so the top-k is simply 0, 1, 2, …"""
    q = -torch.ones(3, 2, 4)
    k = torch.ones(10, 4)
    w = torch.ones(3, 2)
    with force_backend(backend):
        out = indexer_topk(q.to(device), k.to(device), w.to(device), torch.tensor([39, 39, 39], device=device), 4, 6)
    assert torch.equal(out.cpu(), torch.arange(6).expand(3, 6))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_visibility_masks_future_entries(backend, device):
    """Entry n is visible to t iff n < (t + 1) // ratio; the best entry is the latest one."""
    scores = torch.arange(8.0).expand(5, 8)            # later entries score higher
    q, k, w = _exact(scores)
    positions = torch.tensor([0, 2, 3, 8, 100])         # 0, 0, 1, 2, all 8 visible at ratio 4
    with force_backend(backend):
        out = indexer_topk(q.to(device), k.to(device), w.to(device), positions.to(device), 4, 3)
    assert torch.equal(out.cpu(), torch.tensor([[-1, -1, -1], [-1, -1, -1], [0, -1, -1], [1, 0, -1], [7, 6, 5]]))


def test_selection_is_exact_on_given_scores(device):
    """The select kernel alone, on scores with ±0.0, a -inf and near-equal values: it must
    reproduce torch's stable descending sort (which treats -0.0 == +0.0)."""
    from kernels.indexer.triton_impl import _select_topk

    g = torch.Generator().manual_seed(14)
    N = 300
    s = torch.randn(3, N, generator=g)
    s[:, ::7] = 0.0
    s[:, 3::7] = -0.0
    s[1, 5] = float("-inf")
    s[2, 10:20] = torch.nextafter(torch.tensor(1.5), torch.tensor(2.0))  # one-ulp neighbours
    s[2, 20:30] = 1.5
    positions = torch.tensor([N - 1, N - 1, 150])
    topk = 64
    with force_backend("triton"):
        out = _select_topk(s.to(device), positions.to(device), 1, topk).cpu()
    visible = torch.arange(N).view(1, N) < (positions.view(3, 1) + 1)
    order = torch.sort(s.masked_fill(~visible, float("-inf")), dim=1, descending=True, stable=True).indices[:, :topk]
    assert torch.equal(out, order)


def test_degenerate_sizes(device):
    q, k, w = _random(3, 2, 8, 5, torch.float32, seed=15)
    positions = torch.tensor([30, 30, 30])
    for kk, N in ((0, 5), (4, 0)):
        out, ref = _topk_both(q, k[:N], w, positions, 4, kk, device)
        assert out.shape == (3, kk) and torch.equal(out, ref)


def test_validation_names_the_argument(device):
    q, k, w = (x.to(device) for x in _random(3, 2, 8, 5, torch.float32, seed=16))
    pos = torch.tensor([1, 2, 3], device=device)
    with force_backend("triton"):
        with pytest.raises(ValueError, match="k has 7 channels but q has 8"):
            indexer_scores(q, k[:, :7], w)
        with pytest.raises(ValueError, match=r"w must be \[T, nH\]"):
            indexer_scores(q, k, w[:, :1])
        with pytest.raises(ValueError, match="positions has 2 entries but q has 3 queries"):
            indexer_topk(q, k, w, pos[:2], 4, 2)
        with pytest.raises(ValueError, match="ratio must be a positive int"):
            indexer_topk(q, k, w, pos, 0, 2)
        with pytest.raises(ValueError, match="topk must be a non-negative int"):
            indexer_topk(q, k, w, pos, 4, -1)


@pytest.mark.parametrize("seed", range(6))
def test_many_parts_select_what_each_part_selects_alone(seed: int) -> None:
    """indexer_topk_many_ref: the parts' rows equal indexer_topk_ref per part, bit for bit, with
    parts of different key counts (none at all, fewer than topk, more), positions that see
    none, some or all of them, and tied scores (repeated keys)."""
    from kernels.indexer import indexer_topk_many
    from kernels.indexer.reference import indexer_topk_many_ref

    g = torch.Generator().manual_seed(seed)
    NH, DI, ratio, topk = 2, 8, 4, 5
    parts = []
    for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
        T = int(torch.randint(1, 5, (1,), generator=g))
        N = int(torch.randint(0, 12, (1,), generator=g))
        q, k, w = _random(T, NH, DI, N, torch.float32, int(torch.randint(0, 10_000, (1,), generator=g)))
        if N > 3:
            k[N // 2] = k[1]                       # a tie: the lower entry index must win
        positions = torch.randint(0, 4 * N + 8, (T,), generator=g)
        parts.append((q, k, w, positions))
    want = torch.cat([indexer_topk_ref(q, k, w, pos, ratio, topk) for q, k, w, pos in parts])
    assert torch.equal(indexer_topk_many_ref(parts, ratio, topk), want)
    assert torch.equal(indexer_topk_many(parts, ratio, topk), want)
    for topk_other in (1, 12):
        want = torch.cat([indexer_topk_ref(q, k, w, pos, ratio, topk_other) for q, k, w, pos in parts])
        assert torch.equal(indexer_topk_many_ref(parts, ratio, topk_other), want)
