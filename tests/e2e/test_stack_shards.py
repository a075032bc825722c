"""`kvledger up --shards 2`: two ledger shards on the embedded PostgreSQL (a database each) and
NATS, each shard's coordinator under its own identity, a worker that is a member of both, and the
gateway. Prompts sent through the gateway land on both shards' chains; each is served again from
the cache; each shard's audit and the fleet audit are clean; SIGTERM stops everything."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import openai

from tests.e2e.test_stack_up import UP_READY, UpProcess, kvledger, ups, wait_outbox_empty  # noqa: F401 - fixture

#: Twelve prompts of three or more whole blocks: with 256 partitions split between two shards, both
#: get some (all on one shard: 2 in 4,096).
PROMPTS = [f"Request {i:02d} asks the ledger for blocks of its own chain, then again. " for i in range(12)]


def _ready_blocks(coordinator_url: str) -> int:
    with urllib.request.urlopen(f"{coordinator_url}/v1/blocks?state=READY&limit=1000", timeout=10) as r:
        return len(json.load(r)["replicas"])


def test_up_with_two_shards_serves_and_reuses_chains_of_both(tmp_path: Path, ups: list[UpProcess]) -> None:
    up = UpProcess(tmp_path, {"worker": {"pool_bytes": 16 * 2**20}, "cache": {"chunk_blocks": 1}},
                   "--shards", "2")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=240)
    stack = up.stack()
    names = [s["name"] for s in stack["services"]]
    assert names == ["postgres", "nats", "coordinator", "coordinator-s1", "worker-0", "gateway"], names
    shard_urls = stack["coordinator_urls"]
    assert len(shard_urls) == 2
    (worker_url,) = stack["worker_urls"]
    # through the gateway, which asks each prompt's route of the shard owning its chain
    client = openai.OpenAI(base_url=f"{stack['gateway_url']}/v1", api_key="unused", max_retries=0, timeout=60)
    first = {}
    for p in PROMPTS:
        r = client.completions.create(model="kvledger/dsv4-tiny", prompt=p, max_tokens=2, temperature=0)
        first[p] = r.choices[0].text
    wait_outbox_empty(worker_url)
    assert all(_ready_blocks(u) > 0 for u in shard_urls), "both shards hold chains"
    for p in PROMPTS:
        r = client.completions.create(model="kvledger/dsv4-tiny", prompt=p, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens >= 48 and r.choices[0].text == first[p]
    wait_outbox_empty(worker_url)
    audit = kvledger("audit", "--json", *(a for u in shard_urls for a in ("--shard-url", u)), timeout=120)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(90) == 0, up.output()[-4000:]
