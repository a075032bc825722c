"""Message schemas: every type round-trips; bad input is rejected with a clear error."""

import re

import msgspec
import pytest

from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.messages import (
    BlockDrop,
    MESSAGE_TYPES, CacheCounters, CommitWatermark, Control, ControlAck, ErrorCode, ErrorReply, Heartbeat, HeartbeatReply,
    DiskBlock, DiskGc, DiskGcReply, HostEvict, HostEvictReply, InventoryItem, InventoryReply, InventoryRequest, LeaseAcquire, LeaseGrant, LeaseRelease, LeaseReleased,
    LeaseRenew, LeaseRenewed, MessageError, RegisterReply, ReplicaRef, ReplicaState, TransitionBatch, TransitionEvent,
    WorkerRegister, WorkerResume, ResumeReply, RouteCandidate, RouteQuery, RouteReply, decode, encode,
)

H = "ab" * 16
CAT = FormCatalogue(model_id="m", block_size=16, forms=(
    FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=512, dtype="float32"),
    FormSpec(name="swa", scope=FormScope.WINDOW, bytes_per_block=256, dtype="float32", window_tokens=31),
))
REF = ReplicaRef(block_hash=H, form="swa", location="gpu:w1", generation=3, checksum="c")

SAMPLES = [
    WorkerRegister(worker_id="w1", namespace=H, catalogue=CAT, pool_slots={"swa": 10}, endpoint="http://x"),
    RegisterReply(worker_id="w1", epoch=2, resume_grace_ms=60000),
    WorkerResume(worker_id="w1", epoch=2, namespace=H, catalogue=CAT, pool_slots={"swa": 10}, emitted_seq=4,
                 held=bytes(range(16))),
    ResumeReply(worker_id="w1", epoch=2, kept=1, drop=bytes(range(8)), committed_seq=4, resume_grace_ms=60000),
    Heartbeat(worker_id="w1", epoch=2, ready={"swa": 1}, running=1,
              cache=CacheCounters(queried=96, hits=64, validated=48, fallbacks={"validation": 1})),
    HeartbeatReply(committed_seq=7),
    LeaseAcquire(worker_id="w1", epoch=2, namespace=H, tenant="t", block_hashes=[H, H], write_forms=["swa"]),
    LeaseGrant(lease_id="l1", expires_at_ms=5, usable_blocks=1, read=[REF], write={"swa": [1]}, evict=[REF],
               rejected=["block 2: swa not READY"]),
    LeaseRenew(worker_id="w1", epoch=2, lease_id="l1"),
    LeaseRenewed(lease_id="l1", expires_at_ms=9),
    LeaseRelease(worker_id="w1", epoch=2, lease_id="l1"),
    LeaseReleased(lease_id="l1"),
    DiskGc(worker_id="w1", epoch=2, blocks=[DiskBlock(block_hash="ab" * 16, form="swa")]),
    DiskGcReply(evicted=0, pinned=[DiskBlock(block_hash="ab" * 16, form="swa")]),
    HostEvict(worker_id="w1", epoch=2, blocks=[DiskBlock(block_hash="ab" * 16, form="swa")]),
    HostEvict(worker_id="w1", epoch=2, blocks=[DiskBlock(block_hash="ab" * 16, form="swa")], tier="gpu"),
    HostEvictReply(evicted=1, pinned=[DiskBlock(block_hash="cd" * 16, form="tail")]),
    ErrorReply(code=ErrorCode.UNAVAILABLE, message="db down", retry_after_ms=100),
    TransitionEvent(worker_id="w1", epoch=2, seq=1, namespace=H, tenant="t", block_hash=H, parent_hash="0" * 32,
                    token_start=0, token_end=16, form="swa", location="gpu:w1", from_state=ReplicaState.ALLOCATED,
                    to_state=ReplicaState.READY, generation=3, checksum="c", lease_id="l1", reason="commit"),
    TransitionBatch(worker_id="w1", epoch=2, events=[
        TransitionEvent(worker_id="w1", epoch=2, seq=s, namespace=H, block_hash=H, parent_hash="0" * 32,
                        form="swa", location="gpu:w1", from_state=ReplicaState.ALLOCATED, generation=1)
        for s in (4, 5, 7)]),
    CommitWatermark(worker_id="w1", epoch=2, seq=9),
    InventoryRequest(request_id="a1"),
    InventoryReply(worker_id="w1", epoch=2, items=[InventoryItem(block_hash=H, form="swa", location="gpu:w1",
                                                                 generation=3, state=ReplicaState.READY)]),
    Control(action="invalidate_namespace", namespace=H, reason="upgrade"),
    Control(action="invalidate_block", block_hash=H, reason="corrupt", generations={"swa": 3}),
    Control(action="invalidate_blocks", reason="bad gpu", blocks=[BlockDrop(block_hash=H, generations={"swa": 3}),
                                                                BlockDrop(block_hash="cd" * 16)]),
    ControlAck(worker_id="w1", affected=3),
    RouteQuery(gateway_id="g1", namespace=H, block_hashes=[H, H]),
    RouteReply(workers=[RouteCandidate(worker_id="w1", endpoint="http://x", namespace=H, block_size=16,
                                       usable_blocks=2, draining=True)]),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    data = encode(msg)  # type: ignore[arg-type]
    assert decode(data) == msg
    assert decode(data, expect=type(msg)) == msg  # type: ignore[arg-type]


def test_transition_source_id() -> None:
    ev = next(m for m in SAMPLES if isinstance(m, TransitionEvent))
    assert ev.source_id == "w1.2.1"


@pytest.mark.parametrize(("data", "needle"), [
    (b'{"type":"lease.steal","v":1}', "unknown message type 'lease.steal'"),
    (b'{"type":"lease.acquire","v":99}', "schema version 99"),
    (b'{"type":"lease.acquire"}', "schema version -1"),
    # a message that is valid but for its missing version is refused too (not taken as v1)
    (b'{"type":"worker.heartbeat","worker_id":"w1","epoch":1}', "schema version -1"),
    (b"\xff\x00garbage", "not a kvledger message"),
    (b"[1,2]", "not a kvledger message"),
    (b'{"type":"lease.acquire","v":1,"worker_id":"w","epoch":0,"namespace":"' + H.encode() + b'"}', "epoch"),
    (b'{"type":"lease.acquire","v":1,"worker_id":"w","epoch":1,"namespace":"XYZ"}', "namespace"),
    (b'{"type":"lease.release","v":1,"worker_id":"w","epoch":1,"lease_id":"l","extra":1}', "unknown field `extra`"),
    (b'{"type":"transition","v":1,"worker_id":"w","epoch":1,"seq":1,"namespace":"' + H.encode()
     + b'","block_hash":"' + H.encode() + b'","parent_hash":"' + H.encode() + b'","to_state":"GONE"}', "to_state"),
    # a heartbeat's cache counters: names, counts and the number of reasons are bounded
    (b'{"type":"worker.heartbeat","v":1,"worker_id":"w","epoch":1,"cache":{"queried":-1}}', "cache.queried"),
    (b'{"type":"worker.heartbeat","v":1,"worker_id":"w","epoch":1,"cache":{"fallbacks":{"<b>":1}}}',
     "cache.fallbacks"),
    (b'{"type":"worker.heartbeat","v":1,"worker_id":"w","epoch":1,"cache":{"fallbacks":{'
     + b",".join(b'"r%d":1' % i for i in range(33)) + b'}}}', "cache.fallbacks"),
    # a control names generations of forms: a count, under a form's name
    (b'{"type":"control","v":1,"action":"invalidate_block","generations":{"swa":-1}}', "generations"),
    (b'{"type":"control","v":1,"action":"invalidate_block","generations":{"<f>":1}}', "generations"),
    # each block a control names is a block hash, with generations as above, and nothing else
    (b'{"type":"control","v":1,"action":"invalidate_blocks","blocks":[{"block_hash":"AB"}]}', "blocks[0].block_hash"),
    (b'{"type":"control","v":1,"action":"invalidate_blocks","blocks":[{"block_hash":"' + H.encode()
     + b'","generations":{"swa":-1}}]}', "blocks[0].generations"),
    (b'{"type":"control","v":1,"action":"invalidate_blocks","blocks":[{"block_hash":"' + H.encode()
     + b'","form":"swa"}]}', "form"),
    # a worker makes room only on its own tiers: host memory or its GPU pools, never the shared disk
    (b'{"type":"host.evict","v":1,"worker_id":"w","epoch":1,"tier":"disk","blocks":[{"block_hash":"' + H.encode()
     + b'","form":"swa"}]}', "tier"),
])
def test_bad_messages_rejected_with_clear_error(data: bytes, needle: str) -> None:
    with pytest.raises(MessageError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        decode(data)


_T = ('{"type":"transition","v":1,"worker_id":"%s","epoch":1,"seq":1,"namespace":"' + H + '","block_hash":"' + H
      + '","parent_hash":"' + H + '","tenant":"%s","form":"%s"}')
_A = '{"type":"lease.acquire","v":1,"worker_id":"%s","epoch":1,"namespace":"' + H + '","request_id":"%s","tenant":"%s",' \
     '"write_forms":%s}'


@pytest.mark.parametrize(("data", "needle"), [
    # the names a transition and a lease request carry are checked in __post_init__ (a cheaper
    # check than msgspec's pattern), with the same characters and lengths as every Name
    (_T % ("w 1", "default", "swa"), "worker_id: 'w 1' has a character outside"),
    (_T % ("w1", "ten/ant", "swa"), "tenant: 'ten/ant'"),
    (_T % ("w1", "default", "sw\\na"), "form: "),
    (_T % ("w1\\n", "default", "swa"), "worker_id: "),        # a newline is no name character either
    (_T % ("w1", "", "swa"), "length >= 1 - at `$.tenant`"),
    (_T % ("w" * 129, "default", "swa"), "length <= 128 - at `$.worker_id`"),
    (_A % ("w1", "r 1", "default", '["swa"]'), "request_id: 'r 1'"),
    (_A % ("w1", "r1", "dé", '["swa"]'), "tenant: 'dé'"),
    (_A % ("w1", "r1", "default", '["swa","x*"]'), "write_forms: 'x*'"),
    (_A % ("w1", "r1", "default", '[""]'), "length >= 1 - at `$.write_forms[0]`"),
])
def test_names_in_hot_messages_are_checked(data: str, needle: str) -> None:
    t = decode((_T % ("w-1.a:b_c", "default", "swa")).encode())
    a = decode((_A % ("w1", "r1", "t", '["swa"]')).encode())
    assert t.worker_id == "w-1.a:b_c" and a.write_forms == ["swa"]
    with pytest.raises(MessageError, match=re.escape(needle)):
        decode(data.encode())


def _grant(read: list[tuple[str, str]], evict: list[tuple[str, str]] = ()) -> bytes:
    ref = '{{"block_hash":"{}","form":"{}","location":"gpu:w1","generation":1,"checksum":"c"}}'
    return ('{"type":"lease.granted","v":1,"lease_id":"l1","read":[' + ",".join(ref.format(*r) for r in read)
            + '],"evict":[' + ",".join(ref.format(*r) for r in evict) + ']}').encode()


@pytest.mark.parametrize(("read", "evict", "needle"), [
    # a grant's refs are checked all at once (check_refs), each wrong one named
    ([(H, "swa"), (H, "swa"), ("AB" * 16, "swa")], [], "read[2].block_hash: expected 32 lowercase hex"),
    ([(H, "swa")], [(H, "swa"), (H, "s/a")], "evict[1].form: 's/a' has a character outside"),
    ([(H, "sw\\na")], [], "read[0].form: "),
    ([(H[:31], "swa")], [], "length >= 32 - at `$.read[0].block_hash`"),
    ([(H, "")], [], "length >= 1 - at `$.read[0].form`"),
])
def test_a_grants_refs_are_checked_when_decoded(read: list[tuple[str, str]], evict: list[tuple[str, str]],
                                                needle: str) -> None:
    good = decode(_grant([(H, "swa"), ("0" * 32, "a.b:c-d_e")], [(H, "x")]), expect=LeaseGrant)
    assert [r.form for r in good.read] == ["swa", "a.b:c-d_e"] and type(good.read[0]) is ReplicaRef
    with pytest.raises(MessageError, match=re.escape(needle)):
        decode(_grant(read, evict))


def test_a_ref_built_from_the_ledger_is_the_unchecked_base_and_checked_when_made_a_message() -> None:
    from shared.messages import ReplicaRefFields
    trusted = ReplicaRefFields(block_hash=H, form="swa", location="gpu:w1", generation=1)
    grant = LeaseGrant(lease_id="l1", read=[trusted])        # built in process: as msgspec, nothing checked
    assert decode(encode(grant), expect=LeaseGrant).read == [trusted.to_message()]
    with pytest.raises(ValueError, match="ref\\[0\\].form"):
        ReplicaRefFields(block_hash=H, form="s a", location="gpu:w1", generation=1).to_message()


def _batch_json(events: list[tuple[str, int, int]], worker: str = "w", epoch: int = 1) -> bytes:
    evs = ",".join(f'{{"type":"transition","v":1,"worker_id":"{w}","epoch":{e},"seq":{s},"namespace":"{H}",'
                   f'"block_hash":"{H}","parent_hash":"{H}"}}' for w, e, s in events)
    return f'{{"type":"transitions","v":1,"worker_id":"{worker}","epoch":{epoch},"events":[{evs}]}}'.encode()


@pytest.mark.parametrize(("events", "needle"), [
    ([], "events"),                                               # an empty batch says nothing
    ([("w", 1, 1), ("x", 1, 2)], "carries a transition of worker x"),   # speaks for another worker
    ([("w", 1, 1), ("w", 2, 2)], "epoch 2"),                      # or another epoch
    ([("w", 1, 2), ("w", 1, 2)], "seqs must increase"),           # the same seq twice
    ([("w", 1, 3), ("w", 1, 2)], "seqs must increase"),           # out of order
])
def test_bad_transition_batches_rejected(events: list[tuple[str, int, int]], needle: str) -> None:
    assert decode(_batch_json([("w", 1, 1), ("w", 1, 2)])).source_id == "w.1.1-2"
    with pytest.raises(MessageError, match=needle):
        decode(_batch_json(events))


def test_control_block_count_is_bounded() -> None:
    from shared.messages import MAX_CONTROL_BLOCKS
    one = b'{"block_hash":"' + H.encode() + b'"}'
    at = b'{"type":"control","v":1,"action":"invalidate_blocks","blocks":[%s]}'
    assert len(decode(at % b",".join([one] * MAX_CONTROL_BLOCKS)).blocks) == MAX_CONTROL_BLOCKS
    with pytest.raises(MessageError, match="blocks"):
        decode(at % b",".join([one] * (MAX_CONTROL_BLOCKS + 1)))


def test_transition_batch_size_is_bounded() -> None:
    from shared.messages import MAX_TRANSITION_BATCH
    ok = [("w", 1, s) for s in range(1, MAX_TRANSITION_BATCH + 1)]
    assert len(decode(_batch_json(ok)).events) == MAX_TRANSITION_BATCH
    with pytest.raises(MessageError, match="events"):
        decode(_batch_json(ok + [("w", 1, MAX_TRANSITION_BATCH + 1)]))


def test_expect_restricts_type() -> None:
    with pytest.raises(MessageError, match="expected a message of type"):
        decode(encode(LeaseReleased(lease_id="x")), expect=LeaseAcquire)


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        SAMPLES[1].epoch = 3  # type: ignore[misc]


def test_form_catalogue_validation() -> None:
    with pytest.raises(ValueError, match="window_tokens"):
        FormSpec(name="swa", scope=FormScope.WINDOW, bytes_per_block=1, dtype="float32")
    with pytest.raises(ValueError, match="duplicate"):
        FormCatalogue(model_id="m", block_size=16, forms=(CAT.forms[0], CAT.forms[0]))
    with pytest.raises(KeyError, match="not declared"):
        CAT.get("tail")
    assert CAT.window_blocks(CAT.get("swa")) == 2


def test_spec_digest_tracks_meaning() -> None:
    base = FormSpec(name="tail", scope=FormScope.RESUME_POINT, bytes_per_block=64, dtype="float32",
                    params={"ratio": 4})
    assert base.spec_digest == msgspec.json.decode(msgspec.json.encode(base), type=FormSpec).spec_digest
    for change in (dict(dtype="bfloat16"), dict(layout_version=2), dict(params={"ratio": 16}),
                   dict(bytes_per_block=128)):
        assert msgspec.structs.replace(base, **change).spec_digest != base.spec_digest


def test_deeply_nested_json_is_a_message_error_not_a_crash() -> None:
    deep = b'{"type": "lease.acquire", "v": 1, "worker_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(MessageError, match="maximum recursion depth"):
        decode(deep, expect=LeaseAcquire)
