"""Degraded mode, the outbox, fencing, leases, inventory and control — on the coordinator twin."""

from __future__ import annotations

import asyncio
import time

import torch

from coordinator.core import CoreParams
from shared.hashing import chain_hashes
from shared.messages import Control, ReplicaState, WorkerRegister
from tests.worker.conftest import prompt
from tests.twin import InProcessCoordinator


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


async def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_coordinator_down_serves_by_recomputation_and_keeps_the_cache(make_engine, reference) -> None:
    toks = prompt(80, seed=40)
    cold = await reference().generate(toks, max_tokens=2)
    twin = InProcessCoordinator()
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=2)
        await e.flush()
        used = e.health().pool_used["compressed"]
        twin.down = True
        r = await e.generate(toks, max_tokens=2)          # the lease call fails: recompute
        assert same(cold, r) and r.cached_tokens == 0 and r.degraded and "degraded" in r.fallbacks
        assert e.health().degraded
        await until(lambda: e.contact == "unreachable" and e.degraded)   # the heartbeat confirms: unreachable
        h = e.health()
        assert h.degraded and "unreachable" in h.reason and h.contact == "unreachable"
        assert e.registered and h.pool_used["compressed"] == used   # the cache and the epoch are kept
        assert e.metrics.value("kvl_worker_degraded") == 1
        # while away, the supervisor retries with backoff: it never spins on its own failures
        tries = 0
        real = twin.heartbeat

        async def counted(msg):  # type: ignore[no-untyped-def]
            nonlocal tries
            tries += 1
            return await real(msg)

        twin.heartbeat = counted  # type: ignore[method-assign]
        await asyncio.sleep(1.5)
        assert 1 <= tries <= 10, f"{tries} heartbeats in 1.5 s while the coordinator is down"
        r = await e.generate(toks, max_tokens=2)          # known degraded: no coordinator call at all
        assert same(cold, r) and r.degraded
        twin.down = False
        await until(lambda: not e.degraded)                # the ledger never suspended it: carry on
        assert e.epoch == 1 and e.metrics.value("kvl_worker_resumes_total") == 0
        warm = await e.generate(toks, max_tokens=2)
        assert same(cold, warm) and warm.cached_tokens == 64 and warm.epoch == 1


async def test_a_takeover_suspends_the_epoch_and_a_resume_keeps_the_cache(make_engine, reference) -> None:
    toks = prompt(80, seed=44)
    cold = await reference().generate(toks, max_tokens=2)
    twin = InProcessCoordinator()
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=2)
        await e.flush()
        twin.take_over()                                   # a new leader: every epoch suspended
        # the next request, before any heartbeat told the worker: its lease is refused "suspended",
        # it waits for the resume that this starts, and reuses
        warm = await e.generate(toks, max_tokens=2)
        assert same(cold, warm) and warm.cached_tokens == 64 and warm.epoch == 1
        assert e.metrics.value("kvl_worker_resumes_total") == 1 and not e.degraded
        assert e.epoch == 1 and twin.state.workers["w1"].alive and not twin.state.workers["w1"].suspended


async def test_a_resume_reconciles_what_the_worker_lost(make_engine, reference) -> None:
    toks = prompt(80, seed=45)
    cold = await reference().generate(toks, max_tokens=2)
    twin = InProcessCoordinator()
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=2)
        await e.flush()
        # the worker loses block 2's swa copy without telling anyone, then a takeover
        hashes = chain_hashes(toks, 16, e.namespace, e.salt("default"))
        assert e.store.drop("swa", hashes[2]) is not None
        twin.take_over()
        await until(lambda: e.metrics.value("kvl_worker_resumes_total") == 1 and not e.degraded)
        assert twin.state.replicas[(hashes[2], "swa", "gpu:w1")].state is ReplicaState.INVALID
        r = await e.generate(toks, max_tokens=2)
        assert same(cold, r) and r.cached_tokens == 32 and r.invalid == []   # blocks 0-1: nothing stale read


async def test_out_of_contact_past_the_grace_registers_anew(make_engine) -> None:
    twin = InProcessCoordinator(CoreParams(lease_ttl_ms=300, resume_grace_ms=400))
    toks = prompt(48, seed=46)
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=1)
        await e.flush()
        twin.down = True
        await until(lambda: e.contact == "unreachable" and e.degraded)   # the engine noticed, too
        await asyncio.sleep(0.6)                            # longer than the grace period
        twin.expire(); twin.expire(time.time_ns() // 1_000_000 + 2_000)   # the coordinator fenced it meanwhile
        twin.down = False
        # up to the supervisor's 2 s backoff cap, a heartbeat, the refusal, the outbox settle
        # (<= 1 s) and the registration: 5 s was too tight once in CI on a loaded machine
        await until(lambda: e.epoch == 2 and not e.degraded, timeout=10.0)
        assert e.health().pool_used["compressed"] == 0      # the fenced epoch's copies are gone
        assert (await e.generate(toks, max_tokens=1)).cached_tokens == 0


async def test_a_slow_answer_is_not_an_outage(make_engine) -> None:
    """One lease call failing while heartbeats still succeed: degraded for that request only,
    same epoch, cache kept."""
    twin = InProcessCoordinator()
    toks = prompt(48, seed=47)
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=1)
        real = twin.acquire

        async def slow_once(msg):
            twin.acquire = real
            from worker.client import CoordinatorUnavailable
            raise CoordinatorUnavailable("lease.acquire: coordinator did not answer within 1.5 s")

        twin.acquire = slow_once
        r = await e.generate(toks, max_tokens=1)
        assert r.cached_tokens == 0 and "degraded" in r.fallbacks
        await until(lambda: not e.degraded)
        assert e.epoch == 1
        assert (await e.generate(toks, max_tokens=1)).cached_tokens == 32


async def test_publishes_lost_by_the_broker_are_sent_again(make_engine) -> None:
    twin = InProcessCoordinator()
    toks = prompt(48, seed=41)
    async with make_engine(twin) as e:
        twin.drop_publishes = 5                          # "acknowledged", then lost
        await e.generate(toks, max_tokens=1)
        assert await e.flush(timeout=5)
        assert e.publisher.depth == 0
        commits = {ev.seq for ev in twin.published if ev.to_state is ReplicaState.READY}
        assert len(commits) == 12                         # 3 blocks × 4 forms, all in the ledger
        r = await e.generate(toks, max_tokens=1)
        assert r.cached_tokens == 32


async def test_transitions_go_out_in_batches_of_at_most_publish_batch(make_engine) -> None:
    toks = prompt(48, seed=44)
    for size, most_messages in ((5, 3), (1, 12)):
        twin = InProcessCoordinator()
        async with make_engine(twin, **{"worker.publish_batch": size, "worker.outbox_resend_ms": 60_000}) as e:
            twin.hold_watermark = True                    # nothing acked: every commit goes out at once
            await e.generate(toks, max_tokens=1)
            await until(lambda: len(twin.published) >= 12)
            twin.hold_watermark = False
            twin.send_watermark("w1", 1)
            assert await e.flush(timeout=5)
            sent = [ev.seq for ev in twin.published]
            assert sent == sorted(sent) and len(sent) == len(set(sent))      # in order, each once
            messages = e.metrics.value("kvl_worker_published_messages_total")
            assert messages <= most_messages and twin.batches == (messages if size > 1 else 0), (size, messages)
            assert (await e.generate(toks, max_tokens=1)).cached_tokens == 32


async def test_full_outbox_degrades_without_dropping_and_recovers(make_engine, reference) -> None:
    twin = InProcessCoordinator()
    twin.hold_watermark = True
    toks = prompt(64, seed=42)
    cold = await reference().generate(toks, max_tokens=1)
    async with make_engine(twin, **{"worker.outbox_max": 6}) as e:
        r = await e.generate(toks, max_tokens=1)
        assert same(cold, r)
        assert e.publisher.depth == 6 and e.degraded and "outbox full" in e.health().reason
        assert e.metrics.value("kvl_worker_outbox_depth") == 6
        kept = e.publisher.outbox.pending_seqs()
        assert kept == [1, 2, 3, 4, 5, 6]                # nothing dropped, nothing new
        r = await e.generate(toks, max_tokens=1)
        assert same(cold, r) and r.degraded
        twin.hold_watermark = False
        twin.send_watermark("w1", 1)
        await until(lambda: not e.degraded)
        assert e.epoch == 1 and e.publisher.depth == 0   # same epoch: nothing was lost


async def test_fenced_epoch_re_registers_and_drops_local_copies(make_engine, model) -> None:
    twin = InProcessCoordinator()
    toks = prompt(48, seed=43)
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=1)
        await e.flush()
        # another process registers under the same worker id: epoch 1 is fenced
        await twin.register(WorkerRegister(worker_id="w1", namespace=e.namespace, catalogue=e.catalogue,
                                           pool_slots=e.slots))
        await until(lambda: e.epoch == 3, timeout=5)
        assert e.health().pool_used["compressed"] == 0
        r = await e.generate(toks, max_tokens=1)
        assert r.cached_tokens == 0 and r.invalid == []   # nothing stale is offered or read


async def test_leases_are_renewed_and_released(make_engine) -> None:
    twin = InProcessCoordinator(CoreParams(lease_ttl_ms=300))
    toks = prompt(40, seed=44)
    async with make_engine(twin) as e:
        assert e.lease_ttl_ms == 300
        s = await e.open(toks, max_new_tokens=1)
        lease = twin.state.leases[s.main.lease_id]
        first = lease.expires_at_ms
        await asyncio.sleep(0.45)
        assert lease.expires_at_ms > first                # renewed while the request runs
        while not await s.prefill_step():
            pass
        await e.close(s)
        assert not twin.state.leases


async def test_inventory_and_control(make_engine) -> None:
    twin = InProcessCoordinator()
    toks = prompt(48, seed=45)
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=1)
        inv = await twin.inventory("w1")
        assert inv.epoch == 1 and len(inv.items) == 12
        assert {i.location for i in inv.items} == {"gpu:w1"} and all(i.state is ReplicaState.READY for i in inv.items)
        block = inv.items[0].block_hash
        ack = await twin.control("w1", Control(action="evict", block_hash=block))
        assert ack.affected == 4
        ack = await twin.control("w1", Control(action="invalidate_namespace", namespace=e.namespace))
        assert ack.affected == 8 and e.health().pool_used["compressed"] == 0
        ack = await twin.control("w1", Control(action="drain"))
        assert e.health().draining
        other = prompt(48, seed=46)
        r = await e.generate(other, max_tokens=1)        # served, but nothing new is cached
        await e.flush()
        hashes = set(chain_hashes(other, 16, e.namespace, e.salt("default")))
        assert r.tokens and not any(k[0] in hashes for k in twin.state.replicas)


async def test_cancelled_request_releases_its_lease(make_engine) -> None:
    twin = InProcessCoordinator()
    async with make_engine(twin) as e:
        task = asyncio.get_running_loop().create_task(e.generate(prompt(200, seed=48), max_tokens=4))
        await until(lambda: twin.state.leases)
        await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await until(lambda: not twin.state.leases and not e.sessions)


async def test_a_restore_the_model_refuses_falls_back_to_recomputation(make_engine, reference, monkeypatch) -> None:
    from worker.model.state import RequestState
    toks = prompt(64, seed=49)
    async with make_engine(InProcessCoordinator()) as e:
        await e.generate(toks, max_tokens=1)

        def refuse(self, blocks, n_blocks, **kw):
            raise ValueError("restore: corrupt payload (test)")

        monkeypatch.setattr(RequestState, "restore", refuse)
        r = await e.generate(toks, max_tokens=2)
        assert r.cached_tokens == 0 and "restore_failed" in r.fallbacks
        assert same(r, await reference().generate(toks, max_tokens=2))


async def test_release_waits_for_commits_instead_of_aborting_them(make_engine) -> None:
    """A release aborts uncommitted writes; when the watermark is late, the lease is released
    in the background once it covers the commits, never before."""
    twin = InProcessCoordinator()
    toks = prompt(48, seed=60)
    async with make_engine(twin) as e:
        e.settle_timeout_s = 0.05
        twin.hold_watermark = True
        real_publish = twin.publish
        held: list = []

        async def slow_publish(ev):        # the broker holds the events: nothing is ingested yet
            held.append(ev)

        twin.publish = slow_publish
        r = await e.generate(toks, max_tokens=1)
        assert r.tokens and twin.state.leases and e.releasing      # not released: commits pending
        twin.publish = real_publish
        twin.hold_watermark = False
        await until(lambda: not twin.state.leases and not e.releasing, timeout=10)
        ready = [k for k, rep in twin.state.replicas.items() if rep.state is ReplicaState.READY]
        assert len(ready) == 12                                       # every commit landed
        assert (await e.generate(toks, max_tokens=1)).cached_tokens == 32


async def test_a_fused_forward_that_differs_at_run_time_stops_fusing_and_drops_the_cache(
        make_engine, reference, monkeypatch) -> None:
    """The run-time check (``service.fused_check_every``): an op whose bits depend on the batch
    after the start-up probe passed (here: the last hidden state scaled by the forward's row
    count) is caught on the first fused forward it checks; that step's requests fail (retry),
    fusing stops for good, and the worker drops its cache with a new epoch. Later requests are
    served one per forward, exact again."""
    from worker.stepper import FusedMismatch
    toks = prompt(40, seed=51)
    twin = InProcessCoordinator()
    async with make_engine(twin, **{"service.fused_check_every": 1}) as e:
        await e.generate(toks, max_tokens=1)
        await e.flush()
        assert e.stepper.fused and e.health().pool_used["compressed"] > 0
        hidden = e.model._hidden
        monkeypatch.setattr(e.model, "_hidden", lambda ids, batch, need: hidden(ids, batch, need) * (1 + 1e-3 * ids.numel()))
        monkeypatch.setattr(e.model, "batch_invariant", True)      # restored afterwards
        got = await asyncio.gather(*(e.generate(prompt(20, seed=60 + k), max_tokens=4) for k in range(3)),
                                   return_exceptions=True)
        assert any(isinstance(r, FusedMismatch) for r in got), got
        assert not e.stepper.fused and e.stepper.check_failures == 1
        assert e.metrics.value("kvl_worker_fused_checks_total", {"outcome": "differs"}) == 1
        assert e.metrics.value("kvl_worker_batch_invariant") == 0
        await until(lambda: e.registered and e.epoch == 2 and not e.degraded)
        assert e.health().pool_used["compressed"] == 0            # what it made fused is gone
        monkeypatch.setattr(e.model, "_hidden", hidden)
        cold = await reference(**{"service.fused_check_every": 1}).generate(toks, max_tokens=2)
        again = await asyncio.gather(*(e.generate(toks, max_tokens=2) for _ in range(2)))
        assert all(same(cold, r) and r.epoch == 2 for r in again)
        assert not e.stepper.fused and e.stepper.check_failures == 1    # off for good, whatever re-probes the model
