"""``kvledger up``, the subcommand: its arguments, checked, and the :class:`~kvledger.stack.supervisor.Stack` it runs."""

from __future__ import annotations

from typing import Any

from kvledger.stack.options import StackOptions
from kvledger.stack.supervisor import Stack


def add_arguments(p: Any) -> None:
    p.add_argument("--workers", "-n", type=int, default=1, help="number of workers (default 1)")
    p.add_argument("--coordinators", type=int, default=1, metavar="N",
                   help="coordinator processes per ledger shard, 1 to 3 (default 1): the first leads, the others "
                        "are hot standbys on the next admin ports")
    p.add_argument("--shards", type=int, default=None, metavar="N",
                   help="ledger shards, 1 to 16 (default: coordinator.shards, 1): each its own coordinators, "
                        "database and stream, the first start storing the shard map (embedded PostgreSQL only)")
    p.add_argument("--coordinator-port", type=int, default=None,
                   help="admin API port (default: coordinator.port, 8321; 0 = any free port)")
    p.add_argument("--worker-base-port", type=int, default=None,
                   help="worker i listens on BASE+i (default: worker.port, 8400; 0 = any free ports)")
    p.add_argument("--gateway-port", type=int, default=None,
                   help="the gateway's port, the stack's one OpenAI endpoint (default: gateway.port, 8300; 0 = any "
                        "free port)")
    p.add_argument("--nats-cluster", type=int, choices=(1, 3, 5), default=None, metavar="N",
                   help="embedded NATS as a cluster of N JetStream servers, 1, 3 or 5 (default: nats.cluster_size, 1); "
                        "the transitions stream gets N replicas and every client the N servers")
    p.add_argument("--gateways", type=int, default=None, metavar="N",
                   help="gateway replicas, 1 to 16 (default: gateway.replicas, 1), each routing by the ledger's "
                        "block locations; replica i on the gateway's port + i")
    p.add_argument("--no-gateway", action="store_true",
                   help="run no gateway: clients choose a worker themselves")
    p.add_argument("--start-timeout", type=float, default=180.0, metavar="SECONDS",
                   help="how long each part may take to become ready (default 180)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="a coordinator or worker that exits is restarted; one that exits more than N times "
                        "within --restart-window stops the stack (default 5; 0 = stop at the first exit)")
    p.add_argument("--restart-window", type=float, default=60.0, metavar="SECONDS",
                   help="the window of --max-restarts (default 60)")
    p.add_argument("--pg-standby", action="store_true",
                   help="also run a streaming standby of the embedded PostgreSQL (database.standby; "
                        "database.synchronous_standby, database.failover_after_s; `kvledger db promote`)")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="do not echo the services' logs (they are still written under <state_dir>/logs)")


def cmd_up(args: Any) -> int:
    from shared.config import load_config

    if args.workers < 0:
        raise SystemExit("kvledger up: --workers must be >= 0")
    if not 1 <= args.coordinators <= 3:
        raise SystemExit("kvledger up: --coordinators must be 1, 2 or 3")
    if args.max_restarts < 0:
        raise SystemExit("kvledger up: --max-restarts must be >= 0 (0 = stop the stack when a process exits)")
    if not args.restart_window > 0:
        raise SystemExit("kvledger up: --restart-window must be > 0 seconds")
    cfg = load_config(getattr(args, "config", None))
    shards = cfg.coordinator.shards if getattr(args, "shards", None) is None else args.shards
    if not 1 <= shards <= 16:
        raise SystemExit("kvledger up: --shards must be 1 to 16")
    if shards > 1 and (cfg.database.url or args.pg_standby or cfg.database.standby):
        raise SystemExit(f"kvledger up runs {shards} ledger shards on the embedded PostgreSQL (a database each), "
                         "without a standby; with database.url or a standby, run each shard's coordinators yourself "
                         "(docs/operations.md, \"A sharded ledger\")")
    if args.gateways is not None and not 1 <= args.gateways <= 16:
        raise SystemExit("kvledger up: --gateways must be 1 to 16 (or --no-gateway for none)")
    if (args.nats_cluster or 1) > 1 and cfg.nats.url:
        raise SystemExit("kvledger up: --nats-cluster runs an embedded NATS cluster, but nats.url is set: list your "
                         "cluster's servers there instead (comma-separated nats:// URLs)")
    opts = StackOptions(workers=args.workers, coordinators=args.coordinators, coordinator_port=args.coordinator_port,
                        worker_base_port=args.worker_base_port, config_path=getattr(args, "config", None),
                        gateway=not args.no_gateway, gateway_port=args.gateway_port, gateways=args.gateways,
                        start_timeout_s=args.start_timeout, echo_logs=not args.quiet,
                        max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                        nats_cluster=args.nats_cluster,
                        pg_standby=args.pg_standby or cfg.database.standby, shards=shards)
    return Stack(cfg, opts).run()
