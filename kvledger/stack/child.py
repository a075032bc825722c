"""One process that ``kvledger up`` supervises: in its own process group, its output to a rotated
JSON-lines log file and to the terminal, stopped by SIGTERM then SIGKILL to the whole group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvledger.stack.console import Console, render_log_line
from shared.child_process import parent_death_signal
from shared.logging import JsonLinesFile


class Child:
    """A supervised process in its own process group; output to a log file and the terminal.
    :meth:`start` again after it exited runs it anew with the same command and environment."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, console: Console,
                 colour: str, echo: bool, *, max_bytes: int = 50 * 2**20, backups: int = 5) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        #: Every line the child prints, as one JSON object per line, rotated by size (logging.max_bytes).
        self.log = JsonLinesFile(log_path, max_bytes, backups, logger=name)
        self.console = console
        self.colour = colour
        self.echo = echo
        self.url: str | None = None
        self.url_seen = threading.Event()
        self.popen: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._tail: list[str] = []
        #: Supervision: restarts so far, recent exits (monotonic), when it is due to start again.
        self.restarts = 0
        self.exits: list[float] = []
        self.restart_at: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._tail = []  # the end of the log shown when it exits is this run's
        self.popen = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace",
                                      start_new_session=True, preexec_fn=parent_death_signal())
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        for line in self.popen.stdout:
            # NOTE: a plain line (`listening on …`, a traceback) goes to the log file as an `output` record
            self.log.write(line, render_log_line(line)[0])
            self._tail.append(line.rstrip("\n"))
            del self._tail[:-40]
            if line.startswith("listening on http"):
                self.url = line.split()[-1].strip()
                self.url_seen.set()
            if self.echo:
                try:
                    self.console.child_line(self.name, self.colour, line)
                except (OSError, ValueError):  # the terminal went away (`kvledger up | head`)
                    self.echo = False  # keep draining the pipe, or the child blocks on a full one

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def tail(self, n: int = 15) -> str:
        return "\n".join(self._tail[-n:])

    def note(self, event: str, level: str, **fields: Any) -> None:
        """A JSON line of the supervisor's own in this child's log, so that the log says where one
        run ended and why the next began. Only between runs (after :meth:`stop`): no reader writes."""
        ts = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        doc = {"event": event, "level": level, "logger": "kvledger.up", "timestamp": ts, "name": self.name, **fields}
        self.log.write_json(json.dumps(doc))

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)  # start_new_session: its pgid is its pid

    def stop(self, timeout_s: float, hurry: threading.Event | None = None) -> int | None:
        """SIGTERM to the group, wait (until ``timeout_s`` or ``hurry``), then SIGKILL the group.
        Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.popen.poll() is None and time.monotonic() < deadline and not (hurry and hurry.is_set()):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(0.1)
            if self.popen.poll() is None:
                why = "second signal" if hurry and hurry.is_set() else f"did not stop within {timeout_s:.0f}s"
                self.console.say(f"{self.name}: {why}; killing it", style="yellow")
        # NOTE: the group may hold processes the child started; they go too, whatever the child did.
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        if self._reader is not None:
            self._reader.join(2)
        return self.popen.poll()
