"""The terminal of ``kvledger up``: the supervisor's own lines and its children's, each child's
prefixed with its name and a structlog JSON line rendered readably (:func:`render_log_line`)."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

#: Colours of the log prefixes (coordinators first, then workers in turn).
COLOURS = ("cyan", "green", "magenta", "blue", "yellow", "bright_green", "bright_magenta", "bright_blue")
_LEVEL_STYLE = {"debug": "dim", "info": "", "warning": "yellow", "error": "bold red", "critical": "bold red"}
#: Keys of a structlog JSON line shown in the prefix, not as ``key=value``.
_META = ("event", "level", "timestamp", "logger")


class Console:
    """Thread-safe printing: the supervisor's own lines and the children's, prefixed.

    If the output goes away (``kvledger up | head``), further output is discarded and
    ``on_gone`` is called once: the stack stops, as it would on SIGHUP.
    """

    def __init__(self, stream: IO[str] | None = None, on_gone: Callable[[], None] | None = None) -> None:
        from rich.console import Console as RichConsole

        console = self

        class _Rich(RichConsole):
            def on_broken_pipe(self) -> None:  # rich's default raises SystemExit, in whichever thread printed
                self.quiet = True
                if console.on_gone is not None:
                    console.on_gone()

        stream = stream or sys.stdout
        # Not a terminal (a pipe, a file, `make up | tee`): wide enough that no URL is cut.
        width = None if stream.isatty() else 200
        self._rich = _Rich(file=stream, highlight=False, markup=False, soft_wrap=True, emoji=False, width=width)
        self._lock = threading.Lock()
        self.width = 12
        self.on_gone = on_gone

    def say(self, message: str, style: str = "bold") -> None:
        self.print(f"kvledger up: {message}", style=style)

    def print(self, renderable: Any, style: str | None = None) -> None:
        # NOTE: a closed terminal must never stop the supervisor from stopping its children.
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._rich.print(renderable, style=style)

    def child_line(self, name: str, colour: str, line: str) -> None:
        from rich.text import Text

        text = Text()
        text.append(f"{name:<{self.width}}| ", style=colour)
        level, body = render_log_line(line)
        text.append(body, style=_LEVEL_STYLE.get(level, ""))
        with self._lock:
            self._rich.print(text)  # errors reach Child._pump, which stops echoing


def render_log_line(line: str) -> tuple[str, str]:
    """``(level, readable text)`` of one output line: a structlog JSON line becomes
    ``HH:MM:SS level  event key=value …``; anything else is passed through."""
    line = line.rstrip("\n")
    if line.startswith("{"):
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and "event" in doc:
            level = str(doc.get("level", "info"))
            ts = str(doc.get("timestamp", ""))
            clock = ts[11:19] if len(ts) >= 19 else ""
            rest = " ".join(f"{k}={_short(v)}" for k, v in doc.items() if k not in _META)
            return level, f"{clock} {level:<7} {doc['event']}" + (f"  {rest}" if rest else "")
    lowered = line.lower()
    level = "error" if ("traceback" in lowered or "error" in lowered[:40]) else "info"
    return level, line


def _short(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
    return s if len(s) <= 160 else s[:157] + "..."
