"""The offload file format of the shared disk tier, and its atomic writer and verifying reader.

One file holds one form of one block::

    magic "KVLB" | header length (u32 LE) | header (JSON) | payload bytes

The header carries the file format version, namespace, tenant, block hash, form name, the
form's spec digest, the payload length and its xxh3-128 checksum. A reader verifies every
field against what it expects *and* the checksum of the bytes before anything reaches a
pool, so a file written by another model, another form spec, a truncated write or a flipped
bit is rejected with a typed error (and the caller recomputes).

Writes go to a temporary file in the same directory, are flushed and fsynced, then renamed
over the final name: a reader sees either the whole old file, the whole new file, or none.
Directories are 0700 and files 0600 (cache contents are tenant data); each tenant has its
own subdirectory.
"""

from __future__ import annotations

import errno
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shared.hashing import checksum
from shared.versions import OFFLOAD_FILE_VERSION

MAGIC = b"KVLB"
_MAX_HEADER = 64 * 1024
_SAFE = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


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


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    namespace: str
    tenant: str
    block_hash: str
    form: str
    spec_digest: str
    length: int
    checksum: str


@dataclass(frozen=True, slots=True)
class BlockKey:
    namespace: str
    tenant: str
    block_hash: str
    form: str
    spec_digest: str

    def __post_init__(self) -> None:
        for name in ("namespace", "tenant", "block_hash", "form", "spec_digest"):
            if not _SAFE.match(getattr(self, name)):
                raise ValueError(f"offload key field {name}={getattr(self, name)!r} is not a safe path token")


def path_for(root: Path, key: BlockKey) -> Path:
    # NOTE: block hashes are salted per tenant, so the tenant directory is for operators
    # (quotas, deletion on offboarding), not for isolation of identical prefixes.
    return root / key.tenant / key.namespace[:16] / key.block_hash[:2] / f"{key.block_hash}.{key.form}.kvl"


def _mkdirs(path: Path, root: Path) -> None:
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    rel = path.relative_to(root)
    cur = root
    for part in rel.parts:
        cur = cur / part
        try:
            cur.mkdir(mode=0o700)
        except FileExistsError:
            pass


def write_block(root: Path, key: BlockKey, payload: bytes | memoryview) -> tuple[Path, str]:
    """Write one block atomically; returns (path, checksum). Raises OffloadUnavailable."""
    data = memoryview(payload).cast("B")
    digest = checksum(data)
    header = msgspec.json.encode(Header(
        version=OFFLOAD_FILE_VERSION, namespace=key.namespace, tenant=key.tenant, block_hash=key.block_hash,
        form=key.form, spec_digest=key.spec_digest, length=len(data), checksum=digest))
    final = path_for(root, key)
    tmp_name = None
    try:
        _mkdirs(final.parent, root)
        fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", dir=final.parent)  # mode 0600
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<I", len(header)))
            f.write(header)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
        tmp_name = None
    except OSError as e:
        raise OffloadUnavailable(f"offload write failed ({errno.errorcode.get(e.errno or 0, e.errno)}): "
                                 f"{e.strerror}") from e
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass
    return final, digest


def read_block(root: Path, key: BlockKey, expected_checksum: str | None = None) -> bytes:
    """Read and fully verify one block; returns the payload bytes."""
    path = path_for(root, key)
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        if not root.exists():
            raise OffloadUnavailable(f"offload directory {root} is missing") from e
        raise OffloadMissing(f"no offload file for block {key.block_hash[:12]}… form {key.form}") from e
    except OSError as e:
        raise OffloadUnavailable(f"offload read failed: {e.strerror}") from e
    return verify(raw, key, expected_checksum)


def split(raw: bytes) -> tuple[Header, bytes]:
    """The header and the payload of a file, unverified beyond the header's own syntax."""
    if len(raw) < 8 or raw[:4] != MAGIC:
        raise OffloadCorrupt("not a kvledger offload file (bad magic or truncated before the header)")
    (hlen,) = struct.unpack("<I", raw[4:8])
    if hlen > _MAX_HEADER or 8 + hlen > len(raw):
        raise OffloadCorrupt(f"header length {hlen} does not fit a file of {len(raw)} bytes (truncated?)")
    try:
        h = msgspec.json.decode(raw[8:8 + hlen], type=Header)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise OffloadCorrupt(f"unreadable header: {e}") from e
    return h, raw[8 + hlen:]


def verify(raw: bytes, key: BlockKey, expected_checksum: str | None = None) -> bytes:
    h, payload = split(raw)
    if h.version != OFFLOAD_FILE_VERSION:
        raise OffloadMismatch(f"offload file format v{h.version}; this build reads v{OFFLOAD_FILE_VERSION}")
    for field in ("namespace", "tenant", "block_hash", "form", "spec_digest"):
        if getattr(h, field) != getattr(key, field):
            raise OffloadMismatch(f"offload file is for {field}={getattr(h, field)!r}, expected {getattr(key, field)!r}")
    if len(payload) != h.length:
        raise OffloadCorrupt(f"payload is {len(payload)} bytes, header says {h.length} (truncated file)")
    got = checksum(payload)
    if got != h.checksum:
        raise OffloadCorrupt("payload checksum does not match the header (corrupted bytes)")
    if expected_checksum is not None and got != expected_checksum:
        raise OffloadMismatch("payload checksum differs from the one recorded at commit")
    return payload


def remove_block(root: Path, key: BlockKey) -> bool:
    try:
        path_for(root, key).unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        raise OffloadUnavailable(f"offload delete failed: {e.strerror}") from e


def check_block(root: Path, key: BlockKey, expected_checksum: str | None = None) -> str:
    """Verify one block file without keeping it (for the audit): ``""`` if it is whole and as
    expected, ``"missing"``, or what is wrong with it. Raises OffloadUnavailable (the directory
    itself cannot be read)."""
    try:
        read_block(root, key, expected_checksum or None)
    except OffloadMissing:
        return "missing"
    except (OffloadCorrupt, OffloadMismatch) as e:
        return str(e) or type(e).__name__
    return ""
