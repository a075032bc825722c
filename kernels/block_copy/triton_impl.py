"""Block gather / scatter between a paged pool and a staging buffer (Triton).

A block copy moves bytes, so the kernels never look at the element type: the host wrapper
reinterprets each slot's payload as a row of the widest integer words (8, 4, 2 or 1 bytes)
that divide it and its alignment, and the kernel copies words, one program per (block,
chunk of ``BLOCK`` words). The copy is therefore bit-exact for every dtype — fp8 pools
included, which also sidesteps the interpreter's lack of faithful fp8 support.

``scatter_blocks`` writes through a view of ``pool`` and never reallocates it. When ``src``
has another dtype than the pool it is first converted on the host (``src.to(pool.dtype)``,
as in the reference); a conversion is a value change, not a copy, and stays outside the
byte kernel. Slots must be distinct for scatter (with repeats, which copy wins is
unspecified, as for ``index_copy_``).

Slot ids are range-checked on CPU (interpreter) tensors; on CUDA that check would need a
device sync, so there the kernel masks out-of-range slots instead (they copy nothing, and a
gather leaves the matching output block unwritten).
"""

from __future__ import annotations

import torch

from kernels.triton_common import INDEX_DTYPES, require_runnable, tl, triton

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _copy_blocks_kernel(
    DST, SRC, SLOTS, row_words, num_slots,
    stride_dst, stride_src,
    SCATTER: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(SLOTS + i).to(tl.int64)
    slot_v = tl.full((BLOCK,), 0, tl.int64) + slot  # vector form: a scalar mask trips the interpreter
    mask = (offs < row_words) & (slot_v >= 0) & (slot_v < num_slots)
    if SCATTER:   # pool[slot] <- src[i]
        dst_row, src_row = slot, i
    else:         # out[i] <- pool[slot]
        dst_row, src_row = i, slot
    words = tl.load(SRC + src_row * stride_src + offs, mask=mask)
    tl.store(DST + dst_row * stride_dst + offs, words, mask=mask)


# ----------------------------------------------------------------------------- host side


def _as_words(t: torch.Tensor, name: str, word_bytes: int) -> torch.Tensor:
    """``t`` ``[n, ...]`` (n ≥ 1) as an ``[n, row_bytes // word_bytes]`` integer view of its storage."""
    if not t[0].is_contiguous():
        raise ValueError(f"{name} must be contiguous within a block, got strides {t.stride()}")
    es = t.element_size()
    storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    rows = storage.as_strided((t.shape[0], t[0].numel() * es), (t.stride(0) * es, 1), t.storage_offset() * es)
    return rows.view(dict(_WORDS)[word_bytes])


def _word_bytes(*ts: torch.Tensor) -> int:
    """The widest word that divides every row length, row stride and base address."""
    for nbytes, _ in _WORDS:
        if all((t[0].numel() * t.element_size()) % nbytes == 0
               and (t.stride(0) * t.element_size()) % nbytes == 0
               and t.data_ptr() % nbytes == 0 for t in ts):
            return nbytes
    return 1


def _check_slots(slots: object, pool: torch.Tensor) -> None:
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slots must be a torch.Tensor, got {type(slots).__name__}")
    if slots.dim() != 1 or slots.dtype not in INDEX_DTYPES:
        raise TypeError(f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    if slots.device != pool.device:
        raise ValueError(f"slots is on {slots.device} but pool is on {pool.device}")
    if not pool.is_cuda and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= pool.shape[0]:
            raise IndexError(f"slots hold ids in [{lo}, {hi}] but pool has {pool.shape[0]} slots")


def _launch(dst_words: torch.Tensor, src_words: torch.Tensor, slots: torch.Tensor, num_slots: int,
            scatter: bool) -> None:
    n, row_words = (src_words if scatter else dst_words).shape
    if n == 0 or row_words == 0:
        return
    BLOCK = min(4096, triton.next_power_of_2(row_words))
    _copy_blocks_kernel[(n, triton.cdiv(row_words, BLOCK))](
        dst_words, src_words, slots, row_words, num_slots,
        dst_words.stride(0), src_words.stride(0),
        SCATTER=scatter, BLOCK=BLOCK, num_warps=4,
    )


def gather_blocks(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`kernels.block_copy.reference.gather_blocks_ref`: ``pool[slots]``
    as a new contiguous ``[n, *pool.shape[1:]]`` tensor, bit-exact for any dtype."""
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    require_runnable("pool", pool)
    _check_slots(slots, pool)
    out = torch.empty((slots.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    if out.numel() == 0:
        return out
    wb = _word_bytes(pool, out)
    _launch(_as_words(out, "out", wb), _as_words(pool, "pool", wb), slots, pool.shape[0], scatter=False)
    return out


def scatter_blocks(pool: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """Triton twin of :func:`kernels.block_copy.reference.scatter_blocks_ref`:
    ``pool[slots[i]] = src[i]`` in place (the pool's storage is never replaced)."""
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    require_runnable("pool", pool)
    _check_slots(slots, pool)
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    if src.device != pool.device:
        raise ValueError(f"src is on {src.device} but pool is on {pool.device}")
    if tuple(src.shape) != (slots.shape[0], *pool.shape[1:]):
        raise ValueError(f"src must be [len(slots), *pool.shape[1:]] = "
                         f"{[slots.shape[0], *pool.shape[1:]]}, got {list(src.shape)}")
    if src.numel() == 0:
        return
    src = src.to(pool.dtype).contiguous()
    wb = _word_bytes(pool, src)
    _launch(_as_words(pool, "pool", wb), _as_words(src, "src", wb), slots, pool.shape[0], scatter=True)
