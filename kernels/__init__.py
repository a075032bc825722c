"""Kernels: each Triton kernel beside a plain PyTorch reference of the same math.

Every op package holds ``reference.py`` (the oracle and the CPU path), ``triton_impl.py``
(the kernel and its host wrapper) and an ``__init__`` that dispatches through
:func:`kernels.dispatch.backend_for`: CUDA tensors → Triton, CPU tensors → reference, unless
a test forces the Triton interpreter (``TRITON_INTERPRET=1`` plus ``force_backend("triton")``).
"""
