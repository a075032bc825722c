"""fp8 (e4m3fn) group quantisation and dequantisation (Triton).

One program per (row, block of ``BLOCK_G`` groups); a tile ``[BLOCK_G, GROUP]`` gives each
group's amax with one row reduction, so quantisation is a single read of ``x`` and a single
write of the bytes and scales. The arithmetic mirrors the reference step for step —
``scale = amax / 448`` (1 for an all-zero group), ``x / scale`` with IEEE division
(``div_rn``; Triton's ``/`` may lower to an approximate divide), clamp to ±448, round to
nearest-even e4m3 — so the bytes and scales are bit-identical to the reference.

Why the fp8 codes are computed in integer arithmetic: triton 3.9's interpreter converts
fp32 → float8e4nv without carrying a mantissa round-up into the exponent (31.6 becomes 16.0,
not 32.0), so ``.to(tl.float8e4nv)`` cannot be checked on CPU. The kernels therefore read
and write fp8 tensors as raw ``uint8`` (the host wrapper reinterprets with ``Tensor.view``)
and encode/decode e4m3fn with a few integer operations. This is the *only* code path, on
GPU as well: it is exact, and on a memory-bound kernel the dozen integer ops per element
cost nothing measurable next to the loads. (A hardware ``cvt.rn.satfinite.e4m3x2`` path
could replace it once verified on a GPU.)

Inputs are assumed finite: a NaN or inf in a group makes its scale non-finite, as in the
reference, but the codes written for such a group are not promised to match it.
"""

from __future__ import annotations

import torch

from kernels.triton_common import FLOAT_DTYPES, require_runnable, round_bf16, tl, triton

FP8_MAX = 448.0


@triton.jit
def _encode_e4m3(y):
    """fp32 in [-448, 448] → e4m3fn code (int32 in [0, 255]), round to nearest even.

    With ``|y| = M · 2^(E-23)`` (M the 24-bit significand), the code's significand is M
    shifted right by ``s`` bits with nearest-even rounding: ``s = 20`` in the normal range
    (E ≥ -6) and ``14 - E`` in the subnormal range (quantum 2^-9). A carry out of the
    significand lands in the exponent field by itself because code = exponent·8 + mantissa.
    """
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 31) & 1
    a = b & 0x7FFFFFFF
    E = (a >> 23) - 127
    M = (a & 0x7FFFFF) | 0x800000
    normal = E >= -6
    s = tl.where(normal, 20, tl.minimum(14 - E, 24))
    q = M >> s
    r = M & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((r > half) | ((r == half) & ((q & 1) == 1))).to(tl.int32)
    mag = tl.where(normal, ((E + 7) << 3) + q - 8, q)
    mag = tl.where(E < -10, 0, mag)  # below half the smallest subnormal (2^-10): rounds to 0
    return (sign << 7) | mag


@triton.jit
def _decode_e4m3(code):
    """e4m3fn code (int32 in [0, 255]) → fp32, exact (codes 0x7F / 0xFF are NaN)."""
    sign = code >> 7
    e = (code >> 3) & 15
    m = code & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m · 2^-9
    sub = tl.where(sign == 1, -sub, sub)
    nan = ((sign << 31) | 0x7F800000 | (m << 20)).to(tl.float32, bitcast=True)  # sign kept, as torch does
    return tl.where((e == 15) & (m == 7), nan, tl.where(e == 0, sub, normal))


@triton.jit
def _e8m0_exponent(amax):
    """The reference's ``e8m0_exponent``: smallest ``k`` with ``amax ≤ 448 · 2^k``, from the bits."""
    b = amax.to(tl.int32, bitcast=True)
    k = (b >> 23) - 135 + ((b & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(amax > 0, k, 0)
    return tl.minimum(tl.maximum(k, -126), 127)


@triton.jit
def _pow2(k):
    """``2^k`` as fp32 for ``k`` in [-126, 127], from its bits (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    X, QB, SCALE, G, group,
    stride_xn, stride_xd, stride_qn, stride_qd, stride_sn, stride_sg,
    BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, E8M0: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, GROUP_P2)
    mask = (offs_g < G)[:, None] & (offs_c < group)[None, :]
    ch = offs_g[:, None] * group + offs_c[None, :]
    x = tl.load(X + n * stride_xn + ch * stride_xd, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if E8M0:
        # a power-of-two scale: the product by 2^-k is exact and |y| ≤ 448 by construction
        k = _e8m0_exponent(amax)
        y = x * tl.broadcast_to(_pow2(-k)[:, None], x.shape)
        tl.store(SCALE + n * stride_sn + offs_g * stride_sg, (k + 127).to(tl.uint8), mask=offs_g < G)
    else:
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
        y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(SCALE + n * stride_sn + offs_g * stride_sg, scale, mask=offs_g < G)
    tl.store(QB + n * stride_qn + ch * stride_qd, _encode_e4m3(y).to(tl.uint8), mask=mask)


@triton.jit
def _dequantize_kernel(
    QB, SCALE, OUT, G, group,
    stride_qn, stride_qd, stride_sn, stride_sg, stride_on, stride_od,
    BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, E8M0: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, GROUP_P2)
    mask = (offs_g < G)[:, None] & (offs_c < group)[None, :]
    ch = offs_g[:, None] * group + offs_c[None, :]
    code = tl.load(QB + n * stride_qn + ch * stride_qd, mask=mask, other=0).to(tl.int32)
    if E8M0:
        scale = _pow2(tl.load(SCALE + n * stride_sn + offs_g * stride_sg, mask=offs_g < G, other=127)
                      .to(tl.int32) - 127)
    else:
        scale = tl.load(SCALE + n * stride_sn + offs_g * stride_sg, mask=offs_g < G, other=1.0)
    v = _decode_e4m3(code) * scale[:, None]
    if OUT.dtype.element_ty == tl.bfloat16:
        v = round_bf16(v)
    tl.store(OUT + n * stride_on + ch * stride_od, v.to(OUT.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side


def _check_group(group: object, D: int) -> None:
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    if D % group:
        raise ValueError(f"channel count {D} is not a multiple of the quantisation group {group}")


def _check_scale_format(scale_format: str) -> bool:
    if scale_format not in ("fp32", "e8m0"):
        raise ValueError(f"scale_format {scale_format!r}: use one of fp32, e8m0")
    return scale_format == "e8m0"


def _tiles(G: int, group: int) -> tuple[int, int]:
    group_p2 = triton.next_power_of_2(group)
    return max(1, min(triton.next_power_of_2(G), 2048 // group_p2)), group_p2


def quantize_fp8(x: torch.Tensor, group: int, scale_format: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`kernels.quant.reference.quantize_fp8_ref`: x ``[N, D]`` →
    (``[N, D]`` float8_e4m3fn, ``[N, D // group]`` scales: fp32, or uint8 for ``e8m0``), bit-identical."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; allowed: {', '.join(map(str, FLOAT_DTYPES))}")
    require_runnable("x", x)
    e8m0 = _check_scale_format(scale_format)
    N, D = x.shape
    _check_group(group, D)
    G = D // group
    codes = torch.empty((N, D), dtype=torch.uint8, device=x.device)
    scale = torch.empty((N, G), dtype=torch.uint8 if e8m0 else torch.float32, device=x.device)
    if N and G:
        BLOCK_G, GROUP_P2 = _tiles(G, group)
        _quantize_kernel[(N, triton.cdiv(G, BLOCK_G))](
            x, codes, scale, G, group, *x.stride(), *codes.stride(), *scale.stride(),
            BLOCK_G=BLOCK_G, GROUP_P2=GROUP_P2, E8M0=e8m0, num_warps=4,
        )
    return codes.view(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of :func:`kernels.quant.reference.dequantize_fp8_ref`: ``q · scale`` per
    group, in ``dtype``, bit-identical (a uint8 ``scale`` is e8m0: ``2^(scale - 127)``)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"q must be a 2-D float8_e4m3fn tensor, got {q.dtype} of shape {tuple(q.shape)}")
    require_runnable("q", q)
    N, D = q.shape
    _check_group(group, D)
    G = D // group
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float32, torch.uint8):
        raise TypeError("scale must be a float32 tensor (or uint8 e8m0 exponents)")
    if tuple(scale.shape) != (N, G):
        raise ValueError(f"scale must be [N, D // group] = {[N, G]}, got {list(scale.shape)}")
    if scale.device != q.device:
        raise ValueError(f"scale is on {scale.device} but q is on {q.device}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; allowed: {', '.join(map(str, FLOAT_DTYPES))}")
    out = torch.empty((N, D), dtype=dtype, device=q.device)
    if N and G:
        BLOCK_G, GROUP_P2 = _tiles(G, group)
        codes = q.view(torch.uint8)
        _dequantize_kernel[(N, triton.cdiv(G, BLOCK_G))](
            codes, scale, out, G, group, *codes.stride(), *scale.stride(), *out.stride(),
            BLOCK_G=BLOCK_G, GROUP_P2=GROUP_P2, E8M0=scale.dtype == torch.uint8, num_warps=4,
        )
    return out
