"""fp8 e4m3 group quantisation: the Triton kernels are bit-identical to the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DTYPES, assert_bits_equal

from kernels.dispatch import force_backend
from kernels.quant import dequantize_fp8, quantize_fp8
from kernels.quant.reference import FP8_MAX, dequantize_fp8_ref, quantize_fp8_ref

E4M3 = torch.float8_e4m3fn


def _wide_range(N, D, dtype, seed):
    """Magnitudes from 1e-6 to 1e3 across the row, so groups exercise subnormal codes too."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, D, generator=g) * torch.logspace(-6, 3, D)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "D", "group"), [(5, 36, 12), (3, 21, 3), (2, 192, 64)], ids=["g12", "g3", "g64"])
def test_quantize_is_bit_exact(N, D, group, dtype, device):
    x = _wide_range(N, D, dtype, seed=31)
    x[1, :group] = 0  # an all-zero group
    with force_backend("triton"):
        q, scale = quantize_fp8(x.to(device), group)
    q_ref, scale_ref = quantize_fp8_ref(x, group)
    assert_bits_equal(q.cpu(), q_ref)
    assert_bits_equal(scale.cpu(), scale_ref)


def test_quantize_rounds_every_boundary_like_torch(device):
    """Every finite e4m3 value, the midpoints between neighbours (round-half-even) and one
    ulp either side, both signs, at scale exactly 1 (each group holds a 448)."""
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = codes[torch.isfinite(codes)].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    values = torch.cat([grid, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                        torch.tensor([2.0**-10, 1e-30, 0.0, -0.0])])
    values = torch.cat([values, -values])
    G = 63
    rows = -(-values.numel() // G)
    x = torch.zeros(rows * G)
    x[: values.numel()] = values
    x = torch.cat([x.view(rows, G), torch.full((rows, 1), FP8_MAX)], dim=1)
    with force_backend("triton"):
        q, scale = quantize_fp8(x.to(device), 64)
    q_ref, scale_ref = quantize_fp8_ref(x, 64)
    assert scale_ref.eq(1).all()
    assert_bits_equal(q.cpu(), q_ref)
    assert_bits_equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_zero_group_has_unit_scale_and_zero_codes(backend, device):
    x = torch.zeros(2, 8)
    x[1, 4:] = torch.tensor([1.0, -2.0, 0.5, 4.0])
    with force_backend(backend):
        q, scale = quantize_fp8(x.to(device), 4)
    s = torch.tensor(4.0) / FP8_MAX  # fp32 division, as in the kernels
    assert torch.equal(scale.cpu(), torch.tensor([[1.0, 1.0], [1.0, s.item()]]))
    assert q.cpu().view(torch.uint8)[:, :4].eq(0).all()
    torch.testing.assert_close(q.cpu()[1, 4:].float() * s, x[1, 4:], atol=0, rtol=2**-4)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_dequantize_every_code_is_bit_exact(out_dtype, device):
    """All 256 codes (NaN ones included) under a few scales, into each output dtype."""
    q = torch.arange(256, dtype=torch.uint8).view(E4M3).view(8, 32)
    scale = torch.tensor([1.0, 3.0, 1e-3, 7.5, 0.1, 2.0**-20, 100.0, 1.0 / 448]).repeat_interleave(2).view(8, 2)
    with force_backend("triton"):
        out = dequantize_fp8(q.to(device), scale.to(device), 16, out_dtype)
    ref = dequantize_fp8_ref(q, scale, 16, out_dtype)
    assert out.dtype == out_dtype
    assert_bits_equal(out.cpu(), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_is_within_half_an_e4m3_step(dtype, device):
    x = _wide_range(4, 48, dtype, seed=32).float()
    with force_backend("triton"):
        q, scale = quantize_fp8(x.to(device), 16)
        back = dequantize_fp8(q, scale, 16).cpu()
    s = scale.cpu().repeat_interleave(16, dim=1)
    y = (x.abs() / s).clamp_min(2.0**-6)                 # below 2^-6 the spacing is the subnormal 2^-9
    step = s * 2.0 ** (torch.floor(torch.log2(y)) - 3)   # e4m3 spacing at y: 2^(exponent - 3)
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()


def test_validation_names_the_argument(device):
    x = torch.zeros(2, 12, device=device)
    with force_backend("triton"):
        with pytest.raises(ValueError, match="channel count 12 is not a multiple of the quantisation group 5"):
            quantize_fp8(x, 5)
        with pytest.raises(ValueError, match="x must be"):
            quantize_fp8(x[0], 4)
        q, scale = quantize_fp8(x, 4)
        with pytest.raises(ValueError, match=r"scale must be \[N, D // group\]"):
            dequantize_fp8(q, scale[:, :2], 4)
        with pytest.raises(TypeError, match="q must be a 2-D float8_e4m3fn tensor"):
            dequantize_fp8(x, scale, 4)


# --- e8m0 (power-of-two) scales: what kvledger stores cached state with -------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "D", "group"), [(5, 36, 12), (2, 64, 32)], ids=["g12", "g32"])
def test_e8m0_quantize_and_dequantize_are_bit_exact(N, D, group, dtype, device):
    x = _wide_range(N, D, dtype, seed=33)
    x[1, :group] = 0  # an all-zero group
    with force_backend("triton"):
        q, scale = quantize_fp8(x.to(device), group, scale_format="e8m0")
        back = dequantize_fp8(q, scale, group)
    q_ref, scale_ref = quantize_fp8_ref(x, group, scale_format="e8m0")
    assert scale_ref.dtype == torch.uint8 and scale_ref[1, 0] == 127
    assert_bits_equal(q.cpu(), q_ref)
    assert_bits_equal(scale.cpu(), scale_ref)
    assert_bits_equal(back.cpu(), dequantize_fp8_ref(q_ref, scale_ref, group))


def test_e8m0_scale_is_the_smallest_power_of_two_that_fits():
    """amax ≤ 448·2^k and amax > 448·2^(k-1), at and around every boundary 448·2^j."""
    edges = torch.tensor([448.0 * 2.0**j for j in range(-20, 20)])
    amax = torch.cat([edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges / 2),
                      torch.tensor([1e-30, 3.0, 447.9, 448.0, 449.0, 1.75, 1.7500001, 2**-140])])
    x = torch.stack([amax, torch.zeros_like(amax)], 1)      # one group of 2 per row
    _, s = quantize_fp8_ref(x, 2, scale_format="e8m0")
    k = s.double().squeeze(1) - 127
    a = amax.double()
    assert (a <= 448 * 2.0**k).all()
    assert ((a > 448 * 2.0 ** (k - 1)) | (k == -126)).all()


def test_e8m0_round_trip_is_idempotent():
    """Stored, read back and stored again: the same values (the property cached state needs)."""
    for seed in range(4):
        x = _wide_range(16, 64, torch.float32, seed=seed) * 10.0**seed
        once = dequantize_fp8_ref(*quantize_fp8_ref(x, 32, "e8m0"), 32)
        twice = dequantize_fp8_ref(*quantize_fp8_ref(once, 32, "e8m0"), 32)
        assert_bits_equal(twice, once)
        # and the values are exact in bfloat16 (a bfloat16 model keeps them without rounding)
        assert_bits_equal(once.to(torch.bfloat16).float(), once)
