"""The identity of an offloaded block, and the errors of the disk tier.

A block's bytes live in segment files (``worker.cache.segments``); :class:`BlockKey` is what
names a record there (namespace, tenant, block hash, form, the form's spec digest), each field
a safe path token. Directories are 0700 and files 0600: cache contents are tenant data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAFE = re.compile(r"^[A-Za-z0-9_\-]{1,128}\Z")


class OffloadError(Exception):
    """Base class: the offload tier could not deliver a usable block."""


class OffloadUnavailable(OffloadError):
    """The directory cannot be written or read (missing, read-only, full): skip the tier."""


class OffloadCorrupt(OffloadError):
    """The file exists but its bytes are not a valid block (truncated, bit flip, bad header)."""


class OffloadMismatch(OffloadError):
    """A valid file, but for another namespace, form spec, block or format version."""


class OffloadMissing(OffloadError):
    """No file for this block and form."""


@dataclass(frozen=True, slots=True)
class BlockKey:
    namespace: str
    tenant: str
    block_hash: str
    form: str
    spec_digest: str

    def __post_init__(self) -> None:
        for name in ("namespace", "tenant", "block_hash", "form", "spec_digest"):
            check_token(name, getattr(self, name))


def check_token(name: str, value: str) -> None:
    """``ValueError`` unless ``value`` is a safe path token (letters, digits, ``_``, ``-``)."""
    if not _SAFE.match(value):
        raise ValueError(f"offload key field {name}={value!r} is not a safe path token")
