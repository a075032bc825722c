"""Configuration: every documented key parses; bad values fail naming the key."""

from pathlib import Path

import pytest

from shared.config import ConfigError, load_config, parse_config

FULL = {
    "cache": {
        "block_size": 32, "compressed_pool_limit": 0.6, "tail_pool_limit": 0.1, "swa_pool_limit": 0.2,
        "offload_dir": "/data/cache_offload", "offload_dir_bytes": 2**30, "offload_segment_bytes": 2**24,
        "hit_validation": {"check_compressed": False, "check_tail": True, "check_swa": False,
                           "check_indexer": True, "check_offload": False},
        "on_invalid": "error",
    },
    "service": {"max_concurrency": 8, "max_context_length": 4096, "cache_reserve_ratio": 0.5,
                "batch_window_ms": 5, "request_timeout_ms": 1000},
    "database": {"url": "postgresql://u@h/db"},
    "nats": {"url": "nats://h:4222", "subject_prefix": "prod.kvl"},
    "coordinator": {"host": "0.0.0.0", "port": 9000, "admin_token": "s3cret"},
    "worker": {"host": "0.0.0.0", "port": 9100},
    "auth": {"required": True, "keys": [{"key_sha256": "a" * 64, "tenant": "acme"}]},
}


def test_every_operator_key_parsed() -> None:
    cfg = parse_config(FULL)
    c = cfg.cache
    assert (c.block_size, c.compressed_pool_limit, c.tail_pool_limit, c.swa_pool_limit) == (32, 0.6, 0.1, 0.2)
    assert (c.offload_dir_bytes, c.offload_segment_bytes) == (2**30, 2**24)
    assert c.offload_dir == "/data/cache_offload" and c.on_invalid == "error"
    hv = c.hit_validation
    assert (hv.check_compressed, hv.check_tail, hv.check_swa, hv.check_indexer, hv.check_offload) == (
        False, True, False, True, False)
    s = cfg.service
    assert (s.max_concurrency, s.max_context_length, s.cache_reserve_ratio, s.batch_window_ms,
            s.request_timeout_ms) == (8, 4096, 0.5, 5, 1000)
    assert cfg.database.url == "postgresql://u@h/db" and cfg.nats.url == "nats://h:4222"
    assert cfg.nats.subject_prefix == "prod.kvl"
    assert (cfg.coordinator.host, cfg.coordinator.port, cfg.coordinator.admin_token) == ("0.0.0.0", 9000, "s3cret")
    assert (cfg.worker.host, cfg.worker.port) == ("0.0.0.0", 9100)
    assert cfg.auth.required and cfg.auth.keys[0].tenant == "acme"


def test_defaults_are_valid() -> None:
    cfg = load_config(env={})
    assert cfg.cache.block_size == 16 and cfg.cache.on_invalid == "refill"


@pytest.mark.parametrize(("doc", "key", "allowed"), [
    ({"cache": {"block_size": 0}}, "cache.block_size", ">= 1"),
    ({"cache": {"block_size": "big"}}, "cache.block_size", "int"),
    ({"cache": {"compressed_pool_limit": 1.5}}, "cache.compressed_pool_limit", "<= 1.0"),
    ({"cache": {"tail_pool_limit": -0.1}}, "cache.tail_pool_limit", ">= 0.0"),
    ({"cache": {"swa_pool_limit": "x"}}, "cache.swa_pool_limit", "float"),
    ({"cache": {"offload_pool_limit": 0.1}}, "cache.offload_pool_limit", "removed; no pool ever used it"),
    ({"cache": {"offload_segment_bytes": 100}}, "cache.offload_segment_bytes", ">= 4096"),
    ({"cache": {"offload_dir": 3}}, "cache.offload_dir", "str"),
    ({"cache": {"hit_validation": {"check_compressed": "yes"}}}, "cache.hit_validation.check_compressed", "bool"),
    ({"cache": {"hit_validation": {"check_tail": 1}}}, "cache.hit_validation.check_tail", "bool"),
    ({"cache": {"hit_validation": {"check_swa": None}}}, "cache.hit_validation.check_swa", "bool"),
    ({"cache": {"hit_validation": {"check_indexer": []}}}, "cache.hit_validation.check_indexer", "bool"),
    ({"cache": {"hit_validation": {"check_offload": {}}}}, "cache.hit_validation.check_offload", "bool"),
    ({"cache": {"hit_validation": {"check_everything": True}}}, "cache.hit_validation.check_everything",
     "check_compressed"),
    ({"cache": {"on_invalid": "ignore"}}, "cache.on_invalid", "refill, error"),
    ({"service": {"max_concurrency": 0}}, "service.max_concurrency", ">= 1"),
    ({"service": {"max_context_length": -5}}, "service.max_context_length", ">= 1"),
    ({"service": {"cache_reserve_ratio": 1.1}}, "service.cache_reserve_ratio", "<= 1.0"),
    ({"service": {"batch_window_ms": -1}}, "service.batch_window_ms", ">= 0"),
    ({"service": {"request_timeout_ms": "soon"}}, "service.request_timeout_ms", "int"),
    ({"database": {"url": "mysql://x"}}, "database.url", "postgresql"),
    ({"nats": {"url": "http://x"}}, "nats.url", "nats://"),
    ({"nats": {"subject_prefix": "a b"}}, "nats.subject_prefix", "regex"),
    ({"coordinator": {"port": 70000}}, "coordinator.port", "<= 65535"),
    ({"worker": {"port": "x"}}, "worker.port", "int"),
    ({"worker": {"dtype": "fp8"}}, "worker.dtype", "auto, float32, bfloat16, float16"),
    ({"worker": {"dtype": "torch.bfloat16"}}, "worker.dtype", "auto, float32, bfloat16, float16"),
    ({"worker": {"require_manifest": "yes"}}, "worker.require_manifest", "bool"),
    ({"auth": {"keys": [{"key_sha256": "nothex", "tenant": "a"}]}}, "auth.keys[0].key_sha256", "regex"),
    ({"cache": {"block_sise": 16}}, "cache.block_sise", "block_size"),
    ({"caches": {}}, "caches", "cache"),
])
def test_bad_values_name_the_key(doc: dict, key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    msg = str(e.value)
    assert key in msg and allowed in msg, msg


def test_pool_limits_must_fit_one_budget() -> None:
    with pytest.raises(ConfigError, match="sum to 1.200"):
        parse_config({"cache": {"compressed_pool_limit": 1.0, "tail_pool_limit": 0.1, "swa_pool_limit": 0.1}})


def test_env_overrides(tmp_path: Path) -> None:
    f = tmp_path / "kvl.yaml"
    f.write_text("cache:\n  block_size: 32\nservice:\n  max_concurrency: 4\n")
    cfg = load_config(f, env={"KVL_CACHE__BLOCK_SIZE": "64", "KVL_CACHE__HIT_VALIDATION__CHECK_TAIL": "false",
                              "KVL_DATABASE_URL": "postgresql://a@b/c", "KVL_NATS__SUBJECT_PREFIX": "x",
                              "KVL_TEST_DATABASE_URL": "ignored"})
    assert cfg.cache.block_size == 64 and cfg.cache.hit_validation.check_tail is False
    assert cfg.service.max_concurrency == 4 and cfg.database.url == "postgresql://a@b/c"
    assert cfg.nats.subject_prefix == "x"
    assert load_config(env={"KVL_STATE_DIR": "/var/lib/kvl"}).state_dir == "/var/lib/kvl"


def test_worker_dtype_and_manifest_keys() -> None:
    w = load_config(env={}).worker
    assert (w.dtype, w.require_manifest) == ("auto", False)
    w = load_config(env={"KVL_WORKER__DTYPE": "bfloat16", "KVL_WORKER__REQUIRE_MANIFEST": "true"}).worker
    assert (w.dtype, w.require_manifest) == ("bfloat16", True)
    for dtype in ("float32", "float16"):
        assert parse_config({"worker": {"dtype": dtype}}).worker.dtype == dtype


def test_bad_env_override_names_variable_key() -> None:
    with pytest.raises(ConfigError, match="cache.block_size"):
        load_config(env={"KVL_CACHE__BLOCK_SIZE": "lots"})
    with pytest.raises(ConfigError, match="cache.nonsense"):
        load_config(env={"KVL_CACHE__NONSENSE": "1"})


def test_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(lst, env={})


def test_example_config_is_valid() -> None:
    example = Path(__file__).parents[2] / "kvledger.example.yaml"
    cfg = load_config(example, env={})
    assert cfg.cache.block_size == 16


def test_tls_section(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for f in (cert, key, ca):
        f.write_text("PEM\n")
    assert parse_config({}).tls.cert_file == ""
    cfg = parse_config({"tls": {"cert_file": str(cert), "key_file": str(key), "ca_file": str(ca),
                                "require_client_cert": True}})
    assert (cfg.tls.cert_file, cfg.tls.key_file, cfg.tls.ca_file, cfg.tls.require_client_cert) == (
        str(cert), str(key), str(ca), True)
    assert load_config(env={"KVL_TLS__CA_FILE": str(ca)}).tls.ca_file == str(ca)


@pytest.mark.parametrize(("tls", "message"), [
    ({"cert_file": "{cert}"}, "tls.cert_file is set but tls.key_file is empty"),
    ({"key_file": "{key}"}, "tls.key_file is set but tls.cert_file is empty"),
    ({"cert_file": "{cert}", "key_file": "{key}", "require_client_cert": True},
     "tls.require_client_cert needs tls.ca_file"),
    ({"ca_file": "{ca}", "require_client_cert": True}, "tls.require_client_cert needs tls.cert_file"),
    ({"cert_file": "{missing}", "key_file": "{key}"}, "tls.cert_file: cannot read .*missing.pem: No such file"),
    ({"cert_file": "{cert}", "key_file": "{missing}"}, "tls.key_file: cannot read .*missing.pem"),
    ({"ca_file": "{missing}"}, "tls.ca_file: cannot read .*missing.pem"),
    ({"ca_file": "{dir}"}, "tls.ca_file: cannot read"),
    ({"require_client_cert": "yes"}, "config key tls.require_client_cert: Expected `bool`"),
    ({"certfile": "x"}, "config key tls.certfile: unknown key; allowed here: ca_file, cert_file, key_file"),
])
def test_tls_errors_name_the_key(tmp_path: Path, tls: dict, message: str) -> None:
    paths = {"cert": tmp_path / "c.pem", "key": tmp_path / "k.pem", "ca": tmp_path / "ca.pem",
             "missing": tmp_path / "missing.pem", "dir": tmp_path}
    for k in ("cert", "key", "ca"):
        paths[k].write_text("PEM\n")
    doc = {k: v.format(**{n: str(p) for n, p in paths.items()}) if isinstance(v, str) else v for k, v in tls.items()}
    with pytest.raises(ConfigError, match=message):
        parse_config({"tls": doc})


async def test_a_coordinator_owning_its_process_sets_the_young_gc_threshold() -> None:
    """``coordinator.gc_young_threshold`` and ``gc_full_threshold`` apply to the process a
    coordinator owns (``serve``), never to one it merely runs in (a test, a bench): there the
    collector is left alone."""
    import gc

    from coordinator.runtime import Coordinator
    from shared.config import parse_config
    from shared.logging import get_logger
    before = gc.get_threshold()
    cfg = parse_config({"coordinator": {"gc_young_threshold": 4321, "gc_full_threshold": 77}})
    try:
        Coordinator(cfg, database_url="postgresql://x@127.0.0.1:1/x", nats_url="nats://127.0.0.1:1",
                    logger=get_logger("t"))
        assert gc.get_threshold() == before
        Coordinator(cfg, database_url="postgresql://x@127.0.0.1:1/x", nats_url="nats://127.0.0.1:1",
                    logger=get_logger("t"), freeze_gc=True)
        assert gc.get_threshold() == (4321, before[1], 77)
    finally:
        gc.set_threshold(*before)
    with pytest.raises(ConfigError, match="gc_young_threshold"):
        parse_config({"coordinator": {"gc_young_threshold": 5}})
    with pytest.raises(ConfigError, match="gc_full_threshold"):
        parse_config({"coordinator": {"gc_full_threshold": 0}})
