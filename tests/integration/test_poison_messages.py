"""Poison messages on the coordinator's NATS subjects (issue 12, part 4): whatever the bytes do
to the decoder — JSON nested thousands deep, or an exception nobody planned for — a request is
answered INVALID, and a transition on the JetStream stream is terminated and counted, never left
unacked for redelivery (which stops the ack floor)."""

from __future__ import annotations

import asyncio

import nats
import pytest

import coordinator.nats_service as nats_service
import coordinator.transition_consumer as transition_consumer
from coordinator.app import COORDINATOR
from coordinator.nats_service import CONSUMER_NAME
from shared.messages import ErrorCode, ErrorReply, RegisterReply, decode
from shared.subjects import Subjects
from tests.integration.coordinator_kit import Worker, block, fast_config, running_coordinator

DEEP = b'{"type": "worker.heartbeat", "v": 1, "worker_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
POISON = b"POISON"


@pytest.fixture
def exploding_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's decode raises an unplanned exception on the POISON payload."""
    real = nats_service.decode

    def decode_(data, *a, **kw):  # type: ignore[no-untyped-def]
        if bytes(data).startswith(POISON):
            raise RuntimeError("decoder bug")
        return real(data, *a, **kw)

    monkeypatch.setattr(nats_service, "decode", decode_)           # requests
    monkeypatch.setattr(transition_consumer, "decode", decode_)    # transitions


async def _until(cond, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_poison_requests_are_answered_invalid(database_url: str, nats_url: str, subjects: Subjects,
                                                   exploding_decode: None) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, _):
        nc = await nats.connect(nats_url)
        try:
            for subject in (subjects.request("heartbeat", "w"), subjects.request("acquire", "w"), subjects.request("register", "w"),
                            subjects.request("resume", "w")):
                for data in (DEEP, POISON + b"{}"):
                    reply = decode((await nc.request(subject, data, timeout=5)).data)
                    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.INVALID, (subject, reply)
                    assert "decoder bug" not in reply.message
            assert isinstance(await Worker(nc, subjects).register(), RegisterReply)   # and serves on
            m = app[COORDINATOR].metrics.malformed
            assert m.labels(kind="heartbeat")._value.get() >= 2
        finally:
            await nc.drain()


async def test_poison_transitions_are_terminated_and_the_ack_floor_moves_on(
        database_url: str, nats_url: str, subjects: Subjects, exploding_decode: None) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, _):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            w = Worker(nc, subjects)
            await w.register()
            grant = await w.acquire([block(1)])
            await js.publish(subjects.events("w1"), DEEP)
            await js.publish(subjects.events("w1"), POISON + b"{}")
            last = await w.publish(w.commit([block(1)], 0, grant.lease_id))
            coord = app[COORDINATOR]
            await _until(lambda: _async(coord.ledger.state.committed_seq("w1", w.epoch) == 1))

            async def settled() -> bool:
                info = await js.consumer_info(subjects.stream_name, CONSUMER_NAME)
                return info.num_ack_pending == 0 and info.ack_floor.stream_seq >= last.seq

            await _until(settled)
            info = await js.consumer_info(subjects.stream_name, CONSUMER_NAME)
            assert info.num_redelivered == 0
            assert coord.metrics.malformed.labels(kind="transition")._value.get() == 2
            assert coord.metrics.events_ingested.labels(result="malformed")._value.get() == 2
            await asyncio.sleep(1.5)                     # nothing comes back for redelivery
            info = await js.consumer_info(subjects.stream_name, CONSUMER_NAME)
            assert info.num_ack_pending == 0 and info.num_redelivered == 0
        finally:
            await nc.drain()


async def _async(v: bool) -> bool:
    return v
