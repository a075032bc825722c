"""NATS identities in a sharded ledger, against a real nats-server configured by ``shared.nats_auth``:
each shard's coordinator (``coordinator``, ``coordinator.s1``) acts only under its own shard's
prefix; a worker and a gateway speak to every shard, each still only as itself; a shard's
coordinator refuses to start as another shard's identity, and the right one serves its shard."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import nats
import pytest
import yaml

from coordinator.nats_service import StartupError
from coordinator.runtime import Coordinator
from shared import nats_auth
from shared.config import parse_config
from shared.embedded import EmbeddedNats
from shared.logging import get_logger
from shared.messages import RegisterReply
from shared.nats_auth import CredentialStore, Identity
from shared.shards import map_bucket, shard_subjects
from shared.subjects import COORDINATOR_QUEUE, Subjects
from tests.integration.coordinator_kit import Worker, fast_config, running_coordinator
from tests.integration.test_nats_permissions import connect, settle

SUBJECTS = Subjects("kvlshid")
S1 = shard_subjects(SUBJECTS.prefix, 1)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, CredentialStore]]:
    root = tmp_path_factory.mktemp("nats-shards")
    store = CredentialStore(root / "credentials")
    conf = store.write_server_config([nats_auth.worker("w0"), nats_auth.gateway("g0")], SUBJECTS, shards=2)
    srv = EmbeddedNats(root / "nats", config_file=str(conf)).start()
    yield srv, store
    srv.stop()


def test_shard_coordinator_identities() -> None:
    assert nats_auth.coordinator(0) == Identity("coordinator") and nats_auth.coordinator(0).shard == 0
    s3 = nats_auth.coordinator(3)
    assert (s3.user, s3.shard, Identity.parse("coordinator.s3")) == ("coordinator.s3", 3, s3)
    for bad in ("coordinator.s0", "coordinator.x1", "coordinator.s01"):
        with pytest.raises(nats_auth.AuthConfigError, match="coordinator.s<shard>"):
            Identity.parse(bad)
    # one shard: every grant exactly as before sharding
    for ident in (Identity("coordinator"), nats_auth.worker("w0"), nats_auth.gateway("g0"), Identity("observer")):
        assert nats_auth.permissions(ident, SUBJECTS, 1) == nats_auth.permissions(ident, SUBJECTS)
    two = nats_auth.permissions(nats_auth.worker("w0"), SUBJECTS, 2)
    b = map_bucket(SUBJECTS.prefix)
    # each shard's subjects, and reading the shard map (a worker routes its leases by it), not writing it
    assert two["publish"]["allow"] == [f"{SUBJECTS.prefix}.req.w0.*", f"{SUBJECTS.prefix}.events.w0",
                                       f"{S1.prefix}.req.w0.*", f"{S1.prefix}.events.w0",
                                       f"$JS.API.STREAM.INFO.KV_{b}", f"$JS.API.DIRECT.GET.KV_{b}.>",
                                       f"$JS.API.STREAM.MSG.GET.KV_{b}"]


async def _tries(srv: EmbeddedNats, store: CredentialStore, ident: Identity, *, pub: list[str] = (),
                 sub: list[str] = (), queue: list[str] = (), refused: int) -> set[tuple[str, str, str]]:
    """Publish, subscribe and subscribe in the coordinators' queue group as ``ident``; the server's refusals."""
    conn = await connect(srv, store, ident)
    try:
        for s in pub:
            await conn.nc.publish(s, b"{}")
        for s in sub:
            await conn.nc.subscribe(s)
        for s in queue:
            await conn.nc.subscribe(s, queue=COORDINATOR_QUEUE)
        await settle(conn, refused)
        return conn.refused()
    finally:
        await conn.nc.close()


async def test_each_shard_coordinator_acts_under_its_own_prefix_and_the_others_under_every_shard(
        secured: tuple[EmbeddedNats, CredentialStore]) -> None:
    srv, store = secured
    p, p1 = SUBJECTS.prefix, S1.prefix
    got = await _tries(srv, store, nats_auth.coordinator(1), pub=[f"{p1}.worker.w0.control", f"{p}.worker.w0.control"],
                       queue=[f"{p1}.req.*.*", f"{p1}.route.*", f"{p}.req.*.*", f"{p}.route.*"], refused=3)
    assert got == {("publish", f"{p}.worker.w0.control", ""), ("subscription", f"{p}.req.*.*", COORDINATOR_QUEUE),
                   ("subscription", f"{p}.route.*", COORDINATOR_QUEUE)}, got
    got = await _tries(srv, store, nats_auth.coordinator(0), pub=[f"{p1}.worker.w0.control", f"{p}.worker.w0.control"],
                       queue=[f"{p}.req.*.*", f"{p1}.req.*.*"], refused=2)
    assert got == {("publish", f"{p1}.worker.w0.control", ""),
                   ("subscription", f"{p1}.req.*.*", COORDINATOR_QUEUE)}, got
    got = await _tries(srv, store, nats_auth.worker("w0"),
                       pub=[f"{p}.req.w0.acquire", f"{p1}.req.w0.acquire", f"{p}.events.w0", f"{p1}.events.w0",
                            f"{p1}.req.w1.acquire", f"{p1}.events.w1"],
                       sub=[f"{p}.worker.w0.>", f"{p1}.worker.w0.>", f"{p1}.worker.w1.>"], refused=3)
    assert got == {("publish", f"{p1}.req.w1.acquire", ""), ("publish", f"{p1}.events.w1", ""),
                   ("subscription", f"{p1}.worker.w1.>", "")}, got
    b = map_bucket(p)
    got = await _tries(srv, store, nats_auth.gateway("g0"), pub=[f"{p}.route.g0", f"{p1}.route.g0", f"{p1}.route.g1",
                                                                 f"$JS.API.STREAM.INFO.KV_{b}", f"$KV.{b}.map"],
                       refused=2)
    assert got == {("publish", f"{p1}.route.g1", ""), ("publish", f"$KV.{b}.map".lower(), "")}, got   # (lower case, as nats-py has it)


def _as(config: Any, ident: Identity, store: CredentialStore) -> Any:
    doc = msgspec.to_builtins(config)
    return parse_config({**doc, "nats": {**doc["nats"], "user": ident.user, "password_file": str(store.path(ident))}})


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}


async def test_shard_one_starts_only_as_its_own_identity_and_then_serves_its_shard(
        secured: tuple[EmbeddedNats, CredentialStore], database_url: str, tmp_path: Any) -> None:
    srv, store = secured
    cfg = fast_config(database_url, srv.url, SUBJECTS, shards=2, shard=1)
    wrong = Coordinator(_as(cfg, Identity("coordinator"), store), database_url=database_url, nats_url=srv.url,
                        logger=get_logger("test"))
    with pytest.raises(StartupError, match="the coordinator of shard 1 connects as 'coordinator.s1', not 'coordinator'"):
        await wrong.start()
    await wrong.event_log.close()
    async with running_coordinator(_as(cfg, nats_auth.coordinator(1), store)):
        w0 = nats_auth.worker("w0")

        nc = await nats.connect(srv.url, user=w0.user, password=store.password(w0),
                                inbox_prefix=nats_auth.inbox_prefix(w0.user))
        try:
            reply = await Worker(nc, S1, "w0").register()
            assert isinstance(reply, RegisterReply) and reply.epoch == 1
        finally:
            await nc.drain()
        # the coordinator stored the config's map; the operator reads it and writes its next version
        op = Identity("operator")
        conf = tmp_path / "operator.yaml"
        conf.write_text(yaml.safe_dump({"nats": {"url": srv.url, "subject_prefix": SUBJECTS.prefix, "user": op.user,
                                                 "password_file": str(store.path(op))},
                                        "coordinator": {"shards": 2, "shard_partitions": 16}}))
        for args, version in ((["show"], 1), (["freeze", "3", "--to", "0"], 2), (["open", "3"], 3)):
            out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kvledger", "shard", *args, "--json",
                                                           "--config", str(conf)], capture_output=True, text=True,
                                          env=_env(), timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            assert json.loads(out.stdout)["map"]["version"] == version
    js = (await nats.connect(srv.url, user="coordinator", password=store.password(Identity("coordinator")),
                             inbox_prefix=nats_auth.inbox_prefix("coordinator")))
    try:
        await js.jetstream().delete_key_value(map_bucket(SUBJECTS.prefix))
    finally:
        await js.drain()


def test_nats_auth_cli_writes_every_shards_users() -> None:
    """``kvledger nats-auth --shards 2``: the same grants as ``server_config`` with a coordinator per shard."""
    env = _env()
    out = subprocess.run([sys.executable, "-m", "kvledger", "nats-auth", "--shards", "2", "--worker", "w0",
                          "--prefix", SUBJECTS.prefix], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    idents = [*nats_auth.STANDARD, nats_auth.coordinator(1), nats_auth.worker("w0")]
    assert nats_auth.server_config({i: nats_auth.password_env(i) for i in idents}, SUBJECTS, 2) in out.stdout
    bad = subprocess.run([sys.executable, "-m", "kvledger", "nats-auth", "--shards", "0"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "a number of shards from 1 to 1024" in bad.stderr and "Traceback" not in bad.stderr
