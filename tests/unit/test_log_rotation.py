"""The log files of ``kvledger up``: one JSON object per line whatever a child prints, rotated at
``logging.max_bytes`` with ``logging.backups`` files kept (``shared.logging.JsonLinesFile``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvledger.stack.child import Child
from kvledger.stack.console import Console
from shared.config import parse_config
from shared.logging import MAX_OUTPUT_CHARS, JsonLinesFile, as_json_line


def parse_all(files: list[Path]) -> list[dict]:
    docs = []
    for f in files:
        for line in f.read_text().splitlines():
            doc = json.loads(line)          # every line, of every file, is one JSON object
            assert isinstance(doc, dict)
            docs.append(doc)
    return docs


def test_plain_lines_become_output_records_and_json_lines_stay() -> None:
    js = '{"event": "registered", "level": "info", "worker_id": "w"}'
    assert as_json_line(js + "\n", "worker-0") == js
    doc = json.loads(as_json_line("listening on http://127.0.0.1:8400\n", "worker-0"))
    assert doc["event"] == "output" and doc["line"] == "listening on http://127.0.0.1:8400"
    assert doc["logger"] == "worker-0" and doc["level"] == "info" and doc["timestamp"].endswith("Z")
    for odd in ("[1, 2]", "{not json", "", "Traceback (most recent call last):"):
        assert json.loads(as_json_line(odd, "x"))["line"] == odd
    assert json.loads(as_json_line("nats://kvl:s3cret@h:4222", "x"))["line"] == "nats://kvl:***@h:4222"
    long = json.loads(as_json_line("x" * (MAX_OUTPUT_CHARS + 100), "x"))["line"]
    assert long.startswith("x" * MAX_OUTPUT_CHARS) and long.endswith("<100 more chars>")


def test_rotation_happens_at_the_cap_and_keeps_a_bounded_number_of_files(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "worker-0.log"
    log = JsonLinesFile(path, max_bytes=4096, backups=3, logger="worker-0")
    line = json.dumps({"event": "tick", "level": "info", "n": 0, "pad": "p" * 80})
    per_line = len(line) + 1
    n = 4096 // per_line          # lines that fit in one file
    for i in range(n):
        log.write(json.dumps({"event": "tick", "level": "info", "n": i, "pad": "p" * 80}))
    assert not (tmp_path / "logs" / "worker-0.log.1").exists()      # below the cap: one file
    log.write(json.dumps({"event": "tick", "level": "info", "n": n, "pad": "p" * 80}))
    assert (tmp_path / "logs" / "worker-0.log.1").exists()          # the line that would pass it rotated
    for i in range(n + 1, 20 * n):
        log.write(json.dumps({"event": "tick", "level": "info", "n": i, "pad": "p" * 80}))
    log.close()
    files = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert files == ["worker-0.log", "worker-0.log.1", "worker-0.log.2", "worker-0.log.3"]
    for f in (tmp_path / "logs").iterdir():
        assert f.stat().st_size <= 4096
    ordered = [path.with_name(f"worker-0.log.{k}") for k in (3, 2, 1)] + [path]
    ns = [d["n"] for d in parse_all(ordered)]
    assert ns == list(range(20 * n - len(ns), 20 * n))                # the newest, whole and in order


def test_a_child_process_output_is_json_lines_rotated(tmp_path: Path) -> None:
    """A real child printing plain lines, JSON lines and a traceback, through the stack's Child."""
    script = ("import json, sys\n"
              "print('listening on http://127.0.0.1:1', flush=True)\n"
              "for i in range(300):\n"
              "    print(json.dumps({'event': 'tick', 'level': 'info', 'n': i}), flush=True)\n"
              "print('kvledger worker w running', flush=True)\n"
              "raise SystemExit('boom: a plain line on stderr')\n")
    cfg = parse_config({"logging": {"max_bytes": 4096, "backups": 2}})
    log_path = tmp_path / "logs" / "w.log"
    child = Child("w", [sys.executable, "-c", script], {}, log_path, Console(), "cyan", False,
                  max_bytes=cfg.logging.max_bytes, backups=cfg.logging.backups)
    child.start()
    assert child.url_seen.wait(30) and child.url == "http://127.0.0.1:1"
    child.popen.wait(30)
    child.stop(5)
    child.note("process_exited", "error", exit_code=child.returncode)
    files = [log_path.with_name("w.log.2"), log_path.with_name("w.log.1"), log_path]
    assert all(f.exists() for f in files) and not log_path.with_name("w.log.3").exists()
    assert all(f.stat().st_size <= 4096 for f in files)
    docs = parse_all(files)
    assert docs[-1]["event"] == "process_exited" and docs[-1]["logger"] == "kvledger.up"
    outputs = [d for d in docs if d["event"] == "output"]
    assert [d["line"] for d in outputs[-2:]] == ["kvledger worker w running", "boom: a plain line on stderr"]
    assert outputs[-1]["level"] == "info" or outputs[-1]["level"] == "error"
