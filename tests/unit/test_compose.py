"""compose.yaml, the Dockerfile and deploy/ checked for structure (no container engine runs here):
services and the order they start in, healthchecks, volumes, the GPU reservation, JetStream
and credentials for NATS, no secret baked in or defaulted, every variable documented, every
KVL_* setting a valid configuration key, and every metric an alert uses one that exists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.config import load_config

ROOT = Path(__file__).resolve().parents[2]
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
SECRET = re.compile(r"PASSWORD|TOKEN|SECRET", re.I)
#: What every kvledger service is given: the three NATS nodes.
CLUSTER_URL = "nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} with ``env`` (what .env would hold)."""
    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op and op.endswith("-"):
            return arg
        raise AssertionError(f"${{{name}}} is unset and has no default")
    return VAR.sub(sub, value)


def test_services_and_start_order(compose: dict[str, Any]) -> None:
    s = services(compose)
    assert set(s) == {"postgres", "postgres-standby", "nats", "nats-2", "nats-3", "migrate", "coordinator", "coordinator-standby", "worker-0", "worker-1",
                      "gateway", "prometheus", "alertmanager"}
    dep = {name: {k: v["condition"] for k, v in svc.get("depends_on", {}).items()} for name, svc in s.items()}
    # a synchronous standby streams before the first commit (a migration's) can return
    assert dep["migrate"] == {"postgres": "service_healthy", "postgres-standby": "service_healthy"}
    assert dep["postgres-standby"] == {"postgres": "service_healthy"}
    assert dep["coordinator"] == {"migrate": "service_completed_successfully", "postgres": "service_healthy",
                                  "nats": "service_healthy", "nats-2": "service_healthy", "nats-3": "service_healthy"}
    assert dep["coordinator-standby"] == {"coordinator": "service_healthy"}  # the first one leads
    assert dep["worker-0"] == dep["worker-1"] == {"coordinator": "service_healthy"}
    assert dep["prometheus"] == {"coordinator": "service_healthy"}
    assert dep["gateway"] == {"coordinator": "service_healthy", "worker-0": "service_healthy"}
    # the migrations, then the coordinators' login role (a kvledger_writer member), both as the owner
    assert s["migrate"]["command"] == ["sh", "-c", "kvledger db upgrade && python -m coordinator.log.roles"]
    assert s["migrate"]["restart"] == "no"
    assert s["coordinator"]["command"][:2] == ["kvledger", "coordinator"]
    # optional parts are behind profiles; the default `docker compose up` runs one GPU worker
    assert s["worker-1"]["profiles"] == ["multi-gpu"]
    assert s["prometheus"]["profiles"] == s["alertmanager"]["profiles"] == ["monitoring"]
    assert all("profiles" not in s[n] for n in ("postgres", "nats", "migrate", "coordinator", "coordinator-standby",
                                                "worker-0", "gateway"))


def test_workers_advertise_their_service_name(compose: dict[str, Any]) -> None:
    """The gateway reaches a worker at the URL it registered: its name on the compose network,
    not the wildcard it binds (found by deploy/smoke.sh: http://0.0.0.0:8400 was refused)."""
    s = services(compose)
    for name in ("worker-0", "worker-1"):
        env = s[name]["environment"]
        assert env["KVL_WORKER__ADVERTISE_URL"] == f"http://{name}:{env['KVL_WORKER__PORT']}"


def test_healthchecks(compose: dict[str, Any]) -> None:
    s = services(compose)
    for name in ("postgres", "nats", "coordinator", "coordinator-standby", "worker-0", "worker-1", "gateway",
                 "prometheus", "alertmanager"):
        hc = s[name].get("healthcheck")
        assert hc and hc["test"] and hc.get("interval") and hc.get("retries"), name
    assert "pg_isready" in " ".join(s["postgres"]["healthcheck"]["test"])
    # a cluster node is healthy once JetStream has a meta leader and its streams are current
    for name in ("nats", "nats-2", "nats-3"):
        assert any(t.endswith(":8222/healthz") for t in s[name]["healthcheck"]["test"]), name
    assert any("8321/readyz" in t for t in s["coordinator"]["healthcheck"]["test"])
    # a standby's /readyz is 503 while the other one leads: it is healthy when it is up
    assert any("8321/healthz" in t for t in s["coordinator-standby"]["healthcheck"]["test"])
    assert any("8400/readyz" in t for t in s["worker-0"]["healthcheck"]["test"])
    assert any("8300/readyz" in t for t in s["gateway"]["healthcheck"]["test"])


def test_volumes_and_gpu(compose: dict[str, Any]) -> None:
    s = services(compose)
    assert set(compose["volumes"]) == {"pgdata", "pgstandby", "natsdata", "natsdata-2", "natsdata-3", "offload", "promdata",
                                      "alertdata"}
    assert "pgdata:/var/lib/postgresql/data" in s["postgres"]["volumes"]
    for name, volume in (("nats", "natsdata"), ("nats-2", "natsdata-2"), ("nats-3", "natsdata-3")):
        assert f"{volume}:/data" in s[name]["volumes"]   # each node its own JetStream store
    for name, gpu in (("worker-0", "0"), ("worker-1", "1")):
        w = s[name]
        # the shared disk tier: the same named volume, where the worker's config says it is
        assert "offload:/data/cache_offload" in w["volumes"]
        assert w["environment"]["KVL_CACHE__OFFLOAD_DIR"] == "/data/cache_offload"
        assert w["environment"]["KVL_WORKER__DEVICE"] == "cuda"
        devices = w["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]


def test_nats_jetstream_and_one_user_per_service(compose: dict[str, Any]) -> None:
    """The server's users are exactly what `kvledger nats-auth` generates for the compose workers
    (no drift), each password comes from the server's environment, and each kvledger service
    connects as its own user with only its own password."""
    from shared import nats_auth
    from shared.subjects import Subjects

    s = services(compose)
    nats = s["nats"]
    assert nats["command"] == ["--config", "/etc/nats/nats.conf"]
    mount = next(v for v in nats["volumes"] if isinstance(v, dict))
    assert mount["target"] == "/etc/nats" and mount["read_only"] is True
    conf = (ROOT / mount["source"] / "nats.conf").read_text()
    assert re.search(r"^jetstream\s*\{[^}]*store_dir:\s*/data/jetstream", conf, re.M | re.S)
    # the users only in auth.conf (the one authorization block in nats.conf is the cluster routes')
    assert re.search(r"^include \./auth\.conf$", conf, re.M) and not re.search(r"^authorization", conf, re.M)
    assert re.search(r"^http_port:\s*8222", conf, re.M)  # what the healthcheck asks
    workers = sorted(n for n in s if n.startswith("worker-"))
    idents = [*nats_auth.STANDARD, *(nats_auth.worker(w) for w in workers), nats_auth.gateway("gateway")]
    auth = (ROOT / mount["source"] / "auth.conf").read_text()
    expected = nats_auth.server_config({i: nats_auth.password_env(i) for i in idents}, Subjects("kvl"))
    assert expected in auth, ("regenerate: kvledger nats-auth --worker worker-0 --worker worker-1 --gateway gateway "
                              "> deploy/nats/auth.conf")
    for i in idents:
        var = nats_auth.password_env(i).name
        assert nats["environment"][var] == f"${{{var}:?set {var} in .env}}"
    assert "@" not in s["coordinator"]["environment"]["KVL_NATS_URL"]   # no credentials in URLs
    users = {"coordinator": "coordinator", "coordinator-standby": "coordinator",
             **{w: f"worker.{w}" for w in workers}}
    for name, user in users.items():
        env = s[name]["environment"]
        assert env["KVL_NATS__USER"] == user
        assert env["KVL_NATS__PASSWORD"].startswith("${" + nats_auth.password_env(nats_auth.Identity.parse(user)).name)
        if name.startswith("worker"):
            assert env["KVL_WORKER__WORKER_ID"] == name


def test_no_secret_is_baked_in_or_defaulted(compose: dict[str, Any]) -> None:
    text = (ROOT / "compose.yaml").read_text()
    for m in VAR.finditer(text):
        if SECRET.search(m.group(1)):
            assert m.group(2) == ":?", f"${{{m.group(1)}}} must be required (:?), never defaulted"
    for name, svc in services(compose).items():
        for key, value in (svc.get("environment") or {}).items():
            if SECRET.search(key):
                assert "${" in str(value), f"{name}: {key} is written in compose.yaml"
    docker = (ROOT / "Dockerfile").read_text()
    for line in docker.splitlines():
        if re.match(r"\s*(ENV|ARG)\b", line):
            assert not SECRET.search(line) and "KVL_DATABASE_URL" not in line and "KVL_NATS_URL" not in line, line
    assert re.search(r"^USER kvledger$", docker, re.M)  # not root
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", docker, re.M))
    for svc in services(compose).values():
        if "build" in svc:
            assert svc["build"]["target"] in targets
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".env", ".venv", ".kvl-state", ".git"} <= set(ignored)
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_every_variable_is_documented_and_every_setting_valid(compose: dict[str, Any]) -> None:
    text = (ROOT / "compose.yaml").read_text()
    used = {m.group(1) for m in VAR.finditer(text)}
    example = env_example()
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert used <= set(example), f"missing from .env.example: {sorted(used - set(example))}"
    undocumented = sorted(v for v in used if f"`{v}`" not in ops)
    assert not undocumented, f"not documented in docs/operations.md: {undocumented}"
    # What the kvledger containers get is a configuration the services accept.
    for name in ("migrate", "coordinator", "coordinator-standby", "worker-0", "gateway"):
        env = {k: interpolate(str(v), example) for k, v in services(compose)[name]["environment"].items()}
        config_path = ROOT / "deploy" / "kvledger" / Path(env.pop("KVL_CONFIG")).name
        cfg = load_config(config_path, env=env)
        assert cfg.nats.url == CLUSTER_URL
        if name != "migrate":   # the one-shot migration does not use NATS
            assert cfg.nats.user and cfg.nats.password.startswith("change-me-nats-")
        # least privilege: only `migrate` connects as the owner; the rest use the coordinators' role
        owner = name == "migrate"
        assert cfg.database.url.startswith("postgresql://kvledger:" if owner else "postgresql://kvledger_coordinator:")
        if owner:
            assert env["KVL_APP_DB_USER"] == "kvledger_coordinator" and env["KVL_APP_DB_PASSWORD"]
        for key in env:
            assert key.startswith("KVL_"), key
        if name.startswith("worker"):
            assert cfg.worker.port == 8400 and cfg.worker.host == "0.0.0.0" and cfg.auth.salt_secret
        if name.startswith("coordinator"):
            assert env["KVL_ADMIN_TOKEN"]
        if name == "gateway":   # the workers' salt secret, or it hashes other blocks than theirs
            assert cfg.gateway.port == 8300 and cfg.gateway.host == "0.0.0.0" and cfg.auth.salt_secret
            assert cfg.nats.user == "gateway.gateway"


def test_the_standby_coordinator_shares_the_log_and_nats_on_its_own_port(compose: dict[str, Any]) -> None:
    s = services(compose)
    leader, standby = s["coordinator"], s["coordinator-standby"]
    for key in ("image", "build", "command", "environment", "volumes", "restart", "stop_grace_period"):
        assert standby[key] == leader[key], key
    example = env_example()
    env = {k: interpolate(str(v), example) for k, v in standby["environment"].items()}
    assert env["KVL_DATABASE_URL"].endswith("@postgres:5432,postgres-standby:5432/kvledger?target_session_attrs=read-write") and env["KVL_NATS_URL"] == CLUSTER_URL
    assert leader["ports"] == ["${KVL_BIND:-127.0.0.1}:8321:8321"]
    assert standby["ports"] == ["${KVL_BIND:-127.0.0.1}:8322:8321"]


def test_prometheus_scrapes_both_and_alerts_use_real_metrics(compose: dict[str, Any]) -> None:
    from coordinator.metrics import CoordinatorMetrics
    from worker.metrics import GpuMemory, WorkerMetrics
    from worker.scheduler import ServingMetrics

    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["kvledger-coordinator"]["static_configs"][0]["targets"] == ["coordinator:8321",
                                                                            "coordinator-standby:8321"]
    assert jobs["kvledger-worker"]["dns_sd_configs"][0]["names"] == ["worker-0", "worker-1"]
    gateway_port = services(compose)["gateway"]["environment"]["KVL_GATEWAY__PORT"]
    assert jobs["kvledger-gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"]
    # the alerts that fire go to compose's Alertmanager, which has a receiver for every route
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert services(compose)["alertmanager"]["command"][0] == "--config.file=/etc/alertmanager/alertmanager.yml"
    am = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    receivers = {r["name"]: r for r in am["receivers"]}
    assert am["route"]["receiver"] in receivers
    assert all(receivers[r.get("receiver", am["route"]["receiver"])] for r in am["route"].get("routes", []))
    assert receivers[am["route"]["receiver"]]["webhook_configs"][0]["url"].startswith("http")

    known = {"up"}
    cm = CoordinatorMetrics()
    cm.watch_pools(lambda: [("w", "f", 1, 2)])  # pool and worker gauges are collected at scrape time
    cm.watch_workers(lambda: {"live": 1})
    wm = WorkerMetrics()
    ServingMetrics.of(wm.registry)
    wm.watch_gpu("cuda:0", 0, read=lambda _: GpuMemory(0, 0, 0, 0))  # a CUDA worker's (absent on CPU)
    from gateway.app import GatewayMetrics
    for registry in (cm.registry, wm.registry, GatewayMetrics().registry):
        for fam in registry.collect():
            known.add(fam.name)
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    rules = [r for g in alerts["groups"] for r in g["rules"]]
    assert len(rules) >= 10
    ops = (ROOT / "docs" / "operations.md").read_text()
    for rule in rules:
        for metric in re.findall(r"\b(kvl_[a-z_]+|up)\b", rule["expr"]):
            base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
            assert base in known, f"{rule['alert']}: unknown metric {metric}"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["alert"] in ops, f"alert {rule['alert']} is not explained in docs/operations.md"


def test_operations_reference_is_current() -> None:
    """docs/operations.md's generated sections match the schema and the registries; every key has a description."""
    from kvledger.config_reference import config_rows, update

    text = (ROOT / "docs" / "operations.md").read_text()
    assert update(text) == text, "run: python -m kvledger.config_reference --write docs/operations.md"
    missing = [r["key"] for r in config_rows() if not r["description"]]
    assert not missing, f"config keys without a description (shared/config.py `#:` or config_reference.EXTRA): {missing}"


def test_least_privilege_database_roles(compose: dict[str, Any]) -> None:
    """The coordinators log in as the role `migrate` creates (kvledger_writer member), never the owner;
    leader and standby share it (a takeover may terminate only sessions of its own role)."""
    s = services(compose)
    example = env_example()
    env = {name: {k: interpolate(str(v), example) for k, v in s[name]["environment"].items()}
           for name in ("migrate", "coordinator", "coordinator-standby")}
    owner = f"postgresql://{example['POSTGRES_USER']}:{example['POSTGRES_PASSWORD']}@"
    app = f"postgresql://{example['KVL_APP_DB_USER']}:{example['KVL_APP_DB_PASSWORD']}@"
    assert example["KVL_APP_DB_USER"] != example["POSTGRES_USER"]
    assert env["migrate"]["KVL_DATABASE_URL"].startswith(owner)
    assert env["migrate"]["KVL_APP_DB_PASSWORD"] == example["KVL_APP_DB_PASSWORD"]
    assert env["coordinator"]["KVL_DATABASE_URL"] == env["coordinator-standby"]["KVL_DATABASE_URL"]
    assert env["coordinator"]["KVL_DATABASE_URL"].startswith(app)
    for name in ("coordinator", "coordinator-standby"):
        assert example["POSTGRES_PASSWORD"] not in " ".join(env[name].values()), name


def test_the_three_nats_nodes_form_one_cluster_with_authenticated_routes(compose: dict[str, Any]) -> None:
    """Each node runs the same nats.conf under its own name, routes to all three with the route
    password, and nats-server accepts that configuration with each node's environment (``-t``)."""
    import os
    import subprocess

    s = services(compose)
    example = env_example()
    nodes = ("nats", "nats-2", "nats-3")
    envs = {n: {k: interpolate(str(v), example) for k, v in s[n]["environment"].items()} for n in nodes}
    assert len({e["NATS_SERVER_NAME"] for e in envs.values()}) == 3
    routes = [f"nats://route:{example['NATS_ROUTE_PASSWORD']}@{n}:6222" for n in nodes]
    for n in nodes:
        assert [envs[n][f"NATS_ROUTE_{i}"] for i in (1, 2, 3)] == routes
        assert s[n]["command"] == s["nats"]["command"] and s[n]["image"] == s["nats"]["image"]
        # the users' passwords too: the same identities on every node
        assert {k: v for k, v in envs[n].items() if k.startswith("NATS_PASSWORD_")} == \
            {k: v for k, v in envs["nats"].items() if k.startswith("NATS_PASSWORD_")}
    conf = ROOT / "deploy" / "nats" / "nats.conf"
    text = conf.read_text()
    assert re.search(r"^server_name: \$NATS_SERVER_NAME$", text, re.M)
    assert re.search(r"authorization \{ user: route, password: \$NATS_ROUTE_PASSWORD \}", text)
    assert "routes: [$NATS_ROUTE_1, $NATS_ROUTE_2, $NATS_ROUTE_3]" in text
    from shared.embedded import EmbeddedNats

    binary = EmbeddedNats.binary()   # the pip-provided nats-server (a dependency)
    for n in nodes:
        r = subprocess.run([binary, "-c", str(conf), "-t"], cwd=conf.parent, capture_output=True, text=True,
                           env={"PATH": os.environ.get("PATH", ""), **envs[n]}, timeout=30)
        assert r.returncode == 0 and "is valid" in r.stdout + r.stderr, (n, r.stdout, r.stderr)


def test_the_postgres_standby_streams_from_postgres_as_its_own_role(compose: dict[str, Any]) -> None:
    """postgres-standby clones postgres with pg_basebackup -R as kvledger_replication (password
    from a passfile, never a command line), through the slot, and does not wait for a standby of
    its own once promoted; the coordinators' URL names both servers and takes the writable one.
    The initdb script itself runs against a real server in tests/integration/test_pg_standby.py."""
    import subprocess

    s = services(compose)
    example = env_example()
    sb = s["postgres-standby"]
    assert sb["image"] == s["postgres"]["image"] and sb["user"] == "postgres"
    assert sb["entrypoint"] == ["sh", "/etc/kvledger-postgres/standby.sh"]
    assert "pgstandby:/var/lib/postgresql/data" in sb["volumes"] and "pgstandby" in compose["volumes"]
    assert "pg_isready" in " ".join(sb["healthcheck"]["test"])
    env = {k: interpolate(str(v), example) for k, v in sb["environment"].items()}
    primary_env = {k: interpolate(str(v), example) for k, v in s["postgres"]["environment"].items()}
    assert env["KVL_PG_REPLICATION_PASSWORD"] == primary_env["KVL_PG_REPLICATION_PASSWORD"] == \
        example["KVL_PG_REPLICATION_PASSWORD"]
    assert any(v.get("target") == "/docker-entrypoint-initdb.d" for v in s["postgres"]["volumes"] if isinstance(v, dict))
    url = interpolate(str(s["coordinator"]["environment"]["KVL_DATABASE_URL"]), example)
    assert "@postgres:5432,postgres-standby:5432/" in url and url.endswith("?target_session_attrs=read-write")
    assert "postgres-standby" not in interpolate(str(s["migrate"]["environment"]["KVL_DATABASE_URL"]), example)

    script = ROOT / "deploy" / "postgres" / "standby.sh"
    text = script.read_text()
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    for part in ("pg_basebackup", " -R ", "-S kvl_standby", "user=kvledger_replication", "passfile=$pass",
                 "application_name=kvl_standby", "exec postgres -c synchronous_standby_names= "):
        assert part in text, part
    assert "PGPASSWORD" not in text and "password=" not in text
