"""`kvledger up` with two gateway replicas (issue 54, item 6).

``gateway.replicas: 2`` runs ``gateway`` and ``gateway-1``, each on its own port and as its own
NATS user (a route query is answered only on its sender's subject). Both route by the same view,
the ledger's block locations asked of the coordinator: a prompt sent through replica A once is
sent through replica B — which never saw it — to the worker A chose, for the reason ``cache``,
and is served from that cache. SIGTERM stops everything, both gateways included.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path
from typing import Any

from tests.e2e.test_stack_up import UP_READY, UpProcess, kvledger, still_running, ups, wait_outbox_empty  # noqa: F401

PROMPT = "Two gateways, one ledger: the prefix goes home. "  # 48 bytes: three full 16-token blocks


def complete(gateway_url: str, prompt: str) -> tuple[dict[str, Any], Any]:
    """(answer, headers) of one greedy completion through ``gateway_url``."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{gateway_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read()), r.headers


def test_two_gateway_replicas_send_a_prefix_to_the_worker_that_holds_it(tmp_path: Path,
                                                                         ups: list[UpProcess]) -> None:  # noqa: F811
    up = UpProcess(tmp_path, {"worker": {"pool_bytes": 8 * 2**20}, "cache": {"chunk_blocks": 1},
                              "gateway": {"replicas": 2}}, "--workers", "2")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=240)
    stack = up.stack()
    names = [s["name"] for s in stack["services"]]
    assert names[-2:] == ["gateway", "gateway-1"], names
    a, b = stack["gateway_urls"]
    assert a == stack["gateway_url"] and a != b
    assert (up.state / "nats" / "credentials").is_dir()   # embedded NATS: every gateway its own user

    first, head_a = complete(a, PROMPT)
    home = head_a["x-kvl-worker"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for w in stack["worker_urls"]:   # the blocks are in the ledger before B asks for them
        wait_outbox_empty(w)

    again, head_b = complete(b, PROMPT)
    assert head_b["x-kvl-worker"] == home, (head_a, head_b)
    assert head_b["x-kvl-route"].startswith("cache;"), head_b["x-kvl-route"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    tree = up.tree()
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(90) == 0, up.output()[-4000:]
    up._reader.join(5)
    assert still_running(tree) == []


def test_gateways_out_of_range_is_refused_before_anything_starts() -> None:
    bad = kvledger("up", "--gateways", "0")
    assert bad.returncode != 0 and "--gateways must be 1 to 16" in bad.stderr, bad.stderr
