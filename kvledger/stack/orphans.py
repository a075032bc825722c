"""Processes a stack leaves behind, found and stopped: those of a supervisor that was killed
(SIGKILL, OOM) before it could stop them, listed in the ``stack.json`` it left
(:func:`stop_leftovers`), and any still running after a stop (:func:`survivors`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from kvledger.stack.console import Console
from kvledger.stack.options import StackError


def stop_leftovers(state_dir: Path, console: Console) -> None:
    """A ``stack.json`` left by a ``kvledger up`` that was killed (SIGKILL, OOM): stop what it
    started that still runs, so that the ports and the data directories are free again.
    If that supervisor is still alive, refuse: two stacks must not share a state_dir."""
    import psutil

    path = state_dir / "stack.json"
    try:
        doc = json.loads(path.read_text())
        written = path.stat().st_mtime
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        return
    sup = doc.get("supervisor_pid")
    if isinstance(sup, int) and sup != os.getpid() and _is_supervisor(sup):
        raise StackError(f"another `kvledger up` (pid {sup}) runs with state_dir {state_dir}; "
                         f"stop it first (Ctrl-C there, or kill {sup})")
    leftovers: list[psutil.Process] = []
    for svc in doc.get("services", []):
        pid = svc.get("pid")
        if not isinstance(pid, int):
            continue
        try:
            p = psutil.Process(pid)
            # a pid reused since is not ours: ours started before the file was last written
            if p.create_time() <= written + 1 and _looks_like(p, svc.get("name", ""), state_dir):
                leftovers.append(p)
        except psutil.Error:
            continue
    if leftovers:
        names = ", ".join(f"{p.pid}" for p in leftovers)
        console.say(f"a previous `kvledger up` (pid {sup}) was killed and left processes running "
                    f"({names}); stopping them", style="yellow")
        for p in leftovers:
            _signal_leader(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(leftovers, timeout=15)
        for p in alive:
            _signal_leader(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    path.unlink(missing_ok=True)


def _signal_leader(p: Any, sig: int) -> None:
    """``sig`` to ``p``'s process group when it leads one (as everything the stack starts does)."""
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)


def _is_supervisor(pid: int) -> bool:
    import psutil

    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return " up" in cmd and ("kvledger" in cmd or "kvledger.cli" in cmd)


def _looks_like(p: Any, name: str, state_dir: Path) -> bool:
    """Whether ``p`` is the ``name`` service a stack with ``state_dir`` started."""
    cmd = " ".join(p.cmdline())
    if name in ("postgres", "nats", "postgres-standby") or name.startswith("nats-"):
        return str(state_dir) in cmd
    if name == "coordinator" or name.startswith("coordinator-"):
        return "-m coordinator" in cmd
    return "-m worker" in cmd or "-m gateway" in cmd   # workers and gateways carry their ids as names


def descendants(pids: set[int]) -> list[Any]:
    """Every process below ``pids`` right now (taken before the stop: orphans lose their parent)."""
    import psutil

    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out += psutil.Process(pid).children(recursive=True)
    return out


def survivors(pids: set[int], below: list[Any] | None = None) -> list[str]:
    """Processes started here (``pids``), in their process groups, or among ``below`` (taken
    with :func:`descendants` before the stop) that still run: each is SIGKILLed and described.
    Empty = nothing left behind."""
    import psutil

    suspects: dict[int, psutil.Process] = {}
    for p in below or []:
        with contextlib.suppress(psutil.Error):
            if p.is_running():  # also checks that the pid was not reused since
                suspects[p.pid] = p
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if p.pid in pids or os.getpgid(p.pid) in pids:
                suspects[p.pid] = p
    out = []
    for pid, p in sorted(suspects.items()):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            desc = f"pid {pid} ({' '.join(p.cmdline())[:100] or p.name()})"
            p.kill()
            out.append(desc)
        except psutil.Error:
            continue
    return out
