"""deploy/smoke.sh's client (the standard library only: it runs on the host's python3).

``--phase before``: completions through the gateway until one reports ``cached_tokens`` > 0 and
gives the first answer again; the audit (replayed from an empty state, workers' inventories
checked) through the admin API must be clean. ``--phase long``: a prompt of about 4,000 tokens
through the gateway, twice — the second is served from the cache (all but its last partial
block) with the same answer, and the worker's pools hold YOCO's forms (``global_kv``, ``swa``).
``--phase after`` (the leader coordinator killed, the standby leading: ``--admin`` is its
address): the same prompt still hits the cache through the gateway, the answer is unchanged,
the audit is clean again. Exits 1 with one line saying what failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

PROMPT = ("kvledger smoke: every block of every form is in the ledger before a worker reuses it. " * 4).strip()
#: ~4,000 tokens (the YOCO checkpoint's tokenizer is byte-level: a token per byte).
LONG_PROMPT = "".join(f"line {i:04d}: block {i * 7919 % 10007:05d} of every form is recorded before reuse.\n"
                      for i in range(64))
LONG_MIN_TOKENS = 3500


def call(url: str, body: dict | None = None, token: str = "", timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(gateway: str, model: str, prompt: str = PROMPT) -> tuple[str, int, str, int]:
    """(text, cached tokens, the worker that answered, prompt tokens) of one greedy completion."""
    req = urllib.request.Request(gateway + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "prompt": prompt, "max_tokens": 8,
                                                  "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=300) as r:
        doc = json.loads(r.read())
        worker = r.headers.get("x-kvl-worker", "?")
    usage = doc["usage"]
    return doc["choices"][0]["text"], usage["prompt_tokens_details"]["cached_tokens"], worker, usage["prompt_tokens"]


def long_context(gateway: str, admin: str, token: str, model: str) -> None:
    """The long prompt twice: cold, then served from the cache with the same answer; YOCO's forms pooled."""
    t0 = time.monotonic()
    first, cached, worker, n = complete(gateway, model, LONG_PROMPT)
    cold = time.monotonic() - t0
    if n < LONG_MIN_TOKENS:
        sys.exit(f"smoke: the long prompt is {n} tokens, expected at least {LONG_MIN_TOKENS}")
    t0 = time.monotonic()
    text, cached, worker, _ = complete(gateway, model, LONG_PROMPT)
    warm = time.monotonic() - t0
    if cached < n - 32:   # all but the last partial block (and the one the answer starts from)
        sys.exit(f"smoke: the long prompt again read {cached} of its {n} tokens from the cache")
    if text != first:
        sys.exit("smoke: the long prompt's cached completion differs from its first one")
    pools = call(admin + "/v1/pools", token=token)["pools"]
    forms = {f: v["used"] for p in pools for f, v in p["forms"].items()}
    if not (forms.get("global_kv") and forms.get("swa")):
        sys.exit(f"smoke: the worker's pools hold no YOCO forms (global_kv and swa): {forms}")
    print(f"smoke: long context: {n} prompt tokens, cold {cold:.1f} s, again {warm:.1f} s with {cached} cached "
          f"(worker {worker}), the same answer; pool slots used {forms}")


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
    ap.add_argument("--phase", choices=("before", "long", "after"), required=True)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    model = call(a.gateway + "/v1/models")["data"][0]["id"]
    if a.phase == "long":
        long_context(a.gateway, a.admin, a.token, model)
        return
    first, cached, worker, _ = complete(a.gateway, model)
    print(f"smoke: completion through the gateway (worker {worker}): cached_tokens {cached}")
    deadline = time.monotonic() + a.timeout
    while True:
        text, cached, worker, _ = complete(a.gateway, model)
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
