"""``python -m coordinator [--config FILE] [--host H] [--port P]``: same as ``kvledger coordinator``."""

from __future__ import annotations

import argparse
import sys

from shared.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator", description="run the kvledger coordinator")
    p.add_argument("--config", "-c", help="YAML config file (default: $KVL_CONFIG, else built-in defaults)")
    p.add_argument("--host", help="admin API address (default: coordinator.host)")
    p.add_argument("--port", type=int, help="admin API port (default: coordinator.port)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"kvledger: configuration error: {e}", file=sys.stderr)
        return 2
    from coordinator.app import run

    return run(cfg, host=args.host, port=args.port, config_path=args.config)


if __name__ == "__main__":
    sys.exit(main())
