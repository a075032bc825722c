"""What ``kvledger up`` is asked to run (:class:`StackOptions`), and how a start fails or is cut short."""

from __future__ import annotations

from dataclasses import dataclass


class StackError(RuntimeError):
    """The stack could not be brought up; the message says which part and why."""


class Interrupted(Exception):
    """A stop was requested (signal) while something was still starting."""


@dataclass
class StackOptions:
    workers: int = 1
    #: The first leads; the others are hot standbys on the next admin ports.
    coordinators: int = 1
    #: None = the config's coordinator.port; 0 = any free port (each).
    coordinator_port: int | None = None
    #: None = the config's worker.port; worker i listens on base + i; 0 = any free port each.
    worker_base_port: int | None = None
    #: Run the gateway (the stack's one endpoint) in front of the workers.
    gateway: bool = True
    #: None = the config's gateway.port; 0 = any free port.
    gateway_port: int | None = None
    #: Gateway replicas (None = the config's gateway.replicas).
    gateways: int | None = None
    #: Embedded nats-servers, clustered when 3 or 5 (None = the config's nats.cluster_size).
    nats_cluster: int | None = None
    config_path: str | None = None
    start_timeout_s: float = 180.0
    stop_timeout_s: float = 20.0
    #: Echo the children's logs on the terminal (always written to the log files).
    echo_logs: bool = True
    #: A child that exits is restarted after restart_backoff_s, doubled for each earlier exit
    #: within restart_window_s (at most restart_backoff_max_s); more than max_restarts exits
    #: within the window stop the stack (0 = stop at the first).
    max_restarts: int = 5
    restart_window_s: float = 60.0
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 10.0
    #: A streaming standby of the embedded PostgreSQL (``kvledger.pg_failover``).
    pg_standby: bool = False
    #: Ledger shards (``coordinator.shards``): each runs ``coordinators`` processes on a database of its own.
    shards: int = 1
