"""The ledger's partition key and shard map (``shared.shards``), the config keys that name a shard,
and the lease fence a sharded ledger keeps (docs/architecture.md, "The ledger sharded")."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from coordinator.core import CoreParams, acquire_lease, register_worker
from shared.config import CoordinatorConfig
from shared.messages import ErrorCode, ErrorReply, LeaseGrant
from shared.shards import Move, ShardMap, ShardMapError, partition_of, shard_of, shard_subjects
from shared.subjects import REQUEST_OPS, Subjects

from tests.unit.core.support import NS, Driver, acquire, h, register


def test_partition_is_blake2b_of_namespace_and_root_modulo_the_partitions() -> None:
    for root in ("", h(0), h(1), "f" * 32):
        digest = hashlib.blake2b(f"{NS}\0{root}".encode(), digest_size=8).digest()
        assert partition_of(NS, root, 256) == int.from_bytes(digest, "big") % 256
    # the namespace is part of the key: one root under two namespaces may land apart
    assert len({partition_of(f"{i:032x}", h(0), 256) for i in range(64)}) > 1
    with pytest.raises(ShardMapError):
        partition_of(NS, h(0), 0)


def test_uniform_map_spreads_partitions_and_roots_over_every_shard() -> None:
    m = ShardMap.uniform(4, 256)
    assert m.version == 1 and m.partitions == 256 and not m.moving
    assert [len(m.owned_by(s)) for s in range(4)] == [64, 64, 64, 64]
    owners = [m.owner(NS, h(i)) for i in range(400)]
    assert set(owners) == {0, 1, 2, 3}
    assert all(owners.count(s) > 50 for s in range(4)), [owners.count(s) for s in range(4)]
    assert ShardMap() == ShardMap.uniform(1, 1) and ShardMap().owner(NS, h(3)) == 0


def test_a_move_freezes_then_opens_under_new_versions_and_changes_nothing_in_place() -> None:
    m = ShardMap.uniform(2, 8)
    p = 3
    frozen = m.freeze(p, 0)
    assert (frozen.version, frozen.frozen(p), frozen.owners[p]) == (2, True, 1)
    assert m.version == 1 and not m.frozen(p)
    opened = frozen.open(p)
    assert (opened.version, opened.frozen(p), opened.owners[p]) == (3, False, 0)
    assert [o for i, o in enumerate(opened.owners) if i != p] == [o for i, o in enumerate(m.owners) if i != p]
    with pytest.raises(ShardMapError, match="already moving"):
        frozen.freeze(p, 0)
    with pytest.raises(ShardMapError, match="not moving"):
        m.open(p)
    with pytest.raises(ShardMapError, match="no partition 8"):
        m.freeze(8, 0)
    with pytest.raises(ShardMapError, match="owner is shard 1"):
        m.freeze(p, 1)          # to where it already is
    with pytest.raises(ShardMapError, match="owner is shard 1"):
        m.freeze(p, 2)          # to a shard the map does not have


def test_a_map_round_trips_as_json_and_refuses_what_cannot_be() -> None:
    m = ShardMap.uniform(3, 12).freeze(5, 0)
    assert msgspec.json.decode(msgspec.json.encode(m), type=ShardMap) == m
    for bad in ({"shards": 2, "owners": [0, 2]}, {"shards": 3, "owners": [0, 1]}, {"owners": []},
                {"shards": 2, "owners": [0, 1], "moving": [{"partition": 0, "source": 1, "target": 0}]},
                {"shards": 2, "owners": [0, 1], "moving": [{"partition": 0, "source": 0, "target": 1},
                                                           {"partition": 0, "source": 0, "target": 1}]},
                {"version": 0}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, ShardMap)
    assert Move(1, 0, 1).target == 1


def test_shard_zero_keeps_every_subject_and_shard_k_lives_apart_under_its_own_prefix() -> None:
    base, s0, s1 = Subjects("kvl"), shard_subjects("kvl", 0), shard_subjects("kvl", 1)
    assert s0 == base and s0.stream_name == "KVL_EVENTS"
    assert s1.prefix == "kvl.s1" and s1.stream_name == "KVL_S1_EVENTS"
    # shard 0's wildcards match no subject of shard 1 (and the other way round): NATS matching,
    # a '*' for one token, '>' for the rest
    def matches(pattern: str, subject: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        for i, tok in enumerate(p):
            if tok == ">":
                return len(s) > i
            if i >= len(s) or tok not in ("*", s[i]):
                return False
        return len(p) == len(s)

    for a, b in ((s0, s1), (s1, s0)):
        wildcards = [a.requests_wildcard(op) for op in REQUEST_OPS] + [a.route_wildcard, a.events_wildcard]
        subjects = ([b.request(op, "w1") for op in REQUEST_OPS]
                    + [b.route("g1"), b.events("w1"), b.watermark("w1"), b.control("w1"), b.inventory("w1")])
        for w in wildcards:
            assert not [s for s in subjects if matches(w, s)], w
        assert all(matches(w, s) for w, s in zip(wildcards, [a.request(op, "w1") for op in REQUEST_OPS]))
    with pytest.raises(ShardMapError):
        shard_subjects("kvl", -1)


def test_config_names_a_shard_of_the_deployment() -> None:
    c = msgspec.convert({}, CoordinatorConfig)
    assert (c.shards, c.shard, c.shard_partitions) == (1, 0, 256)
    assert CoreParams.from_config(c).shard_map is None          # one shard: nothing is checked
    two = msgspec.convert({"shards": 2, "shard": 1, "shard_partitions": 16}, CoordinatorConfig)
    p = CoreParams.from_config(two)
    assert p.shard == 1 and p.shard_map == ShardMap.uniform(2, 16)
    with pytest.raises(msgspec.ValidationError, match="coordinator.shard is 2, but shards are numbered 0 to 1"):
        msgspec.convert({"shards": 2, "shard": 2}, CoordinatorConfig)
    with pytest.raises(msgspec.ValidationError, match="shard_partitions"):
        msgspec.convert({"shards": 8, "shard_partitions": 4}, CoordinatorConfig)


def _roots(shard_map: ShardMap) -> dict[int, list[str]]:
    """Chains (first two blocks each) by the shard that owns them."""
    out: dict[int, list[str]] = {}
    for i in range(0, 200, 2):
        out.setdefault(shard_map.owner(NS, h(i)), []).append(h(i))
    return out


def test_a_shard_leases_only_chains_its_map_gives_it() -> None:
    m = ShardMap.uniform(2, 16)
    roots = _roots(m)
    for shard in (0, 1):
        d = Driver(CoreParams(shard=shard, shard_map=m))
        d.run(register_worker, register("w1"), 0)
        mine, theirs = roots[shard][0], roots[1 - shard][0]
        g = d.run(acquire_lease, acquire("w1", 1, [mine, h(1001)]), 1, "L1")
        assert isinstance(g, LeaseGrant), g
        before = len(d.log)
        refused = d.run(acquire_lease, acquire("w1", 1, [theirs, h(1003)]), 1, "L2")
        assert isinstance(refused, ErrorReply) and refused.code is ErrorCode.WRONG_SHARD, refused
        assert f"belongs to shard {1 - shard}, not {shard}" in refused.message and "version 1" in refused.message
        assert len(d.log) == before          # a refusal decides nothing
        # a request with no whole block pins and writes nothing: any shard answers it
        assert not isinstance(d.run(acquire_lease, acquire("w1", 1, []), 1, "L3"), ErrorReply)


def test_shard_of_routes_each_lease_to_the_shard_whose_fence_grants_it() -> None:
    """The routing rule workers and the bench follow agrees with the fence every shard keeps: the
    shard it names grants the lease, every other shard refuses it ``wrong_shard``."""
    m = ShardMap.uniform(3, 16)
    drivers = []
    for shard in range(3):
        d = Driver(CoreParams(shard=shard, shard_map=m))
        d.run(register_worker, register("w1", slots=256), 0)
        drivers.append(d)
    for i in range(24):
        chain = [h(100 * i + k) for k in range(3)]
        target = shard_of(m, NS, chain)
        assert target == m.owner(NS, chain[0]) == shard_of(m, NS, chain[:1])   # the root decides, not the tail
        for shard, d in enumerate(drivers):
            r = d.run(acquire_lease, acquire("w1", 1, chain), 1, f"L{i}")
            if shard == target:
                assert isinstance(r, LeaseGrant), r
            else:
                assert isinstance(r, ErrorReply) and r.code is ErrorCode.WRONG_SHARD, r
    assert shard_of(m, NS, []) is None                        # no whole block: any shard may answer
    assert shard_of(None, NS, [h(1)]) == 0                    # no map: one ledger
    # after a move the new map routes the partition's chains to their new owner
    root = next(h(i) for i in range(100) if m.owner(NS, h(i)) == 0)
    moved = m.freeze(m.partition(NS, root), 2).open(m.partition(NS, root))
    assert (shard_of(m, NS, [root]), shard_of(moved, NS, [root])) == (0, 2)


def test_a_frozen_partition_is_leased_by_no_shard_until_its_move_opens() -> None:
    m = ShardMap.uniform(2, 16)
    root = _roots(m)[0][0]
    part = m.partition(NS, root)
    frozen = m.freeze(part, 1)
    for shard in (0, 1):
        d = Driver(CoreParams(shard=shard, shard_map=frozen))
        d.run(register_worker, register("w1"), 0)
        r = d.run(acquire_lease, acquire("w1", 1, [root]), 1, "L")
        assert isinstance(r, ErrorReply) and r.code is ErrorCode.WRONG_SHARD and r.retry_after_ms > 0, r
        assert "moving" in r.message
    d = Driver(CoreParams(shard=1, shard_map=frozen.open(part)))
    d.run(register_worker, register("w1"), 0)
    assert isinstance(d.run(acquire_lease, acquire("w1", 1, [root]), 1, "L"), LeaseGrant)


def _shard_audit(shard: int, keys: list[str], *, ok: bool = True, version: int = 1, shards: int = 2) -> dict:
    return {"ok": ok, "shard": {"shard": shard, "shards": shards, "map_version": version, "partitions": 16,
                                "ok": ok, "keys": keys}}


def test_the_fleet_audit_wants_every_shard_once_clean_on_one_map_and_each_key_on_one_shard() -> None:
    from coordinator.shard_audit import fleet_report

    clean = fleet_report({"a": _shard_audit(0, [h(1), h(2)]), "b": _shard_audit(1, [h(3)])})
    assert clean["ok"] and clean["problems"] == [] and clean["live_blocks"] == 3
    assert clean["shards"] == {"0": "a", "1": "b"}

    def problems(reports: dict) -> list[str]:
        r = fleet_report(reports)
        assert not r["ok"]
        return r["problems"]

    assert problems({"a": _shard_audit(0, [h(1)], ok=False), "b": _shard_audit(1, [])}) == [
        "a: its own audit found problems"]
    assert problems({"a": _shard_audit(0, [h(1)]), "b": _shard_audit(0, [h(2)])}) == [
        "b and a are both shard 0", "shards audited [0], the map has 2"]
    assert problems({"a": _shard_audit(0, [h(1)])}) == ["shards audited [0], the map has 2"]
    both = fleet_report({"a": _shard_audit(0, [h(1), h(2)]), "b": _shard_audit(1, [h(2)])})
    assert both["problems"] == ["1 blocks are live on more than one shard"]
    assert both["on_several_shards"] == {"count": 1, "listed": {h(2): [0, 1]}}
    assert "disagree on the map" in problems({"a": _shard_audit(0, []), "b": _shard_audit(1, [], version=2)})[0]
    assert problems({"a": {"ok": True}, "b": _shard_audit(1, [])})[0] == (
        "a: not a sharded coordinator (no shard section in its audit)")


def test_a_follower_takes_only_a_newer_map_of_its_deployments_shape() -> None:
    from shared.shard_store import accepts

    held = ShardMap.uniform(2, 16)
    assert accepts(None, held, 2, 16) == ""
    assert accepts(held, held.freeze(3, 0), 2, 16) == ""
    assert accepts(held.freeze(3, 0), held, 2, 16) == "version 1 is not newer than the one held (2)"
    assert accepts(held, ShardMap.uniform(3, 16), 2, 16).startswith("the map has 3 shards and 16 partitions, the config 2")
    assert "coordinator.shard_partitions" in accepts(None, ShardMap.uniform(2, 32), 2, 16)


def test_kvledger_up_refuses_a_sharded_config_on_a_configured_database_in_one_line(tmp_path) -> None:
    """`kvledger up --shards N` gives each shard a database of its own on the embedded PostgreSQL;
    with database.url configured it cannot, so it says so and starts nothing."""
    import subprocess
    import sys

    import yaml

    conf = tmp_path / "kvledger.yaml"
    conf.write_text(yaml.safe_dump({"coordinator": {"shards": 2}, "state_dir": str(tmp_path / "state"),
                                    "database": {"url": "postgresql://kvl@127.0.0.1:1/kvl"}}))
    out = subprocess.run([sys.executable, "-m", "kvledger", "--config", str(conf), "up", "--no-gateway"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "kvledger up runs 2 ledger shards on the embedded PostgreSQL" in out.stderr
    assert not (tmp_path / "state").exists()
