"""Test helpers: find the records of blocks in an offload directory's segment files, and damage
them the way a disk or a crash would (a flipped payload or header byte, a file cut short)."""

from __future__ import annotations

from pathlib import Path

from worker.cache.segments import Record, SegmentIndex


def records(root: Path, hashes: list[str] | None = None) -> list[Record]:
    """Every record a fresh reader finds under ``root`` (those of ``hashes`` only, if given)."""
    idx = SegmentIndex(root)
    if root.exists():
        idx.refresh()
    out = [r for path in sorted(idx._by_path) for r in idx.records(path)]
    return [r for r in out if hashes is None or r.header.block_hash in hashes]


def segment_files(root: Path) -> list[Path]:
    return sorted((root / "segments").rglob("*.kvs")) if root.exists() else []


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def flip_payload(r: Record) -> None:
    flip(r.path, r.payload + (r.end - r.payload) // 2)


def flip_header(r: Record) -> None:
    flip(r.path, r.start + 20)          # inside the header JSON: its CRC no longer matches


def cut_inside(r: Record) -> None:
    """Truncate ``r``'s segment in the middle of ``r`` (it and every later record of the file go)."""
    with open(r.path, "r+b") as f:
        f.truncate(r.payload + (r.end - r.payload) // 2)


def torn_tail_bytes(root: Path, writer: str) -> int:
    """Bytes at the ends of ``writer``'s segments that hold no whole record (a write cut short)."""
    idx = SegmentIndex(root)
    if not root.exists():
        return 0
    idx.refresh()
    return sum(p.stat().st_size - idx._scanned.get(p, 0) for p in sorted((root / "segments" / writer).glob("*.kvs")))
