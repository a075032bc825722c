"""One request's cached state for the YOCO family: the global K/V and the self-decoder's window.

Two forms (``worker.model.storage`` decides their precision, ``auto`` = the compute dtype):

``global_kv`` (full history)
    the one K/V every cross-decoder layer attends to, ``[2 (k, v), block_size, kv_heads,
    head_dim]`` per block — K after the rotation. A resume at ``P`` needs every block before it.
``swa`` (window of ``sliding_window - 1`` tokens)
    every self-decoder layer's K/V rows, ``[self_layers, 2, block_size, kv_heads, head_dim]``.
    A self-decoder query attends to itself and the ``W - 1`` rows before it, so a resume at
    ``P`` needs the rows of ``[P - W + 1, P)``: the blocks overlapping that range.

Per token the cache holds one K/V for the whole model (plus a window that does not grow with
the context), where a standard decoder of the same depth holds one per layer.

Buffers are preallocated for the state's capacity (``[layers, capacity, kv_heads, head_dim]``
for the self-decoder's K and V, ``[capacity, kv_heads, head_dim]`` for the global ones), so a
forward writes rows in place and attention reads a contiguous range. The self-decoder's part
has the dense family's interface (``write``/``keys`` by layer), so its layers are dense layers.
Rows are rounded to the storage precision as they are written (the rule in
``worker.model.storage``): every later read — this request's or a resumed one's — sees the
same values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shared.forms import FormScope, FormSpec
from worker.model.forms import FormLayout
from worker.model.state import BlockPayload, CacheState, timed
from worker.model.storage import resolve
from worker.model.yoco.config import YocoConfig

#: Byte layout version of both forms; bump with any layout change.
LAYOUT_VERSION = 1
GLOBAL_KV, SWA = "global_kv", "swa"


def yoco_form_layouts(cfg: YocoConfig, block_size: int, dtype: torch.dtype,
                      cache_dtype: str = "auto") -> dict[str, FormLayout]:
    """Both forms at ``block_size`` for a model computing in ``dtype``, stored in ``cache_dtype``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    storage = resolve(cache_dtype, dtype)
    kvh, D = cfg.num_key_value_heads, cfg.head_dim
    common = {"block_size": block_size, "family": "yoco", "rope": "half:" + cfg.rope.describe(),
              "self_layers": cfg.num_self_decoder_layers, "cross_layers": cfg.num_cross_decoder_layers}
    g_shape = (2, block_size, kvh, D)
    s_shape = (cfg.num_self_decoder_layers, 2, block_size, kvh, D)
    return {
        GLOBAL_KV: FormLayout.of(GLOBAL_KV, FormScope.FULL_HISTORY, g_shape, storage,
                                 {**common, "shape": ",".join(map(str, g_shape))},
                                 layout_version=LAYOUT_VERSION, group=storage.group(GLOBAL_KV, D)),
        SWA: FormLayout.of(SWA, FormScope.WINDOW, s_shape, storage,
                           {**common, "shape": ",".join(map(str, s_shape)), "sliding_window": cfg.sliding_window},
                           layout_version=LAYOUT_VERSION, window_tokens=max(cfg.sliding_window - 1, 1),
                           group=storage.group(SWA, D)),
    }


class YocoState(CacheState):
    """Global and self-decoder K/V of one request (batch 1). See the module docstring."""

    def __init__(self, cfg: YocoConfig, block_size: int, capacity: int | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 cache_dtype: str = "auto") -> None:
        capacity = cfg.max_position_embeddings if capacity is None else capacity
        self._init_positions(block_size, capacity, device)
        self.cfg = cfg
        self.layouts = yoco_form_layouts(cfg, block_size, dtype, cache_dtype)
        storage = self.layouts[GLOBAL_KV].storage
        self.compute_dtype = dtype
        self.buffer_dtype = storage.buffer_dtype(dtype)
        lossless = storage.lossless_for(dtype)
        self._round_g = None if lossless else self.layouts[GLOBAL_KV].round
        self._round_s = None if lossless else self.layouts[SWA].round
        kvh, D = cfg.num_key_value_heads, cfg.head_dim
        on = dict(dtype=self.buffer_dtype, device=self.device)
        self._sk = torch.zeros(cfg.num_self_decoder_layers, capacity, kvh, D, **on)
        self._sv = torch.zeros_like(self._sk)
        self._gk = torch.zeros(capacity, kvh, D, **on)
        self._gv = torch.zeros_like(self._gk)
        self.reset()

    def reset(self) -> None:
        """Position 0. Stale rows of an earlier request are never read: every read is of
        positions this request wrote or restored (self-decoder reads check their lower bound)."""
        self._reset_positions()
        self._self_lo = 0          # first position whose self-decoder rows this state holds

    def _cast(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffer_dtype != self.compute_dtype:
            return k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v

    # ---- the self-decoder (the dense family's interface) ---------------------------------------

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._round_s is not None:
            k, v = self._round_s(k), self._round_s(v)
        self._sk[layer, start:start + k.shape[0]] = k
        self._sv[layer, start:start + v.shape[0]] = v

    def keys(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-decoder K and V rows of positions ``[lo, hi)`` of ``layer`` (views when kept in the
        compute dtype). ``lo`` may reach below what a resume restored only to whole key pieces
        that the window masks (the dense attention anchors pieces at absolute positions)."""
        return self._cast(self._sk[layer, lo:hi], self._sv[layer, lo:hi])

    # ---- the global K/V ------------------------------------------------------------------------

    def write_global(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._round_g is not None:
            k, v = self._round_g(k), self._round_g(v)
        self._gk[start:start + k.shape[0]] = k
        self._gv[start:start + v.shape[0]] = v

    def global_keys(self, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global K and V of positions ``[0, hi)``."""
        return self._cast(self._gk[:hi], self._gv[:hi])

    # ---- block payloads ------------------------------------------------------------------------

    def export_block(self, i: int) -> BlockPayload:
        self._check_exportable(i)
        bs = self.block_size
        rows = slice(i * bs, (i + 1) * bs)
        g, s = self.layouts[GLOBAL_KV], self.layouts[SWA]
        # rows were rounded as written: encoding them is exact
        return self._payload_out({
            GLOBAL_KV: g.encode(torch.stack([self._gk[rows], self._gv[rows]])),
            SWA: s.encode(torch.stack([self._sk[:, rows], self._sv[:, rows]], 1)),
        })

    def restore(self, blocks: Sequence[Mapping[str, torch.Tensor]], n_blocks: int, *,
                specs: Mapping[str, FormSpec] | None = None, timer: Any = None) -> None:
        """Reset, then build the state at ``P = n_blocks * block_size``: ``global_kv`` of every
        block before ``P``, ``swa`` of the blocks overlapping ``[P - W + 1, P)`` (``timer``: as
        :meth:`worker.model.state.RequestState.restore`)."""
        self._check_restore(blocks, n_blocks)
        self.reset()
        if n_blocks == 0:
            return
        bs, P = self.block_size, n_blocks * self.block_size
        with timed(timer, GLOBAL_KV):
            for i in range(n_blocks):
                kv = self._payload(blocks, i, GLOBAL_KV, specs)
                self._gk[i * bs:(i + 1) * bs] = kv[0]
                self._gv[i * bs:(i + 1) * bs] = kv[1]
        first = max(0, P - self.layouts[SWA].spec.window_tokens) // bs
        with timed(timer, SWA):
            for i in range(first, n_blocks):
                kv = self._payload(blocks, i, SWA, specs)
                self._sk[:, i * bs:(i + 1) * bs] = kv[:, 0]
                self._sv[:, i * bs:(i + 1) * bs] = kv[:, 1]
        self._self_lo = first * bs
        self.pos = P
        self._export_from = n_blocks
