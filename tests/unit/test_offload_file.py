"""Offload files: atomic, private, and every way a file can be wrong is detected."""

import os
import stat
from pathlib import Path

import pytest

from worker.cache.offload_file import (
    MAGIC, BlockKey, OffloadCorrupt, OffloadMismatch, OffloadMissing, OffloadUnavailable, path_for, read_block,
    remove_block, write_block,
)

KEY = BlockKey(namespace="ab" * 16, tenant="acme", block_hash="cd" * 16, form="compressed", spec_digest="0123456789abcdef")
DATA = bytes(range(256)) * 4


def test_round_trip_and_permissions(tmp_path: Path) -> None:
    root = tmp_path / "off"
    path, digest = write_block(root, KEY, DATA)
    assert read_block(root, KEY) == DATA
    assert read_block(root, KEY, expected_checksum=digest) == DATA
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    d = path.parent
    while d != tmp_path:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        d = d.parent
    assert "acme" in path.parts  # a subdirectory per tenant
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_rewrite_is_atomic_replace(tmp_path: Path) -> None:
    write_block(tmp_path, KEY, DATA)
    write_block(tmp_path, KEY, DATA[::-1])
    assert read_block(tmp_path, KEY) == DATA[::-1]


def test_truncated_file_detected(tmp_path: Path) -> None:
    path, _ = write_block(tmp_path, KEY, DATA)
    raw = path.read_bytes()
    for cut in (3, 10, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(OffloadCorrupt):
            read_block(tmp_path, KEY)


def test_flipped_bit_detected(tmp_path: Path) -> None:
    path, _ = write_block(tmp_path, KEY, DATA)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(OffloadCorrupt, match="checksum"):
        read_block(tmp_path, KEY)


def test_bad_magic_and_header(tmp_path: Path) -> None:
    path, _ = write_block(tmp_path, KEY, DATA)
    path.write_bytes(b"NOPE" + path.read_bytes()[4:])
    with pytest.raises(OffloadCorrupt, match="magic"):
        read_block(tmp_path, KEY)
    path.write_bytes(MAGIC + (5).to_bytes(4, "little") + b"{zzzz" + DATA)
    with pytest.raises(OffloadCorrupt, match="header"):
        read_block(tmp_path, KEY)


@pytest.mark.parametrize("field", ["namespace", "spec_digest", "form"])
def test_mismatched_identity_rejected(tmp_path: Path, field: str) -> None:
    other = {"namespace": "ef" * 16, "spec_digest": "fedcba9876543210", "form": "indexer"}[field]
    k2 = BlockKey(**{f: (other if f == field else getattr(KEY, f))
                     for f in ("namespace", "tenant", "block_hash", "form", "spec_digest")})
    path, _ = write_block(tmp_path, KEY, DATA)
    target = path_for(tmp_path, k2)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)  # a file planted at the other key's path
    with pytest.raises(OffloadMismatch, match=field):
        read_block(tmp_path, k2)


def test_expected_checksum_mismatch(tmp_path: Path) -> None:
    write_block(tmp_path, KEY, DATA)
    with pytest.raises(OffloadMismatch, match="recorded at commit"):
        read_block(tmp_path, KEY, expected_checksum="0" * 32)


def test_missing_and_unavailable(tmp_path: Path) -> None:
    with pytest.raises(OffloadUnavailable, match="missing"):
        read_block(tmp_path / "nope", KEY)
    (tmp_path / "root").mkdir()
    with pytest.raises(OffloadMissing):
        read_block(tmp_path / "root", KEY)
    assert remove_block(tmp_path / "root", KEY) is False


def test_unwritable_path_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OffloadUnavailable):
        write_block(blocker, KEY, DATA)


def test_unsafe_key_fields_rejected() -> None:
    with pytest.raises(ValueError, match="tenant"):
        BlockKey(namespace="ab" * 16, tenant="../etc", block_hash="cd" * 16, form="f", spec_digest="x")
