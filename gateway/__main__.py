"""``python -m gateway [--config FILE]``: the gateway process (``kvledger gateway`` in the stack).

Reads the workers' text side from ``worker.model_dir`` (tokenizer, chat template, and the vision
input its ``config.json`` declares) so that it hashes prompts as they do, connects to NATS as
``gateway.<gateway.gateway_id>``, serves HTTP on ``gateway.host:gateway.port`` and prints
``listening on <url>`` once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from aiohttp import web

from gateway.app import Gateway, create_app
from shared import nats_auth, tracing
from shared.config import ConfigError, load_config
from shared.event_loop import loop_factory
from shared.logging import configure_logging, get_logger
from shared.images import image_spec_of
from shared.key_rotation import KeyReloader, config_loader
from shared.text.chat_template import load_chat_template
from shared.text.image_prompt import ImagePrompting
from shared.text.checkpoint_files import CheckpointFileError
from shared.text.tokenizer import load_tokenizer
from shared.tls import client_context, http_scheme, server_context

log = get_logger("kvl.gateway.main")


async def serve(cfg, config_path: str | None = None) -> int:
    if not cfg.nats.url:
        print("kvledger gateway: config key nats.url is required (the coordinator's NATS server)", file=sys.stderr)
        return 2
    try:
        # NOTE: no model here: the vocabulary check is the workers' (2**31 admits any tokenizer).
        tokenizer = load_tokenizer(cfg.worker.model_dir, 2**31)
        template = load_chat_template(cfg.worker.model_dir)
        spec = image_spec_of(cfg.worker.model_dir)     # the model's vision input, as its workers read it
        images = ImagePrompting.of(tokenizer, spec) if spec is not None else None
        auth = nats_auth.connect_kwargs(cfg.nats)
    except (CheckpointFileError, nats_auth.AuthConfigError) as e:
        print(f"kvledger gateway: {e}", file=sys.stderr)
        return 2
    tls = client_context(cfg.tls)
    gw = Gateway(cfg, tokenizer, template, nats_kwargs={**auth, **({"tls": tls} if tls is not None else {})},
                 client_ssl=tls, images=images)
    try:
        await gw.start()
    except Exception as e:  # noqa: BLE001 - NATS unreachable at start
        print(f"kvledger gateway: cannot reach NATS: {e}", file=sys.stderr)
        return 2
    tracing.setup(cfg.tracing, "gateway", instance=cfg.gateway.gateway_id)   # before the app: its middleware
    runner = web.AppRunner(create_app(gw), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.gateway.host, cfg.gateway.port, ssl_context=server_context(cfg.tls))
        await site.start()
    except OSError as e:
        print(f"kvledger gateway: cannot serve HTTP on {cfg.gateway.host}:{cfg.gateway.port}: {e}", file=sys.stderr)
        await gw.stop()
        return 2
    host, port = runner.addresses[0][:2]
    url = f"{http_scheme(cfg.tls)}://{host}:{port}"
    log.info("gateway_listening", url=url, gateway_id=cfg.gateway.gateway_id, workers=len(gw.fleet))
    # SIGHUP or a changed file: the API keys are read again (old ones kept for auth.rotation_grace_s),
    # and the rollout's gateway.version_weights / version_prefix_tokens
    load = config_loader(config_path)
    reloader = KeyReloader(load, cfg, log, path=config_path or os.environ.get("KVL_CONFIG"),
                           directories=(gw.tenants,), counter=gw.metrics.auth_reloads,
                           on_config=gw.reload_rollout) if load else None
    if reloader is not None:
        reloader.start()
    print(f"listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if reloader is not None:
        await reloader.stop()
    await runner.cleanup()
    await gw.stop()
    tracing.shutdown()      # the last spans flushed
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway", description="kvledger gateway")
    p.add_argument("--config", help="YAML config file (KVL_* environment overrides apply)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"kvledger gateway: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.logging.format, cfg.logging.level)
    try:
        factory = loop_factory(cfg.gateway.event_loop, "gateway.event_loop")
    except ConfigError as e:
        print(f"kvledger gateway: {e}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(cfg, config_path=args.config))


if __name__ == "__main__":
    sys.exit(main())
