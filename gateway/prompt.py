"""The prompt tokens of a request, computed as the worker will compute them — best effort.

The gateway needs them only to ask where their blocks are cached, so it never refuses what a
worker would accept: a body it cannot read is forwarded with no route hint (the worker answers
whatever error it deserves). Completions' text is encoded with the tokenizer's special tokens,
chat messages (tool calls and results included) and ``tools`` rendered by the checkpoint's template
and encoded without them (as ``worker.api.handlers`` does, through the same
``shared.text.chat_template.message``); token-id prompts are used as they are.

Chat image parts are prepared with the workers' code (:mod:`shared.images`,
:mod:`shared.text.image_prompt`): their content hashes enter the block hashes as the workers'
do. A request whose images the gateway does not prepare — a remote URL (the gateway fetches
nothing), one over a limit, a fleet whose model takes no images — gets no hint.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shared.images import ImageLimits, PreparedImage, PromptImage, decode_data_url, is_remote, prepare
from shared.text.chat_template import ChatTemplate, ChatTemplateError, message
from shared.text.image_prompt import ImagePrompting, jinja_parts
from shared.text.tokenizer import Tokenizer


class Prompt(NamedTuple):
    tokens: list[int]
    #: Where the prompt's images lie (their content hashes key the blocks they overlap).
    images: tuple[PromptImage, ...] = ()


def _is_image(p: Any) -> bool:
    return isinstance(p, dict) and p.get("type") == "image_url"


def _text(content: Any, placeholder: str | None = None) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [placeholder if placeholder is not None and _is_image(p) else p.get("text") for p in content
                 if isinstance(p, dict) and (p.get("type") == "text" or placeholder is not None and _is_image(p))]
        return "".join(parts) if all(isinstance(p, str) for p in parts) else None
    return None


def _images(msgs: list[Any], images: ImagePrompting | None, limits: ImageLimits) -> list[PreparedImage] | None:
    """The request's images, prepared as a worker prepares them; None when the gateway cannot."""
    refs = [(i, j, p) for i, m in enumerate(msgs) if isinstance(m, dict) and isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"]) if _is_image(p)]
    if images is None or len(refs) > limits.max_images:
        return None
    out = []
    for i, j, p in refs:
        url = (p.get("image_url") or {}).get("url") if isinstance(p.get("image_url"), dict) else None
        if not isinstance(url, str) or is_remote(url):
            return None
        param = f"messages[{i}].content[{j}].image_url.url"
        out.append(prepare(decode_data_url(url, param, limits), images.spec, limits, param))
    return out


def _chat(msgs: list[Any], tokenizer: Tokenizer, template: ChatTemplate, images: ImagePrompting | None,
          limits: ImageLimits | None, tools: Any = None) -> Prompt | None:
    has_images = any(isinstance(m, dict) and isinstance(m.get("content"), list)
                     and any(_is_image(p) for p in m["content"]) for m in msgs)
    prepared: list[PreparedImage] | None = []
    if has_images:
        prepared = _images(msgs, images, limits) if limits is not None else None
        if not prepared:
            return None
    ph = images.placeholder if prepared and images is not None else None
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        text = _text(content, ph)
        if text is None:
            return None
        parts = None
        if ph is not None:
            texts = [content] if isinstance(content, str) else [
                p.get("text") for p in content or () if isinstance(p, dict) and p.get("type") == "text"]
            if any(isinstance(t, str) and ph in t for t in texts):
                return None         # text forging the placeholder: the worker refuses it
            if isinstance(content, list) and any(_is_image(p) for p in content):
                parts = jinja_parts([None if _is_image(p) else p.get("text") for p in content])
        out.append(message(m["role"], None if content is None else text, m.get("name"), m.get("tool_calls"),
                           m.get("tool_call_id"), parts=parts))
    rendered = template.render(out, tools or None)
    if prepared and images is not None:
        return Prompt(*images.encode(tokenizer, rendered, prepared))
    return Prompt(tokenizer.encode(rendered, add_special_tokens=False))


def prompt_tokens(path: str, body: Any, tokenizer: Tokenizer, template: ChatTemplate,
                  images: ImagePrompting | None = None, limits: ImageLimits | None = None) -> Prompt | None:
    """The request's prompt (tokens and images), or None: no hint. ``images``: how the fleet's
    model takes images (None: it takes none); ``limits``: ``service.*`` image limits."""
    if not isinstance(body, dict):
        return None
    try:
        if path.endswith("/chat/completions"):
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not template.available:
                return None
            return _chat(msgs, tokenizer, template, images, limits, body.get("tools"))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return Prompt(tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return Prompt(list(prompt))
    # NOTE: RecursionError: a body nested deeper than the workers take (they refuse it) but not
    # too deep for the gateway's parser, rendered by the template (``tools``)
    except (ChatTemplateError, ValueError, TypeError, AttributeError, KeyError, RecursionError):
        return None
    return None
