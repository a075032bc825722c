"""The operator's first hour, as a user drives it: a real ``kvledger up`` in a directory of its own.

* A second ``kvledger`` process started in that directory (or below it) finds the stack through
  ``.kvl-state/stack.json`` — no ``--coordinator-url``, no configuration — and the hint the stack
  printed runs as printed, in a shell without the virtualenv on its PATH.
* ``events`` shows each event's transition (``from → to``).
* Every line of every ``logs/*.log`` file is one JSON object (the children's plain stdout lines
  included), no file passes ``logging.max_bytes``, and one request through the gateway left one
  ``access`` line in the gateway's log and one in the worker's, with the same id, its tenant,
  status and token counts, and nowhere its prompt text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from shared.subjects import Subjects
from tests.e2e.coordinator_processes import REPO, clean_env
from tests.e2e.test_stack_up import UP_READY, UpProcess, still_running, ups, wait_outbox_empty  # noqa: F401

CANARY = "Okapi marmalade is the canary of this prompt. "   # 46 bytes: never in a log
MAX_BYTES = 16384


def kvl(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # a fresh shell: no KVL_* settings, the virtualenv not on PATH
    base = clean_env(**env)
    base["PATH"] = os.pathsep.join(p for p in base.get("PATH", "").split(os.pathsep)
                                   if not p.startswith(str(Path(sys.executable).parent)))
    return subprocess.run([sys.executable, "-m", "kvledger", *args], cwd=cwd, env=base, capture_output=True,
                          text=True, timeout=60)


def fleet(proc: subprocess.CompletedProcess[str]) -> list[tuple[str, int, str]]:
    assert proc.returncode == 0, proc.stderr
    return [(w["worker_id"], w["epoch"], w["endpoint"]) for w in json.loads(proc.stdout)["workers"]]


def test_a_second_process_finds_the_stack_hints_run_and_logs_are_json_lines(
        tmp_path: Path, ups: list[UpProcess], database_url: str, nats_url: str, subjects: Subjects) -> None:
    up = UpProcess(tmp_path, {"state_dir": ".kvl-state", "database": {"url": database_url},
                              "nats": {"url": nats_url, "subject_prefix": subjects.prefix},
                              "worker": {"pool_bytes": 8 * 2**20},
                              "logging": {"level": "info", "max_bytes": MAX_BYTES, "backups": 3}},
                   "--workers", "1", "--quiet")
    up.state = tmp_path / ".kvl-state"
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=180)
    stack = up.stack()
    tree = up.tree()

    # one request through the gateway (the stack's endpoint), with an id to follow it by
    gw = openai.OpenAI(base_url=f"{stack['gateway_url']}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = gw.completions.with_raw_response.create(prompt=CANARY, max_tokens=2, model="kvledger/dsv4-tiny",
                                                  extra_headers={"X-Request-Id": "first-hour-1"})
    assert raw.headers["x-request-id"] == "first-hour-1"
    assert raw.parse().usage.completion_tokens == 2
    wait_outbox_empty(stack["worker_urls"][0])

    # a second process, in a directory below the stack's, with nothing to say where the stack is
    below = tmp_path / "src" / "deep"
    below.mkdir(parents=True)
    mine = kvl("workers", "--json", "--coordinator-url", stack["coordinator_url"], cwd=below)
    found = kvl("workers", "--json", cwd=below)
    assert fleet(found) == fleet(mine)
    [worker] = json.loads(found.stdout)["workers"]
    assert stack["worker_urls"][0] in worker["endpoint"] and worker["alive"]
    # named: from anywhere, by --state-dir or $KVLEDGER_STATE_DIR
    assert fleet(kvl("workers", "--json", "--state-dir", str(up.state), cwd=Path("/"))) == fleet(mine)
    assert kvl("pools", cwd=Path("/"), KVLEDGER_STATE_DIR=str(up.state)).returncode == 0
    gone = kvl("workers", "--state-dir", str(tmp_path / "nothing"), cwd=Path("/"))
    assert gone.returncode == 1 and "no kvledger stack runs with state dir" in gone.stderr

    # the hints, as printed: the first command of the `workers` line, run by a shell in that directory
    out = up.output()
    hints = out[out.index("try:"):].splitlines()
    workers_hint = next(line.strip() for line in hints if line.strip().endswith(" workers"))
    assert workers_hint.split()[0] in ("kvledger", sys.executable) or "/" in workers_hint.split()[0]
    ran = subprocess.run(["bash", "-c", workers_hint], cwd=tmp_path, env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0 and "worker-0" in ran.stdout, ran.stdout + ran.stderr

    # events show their transitions: the table, and --follow's lines
    table = kvl("events", "--limit", "200", cwd=tmp_path)
    assert table.returncode == 0 and "ALLOCATED → READY" in table.stdout, table.stdout[-2000:] + table.stderr
    follow = subprocess.Popen([sys.executable, "-m", "kvledger", "events", "--follow", "--after", "0"], cwd=below,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        seen = ""
        assert follow.stdout is not None
        while "ALLOCATED → READY" not in seen and time.monotonic() < deadline:
            seen = follow.stdout.readline()
        assert "transition.applied" in seen and "ALLOCATED → READY" in seen, seen
    finally:
        follow.send_signal(signal.SIGINT)
        # read what is left: with the pipe full, the interrupted print's flush at exit would
        # block for ever on a reader that stopped reading (seen: wait(10) timed out)
        follow.communicate(timeout=10)

    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(90) == 0, up.output()[-4000:]
    up._reader.join(5)
    assert still_running(tree) == []

    # every line of every log file is one JSON object; none passes the cap
    docs: dict[str, list[dict]] = {}
    for f in sorted((up.state / "logs").iterdir()):
        assert f.stat().st_size <= MAX_BYTES, f
        text = f.read_text()
        assert CANARY.strip() not in text and "Okapi" not in text and "marmalade" not in text, f
        for line in text.splitlines():
            doc = json.loads(line)
            assert isinstance(doc, dict) and "event" in doc, (f, line)
            docs.setdefault(f.name.split(".log")[0], []).append(doc)
    outputs = [d["line"] for d in docs["worker-0"] + docs["gateway"] if d["event"] == "output"]
    assert any(line.startswith("listening on http") for line in outputs)
    access = {name: [d for d in docs[name] if d["event"] == "access" and d.get("id") == "first-hour-1"]
              for name in ("gateway", "worker-0")}
    [g], [w] = access["gateway"], access["worker-0"]
    for a, service in ((g, "gateway"), (w, "worker")):
        assert a["service"] == service and a["status"] == 200 and a["tenant"] == "default"
        assert a["path"] == "/v1/completions" and a["level"] == "info"
        assert (a["prompt_tokens"], a["completion_tokens"]) == (len(CANARY.encode()), 2)
        assert isinstance(a["cached_tokens"], int) and a["duration_ms"] > 0
    assert g["worker"] == "worker-0" and g["failovers"] == 0 and w["fallbacks"] == []
    sizes = {name: len(json.dumps(a)) + 1 for name, a in (("gateway", g), ("worker", w))}
    print(f"access line bytes: {sizes}")
