"""The coordinator's status page (``/ui``) rendered by headless Chromium, as an operator's browser
renders it, against a real coordinator (PostgreSQL, NATS), a real worker engine on the tiny model
(in this process, over NATS: its heartbeats carry its cache counters) and a protocol-level second
worker. Every number the page shows is compared with what the admin API returns.

Chromium runs with ``--dump-dom`` (the DOM after the page's scripts ran) and a virtual-time budget
that covers the first refresh; no driver, no download. It is Debian's ``chromium`` package, which
``.ci/run`` installs when it is missing (and then sets ``KVL_TEST_REQUIRE_CHROMIUM``, so CI fails
rather than skips); elsewhere these tests skip without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
from collections.abc import AsyncIterator
from decimal import ROUND_HALF_UP, Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
import torch
from aiohttp import web

from coordinator.app import create_app
from shared.config import parse_config
from shared.hashing import chain_hashes
from shared.messages import RouteQuery, RouteReply, decode, encode
from shared.subjects import Subjects
from tests.integration.coordinator_kit import Worker, block, fast_config, running_coordinator, wait_ready
from worker.client.nats_adapter import NatsCoordinatorClient
from worker.engine import Engine
from worker.model import build_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("KVL_TEST_REQUIRE_CHROMIUM", "") not in ("", "0")
pytestmark = pytest.mark.skipif(CHROMIUM is None and not REQUIRED,
                                reason="needs Debian's chromium (apt-get install chromium)")

TOKEN = "status-page-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BS = 16
#: Network-supplied text the page must show as text (a drain reason reaches the event list).
HOSTILE = '<img src=x onerror="document.title=\'pwned\'"><script>document.title="pwned"</script>'
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


async def render(url: str, profile: Path, budget_ms: int = 2500) -> str:
    """The page's DOM after its scripts ran (``budget_ms`` of virtual time: one refresh and more)."""
    assert CHROMIUM, "chromium is not installed (apt-get install chromium)"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-extensions", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
        "--dump-dom", url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError("chromium did not finish within 60 s") from None
    assert proc.returncode == 0 and out, err.decode(errors="replace")[-2000:]
    return out.decode()


class Dom(HTMLParser):
    """What a test reads from a dumped page: the text of every element with an ``id`` or a
    ``data-k`` (with its ``data-*``), every tag, and ``<body>``'s attributes."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.ids: dict[str, str] = {}
        self.hidden: set[str] = set()
        self.cells: list[dict[str, str]] = []
        self.body: dict[str, str] = {}
        self._open: list[tuple[str, dict[str, str], list[str]]] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append(tag)
        if tag == "body":
            self.body = a
        if tag == "title":
            a = {**a, "id": "title"}
        if "id" in a and "hidden" in a:
            self.hidden.add(a["id"])
        if tag not in VOID and ("id" in a or "data-k" in a):
            self._open.append((tag, a, []))

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1][0] == tag:
            _, a, text = self._open.pop()
            value = "".join(text).strip()
            if "data-k" in a:
                self.cells.append({**{k[5:]: v for k, v in a.items() if k.startswith("data-")}, "text": value})
            if "id" in a:
                self.ids[a["id"]] = value

    def handle_data(self, data: str) -> None:
        for _, _, text in self._open:
            text.append(data)

    def rows(self, key: str) -> dict[str, dict[str, str]]:
        """``{value of data-<key>: {data-k: text}}`` for the cells that carry ``data-<key>``."""
        out: dict[str, dict[str, str]] = {}
        for c in self.cells:
            if key in c:
                out.setdefault(c[key], {})[c["k"]] = c["text"]
        return out


def pct(x: float | None) -> str:
    """JavaScript's ``(x * 100).toFixed(1) + " %"``: the exact binary value, ties away from zero."""
    if x is None:
        return "–"
    return f"{Decimal(x * 100).quantize(Decimal('0.1'), rounding=ROUND_HALF_UP)} %"


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
async def stack(database_url: str, nats_url: str, subjects: Subjects, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, Any]]:
    """A coordinator with a token; worker ``w1`` (the engine) served three requests — a miss, a
    full hit, and a hit whose block 3 failed validation (a fallback) — and worker ``w2`` (the
    protocol alone) holds two READY blocks in its two slots (100 %) and was drained with a hostile
    reason; gateway ``gw-a`` asked for a route once."""
    monkeypatch.delenv("KVL_ADMIN_TOKEN", raising=False)
    torch.set_num_threads(1)
    # heartbeats every 200 ms; w2 sends none after registering, and must stay live meanwhile
    cfg = fast_config(database_url, nats_url, subjects, admin_token=TOKEN, missed_heartbeats=300)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        engine = Engine(build_model(seed=0), parse_config({
            "nats": {"url": nats_url, "subject_prefix": subjects.prefix},
            "coordinator": {"heartbeat_interval_ms": 200},
            "cache": {"chunk_blocks": 1, "host_tier_bytes": 0},
            "worker": {"worker_id": "w1", "pool_bytes": 4 * 2**20}, "state_dir": str(tmp_path / "w1")}),
            NatsCoordinatorClient(nats_url, subjects))
        http = aiohttp.ClientSession(headers=AUTH)
        try:
            await engine.start()
            w2 = Worker(nc, subjects, worker_id="w2", slots=2)     # full: its pool is drawn red
            await w2.register()
            await w2.watch_watermarks()
            await w2.release((await w2.fill([block(0), block(1)])).lease_id)
            # a gateway asks for the fleet once: the page lists it
            reply = decode((await nc.request(subjects.route("gw-a"), encode(RouteQuery(gateway_id="gw-a")), timeout=5)).data)
            assert isinstance(reply, RouteReply), reply

            toks = prompt(100, seed=7)                      # 6 whole blocks
            assert (await engine.generate(toks, max_tokens=1)).cached_tokens == 0
            await engine.flush()
            assert (await engine.generate(toks, max_tokens=1)).cached_tokens == 6 * BS
            h3 = chain_hashes(toks, BS, engine.namespace, engine.salt("default"))[3]
            slot, _ = engine.store.pools["compressed"].lookup(h3)
            engine.store.pools["compressed"].storage[slot][5] ^= 0x40   # a bit flip: integrity fails
            r = await engine.generate(toks, max_tokens=1)
            assert r.cached_tokens == 3 * BS and "validation" in r.fallbacks
            assert await engine.flush()
            async with http.post(f"{base}/v1/workers/w2/drain", json={"reason": HOSTILE}) as resp:
                assert resp.status == 200, await resp.text()
            for _ in range(100):   # the engine releases its leases in the background
                async with http.get(f"{base}/v1/leases") as resp:
                    if not (await resp.json())["leases"]:
                        break
                await asyncio.sleep(0.05)

            # the engine's counters reach the coordinator with its next heartbeat
            own = engine.metrics.cache_counters()
            assert (own.queried, own.hits, own.validated, own.fallbacks) == (300, 192, 144, {"validation": 1})
            reported: Any = None
            for _ in range(100):
                async with http.get(f"{base}/v1/summary") as resp:
                    reported = [(w["queried_tokens"], w["hit_tokens"], w["validated_tokens"], w["fallbacks"])
                                for w in (await resp.json())["cache"]["by_worker"]]
                if reported == [(own.queried, own.hits, own.validated, own.fallbacks)]:
                    break
                await asyncio.sleep(0.05)
            assert reported == [(own.queried, own.hits, own.validated, own.fallbacks)]
            yield {"base": base, "http": http, "engine": engine}
        finally:
            await http.close()
            await engine.stop()
            await nc.drain()


async def api(s: dict[str, Any]) -> dict[str, Any]:
    """Everything the page reads, as the API answers it now."""
    async def get(path: str) -> Any:
        async with s["http"].get(s["base"] + path) as r:
            assert r.status == 200, await r.text()
            return await r.json()
    summary = await get("/v1/summary")
    pools = await get("/v1/pools")
    return {"summary": summary, "workers": (await get("/v1/workers"))["workers"],
            "pools": pools["pools"], "tiers": pools["tiers"],
            "events": (await get(f"/v1/events?after={max(0, summary['position'] - 200)}&limit=200"))["events"]}


async def test_the_page_shows_what_the_api_returns(stack: dict[str, Any], tmp_path: Path) -> None:
    before = await api(stack)
    dom = Dom(await render(f"{stack['base']}/ui#token={TOKEN}", tmp_path / "profile"))
    after = await api(stack)
    # nothing happened meanwhile (no request, no heartbeat-driven decision): one state to compare with
    assert after["summary"]["position"] == before["summary"]["position"]
    assert after["summary"]["cache"] == before["summary"]["cache"]
    want = after
    cache = want["summary"]["cache"]

    assert dom.body.get("data-state") == "ok", dom.ids.get("status")
    assert dom.ids["status"].startswith("updated at ") and "auth" in dom.hidden
    assert dom.ids["leader"] == (f"leader epoch {want['summary']['leader_epoch']}, log position "
                                 f"{want['summary']['position']}, reuse on")

    # the cache: tiles, per worker, fallbacks — and the worker's own counters are what the API says
    own = stack["engine"].metrics.cache_counters()
    assert (cache["queried_tokens"], cache["hit_tokens"], cache["validated_tokens"], cache["reporting"]) == (
        own.queried, own.hits, own.validated, 1)
    assert cache["hit_rate"] == 192 / 300 and cache["validated_hit_rate"] == 144 / 300
    for k in ("hit_rate", "validated_hit_rate"):
        assert dom.ids[k] == pct(cache[k]), k
    for k in ("queried_tokens", "hit_tokens", "validated_tokens", "reporting"):
        assert dom.ids[k] == str(cache[k]), k
    reporters = dom.rows("reporter")
    assert set(reporters) == {w["worker_id"] for w in cache["by_worker"]} == {"w1"}
    for w in cache["by_worker"]:
        row = {k: reporters[w["worker_id"]][k] for k in ("queried_tokens", "hit_tokens", "validated_tokens",
                                                      "hit_rate", "validated_hit_rate", "fallbacks")}
        assert row == {"queried_tokens": str(w["queried_tokens"]), "hit_tokens": str(w["hit_tokens"]),
                       "validated_tokens": str(w["validated_tokens"]), "hit_rate": pct(w["hit_rate"]),
                       "validated_hit_rate": pct(w["validated_hit_rate"]),
                       "fallbacks": str(sum(w["fallbacks"].values()))}
    fallbacks = {reason: row["count"] for reason, row in dom.rows("reason").items()}
    assert fallbacks == {r: str(n) for r, n in cache["fallbacks"].items()} == {"validation": "1"}

    # workers: both, with the API's epoch, state, draining, leases and endpoint
    workers = dom.rows("worker")
    assert set(workers) == {w["worker_id"] for w in want["workers"]} == {"w1", "w2"}
    for w in want["workers"]:
        row = workers[w["worker_id"]]
        assert (row["epoch"], row["state"], row["draining"], row["leases"], row["endpoint"]) == (
            str(w["epoch"]), "live", "yes" if w["draining"] else "no", str(w["leases"]), w["endpoint"])
        assert re.fullmatch(r"\d+\.\d s ago", row["liveness"]), row["liveness"]
        assert (row["model"], row["device"], row["dtype"], row["cache_dtype"]) == (
            w["model_id"], w["device"] or "–", w["dtype"] or "–", w["cache_dtype"] or "–")
    engine = stack["engine"]
    assert workers["w1"]["device"] == "cpu" == str(engine.device) and workers["w1"]["dtype"] == "float32"
    assert workers["w1"]["model"] == engine.catalogue.model_id and workers["w2"]["device"] == "–"
    assert workers["w2"]["draining"] == "yes" and workers["w1"]["draining"] == "no"
    assert dom.ids["worker_counts"] == "2 live, 0 suspended, 0 lost, 1 draining"

    # pools per worker and form
    pools: dict[tuple[str, str], dict[str, str]] = {}
    for c in dom.cells:
        if "pool" in c:
            pools.setdefault((c["pool"], c["form"]), {"severity": c["severity"]})[c["k"]] = c["text"]
    assert set(pools) == {(p["worker_id"], form) for p in want["pools"] for form in p["forms"]}
    assert len(pools) > 1
    for p in want["pools"]:
        for form, f in p["forms"].items():
            row = pools[(p["worker_id"], form)]
            assert (row["used"], row["limit"], row["usage"]) == (str(f["used"]), str(f["limit"]), pct(f["usage"]))
            t = want["summary"]["thresholds"]
            assert row["severity"] == ("sev-crit" if f["usage"] >= t["critical"] else
                                       "sev-warn" if f["usage"] >= t["warn"] else "sev-ok"), (p["worker_id"], form)
    assert any(f["used"] for p in want["pools"] for f in p["forms"].values())
    assert pools[("w2", "compressed")]["severity"] == "sev-crit" and pools[("w2", "compressed")]["usage"] == "100.0 %"
    assert {r["severity"] for r in pools.values()} >= {"sev-crit", "sev-ok"}
    assert pools[("w1", next(iter(want["pools"][0]["forms"])))]["worker_id"] == "device:w1 (cpu)"

    # every tier the ledger holds replicas in, named by the worker's device, and the gateway
    tiers = {(c["tier"], c["place"]): c["text"] for c in dom.cells if c["k"] == "replicas"}
    assert tiers == {(tier, place): str(n) for tier, places in want["tiers"].items()
                     for place, n in (places or {"": 0}).items()}
    assert {tier for tier, _ in tiers} == {"device", "host", "disk"} and tiers[("host", "")] == "0"
    assert tiers[("device", "w2")] == "2" and ("device", "w1") in tiers
    gateways = dom.rows("gateway")
    assert set(gateways) == {"gw-a"} and re.fullmatch(r"\d+\.\d s ago", gateways["gw-a"]["last_route"])

    # the latest events grouped by stream (one request's commits are one row), newest first; the
    # hostile drain reason among them as text; replicas named by tier, never "gpu:" on a CPU worker
    streams: dict[str, list[dict[str, Any]]] = {}
    for e in want["events"]:
        src = {**(e["event"].get("transition") or {}), **e["event"]}
        streams.setdefault(f"lease:{src['lease_id']}" if src.get("lease_id") else e["stream_id"], []).append(e)
    order = sorted(streams, key=lambda k: -streams[k][-1]["position"])[:20]
    groups = dom.rows("stream")
    assert list(groups) == order and len(want["events"]) > len(groups)
    for sid in order:
        assert (groups[sid]["count"], groups[sid]["position"]) == (str(len(streams[sid])), str(streams[sid][-1]["position"]))
        assert groups[sid]["types"] == ", ".join(sorted({e["type"] for e in streams[sid]}))
    assert max(int(g["count"]) for g in groups.values()) > 1
    drained = next(row for row in groups.values() if "worker.draining" in row["types"].split(", "))
    assert drained["detail"] == f"worker_id=w2 epoch={workers['w2']['epoch']} reason={HOSTILE[:120]}"
    assert not any("gpu:" in g["detail"] or "gpu:" in g["stream"] for g in groups.values())
    assert max(int(g["count"]) for g in groups.values()) >= 6     # a request's commits: one row
    assert any("location=device:w1 (cpu)" in g["detail"] for g in groups.values())
    assert "img" not in dom.tags and dom.tags.count("script") == 1 and dom.ids["title"] == "kvledger status"


@pytest.fixture
async def leader(database_url: str, nats_url: str, subjects: Subjects,
                 monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, Any]]:
    """A coordinator with a token, and nothing else."""
    monkeypatch.delenv("KVL_ADMIN_TOKEN", raising=False)
    cfg = fast_config(database_url, nats_url, subjects, admin_token=TOKEN)
    async with running_coordinator(cfg) as (_, base):
        yield {"base": base, "cfg": cfg}


async def test_without_the_token_the_page_asks_for_it(leader: dict[str, Any], tmp_path: Path) -> None:
    dom = Dom(await render(f"{leader['base']}/ui", tmp_path / "profile"))
    assert dom.body.get("data-state") == "auth" and "auth" not in dom.hidden
    assert dom.ids["auth-error"] == "admin API: send 'Authorization: Bearer <token>'"
    assert dom.ids["hit_rate"] == "–" and dom.ids["leader"] == "" and not dom.cells


async def test_a_coordinator_that_cannot_answer_shows_an_error(leader: dict[str, Any], tmp_path: Path) -> None:
    """A standby (another coordinator leads) serves the page but not the data: the page says so."""
    async with running_coordinator(leader["cfg"], ready=False) as (_, standby):
        await wait_ready(standby, want=503)
        dom = Dom(await render(f"{standby}/ui#token={TOKEN}", tmp_path / "profile"))
    assert dom.body.get("data-state") == "error"
    assert dom.ids["status"].startswith("the coordinator does not answer: coordinator is standby")
    assert "last update: never" in dom.ids["status"]


def _non_loopback_address() -> str | None:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        try:
            s.connect(("192.0.2.254", 9))   # no packet is sent: this only picks the outbound interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


async def test_without_a_token_only_loopback_clients_get_the_page(database_url: str, nats_url: str,
                                                                  subjects: Subjects,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    monkeypatch.delenv("KVL_ADMIN_TOKEN", raising=False)
    app = create_app(fast_config(database_url, nats_url, subjects))
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        loop_site, far_site = web.TCPSite(runner, "127.0.0.1", 0), web.TCPSite(runner, addr, 0)
        await loop_site.start()
        await far_site.start()
        near = f"http://127.0.0.1:{loop_site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001 - the bound port
        far = f"http://{addr}:{far_site._server.sockets[0].getsockname()[1]}"       # noqa: SLF001
        await wait_ready(near)
        async with aiohttp.ClientSession() as http:
            for path in ("/ui", "/v1/summary"):
                async with http.get(near + path) as r:
                    assert r.status == 200, path
                async with http.get(far + path) as r:
                    assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized", path
            async with http.get(near + "/ui") as r:
                csp = r.headers["Content-Security-Policy"]
                assert r.content_type == "text/html" and "default-src 'none'" in csp and "connect-src 'self'" in csp
    finally:
        await runner.cleanup()


#: The page's severity colours (``coordinator.ui._STYLE``): what an operator sees first.
CRIT, OK = (0xd5, 0x00, 0x00), (0xc8, 0xe6, 0xc9)


async def screenshot(url: str, profile: Path, out: Path, budget_ms: int = 2500) -> None:
    assert CHROMIUM, "chromium is not installed (apt-get install chromium)"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-extensions", "--force-color-profile=srgb", "--window-size=1400,2200",
        f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", f"--screenshot={out}", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError("chromium did not finish within 60 s") from None
    assert proc.returncode == 0 and out.exists(), err.decode(errors="replace")[-2000:]


async def test_a_full_pool_is_drawn_red_and_a_quiet_one_green(stack: dict[str, Any], tmp_path: Path) -> None:
    """The screenshot an operator's browser would show: w2's pool at 100 % in the red of
    ``sev-crit``, w1's few used slots in the green of ``sev-ok``; and the DOM says which is which."""
    from PIL import Image

    url = f"{stack['base']}/ui#token={TOKEN}"
    html = await render(url, tmp_path / "profile-dom")
    classes = re.findall(r'<td data-k="usage" data-pool="([^"]+)" data-form="[^"]+" data-severity="[^"]+" '
                         r'class="n (sev-\w+)"', html)
    assert ("w2", "sev-crit") in classes and ("w1", "sev-ok") in classes, classes
    # the event filter offers every type the window holds (and "every type", selected)
    want = await api(stack)
    options = re.findall(r'<option value="([^"]*)"[^>]*>', html)
    assert options == ["", *sorted({e["type"] for e in want["events"]})], options
    png = tmp_path / "status.png"
    await screenshot(url, tmp_path / "profile-shot", png)
    img = Image.open(png).convert("RGB")
    assert img.size == (1400, 2200)
    raw = img.tobytes()
    pixels = [tuple(raw[i:i + 3]) for i in range(0, len(raw), 3)]
    counts = {name: sum(1 for p in pixels if max(abs(a - b) for a, b in zip(p, rgb)) <= 8)
              for name, rgb in (("crit", CRIT), ("ok", OK))}
    # a cell's background is some hundreds of pixels; a page that never rendered has none
    assert counts["crit"] > 300 and counts["ok"] > 300, counts
    assert len(set(pixels[::7])) > 50, "a blank or single-colour screenshot"
