"""The chat template: how ``/v1/chat/completions`` turns messages into one prompt.

The default byte-level tokenizer has no special tokens, so the template is plain text.
Each message is a header line naming its role, then its content, then a newline; the
prompt ends with the assistant header, so the model's continuation is the reply::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

Exactly: for each message ``"<|" + role + "|>\\n" + content + "\\n"``, then
``"<|assistant|>\\n"``. Roles are ``system``, ``user``, ``assistant`` (``developer`` is
accepted as OpenAI's newer name for ``system`` and rendered as ``system``). Content is a
string or a list of ``{"type": "text", "text": ...}`` parts, joined without separators.

Why this shape: it is stable under extension — the prompt of a conversation is a prefix of
the prompt of the same conversation one turn later (append the assistant's reply and the
next user message), so every turn of a multi-turn chat reuses the cached blocks of the
previous turns' prompt. The template itself is versioned (:data:`TEMPLATE_ID`) because
changing it changes every prompt and therefore every cached block hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TEMPLATE_ID = "kvl-chat-v1"
ROLES = ("system", "user", "assistant")
_ALIASES = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class ChatTemplateError(ValueError):
    """A message the template cannot render; ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def normalize_role(role: str, index: int) -> str:
    r = _ALIASES.get(role, role)
    if r not in ROLES:
        raise ChatTemplateError(f"messages[{index}].role: {role!r} is not supported; use one of "
                                f"{', '.join((*ROLES, *_ALIASES))}", f"messages[{index}].role")
    return r


def render(messages: Sequence[ChatMessage]) -> str:
    """The prompt for ``messages`` (see the module docstring for the exact format)."""
    if not messages:
        raise ChatTemplateError("messages: at least one message is required", "messages")
    parts = [f"<|{normalize_role(m.role, i)}|>\n{m.content}\n" for i, m in enumerate(messages)]
    parts.append("<|assistant|>\n")
    return "".join(parts)


__all__ = ["ChatMessage", "ChatTemplateError", "ROLES", "TEMPLATE_ID", "normalize_role", "render"]
