"""``kvledger model manifest|verify DIR``: the manifest of a checkpoint directory
(:mod:`shared.manifest`), loaded by kvledger/cli.py.

``manifest`` hashes every file and writes ``kvledger-manifest.json``; ``verify`` checks the
files against it. Both print the checkpoint digest (what enters the cache namespace) and show
a progress bar over the bytes on a terminal. Exit 0 = done / the checkpoint matches; 1 = it does
not match, or the manifest could not be read or written (one line on stderr); 2 = DIR is not a
directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EXIT_MISMATCH = 1
EXIT_USAGE = 2


def register(sub: Any) -> None:
    m = sub.add_parser("model", help="checkpoint directories: write or verify their manifest of file hashes")
    msub = m.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    w = msub.add_parser("manifest", help="hash every file of DIR and write DIR/kvledger-manifest.json",
                        description="Hash every file of a checkpoint directory and write its manifest; a worker "
                                    "verifies it at start.")
    w.add_argument("dir", metavar="DIR", help="the checkpoint directory (worker.model_dir)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.set_defaults(func=cmd_manifest)
    v = msub.add_parser("verify", help="check the files of DIR against its manifest; exit 1 if they differ",
                        description="Hash every file of a checkpoint directory and compare with its manifest.")
    v.add_argument("dir", metavar="DIR", help="the checkpoint directory (worker.model_dir)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(func=cmd_verify)
    m.set_defaults(func=lambda args: (m.print_help(), EXIT_USAGE)[1])


def cmd_manifest(args: argparse.Namespace) -> int:
    if (bad := _not_a_directory("manifest", args.dir)) is not None:
        return bad
    from shared.manifest import ManifestError, read_manifest, write_manifest

    try:
        with _progress(f"hashing {args.dir}", not args.no_progress) as update:
            path = write_manifest(args.dir, progress=update)
        manifest = read_manifest(args.dir)
    except ManifestError as e:
        print(f"kvledger model manifest: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    print(f"wrote {path}: {len(manifest.files)} files, {_size(manifest.total_bytes)}\n"
          f"checkpoint digest: {manifest.digest}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if (bad := _not_a_directory("verify", args.dir)) is not None:
        return bad
    from shared.manifest import ManifestError, read_manifest, verify_manifest

    try:
        with _progress(f"verifying {args.dir}", not args.no_progress) as update:
            digest = verify_manifest(args.dir, progress=update)
        files = len(read_manifest(args.dir).files)
    except ManifestError as e:
        print(f"kvledger model verify: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    print(f"{args.dir}: {files} files match the manifest\ncheckpoint digest: {digest}")
    return 0


def _not_a_directory(command: str, directory: str) -> int | None:
    """Checked before the manifest module (and the torch that comes with its package) is imported."""
    p = Path(directory)
    if p.is_dir():
        return None
    why = "is not a directory" if p.exists() else "does not exist"
    print(f"kvledger model {command}: {directory} {why} (give the checkpoint directory, as worker.model_dir)",
          file=sys.stderr)
    return EXIT_USAGE


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n} bytes"


@contextmanager
def _progress(description: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A bar over bytes on stderr while hashing; None (no callback) when off or not a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=Console(file=sys.stderr),
                  transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
