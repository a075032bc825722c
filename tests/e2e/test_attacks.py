"""The attacks of "identity on the bus", replayed against a stack from `kvledger up`: each is refused.

Before every participant had its own NATS user, an anonymous client on the bus of a stack
from `kvledger up` could: publish a forged READY→EVICTED transition on ``kvl.events.worker-0``;
have a forged ``lease.acquire`` granted; fence worker-0 with a forged ``worker.register`` (it
dropped its cache); send ``control`` drain / invalidate_namespace to a worker; publish a commit
watermark of seq 10^12 to worker-0; squat worker-0's next sequence numbers with 400 forgeries
on its transition subject; and ask ``kvl.worker.worker-0.debug.generate`` for another tenant's
prompt.

One stack, started the project's way (embedded PostgreSQL and NATS: the path that generates
the users and their passwords), two workers: worker-0 is the victim, warmed with a prompt;
worker-1 plays a compromised worker whose password the attacker holds. Every attack is
replayed, and each must be refused — by the server (no anonymous or wrong-password
connection; a permission violation for a subject outside the user's grant, also written to
nats-server's log) or by the coordinator (a request or transition on the sender's own subject
that speaks for another worker: ``forbidden``, logged and counted). Where it is cheap
the same channel is first shown to work for its legitimate owner, so that no refusal passes
for want of a listener. At the end nothing has changed: no event in the log, worker-0's epoch,
replicas, sequence numbers and cache as before, the audit clean.

The last test replays a hole this module found: a compromised worker publishing on its *own*
transition subject with ``Nats-Msg-Id`` set to another worker's next source id made JetStream
(whose duplicate window is stream-wide) drop the victim's real transitions for two minutes.
Message ids now end in an HMAC under a key of the worker process's own (``worker/client/nats_adapter.py``;
the observer-assisted variant is in tests/integration/test_nats_permissions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvledger.stack.probes import http_json
from shared import nats_auth
from shared.forms import FormCatalogue
from shared.messages import (CommitWatermark, Control, ErrorCode, ErrorReply, Heartbeat, HeartbeatReply,
                             InventoryRequest, LeaseAcquire, ReplicaState, TransitionEvent, WorkerRegister, decode,
                             encode)
from shared.subjects import Subjects
from tests.e2e.test_stack_supervision import complete, eventually
from tests.e2e.test_stack_up import UP_READY, UpProcess, kill_tree, kvledger, wait_outbox_empty

S = Subjects()                       # `kvledger up`'s default prefix, kvl
VICTIM, MOLE = "worker-0", "worker-1"
#: Tenant A's prompt, 72 bytes: four whole 16-token blocks are cached once it is warm.
PROMPT = "Tenant A's private prompt: the ledger records every block state change. "
#: How long a refused request waits for the answer that never comes.
REFUSED_WAIT_S = 0.5


# --- the stack -------------------------------------------------------------------------------------

@dataclass
class Target:
    up: UpProcess
    coordinator_url: str
    victim_url: str
    nats_url: str
    nats_log: Path
    coordinator_log: Path
    credentials: Path
    #: What worker-0 was before the attacks (:func:`victim_state`) and its warm prompt's cached tokens.
    baseline: dict[str, Any] = field(default_factory=dict)
    cached: int = 0

    def password(self, user: str) -> str:
        return (self.credentials / f"{user}.password").read_text().strip()

    def admin(self, path: str) -> Any:
        status, body = http_json(f"{self.coordinator_url}{path}", timeout_s=10)
        assert status == 200, (path, status, body)
        return body

    def worker_row(self, wid: str) -> dict[str, Any]:
        return next(w for w in self.admin("/v1/workers")["workers"] if w["worker_id"] == wid)

    def events_after(self, position: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            page = self.admin(f"/v1/events?after={position}&limit=1000")
            out += page["events"]
            if not page["events"]:
                return out
            position = page["next_after"]

    def replicas(self, wid: str) -> list[dict[str, Any]]:
        return self.admin(f"/v1/blocks?location=gpu:{wid}&limit=1000")["replicas"]

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the coordinator's /metrics (0 when it has none yet: counters appear at their first inc)."""
        with urllib.request.urlopen(f"{self.coordinator_url}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def coordinator_logged(self, event: str) -> list[dict[str, Any]]:
        docs = []
        for line in self.coordinator_log.read_text().splitlines():
            if line.startswith("{") and f'"{event}"' in line:
                doc = json.loads(line)
                if doc.get("event") == event:
                    docs.append(doc)
        return docs

    def nats_logged(self, what: str) -> int:
        """Lines of nats-server's log that contain ``what``."""
        return sum(what in line for line in self.nats_log.read_text().splitlines())


def victim_state(t: Target) -> dict[str, Any]:
    """What an attack on worker-0 would change: its ledger row, its replicas (minus their use
    times) and its own view of itself (/readyz)."""
    row = t.worker_row(VICTIM)
    status, ready = http_json(f"{t.victim_url}/readyz", timeout_s=10)
    replicas = sorted((r["block_hash"], r["form"], r["state"], r["generation"], r["checksum"], r["owner_epoch"])
                      for r in t.replicas(VICTIM))
    return {"row": {k: row[k] for k in ("epoch", "alive", "draining", "suspended", "namespace", "committed_seq",
                                         "registered_at_ms", "leases", "gpu_replicas")},
            "readyz": (status, ready.get("status"), ready.get("epoch"), ready.get("draining"), ready.get("pool_used")),
            "replicas": replicas}


def assert_victim_untouched(t: Target) -> None:
    before, now = t.baseline["victim"], victim_state(t)
    changed = {k: (before[k], now[k]) for k in ("row", "readyz") if now[k] != before[k]}
    if now["replicas"] != before["replicas"]:
        changed["replicas (gone, new)"] = (sorted(set(before["replicas"]) - set(now["replicas"])),
                                           sorted(set(now["replicas"]) - set(before["replicas"])))
    assert not changed, f"worker-0 changed: {changed}"
    new = t.events_after(t.baseline["position"])
    assert new == [], f"{len(new)} event(s) entered the log during the attacks: {[e['type'] for e in new][:20]}"


def _stop(up: UpProcess) -> None:
    if up.popen.poll() is None:
        tree = up.tree()
        up.popen.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):   # then by force
            up.popen.wait(60)
        up.kill_all()
        kill_tree(tree)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One stack for the module (embedded services, two workers), worker-0 warm, and the baseline."""
    up = UpProcess(tmp_path_factory.mktemp("attacks"), {"worker": {"pool_bytes": 8 * 2**20}}, "--quiet",
                   "--workers", "2")
    try:
        up.wait_for(UP_READY, timeout_s=240)
        stack = up.stack()
        svc = {s["name"]: s for s in stack["services"]}
        assert svc["nats"]["role"] == "embedded"
        t = Target(up=up, coordinator_url=stack["coordinator_url"], victim_url=stack["worker_urls"][0],
                   nats_url=svc["nats"]["url"], nats_log=Path(svc["nats"]["log"]),
                   coordinator_log=Path(svc["coordinator"]["log"]), credentials=up.state / "nats" / "credentials")
        assert svc[VICTIM]["url"] == t.victim_url
        # worker-0 warm: the prompt's four whole blocks come from its cache
        t.cached = eventually("worker-0 serves the prompt from its cache",
                              lambda: complete(t.victim_url, PROMPT) or None, timeout_s=30)
        assert t.cached == 64
        for url in stack["worker_urls"]:
            wait_outbox_empty(url)
        # every lease released, so that the log is still from here on while nobody works
        eventually("no lease left", lambda: not t.admin("/v1/leases")["leases"])
        registered = [e for e in t.events_after(0) if e["type"] == "worker.registered"
                      and e["event"]["worker_id"] == VICTIM]
        assert len(registered) == 1
        t.baseline = {"victim": victim_state(t), "position": t.events_after(0)[-1]["position"],
                      "registered": registered[0]["event"]}
        assert t.baseline["victim"]["readyz"][:2] == (200, "ready")
        assert t.baseline["victim"]["row"]["alive"] and t.baseline["victim"]["row"]["committed_seq"] > 0
        assert sum(r[2] == "READY" for r in t.baseline["victim"]["replicas"]) == 16   # 4 blocks x 4 forms
        yield t
    finally:
        _stop(up)


# --- the bus as one user ---------------------------------------------------------------------------

async def until(what: str, probe: Callable[[], Any], timeout_s: float = 10) -> Any:
    """``eventually`` for the async tests: waits without blocking their NATS connections."""
    deadline = time.monotonic() + timeout_s
    while not (got := probe()):
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)
    return got


class Conn:
    """One NATS connection as ``user``, with every asynchronous error the server sent it."""

    def __init__(self, nc: nats.NATS, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors
        #: Violations per (kind, subject) that :meth:`refused` has already accounted for.
        self._counted: dict[tuple[str, str], int] = {}

    def violations(self, kind: str, subject: str) -> int:
        """Errors 'permissions violation for <publish|subscription> to "<subject>"' (nats-py lower-cases them)."""
        want = f'nats: permissions violation for {kind} to "{subject}"'.lower()
        return sum(e.lower() == want for e in self.errors)

    async def refused(self, kind: str, subject: str, n: int = 1) -> None:
        """Since the last call for ``subject``, the server has told us ``n`` times that it is not ours."""
        await self.nc.flush()
        seen = self._counted.get((kind, subject), 0)
        with contextlib.suppress(AssertionError):
            await until(f"{n} violation(s) for {kind} to {subject}",
                        lambda: self.violations(kind, subject) >= seen + n, timeout_s=2)
        assert self.violations(kind, subject) - seen == n, (kind, subject, n, self.errors[-5:])
        self._counted[(kind, subject)] = seen + n

    async def unanswered(self, subject: str, msg: Any) -> None:
        """A request the server drops: no answer, and a permission violation."""
        with pytest.raises(nats.errors.TimeoutError):
            await self.nc.request(subject, encode(msg), timeout=REFUSED_WAIT_S)
        await self.refused("publish", subject)

    async def ask(self, subject: str, msg: Any) -> Any:
        reply = await self.nc.request(subject, encode(msg), timeout=5)
        return decode(reply.data)

    async def close(self) -> None:
        await self.nc.close()


async def connect(t: Target, user: str, password: str | None = None) -> Conn:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(t.nats_url, user=user, password=t.password(user) if password is None else password,
                            inbox_prefix=nats_auth.inbox_prefix(user), error_cb=on_error, allow_reconnect=False,
                            connect_timeout=5)
    return Conn(nc, errors)


def forged_transition(t: Target, seq: int, i: int = 0) -> TransitionEvent:
    """READY→EVICTED of one of worker-0's real replicas, in worker-0's name, at its next seq."""
    reps = [r for r in t.replicas(VICTIM) if r["state"] == "READY"]
    r = reps[i % len(reps)]
    row = t.baseline["victim"]["row"]
    return TransitionEvent(worker_id=VICTIM, epoch=row["epoch"], seq=seq, namespace=r["namespace"],
                           tenant=r["tenant"], block_hash=r["block_hash"], parent_hash=r["parent_hash"],
                           token_start=r["token_start"], token_end=r["token_end"], form=r["form"],
                           location=f"gpu:{VICTIM}", from_state=ReplicaState.READY, to_state=ReplicaState.EVICTED,
                           generation=r["generation"], checksum=r["checksum"], reason="forged by test_attacks")


def forged_register(t: Target) -> WorkerRegister:
    reg = t.baseline["registered"]
    return WorkerRegister(worker_id=VICTIM, namespace=reg["namespace"],
                          catalogue=msgspec.convert(reg["catalogue"], FormCatalogue), pool_slots=reg["pool_slots"])


def forged_acquire(t: Target) -> LeaseAcquire:
    """A lease in worker-0's name over its own warm blocks, asking to write them all again."""
    reps = [r for r in t.replicas(VICTIM) if r["form"] == "compressed"]
    blocks = [r["block_hash"] for r in sorted(reps, key=lambda r: r["token_start"])]
    row = t.baseline["victim"]["row"]
    return LeaseAcquire(worker_id=VICTIM, epoch=row["epoch"], request_id="forged", namespace=row["namespace"],
                        block_hashes=blocks, write_forms=["compressed", "indexer", "tail", "swa"], reuse=False)


async def stream_last_seq(observer: Conn) -> int:
    info = await observer.nc.jetstream(timeout=5).stream_info(S.stream_name)
    return int(info.state.last_seq)


# --- the attacks -----------------------------------------------------------------------------------

async def test_no_connection_without_a_users_password(target: Target) -> None:
    t = target
    refusals = t.nats_logged("authentication error")
    wrong = t.nats_logged(f'authentication error - User "worker.{VICTIM}"')
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(t.nats_url, allow_reconnect=False, connect_timeout=5)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await connect(t, f"worker.{VICTIM}", password="not-" + t.password(f"worker.{VICTIM}"))
    # the same server lets a user with its password in
    mole = await connect(t, f"worker.{MOLE}")
    assert mole.nc.is_connected
    await mole.close()
    await until("nats-server logged both refusals",
                lambda: t.nats_logged("authentication error") == refusals + 2
                and t.nats_logged(f'authentication error - User "worker.{VICTIM}"') == wrong + 1, timeout_s=5)
    assert_victim_untouched(t)


async def test_requests_in_another_workers_name_are_refused(target: Target) -> None:
    """On worker-0's request subjects the server drops them; on the mole's own subjects the
    coordinator answers ``forbidden`` to any message that speaks for worker-0."""
    t = target
    epoch0, epoch1 = t.baseline["victim"]["row"]["epoch"], t.worker_row(MOLE)["epoch"]
    mismatches = len(t.coordinator_logged("request_identity_mismatch"))
    mole = await connect(t, f"worker.{MOLE}")
    try:
        # its own channel works: a heartbeat of its own is answered
        assert isinstance(await mole.ask(S.request("heartbeat", MOLE), Heartbeat(worker_id=MOLE, epoch=epoch1)),
                          HeartbeatReply)
        # worker-0's subjects: never delivered
        await mole.unanswered(S.request("acquire", VICTIM), forged_acquire(t))
        await mole.unanswered(S.request("register", VICTIM), forged_register(t))
        await mole.unanswered(S.request("heartbeat", VICTIM), Heartbeat(worker_id=VICTIM, epoch=epoch0))
        # its own subjects, worker-0's name: forbidden
        for op, msg in (("acquire", forged_acquire(t)), ("register", forged_register(t)),
                        ("heartbeat", Heartbeat(worker_id=VICTIM, epoch=epoch0))):
            before = t.metric("kvl_coordinator_forbidden_messages_total", op=op)
            reply = await mole.ask(S.request(op, MOLE), msg)
            assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.FORBIDDEN, (op, reply)
            assert S.request(op, VICTIM) in reply.message
            assert t.metric("kvl_coordinator_forbidden_messages_total", op=op) == before + 1
        assert mole.errors == [f'nats: permissions violation for publish to "{S.request(op, VICTIM)}"'
                               for op in ("acquire", "register", "heartbeat")]
    finally:
        await mole.close()
    logged = t.coordinator_logged("request_identity_mismatch")[mismatches:]
    assert [(d["op"], d["subject_worker"], d["message_worker"], d["level"]) for d in logged] == \
        [(op, MOLE, VICTIM, "warning") for op in ("acquire", "register", "heartbeat")]
    for op in ("acquire", "register", "heartbeat"):
        assert t.nats_logged(f'"$G/user:worker.{MOLE}" - Publish Violation - Subject "{S.request(op, VICTIM)}"') == 1
    assert_victim_untouched(t)


async def test_forged_transitions_never_reach_the_log(target: Target) -> None:
    """worker-0's transition subject is worker-0's alone (one forged eviction, then 400 with its
    next sequence numbers and their Nats-Msg-Id: none enters the stream); a forgery on the mole's
    own subject is stored by the stream but terminated by the coordinator."""
    t = target
    committed = t.baseline["victim"]["row"]["committed_seq"]
    observer, mole = await connect(t, "observer"), await connect(t, f"worker.{MOLE}")
    seen: list[tuple[str, bytes]] = []

    async def on_event(msg: Any) -> None:
        seen.append((msg.subject, msg.data))

    try:
        await observer.nc.subscribe(S.events_wildcard, cb=on_event)
        await observer.nc.flush()
        last_seq = await stream_last_seq(observer)
        victim_subject = S.events(VICTIM)
        log_lines = t.nats_logged(f'"$G/user:worker.{MOLE}" - Publish Violation - Subject "{victim_subject}"')

        # the forged READY→EVICTED, published as a worker publishes (JetStream, with its msg id)
        forged = forged_transition(t, committed + 1)
        with pytest.raises(nats.errors.TimeoutError):
            await mole.nc.jetstream(timeout=REFUSED_WAIT_S).publish(
                victim_subject, encode(forged), headers={"Nats-Msg-Id": forged.source_id})
        await mole.refused("publish", victim_subject)

        # 400 forgeries squatting worker-0's next sequence numbers
        for i in range(400):
            f = forged_transition(t, committed + 1 + i, i)
            await mole.nc.publish(victim_subject, encode(f), headers={"Nats-Msg-Id": f.source_id})
        await mole.refused("publish", victim_subject, n=400)
        await until("nats-server logged the 401 violations",
                    lambda: t.nats_logged(f'"$G/user:worker.{MOLE}" - Publish Violation - Subject "{victim_subject}"')
                    == log_lines + 401, timeout_s=5)
        assert await stream_last_seq(observer) == last_seq

        # the same forgery on the mole's own subject: the stream takes it (its channel works) ...
        terminated = t.metric("kvl_coordinator_forbidden_messages_total", op="transition")
        malformed = len(t.coordinator_logged("malformed_transition"))
        ack = await mole.nc.jetstream(timeout=5).publish(S.events(MOLE), encode(forged))
        assert ack.seq == last_seq + 1 and await stream_last_seq(observer) == last_seq + 1
        # ... the observer sees it, and saw none of the 401 ...
        await until("the observer receives the one stored forgery", lambda: len(seen) == 1, timeout_s=5)
        assert seen == [(S.events(MOLE), encode(forged))]
        # ... and the coordinator terminates it: a transition of worker-0 on worker-1's subject
        await until("the coordinator refuses the transition",
                    lambda: t.metric("kvl_coordinator_forbidden_messages_total", op="transition") == terminated + 1,
                    timeout_s=15)
        logged = t.coordinator_logged("malformed_transition")[malformed:]
        assert [d["error_kind"] for d in logged] == ["identity_mismatch"]
        assert len(mole.errors) == 401
    finally:
        await observer.close()
        await mole.close()
    assert_victim_untouched(t)


async def test_nobody_but_the_coordinator_speaks_to_a_worker(target: Target) -> None:
    """Watermark, control, inventory: the coordinator's subjects to worker-0; and nothing of
    worker-0's (its subjects, its replies, the stream) can be read or touched by the mole."""
    t = target
    row = t.baseline["victim"]["row"]
    mole = await connect(t, f"worker.{MOLE}")
    try:
        # its own subjects it may read (it is what the real worker-1 does)
        own = await mole.nc.subscribe(f"{S.prefix}.worker.{MOLE}.>")
        await mole.nc.flush()
        assert mole.errors == []
        await own.unsubscribe()
        # and worker-0's, the coordinator's: a watermark far ahead, a drain, an invalidation, an inventory

        await mole.nc.publish(S.watermark(VICTIM), encode(CommitWatermark(worker_id=VICTIM, epoch=row["epoch"],
                                                                           seq=10**12)))
        await mole.refused("publish", S.watermark(VICTIM))
        await mole.unanswered(S.control(VICTIM), Control(action="drain", reason="forged"))
        await mole.unanswered(S.control(VICTIM), Control(action="invalidate_namespace", namespace=row["namespace"],
                                                         reason="forged"))
        await mole.unanswered(S.inventory(VICTIM), InventoryRequest(request_id="forged"))   # what it holds
        # worker-0's inbox: no forged answer to its requests
        inbox = f"{nats_auth.inbox_prefix(f'worker.{VICTIM}')}.forged"
        await mole.nc.publish(inbox, encode(ErrorReply(code=ErrorCode.FENCED, message="forged")))
        await mole.refused("publish", inbox)
        # no reading what is not its own: worker-0's subjects, everyone's replies, the requests, the transitions
        for subject in (f"{S.prefix}.worker.{VICTIM}.>", "_INBOX.>", S.requests_wildcard("register"),
                        S.events_wildcard):
            await mole.nc.subscribe(subject)
            await mole.refused("subscription", subject)
        # nor JetStream's API (no stream deletion)
        with pytest.raises(nats.errors.TimeoutError):
            await mole.nc.jetstream(timeout=REFUSED_WAIT_S).delete_stream(S.stream_name)
        await mole.refused("publish", f"$JS.API.STREAM.DELETE.{S.stream_name}")
    finally:
        await mole.close()
    for subject, n in ((S.watermark(VICTIM), 1), (S.control(VICTIM), 2), (S.inventory(VICTIM), 1)):
        assert t.nats_logged(f'"$G/user:worker.{MOLE}" - Publish Violation - Subject "{subject}"') == n
    assert t.nats_logged(f'"$G/user:worker.{MOLE}" - Subscription Violation - Subject "_INBOX.>"') == 1
    assert_victim_untouched(t)
    # worker-0 never heard of it: not draining, same epoch, cache intact (checked in victim_state)
    assert http_json(f"{t.victim_url}/readyz")[0] == 200


async def test_debug_subjects_answer_nobody_by_default(target: Target) -> None:
    """Tenant A's prompt through worker-0's debug subject: the mole and the observer may not ask;
    the operator may, but with worker.debug_subjects off (the default) nothing listens."""
    t = target
    subject = f"{S.prefix}.worker.{VICTIM}.debug.generate"
    ask = json.dumps({"tokens": list(PROMPT.encode()), "max_tokens": 1, "api_key": "sk-tenant-b"}).encode()
    mole, observer, operator = (await connect(t, f"worker.{MOLE}"), await connect(t, "observer"),
                                await connect(t, "operator"))
    try:
        for who in (mole, observer):
            with pytest.raises(nats.errors.TimeoutError):
                await who.nc.request(subject, ask, timeout=REFUSED_WAIT_S)
            await who.refused("publish", subject)
        # the operator's publish is allowed (no violation): the server answers that nobody listens
        with pytest.raises(nats.errors.NoRespondersError):
            await operator.nc.request(subject, ask, timeout=5)
        await operator.nc.flush()
        assert operator.errors == []
        # nor can the observer listen in on debug traffic (or, being no worker-0, answer it)
        debug = f"{S.prefix}.worker.*.debug.>"
        await observer.nc.subscribe(debug)
        await observer.refused("subscription", debug)
    finally:
        for c in (mole, observer, operator):
            await c.close()
    assert_victim_untouched(t)


async def test_observer_reads_and_operator_only_asks_debug_subjects(target: Target) -> None:
    """The read-only users: the observer may read the bus and JetStream's information, the
    operator JetStream's information and ask debug subjects; neither may publish any forgery."""
    t = target
    forged = forged_transition(t, t.baseline["victim"]["row"]["committed_seq"] + 1)
    sensitive = [(S.events(VICTIM), forged), (S.request("register", VICTIM), forged_register(t)),
                 (S.request("acquire", VICTIM), forged_acquire(t)),
                 (S.watermark(VICTIM), CommitWatermark(worker_id=VICTIM, epoch=forged.epoch, seq=10**12)),
                 (S.control(VICTIM), Control(action="drain", reason="forged"))]
    observer, operator = await connect(t, "observer"), await connect(t, "operator")
    try:
        # the observer may subscribe to what it observes and read JetStream's information ...
        await observer.nc.subscribe(S.events_wildcard)
        await observer.nc.subscribe(f"{S.prefix}.worker.*.watermark")
        await observer.nc.flush()
        assert observer.errors == []
        # ... but no request subject, and never in the coordinator's queue group (issue 51)
        await observer.nc.subscribe(f"{S.prefix}.req.>")
        await observer.refused("subscription", f"{S.prefix}.req.>")
        assert await stream_last_seq(observer) > 0
        assert await stream_last_seq(operator) > 0       # the operator too
        for who in (observer, operator):
            for subject, msg in sensitive:
                await who.nc.publish(subject, encode(msg))
                await who.refused("publish", subject)
            with pytest.raises(nats.errors.TimeoutError):
                await who.nc.jetstream(timeout=REFUSED_WAIT_S).delete_stream(S.stream_name)
            await who.refused("publish", f"$JS.API.STREAM.DELETE.{S.stream_name}")
        # the operator reads nothing of the bus
        await operator.nc.subscribe(S.events_wildcard)
        await operator.refused("subscription", S.events_wildcard)
    finally:
        await observer.close()
        await operator.close()
    for user in ("observer", "operator"):
        assert t.nats_logged(f'"$G/user:{user}" - Publish Violation - Subject "{S.control(VICTIM)}"') == 1
    assert_victim_untouched(t)


def test_after_the_attacks_nothing_has_changed(target: Target) -> None:
    """The log holds no event since the warm-up; worker-0 is as it was and serves its prompt from
    the same cache; its next sequence numbers are its own; the audit is clean."""
    t = target
    assert_victim_untouched(t)
    assert complete(t.victim_url, PROMPT) == t.cached
    # a new prompt: worker-0's next transitions (the seqs the forgeries tried to take) are committed
    # and reusable
    prompt = "Tenant A's second prompt, written after the attacks; all of its blocks are new. "
    complete(t.victim_url, prompt)
    assert eventually("worker-0's new blocks come from its cache", lambda: complete(t.victim_url, prompt) or None,
                      timeout_s=30) >= 64
    wait_outbox_empty(t.victim_url)
    committed = t.baseline["victim"]["row"]["committed_seq"]
    row = t.worker_row(VICTIM)
    assert row["epoch"] == t.baseline["victim"]["row"]["epoch"] and row["committed_seq"] > committed
    new = t.events_after(t.baseline["position"])
    applied = [e["source_id"] for e in new if e["type"] == "transition.applied"]
    epoch = row["epoch"]
    assert applied == [f"{VICTIM}.{epoch}.{s}" for s in range(committed + 1, row["committed_seq"] + 1)]
    # only what worker-0 just did: its leases, its new replicas
    assert {e["type"] for e in new} <= {"lease.granted", "lease.released", "replica.allocated", "transition.applied"}
    assert all("forged" not in json.dumps(e["event"]) for e in new)
    assert http_json(f"{t.victim_url}/readyz")[0] == 200
    audit = kvledger("audit", "--coordinator-url", t.coordinator_url)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "CLEAN" in audit.stdout and f"{VICTIM}, {MOLE}" in audit.stdout


async def test_a_worker_cannot_squat_another_workers_message_ids(target: Target) -> None:
    """Runs last: if the hole were open, it would stall worker-0's commits for two minutes."""
    t = target
    row = t.worker_row(VICTIM)
    committed, epoch = row["committed_seq"], row["epoch"]
    mole = await connect(t, f"worker.{MOLE}")
    try:
        js = mole.nc.jetstream(timeout=5)
        for seq in range(committed + 1, committed + 5):   # permitted subject, junk body, worker-0's msg ids
            await js.publish(S.events(MOLE), b'{"type": "junk", "v": 1}',
                             headers={"Nats-Msg-Id": f"{VICTIM}.{epoch}.{seq}"})
        assert mole.errors == []
    finally:
        await mole.close()
    prompt = "Tenant A's third prompt: its transitions carry the message ids the mole took. "
    complete(t.victim_url, prompt)
    # worker-0 resends what is not committed every 2 s: 8 s is plenty when nothing drops it
    deadline = asyncio.get_running_loop().time() + 8
    while t.worker_row(VICTIM)["committed_seq"] < committed + 4:
        assert asyncio.get_running_loop().time() < deadline, \
            f"worker-0's transitions {committed + 1}.. not committed: dropped by JetStream as duplicates"
        await asyncio.sleep(0.2)
