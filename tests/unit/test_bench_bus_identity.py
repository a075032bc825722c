"""bench.bus_identity on a tiny scale: both servers answer, the permission-checked path works, the keys are there."""

from __future__ import annotations

from bench.bus_identity import run


async def test_both_paths_answer_and_every_key_is_reported() -> None:
    out = await run(rounds=1, serial=20, piped=200, inflight=8)
    for key in ("plain_serial_p50_ms", "auth_serial_p50_ms", "plain_per_s", "auth_per_s", "auth_connect_ms",
                "plain_connect_ms", "auth_serial_ratio", "auth_throughput_ratio"):
        assert out[key] > 0, key
    assert out["auth_serial_ratio"] == round(out["auth_serial_p50_ms"] / out["plain_serial_p50_ms"], 3)
