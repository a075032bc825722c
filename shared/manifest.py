"""The checkpoint manifest: every file of a model directory with its sha256 and size.

A checkpoint directory (what ``save_pretrained`` writes: ``config.json``, the safetensors
shards and their index, the tokenizer and generation files, …) gets ``kvledger-manifest.json``::

    {"version": 1, "files": {"model-00001-of-00002.safetensors": {"sha256": "9f2c…", "bytes": 4998…}, …}}

listing every regular file of the tree except the manifest itself and hidden files (a path
component starting with ``.``: ``.cache/``, ``.gitattributes``). :func:`verify_manifest` hashes
the files again and refuses a directory that differs in any way: changed bytes, a changed size,
a listed file missing, or a file the manifest does not list (a weights shard added after the
manifest must not be served silently).

The **checkpoint digest** is sha256 over the entries sorted by name, one ``sha256sum``-style
line each (``<sha256>  <name>\\n``). It enters the cache namespace, so cache written for one
set of bytes never matches another. Without a manifest :func:`checkpoint_digest` computes the
same value from the files themselves: the namespace follows the bytes either way; the manifest
adds the refusal to start on bytes nobody recorded.

Files are read in 8 MiB chunks (shards are many GB), a few files at once on threads (hashlib
releases the GIL while it hashes); ``progress(bytes_done, bytes_total)`` reports as it goes.
No torch here: ``kvledger model manifest|verify`` and the worker's loader share this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

MANIFEST_NAME = "kvledger-manifest.json"
MANIFEST_VERSION = 1
CHUNK_BYTES = 8 * 2**20
#: Files hashed at once. NOTE: more threads help on NVMe and network file systems, where one
#: stream does not saturate the device; a few keep a spinning disk from seeking to death.
HASH_THREADS = 4

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``; called from hashing threads, never two at once."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_LISTED = 8  # problems named in one error message


class ManifestError(ValueError):
    """A checkpoint directory that does not match its manifest, or a manifest that cannot be used;
    the message names the file (or the manifest's field) and what to do."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    """The files of a checkpoint, by relative POSIX name."""
    files: Mapping[str, FileEntry]

    @property
    def digest(self) -> str:
        return digest_of(self.files)

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.files.values())

    def to_json(self) -> str:
        files = {name: {"sha256": e.sha256, "bytes": e.bytes} for name, e in sorted(self.files.items())}
        return json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=2) + "\n"


def digest_of(files: Mapping[str, FileEntry]) -> str:
    """The checkpoint digest: sha256 of the ``sha256sum`` listing of ``files``, sorted by name."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{files[name].sha256}  {name}\n".encode())
    return h.hexdigest()


def write_manifest(directory: str | os.PathLike[str], *, progress: Progress | None = None) -> Path:
    """Hash every file of ``directory`` and write its manifest there (atomically); return its path."""
    root = _root(directory)
    manifest = Manifest(_hash_files(root, _scan(root), progress))
    path = root / MANIFEST_NAME
    tmp = root / f".{MANIFEST_NAME}.tmp"  # hidden: never part of a checkpoint, even if left behind
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ManifestError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The manifest of ``directory`` as written, checked for form only (nothing is hashed)."""
    root = _root(directory)
    path = root / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{root} has no {MANIFEST_NAME}; create one with `kvledger model manifest {root}`") \
            from None
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
        raise _ill_formed(path, f"not valid UTF-8 JSON ({e})") from None
    return _parse(doc, path)


def verify_manifest(directory: str | os.PathLike[str], *, progress: Progress | None = None) -> str:
    """Check every file of ``directory`` against its manifest; return the checkpoint digest.

    Raises :class:`ManifestError` naming each file that differs (sha256 or size), is missing, or
    is present but not listed, or naming the field of an ill-formed manifest. Names and sizes are
    compared before anything is hashed, so most mismatches are reported at once.
    """
    root = _root(directory)
    manifest = read_manifest(root)
    on_disk = _scan(root)
    listed = manifest.files
    problems = [f"{n}: listed in the manifest but missing" for n in sorted(listed.keys() - on_disk.keys())]
    problems += [f"{n}: present but not in the manifest" for n in sorted(on_disk.keys() - listed.keys())]
    problems += [f"{n}: {on_disk[n]} bytes, the manifest says {listed[n].bytes}"
                 for n in sorted(on_disk.keys() & listed.keys()) if on_disk[n] != listed[n].bytes]
    _refuse(root, problems)
    for name, got in _hash_files(root, on_disk, progress).items():
        want = listed[name]
        if got.bytes != want.bytes:  # it changed while we read it
            problems.append(f"{name}: {got.bytes} bytes read, the manifest says {want.bytes}")
        elif got.sha256 != want.sha256:
            problems.append(f"{name}: sha256 {got.sha256}, the manifest says {want.sha256}")
    _refuse(root, problems)
    return manifest.digest


def checkpoint_digest(directory: str | os.PathLike[str], *, require_manifest: bool,
                      progress: Progress | None = None) -> str:
    """The checkpoint digest of ``directory``, for the cache namespace.

    With a manifest: :func:`verify_manifest`. Without one: :class:`ManifestError` when
    ``require_manifest`` (``worker.require_manifest``), else the same digest computed from the
    files, so a changed checkpoint still gets a new namespace.
    """
    root = _root(directory)
    if os.path.lexists(root / MANIFEST_NAME):  # a dangling link is an unreadable manifest, not none
        return verify_manifest(root, progress=progress)
    if require_manifest:
        raise ManifestError(f"{root} has no {MANIFEST_NAME} and a manifest is required (worker.require_manifest); "
                            f"create one with `kvledger model manifest {root}`")
    return digest_of(_hash_files(root, _scan(root), progress))


# --- the directory ------------------------------------------------------------------------------

def _root(directory: str | os.PathLike[str]) -> Path:
    root = Path(directory)
    if not root.exists():
        raise ManifestError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise ManifestError(f"checkpoint directory {root} is not a directory")
    return root


def _scan(root: Path) -> dict[str, int]:
    """Relative POSIX name -> size of every regular file under ``root`` (symbolic links followed,
    as in a Hugging Face cache snapshot), except hidden ones and the manifest."""
    def fail(e: OSError) -> NoReturn:  # os.walk skips an unreadable directory unless told otherwise
        raise ManifestError(f"cannot list {e.filename}: {e.strerror or e}")

    found: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root, onerror=fail, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError as e:
            fail(e)
        if (st.st_dev, st.st_ino) in seen:  # a link back up the tree
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fn in filenames:
            if fn.startswith("."):
                continue
            path = Path(dirpath, fn)
            name = path.relative_to(root).as_posix()
            if name == MANIFEST_NAME:
                continue
            try:
                st = path.stat()
            except FileNotFoundError:  # a dangling link: no file
                continue
            except OSError as e:
                raise ManifestError(f"cannot read {path}: {e.strerror or e}") from None
            if not stat.S_ISREG(st.st_mode):
                continue
            problem = _name_problem(name)
            if problem:
                raise ManifestError(f"{path}: {problem}")
            found[name] = st.st_size
    if not found:
        raise ManifestError(f"checkpoint directory {root} has no files")
    return found


def _name_problem(name: str) -> str:
    """Why ``name`` cannot be a file of a checkpoint; empty if it can."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "not a relative path inside the checkpoint"
    if any(p.startswith(".") for p in parts):
        return "a hidden file, which is never part of a checkpoint"
    if name == MANIFEST_NAME:
        return "the manifest cannot list itself"
    if "\n" in name or "\\" in name:
        return "a file name with a newline or backslash, which the digest's listing cannot hold"
    try:
        name.encode()
    except UnicodeEncodeError:
        return "a file name that is not valid UTF-8"
    return ""


# --- hashing ------------------------------------------------------------------------------------

def _hash_files(root: Path, sizes: Mapping[str, int], progress: Progress | None) -> dict[str, FileEntry]:
    """sha256 and bytes read of each file named in ``sizes`` (its expected size, for progress)."""
    total = sum(sizes.values())
    lock = threading.Lock()
    stop = threading.Event()
    done = 0

    def count(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            if progress is not None:
                progress(done, total)

    def one(name: str) -> tuple[str, FileEntry | None]:
        try:
            return name, _hash_file(root / name, name, count, stop)
        except BaseException:
            stop.set()  # the other threads give up at their next chunk
            raise

    if progress is not None:
        progress(0, total)
    order = sorted(sizes, key=lambda n: (-sizes[n], n))  # largest first: the threads finish together
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(order))), thread_name_prefix="kvl-hash") as pool:
        try:
            results = dict(pool.map(one, order))  # raises the first failure; the rest returned None
        except BaseException:  # Ctrl-C included: do not wait for GBs of hashing on the way out
            stop.set()
            raise
    hashed = {name: results[name] for name in sorted(results)}
    assert all(e is not None for e in hashed.values()), "a file's hashing stopped without a failure"
    return hashed  # type: ignore[return-value]


def _hash_file(path: Path, name: str, count: Callable[[int], None], stop: threading.Event) -> FileEntry | None:
    h = hashlib.sha256()
    buf = memoryview(bytearray(CHUNK_BYTES))
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while not stop.is_set():
                n = f.readinto(buf)
                if not n:
                    return FileEntry(h.hexdigest(), size)
                h.update(buf[:n])
                size += n
                count(n)
    except OSError as e:
        raise ManifestError(f"{name}: cannot read {path}: {e.strerror or e}") from None
    return None


# --- the manifest's form ------------------------------------------------------------------------

def _ill_formed(path: Path, what: str) -> ManifestError:
    return ManifestError(f"{path}: {what}; write it again with `kvledger model manifest {path.parent}`")


def _parse(doc: object, path: Path) -> Manifest:
    def bad(what: str) -> ManifestError:
        return _ill_formed(path, what)

    if not isinstance(doc, dict):
        raise bad("the top level must be a JSON object with fields `version` and `files`")
    if "version" not in doc:
        raise bad("field `version` is missing")
    version = doc["version"]
    if type(version) is not int:
        raise bad(f"field `version` must be an integer, not {version!r}")
    if version != MANIFEST_VERSION:
        raise bad(f"field `version` is {version}; this kvledger reads version {MANIFEST_VERSION}")
    if "files" not in doc:
        raise bad("field `files` is missing")
    files = doc["files"]
    if not isinstance(files, dict) or not files:
        raise bad("field `files` must be a non-empty object of file name -> {sha256, bytes}")
    out: dict[str, FileEntry] = {}
    for name, entry in files.items():
        field = f"files[{json.dumps(name)}]"
        problem = _name_problem(name)
        if problem:
            raise bad(f"field `{field}`: {problem}")
        if not isinstance(entry, dict):
            raise bad(f"field `{field}` must be an object with `sha256` and `bytes`")
        sha, size = entry.get("sha256"), entry.get("bytes")
        if sha is None:
            raise bad(f"field `{field}.sha256` is missing")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise bad(f"field `{field}.sha256` must be 64 lowercase hex digits, not {sha!r}")
        if size is None:
            raise bad(f"field `{field}.bytes` is missing")
        if type(size) is not int or size < 0:
            raise bad(f"field `{field}.bytes` must be a non-negative integer, not {size!r}")
        out[name] = FileEntry(sha, size)
    return Manifest(out)


def _refuse(root: Path, problems: list[str]) -> None:
    if not problems:
        return
    shown = "; ".join(problems[:_MAX_LISTED])
    more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise ManifestError(f"checkpoint {root} does not match its {MANIFEST_NAME}: {shown}{more}. If the change "
                        f"is intended, record it with `kvledger model manifest {root}`; otherwise restore the files")
