"""Sparse attention with a sink over gathered K=V entries (Triton).

Theory of operation. One program handles one query ``t`` and a block of ``BLOCK_H`` heads.
Because V4 attention is MQA with K = V, every head of a query attends to the *same* gathered
rows, so a program gathers a block of ``BLOCK_N`` entries once (index → block table →
physical row) and uses it for all its heads twice: ``S = Q Kᵀ`` and ``O += P V``. The softmax
is the usual online one, with the sink folded in as its initial state: the running max starts
at ``sink_h`` and the running denominator at ``exp(sink_h − sink_h) = 1``, so the sink joins
the max and adds one term to the denominator and nothing to the numerator — exactly the
reference's ``exp(sink − M)``. Masked entries (index −1) load nothing and score −inf.

Precision: scores and the accumulator are fp32. When q and the entries are both bf16 (or
both fp16) the two products run on the tensor cores with 16-bit operands (P is rounded to
the entries' dtype before ``P V``, as in FlashAttention); when either is fp32, or their
dtypes differ, the products are IEEE fp32 (no TF32), which matches the fp32 reference.
The output has q's dtype.

Interpreter note: ``TRITON_INTERPRET=1`` (triton 3.9) computes ``tl.dot`` on bf16 operands as
a matmul of their raw uint16 bit patterns, which is garbage. Under the interpreter the
operands are therefore widened to fp32 first (constexpr ``DOT_IEEE``); the values fed in are
the same 16-bit values, so the result equals the GPU's up to fp32 accumulation order.

Indices are not range-checked on CUDA (that would cost a device sync per call); out-of-range
indices or block-table entries are masked to "no key" in the kernel so they can never fault.
On CPU (interpreter) tensors the host wrapper checks them and raises, like the reference.
"""

from __future__ import annotations

import torch

from kernels.dispatch import triton_interpreting
from kernels.triton_common import FLOAT_DTYPES, INDEX_DTYPES, cast_to, require_runnable, tl, triton


@triton.jit
def _sparse_attn_fwd(
    Q, POOL, TABLE, IDX, SINK, OUT,
    H, K, D, E, num_blocks, num_rows, scale,
    stride_qt, stride_qh, stride_qd,
    stride_ps, stride_pe, stride_pd,
    stride_it, stride_ik,
    stride_ot, stride_oh, stride_od,
    PAGED: tl.constexpr, MMA16: tl.constexpr, DOT_IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    mask_d = offs_d < D

    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    sink = tl.load(SINK + offs_h, mask=mask_h, other=0.0).to(tl.float32)

    # NOTE: the sink is the softmax's initial state (max = sink, denominator = 1). A sink of
    # -inf contributes nothing: its denominator term starts at 0 instead of exp(nan).
    m_i = sink
    l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)

    for start in range(0, K, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ids = tl.load(IDX + t * stride_it + offs_n * stride_ik, mask=offs_n < K, other=-1).to(tl.int64)
        if PAGED:
            logical_block = ids // E
            valid = (ids >= 0) & (logical_block < num_blocks)
            slot = tl.load(TABLE + logical_block, mask=valid, other=0).to(tl.int64)
            valid = valid & (slot >= 0) & (slot < num_rows)
            row = slot * stride_ps + (ids % E) * stride_pe
        else:
            valid = (ids >= 0) & (ids < num_rows)
            row = ids * stride_ps
        row = tl.where(valid, row, 0)
        kv = tl.load(POOL + row[:, None] + offs_d[None, :] * stride_pd,
                     mask=valid[:, None] & mask_d[None, :], other=0.0)          # [BLOCK_N, BLOCK_D]

        if DOT_IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        s = tl.where(valid[None, :], s * scale, float("-inf"))               # [BLOCK_H, BLOCK_N]

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far and sink -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MMA16:
            p = cast_to(p, kv.dtype)  # the 16-bit operand of P V (emulated when DOT_IEEE)
        if DOT_IEEE:
            acc = tl.dot(p.to(tl.float32), kv.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p, kv, acc * alpha[:, None])
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
             cast_to(o, OUT.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


# ----------------------------------------------------------------------------- host side


def _check(name: str, t: object, ndim: int | None, dtypes: tuple[torch.dtype, ...],
           device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {', '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _block_config(H: int, D: int) -> tuple[int, int, int, int]:
    """BLOCK_H, BLOCK_N, BLOCK_D, num_warps. Untuned defaults for D = 512 on H100/H200.

    ``tl.dot`` needs every block dimension ≥ 16; odd sizes are padded and masked.
    """
    block_d = max(16, triton.next_power_of_2(D))
    if block_d >= 256:
        # A [16, 512] fp32 accumulator plus a [32, 512] gathered tile fit 8 warps' registers.
        return 16, 32, block_d, 8
    return min(64, max(16, triton.next_power_of_2(H))), 64, block_d, 4


def _launch(q, rows, table, idx, sink, scale, E, num_blocks, num_rows, row_strides, paged):
    T, H, D = q.shape
    K = idx.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or H == 0 or D == 0:
        return out
    BLOCK_H, BLOCK_N, BLOCK_D, num_warps = _block_config(H, D)
    # 16-bit tensor-core products only when q and the entries share a 16-bit dtype; otherwise
    # IEEE fp32 products (no TF32). The interpreter always multiplies in fp32 (module docstring).
    mma16 = q.dtype == rows.dtype and q.dtype in (torch.bfloat16, torch.float16)
    dot_ieee = triton_interpreting() or not mma16
    grid = (T, triton.cdiv(H, BLOCK_H))
    _sparse_attn_fwd[grid](
        q, rows, table, idx, sink, out,
        H, K, D, E, num_blocks, num_rows, float(scale),
        *q.stride(), *row_strides, *idx.stride(), *out.stride(),
        PAGED=paged, MMA16=mma16, DOT_IEEE=dot_ieee,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, num_warps=num_warps,
    )
    return out


def _check_common(q, rows_name, rows, idx, sink):
    _check("q", q, 3, FLOAT_DTYPES, q.device)
    require_runnable("q", q)
    dev = q.device
    T, H, D = q.shape
    _check(rows_name, rows, None, FLOAT_DTYPES, dev)
    if rows.shape[-1] != D:
        raise ValueError(f"{rows_name} has {rows.shape[-1]} channels but q has {D}")
    _check("idx", idx, 2, INDEX_DTYPES, dev)
    if idx.shape[0] != T:
        raise ValueError(f"idx has {idx.shape[0]} rows but q has {T} queries")
    _check("sink", sink, 1, FLOAT_DTYPES, dev)
    if sink.shape[0] != H:
        raise ValueError(f"sink has {sink.shape[0]} entries but q has {H} heads")


def paged_sparse_attn(q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, idx: torch.Tensor,
                      sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton twin of :func:`kernels.sparse_attention.reference.paged_sparse_attn_ref`.

    q ``[T, H, D]``, pool ``[num_slots, E, D]`` (any float dtype), block_table
    ``[num_logical_blocks]`` int32/int64, idx ``[T, K]`` logical entry ids (−1 = masked),
    sink ``[H]``. Returns ``[T, H, D]`` in q's dtype.
    """
    _check_common(q, "pool", pool, idx, sink)
    if pool.dim() != 3:
        raise ValueError(f"pool must be [num_slots, E, D], got shape {tuple(pool.shape)}")
    _check("block_table", block_table, 1, INDEX_DTYPES, q.device)
    num_slots, E, _ = pool.shape
    if E == 0:
        raise ValueError("pool has 0 entries per slot")
    if not q.is_cuda and idx.numel():
        # The reference raises on these; on CUDA the kernel masks them instead (no sync).
        hi = int(idx.max())
        if hi >= block_table.shape[0] * E:
            raise IndexError(f"idx holds entry {hi} but block_table maps only "
                             f"{block_table.shape[0]} blocks of {E} entries")
        used = block_table[(idx[idx >= 0] // E).unique()]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_slots):
            raise IndexError(f"block_table maps a used block to slot outside [0, {num_slots})")
    return _launch(q, pool, block_table, idx, sink, scale, E, block_table.shape[0], num_slots,
                   pool.stride(), paged=True)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Triton twin of :func:`kernels.sparse_attention.reference.sparse_attn_ref`: ``kv`` is
    ``[N, D]`` and ``idx`` indexes its rows directly (−1 = masked)."""
    _check_common(q, "kv", kv, idx, sink)
    if kv.dim() != 2:
        raise ValueError(f"kv must be [N, D], got shape {tuple(kv.shape)}")
    N = kv.shape[0]
    if not q.is_cuda and idx.numel() and int(idx.max()) >= N:
        raise IndexError(f"idx holds row {int(idx.max())} but kv has only {N} rows")
    dummy_table = idx  # unused when PAGED=False; any valid pointer
    return _launch(q, kv, dummy_table, idx, sink, scale, 1, 1, N,
                   (kv.stride(0), 0, kv.stride(1)), paged=False)
