"""Every pattern that validates an input matches the whole value: Python's ``$`` also matches
before a trailing newline, so ``^…$`` (msgspec's ``pattern`` searches with ``re``) let a name,
a hash or a subject token through with a newline after it. Patterns end in ``\\Z``."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from coordinator import admin
from shared import messages as m
from shared.config import parse_config
from shared.nats_auth import EnvRef, Identity
from shared.subjects import Subjects
from worker.cache.offload_key import check_token

ROOT = Path(__file__).resolve().parents[2]
NS = "0" * 32


def _acquire(**kw: object) -> bytes:
    body = {"type": "lease.acquire", "v": 1, "worker_id": "w1", "epoch": 1, "request_id": "r1", "namespace": NS,
            "block_hashes": [], "write_forms": [], "reuse": True} | kw
    return msgspec.json.encode(body)


def _renew(**kw: object) -> bytes:
    return msgspec.json.encode({"type": "lease.renew", "v": 1, "worker_id": "w1", "epoch": 1, "lease_id": "L1"} | kw)


@pytest.mark.parametrize("make", [
    lambda v: _renew(worker_id=v),                  # Name, by msgspec's pattern
    lambda v: _renew(lease_id=v),
    lambda v: _acquire(worker_id=v),                # Name's characters, by check_names
])
def test_a_name_with_a_trailing_newline_is_refused_on_the_wire(make):
    m.decode(make("w1"))
    with pytest.raises(m.MessageError):
        m.decode(make("w1\n"))


def test_a_hash_with_a_trailing_newline_is_refused_on_the_wire():
    m.decode(_acquire(namespace=NS))
    with pytest.raises(m.MessageError):
        m.decode(_acquire(namespace=NS + "\n"))


@pytest.mark.parametrize("section, key, good", [
    ("nats", "subject_prefix", "kvl.t1"),
    ("nats", "user", "worker.w1"),
    ("tracing", "service_name", "kvledger"),
])
def test_a_config_value_with_a_trailing_newline_is_refused(section, key, good):
    parse_config({section: {key: good}})
    with pytest.raises(Exception, match=key):
        parse_config({section: {key: good + "\n"}})


def test_an_api_key_with_a_trailing_newline_is_refused():
    key = {"key_sha256": "a" * 64, "tenant": "t1"}
    parse_config({"auth": {"keys": [key]}})
    for field in key:
        with pytest.raises(Exception, match=field):
            parse_config({"auth": {"keys": [key | {field: key[field] + "\n"}]}})


def test_subject_tokens_and_identities_refuse_a_trailing_newline():
    Subjects("kvl").control("w1")
    with pytest.raises(ValueError):
        Subjects("kvl\n")
    with pytest.raises(ValueError):
        Subjects("kvl").control("w1\n")
    Identity("worker", "w1")
    with pytest.raises(ValueError):
        Identity("worker", "w1\n")
    EnvRef("KVL_PASS")
    with pytest.raises(ValueError):
        EnvRef("KVL_PASS\n")


def test_offload_path_tokens_and_admin_parameters_refuse_a_trailing_newline():
    check_token("tenant", "t1")
    with pytest.raises(ValueError):
        check_token("tenant", "t1\n")
    for pattern, good in ((admin.HEX32, NS), (admin.NAME, "w1"), (admin.CURSOR, "ab")):
        assert pattern.fullmatch(good) and pattern.match(good)
        assert not pattern.match(good + "\n")      # also as a prefix match, as msgspec runs it
    msgspec.convert({"state": "off", "namespace": NS}, admin.CacheSwitchBody)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"state": "off", "namespace": NS + "\n"}, admin.CacheSwitchBody)


def _patterns(doc: object) -> set[str]:
    if isinstance(doc, dict):
        return {v for k, v in doc.items() if k == "pattern"} | {p for v in doc.values() for p in _patterns(v)}
    if isinstance(doc, list):
        return {p for v in doc for p in _patterns(v)}
    return set()


def test_the_admin_openapi_document_publishes_each_pattern_with_the_ecma_anchor():
    """JSON Schema patterns are ECMA-262 regexes: there ``$`` anchors at the end of the input (what
    ``\\Z`` does in Python) and ``\\Z`` is no anchor at all."""
    validating = {admin.HEX32.pattern, admin.NAME.pattern, admin.CURSOR.pattern, r"^(?:[0-9a-f]{32})?\Z"}
    published = _patterns(admin.openapi_document())
    assert published == {p[:-2] + "$" for p in validating}


#: Regexes that parse text the project itself reads (checkpoint tensor names, msgspec's own
#: error messages), not inputs they validate: a trailing ``$`` is what they mean.
PARSERS = {"worker/model/hf_names.py", "shared/config.py:_AT", "worker/api/schemas.py:_AT",
           "kvledger/config_reference.py"}


def test_no_validating_pattern_ends_in_a_dollar():
    found = []
    for part in ("shared", "coordinator", "worker", "gateway", "kvledger"):
        for path in sorted((ROOT / part).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line in path.read_text().splitlines():
                if not re.search(r"""(pattern=|re\.(compile|match|search|fullmatch)\()r?["'].*\$["']""", line):
                    continue
                name = line.split("=")[0].strip()
                if rel in PARSERS or f"{rel}:{name}" in PARSERS:
                    continue
                found.append(f"{rel}: {line.strip()}")
    assert not found, "end these patterns in \\Z, not $:\n" + "\n".join(found)
