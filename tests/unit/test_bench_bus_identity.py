"""bench.bus_identity on a tiny scale: both servers answer, the permission-checked path works, the keys are there."""

from __future__ import annotations

import nats
import nats.errors
import pytest

from bench.bus_identity import _first_answer, run
from shared.embedded import EmbeddedNats


async def test_both_paths_answer_and_every_key_is_reported() -> None:
    out = await run(rounds=1, serial=20, piped=200, inflight=8)
    for key in ("plain_serial_p50_ms", "auth_serial_p50_ms", "plain_per_s", "auth_per_s", "auth_connect_ms",
                "plain_connect_ms", "auth_serial_ratio", "auth_throughput_ratio"):
        assert out[key] > 0, key
    assert out["auth_serial_ratio"] == round(out["auth_serial_p50_ms"] / out["plain_serial_p50_ms"], 3)


async def test_a_path_nobody_answers_still_fails(tmp_path) -> None:
    """The first request's retry waits for a responder that is on its way, not for one that never comes."""
    srv = EmbeddedNats(tmp_path / "nats").start()
    try:
        nc = await nats.connect(srv.url, allow_reconnect=False)
        try:
            with pytest.raises(nats.errors.NoRespondersError):
                await _first_answer(nc, "kvlbench.req.w0.acquire", within_s=0.2)
        finally:
            await nc.close()
    finally:
        srv.stop()
