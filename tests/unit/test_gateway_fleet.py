"""The gateway's fleet view across the coordinator's answers (its NATS side replaced by canned
route replies: what is under test is what the view keeps)."""

from __future__ import annotations

import asyncio

from gateway.app import Gateway
from shared import messages as m
from shared.config import Config, GatewayConfig

NS = "ab" * 16


def cand(wid: str, **kw) -> m.RouteCandidate:
    return m.RouteCandidate(worker_id=wid, endpoint=f"http://{wid}", namespace=NS, block_size=16, **kw)


async def test_an_unlisted_worker_stays_a_last_resort_for_the_grace_then_leaves() -> None:
    gw = Gateway(Config(gateway=GatewayConfig(unlisted_grace_ms=50)), None, None)  # type: ignore[arg-type]
    answers = [m.RouteReply(workers=[cand("w1", running=2, queued=1), cand("w2"), cand("w3", draining=True)]),
               m.RouteReply(workers=[cand("w1")]), m.RouteReply(workers=[cand("w1")])]

    async def ask(query, timeout_s):
        return answers.pop(0)

    gw._ask = ask  # type: ignore[method-assign]
    assert await gw.refresh_fleet()
    assert {w.worker_id: w.reported_load for w in gw.fleet} == {"w1": 3, "w2": 0, "w3": 0}
    # w2 and the draining w3 vanish from the answer: w2 stays, suspended (last resort); w3 does not
    assert await gw.refresh_fleet()
    assert {w.worker_id: w.suspended for w in gw.fleet} == {"w1": False, "w2": True}
    choices, _ = await gw.route(None, "default")
    assert [c.worker.worker_id for c in choices] == ["w1", "w2"]
    await asyncio.sleep(0.06)
    assert await gw.refresh_fleet()
    assert [w.worker_id for w in gw.fleet] == ["w1"]


async def test_a_failed_refresh_keeps_the_last_view_and_the_gateway_ready() -> None:
    gw = Gateway(Config(), None, None)  # type: ignore[arg-type]
    answers: list = [m.RouteReply(workers=[cand("w1", suspended=True)]), None]

    async def ask(query, timeout_s):
        return answers.pop(0)

    gw._ask = ask  # type: ignore[method-assign]
    assert not gw.ready                                   # no view yet
    assert await gw.refresh_fleet() and gw.ready          # suspended workers still serve
    assert not await gw.refresh_fleet()                   # the coordinator did not answer
    assert gw.ready and [w.worker_id for w in gw.fleet] == ["w1"]
