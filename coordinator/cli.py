"""The ``kvledger`` command line: one entry point, one small function per subcommand.

Subcommands import what they need lazily, so ``kvledger config check`` does not load
torch and ``kvledger worker`` does not load the coordinator.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable

from shared.logging import mask_credentials
from shared.config import Config, ConfigError, load_config, to_dict

Handler = Callable[[argparse.Namespace], int]


def _load(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.json:
        print(json.dumps(to_dict(cfg), indent=2))
    else:
        print(f"configuration OK ({args.config or 'defaults'}): block_size={cfg.cache.block_size}, "
              f"database={'configured' if cfg.database.url else 'embedded'}, "
              f"nats={'configured' if cfg.nats.url else 'embedded'}")
    return 0


def cmd_services(args: argparse.Namespace) -> int:
    """Run PostgreSQL and NATS (configured or embedded) in the foreground until Ctrl-C."""
    from shared.embedded import resolve_services

    cfg = _load(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with resolve_services(cfg.database.url, cfg.nats.url, cfg.state_dir) as svc:
        print(f"postgres: {mask_credentials(svc.database_url)}\nnats:     {mask_credentials(svc.nats_url)}\n"
              "(Ctrl-C stops them)", flush=True)
        stop.wait()
    print("stopped", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger", description="kvledger: a trustworthy KV-cache layer for LLM serving")
    p.add_argument("--config", "-c", help="YAML config file (default: $KVL_CONFIG, else built-in defaults)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    cfgp = sub.add_parser("config", help="inspect the configuration")
    cfgsub = cfgp.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    chk = cfgsub.add_parser("check", help="validate the configuration and print a summary")
    chk.add_argument("--json", action="store_true", help="print the full effective configuration as JSON")
    chk.set_defaults(func=cmd_config_check)

    svc = sub.add_parser("services", help="run PostgreSQL and NATS (embedded unless configured) until Ctrl-C")
    svc.set_defaults(func=cmd_services)

    from coordinator.stack import add_arguments, cmd_up

    up = sub.add_parser("up", help="run the whole stack on this machine (services, coordinator, workers) "
                                   "until Ctrl-C or SIGTERM")
    up.add_argument("--config", "-c", default=argparse.SUPPRESS, help="YAML config file (as before the command)")
    add_arguments(up)
    up.set_defaults(func=cmd_up)

    for register in _extensions():
        register(sub)
    return p


def _extensions() -> list[Callable[[argparse._SubParsersAction], None]]:  # type: ignore[type-arg]
    """Subcommands contributed by other modules (coordinator, worker), if present."""
    found = []
    for mod_name in ("coordinator.commands", "worker.commands", "coordinator.admin_cli"):
        try:
            mod = __import__(mod_name, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != mod_name:
                raise
            continue
        found.append(mod.register)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"kvledger: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
