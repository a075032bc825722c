"""Compile clients' grammars in child processes (:mod:`worker.grammar_child`), within a time budget,
never on the worker's event loop.

``GrammarPool(spec, processes, timeout_s, memory_mb)``: up to ``processes`` children
(``service.structured_compile_processes``), started on first use and kept warm. A job takes an
idle child and waits for its answer without blocking the loop. A child that exceeds the budget
(``service.structured_compile_timeout_ms``) is killed — the work is abandoned, not left running —
and so is one whose request was cancelled mid-compile; one that crashes (llguidance overflows its
stack on some grammars) or exceeds its memory (``service.structured_compile_memory_mb``) is gone by
itself. Each is replaced on the next job; the other children carry on. A child is also replaced
after :data:`JOBS_PER_CHILD` jobs, so that what big grammars leave in its heap does not pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

from shared.logging import get_logger

log = get_logger("kvl.worker.grammar")

#: Jobs a child compiles before it is replaced (its heap is returned to the OS).
JOBS_PER_CHILD = 256
#: Time a new child may take to start and build its tokenizer (a large vocabulary: ~1 s).
START_TIMEOUT_S = 60.0
#: Where ``python -m worker.grammar_child`` resolves (the directory holding the ``worker`` package).
_ROOT = str(Path(__file__).resolve().parents[1])


class CompileRefused(Exception):
    """The grammar was not compiled: ``code`` says why (``grammar_invalid``, ``grammar_timeout``,
    ``grammar_crashed``, ``compiler_unavailable``)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class _Child:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.jobs = 0

    async def ask(self, obj: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        body = json.dumps(obj).encode()
        self.proc.stdin.write(struct.pack(">I", len(body)) + body)
        await self.proc.stdin.drain()
        (n,) = struct.unpack(">I", await self.proc.stdout.readexactly(4))
        return json.loads(await self.proc.stdout.readexactly(n))

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(Exception):
            await self.proc.wait()


class GrammarPool:
    """See the module docstring. ``spec``: the tokenizer as :func:`worker.grammar_child.lltokenizer`
    reads it."""

    def __init__(self, spec: dict[str, Any], processes: int, timeout_s: float, memory_mb: int = 0) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._idle: asyncio.Queue[_Child | None] | None = None
        self._processes = processes
        self._live: set[_Child] = set()
        self.closed = False
        #: Children started, killed for the budget, crashed (for metrics and tests).
        self.started = self.timeouts = self.crashes = 0

    def _slots(self) -> asyncio.Queue[_Child | None]:
        if self._idle is None:                     # made on the loop that uses it
            self._idle = asyncio.Queue()
            for _ in range(self._processes):
                self._idle.put_nowait(None)
        return self._idle

    async def _start(self) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker.grammar_child", str(self.memory_mb), cwd=_ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            limit=2**26)     # NOTE: no preexec_fn, so the child is vforked: a full fork of a big worker stalls
        child = _Child(proc)
        self._live.add(child)
        self.started += 1
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                reply = await child.ask(self.spec)
        except BaseException:
            await self._drop(child)
            raise
        if not reply.get("ok"):
            await self._drop(child)
            raise CompileRefused(f"structured output is not available with this model's tokenizer: "
                                 f"{reply.get('error')}", "compiler_unavailable")
        return child

    async def _drop(self, child: _Child) -> None:
        self._live.discard(child)
        await child.kill()

    async def compile(self, kind: str, text: str) -> tuple[str, float]:
        """llguidance's grammar text for ``(kind, text)`` and the seconds its child took; raises
        :class:`CompileRefused`."""
        if self.closed:
            raise CompileRefused("the worker is shutting down", "compiler_unavailable")
        slots = self._slots()
        t0 = time.monotonic()
        try:
            # NOTE: waiting for a busy child counts against the budget too: a queue of slow
            # grammars must not hold a request longer than one compile may take
            async with asyncio.timeout(self.timeout_s):
                child = await slots.get()
        except TimeoutError:
            raise CompileRefused(f"every grammar compiler stayed busy for {self.timeout_s:g} s "
                                 f"(service.structured_compile_timeout_ms); retry later", "grammar_timeout") from None
        try:
            if child is None:
                child = await self._start()
            left = max(self.timeout_s - (time.monotonic() - t0), 0.05)
            try:
                async with asyncio.timeout(left):
                    reply = await child.ask({"kind": kind, "text": text})
            except TimeoutError:
                self.timeouts += 1
                await self._drop(child)
                child = None
                raise CompileRefused(f"compiling it took longer than {self.timeout_s:g} s "
                                     f"(service.structured_compile_timeout_ms); it was abandoned",
                                     "grammar_timeout") from None
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                self.crashes += 1
                await self._drop(child)
                code = child.proc.returncode
                child = None
                log.warning("grammar_compiler_died", kind=kind, bytes=len(text), returncode=code)
                raise CompileRefused("the grammar compiler failed on it (it ran out of memory "
                                     "(service.structured_compile_memory_mb) or crashed); simplify it",
                                     "grammar_crashed") from None
            except BaseException:
                # cancelled mid-compile: its answer would be read by the next job
                await self._drop(child)
                child = None
                raise
            child.jobs += 1
            if child.jobs >= JOBS_PER_CHILD:
                await self._drop(child)
                child = None
            if not reply.get("ok"):
                raise CompileRefused(str(reply.get("error") or "?"), "grammar_invalid")
            return str(reply["grammar"]), float(reply["seconds"])
        finally:
            slots.put_nowait(child)

    async def close(self) -> None:
        self.closed = True
        for child in list(self._live):
            await self._drop(child)


__all__ = ["JOBS_PER_CHILD", "CompileRefused", "GrammarPool"]
