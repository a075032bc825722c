"""Continuity benchmark: how much of a worker's cache survives each control-plane fault.

The measurement issue 11 started from, done as a user of ``kvledger up`` would: a stack with
embedded PostgreSQL and NATS and one worker; ``--prompts`` distinct ~400-token prompts are
warmed on the worker (sent twice: the second reuses), the fault is injected and healed, and
once the worker answers readiness again each prompt is resent *once*:
``cache_retained_pct`` = cached tokens on that first resend ÷ on the resend before the fault.

Faults (each on warm prompts of its own):

* ``control``: nothing, a 3 s wait (the baseline: 100 % expected);
* ``coordinator_kill``: kill -9 the coordinator; ``kvledger up`` restarts it, it replays;
* ``nats_kill``: kill -9 nats-server; ``kvledger up`` restarts it on the same port;
* ``postgres_kill``: kill -9 PostgreSQL; ``kvledger up`` restarts it (crash recovery);
* ``stall_3s`` / ``stall_1_5s``: SIGSTOP the coordinator that long, then SIGCONT;
* ``stall_past_grace``: SIGSTOP past ``coordinator.resume_grace_ms`` (set to 12 s here): the
  fence, 0 % expected;
* ``standby_takeover``: a second stack with ``--coordinators 2``; kill -9 the leader.

    python -m bench.continuity            # 20 prompts per fault
    python -m bench.continuity --quick    # 5 prompts, fewer faults' waits

The last line printed is one JSON object: ``cache_retained_pct_<fault>``,
``recovery_s_<fault>`` (injection → worker ready again) and ``takeover_s`` (leader killed →
standby serving).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from shared.child_process import parent_death_signal

#: coordinator.resume_grace_ms (and lease_ttl_ms) of the benchmark's stacks: short enough that
#: a stall past it fits the run.
GRACE_MS = 12_000


def _log(msg: str) -> None:
    print(f"[continuity] {msg}", file=sys.stderr, flush=True)


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


class Up:
    """``kvledger up`` in a fresh state directory, read through its stack.json."""

    def __init__(self, coordinators: int = 1) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvl-bench-continuity-")
        with open(os.path.join(self.dir, "kvledger.yaml"), "w") as f:
            f.write(f"state_dir: state\ncoordinator:\n  resume_grace_ms: {GRACE_MS}\n  lease_ttl_ms: {GRACE_MS}\n")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvledger.cli", "up", "--config", "kvledger.yaml", "--workers", "1",
             "--coordinators", str(coordinators), "--coordinator-port", "0", "--worker-base-port", "0",
             "--gateway-port", "0", "--quiet"],
            cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            preexec_fn=parent_death_signal(),
            env={**os.environ, "PYTHONPATH": os.getcwd(), "KVL_TORCH_THREADS": "1"})
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if "up; Ctrl-C" in line:
                break
            if "kvledger up: error" in line:
                raise RuntimeError(line.strip())
        else:
            raise RuntimeError(f"kvledger up exited ({self.p.wait()})")
        deadline = time.monotonic() + 30
        while not (urls := self.stack().get("worker_urls")) or not urls[0]:   # written just after "up"
            assert time.monotonic() < deadline, "stack.json names no worker URL"
            time.sleep(0.1)
        self.worker = urls[0].removesuffix("/v1")

    def stack(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.dir, "state", "stack.json")) as f:
                return json.load(f)
        except (OSError, ValueError):   # being rewritten
            return {}

    def pid(self, name: str) -> int | None:
        return next((s["pid"] for s in self.stack().get("services", []) if s["name"] == name), None)

    def leader(self) -> str:
        """The name of the coordinator whose /readyz is 200."""
        for s in self.stack().get("services", []):
            if s["name"].startswith("coordinator") and _http(f"{s['url']}/readyz", timeout_s=2)[0] == 200:
                return s["name"]
        return ""

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def prompts(tag: str, n: int) -> list[str]:
    rng = random.Random(tag)
    words = ["ledger", "cache", "replica", "epoch", "lease", "block", "form", "window", "tail", "index"]
    # NOTE: each starts differently: prompts sharing a first block would reuse each other's
    # fresh blocks after a fence, which is not retention
    return [f"{rng.getrandbits(64):016x} {tag} {i}: " + " ".join(rng.choice(words) for _ in range(60))[:380]
            for i in range(n)]


def cached(up: Up, texts: list[str]) -> int:
    total = 0
    for t in texts:
        status, body = _http(f"{up.worker}/v1/completions", {"prompt": t, "max_tokens": 1, "temperature": 0})
        if status == 200:
            total += int(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return total


def wait_ready(up: Up, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = _http(f"{up.worker}/readyz", timeout_s=2)
        if status == 200 and body.get("status") == "ready":
            return
        time.sleep(0.1)
    raise RuntimeError(f"worker not ready within {timeout_s}s")


def measure(up: Up, name: str, n: int, inject: Any) -> dict[str, float]:
    texts = prompts(name, n)
    cached(up, texts)                     # fill
    time.sleep(0.5)                       # let the commits settle
    before = cached(up, texts)
    t0 = time.monotonic()
    inject(up)
    wait_ready(up)
    ready_s = time.monotonic() - t0
    after = cached(up, texts)
    pct = round(100 * after / before, 1) if before else 0.0
    _log(f"{name}: {after}/{before} cached tokens retained ({pct} %), ready after {ready_s:.1f}s")
    return {f"cache_retained_pct_{name}": pct, f"recovery_s_{name}": round(ready_s, 2),
            f"cached_tokens_before_{name}": before}


def _kill(name: str) -> Any:
    def go(up: Up) -> None:
        pid = up.pid(name)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while up.pid(name) in (None, pid):   # kvledger up restarts it
            assert time.monotonic() < deadline, f"{name} was not restarted"
            time.sleep(0.1)
        time.sleep(1.0)                       # until its clients noticed and came back
    return go


def _stall(seconds: float) -> Any:
    def go(up: Up) -> None:
        pid = up.pid("coordinator")
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.0)
    return go


def _takeover(out: dict[str, float]) -> Any:
    def go(up: Up) -> None:
        leader = up.leader()
        t0 = time.monotonic()
        os.kill(up.pid(leader), signal.SIGKILL)
        while not (now := up.leader()) or now == leader:
            assert time.monotonic() - t0 < 60, "no standby took over"
            time.sleep(0.02)
        out["takeover_s"] = round(time.monotonic() - t0, 2)
        time.sleep(1.0)
    return go


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.continuity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 prompts per fault")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per fault (default 20, 5 with --quick)")
    args = ap.parse_args(argv)
    n = args.prompts or (5 if args.quick else 20)
    if n < 1:
        ap.error("--prompts must be at least 1")
    out: dict[str, Any] = {"prompts_per_fault": n, "resume_grace_ms": GRACE_MS}
    up = Up()
    try:
        for name, inject in (("control", lambda up: time.sleep(3)), ("coordinator_kill", _kill("coordinator")),
                             ("nats_kill", _kill("nats")), ("postgres_kill", _kill("postgres")),
                             ("stall_3s", _stall(3.0)), ("stall_1_5s", _stall(1.5)),
                             ("stall_past_grace", _stall(GRACE_MS / 1000 + 5))):
            out.update(measure(up, name, n, inject))
    finally:
        up.stop()
    up = Up(coordinators=2)
    try:
        out.update(measure(up, "standby_takeover", n, _takeover(out)))
    finally:
        up.stop()
    short = [k for k in out if k.startswith("cache_retained_pct_") and k != "cache_retained_pct_stall_past_grace"]
    out["min_retained_pct_short_faults"] = min(out[k] for k in short)
    out["goal_met"] = out["min_retained_pct_short_faults"] >= 99 and out["cache_retained_pct_stall_past_grace"] == 0
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
