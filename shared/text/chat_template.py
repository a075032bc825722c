"""The chat template: how ``/v1/chat/completions`` turns messages into one prompt.

Which template (:func:`load_chat_template`):

* no ``worker.model_dir`` (the built-in tiny model): kvledger's own plain-text template,
  below (:data:`BUILTIN`);
* a checkpoint directory: its Jinja template, as ``save_pretrained`` writes it —
  ``chat_template.jinja`` (transformers 5), else ``tokenizer_config.json``'s ``chat_template``
  (a string, or a list of ``{"name", "template"}`` of which ``default`` is used) — rendered as
  transformers renders it (:mod:`shared.text.jinja_template`) with the checkpoint's special tokens.
  Messages reach it as sent (``role``, ``content``, ``name`` when given): which roles it
  accepts is the template's business.
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
checkpoint templates too, which get the content as one string).

Why this shape: it is stable under extension — the prompt of a conversation is a prefix of
the prompt of the same conversation one turn later (append the assistant's reply and the
next user message), so every turn of a multi-turn chat reuses the cached blocks of the
previous turns' prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jinja2

from shared.text import jinja_template
from shared.text.checkpoint_files import CheckpointFileError, read_json_object
from shared.text.tokenizer import special_tokens

TEMPLATE_ID = "kvl-chat-v1"
ROLES = ("system", "user", "assistant")
_ALIASES = {"developer": "system"}
JINJA_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None


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

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt for ``messages``, ending with the assistant's generation prompt; raises
        :class:`ChatTemplateError` for messages the template refuses."""


def normalize_role(role: str, index: int) -> str:
    r = _ALIASES.get(role, role)
    if r not in ROLES:
        raise ChatTemplateError(f"messages[{index}].role: {role!r} is not supported; use one of "
                                f"{', '.join((*ROLES, *_ALIASES))}", f"messages[{index}].role")
    return r


def _require_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise ChatTemplateError("messages: at least one message is required", "messages")


def render(messages: Sequence[ChatMessage]) -> str:
    """The built-in template's prompt for ``messages`` (the module docstring gives the format)."""
    _require_messages(messages)
    parts = [f"<|{normalize_role(m.role, i)}|>\n{m.content}\n" for i, m in enumerate(messages)]
    parts.append("<|assistant|>\n")
    return "".join(parts)


class BuiltinTemplate:
    """kvledger's plain-text template (:func:`render`), for the built-in tiny model."""

    id = TEMPLATE_ID
    origin = "builtin"
    available = True

    def render(self, messages: Sequence[ChatMessage]) -> str:
        return render(messages)


BUILTIN = BuiltinTemplate()


class JinjaChatTemplate:
    """A checkpoint's Jinja template with its special tokens, compiled once."""

    def __init__(self, source: str, origin: str, tokens: dict[str, str]) -> None:
        """Raises :class:`CheckpointFileError` (``origin`` and the line named) when it does not compile."""
        try:
            self._template = jinja_template.compile_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointFileError(f"{origin}: the chat template does not compile: line {e.lineno}: "
                                      f"{e.message}") from e
        self._tokens = dict(tokens)
        self.id = "jinja-" + hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]
        self.origin = origin
        self.available = True

    def render(self, messages: Sequence[ChatMessage]) -> str:
        _require_messages(messages)
        chat: list[dict[str, Any]] = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name is not None:          # as transformers: keys whose value is None are left out
                d["name"] = m.name
            chat.append(d)
        try:
            return jinja_template.render(self._template, chat, self._tokens)
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

    def __init__(self, reason: str) -> None:
        #: Where the template was looked for (the origin of the refusal).
        self.reason = self.origin = reason

    def render(self, messages: Sequence[ChatMessage]) -> str:
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
    return JinjaChatTemplate(source, origin, special_tokens(directory))


__all__ = ["BUILTIN", "ROLES", "TEMPLATE_ID", "BuiltinTemplate", "ChatMessage", "ChatTemplate", "ChatTemplateError",
           "JinjaChatTemplate", "MissingTemplate", "load_chat_template", "normalize_role", "render"]
