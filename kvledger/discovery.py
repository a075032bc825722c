"""Which running stack a ``kvledger`` command talks to: the ``stack.json`` of its state dir.

``kvledger up`` writes ``<state_dir>/stack.json`` (addresses, pids, the config file it was
started with) and removes it when it stops. An operator command finds its stack by, in order:

1. ``--state-dir DIR`` (the stack named; an error if none runs there);
2. ``$KVLEDGER_STATE_DIR`` (likewise);
3. the configuration's ``state_dir`` (``--config`` / ``$KVL_CONFIG``) when it is not the default,
   resolved against the working directory as ``kvledger up`` resolves it;
4. ``.kvl-state/stack.json`` in the working directory or the nearest directory above it
   (where ``make up`` runs the stack: any shell inside the checkout finds it).

A ``stack.json`` whose supervisor no longer runs (a ``kvledger up`` that was killed) is not a
stack: it is skipped by the search, and named in the error when it was asked for.
``--coordinator-url`` or ``$KVL_COORDINATOR_URL`` bypass the search altogether.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_DIR_ENV = "KVLEDGER_STATE_DIR"
DEFAULT_STATE_DIR = ".kvl-state"
STACK_FILE = "stack.json"


class NoStack(Exception):
    """A stack was named (``--state-dir``, ``$KVLEDGER_STATE_DIR``) but none runs there."""


@dataclass(frozen=True)
class StackInfo:
    state_dir: Path
    doc: dict[str, Any]
    #: How it was found: "--state-dir", "$KVLEDGER_STATE_DIR", "config", "working directory".
    found_by: str

    @property
    def coordinator_url(self) -> str:
        return str(self.doc.get("coordinator_url") or "")

    @property
    def config_path(self) -> str | None:
        return self.doc.get("config") or None


def read_stack(state_dir: Path) -> dict[str, Any] | None:
    """The ``stack.json`` of ``state_dir`` when its supervisor still runs; else None."""
    try:
        doc = json.loads((state_dir / STACK_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    pid = doc.get("supervisor_pid")
    if not isinstance(pid, int) or not _alive(pid):
        return None
    return doc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_stack(state_dir: str | None = None, config_state_dir: str | None = None,
               cwd: Path | None = None, env: dict[str, str] | None = None) -> StackInfo | None:
    """The running stack this command belongs to (see the module docstring), or None.

    Raises :class:`NoStack` when one was named explicitly and does not run."""
    cwd = (cwd or Path.cwd()).resolve()
    env = os.environ if env is None else env
    for given, how in ((state_dir, "--state-dir"), (env.get(STATE_DIR_ENV), f"${STATE_DIR_ENV}")):
        if given:
            d = (cwd / given).resolve()
            doc = read_stack(d)
            if doc is None:
                stale = (d / STACK_FILE).exists()
                raise NoStack(f"no kvledger stack runs with state dir {d} ({how}): "
                              + ("its stack.json was left by a `kvledger up` that no longer runs" if stale
                                 else "no stack.json there") + "; start one with `kvledger up`")
            return StackInfo(d, doc, how)
    if config_state_dir and Path(config_state_dir) != Path(DEFAULT_STATE_DIR):
        d = (cwd / config_state_dir).resolve()
        if (doc := read_stack(d)) is not None:
            return StackInfo(d, doc, "config")
    for parent in (cwd, *cwd.parents):
        d = parent / DEFAULT_STATE_DIR
        if (doc := read_stack(d)) is not None:
            return StackInfo(d, doc, "working directory")
    return None


def found_from(state_dir: Path, cwd: Path) -> bool:
    """Whether a command run in ``cwd`` finds ``state_dir`` by itself (the working-directory search)."""
    state_dir, cwd = state_dir.resolve(), cwd.resolve()
    for parent in (cwd, *cwd.parents):
        if (parent / DEFAULT_STATE_DIR).exists():
            return (parent / DEFAULT_STATE_DIR).resolve() == state_dir
    return False


def cli_command() -> str:
    """How to run this ``kvledger`` again from any shell, as a command line.

    ``kvledger`` when that name on PATH is this very program; else its full path (a virtualenv's
    ``bin/kvledger`` that is not activated); else ``<python> -m kvledger``."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "kvledger":
        me = argv0.absolute()
        on_path = shutil.which("kvledger")
        if on_path and Path(on_path).resolve() == me.resolve():
            return "kvledger"
        return shlex.quote(str(me))
    return f"{shlex.quote(sys.executable)} -m kvledger"


__all__ = ["NoStack", "STATE_DIR_ENV", "StackInfo", "cli_command", "find_stack", "found_from", "read_stack"]
