"""The worker's routing between coordinator shards (``worker.shard_links``): the pure part — which
shard a chain and a block go to, what a shard is told of the pool, what is asked of every shard."""

from __future__ import annotations

from shared.shards import ShardMap, shard_of
from worker.shard_links import ROOTS_FLOOR, ShardLink, ShardLinks

NS = "ab" * 16


def links(shards: int, *, held=tuple, partitions: int = 16) -> ShardLinks:
    """Links without clients (routing only decides, it sends nothing)."""
    return ShardLinks([ShardLink(k, None, None, None) for k in range(shards)], NS,  # type: ignore[arg-type]
                      ShardMap.uniform(shards, partitions), held=held)


def chain(i: int, n: int = 3) -> list[str]:
    return [f"{i:08x}{k:024x}" for k in range(n)]


def test_one_shard_is_todays_worker() -> None:
    one = links(1)
    assert not one.sharded and one.map is None
    assert one.for_chain(chain(1)).shard == 0 and one.shard_of_block("anything") == 0
    one.note(chain(1))
    assert one.roots == {}                                     # nothing remembered
    assert one.share({"a": 7}, 0) == {"a": 7}                  # the whole pool
    assert one.group(["x", "y"], str) == {0: ["x", "y"]}


def test_a_chain_and_its_blocks_go_to_the_shard_owning_its_root() -> None:
    two = links(2)
    seen = set()
    for i in range(40):
        c = chain(i)
        k = two.for_chain(c).shard
        assert k == shard_of(two.map, NS, c)
        assert two.shard_of_block(c[1]) is None               # not leased yet: not known
        two.note(c)
        assert all(two.shard_of_block(h) == k for h in c)     # every block of it, by its root
        seen.add(k)
    assert seen == {0, 1}
    assert two.for_chain([]).shard == 0                        # no whole block: shard 0


def test_a_block_whose_chain_is_unknown_is_asked_of_every_shard() -> None:
    two = links(2)
    c = chain(7)
    two.note(c)
    k = two.shard_of_block(c[0])
    assert two.group([c[0], "unknown"], str) == {k: [c[0], "unknown"], 1 - k: ["unknown"]}


def test_the_shares_of_a_pool_never_sum_past_it() -> None:
    for shards, partitions in ((2, 16), (3, 16), (4, 256), (3, 7)):
        many = links(shards, partitions=partitions)
        for slots in (1, 7, 100, 1001):
            assert sum(many.share({"f": slots}, k)["f"] for k in range(shards)) <= slots


def test_remembered_roots_are_forgotten_only_for_blocks_no_longer_held() -> None:
    held = {h for h in chain(0)}
    two = links(2, held=lambda: held)
    two.note(chain(0))
    i = 1
    while len(two.roots) <= ROOTS_FLOOR - 3:
        two.note(chain(i))
        i += 1
    two.note(chain(i))                                          # past the limit: pruned to what is held
    assert set(two.roots) == held | set(chain(i))
    assert two.shard_of_block(chain(0)[2]) == two.for_chain(chain(0)).shard
