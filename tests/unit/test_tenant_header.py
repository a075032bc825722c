"""The gateway's signed tenant header: accepted exactly when it was made with the secret for
this tenant, body and path, and recently."""

from __future__ import annotations

import pytest

from shared.tenant_header import sign, verify
from shared.tenants import AuthError

SECRET = "gw-secret"
BODY = b'{"prompt": "hi"}'


def test_a_signature_made_with_the_secret_names_its_tenant() -> None:
    sig = sign(SECRET, "alpha", "POST", "/v1/completions", BODY, 1000.0)
    assert verify(SECRET, "alpha", sig, "POST", "/v1/completions", BODY, 1010.0, 30) == "alpha"


@pytest.mark.parametrize("change", ["tenant", "body", "path", "method", "secret"])
def test_a_signature_fits_only_its_own_request(change: str) -> None:
    sig = sign(SECRET, "alpha", "POST", "/v1/completions", BODY, 1000.0)
    args = {"secret": SECRET, "tenant": "alpha", "method": "POST", "path": "/v1/completions", "body": BODY}
    args[change] = {"tenant": "beta", "body": b'{"prompt": "ho"}', "path": "/v1/chat/completions",
                    "method": "GET", "secret": "other"}[change]
    with pytest.raises(AuthError, match="does not match"):
        verify(args["secret"], args["tenant"], sig, args["method"], args["path"], args["body"], 1000.0, 30)


@pytest.mark.parametrize("now", [1031.0, 969.0])
def test_stale_or_future_signatures_are_refused(now: float) -> None:
    sig = sign(SECRET, "alpha", "POST", "/p", BODY, 1000.0)
    with pytest.raises(AuthError, match="s old"):
        verify(SECRET, "alpha", sig, "POST", "/p", BODY, now, 30)


@pytest.mark.parametrize("sig", [None, "", "v1=", "v2=1000." + "0" * 64, "v1=abc." + "0" * 64, "v1=1000.zz",
                                 "v1=1000." + "g" * 64, "v1=1000." + "é" * 64, "v1=١٠٠٠." + "0" * 64])
def test_malformed_signatures_are_a_clear_401(sig: str | None) -> None:
    with pytest.raises(AuthError, match="malformed"):
        verify(SECRET, "alpha", sig, "POST", "/p", BODY, 1000.0, 30)


@pytest.mark.parametrize("tenant", [None, "", "../x", "a" * 65, "a b"])
def test_malformed_tenants_are_refused(tenant: str | None) -> None:
    with pytest.raises(AuthError, match="malformed X-Kvl-Tenant"):
        verify(SECRET, tenant, sign(SECRET, "x", "POST", "/p", BODY, 1000.0), "POST", "/p", BODY, 1000.0, 30)


def test_without_a_secret_no_tenant_header_is_trusted() -> None:
    with pytest.raises(AuthError, match="auth.gateway_secret"):
        verify("", "alpha", sign("", "alpha", "POST", "/p", BODY, 1000.0), "POST", "/p", BODY, 1000.0, 30)
