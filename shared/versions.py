"""Version numbers that gate sharing of cached state and of messages.

Bump ``CACHE_FORMAT_VERSION`` whenever the bytes a form stores change meaning (layout,
dtype, what a tail snapshot holds); bump ``KERNEL_ABI_VERSION`` whenever a kernel reads
those bytes differently, and whenever the model's arithmetic changes (an op that rounds
another way, a reduction reordered or fused): a cache computed by the old arithmetic is not
what the new build computes cold, and the compute fingerprint (torch build, ISA, threads)
does not see the project's own code. Both enter the namespace hash, so blocks written under
an old version can never match a request served by a new one. No test can hold the
arithmetic still for you: the bits differ between CPU kinds, so a frozen logits digest would
fail on the next machine; the rule is the reviewer's. The engine backs it at run time: a digest
of what the model computes on a seeded request here, past its window and its indexer's
selection (``CausalLM.arithmetic_digest``), enters the namespace too, so a change the
reviewer missed still gets its own namespace when that request reaches it.
"""

from importlib import metadata
from typing import Final

#: Version of every NATS message schema and event payload (``shared.messages``).
SCHEMA_VERSION: Final = 1
#: Layout of cached bytes in pools, host memory and offload files.
CACHE_FORMAT_VERSION: Final = 1
#: What the kernels expect of the bytes they read (strides, scales, quantisation).
KERNEL_ABI_VERSION: Final = 2
#: Record format of the segment files on the shared disk tier (``worker.cache.segments``; the
#: one-file-per-block format before them was version 1).
SEGMENT_FORMAT_VERSION: Final = 2


def package_version() -> str:
    """The installed kvledger distribution's version (``GET /version``), or ``0+unknown`` when
    run from a tree that was never installed."""
    try:
        return metadata.version("kvledger")
    except metadata.PackageNotFoundError:
        return "0+unknown"
