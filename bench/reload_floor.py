"""How fast any validating disk reload written in Python could go: the floor under issue 17's
``disk_reload_ratio_vs_raw`` at the tiny model's block sizes.

Writes the tiny model's four forms (2.5–24 KiB a record) for ``--blocks`` blocks through the
real :class:`worker.cache.segment_writer.SegmentWriter` (real headers, alignment and padding), then
times, alternating, ``--reps`` times:

* **floor**: the least a reload that validates can do per record, with no bookkeeping at all —
  a destination from a free list, one scatter ``preadv`` per run of records (headers into one
  scratch buffer, each payload straight into its destination), the header's CRC-32 compared
  with the indexed one, the payload's xxh3-128 compared with the record's checksum, the
  destination noted. ``bench.worker``'s path does this plus a pool slot's reservation and
  install, the ledger's validation and the objects that carry them;
* **raw**: the same segment file read whole into one preallocated buffer (``bench.worker``'s
  ``disk_raw``).

``floor_ratio_vs_raw`` is raw time ÷ floor time: what ``disk_reload_ratio_vs_raw`` would be if
the path cost nothing but this. ``floor_us_per_record`` and ``raw_us_per_record`` give the
budget per record.

    python -m bench.reload_floor [--blocks 118] [--reps 30]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import xxhash

from worker.cache.segments import ALIGN

#: iovecs per ``preadv`` (Linux's IOV_MAX is 1024): up to three per record.
_IOV = 900


def _log(msg: str) -> None:
    print(f"[bench.reload_floor {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tiny_forms() -> dict[str, tuple[int, str]]:
    """The built-in tiny model's forms (what ``bench.worker`` reloads): bytes per block, spec digest."""
    from worker.model import build_model

    return {f.name: (f.bytes_per_block, f.spec_digest) for f in build_model().declare_forms(16).forms}


def write_segment(root: Path, blocks: int, forms: dict[str, tuple[int, str]]) -> tuple[Path, list[Any]]:
    """One segment of ``blocks`` × ``forms`` (random bytes); its path and records."""
    from worker.cache.offload_key import BlockKey
    from worker.cache.segment_writer import SegmentWriter

    w = SegmentWriter(root, "bench", segment_bytes=1 << 40)
    items = [(BlockKey("ab" * 16, "default", f"{b + 1:032x}", form, digest), memoryview(os.urandom(size)))
             for b in range(blocks) for form, (size, digest) in forms.items()]
    records = w.append(items)
    path = w.current
    w.close()
    assert path is not None
    return path, records


def floor_reload(path: Path, records: list[Any], free: dict[int, list[memoryview]]) -> float:
    """Seconds for the bare validating reload of every record (see the module docstring)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        # headers and padding land at their file offsets in one scratch buffer
        hv = memoryview(bytearray(records[-1].end + ALIGN))
        iov: list[memoryview] = []
        dest: list[memoryview] = []
        for r in records:
            d = free[r.end - r.payload].pop()
            dest.append(d)
            iov.append(hv[r.start:r.payload])
            iov.append(d)
            if r.end % ALIGN:
                iov.append(hv[r.end:r.end + (-r.end) % ALIGN])     # the padding after it
        pos = records[0].start
        for i in range(0, len(iov), _IOV):
            part = iov[i:i + _IOV]
            n = os.preadv(fd, part, pos)
            if n != sum(len(v) for v in part):
                raise RuntimeError(f"short read at {pos}: {n} bytes")
            pos += n
        crc, h128 = zlib.crc32, xxhash.xxh3_128_hexdigest
        got: dict[int, memoryview] = {}
        for i, (r, d) in enumerate(zip(records, dest)):
            if crc(hv[r.start:r.payload]) != r.head_crc or h128(d) != r.header.checksum:
                raise RuntimeError(f"record {i} does not verify")
            got[i] = d
        assert len(got) == len(records)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    for r, d in zip(records, dest):
        free[r.end - r.payload].append(d)
    return dt


def raw_read(path: Path, buf: bytearray) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [memoryview(buf)], 0)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def run(blocks: int, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvl-reload-floor-") as tmp:
        forms = tiny_forms()
        path, records = write_segment(Path(tmp), blocks, forms)
        size = path.stat().st_size
        payload = sum(r.end - r.payload for r in records)
        # destinations: one preallocated pool per form size, as the worker's pools are
        free = {}
        for s, _ in forms.values():
            pool = memoryview(bytearray(s * (blocks + 1)))
            free[s] = [pool[i * s:(i + 1) * s] for i in range(blocks + 1)]
        buf = bytearray(size)
        floor_reload(path, records, free), raw_read(path, buf)         # warm-up (and page cache)
        tf, tr = [], []
        for _ in range(reps):
            tf.append(floor_reload(path, records, free))
            tr.append(raw_read(path, buf))
        f, r = statistics.median(tf), statistics.median(tr)
        n = len(records)
        return {"bench": "reload_floor", "records": n, "segment_bytes": size, "payload_bytes": payload, "reps": reps,
                "floor_us_per_record": round(f / n * 1e6, 3), "raw_us_per_record": round(r / n * 1e6, 3),
                "floor_gbps": round(payload / f / 1e9, 3), "raw_gbps": round(payload / r / 1e9, 3),
                "floor_ratio_vs_raw": round(r / f, 3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.reload_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=118,
                    help="blocks of the tiny model's four forms (default 118: bench.worker's 472 records)")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions of each (default 30)")
    args = ap.parse_args(argv)
    if not 1 <= args.blocks <= 100_000:
        ap.error("--blocks: 1 to 100000")
    if not 1 <= args.reps <= 10_000:
        ap.error("--reps: 1 to 10000")
    _log(f"{args.blocks} blocks of the tiny model's forms, {args.reps} reps ...")
    result = run(args.blocks, args.reps)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
