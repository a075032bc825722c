"""What every ``kvledger`` operator command shares: its error (one line on stderr, then an exit
code), the wrapper that turns one into that line, and the output — tables and progress bars on
a terminal (rich), JSON for scripts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EXIT_FAILED = 1
EXIT_FOUND_PROBLEMS = 3


class CliError(Exception):
    """One line for stderr, then exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``fn`` with a :class:`CliError` printed as one line (its exit code returned) and a closed
    pipe (``kvledger events | head``) taken as success."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except CliError as e:
            print(f"kvledger: {e}", file=sys.stderr)
            return e.code
        except BrokenPipeError:  # `kvledger events | head`
            return 0
    return run


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, highlight=False, soft_wrap=False, width=None if stream.isatty() else 200)


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold", justify="right" if c.startswith("#") else "left")
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    return t


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def age(ms: int | None) -> str:
    if not ms:
        return "-"
    s = max(time.time() - ms / 1000, 0.0)
    return f"{s:.1f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def when(iso: str) -> str:
    return iso[:23].replace("T", " ") if iso else ""


@contextmanager
def progress(description: str, total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (a spinner when ``total`` is unknown); yields ``update(done)``."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total or None)
        yield lambda done: bar.update(task, completed=done)
