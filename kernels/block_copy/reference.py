"""Block gather / scatter between a paged pool and a contiguous staging buffer (reference).

Offload gathers a request's slots into one contiguous buffer (one sequential write);
reload scatters a staging buffer back into free slots. Pools keep their storage: scatter
writes in place and never reallocates (static topology).
"""

from __future__ import annotations

import torch


def gather_blocks_ref(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` as a new contiguous tensor ``[n, *pool.shape[1:]]``."""
    return pool.index_select(0, slots.to(torch.int64)).contiguous()


def scatter_blocks_ref(pool: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """``pool[slots[i]] = src[i]`` in place."""
    src = src.to(pool.dtype)
    if pool.element_size() == 1 and pool.is_floating_point():
        # NOTE: index_copy_ has no kernel for fp8 dtypes; copy the same bytes through a uint8 view.
        pool, src = pool.view(torch.uint8), src.view(torch.uint8)
    pool.index_copy_(0, slots.to(torch.int64), src)
