"""Fault drills: the ``--soak`` option, and the summary printed (and written) at the end of the session.

``pytest tests/faults --soak`` (or ``KVL_SOAK=1`` with any pytest command) also runs the soak
(``test_soak.py``, marked ``soak``); without it the soak is skipped. NOTE: pytest registers
options only from the conftest files it loads at start-up — those of the paths on the
command line — so ``--soak`` is known when ``tests/faults`` (or a file in it) is named; the
environment variable works however pytest is started.

Each run of drills adds its summary to :data:`REPORTS`; it is printed after the test
results, and with ``KVL_WRITE_RELIABILITY=1`` written to ``docs/RELIABILITY.md`` (so a plain
``make test`` leaves the tree as it was).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md"
#: (terminal summary, markdown section) of each run of drills in this session.
REPORTS: list[tuple[str, str]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="also run the long fault-drill soak (tests/faults/test_soak.py); KVL_SOAK=1 does the same")


def soak_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--soak", default=False)) or os.environ.get("KVL_SOAK", "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if soak_enabled(config):
        return
    skip = pytest.mark.skip(reason="the fault soak runs only with --soak (pytest tests/faults --soak) or KVL_SOAK=1")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORTS:
        return
    for text, _ in REPORTS:
        terminalreporter.write_sep("=", "fault drills")
        terminalreporter.write_line(text)
    if os.environ.get("KVL_WRITE_RELIABILITY", "") not in ("", "0"):
        from tests.faults.report import document

        DOC.write_text(document([md for _, md in REPORTS]))
        terminalreporter.write_line(f"written to {DOC}")
