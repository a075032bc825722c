"""Compressor: fused softmax-pool + RMSNorm + RoPE, and the ring-buffer state save."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DTYPES, assert_bits_equal

from kernels.compressor import compress_entries, save_state
from kernels.compressor.reference import compress_entries_ref, save_state_ref
from kernels.dispatch import force_backend

# (n windows, S slots, C channels, rope_dims // 2)
SHAPES = [
    pytest.param((3, 8, 37, 4), id="csa-like-odd-C"),      # C - rope_dims odd: rotary pairs shifted
    pytest.param((2, 19, 300, 8), id="multi-slot-chunks"),  # 8 slots per chunk at this width: 3 chunks
    pytest.param((1, 128, 24, 6), id="hca-like"),
]


def _case(shape, dtype, seed, empty_slots=0):
    n, S, C, half = shape
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, S, C, generator=g).to(dtype)
    score = (torch.randn(n, S, C, generator=g) * 3).to(dtype)
    score[:, :empty_slots] = float("-inf")  # CSA's first window: the previous window's slots are empty
    weight = torch.rand(C, generator=g) + 0.5
    angle = torch.rand(n, half, generator=g) * 6.3
    return kv, score, weight, torch.cos(angle), torch.sin(angle)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_compress_entries_matches_reference(shape, dtype, device):
    kv, score, weight, cos, sin = _case(shape, dtype, seed=21, empty_slots=shape[1] // 2)
    with force_backend("triton"):
        out = compress_entries(*(x.to(device) for x in (kv, score, weight)), 1e-6, cos.to(device), sin.to(device))
    assert out.dtype == torch.float32 and out.shape == (shape[0], shape[2])
    # fp32 throughout for both (bf16 inputs are upcast exactly): only rounding order differs.
    torch.testing.assert_close(out.cpu(), compress_entries_ref(kv, score, weight, 1e-6, cos, sin),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_slots_weigh_nothing(backend, device):
    """Slots scored -inf do not change the entry, whatever their kv rows hold."""
    kv, score, weight, cos, sin = _case((2, 8, 16, 2), torch.float32, seed=22, empty_slots=4)
    garbage = kv.clone()
    garbage[:, :4] = 1e6
    with force_backend(backend):
        a = compress_entries(*(x.to(device) for x in (kv, score, weight)), 1e-6, cos.to(device), sin.to(device))
        b = compress_entries(*(x.to(device) for x in (garbage, score, weight)), 1e-6, cos.to(device), sin.to(device))
        c = compress_entries(*(x.to(device) for x in (kv[:, 4:], score[:, 4:], weight)), 1e-6,
                             cos.to(device), sin.to(device))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)


def test_strided_inputs(device):
    kv, score, weight, cos, sin = _case((3, 6, 20, 3), torch.float32, seed=23)
    kv_t = kv.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    cos_wide = torch.stack((cos, cos), -1)[..., 0]           # non-unit last stride
    with force_backend("triton"):
        out = compress_entries(*(x.to(device) for x in (kv_t, score, weight)), 1e-5,
                               cos_wide.to(device), sin.to(device))
    ref = compress_entries_ref(kv, score, weight, 1e-5, cos, sin)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_compress_validation_names_the_argument(device):
    kv, score, weight, cos, sin = (x.to(device) for x in _case((2, 4, 8, 2), torch.float32, seed=24))
    with force_backend("triton"):
        with pytest.raises(ValueError, match="score has shape"):
            compress_entries(kv, score[:, :3], weight, 1e-6, cos, sin)
        with pytest.raises(ValueError, match="norm_weight has 7 channels but kv has 8"):
            compress_entries(kv, score, weight[:7], 1e-6, cos, sin)
        with pytest.raises(ValueError, match="cos/sin rotate 10 channels but kv has only 8"):
            compress_entries(kv, score, weight, 1e-6, torch.ones(2, 5, device=device), torch.ones(2, 5, device=device))
        with pytest.raises(ValueError, match="cos/sin have 1 rows but there are 2 windows"):
            compress_entries(kv, score, weight, 1e-6, cos[:1], sin[:1])


def _rows(T, C, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, C, generator=g), torch.randn(T, C, generator=g)


@pytest.mark.parametrize(
    ("state_dtype", "positions"),
    [
        pytest.param(torch.float32, [3, 4, 5, 6, 7], id="fp32-consecutive"),
        pytest.param(torch.float32, [9, 2, 14, 7, 4, 19, 2, 24, 11, 30], id="fp32-collisions-unsorted"),
        pytest.param(torch.bfloat16, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], id="bf16-state-wraps"),
        pytest.param(torch.float32, [-1, -6, 3], id="negative-positions-python-modulo"),
    ],
)
def test_save_state_is_bit_exact(state_dtype, positions, device):
    R, C = 5, 7
    kv_rows, score_rows = _rows(len(positions), C, seed=25)
    pos = torch.tensor(positions)
    state = [torch.full((R, C), 0.5, dtype=state_dtype), torch.full((R, C), float("-inf"), dtype=state_dtype)]
    expected = [s.clone() for s in state]
    save_state_ref(*expected, kv_rows, score_rows, pos)
    got = [s.to(device) for s in state]
    ptrs = [s.data_ptr() for s in got]
    with force_backend("triton"):
        save_state(*got, kv_rows.to(device), score_rows.to(device), pos.to(device))
    assert [s.data_ptr() for s in got] == ptrs
    for g, e in zip(got, expected):
        assert_bits_equal(g.cpu(), e)


def test_save_state_later_row_wins(device):
    """Three rows land on ring row 1; the last one in chunk order is kept."""
    R, C = 4, 3
    state_kv, state_score = torch.zeros(R, C, device=device), torch.zeros(R, C, device=device)
    kv_rows = torch.tensor([[1.0] * C, [2.0] * C, [3.0] * C], device=device)
    with force_backend("triton"):
        save_state(state_kv, state_score, kv_rows, -kv_rows, torch.tensor([9, 5, 1], device=device))
    assert state_kv[1].tolist() == [3.0] * C and state_score[1].tolist() == [-3.0] * C
    assert state_kv[[0, 2, 3]].eq(0).all()


def test_save_state_validation_names_the_argument(device):
    state = torch.zeros(4, 3, device=device)
    rows = torch.zeros(2, 3, device=device)
    with force_backend("triton"):
        with pytest.raises(ValueError, match="positions has 3 entries but there are 2 rows"):
            save_state(state, state.clone(), rows, rows, torch.tensor([0, 1, 2], device=device))
        with pytest.raises(ValueError, match=r"must both be \[T, 3\]"):
            save_state(state, state.clone(), rows[:, :2], rows, torch.tensor([0, 1], device=device))
        with pytest.raises(TypeError, match="positions has dtype torch.float32"):
            save_state(state, state.clone(), rows, rows, torch.tensor([0.0, 1.0], device=device))
