"""Block identity: frozen vectors, and every input that must change the hash does."""

import json
from pathlib import Path

import pytest

from shared.hashing import block_hash, chain_hashes, checksum, namespace_hash, replica_digest, replica_digests
from shared.ids import ROOT_HASH

VECTORS = json.loads((Path(__file__).parents[2] / "shared/testdata/hash_vectors.json").read_text())


def test_namespace_vector() -> None:
    v = VECTORS["namespace"]
    assert namespace_hash(v["model_id"], v["weights_digest"], cache_format_version=v["cache_format_version"],
                          kernel_abi_version=v["kernel_abi_version"]) == v["hash"]


@pytest.mark.parametrize("case", VECTORS["blocks"], ids=lambda c: c["hash"][:8])
def test_block_vectors(case: dict) -> None:
    got = block_hash(case["parent"], case["tokens"], case["namespace"], bytes.fromhex(case["tenant_salt_hex"]),
                     case["extra_keys"])
    assert got == case["hash"]


def test_chain_vector() -> None:
    c = VECTORS["chain"]
    assert chain_hashes(c["tokens"], c["block_size"], c["namespace"], bytes.fromhex(c["tenant_salt_hex"])) == c["hashes"]


def test_checksum_vector() -> None:
    c = VECTORS["checksum"]
    assert checksum(bytes.fromhex(c["data_hex"])) == c["xxh3_128"]


NS = namespace_hash("m", "w" * 8)
TOKENS = list(range(100))


def test_tenant_salt_changes_every_hash() -> None:
    a = chain_hashes(TOKENS, 16, NS, b"tenant-a")
    b = chain_hashes(TOKENS, 16, NS, b"tenant-b")
    assert len(a) == 6 and all(x != y for x, y in zip(a, b, strict=True))


def test_namespace_changes_every_hash() -> None:
    other = namespace_hash("m", "w" * 8, cache_format_version=2)
    a = chain_hashes(TOKENS, 16, NS, b"s")
    b = chain_hashes(TOKENS, 16, other, b"s")
    assert all(x != y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("field", ["model_id", "weights", "format", "abi"])
def test_namespace_depends_on_each_part(field: str) -> None:
    base = dict(model_id="m", weights_digest="w", cache_format_version=1, kernel_abi_version=1)
    changed = dict(base)
    key = {"model_id": "model_id", "weights": "weights_digest", "format": "cache_format_version",
           "abi": "kernel_abi_version"}[field]
    changed[key] = "x" if isinstance(base[key], str) else 2
    mk = lambda d: namespace_hash(d["model_id"], d["weights_digest"], cache_format_version=d["cache_format_version"],  # noqa: E731
                                  kernel_abi_version=d["kernel_abi_version"])
    assert mk(base) != mk(changed)


def test_chain_is_prefix_stable_and_order_sensitive() -> None:
    full = chain_hashes(TOKENS, 16, NS, b"s")
    assert chain_hashes(TOKENS[:40], 16, NS, b"s") == full[:2]  # a partial block gets no hash
    swapped = TOKENS[:16] + TOKENS[17:18] + TOKENS[16:17] + TOKENS[18:]
    assert chain_hashes(swapped, 16, NS, b"s")[0] == full[0]
    assert chain_hashes(swapped, 16, NS, b"s")[1] != full[1]
    # a change in block 0 changes every later block (chaining)
    assert all(x != y for x, y in zip(chain_hashes([7] + TOKENS[1:], 16, NS, b"s"), full, strict=True))


def test_extra_keys_change_the_hash() -> None:
    t = TOKENS[:16]
    assert block_hash(ROOT_HASH, t, NS, b"", ["img:1"]) != block_hash(ROOT_HASH, t, NS, b"", ["img:2"])
    assert block_hash(ROOT_HASH, t, NS, b"", []) != block_hash(ROOT_HASH, t, NS, b"", [""])


def test_encoding_is_unambiguous() -> None:
    # length prefixes: moving a byte between salt and extra key must not collide
    assert block_hash(ROOT_HASH, [1], NS, b"ab", ["c"]) != block_hash(ROOT_HASH, [1], NS, b"a", ["bc"])


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_range_checked(bad: int) -> None:
    with pytest.raises(ValueError, match="token id"):
        block_hash(ROOT_HASH, [bad], NS, b"")
    with pytest.raises(ValueError, match="token id"):
        chain_hashes([1] * 20 + [bad] + [1] * 11, 16, NS, b"")
    assert len(chain_hashes([1] * 16 + [bad], 16, NS, b"")) == 1     # a partial block is not hashed


def test_chain_hashes_are_the_block_by_block_fold() -> None:
    """chain_hashes builds block_hash's bytes at once (one pack, one call per block): the same
    hashes for any block size, salt and per-block extra keys (some blocks with none)."""
    import random

    rng = random.Random(7)
    for block_size in (1, 3, 16, 64):
        tokens = [rng.choice((0, 2**32 - 1, rng.randrange(2**32))) for _ in range(block_size * 9 + block_size // 2)]
        salt = bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 32))))
        extras = [tuple(f"image:{rng.random()}:é{j}" for j in range(rng.choice((0, 0, 1, 2)))) for _ in range(6)]
        fold, parent = [], ROOT_HASH
        for i in range(len(tokens) // block_size):
            parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], NS, salt,
                                extras[i] if i < len(extras) else ())
            fold.append(parent)
        assert chain_hashes(tokens, block_size, NS, salt, extras) == fold
        assert chain_hashes(tokens, block_size, NS, salt) == chain_hashes(tokens, block_size, NS, salt, [])
    assert chain_hashes([1, 2, 3], 16, NS, b"") == []
    with pytest.raises(ValueError, match="token id 1.5"):
        chain_hashes([1.5] * 16, 16, NS, b"")  # type: ignore[list-item]


def test_bad_parent_rejected() -> None:
    with pytest.raises(ValueError, match="parent hash"):
        block_hash("abc", [1], NS, b"")  # type: ignore[arg-type]


def test_the_compute_fingerprint_separates_namespaces() -> None:
    """Other CPUs (or thread counts) compute other bits: their namespaces differ; "" is the old hash."""
    from kernels.invariant import compute_fingerprint

    here = compute_fingerprint()
    assert here.startswith("cpu:") and "threads" in here
    assert namespace_hash("m", "w" * 8, compute="") == namespace_hash("m", "w" * 8)
    assert namespace_hash("m", "w" * 8, compute=here) != namespace_hash("m", "w" * 8)
    assert namespace_hash("m", "w" * 8, compute=here) != namespace_hash("m", "w" * 8, compute=here + "x")


def test_replica_digest_vector_and_the_batch_form_agree() -> None:
    """The resume's inventory digest is wire format (a worker and a coordinator of different
    builds must agree): one pinned vector, and the batch form gives the same bytes as the single
    one for mixed pools, generations, empty and non-ASCII fields."""
    assert replica_digest("0" * 32, "compressed", "gpu:w-a", 3, "f" * 32).hex() == "dd6fd749d5575a55"
    import random
    r = random.Random(0)
    rows = [(f"{r.getrandbits(128):032x}", r.choice(["compressed", "window", "ü", ""]),
             r.choice(["gpu:w1", "host:n1", "gpu:ünï"]), r.randrange(0, 10**6) if r.random() < 0.5 else r.randrange(3),
             r.choice([f"{r.getrandbits(128):032x}", "", "abc"])) for _ in range(2000)]
    assert replica_digests(rows) == [replica_digest(*row) for row in rows]
    assert len(set(replica_digests(rows))) == len(set(rows))
    assert replica_digests([]) == []
