"""Agent tool turns on the chat endpoint: a request's ``tools``, ``tool_choice`` and tool messages
checked, the plan for its output (which call syntax to read, the grammar that forces a call), and
a reply's text as OpenAI ``tool_calls``.

Checks, each a 400 naming the parameter:

* ``tools``: at most :data:`MAX_TOOLS` entries, :data:`MAX_TOOLS_BYTES` of JSON in all; each
  ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}``, names
  ``[a-zA-Z0-9_-]{1,64}`` and distinct, ``parameters`` a JSON Schema object (``type`` "object" if
  given). ``[]`` is no tools. The schemas themselves are compiled only when a call is forced.
* ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function":
  {"name"}}`` naming a declared tool; default ``auto`` with tools, ``none`` without. ``required`` and
  a named function need tools, a template whose call syntax is known (``service.tool_call_parser``),
  and no ``response_format`` / ``structured_outputs`` (both would constrain the same output).
* messages: ``tool_calls`` only on assistant messages, each ``{"id", "type": "function", "function":
  {"name", "arguments"}}`` with arguments JSON text; a ``tool`` message has content and a
  ``tool_call_id`` that an earlier assistant message's call carries.

What each choice does: ``none`` renders the tools but reads the output as text; ``auto`` reads
calls out of it (:mod:`shared.text.tool_calls`); ``required`` and a named function also force it
into the call syntax with llguidance (``worker.structured``), as vLLM serves them — one call unless
``parallel_tool_calls`` (default true) allows more. A reply with calls has ``finish_reason``
``tool_calls`` (``length`` stays ``length``: a call may have been cut short).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.text import tool_calls
from worker.api.errors import ApiError
from worker.structured import GrammarError, StructuredOutput

MAX_TOOLS = 128
#: Bound on the tools' JSON: they are rendered into every prompt and compiled into a grammar.
MAX_TOOLS_BYTES = 256 * 1024
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    #: ``none`` | ``auto`` | ``required`` | ``function`` (then ``name`` is the function's).
    mode: str
    name: str | None = None


def _bad(param: str, message: str) -> ApiError:
    return ApiError.invalid(f"{param}: {message}", param)


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The request's tools as sent (None for none or ``[]``), each checked."""
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    if len(msgspec.json.encode(tools)) > MAX_TOOLS_BYTES:
        raise _bad("tools", f"at most {MAX_TOOLS_BYTES} bytes of tool definitions (JSON) per request")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(at, 'expected {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        if tool.get("type") != "function":
            raise _bad(f"{at}.type", f"only 'function' tools are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function", 'expected {"name": ..., "description": ..., "parameters": {...}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{at}.function.name", "1 to 64 characters of a-z, A-Z, 0-9, '_' and '-' are required")
        if name in seen:
            raise _bad(f"{at}.function.name", f"{name!r} is already the name of tools[{seen[name]}]")
        seen[name] = i
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"{at}.function.description", "expected a string")
        if not isinstance(fn.get("strict", False), bool | None):
            raise _bad(f"{at}.function.strict", "expected true or false")
        params = fn.get("parameters")
        if params is not None:
            _check_parameters(params, f"{at}.function.parameters")
    return list(tools)


def _check_parameters(params: Any, at: str) -> None:
    """A function's arguments are a JSON object, so its schema is an object schema."""
    if not isinstance(params, dict):
        raise _bad(at, "expected a JSON Schema object")
    if params.get("type", "object") != "object":
        raise _bad(at, f"a function's arguments are a JSON object: 'type' must be 'object', got {params['type']!r}")
    if not isinstance(params.get("properties", {}), dict):
        raise _bad(f"{at}.properties", "expected an object mapping argument names to schemas")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _bad(f"{at}.required", "expected a list of argument names")


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``tool_choice`` against the (checked) tools."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise _bad("tool_choice", f"{choice[:40]!r} is not one of {', '.join(_CHOICES)} or a named function")
        if choice == "required" and not tools:
            raise _bad("tool_choice", "'required' needs tools")
        return ToolChoice(choice if tools else "none")
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", f'expected {", ".join(map(repr, _CHOICES))} or {{"type": "function", '
                                  f'"function": {{"name": ...}}}}')
    declared = [t["function"]["name"] for t in tools or ()]
    if name not in declared:
        raise _bad("tool_choice", f"names function {name[:64]!r}, which is not among tools "
                                  f"({', '.join(declared) or 'none given'})")
    return ToolChoice("function", name)


def check_tool_messages(messages: Sequence[Any]) -> None:
    """Tool calls and tool results in the conversation (``Message`` structs)."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"{at}.tool_calls", "only assistant messages carry tool calls")
            for j, call in enumerate(m.tool_calls):
                ids.add(_check_call(call, f"{at}.tool_calls[{j}]"))
        if m.role == "tool":
            if not m.tool_call_id:
                raise _bad(f"{at}.tool_call_id", "a tool message names the call it answers")
            if m.tool_call_id not in ids:
                raise _bad(f"{at}.tool_call_id", f"{m.tool_call_id[:64]!r} is not the id of a tool call in an "
                                                 f"earlier assistant message")
            if m.content is None:
                raise _bad(f"{at}.content", "a tool message carries the tool's result")


def _check_call(call: Any, at: str) -> str:
    if not isinstance(call, dict):
        raise _bad(at, 'expected {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise _bad(f"{at}.id", "expected the call's id (a string)")
    if call.get("type", "function") != "function":
        raise _bad(f"{at}.type", f"only 'function' calls are supported, got {call.get('type')!r}")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{at}.function", 'expected {"name": ..., "arguments": ...}')
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"{at}.function.name", "expected the function's name")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            raise _bad(f"{at}.function.arguments", "not valid JSON") from None
    elif not isinstance(args, dict):
        raise _bad(f"{at}.function.arguments", "expected the arguments as JSON text")
    return call["id"]


# --- the output -----------------------------------------------------------------------------------

def choose_format(setting: str, template_format: str) -> str:
    """``service.tool_call_parser``: ``auto`` takes the chat template's own syntax."""
    return template_format if setting == "auto" else setting


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request with tools does with its output: read calls in ``fmt``, forced by ``grammar``."""

    fmt: str
    names: frozenset[str]
    grammar: Any = None

    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The chat ``message`` of a whole output, and its finish reason."""
        parsed = tool_calls.parse(self.fmt, text, self.names)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, finish
        calls = [_openai_call(c) for c in parsed.calls]
        return ({"role": "assistant", "content": parsed.content, "tool_calls": calls},
                "tool_calls" if finish == "stop" else finish)

    def stream(self) -> ToolStream:
        return ToolStream(tool_calls.StreamParser(self.fmt, self.names))


class ToolStream:
    """One streamed choice: content as it is final, the calls (``delta.tool_calls``) at the end."""

    def __init__(self, parser: tool_calls.StreamParser) -> None:
        self._parser = parser

    def push(self, text: str) -> str:
        return self._parser.push(text)

    def end(self, text: str, finish: str) -> tuple[str, list[dict[str, Any]], str]:
        """The output's last text → (content still to send, the calls' deltas, the finish reason)."""
        content = self._parser.push(text)
        rest, parsed = self._parser.finish()
        calls = [{"index": k, **_openai_call(c)} for k, c in enumerate(parsed.calls)]
        return content + rest, calls, "tool_calls" if calls and finish == "stop" else finish


def _openai_call(call: tool_calls.Call) -> dict[str, Any]:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


async def plan(fmt: str, tools: list[dict[str, Any]] | None, choice: ToolChoice, parallel: bool,
         so: StructuredOutput) -> ToolPlan | None:
    """The request's :class:`ToolPlan` (None: its output is plain text). Raises the 400s of a call
    that cannot be forced: no known syntax, or a schema llguidance cannot compile (named)."""
    if not tools or choice.mode == "none":
        return None
    names = frozenset(t["function"]["name"] for t in tools)
    if choice.mode == "auto":
        return ToolPlan(fmt, names) if fmt != "none" else None
    if fmt == "none":
        raise _bad("tool_choice", f"{choice.mode if choice.mode == 'required' else 'a named function'} needs the "
                                  "model's tool-call syntax, and its chat template defines none this server knows; "
                                  "set service.tool_call_parser")
    chosen = [(i, t["function"]) for i, t in enumerate(tools) if choice.name in (None, t["function"]["name"])]
    functions = [(fn["name"], fn.get("parameters")) for _, fn in chosen]
    schemas = [(f"tools[{i}].function.parameters", fn.get("parameters") or tool_calls.NO_PARAMETERS)
               for i, fn in chosen]
    try:
        lark = tool_calls.grammar(fmt, functions, parallel=parallel and choice.mode == "required")
        grammar = await so.compile_tool_calls(lark, schemas)
    except GrammarError as e:
        raise ApiError.invalid(str(e), e.param or "tool_choice", code=e.code) from None
    return ToolPlan(fmt, names, grammar)


__all__ = ["MAX_TOOLS", "MAX_TOOLS_BYTES", "ToolChoice", "ToolPlan", "ToolStream", "check_tool_choice",
           "check_tool_messages", "check_tools", "choose_format", "plan"]
