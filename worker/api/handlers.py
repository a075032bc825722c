"""The endpoints: parse the request, call the scheduler, serialise the result.

``POST /v1/completions``, ``POST /v1/chat/completions`` (prompt from
:mod:`shared.text.chat_template`), ``GET /v1/models``; ``GET /healthz``, ``/readyz``,
``/metrics``. A completion's text prompt is encoded with the tokenizer's special tokens (e.g.
Llama's BOS), a chat prompt without them (its template writes them), as vLLM does; omitted
sampling fields take the checkpoint's defaults (:mod:`shared.text.generation_config`). Streaming
is Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``.

Chat ``image_url`` parts are checked, read and placed in the prompt by :mod:`worker.api.images`.
Chat ``tools`` are rendered by the template; the output's tool calls become ``message.tool_calls``
(streamed: ``delta.tool_calls``, whole calls once the output ends), :mod:`worker.api.tools`.

``usage`` always carries ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``prompt_tokens_details.cached_tokens`` (prompt tokens restored from validated cache; 0 on
a miss). A stream carries it on its last chunk — in the separate ``choices: []`` chunk when
``stream_options.include_usage`` is set (OpenAI's way), else on the chunk with the
``finish_reason``. Responses also carry ``kvl``: whether reuse was allowed, and why the
request recomputed more than the cache offered (``fallbacks``), if it did.

A streaming response sends its headers only with its first token, so anything that fails
before then (queue full, queue timeout, ...) is still an ordinary HTTP error status; a
failure after it is an ``error`` event (which the openai client raises), then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from shared import access_log
from shared.tenants import effective_priority
from worker.api.errors import ApiError, to_api_error, internal_error
from worker.api.keys import (
    CHAT_TEMPLATE, CONFIG, ENGINE, SAMPLING, SCHEDULER, SERVED, STRUCTURED, TENANT, TOKENIZER, TOOL_FORMAT, Served,
)
from shared.text.generation_config import DEFAULT_MAX_TOKENS
from shared.versions import package_version
from shared import http_limits
from worker.api.logprobs import LogprobsShape
from worker.api.schemas import (
    BaseRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, decode,
)
from worker.api.output import Ending, Output
from shared.images import PromptImage
from shared.text.chat_template import ChatMessage, message
from worker.api import tools as tools_api
from worker.api.images import chat_images
from worker.api.tools import ToolPlan
from worker.generation import SamplingParams
from worker.request import GenRequest, Job
from worker.structured import GrammarError


# --- input ---------------------------------------------------------------------------------------

async def read_body(request: web.Request, served: Served) -> bytes:
    """The body, within ``service.max_body_bytes`` and ``service.body_read_timeout_ms``: a slower
    sender gets a 408 and its connection back instead of holding it (and a handler) open."""
    try:
        return await http_limits.read_body(request, served.max_body_bytes, served.body_read_timeout_s)
    except http_limits.BodyTimeout as e:
        raise ApiError(408, str(e), type="timeout_error", code="body_timeout", headers={"Connection": "close"}) from None


def check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.model_id:
        raise ApiError(404, f"model {model!r} does not exist on this worker; GET /v1/models lists "
                            f"{served.model_id!r}", param="model", code="model_not_found")


async def structured(request: web.Request, body: BaseRequest) -> Any:
    """The output's grammar, compiled off the event loop within ``service.structured_*``
    (:mod:`worker.structured`)."""
    so = request.app[STRUCTURED]
    if body.structured_outputs:
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise ApiError.invalid("give response_format or structured_outputs, not both", "structured_outputs")
        try:
            return await so.compile_extension(body.structured_outputs)
        except GrammarError as e:
            raise ApiError.invalid(str(e), "structured_outputs", code=e.code) from None
    try:
        return await so.compile(body.response_format)
    except GrammarError as e:
        raise ApiError.invalid(str(e), "response_format", code=e.code) from None


async def gen_request(request: web.Request, body: BaseRequest, tokens: list[int], max_tokens: int | None,
                images: tuple[PromptImage, ...] = (), tools: ToolPlan | None = None) -> GenRequest:
    """The scheduler's request; a forced tool call (``tools.grammar``) is its output's grammar."""
    tok = request.app[TOKENIZER]
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS
    body.check_vocab(request.app[ENGINE].model.cfg.vocab_size, max_tokens)
    temperature, top_p, top_k = request.app[SAMPLING].resolve(body.temperature, body.top_p, body.top_k)
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=body.seed63, min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, logit_bias=body.bias(), min_tokens=body.min_tokens,
        logprobs=body.top_logprobs_count,
        grammar=tools.grammar if tools is not None and tools.grammar is not None else await structured(request, body))
    return GenRequest(tokens=tokens, max_tokens=max_tokens, tenant=request[TENANT], sampling=sampling,
                      reuse=body.cache_reuse, priority=effective_priority(request[TENANT], body.priority),
                      stop_token_ids=(frozenset() if body.ignore_eos else tok.eos_token_ids) | frozenset(body.stop_token_ids or ()),
                      images=images)


# --- output --------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Shape:
    """What differs between the two endpoints' responses."""

    chat: bool
    id: str
    created: int
    model: str
    fingerprint: str
    #: A chat request with tools: how its output becomes ``tool_calls`` (None: text only).
    tools: ToolPlan | None = None

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False,
              logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**self.head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self.head("text_completion"), "choices": [choice]}

    def tool_chunk(self, calls: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        """A chat chunk of whole tool calls (``delta.tool_calls``, each with its ``index``)."""
        choice = {"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
        return {**self.head("chat.completion.chunk"), "choices": [choice]}

    def choice(self, end: Ending, logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        """A whole output's choice (:meth:`Output.whole`)."""
        if self.chat:
            msg = end.message or {"role": "assistant", "content": end.text}
            return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": end.finish}
        return {"index": index, "text": end.text, "logprobs": logprobs, "finish_reason": end.finish}

    def full(self, end: Ending, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self.head("chat.completion" if self.chat else "text_completion"),
                "choices": [self.choice(end, logprobs)]}

    def last_chunks(self, end: Ending, logprobs: dict[str, Any] | None, index: int = 0) -> list[dict[str, Any]]:
        """A streamed output's last chunks: text still held, the tool calls, the ``finish_reason``."""
        out, tail = [], end.text
        if end.tool_calls:
            if tail:
                out.append(self.chunk(tail, index=index))
                tail = ""
            out.append(self.tool_chunk(end.tool_calls, index=index))
        out.append(self.chunk(tail if tail else (None if self.chat else ""), end.finish, logprobs=logprobs, index=index))
        return out


def usage(job: Job, completion_tokens: int) -> dict[str, Any]:
    return access_log.note_usage({"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
                                  "total_tokens": job.prompt_tokens + completion_tokens,
                                  "prompt_tokens_details": {"cached_tokens": job.cached_tokens}})


def kvl_info(job: Job) -> dict[str, Any]:
    access_log.note(fallbacks=job.fallbacks)
    return {"cache_reuse": job.req.reuse, "fallbacks": job.fallbacks, "degraded": job.degraded}


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


async def _generate(request: web.Request, body: BaseRequest, shape: _Shape, tokens: list[int],
                    max_tokens: int | None, images: tuple[PromptImage, ...] = ()) -> web.StreamResponse:
    if body.samples > 1:
        return await _generate_samples(request, body, shape, tokens, max_tokens, images)
    sched = request.app[SCHEDULER]
    # NOTE: everything that can refuse the request happens before submit: a request answered
    # 400 must never be left running in the scheduler (it would hold a slot to max_tokens).
    req = await gen_request(request, body, tokens, max_tokens, images, shape.tools)
    lps = (LogprobsShape(request.app[TOKENIZER], chat=shape.chat, top=req.sampling.logprobs)
           if req.sampling.logprobs is not None else None)
    echo: tuple[str, dict[str, Any] | None] | None = None
    if getattr(body, "echo", False):
        # the prompt's text before the completion; with logprobs, its tokens' from a cold pass
        prompt = body.prompt_value()                              # type: ignore[attr-defined]
        echo = (prompt if isinstance(prompt, str) else request.app[TOKENIZER].decode(tokens),
                lps.prompt_entries(tokens, await request.app[ENGINE].prompt_logits(tokens, images)) if lps else None)
    job = sched.submit(req)
    try:
        out = Output(job, request.app[TOKENIZER].detokenizer(), body.stops(), lps=lps, tools=shape.tools,
                     stream=body.stream)
        if body.stream:
            return await _stream(request, body, shape, out, echo)
        end = await out.whole(echo[0] if echo else "")
        resp = shape.full(end, _joined(echo[1] if echo else None, out.all_logprobs()))
        resp["usage"] = usage(job, out.tokens)
        resp["kvl"] = kvl_info(job)
        return json_response(resp)
    finally:
        # NOTE: whatever happened (client gone, error, stop string), the job ends here and
        # the engine releases its leases before the handler returns.
        await job.aclose()


async def _end_with_error(resp: web.StreamResponse, send: Any, e: Exception) -> web.StreamResponse:
    """A stream that has started ends with an error event (OpenAI's shape) and ``[DONE]``."""
    err = to_api_error(e) or internal_error()
    with contextlib.suppress(ConnectionResetError):
        await send(err.body())
        await send(b"[DONE]")
        await resp.write_eof()
    return resp


def _joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects as one (the echoed prompt's, then the completion's)."""
    if first is None or then is None:
        return then
    return {k: first[k] + then[k] for k in then}


async def _stream(request: web.Request, body: BaseRequest, shape: _Shape, out: Output,
                  echo: tuple[str, dict[str, Any] | None] | None = None) -> web.StreamResponse:
    resp: web.StreamResponse | None = None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    job = out.job

    async def send(obj: Any) -> None:
        assert resp is not None
        await resp.write(b"data: " + (obj if isinstance(obj, bytes) else msgspec.json.encode(obj)) + b"\n\n")

    async def start() -> None:
        nonlocal resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        if shape.chat:
            await send(shape.chunk("", role=True))
        elif echo is not None:
            await send(shape.chunk(echo[0], logprobs=echo[1]))

    try:
        async for piece in out.pieces():
            first = resp is None
            if first:
                await start()
            if piece or (first and not shape.chat):
                # NOTE: the first token always makes a chunk (chat: the role chunk), even when its
                # text is still held back (a partial UTF-8 sequence), so clients see time to first token.
                await send(shape.chunk(piece, logprobs=out.new_logprobs()))
    except ConnectionResetError:
        # the client went away between two chunks (the finally in _generate ends the job)
        raise asyncio.CancelledError() from None
    except Exception as e:  # noqa: BLE001 - before the first token: an HTTP status; after: an error event
        if resp is None:
            raise
        return await _end_with_error(resp, send, e)
    if resp is None:
        await start()
    *before, last = shape.last_chunks(await out.end(), out.new_logprobs() if out.logprobs_pending else None)
    for chunk in before:
        await send(chunk)
    last["kvl"] = kvl_info(job)
    if include_usage:
        await send(last)
        await send({**shape.head(last["object"]), "choices": [], "usage": usage(job, out.tokens)})
    else:
        last["usage"] = usage(job, out.tokens)
        await send(last)
    await send(b"[DONE]")
    await resp.write_eof()
    return resp


# --- n > 1 and best_of ----------------------------------------------------------------------------

async def _generate_samples(request: web.Request, body: BaseRequest, shape: _Shape, tokens: list[int],
                            max_tokens: int | None, images: tuple[PromptImage, ...] = ()) -> web.StreamResponse:
    """``n`` (or ``best_of``) samples of one prompt, one prefill: the first sample leases,
    restores and prefills the prompt; the others wait for it and each decode a copy of the state
    it leaves (``Scheduler.submit(fork_of=)``); their decode steps share forwards. Sample ``i``
    is seeded ``seed + i`` (with a ``seed``)."""
    sched = request.app[SCHEDULER]
    body.check_n(request.app[CONFIG].service.max_n)
    base = await gen_request(request, body, tokens, max_tokens, images, shape.tools)
    k, n = body.samples, body.n
    want_lp = base.sampling.logprobs

    jobs: list[Job] = []

    def submit(i: int) -> Job:
        sp = base.sampling
        seed = None if sp.seed is None else (sp.seed + i) % (1 << 63)
        lp = want_lp if want_lp is not None else (0 if k > n else None)   # best_of ranks by logprob
        jobs.append(sched.submit(dataclasses.replace(base, sampling=dataclasses.replace(sp, seed=seed, logprobs=lp)),
                                 fork_of=jobs[0] if jobs else None))
        return jobs[-1]

    def output(i: int, job: Job, prefetched: tuple[int, ...]) -> Output:
        lps = LogprobsShape(request.app[TOKENIZER], chat=shape.chat, top=want_lp) if want_lp is not None else None
        return Output(job, request.app[TOKENIZER].detokenizer(), body.stops(), lps=lps, tools=shape.tools,
                      stream=body.stream, prefetched=prefetched)

    try:
        for i in range(k):
            submit(i)
        first = await anext(jobs[0], None)
        samples = [output(i, job, (first,) if i == 0 and first is not None else ()) for i, job in enumerate(jobs)]
        if body.stream:
            return await _stream_samples(request, body, shape, samples)
        ends = await asyncio.gather(*(s.whole() for s in samples))
        ranked = sorted(range(k), key=lambda i: -samples[i].total_logprob)[:n] if k > n else range(k)
        out = {**shape.head("chat.completion" if shape.chat else "text_completion"),
               "choices": [shape.choice(ends[j], samples[j].all_logprobs(), i) for i, j in enumerate(ranked)]}
        out["usage"] = _samples_usage(samples)
        out["kvl"] = {**kvl_info(jobs[0]), "samples_cached_tokens": [j.cached_tokens for j in jobs],
                      "samples_forked": [j.forked for j in jobs]}
        return json_response(out)
    finally:
        for job in jobs:
            await job.aclose()


def _samples_usage(samples: list[Output]) -> dict[str, Any]:
    """The prompt once (its first run's cache figure), the completions of every sample."""
    completion = sum(s.tokens for s in samples)
    return access_log.note_usage({**usage(samples[0].job, completion), "completion_tokens": completion})


async def _stream_samples(request: web.Request, body: BaseRequest, shape: _Shape,
                          samples: list[Output]) -> web.StreamResponse:
    """Each sample's chunks carry its ``index``; they interleave as the samples advance."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    lock = asyncio.Lock()

    async def send(obj: Any) -> None:
        async with lock:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else msgspec.json.encode(obj)) + b"\n\n")

    async def run(i: int, s: Output) -> None:
        if shape.chat:
            await send(shape.chunk("", role=True, index=i))
        async for piece in s.pieces():
            if piece:
                await send(shape.chunk(piece, logprobs=s.new_logprobs(), index=i))
        for chunk in shape.last_chunks(await s.end(), s.new_logprobs() if s.logprobs_pending else None, i):
            await send(chunk)

    try:
        await asyncio.gather(*(run(i, s) for i, s in enumerate(samples)))
    except ConnectionResetError:
        raise asyncio.CancelledError() from None
    except Exception as e:  # noqa: BLE001 - the stream has started: an error event
        return await _end_with_error(resp, send, e)
    if include_usage:
        await send({**shape.head("chat.completion.chunk" if shape.chat else "text_completion"), "choices": [],
                    "usage": _samples_usage(samples)})
    await send(b"[DONE]")
    await resp.write_eof()
    return resp


def _shape(request: web.Request, chat: bool, tools: ToolPlan | None = None) -> _Shape:
    served = request.app[SERVED]
    prefix = "chatcmpl-" if chat else "cmpl-"
    return _Shape(chat=chat, id=prefix + uuid.uuid4().hex, created=int(time.time()), model=served.model_id,
                  fingerprint=served.fingerprint, tools=tools)


def _message(body: ChatCompletionRequest | TokenizeRequest, i: int, image: str | None) -> ChatMessage:
    """Message ``i`` as the template gets it (:func:`shared.text.chat_template.message`, as the gateway too)."""
    m = (body.messages or [])[i]
    return message(m.role, None if m.content is None else body.text_of(i, image), m.name, m.tool_calls,
                   m.tool_call_id)


# --- handlers ------------------------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body: CompletionRequest = decode(await read_body(request, served), CompletionRequest)
    body.checks()
    check_model(served, body.model)
    prompt = body.prompt_value()
    tokens = request.app[TOKENIZER].encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
    return await _generate(request, body, _shape(request, chat=False), tokens, body.max_tokens)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    served = request.app[SERVED]
    body: ChatCompletionRequest = decode(await read_body(request, served), ChatCompletionRequest)
    body.checks()
    check_model(served, body.model)
    tools = await tools_api.plan(request.app[TOOL_FORMAT], body.tools, body.choice, body.parallel_tool_calls is not False,
                           request.app[STRUCTURED])
    images = await chat_images(request, body.messages)        # empty without image parts
    messages = [images.message(i, _message(body, i, images.placeholder)) for i in range(len(body.messages))]
    tokens, placed = images.tokens(request.app[TOKENIZER], request.app[CHAT_TEMPLATE].render(messages, body.tools))
    return await _generate(request, body, _shape(request, chat=True, tools=tools), tokens,
                           body.max_completion_tokens or body.max_tokens, placed)


async def models(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    card = {"id": served.model_id, "object": "model", "created": served.created, "owned_by": "kvledger",
            "max_model_len": request.app[SCHEDULER].max_context, "tokenizer": request.app[TOKENIZER].name,
            "chat_template": request.app[CHAT_TEMPLATE].id if request.app[CHAT_TEMPLATE].available else None}
    return json_response({"object": "list", "data": [card]})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize``: ``{"count", "max_model_len", "tokens"}`` (token ids exactly as a
    completion or chat request of the same prompt would be fed)."""
    served = request.app[SERVED]
    body: TokenizeRequest = decode(await read_body(request, served), TokenizeRequest)
    body.checks()
    check_model(served, body.model)
    tok = request.app[TOKENIZER]
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tok.encode(body.prompt, add_special_tokens=add)
    else:
        images = await chat_images(request, body.messages or [])
        messages = [images.message(i, _message(body, i, images.placeholder)) for i in range(len(body.messages or []))]
        text = request.app[CHAT_TEMPLATE].render(messages, body.tools)
        ids, _ = images.tokens(tok, text, add_special_tokens=bool(body.add_special_tokens))
    return json_response({"count": len(ids), "max_model_len": request.app[SCHEDULER].max_context, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /detokenize``: ``{"prompt": text}`` of token ids (in the vocabulary)."""
    served = request.app[SERVED]
    body: DetokenizeRequest = decode(await read_body(request, served), DetokenizeRequest)
    check_model(served, body.model)
    tok = request.app[TOKENIZER]
    bad = next((t for t in body.tokens if t >= tok.vocab_size), None)
    if bad is not None:
        raise ApiError.invalid(f"tokens: token id {bad} is not in the tokenizer's vocabulary "
                               f"(0..{tok.vocab_size - 1})", "tokens")
    return json_response({"prompt": tok.decode(list(body.tokens))})


async def version(request: web.Request) -> web.Response:
    """``worker.version`` (the installed package's version when unset): what the gateway's
    ``gateway.version_weights`` route by."""
    return json_response({"version": request.app[CONFIG].worker.version or package_version()})


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: model loaded, pools allocated, coordinator reachable (else ``degraded``: still
    serving, by recomputation).

    503 (``starting``) until the worker has registered with the coordinator once — a new
    worker joins only once the ledger knows it — and (``not_ready``) while the pools are
    missing, the worker drains or shuts down. A registered worker that loses the coordinator
    stays 200 with status ``degraded`` (``coordinator``: ``unreachable``, or ``suspended`` while
    its epoch is being resumed); it keeps its cache meanwhile.
    """
    engine = request.app[ENGINE]
    sched = request.app[SCHEDULER]
    h = engine.health()
    pools = h.pools_allocated or not h.cache_enabled
    if h.contact == "unregistered":
        coordinator = "unreachable"
    elif h.contact == "reachable" and h.degraded:
        coordinator = "degraded"
    else:
        coordinator = h.contact   # disabled | reachable | unreachable (cache kept) | suspended (resuming)
    starting = h.cache_enabled and h.epoch == 0
    ready = pools and not h.draining and not sched.closed and not starting
    if starting:
        status = "starting"
    else:
        status = "not_ready" if not ready else ("degraded" if h.degraded else "ready")
    body = {"status": status, "model_loaded": True, "pools_allocated": pools, "coordinator": coordinator,
            "reason": h.reason, "epoch": h.epoch, "draining": h.draining, "queue_depth": sched.queue_depth,
            "running": sched.running, "pool_used": h.pool_used, "pool_slots": h.pool_slots,
            "disk_tier": h.disk_tier, "disk_tier_reason": engine.tiers.disk_down_reason if h.disk_tier == "down" else "",
            "self_check": engine.checked.as_dict() if engine.checked is not None else None,
            # now, not at start: a run-time check can turn fusing off for good (worker.stepper)
            "batching": engine.stepper.describe()}
    return json_response(body, 200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.pool_metrics()
    return web.Response(body=engine.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
