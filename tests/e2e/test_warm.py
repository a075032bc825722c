"""``kvledger warm`` against a real coordinator, real workers, PostgreSQL and NATS: the prompts an
operator supplies are ranked by the event log's leases of their blocks for the tenant, and the
hottest are prefilled on a new worker, whose next request of that prefix finds it cached."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from tests.e2e.test_gateway import AUTH, KEYS
from tests.worker.processes import running_cluster

SYSTEM = ("You are the ledger's assistant. Every cached block has an owner, a generation and a checksum; "
          "answer from the log. ")
OTHER = "A different preamble, asked about once, that the ledger saw leased but never reused. "
NEVER = "A prompt nobody ever sent: the log has never seen its blocks, so nothing ranks it. "


@pytest.fixture
async def cluster(tmp_path, database_url, nats_url, subjects):
    async with running_cluster(tmp_path, database_url, nats_url, subjects, auth=AUTH) as c:
        yield c


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, tenant: str = "alpha") -> int:
    """Cached prompt tokens of one completion sent to a worker directly."""
    async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


def warm(cluster, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = cluster._write("warm", cluster.base())
    return subprocess.run([sys.executable, "-m", "kvledger", "warm", "--config", str(cfg),
                           "--coordinator-url", f"http://127.0.0.1:{cluster.admin_port}", *args],
                          cwd=cluster.tmp, env=cluster._env(), capture_output=True, text=True, timeout=120)


async def test_warm_prefills_the_hottest_prompts_on_a_new_worker(cluster) -> None:
    cluster.start_coordinator()
    cluster.start_worker("old", worker={"port": 0})
    await cluster.wait_worker("old")
    old = await cluster.http_url("old")
    async with aiohttp.ClientSession() as http:
        # traffic on the old worker: the system prompt four times (three reuse it), the other once
        assert await complete(http, old, SYSTEM + "Question one?") == 0
        for q in ("Question two?", "Question three?", "Question four?"):
            assert await complete(http, old, SYSTEM + q) > 0
        await complete(http, old, OTHER + "Once.")
        await asyncio.sleep(1.0)            # the leases and commits appended to the log
        cluster.start_worker("new", worker={"port": 0})
        await cluster.wait_worker("new")
        new = await cluster.http_url("new")
        prompts = cluster.tmp / "prompts.jsonl"
        prompts.write_text("\n".join(json.dumps(b) for b in (
            {"prompt": NEVER}, {"prompt": OTHER}, {"messages": [{"role": "user", "content": "hello"}]},
            {"prompt": SYSTEM})) + "\n")
        common = ("--worker", "new", "--prompts", str(prompts), "--api-key", KEYS["alpha"],
                  "--database-url", cluster.database_url, "--json")
        # ranked by the log, nothing sent
        dry = warm(cluster, *common, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        rows = json.loads(dry.stdout)["prompts"]
        assert [r["line"] for r in rows][:2] == [4, 2], rows
        assert rows[0]["hit_tokens"] > 0 and rows[0]["outcome"] == "would warm"
        assert rows[1]["hit_tokens"] == 0 and rows[1]["leased_tokens"] > 0
        assert {r["line"]: r["outcome"] for r in rows[2:]} == {1: "cold", 3: "cold"}
        shown = warm(cluster, *common[:-1], "--dry-run")           # the table an operator reads
        assert shown.returncode == 0 and "hit tokens" in shown.stdout and "would warm" in shown.stdout, shown
        # another tenant's key: alpha's history is not its own
        beta = warm(cluster, "--worker", "new", "--prompts", str(prompts), "--api-key", KEYS["beta"],
                    "--database-url", cluster.database_url, "--json", "--dry-run")
        assert beta.returncode == 0, beta.stderr
        assert all(r["leased_tokens"] == 0 for r in json.loads(beta.stdout)["prompts"])
        # the hottest one prefilled on the new worker
        done = warm(cluster, *common, "--top", "1")
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)["prompts"]
        assert (rows[0]["line"], rows[0]["outcome"]) == (4, "warmed")
        assert rows[1]["outcome"] == "not in --top"
        await asyncio.sleep(0.5)
        # the new worker now holds the system prompt; the prompt left out it does not
        assert await complete(http, new, SYSTEM + "Question five?") > 0
        assert await complete(http, new, OTHER + "Twice.") == 0


async def test_warm_refuses_what_it_cannot_do_with_one_line(cluster, tmp_path) -> None:
    cluster.start_coordinator()
    cluster.start_worker("w", worker={"port": 0})
    await cluster.wait_worker("w")
    bad = tmp_path / "bad.jsonl"
    for text, why in (('{"prompt": "a"}\nnot json\n', "bad.jsonl:2: not a JSON object"),
                      ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
                       '{"url": "data:image/png;base64,AA"}}]}]}\n', "image prompts cannot be warmed"),
                      ('{"max_tokens": 3}\n', 'either "prompt"')):
        bad.write_text(text)
        r = warm(cluster, "--worker", "w", "--prompts", str(bad), "--api-key", KEYS["alpha"],
                 "--database-url", cluster.database_url)
        assert r.returncode != 0 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    bad.write_text('{"prompt": "fine"}\n')
    r = warm(cluster, "--worker", "nobody", "--prompts", str(bad), "--api-key", KEYS["alpha"],
             "--database-url", cluster.database_url)
    assert r.returncode != 0 and "worker nobody is not a live worker" in r.stderr, r.stderr
    r = warm(cluster, "--worker", "w", "--prompts", str(bad), "--api-key", "sk-wrong",
             "--database-url", cluster.database_url)
    assert r.returncode != 0 and "--api-key" in r.stderr and "Traceback" not in r.stderr, r.stderr
