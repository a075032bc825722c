"""What the service benchmarks' entry points share: quiet logs, one run, the result as the last
line of stdout (the JSON object every bench ends with)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any


def run_and_print(bench: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run ``bench`` with only warnings logged; print its result as one JSON line and return it."""
    from shared.logging import configure_logging
    configure_logging("json", "warning")
    result = asyncio.run(bench)
    print(json.dumps(result))
    return result
