"""The status page's pure parts: the cache summary it shows (which worker reports count, the sums
and rates), and the page itself (self-contained, no way to parse network text as markup, a
Content-Security-Policy that admits exactly its own script and style). The page in a browser, on
a real stack, is tests/e2e/test_status_page.py."""

from __future__ import annotations

import base64
import hashlib
import re

from coordinator.core import expire, register_worker
from coordinator.ui import CSP, HEADERS, PAGE, cache_summary
from shared.messages import CacheCounters
from tests.unit.core.support import Driver, register


def test_the_summary_adds_up_the_current_epochs_of_alive_workers() -> None:
    d = Driver()
    for wid in ("w1", "w2", "w3"):
        d.run(register_worker, register(wid), 0)
    epochs = {wid: w.epoch for wid, w in d.state.workers.items()}
    d.run(register_worker, register("w1"), 10)        # a new process: its old epoch is fenced
    assert d.state.workers["w1"].epoch > epochs["w1"]
    reports = {
        "w1": (epochs["w1"], CacheCounters(queried=1000, hits=1000, validated=1000)),   # the old process's
        "w2": (epochs["w2"], CacheCounters(queried=300, hits=192, validated=144, fallbacks={"validation": 1})),
        "w3": (epochs["w3"], CacheCounters(queried=100, hits=0, validated=0, fallbacks={"validation": 2,
                                                                                        "grid": 1})),
    }
    out = cache_summary(d.state, reports)
    assert out == {
        "reporting": 2, "queried_tokens": 400, "hit_tokens": 192, "validated_tokens": 144,
        "hit_rate": 192 / 400, "validated_hit_rate": 144 / 400, "fallbacks": {"grid": 1, "validation": 3},
        "by_worker": [
            {"worker_id": "w2", "epoch": epochs["w2"], "queried_tokens": 300, "hit_tokens": 192,
             "validated_tokens": 144, "hit_rate": 0.64, "validated_hit_rate": 0.48, "fallbacks": {"validation": 1}},
            {"worker_id": "w3", "epoch": epochs["w3"], "queried_tokens": 100, "hit_tokens": 0,
             "validated_tokens": 0, "hit_rate": 0.0, "validated_hit_rate": 0.0,
             "fallbacks": {"grid": 1, "validation": 2}}]}

    # w3 falls silent: suspended, it still counts (its process may resume); lost, it leaves the sums
    seen = {("w1", d.state.workers["w1"].epoch): 10_000, ("w2", epochs["w2"]): 10_000}
    d.run(expire, 10_000, seen)
    assert d.state.workers["w3"].suspended and cache_summary(d.state, reports) == out
    d.run(expire, 20_000, seen | {("w2", epochs["w2"]): 20_000, ("w1", d.state.workers["w1"].epoch): 20_000})
    assert not d.state.workers["w3"].alive
    out = cache_summary(d.state, reports)
    assert [w["worker_id"] for w in out["by_worker"]] == ["w2"] and out["fallbacks"] == {"validation": 1}


def test_nothing_queried_is_no_rate_not_zero() -> None:
    d = Driver()
    d.run(register_worker, register("w1"), 0)
    assert cache_summary(d.state, {}) == {
        "reporting": 0, "queried_tokens": 0, "hit_tokens": 0, "validated_tokens": 0, "hit_rate": None,
        "validated_hit_rate": None, "fallbacks": {}, "by_worker": []}
    epoch = d.state.workers["w1"].epoch
    out = cache_summary(d.state, {"w1": (epoch, CacheCounters())})
    assert out["reporting"] == 1 and out["hit_rate"] is None and out["by_worker"][0]["validated_hit_rate"] is None


def _between(tag: str, html: str) -> list[str]:
    return re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)


def test_the_page_is_self_contained_and_never_parses_markup() -> None:
    html = PAGE.decode()
    (script,) = _between("script", html)
    (style,) = _between("style", html)
    # no asset from anywhere: no URL with a scheme or host, no src/href, no @import/url(), no font
    assert not re.search(r"https?:|//[a-z0-9]|\bsrc=|\bhref=|@import|url\(|@font-face", html, re.I), html
    # network text becomes text nodes: no API that parses a string as HTML or code
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "setAttribute(\"on", "srcdoc"):
        assert sink not in script, sink
    assert "setTimeout(refresh" in script and "sessionStorage" in script   # refreshes itself; token per tab
    # the policy admits this script and this style by hash, requests to its own origin, nothing else
    digest = {name: "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"
              for name, text in (("script", script), ("style", style))}
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives == {"default-src": "'none'", "script-src": digest["script"], "style-src": digest["style"],
                          "connect-src": "'self'", "img-src": "'none'", "base-uri": "'none'",
                          "form-action": "'none'", "frame-ancestors": "'none'"}
    assert HEADERS["Content-Security-Policy"] == CSP and HEADERS["X-Content-Type-Options"] == "nosniff"
    assert not re.search(r"\sstyle=|\son[a-z]+=", html)   # no inline attribute the policy would block
