"""The gateway's per-tenant token buckets (a pure core, clock passed in)."""

from __future__ import annotations

from gateway.limits import Admitted, Refused, TenantLimits
from shared.tenants import Tenant


def test_requests_per_second_admits_a_second_of_burst_then_429_with_retry_after() -> None:
    lim, t = TenantLimits(), Tenant("a", requests_per_second=2)
    assert all(isinstance(lim.admit(t, 10, 0.0), Admitted) for _ in range(2))
    r = lim.admit(t, 10, 0.0)
    assert isinstance(r, Refused) and r.status == 429 and r.code == "rate_limit_exceeded" and r.retry_after_s == 1
    assert isinstance(lim.admit(t, 10, 0.5), Admitted)         # half a second refills one request
    assert isinstance(lim.admit(t, 10, 0.5), Refused)


def test_tokens_per_minute_counts_the_estimate_and_refunds_what_was_not_used() -> None:
    lim, t = TenantLimits(), Tenant("a", tokens_per_minute=600)      # 10 tokens per second
    first = lim.admit(t, 400, 0.0)
    assert isinstance(first, Admitted)
    r = lim.admit(t, 400, 0.0)
    assert isinstance(r, Refused) and r.retry_after_s == 20           # 200 missing at 10/s
    lim.refund(first, 100, 0.0)                                       # it used 100 of its 400
    assert isinstance(lim.admit(t, 400, 0.0), Admitted)


def test_a_refused_request_takes_from_neither_bucket() -> None:
    lim, t = TenantLimits(), Tenant("a", requests_per_second=1, tokens_per_minute=60)
    assert isinstance(lim.admit(t, 50, 0.0), Admitted)
    assert isinstance(lim.admit(t, 50, 0.0), Refused)                 # both short
    # one second later the request bucket is full again; the token bucket holds 11 of 60
    r = lim.admit(t, 50, 1.0)
    assert isinstance(r, Refused) and "tokens per minute" in r.message and r.retry_after_s == 39
    assert isinstance(lim.admit(t, 11, 1.0), Admitted)                # the request token was not taken


def test_a_request_over_a_whole_minute_of_tokens_is_a_400_not_a_429() -> None:
    r = TenantLimits().admit(Tenant("a", tokens_per_minute=100), 101, 0.0)
    assert isinstance(r, Refused) and r.status == 400 and r.code == "tokens_over_rate_limit" and not r.retry_after_s


def test_tenants_without_limits_and_other_tenants_are_not_affected() -> None:
    lim = TenantLimits()
    assert all(isinstance(lim.admit(Tenant("free"), 10**6, 0.0), Admitted) for _ in range(1000))
    a, b = Tenant("a", requests_per_second=1), Tenant("b", requests_per_second=1)
    assert isinstance(lim.admit(a, 1, 0.0), Admitted) and isinstance(lim.admit(a, 1, 0.0), Refused)
    assert isinstance(lim.admit(b, 1, 0.0), Admitted)


def test_fractional_rates_still_admit_one_request() -> None:
    lim, t = TenantLimits(), Tenant("a", requests_per_second=0.25)
    assert isinstance(lim.admit(t, 1, 0.0), Admitted)
    r = lim.admit(t, 1, 1.0)
    assert isinstance(r, Refused) and r.retry_after_s == 3
