"""bench.snapshot on a tiny state: both ways take their snapshots on a real PostgreSQL and every key is reported."""

from __future__ import annotations

import pytest

from bench.snapshot import build_state, rounds
from coordinator.snapshot_child import can_fork


@pytest.mark.skipif(not can_fork(), reason="bench.snapshot needs fork()")
async def test_both_ways_snapshot_and_every_key_is_reported(database_url: str) -> None:
    state = build_state(64, 600)
    out = await rounds(database_url, state, 1)
    for way in ("fork", "in_process"):
        for key in ("stall_ms", "freeze_ms", "seconds"):
            assert out[f"snapshot_{key}_{way}"] > 0, (key, way)
        assert out[f"snapshot_decisions_{way}"] >= 0
    assert out["snapshot_bytes"] > 0
    # whatever the ratio is on a tiny state (the child may well be the slower there), it is the two stalls'
    assert out["snapshot_stall_ratio"] == pytest.approx(
        out["snapshot_stall_ms_in_process"] / out["snapshot_stall_ms_fork"], rel=0.1, abs=0.01)
