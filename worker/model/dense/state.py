"""One request's cached state for the dense family: every layer's K and V rows, paged by block.

The one form, ``kv`` (full history): a block of ``block_size`` tokens is
``[layers, 2 (k, v), block_size, kv_heads, head_dim]`` in the model's dtype; K after the
rotation (and Qwen3's k-norm), V as projected. A resume at block ``P`` needs every block
before it, sliding-window layers included (they keep their whole history here: one layout for
every layer keeps the form simple, and a window layer reads only its last ``W`` rows).

The buffers are preallocated ``[layers, capacity, kv_heads, head_dim]`` for K and for V, so a
forward writes its rows in place and attention reads a contiguous prefix of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

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
        if recycler is not None:
            self._k, self._v = recycler.take(shape, self.buffer_dtype, self.device, cfg.max_position_embeddings)
        else:
            self._k = torch.empty(shape, dtype=self.buffer_dtype, device=self.device)
            self._v = torch.empty(shape, dtype=self.buffer_dtype, device=self.device)
        self.reset()

    def __del__(self) -> None:
        # the buffers go to the next request's state (worker.model.recycle says why that is safe)
        r = getattr(self, "_recycler", None)
        if r is not None:
            r.give(self._k, self._v)

    def reset(self) -> None:
        """Position 0. The buffers keep stale rows, which are never read: attention reads
        ``[0, end)`` of positions this request wrote or restored."""
        self._reset_positions()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
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
        """K and V rows of positions ``[lo, hi)`` in the compute dtype (views when kept in it)."""
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
                specs: Mapping[str, FormSpec] | None = None, timer: Any = None) -> None:
        """Reset, then hold positions ``[0, n_blocks * block_size)`` from cached ``kv`` payloads
        (``timer``: as :meth:`worker.model.state.RequestState.restore`)."""
        self._check_restore(blocks, n_blocks)
        self.reset()
        bs = self.block_size
        with timed(timer, KV):
            for i in range(n_blocks):
                kv = self._payload(blocks, i, KV, specs)
                self._k[:, i * bs:(i + 1) * bs] = kv[:, 0]
                self._v[:, i * bs:(i + 1) * bs] = kv[:, 1]
        self.pos = n_blocks * bs
        self._export_from = n_blocks
