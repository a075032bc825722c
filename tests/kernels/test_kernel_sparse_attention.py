"""Sparse attention with a sink: the Triton kernel against the reference, and the reference's own edge cases."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DTYPES, TOL, cpu_only

from kernels.dispatch import force_backend
from kernels.sparse_attention import paged_sparse_attn, sparse_attn
from kernels.sparse_attention.reference import paged_sparse_attn_ref, sparse_attn_ref

# (T queries, H heads, D channels, E entries per slot, slots, K keys per query)
SHAPES = [
    pytest.param((3, 5, 37, 4, 7, 11), id="odd"),
    pytest.param((2, 17, 257, 3, 5, 70), id="wide-D-multi-block"),  # D ≥ 256: 2 head blocks, K spans 3
    pytest.param((1, 33, 16, 1, 9, 5), id="many-heads"),
]


def _case(shape, dtype, device, seed):
    T, H, D, E, S, K = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    pool = torch.randn(S, E, D, generator=g).to(dtype)
    n_blocks = S - 1
    table = torch.randperm(S, generator=g)[:n_blocks].to(torch.int32)   # a permuted, partial table
    idx = torch.randint(-1, n_blocks * E, (T, K), generator=g)          # -1 = masked
    idx[0, : K // 2] = -1
    sink = torch.randn(H, generator=g) * 2
    return [x.to(device) for x in (q, pool, table, idx, sink)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_matches_reference(shape, dtype, device):
    q, pool, table, idx, sink = _case(shape, dtype, device, seed=1)
    scale = q.shape[-1] ** -0.5
    with force_backend("triton"):
        out = paged_sparse_attn(q, pool, table, idx, sink, scale)
    ref = paged_sparse_attn_ref(q.cpu(), pool.cpu(), table.cpu(), idx.cpu(), sink.cpu(), scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpaged_matches_reference(dtype, device):
    g = torch.Generator().manual_seed(2)
    T, H, D, N, K = 4, 3, 19, 9, 13
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(N, D, generator=g).to(dtype)
    idx = torch.randint(-1, N, (T, K), generator=g)
    sink = torch.randn(H, generator=g)
    with force_backend("triton"):
        out = sparse_attn(q.to(device), kv.to(device), idx.to(device), sink.to(device), 0.3)
    torch.testing.assert_close(out.cpu(), sparse_attn_ref(q, kv, idx, sink, 0.3), **TOL[dtype])


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["bf16-q-fp32-kv", "fp32-q-bf16-kv"])
def test_mixed_dtypes_match_reference(q_dtype, kv_dtype, device):
    """The model concatenates window rows and fp32 compressed entries: dtypes may differ."""
    q, pool, table, idx, sink = _case((2, 3, 20, 3, 4, 7), torch.float32, device, seed=8)
    q, pool = q.to(q_dtype), pool.to(kv_dtype)
    with force_backend("triton"):
        out = paged_sparse_attn(q, pool, table, idx, sink, 0.3)
    ref = paged_sparse_attn_ref(q.cpu(), pool.cpu(), table.cpu(), idx.cpu(), sink.cpu(), 0.3)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.cpu(), ref, **TOL[q_dtype])


def test_strided_inputs_and_int32_indices(device):
    """q as a transposed view, pool as a slice, int32 indices: strides are honoured."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, 21, generator=g).transpose(0, 1)             # [T=2, H=5, D=21], not contiguous
    pool = torch.randn(6, 4, 2, 21, generator=g)[:, :, 1]              # [6, 4, 21], strided
    table = torch.tensor([4, 1, 3], dtype=torch.int64)
    idx = torch.randint(-1, 12, (2, 9), generator=g, dtype=torch.int32)
    sink = torch.randn(5, generator=g)
    with force_backend("triton"):
        out = paged_sparse_attn(*(x.to(device) for x in (q, pool, table, idx, sink)), 0.2)
    ref = paged_sparse_attn_ref(q, pool, table, idx.long(), sink, 0.2)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])


@pytest.mark.parametrize("sink_value", [30.0, -30.0, float("-inf")], ids=["dominant", "negligible", "minus-inf"])
def test_sink_extremes_match_reference(sink_value, device):
    q, pool, table, idx, sink = _case((3, 4, 24, 4, 5, 10), torch.float32, device, seed=4)
    idx[0, 0] = 0  # every query has at least one key (with a -inf sink and none, both give nan)
    sink = torch.full_like(sink, sink_value)
    with force_backend("triton"):
        out = paged_sparse_attn(q, pool, table, idx, sink, 0.25)
    ref = paged_sparse_attn_ref(q.cpu(), pool.cpu(), table.cpu(), idx.cpu(), sink.cpu(), 0.25)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_all_masked_gives_zero_output(backend, device):
    q, pool, table, idx, sink = _case((2, 3, 8, 2, 4, 6), torch.float32, device, seed=5)
    idx = torch.full_like(idx, -1)
    with force_backend(backend):
        out = paged_sparse_attn(q, pool, table, idx, sink, 1.0)
    assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sink_enters_the_denominator_only(backend, device):
    """One key j: o = v_j · e^{s_j} / (e^{s_j} + e^{sink}); repeating the key doubles its weight."""
    D = 4
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    kv = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    sink = torch.tensor([0.5])
    s = 2.0  # q · k with scale 1
    with force_backend(backend):
        one = sparse_attn(q.to(device), kv.to(device), torch.tensor([[0, -1]], device=device), sink.to(device), 1.0)
        two = sparse_attn(q.to(device), kv.to(device), torch.tensor([[0, 0]], device=device), sink.to(device), 1.0)
    e_s, e_sink = torch.exp(torch.tensor(s)), torch.exp(sink)
    torch.testing.assert_close(one.cpu(), (kv * e_s / (e_s + e_sink)).view(1, 1, D))
    torch.testing.assert_close(two.cpu(), (kv * 2 * e_s / (2 * e_s + e_sink)).view(1, 1, D))


def test_empty_unpaged_kv_with_all_masked(device):
    q = torch.randn(2, 3, 8)
    with force_backend("triton"):
        out = sparse_attn(q.to(device), torch.empty(0, 8, device=device),
                          torch.full((2, 4), -1, device=device), torch.zeros(3, device=device), 1.0)
    assert torch.equal(out.cpu(), sparse_attn_ref(q, torch.empty(0, 8), torch.full((2, 4), -1), torch.zeros(3), 1.0))


def test_validation_names_the_argument(device):
    q, pool, table, idx, sink = _case((2, 3, 8, 2, 4, 6), torch.float32, device, seed=6)
    with force_backend("triton"):
        with pytest.raises(ValueError, match="sink has 2 entries but q has 3 heads"):
            paged_sparse_attn(q, pool, table, idx, sink[:2], 1.0)
        with pytest.raises(ValueError, match="idx has 1 rows but q has 2 queries"):
            paged_sparse_attn(q, pool, table, idx[:1], sink, 1.0)
        with pytest.raises(TypeError, match="idx has dtype torch.float32"):
            paged_sparse_attn(q, pool, table, idx.float(), sink, 1.0)
        with pytest.raises(ValueError, match="pool has 7 channels but q has 8"):
            paged_sparse_attn(q, pool[..., :7], table, idx, sink, 1.0)


@cpu_only
def test_out_of_range_indices_raise_on_cpu():
    q, pool, table, idx, sink = _case((2, 3, 8, 2, 4, 6), torch.float32, torch.device("cpu"), seed=7)
    with force_backend("triton"):
        with pytest.raises(IndexError, match="block_table maps only 3 blocks of 2 entries"):
            paged_sparse_attn(q, pool, table, torch.full_like(idx, 6), sink, 1.0)
        with pytest.raises(IndexError, match="kv has only 3 rows"):
            sparse_attn(q, pool[0:3, 0], torch.full_like(idx, 3), sink, 1.0)
        with pytest.raises(IndexError, match="slot outside"):
            paged_sparse_attn(q, pool, torch.tensor([0, 9, 1]), torch.full_like(idx, 2), sink, 1.0)
