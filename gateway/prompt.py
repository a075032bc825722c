"""The prompt tokens of a request, computed as the worker will compute them — best effort.

The gateway needs them only to ask where their blocks are cached, so it never refuses what a
worker would accept: a body it cannot read is forwarded with no route hint (the worker answers
whatever error it deserves). Completions' text is encoded with the tokenizer's special tokens,
chat messages rendered by the checkpoint's template and encoded without them (as
``worker.api.handlers`` does); token-id prompts are used as they are.
"""

from __future__ import annotations

from typing import Any

from shared.text.chat_template import ChatMessage, ChatTemplate, ChatTemplateError
from shared.text.tokenizer import Tokenizer


def _text(content: Any) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(parts) if all(isinstance(p, str) for p in parts) else None
    return None


def prompt_tokens(path: str, body: Any, tokenizer: Tokenizer, template: ChatTemplate) -> list[int] | None:
    if not isinstance(body, dict):
        return None
    try:
        if path.endswith("/chat/completions"):
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not template.available:
                return None
            out = []
            for m in msgs:
                text = _text(m.get("content")) if isinstance(m, dict) else None
                if text is None or not isinstance(m.get("role"), str):
                    return None
                out.append(ChatMessage(m["role"], text, m.get("name")))
            return tokenizer.encode(template.render(out), add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
    except (ChatTemplateError, ValueError, TypeError):
        return None
    return None
