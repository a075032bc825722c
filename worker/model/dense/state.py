"""One request's cached state for the dense family: every layer's K and V rows, paged by block.

The one form, ``kv`` (full history): a block of ``block_size`` tokens is
``[layers, 2 (k, v), block_size, kv_heads, head_dim]`` in the model's dtype; K after the
rotation (and Qwen3's k-norm), V as projected. A resume at block ``P`` needs every block
before it, sliding-window layers included (they keep their whole history here: one layout for
every layer keeps the form simple, and a window layer reads only its last ``W`` rows).

The buffers are preallocated ``[layers, capacity, kv_heads, head_dim]`` for K and for V, so a
forward writes its rows in place and attention reads a contiguous prefix of them.

*A restored prefix read in place.* Where the compiled attention serves and the cache stores
rows exactly as they are computed, :meth:`DenseState.restore` copies nothing: a validated
block is an entry of the state's prefix table (:meth:`DenseState.prefix_table`: the addresses
of each layer's K and V rows in the block's payload), and the payload's pool slot is pinned
for as long as the state reads it (``restore``'s ``hold``; ``worker.cache.pools``), so the
bytes validated are the bytes attention reads. A block that cannot be held is copied into the
buffers as before, and its table entry points there. New rows are never written into a cached
block (positions past the restore point only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kernels import invariant
from shared.forms import FormScope, FormSpec
from worker.model.dense.config import DenseConfig
from worker.model.forms import FormLayout
from worker.model.recycle import BufferRecycler
from worker.model.state import BlockPayload, CacheState, timed
from worker.model.storage import resolve

#: Byte layout version of the ``kv`` form; bump with any layout change.
LAYOUT_VERSION = 1
KV = "kv"


def dense_form_layouts(cfg: DenseConfig, block_size: int, dtype: torch.dtype,
                       cache_dtype: str = "auto") -> dict[str, FormLayout]:
    """The dense family's one form at ``block_size`` for a model computing in ``dtype``, stored in
    ``cache_dtype`` (``auto``: ``dtype`` itself)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    storage = resolve(cache_dtype, dtype)
    shape = (cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
    params = {"block_size": block_size, "shape": ",".join(map(str, shape)), "family": cfg.family,
              "qk_norm": int(cfg.qk_norm), "rope": "half:" + cfg.rope.describe(),
              "layer_types": ",".join("s" if t == "sliding_attention" else "f" for t in cfg.layer_types),
              "sliding_window": cfg.sliding_window}
    return {KV: FormLayout.of(KV, FormScope.FULL_HISTORY, shape, storage, params, layout_version=LAYOUT_VERSION,
                              group=storage.group(KV, cfg.head_dim))}


class _Prefix:
    """The cached blocks a state reads in place: the table the kernel reads, each block's K and V
    rows (views of the payloads), and the holds on the slots behind them. Not a list or dict, so
    ``CacheState.buffer_bytes`` does not count pool memory as the state's; a fork shares the
    payloads and holds each slot once more."""

    __slots__ = ("table", "blocks", "holds")

    def __init__(self, table: torch.Tensor, blocks: list[torch.Tensor], holds: list[Any]) -> None:
        self.table, self.blocks, self.holds = table, blocks, holds

    def release(self) -> None:
        for h in self.holds:
            h.release()
        self.holds = []

    def __deepcopy__(self, memo: dict) -> _Prefix:
        return _Prefix(self.table, self.blocks, [h.share() for h in self.holds])


_NO_PREFIX = torch.empty(0, dtype=torch.long)


class DenseState(CacheState):
    """K/V of one request (batch 1). See the module docstring.

    Rows are rounded to the storage precision as they are written (``worker.model.storage``),
    so every read — this request's own attention, or a later request's resumed from the
    exported block — sees the same values. They are kept in the compute dtype where it holds
    the stored values exactly, else in float32 and cast for attention.
    """

    def __init__(self, cfg: DenseConfig, block_size: int, capacity: int | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 cache_dtype: str = "auto", recycler: BufferRecycler | None = None) -> None:
        capacity = cfg.max_position_embeddings if capacity is None else capacity
        self._init_positions(block_size, capacity, device)
        self.cfg = cfg
        self.layouts = dense_form_layouts(cfg, block_size, dtype, cache_dtype)
        self._layout = self.layouts[KV]
        storage = self._layout.storage
        self.compute_dtype = dtype
        self.buffer_dtype = storage.buffer_dtype(dtype)
        self._round = None if storage.lossless_for(dtype) else self._layout.round
        shape = (cfg.num_hidden_layers, capacity, cfg.num_key_value_heads, cfg.head_dim)
        # NOTE: not zeroed: no row is read before this request writes or restores it (as after
        # reset(), whose stale rows are never read either). Zeroing a SmolLM2 float32 request's
        # ~55 MB on the model thread was ~3 % of a c = 32 profile (torch's fill on pages the
        # kernel had just zeroed).
        # (a kept buffer may be longer than capacity: rows past it are never reached)
        self._recycler = recycler
        #: Whether the buffers were kept from an ended request (pages resident) rather than made.
        self.buffers_resident = False
        if recycler is not None:
            self._k, self._v, self.buffers_resident = recycler.take(shape, self.buffer_dtype, self.device,
                                                                    cfg.max_position_embeddings)
        else:
            self._k = torch.empty(shape, dtype=self.buffer_dtype, device=self.device)
            self._v = torch.empty(shape, dtype=self.buffer_dtype, device=self.device)
        #: Whether a restored block may be read where it lies (see the module docstring).
        self.reads_in_place = (self._round is None and self.buffer_dtype == dtype and self.device.type == "cpu"
                               and invariant.attention_path() != "chunked"
                               and dtype in invariant.ATTENTION_DTYPES)
        self._prefix: _Prefix | None = None
        self.reset()

    def __del__(self) -> None:
        prefix = getattr(self, "_prefix", None)
        if prefix is not None:
            prefix.release()
        # the buffers go to the next request's state (worker.model.recycle says why that is safe)
        r = getattr(self, "_recycler", None)
        if r is not None:
            r.give(self._k, self._v)

    def reset(self) -> None:
        """Position 0, no cached block held. The buffers keep stale rows, which are never read:
        attention reads ``[0, end)`` of positions this request wrote or restored."""
        self._reset_positions()
        if self._prefix is not None:
            self._prefix.release()
            self._prefix = None

    @property
    def cached_in_place(self) -> int:
        """Blocks this state reads where the cache holds them (0: none, or all copied)."""
        return 0 if self._prefix is None else sum(b is not None for b in self._prefix.blocks)

    def prefix_table(self) -> torch.Tensor:
        """int64 ``[layers, blocks, 2]``: the addresses of each restored block's K and V rows per
        layer, for ``kernels.invariant.attention_cached``; empty when nothing was restored."""
        return _NO_PREFIX if self._prefix is None else self._prefix.table

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self._prefix is None or start >= self._export_from * self.block_size, "a write into a cached block"
        if self._round is not None:
            k, v = self._round(k), self._round(v)
        self._k[layer, start:start + k.shape[0]] = k
        self._v[layer, start:start + v.shape[0]] = v

    def buffers_for(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V buffers, where a kernel may write rows of ``dtype`` into them and read them in
        place with no other step (:meth:`write` rounds nothing and :meth:`keys` casts nothing); else None."""
        if self._round is None and self.buffer_dtype == self.compute_dtype == dtype:
            return self._k, self._v
        return None

    def keys(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of positions ``[lo, hi)`` in the compute dtype (views when kept in it; a copy
        where they reach into blocks read in place)."""
        if self._prefix is not None and lo < self._export_from * self.block_size:
            bs, P = self.block_size, self._export_from * self.block_size
            parts = []
            for b in range(lo // bs, min(hi, P) // bs + (min(hi, P) % bs > 0)):
                blk = self._prefix.blocks[b]
                a, z = max(lo, b * bs) - b * bs, min(hi, (b + 1) * bs) - b * bs
                parts.append((blk[layer, 0, a:z], blk[layer, 1, a:z]) if blk is not None
                             else (self._k[layer, b * bs + a:b * bs + z], self._v[layer, b * bs + a:b * bs + z]))
            if hi > P:
                parts.append((self._k[layer, P:hi], self._v[layer, P:hi]))
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        k, v = self._k[layer, lo:hi], self._v[layer, lo:hi]
        if self.buffer_dtype != self.compute_dtype:
            return k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v

    def export_block(self, i: int) -> BlockPayload:
        self._check_exportable(i)
        bs = self.block_size
        rows = slice(i * bs, (i + 1) * bs)
        # the rows were rounded as written: encoding them is exact
        return self._payload_out({KV: self._layout.encode(torch.stack([self._k[:, rows], self._v[:, rows]], 1))})

    def restore(self, blocks: Sequence[Mapping[str, torch.Tensor]], n_blocks: int, *,
                specs: Mapping[str, FormSpec] | None = None, timer: Any = None,
                hold: Callable[[int, str], Any] | None = None) -> None:
        """Reset, then hold positions ``[0, n_blocks * block_size)`` from cached ``kv`` payloads
        (``timer``: as :meth:`worker.model.state.RequestState.restore`).

        ``hold(i, form)``: pins the memory block ``i``'s payload lies in for as long as this state
        reads it (a ``worker.cache.pools.SlotHold``, released at reset or when the state goes), or
        None when it cannot (that block is copied). Without ``hold``, or where the state cannot
        read in place, every block is copied into the buffers."""
        self._check_restore(blocks, n_blocks)
        self.reset()
        bs = self.block_size
        in_place = hold is not None and self.reads_in_place and n_blocks > 0
        with timed(timer, KV):
            views: list[torch.Tensor | None] = []
            holds = []
            for i in range(n_blocks):
                raw = blocks[i].get(KV) if in_place else None
                kv = self._payload(blocks, i, KV, specs)
                h = (hold(i, KV) if raw is not None and kv.data_ptr() == raw.data_ptr() and kv.is_contiguous()
                     else None)
                if h is not None:
                    views.append(kv)
                    holds.append(h)
                    continue
                views.append(None)
                self._k[:, i * bs:(i + 1) * bs] = kv[:, 0]
                self._v[:, i * bs:(i + 1) * bs] = kv[:, 1]
            if holds:
                self._prefix = _Prefix(self._table(views), views, holds)
        self.pos = n_blocks * bs
        self._export_from = n_blocks

    def _table(self, views: list[torch.Tensor | None]) -> torch.Tensor:
        """The prefix table of blocks ``views`` (a payload ``[layers, 2, bs, kvh, D]``, or None: the
        block's rows in the buffers)."""
        layers, bs = self.cfg.num_hidden_layers, self.block_size
        es = self._k.element_size()
        layer = torch.arange(layers, dtype=torch.long)
        cols = []
        for i, kv in enumerate(views):
            if kv is not None:
                k = kv.data_ptr() + layer * kv.stride(0) * es
                cols.append(torch.stack([k, k + kv.stride(1) * es], 1))
            else:
                rows = self._k.stride(0) * es
                k = self._k.data_ptr() + layer * rows + i * bs * self._k.stride(1) * es
                v = self._v.data_ptr() + layer * rows + i * bs * self._v.stride(1) * es
                cols.append(torch.stack([k, v], 1))
        return torch.stack(cols, 1).contiguous()
