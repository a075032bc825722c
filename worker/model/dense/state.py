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

import math
from collections.abc import Mapping, Sequence

import torch

from shared.forms import FormScope, FormSpec
from worker.model.dense.config import DenseConfig
from worker.model.forms import FormLayout
from worker.model.state import BlockPayload, CacheState

#: Byte layout version of the ``kv`` form; bump with any layout change.
LAYOUT_VERSION = 1
KV = "kv"


def dense_form_layouts(cfg: DenseConfig, block_size: int, dtype: torch.dtype) -> dict[str, FormLayout]:
    """The dense family's one form at ``block_size``, stored in ``dtype``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    shape = (cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    spec = FormSpec(name=KV, scope=FormScope.FULL_HISTORY, bytes_per_block=nbytes,
                    dtype=str(dtype).removeprefix("torch."), layout_version=LAYOUT_VERSION,
                    params={"block_size": block_size, "shape": ",".join(map(str, shape)), "family": cfg.family,
                            "qk_norm": int(cfg.qk_norm), "rope": "half:" + cfg.rope.describe(),
                            "layer_types": ",".join("s" if t == "sliding_attention" else "f" for t in cfg.layer_types),
                            "sliding_window": cfg.sliding_window})
    return {KV: FormLayout(spec=spec, shape=shape, dtype=dtype)}


class DenseState(CacheState):
    """K/V of one request (batch 1). See the module docstring."""

    def __init__(self, cfg: DenseConfig, block_size: int, capacity: int | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        capacity = cfg.max_position_embeddings if capacity is None else capacity
        self._init_positions(block_size, capacity, device)
        self.cfg = cfg
        self.layouts = dense_form_layouts(cfg, block_size, dtype)
        shape = (cfg.num_hidden_layers, capacity, cfg.num_key_value_heads, cfg.head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Position 0. The buffers keep stale rows, which are never read: attention reads
        ``[0, end)`` of positions this request wrote or restored."""
        self._reset_positions()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k[layer, start:start + k.shape[0]] = k
        self._v[layer, start:start + v.shape[0]] = v

    def keys(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of positions ``[lo, hi)`` (views)."""
        return self._k[layer, lo:hi], self._v[layer, lo:hi]

    def export_block(self, i: int) -> BlockPayload:
        self._check_exportable(i)
        bs = self.block_size
        rows = slice(i * bs, (i + 1) * bs)
        return self._payload_out({KV: torch.stack([self._k[:, rows], self._v[:, rows]], 1)})

    def restore(self, blocks: Sequence[Mapping[str, torch.Tensor]], n_blocks: int, *,
                specs: Mapping[str, FormSpec] | None = None) -> None:
        """Reset, then hold positions ``[0, n_blocks * block_size)`` from cached ``kv`` payloads."""
        self._check_restore(blocks, n_blocks)
        self.reset()
        bs = self.block_size
        for i in range(n_blocks):
            kv = self._payload(blocks, i, KV, specs)
            self._k[:, i * bs:(i + 1) * bs] = kv[:, 0]
            self._v[:, i * bs:(i + 1) * bs] = kv[:, 1]
        self.pos = n_blocks * bs
        self._export_from = n_blocks
