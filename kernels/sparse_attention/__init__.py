"""Public entry points of the sparse attention op: dispatch to Triton or the reference."""

from __future__ import annotations

from kernels.dispatch import backend_for
from kernels.sparse_attention import reference


def paged_sparse_attn(*args, **kwargs):
    """See :func:`kernels.sparse_attention.reference.paged_sparse_attn_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.sparse_attention import triton_impl
        return triton_impl.paged_sparse_attn(*args, **kwargs)
    return reference.paged_sparse_attn_ref(*args, **kwargs)


def sparse_attn(*args, **kwargs):
    """See :func:`kernels.sparse_attention.reference.sparse_attn_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.sparse_attention import triton_impl
        return triton_impl.sparse_attn(*args, **kwargs)
    return reference.sparse_attn_ref(*args, **kwargs)
