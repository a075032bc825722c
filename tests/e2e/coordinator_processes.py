"""Coordinator processes for end-to-end tests: started as ``python -m coordinator`` with a config
file, observed over HTTP and their log, and always killed when the test ends."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from shared.child_process import parent_death_signal
from shared.embedded import free_port
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any KVL_* setting (the config file says everything)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


class CoordinatorProcess:
    def __init__(self, name: str, tmp: Path, *, database_url: str = "", nats_url: str = "",
                 subjects: Subjects | None = None, **coordinator: Any) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.config = tmp / f"{name}.yaml"
        self.log = tmp / f"{name}.log"
        doc = {
            "database": {"url": database_url, "connect_timeout_ms": 1000},
            "nats": {"url": nats_url, "subject_prefix": subjects.prefix if subjects else "kvl"},
            "coordinator": {"host": "127.0.0.1", "port": self.port, "heartbeat_interval_ms": 200,
                            "missed_heartbeats": 50, **coordinator},
            "logging": {"format": "json"},
            "state_dir": str(tmp / f"{name}-state"),
        }
        self.config.write_text(yaml.safe_dump(doc))
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> "CoordinatorProcess":
        """Start (or, after it died, start again with the same config, port and log)."""
        assert not self.alive, f"coordinator {self.name} is running"
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "coordinator", "--config", str(self.config)],
                                          cwd=REPO, env=clean_env(), stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=parent_death_signal())
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """kill -9 (works on a stopped process too)."""
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
            assert self.popen is not None
            self.popen.wait(10)

    def terminate(self, timeout_s: float = 20) -> int:
        assert self.popen is not None
        self.signal(signal.SIGTERM)
        return self.popen.wait(timeout_s)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            async with http.get(f"{self.base}/readyz") as r:
                return r.status, await r.json()

    async def wait_status(self, status: str, timeout_s: float = 20) -> dict[str, Any]:
        """Until readyz reports ``status`` (serving, standby, degraded, …)."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            if not self.alive:
                raise AssertionError(f"coordinator {self.name} exited ({self.popen.returncode}):\n"  # type: ignore[union-attr]
                                     f"{self.text()[-3000:]}")
            try:
                code, body = await self.readyz()
                last = body
                if body.get("status") == status:
                    assert (code == 200) == (status == "serving")
                    return body
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = repr(e)
            await asyncio.sleep(0.1)
        raise AssertionError(f"coordinator {self.name} not {status} within {timeout_s}s; last: {last}\n"
                             f"{self.text()[-3000:]}")


@pytest.fixture
def coordinators(tmp_path: Path) -> Iterator[list[CoordinatorProcess]]:
    """Append started processes here; every one is killed at the end, whatever happened."""
    started: list[CoordinatorProcess] = []
    yield started
    for p in started:
        p.kill()
