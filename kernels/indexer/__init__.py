"""Public entry points of the indexer op: dispatch to Triton or the reference."""

from __future__ import annotations

from kernels.dispatch import backend_for
from kernels.indexer import reference


def indexer_topk(*args, **kwargs):
    """See :func:`kernels.indexer.reference.indexer_topk_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.indexer import triton_impl
        return triton_impl.indexer_topk(*args, **kwargs)
    return reference.indexer_topk_ref(*args, **kwargs)


def indexer_topk_many(parts, ratio, topk):
    """See :func:`kernels.indexer.reference.indexer_topk_many_ref`: several requests' selections,
    their rows in order. NOTE: the Triton backend selects part by part (no batched kernel yet)."""
    if parts and backend_for(parts[0][0]) == "triton":
        import torch

        from kernels.indexer import triton_impl
        picks = [triton_impl.indexer_topk(q, k, w, pos, ratio, topk) for q, k, w, pos in parts]
        return picks[0] if len(picks) == 1 else torch.cat(picks, 0)
    return reference.indexer_topk_many_ref(parts, ratio, topk)


def indexer_scores(*args, **kwargs):
    """See :func:`kernels.indexer.reference.indexer_scores_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.indexer import triton_impl
        return triton_impl.indexer_scores(*args, **kwargs)
    return reference.indexer_scores_ref(*args, **kwargs)
