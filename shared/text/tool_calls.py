"""Tool calls in a model's output: the syntaxes chat templates define, read back into OpenAI
``tool_calls``, and the grammar that makes a model write one (``tool_choice`` "required" or a
named function).

Formats (``service.tool_call_parser``; ``auto`` takes the template's :func:`detect`):

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
  one block per call, any number, text around them;
* ``llama3_json`` (Llama 3.1–3.3): the output *starts* with ``{"name": "f", "parameters": {...}}``
  (``arguments`` accepted too; several joined by ``;``; ``<|python_tag|>`` before them allowed);
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects. ``[TOOL_CALLS]``
  is a control token that decoding drops, so such an array at the start of the output counts too;
* ``builtin`` (kvledger's plain-text template, :mod:`shared.text.chat_template`):
  ``<|tool_calls|>[{"name":"f","arguments":{...}}]``, compact JSON;
* ``none``: nothing is parsed.

**Parsing** (:func:`parse`). A block counts when every call in it is well-formed, names one of the
request's tools and has a JSON object for arguments; any other block stays in the text as written
(never an error). ``content`` is the text outside the blocks that count, whitespace next to them
dropped, or None when nothing is left; with no block counting it is the output unchanged.
Arguments are returned as the JSON text the model wrote (arguments written as a JSON *string*
are decoded and re-encoded in the format's spacing). A forced call is spaced as the template
renders calls back (``tojson``'s ``", "`` and ``": "``; compact for ``builtin``, which renders the
arguments text as is), so the call re-rendered in the next turn is the text the model wrote and
the conversation's prompt stays a prefix of the next one's.

**Streaming** (:class:`StreamParser`). Text before the first place a call could begin streams as
content (a partial marker and trailing whitespace held back); from there on the text is held, and
at the end the whole output is parsed as above — the stream's content and calls are exactly the
non-streamed ones.

**Forcing** (:func:`grammar`). A Lark grammar (llguidance's, ``%json`` for each function's
``parameters``) that admits exactly the format's call syntax, spaced as above, for every tool or
only the named one; one call unless parallel calls are allowed (``llama3_json``: always one, as its
templates render one call per turn).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral", "builtin", "none")
BUILTIN_MARKER = "<|tool_calls|>"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_MARKER = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    #: The arguments as JSON text (an object).
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None
    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class _Block:
    """A span of output written in the format's call syntax; ``calls`` None when it is not calls."""

    start: int
    end: int
    calls: tuple[tuple[Any, Any, str], ...] | None


@dataclass(frozen=True, slots=True)
class _Syntax:
    """How a format writes calls: ``before`` + calls joined by ``joiner`` + ``after``, each call
    ``open`` + name + ``sep`` + arguments + ``close``; ``spacing`` is the arguments' JSON separators."""

    before: str
    open: str
    sep: str
    close: str
    joiner: str
    after: str
    spacing: tuple[str, str]
    parallel: bool = True


_TOJSON = (", ", ": ")
_COMPACT = (",", ":")
SYNTAX = {
    "hermes": _Syntax("", '<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n", "", _TOJSON),
    "llama3_json": _Syntax("", '{"name": ', ', "parameters": ', "}", "", "", _TOJSON, parallel=False),
    "mistral": _Syntax("[", '{"name": ', ', "arguments": ', "}", ", ", "]", _TOJSON),
    "builtin": _Syntax(BUILTIN_MARKER + "[", '{"name":', ',"arguments":', "}", ",", "]", _COMPACT),
}


def detect(*sources: str) -> str:
    """The format a Jinja chat template renders calls in, from its text (and its ``tool_use`` variant's)."""
    text = "\n".join(sources)
    if _HERMES_OPEN in text:
        return "hermes"
    if _MISTRAL_MARKER in text:
        return "mistral"
    if '"parameters": ' in text and "tool_call" in text:      # Llama 3.x: {"name": ..., "parameters": ...}
        return "llama3_json"
    return "none"


def render_calls(fmt: str, calls: Sequence[tuple[str, str]]) -> str:
    """``(name, arguments JSON text)`` pairs written in ``fmt``'s syntax (the built-in template's turns)."""
    s = SYNTAX[fmt]
    return s.before + s.joiner.join(s.open + json.dumps(n) + s.sep + a + s.close for n, a in calls) + s.after


# --- parsing -----------------------------------------------------------------------------------------

#: A decoded call: its name, its arguments and their JSON text as written (None: not a call).
_Decoded = tuple[Any, Any, str] | None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _members(text: str, i: int) -> tuple[dict[str, tuple[Any, int, int]], int] | None:
    """The JSON object at ``text[i]`` (a ``{``) as ``key -> (value, start, end)`` of each value's text,
    and where it ends; None when it is not JSON."""
    out: dict[str, tuple[Any, int, int]] = {}
    i = _skip_ws(text, i + 1)
    if text.startswith("}", i):
        return out, i + 1
    try:
        while True:
            if not text.startswith('"', i):
                return None
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, i)
            if not text.startswith(":", i):
                return None
            start = _skip_ws(text, i + 1)
            value, end = _DECODER.raw_decode(text, start)
            out[key] = (value, start, end)
            i = _skip_ws(text, end)
            if text.startswith("}", i):
                return out, i + 1
            if not text.startswith(",", i):
                return None
            i = _skip_ws(text, i + 1)
    except ValueError:
        return None


def _call_at(text: str, i: int, spacing: tuple[str, str], keys: tuple[str, ...] = ("arguments",)
             ) -> tuple[_Decoded, int] | None:
    """The ``{"name": ..., "arguments": ...}`` object at ``text[i]`` and its end; None when it is not JSON."""
    found = _members(text, i)
    if found is None:
        return None
    members, end = found
    key = next((k for k in keys if k in members), None)
    if "name" not in members or key is None or set(members) - {"name", key, "id"}:
        return None, end
    args, a, b = members[key]
    args_text = text[a:b]
    if isinstance(args, str):           # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None, end
        args_text = json.dumps(args, ensure_ascii=False, separators=spacing)
    return (members["name"][0], args, args_text), end


def _array_block(text: str, start: int, at: int, spacing: tuple[str, str]) -> _Block | None:
    """A JSON array of calls at ``text[at]`` (the block from ``start``); None when it is not JSON."""
    try:
        value, end = _DECODER.raw_decode(text, at)
    except ValueError:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        return _Block(start, end, None)
    calls, i = [], at + 1
    for _ in value:                     # valid JSON already: walk it again for each call's spans
        found = _call_at(text, _skip_ws(text, i), spacing)
        assert found is not None
        calls.append(found[0])
        i = _skip_ws(text, found[1]) + 1            # past the ',' or ']'
    return _Block(start, end, None if None in calls else tuple(calls))   # type: ignore[arg-type]


def _hermes_blocks(text: str) -> list[_Block]:
    out, pos = [], 0
    while (i := text.find(_HERMES_OPEN, pos)) >= 0:
        j = text.find(_HERMES_CLOSE, i)
        if j < 0:
            out.append(_Block(i, len(text), None))     # unterminated: a call cut short stays text
            break
        k = _skip_ws(text, i + len(_HERMES_OPEN))
        found = _call_at(text, k, _TOJSON) if text.startswith("{", k) else None
        ok = found is not None and found[0] is not None and _skip_ws(text, found[1]) == j
        out.append(_Block(i, j + len(_HERMES_CLOSE), (found[0],) if ok else None))  # type: ignore[index]
        pos = j + len(_HERMES_CLOSE)
    return out


def _llama_blocks(text: str) -> list[_Block]:
    out: list[_Block] = []
    start = i = _skip_ws(text, 0)
    if text.startswith(_PYTHON_TAG, i):
        i = _skip_ws(text, i + len(_PYTHON_TAG))
    while text.startswith("{", i):
        found = _call_at(text, i, _TOJSON, ("parameters", "arguments"))
        if found is None:
            break
        call, end = found
        nxt = _skip_ws(text, end)
        more = text.startswith(";", nxt)
        # a ';' joining two calls belongs to the first one's block
        out.append(_Block(start, nxt + 1 if more else end, None if call is None else (call,)))
        if not more:
            break
        start = i = _skip_ws(text, nxt + 1)
    return out


def _marker_array_blocks(marker: str, spacing: tuple[str, str], at_start: bool) -> Callable[[str], list[_Block]]:
    def blocks(text: str) -> list[_Block]:
        out, pos = [], 0
        first = _skip_ws(text, 0)
        if at_start and text.startswith("[", first) and not text.startswith(marker, first):
            b = _array_block(text, first, first, spacing)
            if b is not None and b.calls is not None:
                out.append(b)
                pos = b.end
        while (i := text.find(marker, pos)) >= 0:
            b = _array_block(text, i, _skip_ws(text, i + len(marker)), spacing)
            out.append(b if b is not None else _Block(i, i + len(marker), None))
            pos = out[-1].end
        return out
    return blocks


_BLOCKS: dict[str, Callable[[str], list[_Block]]] = {
    "hermes": _hermes_blocks,
    "llama3_json": _llama_blocks,
    "mistral": _marker_array_blocks(_MISTRAL_MARKER, _TOJSON, at_start=True),
    "builtin": _marker_array_blocks(BUILTIN_MARKER, _COMPACT, at_start=False),
}


def parse(fmt: str, text: str, names: frozenset[str] | set[str]) -> Parsed:
    """``text`` (a whole output) as content and the calls of the tools ``names`` (module docstring)."""
    if fmt not in _BLOCKS:
        return Parsed(text, ())
    valid = [b for b in _BLOCKS[fmt](text)
             if b.calls is not None and all(isinstance(n, str) and n in names and isinstance(a, dict)
                                            for n, a, _ in b.calls)]
    if not valid:
        return Parsed(text, ())
    calls = tuple(Call(n, args_text) for b in valid for n, _, args_text in b.calls)
    pieces, pos = [], 0
    for b in valid:
        piece = text[pos:b.start]
        pieces.append(piece.rstrip() if pos == 0 else piece.strip())
        pos = b.end
    pieces.append(text[pos:].strip())
    content = "\n".join(p for p in pieces if p)
    return Parsed(content if content.strip() else None, calls)


# --- streaming ---------------------------------------------------------------------------------------

def _first_start(fmt: str, text: str, since: int = 0) -> int | None:
    """Where the first call could begin (everything from there is held); None: not yet, or never.
    A marker is looked for from ``since`` on (text before it was sent: no marker begins there)."""
    first = _skip_ws(text, 0)
    if fmt == "llama3_json":
        return first if text.startswith(("{", _PYTHON_TAG), first) else None
    if fmt == "mistral" and text.startswith("[", first):
        return first
    marker = {"hermes": _HERMES_OPEN, "mistral": _MISTRAL_MARKER, "builtin": BUILTIN_MARKER}[fmt]
    i = text.find(marker, since)
    return i if i >= 0 else None


def _partial(fmt: str, text: str) -> int:
    """How many trailing characters may be the beginning of a marker (held back until they are not)."""
    if fmt == "llama3_json":
        first = _skip_ws(text, 0)
        return len(text) - first if first < len(text) and _PYTHON_TAG.startswith(text[first:]) else 0
    marker = {"hermes": _HERMES_OPEN, "mistral": _MISTRAL_MARKER, "builtin": BUILTIN_MARKER}[fmt]
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class StreamParser:
    """One streamed output: :meth:`push` the text as it becomes final, :meth:`finish` at the end."""

    def __init__(self, fmt: str, names: frozenset[str]) -> None:
        assert fmt in _BLOCKS, fmt
        self.fmt, self.names = fmt, names
        self._text = ""
        self._sent = 0
        self._holding = False

    def push(self, piece: str) -> str:
        """The content that is final now (may be empty)."""
        self._text += piece
        if self._holding:
            return ""
        start = _first_start(self.fmt, self._text, self._sent)
        if start is not None:
            self._holding = True
            end = start
        else:
            end = len(self._text) - _partial(self.fmt, self._text)
        # NOTE: whitespace is held too: it is dropped when a call follows it
        while end > self._sent and self._text[end - 1].isspace():
            end -= 1
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent:end], end
        return out

    def finish(self) -> tuple[str, Parsed]:
        """The content not sent yet, and the whole output parsed."""
        parsed = parse(self.fmt, self._text, self.names)
        content = parsed.content or ""
        assert content.startswith(self._text[:self._sent]), "streamed content must be a prefix of the parsed content"
        return content[self._sent:], parsed


# --- forcing -----------------------------------------------------------------------------------------

#: A function declared without ``parameters`` takes none (OpenAI's reading): its arguments are ``{}``.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def grammar(fmt: str, functions: Sequence[tuple[str, Mapping[str, Any] | None]], *, parallel: bool) -> str:
    """A Lark grammar admitting exactly calls of ``functions`` (``(name, parameters schema)``) in ``fmt``."""
    s = SYNTAX[fmt]
    lit = json.dumps
    opts = {"whitespace_flexible": False, "item_separator": s.spacing[0], "key_separator": s.spacing[1]}
    rules = []
    for k, (name, params) in enumerate(functions):
        schema = {**(params if params is not None else NO_PARAMETERS), "x-guidance": opts}
        rules.append(f"fn_{k}: {lit(lit(name) + s.sep)} args_{k}\nargs_{k}: %json {json.dumps(schema)}")
    one = f"{lit(s.open)} fn {lit(s.close)}"
    calls = f"call ({lit(s.joiner)} call)*" if parallel and s.parallel else "call"
    head = f"start: {lit(s.before) + ' ' if s.before else ''}{calls}{' ' + lit(s.after) if s.after else ''}"
    fns = " | ".join(f"fn_{k}" for k in range(len(functions)))
    return "\n".join([head, f"call: {one}", f"fn: {fns}", *rules]) + "\n"


__all__ = ["BUILTIN_MARKER", "FORMATS", "NO_PARAMETERS", "SYNTAX", "Call", "Parsed", "StreamParser", "detect",
           "grammar", "parse", "render_calls"]
