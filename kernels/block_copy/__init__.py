"""Public entry points of the block copy op: dispatch to Triton or the reference."""

from __future__ import annotations

from kernels.dispatch import backend_for
from kernels.block_copy import reference


def gather_blocks(*args, **kwargs):
    """See :func:`kernels.block_copy.reference.gather_blocks_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.block_copy import triton_impl
        return triton_impl.gather_blocks(*args, **kwargs)
    return reference.gather_blocks_ref(*args, **kwargs)


def scatter_blocks(*args, **kwargs):
    """See :func:`kernels.block_copy.reference.scatter_blocks_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.block_copy import triton_impl
        return triton_impl.scatter_blocks(*args, **kwargs)
    return reference.scatter_blocks_ref(*args, **kwargs)
