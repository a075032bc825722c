"""``kvledger warm --worker W --prompts FILE.jsonl``: prefill a worker with the hottest of an
operator's prompts, ranked by what the event log says was leased and reused.

What can be warmed, honestly: the log holds block hashes (salted per tenant), never text, and a
worker keeps no prompt text either, so nothing in the system can turn the log's hottest chains
back into prompts. Nor is there a path that copies one worker's GPU blocks to another: a worker
reads only its own pools, its node's host tier and the shared disk tier (which a new worker
already reads on its first request). So the operator supplies the prompts — the system prompts,
few-shot preambles and documents their traffic shares — one JSON object per line, as a request
body: ``{"prompt": "…"}`` (a completion) or ``{"messages": [...], "tools": [...]}`` (a chat).
The command

1. tokenizes each on the worker itself (``POST /tokenize``: exactly the ids a request of that
   body is fed),
2. hashes the whole blocks for the tenant of ``--api-key`` in the namespace of every live worker
   (the log's leases were taken in theirs: a new version's namespace has no history yet),
3. counts, in the last ``--window`` events of the log, the ``lease.granted`` events of that tenant
   naming each block, and how many of them found it cached (``usable_blocks``),
4. ranks the prompts by the prompt tokens those leases found cached over their prefix (then by the
   tokens leased), and sends the ``--top`` ones with any history to the worker, one at a time, as
   completions of one token with the tenant's key: the worker leases, computes (or reloads from
   the disk tier) and commits their blocks like any request's, so the next request of that prefix
   finds them there.

Image prompts are refused (their blocks are keyed by the images' contents, which a token list
cannot carry). Nothing is printed of a prompt but its line number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.cli_support import EXIT_FOUND_PROBLEMS, CliError, console, print_json, table, wrap
from shared.config import Config, load_config

#: Lines a prompts file may hold (a warm-up is a few hundred prefixes, not a workload replay).
MAX_PROMPTS = 10_000

HOT_BLOCKS = """
SELECT b.h AS block_hash, count(*) AS leases,
       count(*) FILTER (WHERE b.i <= (e.p->>'usable_blocks')::int) AS hits
FROM (SELECT payload::jsonb AS p FROM events WHERE position > $1 AND type = 'lease.granted') e,
     jsonb_array_elements_text(e.p->'block_hashes') WITH ORDINALITY AS b(h, i)
WHERE e.p->>'tenant' = $2 AND e.p->>'namespace' = ANY($3::text[]) AND b.h = ANY($4::text[])
GROUP BY b.h
"""


@dataclass
class Prompt:
    line: int
    body: dict[str, Any]
    tokens: list[int] = field(default_factory=list)
    blocks: int = 0
    #: Prompt tokens of the log's leases over this prompt's blocks, and of those found cached.
    leased_tokens: int = 0
    hit_tokens: int = 0
    outcome: str = ""
    cached_tokens: int | None = None
    seconds: float | None = None

    def row(self) -> dict[str, Any]:
        return {"line": self.line, "prompt_tokens": len(self.tokens), "blocks": self.blocks,
                "leased_tokens": self.leased_tokens, "hit_tokens": self.hit_tokens, "outcome": self.outcome,
                "cached_tokens": self.cached_tokens, "seconds": self.seconds}


def read_prompts(path: Path) -> list[Prompt]:
    """The request bodies of a JSON-lines file; :class:`CliError` naming the line of a bad one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read the prompts file {path}: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            body = json.loads(text)
        except ValueError as e:
            raise CliError(f"{path}:{n}: not a JSON object ({e})") from None
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise CliError(f"{path}:{n}: expected an object with either \"prompt\" (a completion) or "
                           "\"messages\" (a chat), as a request body")
        if "image_url" in text:
            raise CliError(f"{path}:{n}: image prompts cannot be warmed (their blocks are keyed by the images, "
                           "which a token list cannot carry); leave them out")
        out.append(Prompt(n, body))
        if len(out) > MAX_PROMPTS:
            raise CliError(f"{path}: more than {MAX_PROMPTS} prompts; warm the hottest prefixes, not a workload")
    if not out:
        raise CliError(f"{path}: no prompts")
    return out


def rank(prompts: list[Prompt], hashes: dict[int, list[tuple[int, list[str]]]],
         counts: dict[str, tuple[int, int]]) -> list[Prompt]:
    """Score each prompt from the log's counts (``counts[block] = (leases, hits)``; ``hashes[line]``:
    its (block size, chain) in each namespace) and sort them hottest first (stable on ties)."""
    for p in prompts:
        for bs, chain in hashes.get(p.line, ()):
            for h in chain:
                leases, hits = counts.get(h, (0, 0))
                p.leased_tokens += leases * bs
                p.hit_tokens += hits * bs
    return sorted(prompts, key=lambda p: (-p.hit_tokens, -p.leased_tokens, p.line))


async def hot_blocks(url: str, cfg: Config, tenant: str, namespaces: list[str], hashes: list[str],
                     window: int) -> dict[str, tuple[int, int]]:
    """``block -> (leases, hits)`` of ``tenant``'s ``lease.granted`` events in the log's last
    ``window`` events, over ``hashes`` in ``namespaces``."""
    import asyncpg

    from coordinator.log.postgres import PgSettings

    s = PgSettings.from_config(url, cfg.database, application_name="kvledger-warm", tls=cfg.tls)
    conn = await asyncpg.connect(s.dsn, ssl=s.ssl, timeout=s.connect_timeout_s,
                                 server_settings={"application_name": s.application_name})
    try:
        head = await conn.fetchval("SELECT coalesce(max(position), 0) FROM events")
        rows = await conn.fetch(HOT_BLOCKS, max(0, head - window), tenant, namespaces, hashes)
    finally:
        await conn.close()
    return {r["block_hash"]: (r["leases"], r["hits"]) for r in rows}


class Warmer:
    """The worker's HTTP side as ``warm`` uses it: its tokenizer and its completions."""

    def __init__(self, endpoint: str, api_key: str, timeout_s: float, ssl: Any = None) -> None:
        self.endpoint, self.api_key, self.timeout_s, self.ssl = endpoint.rstrip("/"), api_key, timeout_s, ssl

    async def __aenter__(self) -> Warmer:
        import aiohttp

        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                          connector=aiohttp.TCPConnector(ssl=self.ssl))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.close()

    async def _post(self, path: str, body: dict[str, Any], auth: bool) -> tuple[int, Any]:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if auth and self.api_key else {}
        try:
            async with self.http.post(self.endpoint + path, json=body, headers=headers) as r:
                try:
                    doc = await r.json(content_type=None)
                except ValueError:
                    doc = None
                return r.status, doc
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise CliError(f"worker at {self.endpoint} not reachable ({type(e).__name__}: {e})") from None

    async def tokens(self, p: Prompt) -> list[int]:
        body = ({"prompt": p.body["prompt"]} if "prompt" in p.body
                else {"messages": p.body["messages"], **({"tools": p.body["tools"]} if p.body.get("tools") else {})})
        if isinstance(body.get("prompt"), list):
            return list(body["prompt"])         # token ids: fed as they are
        status, doc = await self._post("/tokenize", body, auth=False)
        if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("tokens"), list):
            why = (doc or {}).get("error", {}).get("message") if isinstance(doc, dict) else None
            raise CliError(f"prompts file line {p.line}: the worker could not tokenize it ({why or f'HTTP {status}'})")
        return doc["tokens"]

    async def prefill(self, p: Prompt) -> None:
        t0 = time.perf_counter()
        status, doc = await self._post("/v1/completions", {"prompt": p.tokens, "max_tokens": 1, "temperature": 0},
                                       auth=True)
        p.seconds = round(time.perf_counter() - t0, 3)
        if status == 200 and isinstance(doc, dict):
            p.outcome = "warmed"
            details = (doc.get("usage") or {}).get("prompt_tokens_details") or {}
            p.cached_tokens = int(details.get("cached_tokens") or 0)
        else:
            err = (doc or {}).get("error", {}) if isinstance(doc, dict) else {}
            p.outcome = f"failed: HTTP {status} {err.get('code') or ''}".rstrip()


def _stack(args: argparse.Namespace) -> tuple[Config, Path, Any]:
    """The configuration of the stack this command belongs to (as the admin commands find it),
    its state dir, and its admin client."""
    from kvledger.admin_client import client_for
    from kvledger.discovery import NoStack, find_stack

    cfg = load_config(getattr(args, "config", None))
    state_dir = Path(cfg.state_dir)
    if not args.coordinator_url and not os.environ.get("KVL_COORDINATOR_URL"):
        try:
            stack = find_stack(getattr(args, "state_dir", None), cfg.state_dir)
        except NoStack as e:
            raise CliError(str(e)) from None
        if stack is not None:
            state_dir = stack.state_dir
            if stack.config_path and not getattr(args, "config", None) and not os.environ.get("KVL_CONFIG"):
                cfg = load_config(stack.config_path)
    elif getattr(args, "state_dir", None):
        state_dir = Path(args.state_dir)
    return cfg, state_dir, client_for(args)


def _salt(cfg: Config, state_dir: Path, tenant: str) -> bytes:
    """The tenant's hash salt as the workers derive it — never a new secret (a missing one would
    silently rank everything cold)."""
    from shared.tenants import DEFAULT_TENANT_SECRET, tenant_salt

    if cfg.auth.salt_secret:
        secret = cfg.auth.salt_secret
    elif tenant == "default":
        secret = DEFAULT_TENANT_SECRET
    else:
        path = state_dir / "tenant-salt.secret"
        try:
            secret = path.read_text().strip()
        except OSError:
            raise CliError(f"tenant {tenant}'s hash salt needs auth.salt_secret or {path} (the stack's state dir: "
                           "--state-dir, or its --config)") from None
    return tenant_salt(secret, tenant)


def cmd_warm(args: argparse.Namespace) -> int:
    from shared.hashing import chain_hashes
    from shared.tenants import AuthError, TenantDirectory
    from shared.tls import client_context

    prompts = read_prompts(Path(args.prompts))
    cfg, state_dir, admin = _stack(args)
    api_key = args.api_key or os.environ.get("KVL_API_KEY", "")
    try:
        tenant = TenantDirectory.from_config(cfg.auth).authenticate(f"Bearer {api_key}" if api_key else None).id
    except AuthError as e:
        raise CliError(f"--api-key / $KVL_API_KEY: {e}") from None
    workers = [w for w in admin.call("GET", "/v1/workers")["workers"] if w["alive"]]
    target = next((w for w in workers if w["worker_id"] == args.worker), None)
    if target is None:
        raise CliError(f"worker {args.worker} is not a live worker of this stack (kvledger workers)")
    if target["draining"] or not target.get("endpoint"):
        raise CliError(f"worker {args.worker} is draining or has no endpoint: it takes no new requests")
    db_url = args.database_url or cfg.database.url
    if not db_url:
        raise CliError("kvledger warm reads the event log: --database-url, or database.url (KVL_DATABASE_URL)")
    spaces = sorted({(w["namespace"], int(w.get("block_size") or cfg.cache.block_size)) for w in workers})
    salt = _salt(cfg, state_dir, tenant)

    async def go() -> list[Prompt]:
        async with Warmer(target["endpoint"], api_key, args.timeout_s, client_context(cfg.tls)) as w:
            for p in prompts:
                p.tokens = await w.tokens(p)
            hashes = {p.line: [(bs, chain_hashes(p.tokens, bs, ns, salt)) for ns, bs in spaces] for p in prompts}
            for p in prompts:
                p.blocks = len(p.tokens) // int(target.get("block_size") or cfg.cache.block_size)
            counts = await hot_blocks(db_url, cfg, tenant, sorted({ns for ns, _ in spaces}),
                                      sorted({h for v in hashes.values() for _, c in v for h in c}), args.window)
            ranked = rank(prompts, hashes, counts)
            chosen = [p for p in ranked if p.leased_tokens > 0 or args.include_cold][:args.top]
            for p in ranked:
                p.outcome = "cold" if p.leased_tokens == 0 and not args.include_cold else "not in --top"
            for p in chosen:
                if args.dry_run:
                    p.outcome = "would warm"
                elif p.blocks == 0:
                    p.outcome = "shorter than a block"
                else:
                    await w.prefill(p)
            return ranked

    try:
        ranked = asyncio.run(go())
    except CliError:
        raise
    except Exception as e:  # noqa: BLE001 - the log unreachable, a query refused: one readable line
        from coordinator.log.postgres import describe
        raise CliError(f"warm: {describe(e)}") from None
    failed = [p for p in ranked if p.outcome.startswith("failed")]
    if args.json:
        print_json({"worker": args.worker, "tenant": tenant, "window_events": args.window,
                    "prompts": [p.row() for p in ranked]})
    else:
        rows = [[p.line, len(p.tokens), p.hit_tokens, p.leased_tokens, p.outcome,
                 "-" if p.cached_tokens is None else p.cached_tokens, "-" if p.seconds is None else p.seconds]
                for p in ranked]
        console().print(table(f"warm {args.worker} (tenant {tenant}, the log's last {args.window} events)",
                              ["line", "tokens", "hit tokens", "leased tokens", "outcome", "cached", "s"], rows))
    return EXIT_FOUND_PROBLEMS if failed else 0


def register(sub: Any) -> None:
    p = sub.add_parser("warm", help="prefill a worker with the hottest of your prompts, ranked by the event log's "
                                    "leases of their blocks (docs/operations.md: warm-up)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", required=True, help="the worker to warm (its id, as `kvledger workers` lists it)")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                   help="one request body per line: {\"prompt\": ...} or {\"messages\": [...]}")
    p.add_argument("--api-key", default="", help="the tenant's API key (default: $KVL_API_KEY; none when "
                                                 "auth.required is off: tenant default)")
    p.add_argument("--top", type=int, default=20, help="prompts to send, hottest first (default 20)")
    p.add_argument("--window", type=int, default=1_000_000, metavar="EVENTS",
                   help="how far back the log is read, in events (default 1000000)")
    p.add_argument("--include-cold", action="store_true", help="also send prompts the log never saw leased")
    p.add_argument("--dry-run", action="store_true", help="rank and print, send nothing")
    p.add_argument("--database-url", default="", help="the event log (default: database.url)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request to the worker (default 120)")
    p.add_argument("--config", "-c", default=argparse.SUPPRESS, help="YAML config file")
    p.add_argument("--coordinator-url", metavar="URL", help="admin API (default: as `kvledger workers`)")
    p.add_argument("--state-dir", metavar="DIR", help="the state dir of the `kvledger up` to talk to")
    p.add_argument("--token", default="", help="admin bearer token (default: coordinator.admin_token, "
                                                "else $KVL_ADMIN_TOKEN)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="per admin request (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=wrap(cmd_warm))
