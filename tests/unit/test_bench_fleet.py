"""bench.fleet's pure parts: the request mix (shared prefixes, multi-turn chains) and the figures."""

from __future__ import annotations

import pytest

from bench.fleet.mix import PROMPT_BLOCKS, MixParams, WorkerMix, chained, namespace, system_prompt
from bench.fleet.report import fleet_keys, goals, table
from shared.shards import ShardMap, shard_of


def _turns(mix: WorkerMix, n: int) -> list[list[str]]:
    out = []
    for _ in range(n):
        conv, hashes = mix.next_turn()
        mix.done(conv, hashes)
        out.append(hashes)
    return out


def test_turns_extend_their_conversation_and_share_the_namespaces_system_prompts() -> None:
    ns = namespace(0)
    mix = WorkerMix(ns, "fw0001", MixParams(prompts=3, shared=1.0, active=4, max_blocks=20), seed=5)
    prompts = [system_prompt(ns, k) for k in range(3)]
    seen: dict[str, list[str]] = {}
    for _ in range(200):
        conv, hashes = mix.next_turn()
        before = list(conv.chain)
        assert hashes[:len(before)] == before and len(hashes) > len(before)      # a turn extends the chain
        assert hashes[:PROMPT_BLOCKS] in prompts                                 # under a shared system prompt
        for i in range(1, len(hashes)):                                          # chained hashes, 32 hex
            assert len(hashes[i]) == 32 and int(hashes[i], 16) >= 0
        mix.done(conv, hashes)
        seen[conv.cid] = hashes
    assert len(seen) > 4                         # conversations end (max_blocks) and new ones start
    assert all(len(c.chain) < 20 for c in mix.active)
    # the same worker and seed make the same requests; another worker other conversations
    again = WorkerMix(ns, "fw0001", MixParams(prompts=3, shared=1.0, active=4, max_blocks=20), seed=5)
    assert _turns(again, 50) == _turns(WorkerMix(ns, "fw0001", again.p, seed=5), 50)
    assert chained("", "a") != chained("", "b") and namespace(0) != namespace(1)


def test_roots_are_shared_prompts_or_a_conversations_own_and_spread_over_the_shards() -> None:
    m = ShardMap.uniform(4, 256)
    roots = set()
    shards = set()
    for w in range(40):
        ns = namespace(w % 4)
        mix = WorkerMix(ns, f"fw{w:04d}", MixParams(prompts=8, shared=0.5), seed=w)
        for hashes in _turns(mix, 30):
            roots.add((ns, hashes[0]))
            shards.add(shard_of(m, ns, hashes))
    shared_roots = {(namespace(i), system_prompt(namespace(i), k)[0]) for i in range(4) for k in range(8)}
    assert roots & shared_roots and roots - shared_roots       # both kinds of root occur
    assert shards == {0, 1, 2, 3}


def _round(n: int, leases: list[int], cpu: float, idle: float, wall: float = 10.0) -> dict:
    return {"shards": n, "workers": 200, "wall_s": wall, "leases_by_shard": leases, "blocks_read": 90,
            "blocks_written": 10, "wrong_shard": 0, "errors": {}, "heartbeats": 2000 * n,
            "cpu_s": {"coordinators": cpu / 2, "drivers": cpu / 4, "postgres": cpu / 8, "nats": cpu / 8, "bench": 0.0},
            "idle_cpu_s_per_s": {"coordinators": idle}, "append_txs": 100, "append_events": 1500}


def test_scaling_efficiency_is_leases_per_cpu_second_against_one_shard() -> None:
    keys = fleet_keys([_round(1, [10_000], 10.0, 0.05), _round(2, [4_000, 4_000], 10.0, 0.1),
                       _round(4, [1_000, 1_000, 1_000, 3_000], 12.0, 0.2)])
    assert keys["leases_per_s_shards1"] == 1000 and keys["cpu_us_per_lease_shards1"] == 1000
    assert keys["cpu_us_per_lease_shards2"] == 1250 and keys["scaling_efficiency_shards2"] == 0.8
    assert keys["scaling_efficiency_shards4"] == pytest.approx(6000 / 12 / 1000, abs=1e-3)
    assert keys["cpu_us_per_lease_shards1_coordinators"] == 500
    # the ledger's share: coordinators, postgres and nats (3/4 of the CPU here), not the drivers
    assert keys["cpu_us_per_lease_ledger_shards1"] == 750 and keys["scaling_efficiency_ledger_shards2"] == 0.8
    # beyond idle: (10 − 0.05 × 10) / 10,000 at one shard, (10 − 0.1 × 10) / 8,000 at two
    assert keys["cpu_us_per_lease_beyond_idle_shards1"] == 950 and keys["cpu_us_per_lease_beyond_idle_shards2"] == 1125
    assert keys["scaling_efficiency_beyond_idle_shards2"] == round(950 / 1125, 3)
    assert keys["hottest_shard_share_shards4"] == 2.0 and keys["reuse_share_shards4"] == 0.9
    assert keys["append_txs_per_lease_shards2"] == 0.013 and keys["append_events_per_tx_shards2"] == 15
    text = table(keys, [1, 2, 4])
    assert len(text.splitlines()) == 4 and "0.8" in text.splitlines()[2]
    assert goals(keys, [1, 2, 4], 0, 0) == {"scaling_efficiency_shards2 >= 0.9": False,
                                            "scaling_efficiency_shards4 >= 0.9": False,
                                            "wrong_shard == 0": True, "errors == 0": True}
    assert not goals(keys, [1, 2, 4], 1, 0)["wrong_shard == 0"] and not goals(keys, [1, 2], 0, 3)["errors == 0"]
    # no one-shard round: nothing to compare with
    assert "scaling_efficiency_shards2" not in fleet_keys([_round(2, [1, 1], 1.0, 0.0)])
