"""TLS contexts from the ``tls`` config section, in one place (TLS 1.2 or newer everywhere).

* :func:`server_context` — the HTTPS listeners (worker HTTP API, coordinator admin API):
  ``None`` when ``tls.cert_file`` is empty (plain HTTP). With ``require_client_cert`` a client
  must present a certificate signed by ``tls.ca_file`` (mutual TLS).
* :func:`client_context` — NATS and PostgreSQL connections: ``None`` when ``tls.ca_file`` is
  empty, and the drivers then decide with the system CAs (nats-py: a ``tls://`` URL; asyncpg:
  ``PGSSLMODE`` / ``PGSSLROOTCERT``, default ``prefer``). When set, the peer is verified against it
  (hostname checked) and ``cert_file``/``key_file``, if set, are offered as the client
  certificate.
"""

from __future__ import annotations

import ssl
from typing import Any

from shared.config import ConfigError, TlsConfig


def _load_chain(ctx: ssl.SSLContext, tls: TlsConfig) -> None:
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"config keys tls.cert_file/tls.key_file: cannot load {tls.cert_file} with "
                          f"{tls.key_file}: {e}") from e


def _load_ca(ctx: ssl.SSLContext, tls: TlsConfig) -> None:
    try:
        ctx.load_verify_locations(cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"config key tls.ca_file: cannot load {tls.ca_file}: {e}") from e


def server_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The HTTPS listeners' context, or ``None`` for plain HTTP (no ``tls.cert_file``)."""
    if not tls.cert_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, tls)
    if tls.require_client_cert:
        _load_ca(ctx, tls)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """Context for NATS/PostgreSQL connections, or ``None`` (no ``tls.ca_file``: the URL decides)."""
    if not tls.ca_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # CERT_REQUIRED + check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(ctx, tls)
    if tls.cert_file:
        _load_chain(ctx, tls)
    return ctx


def http_scheme(tls: TlsConfig) -> str:
    return "https" if tls.cert_file else "http"


def nats_tls_kwargs(tls: TlsConfig) -> dict[str, Any]:
    """Extra ``nats.connect`` keyword arguments: ``tls=context`` when ``tls.ca_file`` is set."""
    ctx = client_context(tls)
    return {} if ctx is None else {"tls": ctx}


__all__ = ["client_context", "http_scheme", "nats_tls_kwargs", "server_context"]
