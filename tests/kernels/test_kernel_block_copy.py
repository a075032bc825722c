"""Block gather / scatter: bit-exact for every dtype, in place, never reallocating."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_bits_equal, cpu_only

from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.block_copy.reference import gather_blocks_ref, scatter_blocks_ref
from kernels.dispatch import force_backend

CASES = [
    pytest.param(torch.float32, (7, 3, 5), id="fp32"),
    pytest.param(torch.bfloat16, (6, 3, 3), id="bf16-odd-bytes"),    # 18 B per block: int16 words
    pytest.param(torch.float8_e4m3fn, (9, 5), id="fp8"),              # 5 B per block: bytes
    pytest.param(torch.int64, (5,), id="int64-scalar-blocks"),
    pytest.param(torch.float32, (4, 2, 1, 3), id="fp32-4d"),
]


def _fill(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_gather_is_bit_exact(dtype, shape, device):
    pool = _fill(shape, dtype, seed=41)
    slots = torch.tensor([2, 0, 3, 2], dtype=torch.int32)
    with force_backend("triton"):
        out = gather_blocks(pool.to(device), slots.to(device))
    assert out.is_contiguous()
    assert_bits_equal(out.cpu(), gather_blocks_ref(pool, slots))


@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_scatter_is_bit_exact_and_in_place(dtype, shape, device):
    pool = _fill(shape, dtype, seed=42)
    slots = torch.tensor([3, 0, 1])
    src = _fill((3, *shape[1:]), dtype, seed=43)
    expected = pool.clone()
    scatter_blocks_ref(expected, slots, src)
    got = pool.to(device)
    ptr = got.data_ptr()
    with force_backend("triton"):
        scatter_blocks(got, slots.to(device), src.to(device))
    assert got.data_ptr() == ptr
    assert_bits_equal(got.cpu(), expected)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_scatter_keeps_the_pool_storage(backend, device):
    """Static topology: the pool's storage is written through, never replaced, even when
    src needs a dtype conversion."""
    pool = torch.zeros(5, 4, dtype=torch.bfloat16, device=device)
    ptr = pool.data_ptr()
    src = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], device=device)  # fp32 into bf16
    with force_backend(backend):
        scatter_blocks(pool, torch.tensor([4, 1], device=device), src)
    assert pool.data_ptr() == ptr
    assert pool.cpu().float()[[4, 1]].tolist() == src.cpu().tolist()
    assert pool.cpu()[[0, 2, 3]].eq(0).all()


def test_reference_scatter_into_an_fp8_pool():
    """Regression: index_copy_ has no fp8 kernel, so the reference used to raise
    NotImplementedError for fp8 pools (the KV cache's storage format)."""
    pool = torch.zeros(4, 3, dtype=torch.float8_e4m3fn)
    src = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, 3.0]]).to(torch.float8_e4m3fn)
    scatter_blocks_ref(pool, torch.tensor([2, 0]), src)
    assert pool.float().tolist() == [[448.0, 0.0, 3.0], [0.0] * 3, [1.0, -2.0, 0.5], [0.0] * 3]


def test_pool_views_are_honoured(device):
    """A pool that is a slice of a bigger tensor (offset storage, blocks still contiguous)."""
    big = _fill((10, 4, 6), torch.float32, seed=44).to(device)
    pool = big[1:9, 1:3]  # [8, 2, 6]: each block is 12 contiguous floats
    with force_backend("triton"):
        out = gather_blocks(pool, torch.tensor([7, 1], device=device))
        assert torch.equal(out, pool[[7, 1]])
        before = big.clone()
        scatter_blocks(pool, torch.tensor([0], device=device), torch.ones(1, 2, 6, device=device))
    expected = before.clone()
    expected[1, 1:3] = 1
    assert torch.equal(big, expected)


def test_validation_names_the_argument(device):
    pool = torch.zeros(4, 3, 2, device=device)
    with force_backend("triton"):
        with pytest.raises(ValueError, match="pool must be contiguous within a block"):
            gather_blocks(pool[:, :, :1], torch.tensor([0], device=device))
        with pytest.raises(TypeError, match="slots must be a 1-D int32/int64 tensor"):
            gather_blocks(pool, torch.tensor([0.0], device=device))
        with pytest.raises(ValueError, match=r"src must be \[len\(slots\), \*pool.shape\[1:\]\]"):
            scatter_blocks(pool, torch.tensor([0, 1], device=device), torch.zeros(2, 3, 3, device=device))


@cpu_only
def test_out_of_range_slots_raise_on_cpu():
    pool = torch.zeros(4, 3)
    with force_backend("triton"):
        with pytest.raises(IndexError, match=r"slots hold ids in \[0, 4\] but pool has 4 slots"):
            gather_blocks(pool, torch.tensor([0, 4]))
        with pytest.raises(IndexError, match="pool has 4 slots"):
            scatter_blocks(pool, torch.tensor([-1]), torch.zeros(1, 3))
