"""The disk writer (``worker.spill.SpillWriter.spill_once``) survives a block whose write fails on its own:
that block is counted, logged without content and dropped; the others are still written."""

from __future__ import annotations

import hashlib

import torch
from structlog.testing import capture_logs

from shared.hashing import checksum
from worker.cache.planner import BlockMeta
from tests.segment_files import records
from tests.twin import InProcessCoordinator


def _meta(engine, tenant: str, n: int, data: torch.Tensor) -> BlockMeta:
    form = sorted(engine.spec_digests)[0]
    h = hashlib.sha256(f"block-{n}".encode()).hexdigest()
    return BlockMeta(namespace=engine.namespace, tenant=tenant, block_hash=h, parent_hash="", token_start=0,
                     token_end=16, form=form, spec_digest=engine.spec_digests[form],
                     checksum=checksum(memoryview(data.numpy())))


async def test_a_block_that_cannot_be_written_does_not_stop_the_spill_loop(make_engine, tmp_path) -> None:
    secret = torch.arange(64, dtype=torch.uint8)
    async with make_engine(InProcessCoordinator(), **{"cache.host_tier_bytes": 0}) as e:
        bad = _meta(e, "..", 1, secret)                 # an unsafe path token: refused before the batch
        good = [_meta(e, "default", n, secret) for n in (2, 3)]
        e.tiers.spill_direct(bad, secret)
        for m in good:
            e.tiers.spill_direct(m, secret)
        with capture_logs() as logs:
            assert await e.flush(timeout=5)             # the queue drains: nothing is stuck at its head
        assert e.tiers.spill_depth == 0
        v = e.metrics.value
        assert v("kvl_worker_offload_failures_total", {"tier": "disk", "reason": "error"}) == 1
        assert sorted(r.header.block_hash for r in records(tmp_path / "offload")) == sorted(m.block_hash for m in good)
        failed = [x for x in logs if x["event"] == "spill_item_failed"]
        assert len(failed) == 1 and failed[0]["error"] == "ValueError"
        assert "'..'" not in repr(logs) and secret.numpy().tobytes() not in repr(logs).encode()
        # and later spills are still written
        later = _meta(e, "default", 4, secret)
        e.tiers.spill_direct(later, secret)
        assert await e.flush(timeout=5)
        assert records(tmp_path / "offload", [later.block_hash])
