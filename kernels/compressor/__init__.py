"""Public entry points of the compressor op: dispatch to Triton or the reference."""

from __future__ import annotations

from kernels.dispatch import backend_for
from kernels.compressor import reference


def compress_entries(*args, **kwargs):
    """See :func:`kernels.compressor.reference.compress_entries_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.compressor import triton_impl
        return triton_impl.compress_entries(*args, **kwargs)
    return reference.compress_entries_ref(*args, **kwargs)


def save_state(*args, **kwargs):
    """See :func:`kernels.compressor.reference.save_state_ref`; same arguments, same result."""
    if backend_for(args[0]) == "triton":
        from kernels.compressor import triton_impl
        return triton_impl.save_state(*args, **kwargs)
    return reference.save_state_ref(*args, **kwargs)
