"""Stack benchmark: how long `kvledger up` takes to be ready, and to stop.

Runs ``kvledger up --workers N`` (embedded PostgreSQL and NATS in a fresh temporary
state_dir, free ports, ``--quiet``) and reads its output for the phases: services started
and migrated, coordinator ready, every worker ready; then sends SIGTERM and times the
ordered stop (the supervisor also checks that nothing it started survives: ``rc`` 0).

    python -m bench.stack                 # 1 and 2 workers, 2 runs each
    python -m bench.stack --quick         # 1 worker, 1 run

The last line printed is one JSON object (seconds, medians over runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from shared.child_process import parent_death_signal

PHASES = (("services+migrate", "event log schema at revision"), ("coordinator ready", "worker(s) starting"),
          ("all ready", "up; Ctrl-C"))


def one_run(workers: int) -> dict[str, float]:
    d = tempfile.mkdtemp(prefix="kvl-bench-stack-")
    try:
        with open(os.path.join(d, "kvledger.yaml"), "w") as f:
            f.write("state_dir: state\n")
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "up", "--config", "kvledger.yaml",
                              "--workers", str(workers), "--coordinator-port", "0", "--worker-base-port", "0", "--gateway-port", "0",
                              "--quiet"], cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, preexec_fn=parent_death_signal(),
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        out: dict[str, float] = {}
        assert p.stdout is not None
        for line in p.stdout:
            for name, marker in PHASES:
                if marker in line:
                    out[name] = time.monotonic() - t0
            if "all ready" in out or "kvledger up: error" in line:
                break
        t1 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        for _ in p.stdout:
            pass
        out["stop"] = time.monotonic() - t1
        out["rc"] = p.wait(60)
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.stack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one worker, one run")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    counts = (1,) if args.quick else (1, 2)
    runs = 1 if args.quick else args.runs
    result: dict[str, object] = {"cpus": os.cpu_count(), "load_avg_1m_before": round(os.getloadavg()[0], 1)}
    for n in counts:
        samples = [one_run(n) for _ in range(runs)]
        for s in samples:
            print(json.dumps({"workers": n, **{k: round(v, 1) for k, v in s.items()}}), file=sys.stderr)
        result[f"workers_{n}"] = {k: round(statistics.median(s[k] for s in samples), 1)
                                  for k in samples[0] if k != "rc"} | {"rc": max(s["rc"] for s in samples)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
