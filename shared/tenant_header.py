"""The tenant a gateway vouches for, in two headers a client cannot forge.

The gateway checks a request's API key, then forwards it to a worker *without* the key, with
``X-Kvl-Tenant: <tenant>`` and ``X-Kvl-Tenant-Signature: v1=<unix seconds>.<hex>``: an
HMAC-SHA256, under ``auth.gateway_secret`` (shared by gateways and workers, never by
clients), of the tenant, the time, the method, the path and the SHA-256 of the body. A worker
with the secret accepts the tenant when the signature matches and is at most
``auth.gateway_signature_max_age_ms`` old; anything else that carries ``X-Kvl-Tenant`` is a 401.

What it gives and what it does not:

* A client cannot name a tenant: without the secret it cannot sign, and a signature binds
  one tenant, one body, one path — a captured header does not fit another request.
* Replay of a *whole* captured request (same body) within the age window is not prevented:
  it redoes that tenant's own request. Run gateway→worker traffic over TLS (``tls.*``) where
  the network between them is not trusted.
* With no ``auth.gateway_secret``, the gateway forwards the client's ``Authorization``
  header instead and each worker checks the key itself (the same key config).
"""

from __future__ import annotations

import hashlib
import hmac

from shared.tenants import TENANT_NAME, AuthError

TENANT_HEADER = "X-Kvl-Tenant"
SIGNATURE_HEADER = "X-Kvl-Tenant-Signature"
_VERSION = "v1"


def _mac(secret: str, tenant: str, ts: int, method: str, path: str, body: bytes) -> str:
    msg = "\n".join(("kvl-tenant-v1", tenant, str(ts), method.upper(), path, hashlib.sha256(body).hexdigest()))
    return hmac.new(secret.encode(), msg.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, tenant: str, method: str, path: str, body: bytes, now_s: float) -> str:
    """The signature header's value for this request (``path`` with its query string)."""
    ts = int(now_s)
    return f"{_VERSION}={ts}.{_mac(secret, tenant, ts, method, path, body)}"


def verify(secret: str, tenant: str | None, signature: str | None, method: str, path: str, body: bytes,
           now_s: float, max_age_s: float) -> str:
    """The tenant, when ``signature`` vouches for it; :class:`AuthError` (a 401) otherwise."""
    if not secret:
        raise AuthError(f"{TENANT_HEADER} is accepted only from a gateway, and this worker has no "
                        f"auth.gateway_secret: send 'Authorization: Bearer <key>' instead")
    if not tenant or not TENANT_NAME.fullmatch(tenant):
        raise AuthError(f"malformed {TENANT_HEADER} header")
    version, _, rest = (signature or "").partition("=")
    ts_text, _, mac = rest.partition(".")
    if version != _VERSION or not ts_text.isascii() or not ts_text.isdigit() or len(mac) != 64 \
            or mac.strip("0123456789abcdef"):
        raise AuthError(f"missing or malformed {SIGNATURE_HEADER} header")
    ts = int(ts_text)
    if abs(now_s - ts) > max_age_s:
        # NOTE: both directions: a gateway clock far ahead of the worker's is as wrong as a stale one
        raise AuthError(f"{SIGNATURE_HEADER} is {int(now_s - ts)} s old (at most {max_age_s:g} s accepted; "
                        f"check the clocks of gateway and worker)")
    if not hmac.compare_digest(mac, _mac(secret, tenant, ts, method, path, body)):
        raise AuthError(f"{SIGNATURE_HEADER} does not match this request (a different secret, body or path)")
    return tenant


__all__ = ["SIGNATURE_HEADER", "TENANT_HEADER", "sign", "verify"]
