"""Lightning-indexer scores and deterministic top-k (Triton).

Theory of operation. Two kernels.

1. ``_indexer_scores_kernel``: one program per (tile of ``BLOCK_N`` keys, tile of
   ``BLOCK_T`` queries). It loads its key tile once and reuses it for every query of the tile:
   per query and block of heads ``S = Q_t Kᵀ`` on the tensor cores, ``ReLU``, then the
   weighted sum over heads in fp32. With visibility on, a query skips key tiles that lie
   wholly past its visible count ``(t + 1) // ratio`` (half the work in a causal prefill).

2. ``_topk_select_kernel``: one program per query row, exact radix select on the scores.
   Each fp32 score maps to a 32-bit key whose integer order is the float order (``-0.0`` is
   folded into ``+0.0`` first, because ``torch.sort`` treats them as equal). Eight passes
   over the visible prefix find, four bits at a time, the k-th largest key θ (each pass
   counts, for 16 candidate digits at once, how many keys are ≥ the candidate). Then one
   pass emits, in index order, every key > θ and the *lowest-index* keys == θ until k are
   chosen, and a bitonic ``tl.sort`` on ``key · 2³² + (2³² − 1 − index)`` orders them: higher
   score first, ties by lower index — the reference's stable descending sort, exactly.
   Slots past ``min(topk, visible)`` are −1. Only the visible prefix is ever read, which is
   also why invisible entries never compete (the reference puts them last and blanks them).

Exactness: the selection is exact for the scores it is given. Scores computed by kernel 1
can differ from the reference's in the last bits (other summation order), so two entries
whose reference scores differ by ~1 ulp may swap; entries with *equal* scores (the ReLU-zero
ties that matter in practice) are always resolved the same way.

Interpreter note: under ``TRITON_INTERPRET=1`` (triton 3.9) ``tl.dot`` on bf16 operands
multiplies raw bit patterns, so the operands are widened to fp32 first (constexpr
``DOT_IEEE``). On the GPU, bf16 q and k use 16-bit tensor-core products; when either is
fp32, or their dtypes differ, the products are IEEE fp32 (no TF32).
"""

from __future__ import annotations

import operator

import torch

from kernels.dispatch import triton_interpreting
from kernels.triton_common import FLOAT_DTYPES, INDEX_DTYPES, require_runnable, tl, triton


@triton.jit
def _indexer_scores_kernel(
    Q, KEYS, W, POS, S,
    T, N, NH, DI, ratio,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kd,
    stride_wt, stride_wh,
    stride_st, stride_sn,
    VISIBLE_ONLY: tl.constexpr, DOT_IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < DI
    k = tl.load(KEYS + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    kt = tl.trans(k)                                                            # [BLOCK_D, BLOCK_N]
    if DOT_IEEE:
        kt = kt.to(tl.float32)

    for i in range(BLOCK_T):
        t = (tl.program_id(1) * BLOCK_T + i).to(tl.int64)
        if t < T:
            if VISIBLE_ONLY:
                n_visible = (tl.load(POS + t).to(tl.int64) + 1) // ratio
            else:
                n_visible = N
            if n0 < n_visible:
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for h0 in range(0, NH, BLOCK_H):
                    offs_h = h0 + tl.arange(0, BLOCK_H)
                    mask_h = offs_h < NH
                    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
                    w = tl.load(W + t * stride_wt + offs_h * stride_wh, mask=mask_h, other=0.0).to(tl.float32)
                    if DOT_IEEE:
                        s = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
                    else:
                        s = tl.dot(q, kt)
                    acc += tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
                tl.store(S + t * stride_st + offs_n * stride_sn, acc, mask=mask_n)


@triton.jit
def _ordered_key(x):
    """fp32 → int32 whose signed order is the float order; -0.0 and +0.0 map to the same key."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _topk_select_kernel(
    S, POS, OUT,
    N, ratio, topk,
    stride_st, stride_sn, stride_ot, stride_ok,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n_visible = (tl.load(POS + t).to(tl.int64) + 1) // ratio
    n_visible = tl.maximum(tl.minimum(n_visible, N), 0)
    kk = tl.minimum(n_visible, topk)
    row = S + t * stride_st
    out_row = OUT + t * stride_ot
    offs_k = tl.arange(0, BLOCK_K)

    if kk > 0:
        # --- radix select: θ = the kk-th largest key (keys shifted to [0, 2^32)).
        digits = tl.arange(0, 16).to(tl.int64)
        theta = n_visible * 0  # int64 scalar 0
        for r in tl.static_range(8):
            shift = 28 - 4 * r  # constexpr: r is a static_range index
            cands = theta + (digits << shift)
            counts = tl.zeros((16,), dtype=tl.int64)
            for start in range(0, n_visible, BLOCK_N):
                offs = start + tl.arange(0, BLOCK_N)
                m = offs < n_visible
                key = _ordered_key(tl.load(row + offs * stride_sn, mask=m, other=0.0)).to(tl.int64) + 2147483648
                ge = (key[:, None] >= cands[None, :]) & m[:, None]
                counts += tl.sum(ge.to(tl.int64), axis=0)
            # counts is non-increasing in the digit and counts[0] >= kk by construction
            theta = theta + (tl.max(tl.where(counts >= kk, digits, 0), axis=0) << shift)

        n_greater = kk * 0
        for start in range(0, n_visible, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            m = offs < n_visible
            key = _ordered_key(tl.load(row + offs * stride_sn, mask=m, other=0.0)).to(tl.int64) + 2147483648
            n_greater += tl.sum(((key > theta) & m).to(tl.int64), axis=0)
        need_equal = kk - n_greater

        # --- emit the chosen ids in index order (ties at θ: lowest indices first).
        n_out = kk * 0
        n_equal = kk * 0
        for start in range(0, n_visible, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            m = offs < n_visible
            key = _ordered_key(tl.load(row + offs * stride_sn, mask=m, other=0.0)).to(tl.int64) + 2147483648
            eq = (key == theta) & m
            eq_rank = n_equal + tl.cumsum(eq.to(tl.int64), axis=0) - 1
            sel = ((key > theta) & m) | (eq & (eq_rank < need_equal))
            dst = n_out + tl.cumsum(sel.to(tl.int64), axis=0) - 1
            tl.store(out_row + dst * stride_ok, offs.to(tl.int64), mask=sel)
            n_out += tl.sum(sel.to(tl.int64), axis=0)
            n_equal += tl.sum(eq.to(tl.int64), axis=0)

        # NOTE: the ids just stored are re-read by other threads of this program.
        tl.debug_barrier()

        # --- order them: score descending, index ascending.
        mk = offs_k < kk
        ids = tl.load(out_row + offs_k * stride_ok, mask=mk, other=0)
        key = _ordered_key(tl.load(row + ids * stride_sn, mask=mk, other=0.0)).to(tl.int64)
        packed = key * 4294967296 + (4294967295 - ids)
        packed = tl.where(mk, packed, -9223372036854775807 - 1)
        packed = tl.sort(packed, dim=0, descending=True)
        ids = 4294967295 - (packed & 4294967295)
        tl.store(out_row + offs_k * stride_ok, tl.where(mk, ids, -1), mask=offs_k < topk)
    else:
        tl.store(out_row + offs_k * stride_ok, tl.full((BLOCK_K,), -1, tl.int64), mask=offs_k < topk)


# ----------------------------------------------------------------------------- host side


def _check(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {', '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _check_qkw(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> None:
    _check("q", q, 3, FLOAT_DTYPES, q.device if isinstance(q, torch.Tensor) else None)
    require_runnable("q", q)
    T, NH, DI = q.shape
    _check("k", k, 2, FLOAT_DTYPES, q.device)
    if k.shape[1] != DI:
        raise ValueError(f"k has {k.shape[1]} channels but q has {DI}")
    _check("w", w, 2, FLOAT_DTYPES, q.device)
    if tuple(w.shape) != (T, NH):
        raise ValueError(f"w must be [T, nH] = {[T, NH]}, got {list(w.shape)}")


def _as_int(name: str, value: object, lowest: int) -> int:
    try:
        v = operator.index(value)  # ints, numpy ints, 0-d integer tensors; not floats
    except TypeError:
        v = None
    if v is None or isinstance(value, bool) or v < lowest:
        kind = "positive" if lowest == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")
    return v


def _scores(q, k, w, positions, ratio, visible_only):
    T, NH, DI = q.shape
    N = k.shape[0]
    s = torch.empty((T, N), dtype=torch.float32, device=q.device)
    if T == 0 or N == 0:
        return s
    BLOCK_T, BLOCK_N = 8, 64
    BLOCK_H = min(64, max(16, triton.next_power_of_2(NH)))
    BLOCK_D = max(16, triton.next_power_of_2(DI))
    pos = positions if positions is not None else s  # unused when VISIBLE_ONLY is False
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(T, BLOCK_T))
    _indexer_scores_kernel[grid](
        q, k, w, pos, s, T, N, NH, DI, ratio,
        *q.stride(), *k.stride(), *w.stride(), *s.stride(),
        VISIBLE_ONLY=visible_only,
        DOT_IEEE=triton_interpreting() or torch.float32 in (q.dtype, k.dtype) or q.dtype != k.dtype,
        BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4,
    )
    return s


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`kernels.indexer.reference.indexer_scores_ref`.

    q ``[T, nH, dI]``, k ``[N, dI]``, w ``[T, nH]`` (any float dtypes) → ``[T, N]`` fp32.
    """
    _check_qkw(q, k, w)
    return _scores(q, k, w, None, 1, visible_only=False)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                 ratio: int, topk: int) -> torch.Tensor:
    """Triton twin of :func:`kernels.indexer.reference.indexer_topk_ref`: ``[T, topk]`` int64
    entry ids, higher score first, ties to the lower id, −1 past the visible count."""
    _check_qkw(q, k, w)
    T = q.shape[0]
    _check("positions", positions, 1, INDEX_DTYPES, q.device)
    if positions.shape[0] != T:
        raise ValueError(f"positions has {positions.shape[0]} entries but q has {T} queries")
    ratio, topk = _as_int("ratio", ratio, 1), _as_int("topk", topk, 0)
    N = k.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    if T == 0 or topk == 0 or N == 0:
        return out
    s = _scores(q, k, w, positions, ratio, visible_only=True)
    return _select_topk(s, positions, ratio, topk, out)


def _select_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The selection step alone, on given fp32 ``[T, N]`` scores (only each row's visible
    prefix is read). Split out so that tests can check it on exactly chosen scores."""
    T, N = scores.shape
    if out is None:
        out = torch.full((T, topk), -1, dtype=torch.int64, device=scores.device)
    if T == 0 or topk == 0 or N == 0:
        return out
    _topk_select_kernel[(T,)](
        scores, positions, out, N, ratio, topk, *scores.stride(), *out.stride(),
        BLOCK_N=256, BLOCK_K=max(16, triton.next_power_of_2(topk)), num_warps=4,
    )
    return out
