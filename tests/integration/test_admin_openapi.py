"""The admin API's own OpenAPI document matches the server: schemathesis fuzzes every operation
of /openapi.json against a running coordinator (with a worker, a lease and READY blocks, so the
views have data) with every check it has, as an attacker's probe would.

schemathesis runs as its own process (its client is synchronous; the coordinator runs in this
test's event loop), deterministic and bounded: ``--generation-deterministic`` (no seed, no
example database), ``MAX_EXAMPLES`` per operation and phase, no shrinking, one worker; about 10 s.
Every phase runs (examples, coverage, fuzzing, stateful): the stateful one follows the document's
links, so it drains the worker and invalidates what it finds; nothing runs after it on this stack.
"""

from __future__ import annotations

import asyncio
import os
import xml.etree.ElementTree as ET
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from coordinator.admin import ROUTES, openapi_document
from shared.subjects import Subjects
from tests.integration.coordinator_kit import Worker, block, fast_config, running_coordinator


TOKEN = "openapi-probe-token"
MAX_EXAMPLES = 25
#: The whole run is bounded: the probe itself, and the test around it.
PROBE_TIMEOUT_S = 120


@pytest.fixture
async def stack(database_url: str, nats_url: str, subjects: Subjects) -> AsyncIterator[dict[str, Any]]:
    """A coordinator with one worker, one write lease and four READY blocks."""
    cfg = fast_config(database_url, nats_url, subjects, admin_token=TOKEN)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        try:
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(4)]
            await w.fill(hashes)
            yield {"app": app, "base": base}
        finally:
            await nc.drain()


def _schemathesis() -> list[str]:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()"]


@pytest.mark.timeout(PROBE_TIMEOUT_S + 60)
async def test_schemathesis_finds_no_mismatch(stack: dict[str, Any], tmp_path: Path) -> None:
    base = stack["base"]
    cmd = [*_schemathesis(), "run", f"{base}/openapi.json",
           "--checks", "all",
           "--header", f"Authorization: Bearer {TOKEN}",
           "--max-examples", str(MAX_EXAMPLES),
           "--generation-deterministic", "--no-shrink",
           "--phases", "examples,coverage,fuzzing,stateful",
           "--workers", "1", "--request-timeout", "10",
           "--suppress-health-check", "all",
           "--continue-on-failure", "--no-color", "--output-truncate", "false",
           "--report", "junit", "--report-junit-path", str(tmp_path / "junit.xml")]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"schemathesis did not finish within {PROBE_TIMEOUT_S}s") from None
    text = out.decode(errors="replace")
    elapsed = time.monotonic() - started
    print(text)  # the run's summary, in the test's captured output
    assert proc.returncode == 0, f"schemathesis found mismatches ({elapsed:.1f}s):\n{text}"
    # ...and it did test every operation of the route table (but the document's own: schemathesis
    # leaves out the operation it loaded the schema from), and the stateful phase ran
    tested = {case.get("name") for case in ET.parse(tmp_path / "junit.xml").iter("testcase")}
    expected = {f"{r.method} {r.path}" for r in ROUTES} - {"GET /openapi.json"} | {"Stateful tests"}
    assert tested == expected, (sorted(tested), text)


def test_every_ref_in_the_document_resolves() -> None:
    """msgspec writes ``#/$defs/...``; the document must point into ``#/components/schemas``
    (schemathesis only warns about a dangling ``$ref``, and skips what it cannot resolve)."""
    doc = openapi_document()
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            assert "$defs" not in node
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in doc["components"]["schemas"], ref
    invalidate = doc["paths"]["/v1/invalidate"]["post"]
    assert invalidate["requestBody"]["required"] is True
    assert {"404", "503"} <= set(invalidate["responses"])
