"""How many examples a property test draws: its CI count, times ``KVL_FUZZ_SCALE`` (``make fuzz``).

CI draws the same examples on every run (tests/conftest.py); ``make fuzz`` draws new ones, more of
them, to search wider than a run that must stay fast — a failure prints the blob that reproduces it.
"""

from __future__ import annotations

import os


def examples(n: int) -> int:
    """``n`` scaled by ``KVL_FUZZ_SCALE`` (a positive integer; 1 when unset)."""
    raw = os.environ.get("KVL_FUZZ_SCALE", "1")
    try:
        scale = int(raw)
    except ValueError:
        raise ValueError(f"KVL_FUZZ_SCALE={raw!r}: a positive integer") from None
    if scale < 1:
        raise ValueError(f"KVL_FUZZ_SCALE={raw!r}: a positive integer")
    return n * scale
