"""The drills' workload: multi-turn conversations under load, every answer checked against a cold run.

*Conversations.* Conversation ``c`` opens with ``first_len`` seeded random tokens; turn ``t``
sends the previous prompt + the previous answer + ``user_len`` new tokens, greedy, with a
small ``max_tokens`` — so each turn's prompt extends the last one and the cache has
something to offer. The answer carried into the next turn is the *reference* answer (equal
to the served one unless a mismatch is recorded), so the script — and every reference — is
the same in every drill and every run: references are computed once per run.

*Reference.* A cache-disabled engine (``Engine(model, cfg, client=None)``: the same prefill
schedule, no cache at all) in this process, with the same seeded weights and one intra-op
thread like the workers: cold by construction.

*Comparison.* NATS debug replies carry token ids and logits: both must be equal bit for bit
(``logits``). HTTP replies carry text only: it must equal the reference tokens decoded the
way the byte tokenizer decodes, with the same number of completion tokens; when the text has
no replacement character the byte tokenizer is injective and this is a token-id comparison
(``tokens``), otherwise a text comparison (``text``). A failed request must fail with a clear
error; it is recorded by kind and retried (bounded), never counted as an answer.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.config import parse_config
from tests.faults.harness import Reply, Stack
from worker.engine import Engine
from worker.model import build_model


@dataclass(frozen=True)
class Expected:
    tokens: list[int]
    logits: torch.Tensor

    @property
    def text(self) -> str:
        return bytes(self.tokens).decode("utf-8", errors="replace")


def drill_cache_dtype() -> str:
    """``cache.dtype`` of every drill worker and of the cold reference (``KVL_DRILL_CACHE_DTYPE``,
    default ``auto``), to put a storage precision through the same drills."""
    return os.environ.get("KVL_DRILL_CACHE_DTYPE", "auto")


@functools.cache
def drill_bytes_scale() -> float:
    """Bytes of a block (all forms) at the drills' ``cache.dtype`` over its bytes at ``auto``: the
    drills' pool, host-tier and disk bounds are scaled by it, so an fp8 run evicts, spills and
    collects as much as the default one."""
    cache_dtype = drill_cache_dtype()
    if cache_dtype == "auto":
        return 1.0
    model = drill_model()
    size = lambda dt: sum(lay.spec.bytes_per_block for lay in model.form_layouts(16, dt).values())  # noqa: E731
    return size(cache_dtype) / size("auto")


def drill_model():
    """The model every drill runs: the built-in tiny one, or ``KVL_DRILL_MODEL_DIR`` (a checkpoint
    directory with a vocabulary of at least 256 ids — prompts are random byte ids — that the
    workers load as ``worker.model_dir``), to put another family through the same drills."""
    directory = os.environ.get("KVL_DRILL_MODEL_DIR", "")
    if not directory:
        return build_model(seed=0)
    from worker.model.checkpoint import load_checkpoint
    return load_checkpoint(directory).model


class Reference:
    """Cold runs, each computed once, in this process."""

    def __init__(self, chunk_blocks: int = 1) -> None:
        torch.set_num_threads(1)
        self.engine = Engine(drill_model(), parse_config({"cache": {"chunk_blocks": chunk_blocks,
                                                                    "dtype": drill_cache_dtype()}}), None)
        assert not self.engine.cache_enabled
        self._runs: dict[tuple[tuple[int, ...], int], asyncio.Future[Expected]] = {}
        self.computed = 0
        self.seconds = 0.0

    async def get(self, tokens: list[int], max_tokens: int) -> Expected:
        key = (tuple(tokens), max_tokens)
        fut = self._runs.get(key)
        if fut is None:
            fut = self._runs[key] = asyncio.get_running_loop().create_future()
            t0 = time.perf_counter()
            try:
                r = await self.engine.generate(list(tokens), max_tokens=max_tokens, reuse=False)
            except BaseException as e:
                del self._runs[key]
                if isinstance(e, asyncio.CancelledError):
                    fut.cancel()
                else:
                    fut.set_exception(e)
                    fut.exception()  # retrieved: whoever awaits it gets it; nobody else must
                raise
            self.seconds += time.perf_counter() - t0
            self.computed += 1
            assert r.cached_tokens == 0 and r.logits is not None
            fut.set_result(Expected(list(r.tokens), r.logits))
        return await asyncio.shield(fut)

    async def stop(self) -> None:
        await self.engine.stop()


def rand_tokens(n: int, *seed: Any) -> list[int]:
    rng = random.Random(repr(seed))
    return [rng.randrange(256) for _ in range(n)]


class Script:
    """The conversations: prompts and their references, identical in every drill."""

    def __init__(self, reference: Reference, *, turns: int, first_len: int = 28, user_len: int = 14,
                 max_tokens: int = 3, seed: int = 8) -> None:
        self.reference = reference
        self.turns = turns
        self.first_len = first_len
        self.user_len = user_len
        self.max_tokens = max_tokens
        self.seed = seed
        self._prompts: dict[tuple[int, int], list[int]] = {}

    async def turn(self, conv: int, t: int) -> tuple[list[int], Expected]:
        key = (conv, t)
        if key not in self._prompts:
            if t == 0:
                prompt = rand_tokens(self.first_len, self.seed, conv, 0)
            else:
                prev, ans = await self.turn(conv, t - 1)
                prompt = prev + ans.tokens + rand_tokens(self.user_len, self.seed, conv, t)
            self._prompts[key] = prompt
        prompt = self._prompts[key]
        return prompt, await self.reference.get(prompt, self.max_tokens)

    async def warm(self, conversations: list[int]) -> None:
        """Compute these conversations' references ahead (while the stack starts)."""
        for c in conversations:
            await self.turn(c, self.turns - 1)


# --- the record ---------------------------------------------------------------------------------

@dataclass
class Record:
    drill: str
    conv: int                      # -1: probe, -2: spike
    turn: int
    channel: str
    worker: str
    at: float                      # seconds since the run began
    seconds: float
    ok: bool
    error: str = ""
    detail: str = ""
    compared: str = ""             # logits | tokens | text ("" when the request failed)
    mismatch: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    degraded: bool = False
    fallbacks: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    reloaded: dict[str, int] = field(default_factory=dict)


def compare(reply: Reply, want: Expected) -> tuple[str, str]:
    """``(how it was compared, what differs or "")`` for a successful reply."""
    if reply.channel == "debug":
        if reply.tokens != want.tokens:
            return "logits", f"tokens {reply.tokens} != cold {want.tokens}"
        if reply.logits is None or reply.logits.shape != want.logits.shape:
            return "logits", f"logits shape {None if reply.logits is None else tuple(reply.logits.shape)}"
        if not torch.equal(reply.logits, want.logits):
            d = (reply.logits - want.logits).abs().max().item()
            return "logits", f"logits differ from the cold run (max |diff| {d:.3g})"
        return "logits", ""
    how = "text" if "\ufffd" in (reply.text or "") else "tokens"
    if reply.text != want.text:
        return how, f"text {reply.text!r} != cold {want.text!r}"
    if reply.completion_tokens != len(want.tokens):
        return how, f"{reply.completion_tokens} completion tokens, cold run {len(want.tokens)}"
    return how, ""


class History:
    """Every request of the run, as it happened."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.records: list[Record] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, drill: str, conv: int, turn: int, prompt: list[int], reply: Reply, want: Expected) -> Record:
        r = Record(drill=drill, conv=conv, turn=turn, channel=reply.channel, worker=reply.worker,
                   at=self.now() - reply.seconds, seconds=reply.seconds, ok=reply.ok, error=reply.error,
                   detail=reply.detail, prompt_tokens=len(prompt), cached_tokens=reply.cached_tokens,
                   degraded=reply.degraded, fallbacks=reply.fallbacks, invalid=reply.invalid,
                   reloaded=reply.reloaded)
        if reply.ok:
            r.compared, r.mismatch = compare(reply, want)
            if not r.mismatch and reply.prompt_tokens != len(prompt):
                r.mismatch = f"the worker counted {reply.prompt_tokens} prompt tokens, {len(prompt)} were sent"
            if not r.mismatch and not 0 <= reply.cached_tokens < len(prompt):
                r.mismatch = f"{reply.cached_tokens} cached tokens of a {len(prompt)}-token prompt"
        self.records.append(r)
        return r

    def of(self, drill: str | None = None) -> list[Record]:
        return [r for r in self.records if drill is None or r.drill == drill]

    def mismatches(self, drill: str | None = None) -> list[Record]:
        return [r for r in self.of(drill) if r.mismatch]

    def errors(self, drill: str | None = None) -> Counter[str]:
        return Counter(r.error for r in self.of(drill) if not r.ok)

    def describe_mismatches(self, drill: str | None = None) -> str:
        return "\n".join(f"  {r.drill} conv {r.conv} turn {r.turn} on {r.worker} ({r.channel}, cached "
                         f"{r.cached_tokens}, fallbacks {r.fallbacks}, invalid {r.invalid}): {r.mismatch}"
                         for r in self.mismatches(drill)[:20])


# --- load -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    cid: int
    channel: str                   # "http" | "debug" | "gateway" (workers unused: the gateway routes)
    workers: tuple[str, ...]       # preference order; a retry moves to the next
    hop: bool = False              # turn t goes to workers[t % len] (cache only via disk)


async def ask(stack: Stack, channel: str, wid: str, prompt: list[int], max_tokens: int, tenant: str) -> Reply:
    if channel == "gateway":
        # the gateway picks the worker; two greedy samples of one prefill: the fork path in every drill
        return await stack.gateway_generate(prompt, max_tokens, tenant, n=2)
    if channel == "http":
        return await stack.http_generate(wid, prompt, max_tokens, tenant)
    return await stack.debug_generate(wid, prompt, max_tokens, tenant)


class Load:
    """Conversations run concurrently, pass after pass, until stopped (after at least one pass)."""

    def __init__(self, stack: Stack, script: Script, history: History, drill: str, tenant: str,
                 conversations: list[Conversation], *, give_up_s: float = 90.0) -> None:
        self.stack = stack
        self.script = script
        self.history = history
        self.drill = drill
        self.tenant = tenant
        self.conversations = conversations
        self.give_up_s = give_up_s
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.passes: Counter[int] = Counter()
        self.gave_up: list[tuple[int, int]] = []
        self.done = 0
        self.started = 0.0
        self.ended = 0.0

    def start(self) -> Load:
        self.started = self.history.now()
        self._tasks = [asyncio.get_running_loop().create_task(self._converse(c)) for c in self.conversations]
        return self

    async def wait_done(self, n: int, timeout_s: float = 120) -> None:
        """Until ``n`` more requests of this load have succeeded."""
        target = self.done + n
        deadline = time.monotonic() + timeout_s
        while self.done < target:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.drill}: the load did not complete {n} requests in {timeout_s:.0f}s; "
                                     f"errors so far {dict(self.history.errors(self.drill))}\n"
                                     f"{self.stack.log_tails()}")
            for t in self._tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            await asyncio.sleep(0.05)

    async def stop(self, timeout_s: float = 180) -> None:
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks), timeout_s)
        finally:
            self.ended = self.history.now()

    async def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _converse(self, c: Conversation) -> None:
        while True:
            for t in range(self.script.turns):
                prompt, want = await self.script.turn(c.cid, t)
                await self._turn(c, t, prompt, want)
            self.passes[c.cid] += 1
            if self._stopping.is_set():
                return

    async def _turn(self, c: Conversation, t: int, prompt: list[int], want: Expected) -> None:
        deadline = time.monotonic() + self.give_up_s
        attempt = 0
        while True:
            i = (t if c.hop else 0) + attempt
            wid = c.workers[i % len(c.workers)]
            reply = await ask(self.stack, c.channel, wid, prompt, self.script.max_tokens, self.tenant)
            self.history.add(self.drill, c.cid, t, prompt, reply, want)
            if reply.ok:
                self.done += 1
                return
            attempt += 1
            if time.monotonic() > deadline:
                self.gave_up.append((c.cid, t))
                return
            await asyncio.sleep(min(0.25 * 2 ** min(attempt, 4), 2.0))


def probe_prompt(wid: str) -> list[int]:
    return rand_tokens(40, "probe", wid)


async def probe_reuse(stack: Stack, script: Script, history: History, drill: str, wid: str, tenant: str,
                      since: float, timeout_s: float = 150) -> float:
    """Seconds from ``since`` (monotonic) until ``wid`` answers a request *with reuse*, correctly.

    The probe sends one fixed prompt over HTTP again and again: the first success fills the
    cache, a later one reuses it.
    """
    prompt = probe_prompt(wid)
    want = await script.reference.get(prompt, 2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = await stack.http_generate(wid, prompt, 2, tenant)
        rec = history.add(drill, -1, 0, prompt, reply, want)
        if reply.ok and not rec.mismatch and reply.cached_tokens > 0:
            return time.monotonic() - since
        await asyncio.sleep(0.2)
    raise AssertionError(f"{drill}: {wid} served no request with reuse within {timeout_s:.0f}s; last probes: "
                         f"{[(r.error or 'ok', r.cached_tokens, r.fallbacks) for r in history.of(drill)[-5:]]}\n"
                         f"{stack.log_tails()}")
