"""Block identity: chained 128-bit hashes, salted per tenant, scoped per namespace.

``h_i = H(h_{i-1} ‖ namespace ‖ tenant_salt ‖ tokens_i ‖ extra_keys_i)``

* BLAKE2b with a 16-byte digest, not Python's ``hash()`` (randomised per process) and not a
  non-cryptographic hash: a tenant who could craft two prefixes with one hash would be
  served the other prefix's cache — a wrong answer. (vLLM moved its prefix hash to SHA-256
  for the same reason.) Cache *content* checksums, where the threat is corruption, not an
  adversary, use xxh3 (see ``checksum``).
* Every field is length-prefixed and tokens are packed as little-endian uint32, so the
  encoding is unambiguous and identical on every machine.
* The namespace binds the model id, a digest of the loaded weights, the cache format
  version and the kernel ABI: two workers share a block only if they would compute the
  same bits for it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import xxhash

from shared.ids import ROOT_HASH, BlockHash, Namespace
from shared.versions import CACHE_FORMAT_VERSION, KERNEL_ABI_VERSION

_DOMAIN_BLOCK = b"kvl.block.v1"
_DOMAIN_NS = b"kvl.namespace.v1"
_MAX_TOKEN = 2**32 - 1


_U32 = struct.Struct("<I")


def _field(b: bytes) -> bytes:
    return _U32.pack(len(b)) + b


def namespace_hash(model_id: str, weights_digest: str, *,
                   cache_format_version: int = CACHE_FORMAT_VERSION,
                   kernel_abi_version: int = KERNEL_ABI_VERSION, compute: str = "") -> Namespace:
    """Hash of everything that decides whether two workers compute the same cache bits.

    ``compute``: the machine's compute fingerprint (``kernels.invariant.compute_fingerprint``:
    torch build, instruction set, threads; CUDA device) — "" leaves it out (the golden vectors)."""
    h = hashlib.blake2b(digest_size=16, person=b"kvl-namespace")
    h.update(_DOMAIN_NS)
    for part in (model_id.encode(), weights_digest.encode(),
                 struct.pack("<II", cache_format_version, kernel_abi_version),
                 *((compute.encode(),) if compute else ())):
        h.update(_field(part))
    return Namespace(h.hexdigest())


def block_hash(parent: BlockHash, tokens: Sequence[int], namespace: Namespace,
               tenant_salt: bytes, extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash of one block given its parent's hash (``ROOT_HASH`` for the first block)."""
    if len(parent) != 32:
        raise ValueError(f"parent hash must be 32 hex characters, got {len(parent)}")
    return BlockHash(_block_digest(bytes.fromhex(parent), _scope(namespace, tenant_salt), _pack_tokens(tokens),
                                   _keys(extra_keys)).hex())


def chain_hashes(tokens: Sequence[int], block_size: int, namespace: Namespace,
                 tenant_salt: bytes, extra_keys: Iterable[Sequence[str]] | None = None) -> list[BlockHash]:
    """Hashes of every *whole* block of ``tokens`` (a trailing partial block has none).

    ``extra_keys`` optionally gives per-block keys (e.g. image hashes overlapping the block).
    """
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    extras = list(extra_keys) if extra_keys is not None else []
    n = len(tokens) // block_size
    # NOTE: :func:`block_hash`'s fold, with the tokens packed once and the namespace and salt
    # framed once (block by block it cost ~11 us a block: 2.8 ms for a 4,096-token prompt on
    # every request's path).
    packed = _pack_tokens(tokens[:n * block_size])
    scope, no_keys, step = _scope(namespace, tenant_salt), _keys(()), 4 * block_size
    out: list[BlockHash] = []
    parent = bytes.fromhex(ROOT_HASH)
    for i in range(n):
        ek = extras[i] if i < len(extras) else ()
        parent = _block_digest(parent, scope, packed[i * step:(i + 1) * step], _keys(ek) if ek else no_keys)
        out.append(BlockHash(parent.hex()))
    return out


# The fields of a block hash's input, in order: domain, parent, namespace, tenant salt, tokens
# (little-endian uint32), extra keys; each length-prefixed (see the module docstring).

def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        bad = next((t for t in tokens if not (isinstance(t, int) and 0 <= t <= _MAX_TOKEN)), None)
        raise ValueError(f"token id {bad!r} is not an integer in 0..{_MAX_TOKEN}") from None


def _scope(namespace: Namespace, tenant_salt: bytes) -> bytes:
    return _field(bytes.fromhex(namespace)) + _field(tenant_salt)


def _keys(extra_keys: Sequence[str]) -> bytes:
    return _U32.pack(len(extra_keys)) + b"".join(_field(k.encode()) for k in extra_keys)


def _block_digest(parent: bytes, scope: bytes, packed_tokens: bytes, keys: bytes) -> bytes:
    return hashlib.blake2b(b"".join((_DOMAIN_BLOCK, _field(parent), scope, _field(packed_tokens), keys)),
                           digest_size=16, person=b"kvl-block").digest()


def checksum(data: bytes | memoryview) -> str:
    """Integrity checksum of cached bytes (xxh3-128 hex): detects corruption, fast."""
    return xxhash.xxh3_128_hexdigest(data)


#: Bytes of one :func:`replica_digest` (a resume's inventory is a concatenation of them).
REPLICA_DIGEST_BYTES = 8
_DOMAIN_REPLICA = b"kvl.replica.v1"


def replica_digest(block_hash: str, form: str, location: str, generation: int, checksum: str) -> bytes:
    """8 bytes naming one incarnation of one replica: its key, generation and content checksum.

    A worker resuming after an outage sends one per replica it holds instead of the replicas
    themselves (a GPU holds tens of thousands; their JSON would not fit one NATS message).
    NOTE: 64 bits are plenty against accidental collisions, and a collision could only keep a
    replica whose bytes differ — which hit validation (the checksum on read) still catches.
    """
    return replica_digests(((block_hash, form, location, generation, checksum),))[0]


def replica_digests(replicas: Iterable[tuple[str, str, str, int, str]]) -> list[bytes]:
    """:func:`replica_digest` of each ``(block_hash, form, location, generation, checksum)``.

    The same bytes, computed for many at once: BLAKE2b of the domain and the five
    length-prefixed fields in one call, the (form, location) part framed once per pool and
    each generation once.
    NOTE: a resume or an audit digests every replica a worker holds (100k at a time) on the
    coordinator's one thread; hashing field by field cost ~4 µs a replica, mostly calls.
    """
    pack, blake, domain, size = _U32.pack, hashlib.blake2b, _DOMAIN_REPLICA, REPLICA_DIGEST_BYTES
    middles: dict[tuple[str, str], bytes] = {}
    generations: dict[int, bytes] = {}
    out: list[bytes] = []
    append = out.append
    for block_hash, form, location, generation, checksum in replicas:
        middle = middles.get((form, location))
        if middle is None:
            middle = middles[(form, location)] = _field(form.encode()) + _field(location.encode())
        g = generations.get(generation)
        if g is None:
            g = generations[generation] = _field(str(generation).encode())
        b, c = block_hash.encode(), checksum.encode()
        append(blake(b"".join((domain, pack(len(b)), b, middle, g, pack(len(c)), c)), digest_size=size).digest())
    return out


def split_digests(data: bytes) -> list[bytes]:
    """The :func:`replica_digest` values concatenated in ``data`` (ValueError if it is not a whole number of them)."""
    n = REPLICA_DIGEST_BYTES
    if len(data) % n:
        raise ValueError(f"{len(data)} bytes is not a whole number of {n}-byte replica digests")
    return [data[i:i + n] for i in range(0, len(data), n)]
