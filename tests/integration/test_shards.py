"""Two coordinator shards side by side on one NATS (real coordinators, real PostgreSQL, one database
each): each answers on its own subjects and stream, leases only the chains its shard map gives it,
refuses the others' with ``wrong_shard``, and keeps its own log, clean by its own audit — and the two
logs together hold every chain once (docs/architecture.md, "The ledger sharded")."""

from __future__ import annotations

import contextlib

import aiohttp
import asyncpg
import nats

from coordinator.core import CoreParams, decode_event, replay
from shared.messages import ErrorCode, ErrorReply, LeaseGrant, ReplicaState
from shared.shards import ShardMap, shard_subjects
from shared.subjects import Subjects
from tests.integration.coordinator_kit import NS, Worker, fast_config, running_coordinator

PARTITIONS = 16


async def _audit(base: str) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/audit", json={"check_workers": False}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def _chains(shard_map: ShardMap, per_shard: int) -> dict[int, list[list[str]]]:
    """``per_shard`` three-block chains for each shard, by the root the map gives it."""
    out: dict[int, list[list[str]]] = {0: [], 1: []}
    i = 0
    while min(len(c) for c in out.values()) < per_shard:
        chain = [f"{i:08x}{k:024x}" for k in range(3)]
        i += 1
        owned = out[shard_map.owner(NS, chain[0])]
        if len(owned) < per_shard:
            owned.append(chain)
    return out


async def test_two_shards_lease_only_their_own_chains_each_in_its_own_log_and_stream(
        database_url: str, other_database_url: str, nats_url: str, subjects: Subjects) -> None:
    urls = [database_url, other_database_url]
    shard_map = ShardMap.uniform(2, PARTITIONS)
    chains = _chains(shard_map, 3)
    configs = [fast_config(urls[k], nats_url, subjects, shards=2, shard=k, shard_partitions=PARTITIONS)
               for k in (0, 1)]
    per_shard = [shard_subjects(subjects.prefix, k) for k in (0, 1)]
    assert per_shard[0] == subjects and per_shard[1].prefix == f"{subjects.prefix}.s1"
    nc = await nats.connect(nats_url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            bases = [(await stack.enter_async_context(running_coordinator(c)))[1] for c in configs]
            # one worker, a member of both shards: registered with each, one epoch and seq space per shard
            workers = [Worker(nc, per_shard[k], "w1", slots=64) for k in (0, 1)]
            for w in workers:
                assert (await w.register()).epoch == 1
                await w.watch_watermarks()
            for k in (0, 1):
                for chain in chains[k]:
                    grant = await workers[k].fill(chain)
                    assert isinstance(grant, LeaseGrant) and sorted(grant.write["compressed"]) == [0, 1, 2]
                    # the other shard does not decide this chain, and writes nothing for asking
                    refused = await workers[1 - k].acquire(chain)
                    assert isinstance(refused, ErrorReply) and refused.code is ErrorCode.WRONG_SHARD, refused
                    assert f"belongs to shard {k}, not {1 - k}" in refused.message
                    # the owner's next lease on the chain reads it
                    again = await workers[k].acquire(chain)
                    assert isinstance(again, LeaseGrant) and again.usable_blocks == 3, again
                    await workers[k].release(again.lease_id)
                    await workers[k].release(grant.lease_id)

            # each shard's stream: its own, holding only its own transitions
            js = nc.jetstream()
            for k in (0, 1):
                info = await js.stream_info(per_shard[k].stream_name)
                assert info.config.subjects == [per_shard[k].events_wildcard]
                assert info.state.last_seq == 9      # 3 chains × 3 commits (purged or not once acknowledged)

            # per shard: today's audit, clean
            for base in bases:
                report = await _audit(base)
                assert report["ok"], report
    finally:
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(per_shard[1].stream_name)
        await nc.drain()

    # fleet-wide: the two logs hold disjoint keys, each only chains its shard owns
    roots = {b: chain[0] for k in (0, 1) for chain in chains[k] for b in chain}
    ready: list[set[str]] = []
    for k in (0, 1):
        db = await asyncpg.connect(urls[k])
        try:
            rows = await db.fetch("SELECT payload FROM events ORDER BY position")
        finally:
            await db.close()
        state = replay((decode_event(r["payload"]) for r in rows), CoreParams(shard=k, shard_map=shard_map))
        keys = {key[0] for key, r in state.replicas.items() if r.state is ReplicaState.READY}
        assert keys == {b for chain in chains[k] for b in chain}, k
        assert {shard_map.owner(NS, roots[b]) for b in keys} == {k}
        ready.append(keys)
    assert not ready[0] & ready[1]
