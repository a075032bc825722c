"""The audit's worker half against real engines on the coordinator twin: a host tier that
silently loses replicas, GPU copies gone without a transition, and offload files deleted or
damaged behind the ledger's back are reported; a settled engine audits clean."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from coordinator.audit import audit_workers
from coordinator.core.state import LedgerState
from shared.messages import InventoryRequest
from tests.worker.conftest import prompt
from tests.segment_files import flip_header, flip_payload, records, segment_files
from tests.worker.test_engine_tiers import ONE_PROMPT, SMALL
from tests.twin import InProcessCoordinator


class TwinLedger:
    """What :func:`audit_workers` needs of a ledger, over the twin's state."""

    def __init__(self, twin: InProcessCoordinator) -> None:
        self.twin = twin

    @property
    def state(self) -> LedgerState:
        return self.twin.state

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[LedgerState]:
        yield self.twin.state


async def audit(twin: InProcessCoordinator, **kw: Any) -> dict[str, Any]:
    return await audit_workers(TwinLedger(twin), twin.audit_inventory, confirm_s=kw.pop("confirm_s", 0.05), **kw)


async def test_a_host_tier_that_loses_replicas_is_not_clean(make_engine) -> None:
    twin = InProcessCoordinator()
    async with make_engine(twin, **SMALL, **{"cache.host_tier_bytes": 4 * ONE_PROMPT, "cache.offload_dir": ""}) as e:
        for seed in (50, 51, 52):
            await e.generate(prompt(100, seed=seed), max_tokens=1)
        assert await e.flush()
        report = await audit(twin, disk_checks=0)
        assert report["drift"] == {} and report["workers_checked"] == ["w1"], report
        inv = report["inventory"]["w1"]
        assert inv["host:w1"]["worker"] == inv["host:w1"]["ledger_ready"] > 3
        assert inv["gpu:w1"]["worker"] == inv["gpu:w1"]["ledger_ready"] > 0

        # the digests the worker sends are what its items say
        whole = await twin.inventory("w1", request=InventoryRequest(digests=True))
        assert dict(whole.locations) == {"gpu:w1": inv["gpu:w1"]["worker"], "host:w1": inv["host:w1"]["worker"]}

        lost = e.tiers.host_items()[:3]       # gone from host memory, no transition
        for meta in lost:
            assert e.tiers.host_drop(meta.block_hash, meta.form)
        form, _, gone = next(iter(e.store.items()))
        assert e.store.drop(form, gone.block_hash, gone.generation) is not None
        report = await audit(twin, disk_checks=0)
        d = report["drift"]["w1"]
        assert d["tiers"] == {"gpu:w1": {"ledger_only": 1, "worker_only": 0},
                              "host:w1": {"ledger_only": 3, "worker_only": 0}}, d
        listed = {tuple(r) for r in d["missing_on_worker"]["replicas"]}
        assert listed == {(m.block_hash, m.form, "host:w1") for m in lost} | {(gone.block_hash, form, "gpu:w1")}
        assert "unknown_to_ledger" not in d


async def test_offload_files_deleted_or_damaged_are_reported(make_engine, tmp_path) -> None:
    twin = InProcessCoordinator()
    async with make_engine(twin, worker_id="wa", **SMALL, **{"cache.host_tier_bytes": ONE_PROMPT}) as a:
        for seed in (50, 58, 52, 53, 54):
            await a.generate(prompt(100, seed=seed), max_tokens=1)
        assert await a.flush(timeout=10)
        recs = records(tmp_path / "offload")
        blocks = {(r.header.block_hash, r.header.form) for r in recs}
        assert len(blocks) >= 3
        report = await audit(twin, disk_checks=1024)
        assert report["drift"] == {}, report["drift"]
        disk = report["disk"]
        assert disk["worker"] == "wa" and disk["checked"] == disk["ledger_ready"] == len(blocks), disk
        assert "missing" not in disk and "damaged" not in disk

        flip_payload(recs[0])
        flip_header(recs[1])
        report = await audit(twin, disk_checks=1024)
        disk = report["disk"]
        assert "missing" not in disk and disk["damaged"]["count"] == 2, disk
        reasons = {(b, f): why for b, f, *_, why in disk["damaged"]["replicas"]}
        assert "checksum" in reasons[(recs[0].header.block_hash, recs[0].header.form)]
        assert "CRC" in reasons[(recs[1].header.block_hash, recs[1].header.form)]

        for f in segment_files(tmp_path / "offload"):
            f.unlink()
        report = await audit(twin, disk_checks=1024)
        assert report["disk"]["missing"]["count"] == len(blocks), report["disk"]

        report = await audit(twin, disk_checks=1)     # bounded: one file per audit
        assert report["disk"]["checked"] == 1 and report["disk"]["sampled"]
