"""The chat template: how ``/v1/chat/completions`` turns messages into one prompt.

Which template (:func:`load_chat_template`):

* no ``worker.model_dir`` (the built-in tiny model): kvledger's own plain-text template,
  below (:data:`BUILTIN`);
* a checkpoint directory: its Jinja template, as ``save_pretrained`` writes it —
  ``chat_template.jinja`` (transformers 5), else ``tokenizer_config.json``'s ``chat_template``
  (a string, or a list of ``{"name", "template"}`` of which ``default`` is used) — rendered as
  transformers renders it (:mod:`shared.text.jinja_template`) with the checkpoint's special tokens.
  Messages reach it as sent (``role``, ``content``, ``name``, ``tool_calls``, ``tool_call_id``
  when given; a null ``content`` left out): which roles it accepts is the template's business.
  A request's ``tools`` reach it as ``tools`` (the list as sent; else none), and with tools the
  checkpoint's ``tool_use`` template is used when it has one, as transformers chooses.
  A call's ``function.arguments`` reaches it as the object its JSON text holds (transformers'
  own server does the same: templates such as Llama 3.1's and Qwen2.5's iterate it or ``tojson``
  it, which a string would break).
  A template that does not compile refuses the start (the file named); one that fails on a
  request's messages (its ``raise_exception``, or an error) is a 400 naming why;
* a checkpoint without any template: every chat request is a 400 saying so (code
  ``chat_template_missing``); ``/v1/completions`` takes prompts formatted by the client.

Every template has an identity (``id``): :data:`TEMPLATE_ID` for the built-in, ``jinja-`` and
16 hex digits of the SHA-256 of the template text for a checkpoint's. Changing a template
changes every prompt and therefore every cached block hash.

**The built-in template.** The default byte-level tokenizer has no special tokens, so the
template is plain text. Each message is a header line naming its role, then its content,
then a newline; the prompt ends with the assistant header, so the model's continuation is
the reply::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

Exactly: for each message ``"<|" + role + "|>\\n" + content + "\\n"``, then
``"<|assistant|>\\n"``. Roles are ``system``, ``user``, ``assistant`` (``developer`` is
accepted as OpenAI's newer name for ``system`` and rendered as ``system``). Content is a
string or a list of ``{"type": "text", "text": ...}`` parts, joined without separators (for
checkpoint templates too, which get the content as one string). A message with images is the
exception (:mod:`shared.text.image_prompt`): the built-in template renders each image as the
placeholder ``<|image|>`` in its place, a checkpoint's template gets the list of parts.

Tools (OpenAI's ``tools``, assistant ``tool_calls``, ``tool`` messages) in the built-in
template: the tools come first, one JSON line each (compact, as sent), under a ``<|tools|>``
header; an assistant turn's calls follow its content as ``<|tool_calls|>`` and a compact JSON array
of ``{"name", "arguments"}`` (``arguments`` is the JSON text the request carries, as is: the text
the model wrote, :mod:`shared.text.tool_calls` format ``builtin``); a tool's result is a ``tool``
message::

    <|tools|>
    {"type":"function","function":{"name":"get_weather","parameters":{...}}}
    <|user|>
    Weather in Paris?
    <|assistant|>
    <|tool_calls|>[{"name":"get_weather","arguments":{"city":"Paris"}}]
    <|tool|>
    {"temp": 21}
    <|assistant|>

A request without tools renders exactly as before.

Why this shape: it is stable under extension — the prompt of a conversation is a prefix of
the prompt of the same conversation one turn later (append the assistant's reply and the
next user message — or its tool calls and their results), so every turn of a multi-turn chat,
an agent's tool loop included, reuses the cached blocks of the previous turns' prompt.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jinja2

from shared.text import jinja_template, tool_calls
from shared.text.checkpoint_files import CheckpointFileError, read_json_object
from shared.text.tokenizer import special_tokens

TEMPLATE_ID = "kvl-chat-v1"
ROLES = ("system", "user", "assistant", "tool")
_ALIASES = {"developer": "system"}
JINJA_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    #: The text (an image part as the placeholder: ``shared.text.image_prompt``); None only for an
    #: assistant turn of tool calls sent with null content (:func:`message`).
    content: str | None
    name: str | None = None
    #: A message holding images: its parts as a Jinja template receives them (``{"type": "text",
    #: "text"}`` / ``{"type": "image"}``, as transformers passes them); None: ``content`` alone.
    parts: tuple[dict[str, Any], ...] | None = None
    #: An assistant turn's calls as the request sent them (``{"id", "type", "function": {"name",
    #: "arguments"}}``); ``tool_call_id``: the call a ``tool`` message answers.
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None


class ChatTemplateError(ValueError):
    """A request the template cannot render; ``param`` names the offending field, ``code`` the case."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ChatTemplate(Protocol):
    #: The template's identity (see the module docstring).
    id: str
    #: Where it comes from, for logs: ``builtin``, a file, or a file and its field.
    origin: str
    #: False for a checkpoint without a template (``render`` then always refuses).
    available: bool

    #: The tool-call syntax it renders (:mod:`shared.text.tool_calls` format; ``none``: it defines none).
    tool_format: str

    def render(self, messages: Sequence[ChatMessage], tools: list[Any] | None = None) -> str:
        """The prompt for ``messages`` (and the request's ``tools``, None without), ending with the
        assistant's generation prompt; raises :class:`ChatTemplateError` for messages the template
        refuses."""


def normalize_role(role: str, index: int) -> str:
    r = _ALIASES.get(role, role)
    if r not in ROLES:
        raise ChatTemplateError(f"messages[{index}].role: {role!r} is not supported; use one of "
                                f"{', '.join((*ROLES, *_ALIASES))}", f"messages[{index}].role")
    return r


def _require_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise ChatTemplateError("messages: at least one message is required", "messages")


def message(role: str, content: str | None, name: str | None = None, tool_calls: Sequence[Any] | None = None,
            tool_call_id: str | None = None, parts: tuple[dict[str, Any], ...] | None = None) -> ChatMessage:
    """A request's message as both the worker and the gateway give it to a template (so their
    prompts agree): a null ``content`` stays null only beside tool calls — a template tests for
    it there — and is ``""`` elsewhere, as it always was."""
    calls = tuple(tool_calls or ())
    if content is None and not calls:
        content = ""
    return ChatMessage(role, content, name, parts=parts, tool_calls=calls, tool_call_id=tool_call_id)


def _function_of(call: Any, where: str) -> tuple[dict[str, Any], Any]:
    """A call's ``function`` object (or the call itself, as transformers accepts) and its arguments."""
    fn = (call.get("function") or call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
        raise ChatTemplateError(f"{where}: a tool call is {{\"id\", \"type\": \"function\", \"function\": "
                                f"{{\"name\", \"arguments\"}}}}", where)
    return fn, fn["arguments"]


def _builtin_turn(m: ChatMessage, index: int) -> str:
    if not m.tool_calls:
        return m.content or ""
    calls = []
    for j, c in enumerate(m.tool_calls):
        fn, args = _function_of(c, f"messages[{index}].tool_calls[{j}]")
        calls.append((fn["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False,
                                                                                 separators=(",", ":"))))
    return (m.content or "") + tool_calls.render_calls("builtin", calls)


def render(messages: Sequence[ChatMessage], tools: list[Any] | None = None) -> str:
    """The built-in template's prompt for ``messages`` and ``tools`` (the module docstring gives the format)."""
    _require_messages(messages)
    parts = ["<|tools|>\n" + "".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) + "\n" for t in tools)
             ] if tools else []
    parts += [f"<|{normalize_role(m.role, i)}|>\n{_builtin_turn(m, i)}\n" for i, m in enumerate(messages)]
    parts.append("<|assistant|>\n")
    return "".join(parts)


class BuiltinTemplate:
    """kvledger's plain-text template (:func:`render`), for the built-in tiny model."""

    id = TEMPLATE_ID
    origin = "builtin"
    available = True
    tool_format = "builtin"

    def render(self, messages: Sequence[ChatMessage], tools: list[Any] | None = None) -> str:
        return render(messages, tools)


BUILTIN = BuiltinTemplate()


def _compile(source: str, origin: str) -> jinja2.Template:
    try:
        return jinja_template.compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointFileError(f"{origin}: the chat template does not compile: line {e.lineno}: "
                                  f"{e.message}") from e


def _jinja_call(call: Any, where: str) -> dict[str, Any]:
    """A tool call as a template gets it: a copy whose ``arguments`` JSON text is parsed, as
    transformers' server passes it (``get_processor_inputs_from_messages``)."""
    call = copy.deepcopy(call)
    fn, args = _function_of(call, where)
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            raise ChatTemplateError(f"{where}.function.arguments: not valid JSON", f"{where}.function.arguments") \
                from None
    return call


class JinjaChatTemplate:
    """A checkpoint's Jinja template with its special tokens, compiled once."""

    def __init__(self, source: str, origin: str, tokens: dict[str, str],
                 tool_use: tuple[str, str] | None = None) -> None:
        """``tool_use``: the checkpoint's ``tool_use`` template and its origin, for requests with tools.

        Raises :class:`CheckpointFileError` (``origin`` and the line named) when one does not compile."""
        self._template = _compile(source, origin)
        self._tool_template = _compile(*tool_use) if tool_use is not None else None
        self._tokens = dict(tokens)
        key = source if tool_use is None else source + "\0" + tool_use[0]
        self.id = "jinja-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
        self.origin = origin
        self.available = True
        self.tool_format = tool_calls.detect(source, *(tool_use[:1] if tool_use else ()))

    def render(self, messages: Sequence[ChatMessage], tools: list[Any] | None = None) -> str:
        _require_messages(messages)
        chat: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            content = m.content if m.parts is None else [dict(p) for p in m.parts]
            d: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:          # as transformers: keys whose value is None are left out
                d["name"] = m.name
            if d["content"] is None:
                del d["content"]
            if m.tool_calls:
                d["tool_calls"] = [_jinja_call(c, f"messages[{i}].tool_calls[{j}]")
                                   for j, c in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            chat.append(d)
        # transformers' choice: the ``tool_use`` template when tools are given and it has one
        template = self._tool_template if tools is not None and self._tool_template is not None else self._template
        try:
            return jinja_template.render(template, chat, self._tokens, tools=tools)
        except jinja2.TemplateError as e:   # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(f"messages: the model's chat template refused them: {e.message or e}",
                                    "messages", code="chat_template_error") from None
        except Exception as e:  # noqa: BLE001 - a template's own bug, triggered by these messages
            raise ChatTemplateError(f"messages: the model's chat template failed on them: "
                                    f"{type(e).__name__}: {e}", "messages", code="chat_template_error") from None


class MissingTemplate:
    """A checkpoint without a chat template: chat requests are refused (400), saying why."""

    id = "none"
    available = False
    tool_format = "none"

    def __init__(self, reason: str) -> None:
        #: Where the template was looked for (the origin of the refusal).
        self.reason = self.origin = reason

    def render(self, messages: Sequence[ChatMessage], tools: list[Any] | None = None) -> str:
        # NOTE: the reason names server paths; it goes to the start log, not to clients.
        raise ChatTemplateError("this model has no chat template, so it cannot serve chat completions; send "
                                "a formatted prompt to /v1/completions instead", "messages",
                                code="chat_template_missing")


def _checkpoint_source(directory: Path) -> tuple[str, str] | str:
    """``(template text, origin)`` of the checkpoint's default template, or why there is none.

    transformers' order: ``chat_template.jinja`` wins over ``tokenizer_config.json``'s field.
    """
    jinja = directory / JINJA_FILE
    try:
        return jinja.read_text(encoding="utf-8"), str(jinja)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFileError(f"{jinja}: cannot read it: {e}") from e
    path = directory / TOKENIZER_CONFIG
    value = (read_json_object(path) or {}).get("chat_template")
    origin = f"{path}: field chat_template"
    if value is None:
        return f"{directory} has no {JINJA_FILE} and no chat_template in {TOKENIZER_CONFIG}"
    if isinstance(value, str):
        return value, origin
    named = value if isinstance(value, list) else None
    if named is None or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                and isinstance(t.get("template"), str) for t in named):
        raise CheckpointFileError(f"{origin}: expected a template string or a list of "
                                  '{"name": ..., "template": ...} objects')
    templates = {t["name"]: t["template"] for t in named}
    if "default" not in templates:
        return f"{origin} names templates {sorted(templates)} but none is named 'default'"
    return templates["default"], f"{origin} (default)"


def _tool_use_source(directory: Path) -> tuple[str, str] | None:
    """The checkpoint's ``tool_use`` template, as transformers finds it: ``additional_chat_templates/
    tool_use.jinja`` (transformers 5's file), else the one so named in ``tokenizer_config.json``."""
    path = directory / "additional_chat_templates" / "tool_use.jinja"
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFileError(f"{path}: cannot read it: {e}") from e
    config = directory / TOKENIZER_CONFIG
    value = (read_json_object(config) or {}).get("chat_template")
    named = [t for t in value if isinstance(t, dict) and t.get("name") == "tool_use"] if isinstance(value, list) else []
    if named and isinstance(named[0].get("template"), str):
        return named[0]["template"], f"{config}: field chat_template (tool_use)"
    return None


def load_chat_template(model_dir: str) -> ChatTemplate:
    """The template for ``worker.model_dir``: the built-in one when it is empty, else the
    checkpoint's (a :class:`MissingTemplate` when it has none).

    Raises :class:`CheckpointFileError` naming the file for an unreadable file, an ill-typed
    ``chat_template`` field or a template that does not compile.
    """
    if not model_dir:
        return BUILTIN
    directory = Path(model_dir)
    found = _checkpoint_source(directory)
    if isinstance(found, str):
        return MissingTemplate(found)
    source, origin = found
    return JinjaChatTemplate(source, origin, special_tokens(directory), _tool_use_source(directory))


__all__ = ["BUILTIN", "ROLES", "TEMPLATE_ID", "BuiltinTemplate", "ChatMessage", "ChatTemplate", "ChatTemplateError",
           "JinjaChatTemplate", "MissingTemplate", "load_chat_template", "message", "normalize_role", "render"]
