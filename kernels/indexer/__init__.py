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


def indexer_scores(*args, **kwargs):
    """See :func:`kernels.indexer.reference.indexer_scores_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.indexer import triton_impl
        return triton_impl.indexer_scores(*args, **kwargs)
    return reference.indexer_scores_ref(*args, **kwargs)
