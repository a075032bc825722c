"""Optional TLS from the ``tls`` config section (shared/tls.py).

Certificates come from the ``openssl`` CLI (a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate). Covered end to end: the worker HTTP API (``start_http``)
and the coordinator's admin API (``coordinator.app.admin_site`` on the real app) over HTTPS,
mutual TLS, and NATS over TLS against an embedded nats-server started with a certificate.
PostgreSQL: against an embedded server started with a certificate, both connection paths (the
pool, migrations included, and the leader's lock connection) run over verified TLS; against the
shared test server (no TLS) they refuse to go on in plain text.
"""

from __future__ import annotations

import contextlib
import shutil
import ssl
import subprocess
import uuid
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from aiohttp import web

from coordinator.log.leader import LeaderElection, make_holder_id
from coordinator.log.postgres import PgSettings, PostgresEventLog
from shared.config import ConfigError, TlsConfig, parse_config
from shared.embedded import EmbeddedNats, free_port
from shared.subjects import Subjects
from shared.tls import client_context, http_scheme, nats_tls_kwargs, server_context
from tests.integration.coordinator_kit import fast_config, wait_ready
from worker.client.nats_adapter import NatsCoordinatorClient

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvl-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(f"{ext}\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
                                       "basicConstraints=CA:FALSE\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvl-test-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    # another CA, to show that a certificate it signs is not trusted
    _openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.pem", "-days", "2", "-subj", "/CN=other",
             cwd=d)
    return {k: str(d / f"{k}.{ext}") for k, ext in (
        ("ca", "pem"), ("server", "pem"), ("client", "pem"), ("other", "pem"))} | {
        "server_key": str(d / "server.key"), "client_key": str(d / "client.key")}


def client_ssl(certs: dict[str, str], *, cert: bool = False, ca: str = "ca") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs[ca])
    if cert:
        ctx.load_cert_chain(certs["client"], certs["client_key"])
    return ctx


def tls_section(certs: dict[str, str], **over: Any) -> dict[str, Any]:
    return {"cert_file": certs["server"], "key_file": certs["server_key"], **over}


# --- the contexts -------------------------------------------------------------------------------

def test_contexts_from_config(certs: dict[str, str]) -> None:
    assert server_context(TlsConfig()) is None and client_context(TlsConfig()) is None
    assert http_scheme(TlsConfig()) == "http" and nats_tls_kwargs(TlsConfig()) == {}
    tls = TlsConfig(**tls_section(certs))
    srv = server_context(tls)
    assert srv is not None and srv.minimum_version == ssl.TLSVersion.TLSv1_2 and srv.verify_mode == ssl.CERT_NONE
    assert http_scheme(tls) == "https"
    assert client_context(tls) is None   # no ca_file: the URL decides
    mtls = TlsConfig(**tls_section(certs, ca_file=certs["ca"], require_client_cert=True))
    srv = server_context(mtls)
    assert srv is not None and srv.verify_mode == ssl.CERT_REQUIRED
    cli = client_context(mtls)
    assert cli is not None and cli.check_hostname and cli.verify_mode == ssl.CERT_REQUIRED
    assert cli.minimum_version == ssl.TLSVersion.TLSv1_2
    assert list(nats_tls_kwargs(mtls)) == ["tls"] and isinstance(nats_tls_kwargs(mtls)["tls"], ssl.SSLContext)


def test_unloadable_pem_is_a_config_error(certs: dict[str, str], tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="tls.cert_file/tls.key_file: cannot load"):
        server_context(TlsConfig(cert_file=str(junk), key_file=certs["server_key"]))
    with pytest.raises(ConfigError, match="tls.cert_file/tls.key_file: cannot load"):  # key of another cert
        server_context(TlsConfig(cert_file=certs["server"], key_file=certs["client_key"]))
    with pytest.raises(ConfigError, match="tls.ca_file: cannot load"):
        client_context(TlsConfig(ca_file=str(junk)))


# --- the worker HTTP API --------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def worker_http(tmp_path: Path, tls: dict[str, Any]) -> AsyncIterator[str]:
    """``start_http`` on a twin-backed engine (as tests/serving does); yields the base URL."""
    from tests.serving.conftest import config
    from tests.twin import InProcessCoordinator
    from worker.engine import Engine
    from worker.http_server import bound_address, start_http
    from worker.model import build_model

    cfg = config(tmp_path, tls=tls)
    engine = Engine(build_model(seed=0), cfg, InProcessCoordinator())
    await engine.start()
    try:
        runner = await start_http(engine, cfg)
        try:
            host, port = bound_address(runner)
            yield f"{host}:{port}"
        finally:
            await runner.cleanup()
    finally:
        await engine.stop()


async def get(url: str, ssl_: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url, ssl=ssl_) as r:
        return r.status, await r.text()


async def test_worker_http_over_https(certs: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    async with worker_http(tmp_path, tls_section(certs)) as addr:
        assert f"listening on https://{addr}" in capsys.readouterr().out
        assert (await get(f"https://{addr}/healthz", client_ssl(certs)))[0] == 200
        with pytest.raises(aiohttp.ClientError):          # plain HTTP is not served
            await get(f"http://{addr}/healthz")
        with pytest.raises(aiohttp.ClientConnectorCertificateError):   # a CA that did not sign it
            await get(f"https://{addr}/healthz", client_ssl(certs, ca="other"))
        ctx = ssl.create_default_context(cafile=certs["ca"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.maximum_version = ssl.TLSVersion.TLSv1_1
        with pytest.raises(aiohttp.ClientError):          # TLS 1.2 is the floor
            await get(f"https://{addr}/healthz", ctx)


async def test_worker_http_mutual_tls(certs: dict[str, str], tmp_path: Path) -> None:
    async with worker_http(tmp_path, tls_section(certs, ca_file=certs["ca"], require_client_cert=True)) as addr:
        assert (await get(f"https://{addr}/healthz", client_ssl(certs, cert=True)))[0] == 200
        with pytest.raises(aiohttp.ClientError):          # no client certificate
            await get(f"https://{addr}/healthz", client_ssl(certs))


async def test_worker_http_stays_plain_without_tls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with worker_http(tmp_path, {}) as addr:
        assert f"listening on http://{addr}" in capsys.readouterr().out
        assert (await get(f"http://{addr}/healthz"))[0] == 200


# --- the coordinator's admin API ------------------------------------------------------------------

async def test_admin_api_over_https(certs: dict[str, str], database_url: str, nats_url: str,
                                    subjects: Subjects) -> None:
    """The real coordinator app, its listener made by ``admin_site`` as ``serve()`` makes it."""
    from coordinator.app import admin_site, create_app

    base = fast_config(database_url, nats_url, subjects)
    cfg = parse_config({**_as_doc(base), "tls": tls_section(certs)})
    app = create_app(cfg)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        port = free_port()
        site = admin_site(runner, cfg, "127.0.0.1", port)
        await site.start()
        assert (await get(f"https://127.0.0.1:{port}/healthz", client_ssl(certs)))[0] == 200
        with pytest.raises(aiohttp.ClientError):
            await get(f"http://127.0.0.1:{port}/healthz")
        # the plain config still makes a plain listener
        plain_port = free_port()
        await admin_site(runner, base, "127.0.0.1", plain_port).start()
        await wait_ready(f"http://127.0.0.1:{plain_port}")
    finally:
        await runner.cleanup()


def _as_doc(cfg: Any) -> dict[str, Any]:
    from shared.config import to_dict
    return to_dict(cfg)


# --- NATS -------------------------------------------------------------------------------------------

@pytest.fixture
def tls_nats(certs: dict[str, str], tmp_path: Path) -> Any:
    srv = EmbeddedNats(tmp_path / "nats", tls_cert=certs["server"], tls_key=certs["server_key"]).start()
    try:
        yield srv
    finally:
        srv.stop()


async def test_nats_over_tls(certs: dict[str, str], tls_nats: EmbeddedNats) -> None:
    assert tls_nats.url.startswith("tls://")
    tls = parse_config({"tls": {"ca_file": certs["ca"]}}).tls
    # the coordinator's connect (runtime.py: **nats_tls_kwargs(config.tls))
    nc = await nats.connect(tls_nats.url, connect_timeout=5, allow_reconnect=False, **nats_tls_kwargs(tls))
    try:
        assert nc.is_connected
    finally:
        await nc.close()
    # the worker's client
    client = NatsCoordinatorClient(tls_nats.url, Subjects("tlstest"), tls=client_context(tls))
    await client.connect()
    try:
        assert client.connected
    finally:
        await client.close()
    # without the context nats-py verifies against the system CAs, which do not know the test CA
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(tls_nats.url, connect_timeout=5, allow_reconnect=False)


async def test_nats_mutual_tls(certs: dict[str, str], tmp_path: Path) -> None:
    srv = EmbeddedNats(tmp_path / "nats", tls_cert=certs["server"], tls_key=certs["server_key"],
                       tls_ca=certs["ca"]).start()
    try:
        # cert_file/key_file are offered as the client certificate
        with_cert = client_context(TlsConfig(**tls_section(certs, ca_file=certs["ca"])))
        nc = await nats.connect(srv.url, connect_timeout=5, allow_reconnect=False, tls=with_cert)
        await nc.close()
        without = client_context(TlsConfig(ca_file=certs["ca"]))
        with pytest.raises(Exception):  # noqa: B017 - the server closes the handshake
            await nats.connect(srv.url, connect_timeout=5, allow_reconnect=False, tls=without)
    finally:
        srv.stop()


# --- PostgreSQL ----------------------------------------------------------------------------------------

async def test_postgres_connections_carry_the_context(certs: dict[str, str], database_url: str) -> None:
    """The test server speaks no TLS (or a certificate the test CA did not sign): with
    ``tls.ca_file`` set, the pool and the lock connection both refuse it; without, they connect."""
    cfg = parse_config({"database": {"url": database_url, "connect_timeout_ms": 2000},
                        "tls": {"ca_file": certs["ca"]}})
    settings = PgSettings.from_config(database_url, cfg.database, tls=cfg.tls)
    assert isinstance(settings.ssl, ssl.SSLContext)
    log = PostgresEventLog.connect(settings)
    try:
        with pytest.raises(Exception) as pooled:  # noqa: B017
            await log.ping()
        assert "ssl" in repr(pooled.value).lower() or "certificate" in repr(pooled.value).lower(), pooled.value
    finally:
        await log.close()
    election = LeaderElection(settings, make_holder_id(), renew_interval_s=1, takeover_after_s=5)
    with pytest.raises(Exception) as lock:  # noqa: B017
        await election._connect()
    assert "ssl" in repr(lock.value).lower() or "certificate" in repr(lock.value).lower(), lock.value

    plain = PgSettings.from_config(database_url, cfg.database, tls=TlsConfig())
    assert plain.ssl is None
    log = PostgresEventLog.connect(plain)
    try:
        await log.ping()
    finally:
        await log.close()
    conn = await LeaderElection(plain, make_holder_id(), renew_interval_s=1, takeover_after_s=5)._connect()
    await conn.close()


async def test_coordinator_nats_connect_uses_the_ca(certs: dict[str, str], tls_nats: EmbeddedNats,
                                                    database_url: str) -> None:
    """``Coordinator.start``: with ``tls.ca_file`` it gets past NATS (what stops it, if anything, is
    this test's PostgreSQL without TLS); without, the TLS-only NATS refuses it."""
    from coordinator.nats_service import StartupError
    from coordinator.runtime import Coordinator
    from shared.logging import get_logger

    base = _as_doc(fast_config(database_url, tls_nats.url, Subjects(f"tls{uuid.uuid4().hex[:8]}")))
    for tls, nats_ok in (({"ca_file": certs["ca"]}, True), ({}, False)):
        cfg = parse_config({**base, "tls": tls})
        coord = Coordinator(cfg, database_url=database_url, nats_url=tls_nats.url, logger=get_logger("test"))
        try:
            try:
                await coord.start()
            except StartupError as e:
                assert ("cannot connect to NATS" in str(e)) != nats_ok, e
            if nats_ok:
                assert coord.nc is not None and coord.nc.is_connected
            else:
                assert coord.nc is None
        finally:
            await coord.stop()


async def test_postgres_over_tls_end_to_end(certs: dict[str, str], tmp_path: Path) -> None:
    """A PostgreSQL that offers TLS: with ``tls.ca_file`` the pool (migrations included) and the
    leader's lock connection run encrypted, the server's certificate verified (``pg_stat_ssl``
    says so for each session); a CA that did not sign it is refused; without the section the same
    server is used in plain text, as the URL says."""
    from sqlalchemy import text

    from coordinator.log.migrate import upgrade
    from shared.embedded import EmbeddedPostgres

    # pgserver's bundled PostgreSQL is built without TLS: a system build (Debian's) is needed
    builds = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not builds:
        pytest.skip("needs a PostgreSQL build with TLS support under /usr/lib/postgresql (pgserver's has none)")
    pg = EmbeddedPostgres(tmp_path / "pg", tls_cert=certs["server"], tls_key=certs["server_key"],
                          binaries=str(builds[-1].parent)).start()
    query = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
    try:
        def settings(tls: dict[str, Any]) -> PgSettings:
            cfg = parse_config({"database": {"url": pg.url, "connect_timeout_ms": 3000}, "tls": tls})
            return PgSettings.from_config(pg.url, cfg.database, tls=cfg.tls)

        log = PostgresEventLog.connect(settings({"ca_file": certs["ca"]}))
        try:
            assert await upgrade(log.engine, "head")
            async with log.engine.connect() as conn:
                assert (await conn.execute(text(query))).scalar_one() is True
        finally:
            await log.close()
        lock = await LeaderElection(settings({"ca_file": certs["ca"]}), make_holder_id(), renew_interval_s=1,
                                    takeover_after_s=5)._connect()
        try:
            assert await lock.fetchval(query) is True
        finally:
            await lock.close()
        log = PostgresEventLog.connect(settings({"ca_file": certs["other"]}))
        try:
            with pytest.raises(Exception) as refused:  # noqa: B017
                await log.ping()
            assert "certificate" in repr(refused.value).lower(), refused.value
        finally:
            await log.close()
    finally:
        pg.stop()
