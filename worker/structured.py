"""Structured output: ``response_format`` ``json_object`` / ``json_schema``, and vLLM's
``structured_outputs`` extension (exactly one of ``json`` (a schema), ``regex``, ``choice`` (a
list of strings, the output is one of them) or ``grammar`` (a context-free grammar in the Lark
syntax llguidance reads: ``start: expr`` and so on)), and a forced tool call (chat's ``tool_choice``
``required`` or a named function: the template's call syntax around each function's ``parameters``,
``shared.text.tool_calls.grammar``), as a token mask on each step, computed by
llguidance (an Earley parser over the tokenizer's vocabulary, made for
LLM decoding; no dependencies, no per-schema precompilation).

Why llguidance (measured on this CPU, a 3-field JSON schema with string, integer and array
fields, 5 random valid documents): mask per token p50 30 µs / p99 0.7 ms with a 16k BPE
vocabulary, 40 µs with the 256-token byte vocabulary; outlines-core lists the allowed tokens
in 12 µs p50 but first compiles the schema to a regex index (0.1 s here, and regex indices of
JSON schemas grow fast with nesting and bounds); xgrammar needs transformers and a TVM runtime
at serving time. A token of the tiny model costs ~25–40 ms to compute: the mask is ~0.1% of it.

How it keeps the rules:

* **Exactness.** The mask is a function of the request's own tokens only; it changes which
  token is chosen, never a logit the model computed. A warm run masks exactly what a cold run
  masks, and batching does not see it (it is applied to one request's row after the forward).
* **The end.** A grammar that is complete and admits nothing more (``is_stopped``) ends the
  output with finish reason ``stop``. A model whose vocabulary has an end-of-sequence token
  gets it allowed there; one without (the byte tokenizer) ends by the grammar alone.
* **Errors.** A schema, regex or grammar llguidance cannot compile is a 400 naming the field
  (``response_format`` or ``structured_outputs``) with its message; so is an unknown ``type`` or
  key, and both fields in one request.
* **Compact JSON.** No whitespace between tokens (``whitespace_flexible`` off): a model cannot
  spend its tokens on indentation, and ``max_tokens`` goes to content. Output that reaches
  ``max_tokens`` first ends unfinished (finish reason ``length``), as OpenAI's does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from shared.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from worker.grammar_child import ByteVocab as _ByteVocab, lltokenizer
from worker.grammar_pool import CompileRefused, GrammarPool

T = TypeVar("T")


class GrammarError(ValueError):
    """The response_format cannot be served (a 400 naming it, or ``param`` when given); ``code``
    says which limit or failure."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_grammar") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class StructuredLimits:
    """``service.structured_*``: what a client's grammar may be, and what compiling it may cost."""

    max_bytes: int = 256 * 1024
    max_choices: int = 10_000
    max_schema_depth: int = 32
    timeout_s: float = 5.0
    processes: int = 2
    memory_mb: int = 1024
    cache_bytes: int = 2 * 2**20

    @classmethod
    def of(cls, service: Any) -> StructuredLimits:
        """From a :class:`shared.config.ServiceConfig`."""
        return cls(max_bytes=service.structured_max_bytes, max_choices=service.structured_max_choices,
                   max_schema_depth=service.structured_max_schema_depth,
                   timeout_s=service.structured_compile_timeout_ms / 1000,
                   processes=service.structured_compile_processes, memory_mb=service.structured_compile_memory_mb,
                   cache_bytes=service.structured_cache_bytes)


class GrammarMetrics:
    """Compilation metrics, on the worker's registry (one per registry)."""

    _by_registry: dict[int, GrammarMetrics] = {}

    @classmethod
    def of(cls, registry: CollectorRegistry) -> GrammarMetrics:
        m = cls._by_registry.get(id(registry))
        if m is None or m.registry is not registry:
            m = cls._by_registry[id(registry)] = cls(registry)
        return m

    def __init__(self, r: CollectorRegistry) -> None:
        self.registry = r
        self.compiles = Counter("kvl_worker_grammar_compiles", "Structured-output grammars asked for, by outcome "
                                "(compiled, cached, refused)", ["outcome"], registry=r)
        self.refused = Counter("kvl_worker_grammar_refused", "Grammars refused, by reason (a service.structured_* "
                               "limit, grammar_timeout, grammar_crashed, invalid_grammar)", ["reason"], registry=r)
        self.seconds = Histogram("kvl_worker_grammar_compile_seconds", "Time a grammar took to compile in the "
                                 "compiler's child process", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
                                 registry=r)


class StructuredOutput:
    """One worker's llguidance tokenizer (built on first use, on a thread: ~1 s for a large
    vocabulary), its compiler pool, and the grammars it compiled (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, model_vocab: int, limits: StructuredLimits | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_vocab = model_vocab
        self.limits = limits or StructuredLimits()
        self.metrics = GrammarMetrics.of(registry if registry is not None else CollectorRegistry())
        self._lltok: Any = None
        self._pool: GrammarPool | None = None
        self._threads = ThreadPoolExecutor(max(self.limits.processes, 1), thread_name_prefix="kvl-grammar")
        #: Checking and quoting what a client sent: short, and not behind a long template build.
        self._prep = ThreadPoolExecutor(1, thread_name_prefix="kvl-grammar-prep")
        self._cache: OrderedDict[str, Grammar | GrammarError] = OrderedDict()
        self._cache_size: dict[str, int] = {}
        self._cache_total = 0
        self._pending: dict[str, asyncio.Future[Grammar]] = {}

    def _spec(self) -> dict[str, Any]:
        """The tokenizer as :func:`worker.grammar_child.lltokenizer` reads it."""
        tok = self.tokenizer
        if isinstance(tok, ByteTokenizer):
            # one id past the model's vocabulary: the grammar's end, never a logit
            return {"byte_vocab": self.model_vocab + 1}
        if isinstance(tok, HFTokenizer):
            eos = sorted(t for t in tok.eos_token_ids if t < self.model_vocab)
            n = max(self.model_vocab, tok.vocab_size)
            return {"hf_json": tok.to_json(), "n_vocab": n if eos else n + 1, "eos": eos or n}
        raise GrammarError(f"response_format: structured output needs a byte or tokenizers tokenizer, "
                           f"not {type(tok).__name__}")

    async def _llg(self) -> Any:
        if self._lltok is None:
            spec = self._spec()
            try:
                lltok = await asyncio.get_running_loop().run_in_executor(self._threads, lltokenizer, spec)
            except ValueError as e:     # a decoder llguidance cannot map to bytes (a 400, not a 500)
                raise GrammarError(f"structured output is not available with this model's tokenizer: {e}") \
                    from None
            self._lltok = self._lltok or lltok
        return self._lltok

    # --- the request's fields ------------------------------------------------------------------

    async def compile(self, response_format: dict[str, Any] | None) -> Grammar | None:
        """The grammar of a request's ``response_format`` (None: free text)."""
        if not response_format:
            return None
        kind = response_format.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise GrammarError("response_format: json_schema needs {'json_schema': {'name': ..., 'schema': "
                                   "{...}}}")
            schema = spec.get("schema") or {}
        else:
            raise GrammarError(f"response_format: type {kind!r} is not supported; use text, json_object or "
                               f"json_schema")
        return await self._schema("response_format: the schema", schema)

    async def compile_extension(self, spec: dict[str, Any] | None) -> Grammar | None:
        """The grammar of vLLM's ``structured_outputs`` (None or empty: free text)."""
        if not spec:
            return None
        given = [k for k in _EXTENSION_KINDS if spec.get(k) is not None]
        unknown = sorted(set(spec) - set(_EXTENSION_KINDS))
        if unknown:
            raise GrammarError(f"structured_outputs: unknown key(s) {unknown}; give one of {list(_EXTENSION_KINDS)}")
        if len(given) != 1:
            raise GrammarError(f"structured_outputs: give exactly one of {list(_EXTENSION_KINDS)} (got {given or 'none'})")
        kind, value = given[0], spec[given[0]]
        if kind == "json":
            if isinstance(value, str):
                self._check_bytes("structured_outputs.json", len(value.encode()))
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise GrammarError(f"structured_outputs: json is not a JSON schema: {e}") from None
            if not isinstance(value, dict):
                raise GrammarError("structured_outputs: json must be a JSON schema (an object)")
            return await self._schema("structured_outputs: the json schema", value, "structured_outputs.json")
        if kind == "choice":
            if not isinstance(value, list) or not value:
                raise GrammarError("structured_outputs: choice must be a non-empty list of non-empty strings")
            lim = self.limits
            if len(value) > lim.max_choices:
                raise self._refuse(f"structured_outputs.choice: {len(value)} choices; at most {lim.max_choices} "
                                   f"(service.structured_max_choices)", "structured_max_choices")
            # NOTE: 10,000 strings take tens of ms to check and quote: on a thread, so the loop keeps turning
            lark, size = await self._off(_choice_lark, value)
            self._check_bytes("structured_outputs.choice", size)
            return await self._build("structured_outputs: the choices", "lark", lark)
        if not isinstance(value, str) or not value:
            raise GrammarError(f"structured_outputs: {kind} must be a non-empty string")
        self._check_bytes(f"structured_outputs.{kind}", len(value.encode()))
        if kind == "regex":
            return await self._build("structured_outputs: the regex", "regex", value)
        return await self._build("structured_outputs: the grammar", "lark", value)

    async def compile_tool_calls(self, lark: str, schemas: Sequence[tuple[str, dict[str, Any]]]) -> Grammar:
        """The grammar that forces a tool call (``shared.text.tool_calls.grammar``, a Lark grammar with
        each function's ``parameters`` inline). When it does not compile, each schema
        (``(param, schema)``) is compiled alone, so the error names the one at fault."""
        await self._llg()               # a tokenizer llguidance cannot read is no schema's fault
        for param, schema in schemas:
            self._check_depth(param, schema)
        try:
            return await self._build("tool_choice: the tool-call grammar", "lark", lark)
        except GrammarError as whole:
            if whole.code != "invalid_grammar":
                raise
            for param, schema in schemas:
                try:
                    await self._schema(f"{param}: the schema", schema)
                except GrammarError as e:
                    raise GrammarError(str(e), param, e.code) from None
            raise whole from None

    # --- limits -----------------------------------------------------------------------------------

    def _refuse(self, message: str, code: str) -> GrammarError:
        self.metrics.refused.labels(reason=code).inc()
        self.metrics.compiles.labels(outcome="refused").inc()
        return GrammarError(message, code=code)

    def _check_bytes(self, what: str, n: int) -> None:
        if n > self.limits.max_bytes:
            raise self._refuse(f"{what}: {n} bytes; at most {self.limits.max_bytes} (service.structured_max_bytes)",
                               "structured_max_bytes")

    def _check_depth(self, what: str, schema: Any) -> None:
        """The schema's nesting (objects and arrays inside each other) within ``max_schema_depth``;
        iterative, so a deep document cannot exhaust this check's stack either."""
        limit = self.limits.max_schema_depth
        stack: list[tuple[Any, int]] = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > limit:
                raise self._refuse(f"{what}: nested more than {limit} deep (service.structured_max_schema_depth)",
                                   "structured_max_schema_depth")
            children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))

    async def _off(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the grammar threads (CPU work of a size the client chose)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    async def _schema(self, what: str, schema: dict[str, Any], field: str | None = None) -> Grammar:
        self._check_depth(field or what.split(":")[0], schema)
        text = await self._off(json.dumps, schema)
        self._check_bytes(field or what.split(":")[0], len(text.encode()))
        return await self._build(what, "json_schema", text)

    # --- compile, once per content ------------------------------------------------------------

    async def _build(self, what: str, kind: str, text: str) -> Grammar:
        await self._llg()               # a tokenizer llguidance cannot read is no grammar's fault
        key = hashlib.sha256(f"{kind}\0{text}".encode()).hexdigest()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.metrics.compiles.labels(outcome="cached").inc()
            if isinstance(hit, GrammarError):
                raise GrammarError(f"{what} {hit}", hit.param, hit.code)
            return hit
        pending = self._pending.get(key)
        if pending is not None:                 # the same grammar is being compiled: wait for it
            try:
                return await asyncio.shield(pending)
            except GrammarError as e:
                raise GrammarError(f"{what} {e}", e.param, e.code) from None
        fut: asyncio.Future[Grammar] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            grammar = await self._compile(kind, text)
        except GrammarError as e:
            if e.code != "compiler_unavailable":
                self._remember(key, e, len(text))
            fut.set_exception(e)
            fut.exception()                     # retrieved: no warning when nobody else waited
            raise GrammarError(f"{what} {e}", e.param, e.code) from None
        except BaseException as e:
            fut.set_exception(GrammarError("cannot be compiled now (the request that compiled it ended); retry",
                                           code="compiler_unavailable"))
            fut.exception()
            raise e from None
        finally:
            self._pending.pop(key, None)
        self._remember(key, grammar, len(text))
        fut.set_result(grammar)
        return grammar

    async def _compile(self, kind: str, text: str) -> Grammar:
        """Compiled in a child within the budget, then built here on a thread."""
        lltok = await self._llg()
        if self._pool is None:
            lim = self.limits
            self._pool = GrammarPool(self._spec(), lim.processes, lim.timeout_s, lim.memory_mb)
        try:
            grammar, seconds = await self._pool.compile(kind, text)
        except CompileRefused as e:
            self.metrics.refused.labels(reason=e.code if e.code != "grammar_invalid" else "invalid_grammar").inc()
            self.metrics.compiles.labels(outcome="refused").inc()
            if e.code == "grammar_invalid":
                raise GrammarError(f"cannot be compiled: {e}") from None
            raise GrammarError(f"cannot be compiled: {e}", code=e.code) from None
        self.metrics.seconds.observe(seconds)
        self.metrics.compiles.labels(outcome="compiled").inc()
        return await asyncio.get_running_loop().run_in_executor(self._threads, _template, lltok, grammar,
                                                                self.model_vocab)

    def _remember(self, key: str, value: Grammar | GrammarError, size: int) -> None:
        if size > self.limits.cache_bytes:
            return
        self._cache[key] = value
        self._cache_size[key] = size
        self._cache_total += size
        while self._cache_total > self.limits.cache_bytes:
            old, _ = self._cache.popitem(last=False)
            self._cache_total -= self._cache_size.pop(old)

    async def close(self) -> None:
        """Stop the compiler's children (the app's cleanup)."""
        if self._pool is not None:
            await self._pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._prep.shutdown(wait=False, cancel_futures=True)


def _choice_lark(choices: list[Any]) -> tuple[str, int]:
    """The Lark grammar whose output is one of ``choices``, and their size in bytes.

    Each choice is a Lark string literal (JSON quoting is Lark's). NOTE: one terminal (a lexeme,
    run by the lexer's automaton), not a rule of alternatives: the parser refuses a row of more
    than 2,000 items at the first token, and the lexeme compiles ~5x faster (10,000: 0.07 s)."""
    if not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("structured_outputs: choice must be a non-empty list of non-empty strings")
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices), sum(len(c.encode()) for c in choices)


def _template(lltok: Any, grammar: str, model_vocab: int) -> Grammar:
    """A matcher every request copies, with its first mask computed (on the grammar thread)."""
    import llguidance

    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    return Grammar(m, bytes(m.compute_bitmask()), model_vocab)


#: ``structured_outputs`` keys this worker serves (vLLM's names).
_EXTENSION_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """A compiled grammar: a template matcher and its first mask; :meth:`start` gives one request
    its own copy (cheap: no compilation on the event loop)."""

    template: Any
    first_mask: bytes
    model_vocab: int

    def start(self) -> Constraint:
        return Constraint(self.template.deep_copy(), self.model_vocab, self.first_mask)


class Constraint:
    """One request's matcher: the allowed tokens now, and the tokens it was fed."""

    def __init__(self, matcher: Any, model_vocab: int, first_mask: bytes | None = None) -> None:
        self.m = matcher
        self.vocab = model_vocab
        #: The mask before any token (computed once, with the template): used until a token is fed.
        self._first = first_mask

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more (or the matcher failed)."""
        return bool(self.m.is_stopped() or self.m.is_error())

    def allowed(self) -> torch.Tensor:
        """Bool mask over the model's vocabulary."""
        raw = self._first if self._first is not None else self.m.compute_bitmask()
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        mask = np.zeros(self.vocab, dtype=bool)
        n = min(self.vocab, bits.size)
        mask[:n] = bits[:n].astype(bool)
        return torch.from_numpy(mask)

    def advance(self, token: int) -> None:
        self._first = None
        self.m.consume_token(token)


__all__ = ["Constraint", "Grammar", "GrammarError", "GrammarMetrics", "StructuredLimits", "StructuredOutput"]
