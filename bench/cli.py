"""What the service benchmarks' entry points share: quiet logs, one run, the result as the last
line of stdout (the JSON object every bench ends with)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any


def run_and_print(bench: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run ``bench`` with only warnings logged; print its result as one JSON line and return it."""
    from shared.logging import configure_logging
    configure_logging("json", "warning")
    result = asyncio.run(bench)
    print(json.dumps(result))
    return result


@contextlib.asynccontextmanager
async def services(database_url: str, nats_url: str, state_dir: Path) -> AsyncIterator[tuple[str, str]]:
    """``(database URL, NATS URL)``: the ones given, or embedded PostgreSQL and/or NATS started in
    ``state_dir`` for what is missing (stopped on exit)."""
    if database_url and nats_url:
        yield database_url, nats_url
        return
    from shared.embedded import start_services
    print("starting embedded PostgreSQL and/or NATS ...", file=sys.stderr, flush=True)
    svc = await asyncio.to_thread(start_services, database_url, nats_url, str(state_dir))
    try:
        yield svc.database_url, svc.nats_url
    finally:
        await asyncio.to_thread(svc.stop)
