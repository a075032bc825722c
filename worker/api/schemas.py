"""Request bodies of the OpenAI-compatible endpoints, as msgspec structs, and their parsing.

Fields follow the OpenAI API. Unknown fields are ignored (clients send fields this server
does not use, such as ``user``); known but unsupported features are refused with a 400
that names the parameter, rather than silently ignored (``suffix``, ``echo`` with ``n`` > 1).
Chat's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and tool messages: :mod:`worker.api.tools`.
Chat content parts are ``text`` and ``image_url`` (a ``data:`` URL; :mod:`worker.api.images`).
``echo`` puts the prompt's text before the completion (and with ``logprobs``, the
prompt tokens' log probabilities: :meth:`worker.engine.Engine.prompt_logits`).
``n`` (and completions' ``best_of``, the ``n`` most likely of ``best_of`` samples by total
log probability) run that many samples of one prompt, at most ``service.max_n``; sample ``i``
is seeded ``seed + i`` when a ``seed`` is given. ``response_format`` ``json_object`` and ``json_schema`` constrain the output,
and so does vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice`` or a Lark ``grammar``;
``worker.structured``).

Sampling controls (ranges checked, a 400 naming the field otherwise; what each does:
:class:`worker.generation.SamplingParams`): ``presence_penalty`` and ``frequency_penalty``
in [-2, 2]; ``logit_bias`` {token id: bias in [-100, 100]}, at most 300 entries, ids in the
vocabulary; ``logprobs`` (completions, 0–20) and ``logprobs`` + ``top_logprobs`` (chat, 0–20,
``top_logprobs`` only with ``logprobs``: true). vLLM's extensions: ``repetition_penalty``
(0, 10], ``min_p`` [0, 1], ``min_tokens`` (at most ``max_tokens``), ``stop_token_ids`` (at
most 64 ids in the vocabulary; the token is part of the output unless it is a special token),
``ignore_eos`` (the model's end-of-sequence tokens do not end the output).

kvledger extensions (pass them with the openai client's ``extra_body``):

* ``cache_reuse`` (bool, default true) — false runs this request without reading the
  prefix cache (it still fills it): a cold run, for differential checks;
* ``priority`` (int, default: the tenant's, ``auth.keys[].priority``, 0 unless configured) — lower
  is scheduled first (vLLM's convention); a request may only lower its tenant's priority (ask for a
  larger number): one that asks for a smaller number runs at its tenant's
  (:func:`shared.tenants.effective_priority`);
* ``top_k`` (int, default 0 = off, or the checkpoint's default).

Defaults: ``max_tokens`` 16 (both endpoints; the tiny model has no end-of-sequence token,
so an unbounded default would run to the context limit). ``temperature``, ``top_p`` and
``top_k`` are None when omitted (or null) and resolved by the handler: the checkpoint's
``generation_config.json`` defaults where it sets them, else ``temperature`` 1.0, ``top_p``
1.0 (OpenAI's) and ``top_k`` 0 (:class:`shared.text.generation_config.SamplingDefaults`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from worker.api import tools as tools_api
from worker.api.errors import ApiError

MAX_STOP = 4
#: Deepest JSON nesting a request body may have (the schemas need 4 levels); checked on the raw
#: bytes before parsing, so a body nested thousands deep is a 400, not a RecursionError.
MAX_JSON_DEPTH = 64

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Priority = Annotated[int, msgspec.Meta(ge=-1_000_000, le=1_000_000)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class BaseRequest(msgspec.Struct, kw_only=True):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: PosInt | None = None
    #: None = omitted: the checkpoint's default or the API's (see the module docstring).
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: NonNeg | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: PosInt = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    user: str | None = None
    # vLLM's extensions
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    min_tokens: NonNeg = 0
    stop_token_ids: Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    #: Generation goes on past the model's end-of-sequence tokens (benchmarks' fixed-length
    #: replies); ``stop_token_ids`` and ``stop`` still end it.
    ignore_eos: bool = False
    #: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}``
    #: (completions too, as vLLM takes it); compiled by ``worker.structured``.
    response_format: dict[str, Any] | None = None
    #: vLLM's ``{"json" | "regex" | "choice" | "grammar": ...}`` (exactly one); ``worker.structured``.
    structured_outputs: dict[str, Any] | None = None
    # kvledger extensions
    cache_reuse: bool = True
    #: None = the tenant's; see :func:`shared.tenants.effective_priority` (a client may only lower it).
    priority: Priority | None = None

    def common_checks(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError.invalid("stream_options: only allowed when stream is true", "stream_options")
        self.stops()   # validated here, before the request reaches the scheduler
        self.bias()

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs (ids checked against the vocabulary by
        :meth:`check_vocab`)."""
        if not self.logit_bias:
            return ()
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ApiError.invalid(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
                                   "logit_bias")
        out = []
        for key, v in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise ApiError.invalid(f"logit_bias: keys are token ids (non-negative integers as strings), got "
                                       f"{key[:40]!r}", "logit_bias")
            out.append((int(key), float(v)))
        return tuple(sorted(out))

    @property
    def samples(self) -> int:
        """How many samples run: ``best_of`` (completions) or ``n``."""
        return max(self.n, getattr(self, "best_of", None) or 1)

    def check_n(self, max_n: int) -> None:
        if self.samples > max_n:
            param = "best_of" if self.samples > self.n else "n"
            raise ApiError.invalid(f"{param}: at most {max_n} samples per request (service.max_n)", param)

    def check_vocab(self, vocab_size: int, max_tokens: int) -> None:
        """What needs the model: token ids in its vocabulary, ``min_tokens`` within ``max_tokens``."""
        for param, ids in (("logit_bias", [t for t, _ in self.bias()]), ("stop_token_ids", self.stop_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ApiError.invalid(f"{param}: token id {bad[0]} is not in the vocabulary (0..{vocab_size - 1})",
                                       param)
        if self.min_tokens > max_tokens:
            raise ApiError.invalid(f"min_tokens: {self.min_tokens} is more than max_tokens ({max_tokens})",
                                   "min_tokens")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > MAX_STOP:
            raise ApiError.invalid(f"stop: at most {MAX_STOP} stop strings are allowed, got {len(stops)}", "stop")
        return [s for s in stops if s]

    @property
    def seed63(self) -> int | None:
        return None if self.seed is None else self.seed % (1 << 63)


class CompletionRequest(BaseRequest, kw_only=True):
    #: A string or a list of token ids (a list of one string / one id list is accepted too).
    prompt: str | list[Any]
    logprobs: TopLogprobs | None = None
    echo: bool = False
    best_of: PosInt | None = None
    suffix: str | None = None

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def checks(self) -> None:
        self.common_checks()
        if self.echo and self.samples > 1:
            raise ApiError.invalid("echo: not supported with n or best_of above 1", "echo")
        if self.best_of is not None and self.best_of < self.n:
            raise ApiError.invalid(f"best_of: must be at least n ({self.n})", "best_of")
        if self.best_of not in (None, self.n) and self.stream:
            raise ApiError.invalid("best_of: cannot be used with stream (the best are known only at the end)",
                                   "best_of")
        if self.suffix:
            raise ApiError.invalid("suffix is not supported", "suffix")

    def prompt_value(self) -> str | list[int]:
        """The one prompt: a string or token ids (ints only; booleans are not ids)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
            if isinstance(p, str):
                return p
        if p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        if not p:
            raise ApiError.invalid("prompt: the prompt is empty; send at least one token", "prompt")
        if all(isinstance(x, (str, list)) for x in p):
            raise ApiError.invalid("prompt: batched prompts are not supported; send one prompt per request",
                                   "prompt")
        raise ApiError.invalid("prompt: expected a string or a list of integer token ids", "prompt")


class ImageURL(msgspec.Struct, kw_only=True):
    """An ``image_url`` part's object: a ``data:`` URL (or ``http(s)`` with
    ``service.allow_remote_images``); ``detail`` is accepted and has no effect (one resolution)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: An assistant turn's calls and the call a ``tool`` message answers (``worker.api.tools`` checks them).
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(BaseRequest, kw_only=True):
    messages: list[Message]
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    #: ``worker.api.tools``: checked by :meth:`checks` (which leaves None for ``[]``).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def choice(self) -> tools_api.ToolChoice:
        """``tool_choice`` resolved against the tools (after :meth:`checks`)."""
        return tools_api.check_tool_choice(self.tool_choice, self.tools)

    def checks(self) -> None:
        self.common_checks()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError.invalid("top_logprobs: only allowed when logprobs is true", "top_logprobs")
        self.tools = tools_api.check_tools(self.tools)
        if self.choice.mode in ("required", "function") and (
                self.structured_outputs or (self.response_format or {}).get("type") not in (None, "text")):
            raise ApiError.invalid("tool_choice: a forced tool call and response_format / structured_outputs "
                                   "both constrain the output; send one of them", "tool_choice")
        tools_api.check_tool_messages(self.messages)
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError.invalid("max_tokens and max_completion_tokens disagree; send one of them",
                                   "max_completion_tokens")

    def text_of(self, i: int, image: str | None = None) -> str:
        """Message ``i``'s text; an ``image_url`` part becomes ``image`` (the model's placeholder,
        ``worker.api.images``), and is refused when that is None."""
        c = self.messages[i].content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        out = []
        for j, part in enumerate(c):
            if part.type == "image_url" and image is not None:
                out.append(image)
                continue
            if part.type != "text" or part.text is None:
                raise ApiError.invalid(f"messages[{i}].content[{j}]: only text and image_url parts are supported "
                                       f"(type 'text' with a 'text' string)", f"messages[{i}].content")
            out.append(part.text)
        return "".join(out)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` as vLLM serves it: a ``prompt`` (completions' tokenization) or
    ``messages`` (the chat endpoint's: the template with its generation prompt)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    #: The chat request's ``tools`` (rendered into the prompt, as the chat endpoint renders them).
    tools: list[Any] | None = None

    def checks(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError.invalid("send exactly one of prompt and messages", "prompt")
        self.tools = tools_api.check_tools(self.tools)
        tools_api.check_tool_messages(self.messages or [])

    def text_of(self, i: int, image: str | None = None) -> str:
        return ChatCompletionRequest(messages=self.messages or []).text_of(i, image)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[NonNeg], msgspec.Meta(max_length=1_000_000)]


#: A JSON string (escapes included; an unterminated one runs to the end) or one bracket.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` nests arrays/objects deeper than ``limit`` (brackets inside strings do
    not count). A cheap scan of the raw bytes, done before any parsing: with no more than
    ``limit`` opening brackets in all (the usual case) it is two ``bytes.count`` calls."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for m in _JSON_TOKEN.finditer(body):
        c = m.group()[0]
        if c in (0x5B, 0x7B):           # [ {
            depth += 1
            if depth > limit:
                return True
        elif c in (0x5D, 0x7D):         # ] }
            depth = max(0, depth - 1)
    return False


#: msgspec's error location: ``$.a.b[0]``, ``[...]`` for a dict value (the param is the dict).
_AT = re.compile(r" - at `\$((?:\.[A-Za-z0-9_]+|\[\d+\]|\[\.\.\.\])*)`$")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def decode(body: bytes, kind: type[Any]) -> Any:
    """Decode and validate a JSON body; errors are 400s naming the parameter and what was expected."""
    if not body.strip():
        raise ApiError.invalid("the request body is empty; send a JSON object", None)
    if json_too_deep(body):
        raise ApiError.invalid(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", None)
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:                # belt and braces: the scan above should have caught it
        raise ApiError.invalid(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", None) from None
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _AT.search(msg)
        path = m.group(1).lstrip(".").split("[...]", 1)[0] if m else ""
        detail = _AT.sub("", msg)
        miss = _MISSING.search(detail)
        if miss:
            param = f"{path}.{miss.group(1)}" if path else miss.group(1)
            raise ApiError.invalid(f"{param}: this field is required", param) from None
        detail = detail[0].lower() + detail[1:] if detail else detail
        param = path or None
        raise ApiError.invalid(f"{param}: {detail}" if param else f"request body: {detail}", param) from None
    except msgspec.DecodeError as e:
        raise ApiError.invalid(f"the request body is not valid JSON: {e}", None) from None
