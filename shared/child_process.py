"""What a process that starts long-lived children asks of the OS so they do not outlive it."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send ``sig`` to the child when the thread that started it
    dies (even by kill -9), so a killed supervisor — ``kvledger up``, a test run — leaves no
    orphans holding ports, locks or a leader lease. Resolved here, in the parent: the child only
    calls it. None where the OS has no such request (the child then outlives a killed parent).

    NOTE: the signal follows the *thread* that forked: start children from a thread that lives as
    long as they should (the main thread, or the event loop's), not from a short-lived worker thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1  # noqa: N806 - the kernel's name

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    return preexec
