"""The DeepSeek-V4 compressor's two kernels (Triton).

``compress_entries``: one program per closing window, fused softmax-pool → RMSNorm → RoPE.
The program walks the window's slots in chunks of ``BLOCK_S`` with a *per-channel* online
softmax (running max, denominator and weighted sum for every channel), so an HCA window of
128 slots × 512 channels never has to sit in registers at once; the pooled row (512 fp32)
stays in registers for the RMSNorm and the rotation, and is written once.

Channels are held as pairs ``[BLOCK_P, 2]`` aligned to the rotary pairs ``(C − rd + 2i,
C − rd + 2i + 1)`` (shifted by one when ``C − rd`` is odd), so the interleaved rotation is a
``tl.split`` / ``tl.join`` in registers, with no second load and no shuffle. Pairs before the
rotary part see cos = 1, sin = 0.

``save_state``: one program per (ring row, channel block). A ring row receives the *last* of
the chunk's rows whose ``position % R`` lands on it ("later rows win", as in the reference on
CPU), so each program scans the positions for its row and copies that one row; duplicates
never race and the result does not depend on scheduling. The scan is O(T) per program, which
is cheap next to the row copy for chunk sizes up to a few thousand tokens.
"""

from __future__ import annotations

import torch

from kernels.triton_common import FLOAT_DTYPES, INDEX_DTYPES, cast_to, require_runnable, tl, triton


@triton.jit
def _compress_entries_kernel(
    KV, SCORE, NW, COS, SIN, OUT,
    S, C, HALF, eps,
    stride_kn, stride_ks, stride_kc,
    stride_zn, stride_zs, stride_zc,
    stride_cn, stride_ci,
    stride_sn, stride_si,
    stride_on, stride_oc,
    SHIFT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    # channel of pair p, lane j: 2p + j - SHIFT (SHIFT = (C - 2*HALF) % 2 aligns the rotary pairs)
    offs_p = tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, 2)
    ch = 2 * offs_p[:, None] + offs_j[None, :] - SHIFT                            # [BLOCK_P, 2]
    mask_c = (ch >= 0) & (ch < C)

    m_i = tl.full((BLOCK_P, 2), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_P, 2), dtype=tl.float32)
    acc = tl.zeros((BLOCK_P, 2), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask = (offs_s < S)[:, None, None] & mask_c[None, :, :]                  # [BLOCK_S, BLOCK_P, 2]
        z = tl.load(SCORE + n * stride_zn + offs_s[:, None, None] * stride_zs + ch[None, :, :] * stride_zc,
                    mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.load(KV + n * stride_kn + offs_s[:, None, None] * stride_ks + ch[None, :, :] * stride_kc,
                    mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every slot so far empty (-inf)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(z - m_safe[None, :, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * x, axis=0)
        m_i = m_new
    # A channel whose slots are all -inf gives 0/0 = nan, as the reference's softmax does.
    pooled = tl.where(mask_c, acc / tl.where(mask_c, l_i, 1.0), 0.0)

    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(pooled * pooled, axis=1), axis=0) / C + eps)
    nw = tl.load(NW + ch, mask=mask_c, other=0.0).to(tl.float32)
    y = pooled * rstd * nw

    a, b = tl.split(y)                                                           # even / odd lanes
    i = offs_p - (C - 2 * HALF + SHIFT) // 2                                     # rotary pair index
    rot = (i >= 0) & (i < HALF)
    cos = tl.load(COS + n * stride_cn + i * stride_ci, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(SIN + n * stride_sn + i * stride_si, mask=rot, other=0.0).to(tl.float32)
    out = tl.join(a * cos - b * sin, a * sin + b * cos)
    tl.store(OUT + n * stride_on + ch * stride_oc, out, mask=mask_c)


@triton.jit
def _save_state_kernel(
    STATE_KV, STATE_SCORE, KV_ROWS, SCORE_ROWS, POS,
    T, R, C,
    stride_vr, stride_vc, stride_sr, stride_sc,
    stride_kt, stride_kc, stride_zt, stride_zc,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C

    # The last row of the chunk that lands on ring row r (-1: none).
    last = tl.max(tl.full((BLOCK_T,), -1, tl.int64), axis=0)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        pos = tl.load(POS + offs_t, mask=offs_t < T, other=0).to(tl.int64)
        slot = pos % R
        slot = tl.where(slot < 0, slot + R, slot)  # Python/torch modulo for negative positions
        hit = (slot == r) & (offs_t < T)
        last = tl.maximum(last, tl.max(tl.where(hit, offs_t, -1), axis=0))

    if last >= 0:
        kv = tl.load(KV_ROWS + last * stride_kt + offs_c * stride_kc, mask=mask_c)
        z = tl.load(SCORE_ROWS + last * stride_zt + offs_c * stride_zc, mask=mask_c)
        tl.store(STATE_KV + r * stride_vr + offs_c * stride_vc, cast_to(kv, STATE_KV.dtype.element_ty), mask=mask_c)
        tl.store(STATE_SCORE + r * stride_sr + offs_c * stride_sc, cast_to(z, STATE_SCORE.dtype.element_ty),
                 mask=mask_c)


# ----------------------------------------------------------------------------- host side


def _check(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device | None,
           first: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {', '.join(map(str, dtypes))}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but {first} is on {device}")


def compress_entries(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`kernels.compressor.reference.compress_entries_ref`.

    kv, score ``[n, S, C]`` (score −inf = empty slot), norm_weight ``[C]``, cos/sin
    ``[n, rope_dims // 2]`` at each entry's first position → ``[n, C]`` fp32.
    """
    _check("kv", kv, 3, FLOAT_DTYPES, None, "kv")
    require_runnable("kv", kv)
    dev = kv.device
    n, S, C = kv.shape
    _check("score", score, 3, FLOAT_DTYPES, dev, "kv")
    if score.shape != kv.shape:
        raise ValueError(f"score has shape {tuple(score.shape)} but kv has {tuple(kv.shape)}")
    _check("norm_weight", norm_weight, 1, FLOAT_DTYPES, dev, "kv")
    if norm_weight.shape[0] != C:
        raise ValueError(f"norm_weight has {norm_weight.shape[0]} channels but kv has {C}")
    _check("cos", cos, 2, FLOAT_DTYPES, dev, "kv")
    _check("sin", sin, 2, FLOAT_DTYPES, dev, "kv")
    if cos.shape != sin.shape:
        raise ValueError(f"cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}")
    half = cos.shape[1]
    if cos.shape[0] != n:
        raise ValueError(f"cos/sin have {cos.shape[0]} rows but there are {n} windows")
    if 2 * half > C:
        raise ValueError(f"cos/sin rotate {2 * half} channels but kv has only {C}")

    out = torch.empty((n, C), dtype=torch.float32, device=dev)
    if n == 0 or C == 0:
        return out
    if S == 0:
        raise ValueError("kv has 0 slots per window; the softmax over slots is undefined")
    shift = (C - 2 * half) % 2
    BLOCK_P = triton.next_power_of_2((C + shift + 1) // 2)
    # Keep one [BLOCK_S, BLOCK_P, 2] tile around 4K elements: 8 slots at C = 512.
    BLOCK_S = max(1, min(triton.next_power_of_2(S), 4096 // (2 * BLOCK_P)))
    _compress_entries_kernel[(n,)](
        kv, score, norm_weight, cos, sin, out,
        S, C, half, float(eps),
        *kv.stride(), *score.stride(), *cos.stride(), *sin.stride(), *out.stride(),
        SHIFT=shift, BLOCK_S=BLOCK_S, BLOCK_P=BLOCK_P, num_warps=4,
    )
    return out


def save_state(state_kv: torch.Tensor, state_score: torch.Tensor, kv_rows: torch.Tensor,
               score_rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Triton twin of :func:`kernels.compressor.reference.save_state_ref`: in place,
    ``state[positions[t] % R] = rows[t]``, the later row winning on a collision."""
    _check("state_kv", state_kv, 2, FLOAT_DTYPES, None, "state_kv")
    require_runnable("state_kv", state_kv)
    dev = state_kv.device
    R, C = state_kv.shape
    _check("state_score", state_score, 2, FLOAT_DTYPES, dev, "state_kv")
    if state_score.shape != state_kv.shape:
        raise ValueError(f"state_score has shape {tuple(state_score.shape)} but state_kv has {(R, C)}")
    _check("kv_rows", kv_rows, 2, FLOAT_DTYPES, dev, "state_kv")
    _check("score_rows", score_rows, 2, FLOAT_DTYPES, dev, "state_kv")
    T = kv_rows.shape[0]
    if kv_rows.shape[1] != C or tuple(score_rows.shape) != (T, C):
        raise ValueError(f"kv_rows {tuple(kv_rows.shape)} and score_rows {tuple(score_rows.shape)} "
                         f"must both be [T, {C}]")
    _check("positions", positions, 1, INDEX_DTYPES, dev, "state_kv")
    if positions.shape[0] != T:
        raise ValueError(f"positions has {positions.shape[0]} entries but there are {T} rows")
    if R == 0 and T:
        raise ValueError("the state ring has 0 rows")
    if T == 0 or C == 0:
        return
    BLOCK_C = min(1024, triton.next_power_of_2(C))
    BLOCK_T = min(1024, triton.next_power_of_2(T))
    _save_state_kernel[(R, triton.cdiv(C, BLOCK_C))](
        state_kv, state_score, kv_rows, score_rows, positions,
        T, R, C,
        *state_kv.stride(), *state_score.stride(), *kv_rows.stride(), *score_rows.stride(),
        BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4,
    )
