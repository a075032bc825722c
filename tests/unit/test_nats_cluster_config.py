"""A NATS cluster in the configuration: the server list every client gets, the stream's replicas,
and the configuration each embedded node is started with (shared/nats_cluster.py)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.stream import TransitionStream
from shared.config import ConfigError, nats_servers, parse_config
from shared.embedded import EmbeddedServiceError
from shared.nats_cluster import CLUSTER_NAME, ROUTE_USER, NatsCluster, embedded_nodes, node_config
from shared.subjects import Subjects

THREE = "nats://10.0.0.1:4222, nats://10.0.0.2:4222,nats://10.0.0.3:4222"


def test_the_server_list_is_every_url_of_nats_url() -> None:
    assert nats_servers(THREE) == ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222", "nats://10.0.0.3:4222"]
    assert nats_servers("nats://h:4222") == ["nats://h:4222"]
    assert nats_servers("") == []


def test_a_comma_separated_nats_url_is_valid_and_each_url_is_checked() -> None:
    assert parse_config({"nats": {"url": THREE}}).nats.url == THREE
    with pytest.raises(ConfigError, match="nats.url"):
        parse_config({"nats": {"url": "nats://a:4222,http://b:4222"}})


@pytest.mark.parametrize("size", [1, 3, 5])
def test_cluster_size_is_one_three_or_five(size: int) -> None:
    assert parse_config({"nats": {"cluster_size": size}}).nats.cluster_size == size


@pytest.mark.parametrize("size", [0, 2, 4, 7])
def test_an_even_or_oversized_cluster_is_refused(size: int) -> None:
    with pytest.raises(ConfigError, match="nats.cluster_size"):
        parse_config({"nats": {"cluster_size": size}})
    with pytest.raises(EmbeddedServiceError, match="3 or 5"):
        NatsCluster(Path("/nonexistent"), size)


def _replicas(url: str, stream_replicas: int = 0) -> int:
    cfg = parse_config({"nats": {"url": url, "stream_replicas": stream_replicas}})
    return TransitionStream(None, None, Subjects("kvl"), config=cfg, metrics=None, logger=None).replicas


def test_stream_replicas_default_to_one_per_listed_server() -> None:
    assert _replicas("nats://h:4222") == 1
    assert _replicas(THREE) == 3
    assert _replicas(",".join(f"nats://h{i}:4222" for i in range(7))) == 5   # JetStream's most
    assert _replicas(THREE, stream_replicas=1) == 1                           # configured wins
    assert _replicas("nats://lb:4222", stream_replicas=3) == 3                # a cluster behind one name
    with pytest.raises(ConfigError, match="nats.stream_replicas"):
        parse_config({"nats": {"stream_replicas": 6}})


def test_each_node_routes_to_every_node_with_the_route_password_and_includes_the_users() -> None:
    ports = [6001, 6002, 6003]
    confs = [node_config(i, host="127.0.0.1", route_ports=ports, http_port=8000 + i, route_password="s3cret",
                         auth_include="../credentials/auth.conf") for i in range(3)]
    for i, conf in enumerate(confs):
        assert f'server_name: "kvl-nats-{i + 1}"' in conf
        assert f'listen: "127.0.0.1:{ports[i]}"' in conf
        assert f'name: "{CLUSTER_NAME}"' in conf
        assert f'authorization {{ user: "{ROUTE_USER}", password: "s3cret" }}' in conf
        routes = re.findall(r"nats-route://(\w+):(\w+)@127\.0\.0\.1:(\d+)", conf)
        assert routes == [(ROUTE_USER, "s3cret", str(p)) for p in ports]
        assert 'include "../credentials/auth.conf"' in conf
        assert f'http: "127.0.0.1:{8000 + i}"' in conf
    assert len(set(confs)) == 3


def test_embedded_nodes_names_a_lone_server_nats_and_a_clusters_nodes_nats_n() -> None:
    lone = SimpleNamespace()
    assert list(embedded_nodes(lone)) == [("nats", lone)]  # type: ignore[arg-type]
    assert list(embedded_nodes(None)) == []
    cluster = NatsCluster(Path("/nonexistent"), 3)
    assert list(embedded_nodes(cluster)) == [(f"nats-{i + 1}", n) for i, n in enumerate(cluster.nodes)]
    # ports are chosen up front (the URL is known before the start) and are all distinct
    ports = [n.port for n in cluster.nodes] + cluster.route_ports + cluster.http_ports
    assert len(set(ports)) == 9 and 0 not in ports
    assert cluster.url == ",".join(f"nats://127.0.0.1:{n.port}" for n in cluster.nodes)
