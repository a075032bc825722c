"""deploy/smoke.sh's client (the standard library only: it runs on the host's python3).

``--phase before``: completions through the gateway until one reports ``cached_tokens`` > 0 and
gives the first answer again; the audit (replayed from an empty state, workers' inventories
checked) through the admin API must be clean. ``--phase after`` (the coordinator restarted):
the same prompt still hits the cache through the gateway, the answer is unchanged, the audit
is clean again. Exits 1 with one line saying what failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

PROMPT = ("kvledger smoke: every block of every form is in the ledger before a worker reuses it. " * 4).strip()


def call(url: str, body: dict | None = None, token: str = "", timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(gateway: str, model: str) -> tuple[str, int, str]:
    """(text, cached tokens, the worker that answered) of one greedy completion."""
    req = urllib.request.Request(gateway + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                  "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        doc = json.loads(r.read())
        worker = r.headers.get("x-kvl-worker", "?")
    return doc["choices"][0]["text"], doc["usage"]["prompt_tokens_details"]["cached_tokens"], worker


def audit(admin: str, token: str) -> None:
    report = call(admin + "/v1/audit", {"replay_from": "empty", "check_workers": True}, token, timeout=120)
    if not report.get("ok"):
        sys.exit(f"smoke: the audit is not clean: {json.dumps(report)[:600]}")
    if not report.get("workers_checked"):
        sys.exit(f"smoke: the audit checked no worker's inventory: {json.dumps(report)[:600]}")
    print(f"smoke: audit clean: {report['replayed_events']} events replayed from empty to position "
          f"{report['position']}, hash match, workers checked {report['workers_checked']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--admin", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--phase", choices=("before", "after"), required=True)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    model = call(a.gateway + "/v1/models")["data"][0]["id"]
    first, cached, worker = complete(a.gateway, model)
    print(f"smoke: completion through the gateway (worker {worker}): cached_tokens {cached}")
    deadline = time.monotonic() + a.timeout
    while True:
        text, cached, worker = complete(a.gateway, model)
        if cached > 0:
            break
        if time.monotonic() > deadline:
            sys.exit(f"smoke: no completion reported cached_tokens > 0 within {a.timeout:.0f} s")
        time.sleep(1)
    if text != first:
        sys.exit("smoke: the cached completion differs from the first one")
    print(f"smoke: cached_tokens {cached} (worker {worker}), the same answer")
    audit(a.admin, a.token)


if __name__ == "__main__":
    try:
        main()
    except urllib.error.HTTPError as e:
        sys.exit(f"smoke: HTTP {e.code} from {e.url}: {e.read()[:300]!r}")
    except (urllib.error.URLError, OSError) as e:
        sys.exit(f"smoke: {e}")
