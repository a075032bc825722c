"""Image parts of chat requests: checked, read, prepared, and placed in the prompt.

``{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": ...}}`` parts
go through :mod:`shared.images` (limits, decoding, preprocessing, content hash) and
:mod:`shared.text.image_prompt` (placeholder, image-token runs) — the code the gateway runs to
hash the same prompt. The checks, cheapest first, each a 400 naming the part and the limit:

1. the model takes images at all (it has a vision encoder; else ``images_not_supported``);
2. the number of image parts, ``service.max_images_per_request`` (before any image is read);
3. no text of the request holds the model's image placeholder;
4. per image: its URL — a ``data:`` URL, or ``http(s)`` only with ``service.allow_remote_images``
   (else ``remote_image_not_allowed``) — then ``service.max_image_bytes`` (on the base64
   length, before decoding), then ``service.max_image_pixels`` (from the header, before the
   pixels are decoded); decoding and resizing run off the event loop.

Remote images, when allowed, are fetched with aiohttp within ``service.image_fetch_timeout_ms``
(connection, at most :data:`MAX_REDIRECTS` redirects and body together), reading no more than
``service.max_image_bytes``. The worker then fetches whatever URL a client names — internal
addresses included — which is why that is off by default.

Nothing of an image reaches a log: not its bytes, not its URL (a data URL *is* the image).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from shared.images import (
    ImageError,
    ImageLimits,
    PreparedImage,
    PromptImage,
    check_bytes,
    decode_data_url,
    is_remote,
    prepare,
)
from shared.text.chat_template import ChatMessage
from shared.text.image_prompt import ImagePrompting, jinja_parts
from shared.text.tokenizer import Tokenizer
from worker.api.errors import ApiError
from worker.api.keys import CONFIG, ENGINE, TOKENIZER
from worker.api.schemas import Message
from worker.model.vision import image_spec

#: Redirects a remote image's fetch may follow.
MAX_REDIRECTS = 3
_CHUNK = 64 * 1024


@dataclass(slots=True)
class ChatImages:
    """A chat request's images, prepared, in message order (empty: a text-only request)."""

    prompting: ImagePrompting | None = None
    images: list[PreparedImage] = field(default_factory=list)
    #: message index → its parts as a Jinja template receives them (messages holding images).
    parts: dict[int, tuple[dict[str, Any], ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.images)

    @property
    def placeholder(self) -> str | None:
        """What an image part renders as in a message's text (None: no images)."""
        return self.prompting.placeholder if self.prompting is not None and self.images else None

    def message(self, i: int, m: ChatMessage) -> ChatMessage:
        """Message ``i`` with its parts when it holds images (a Jinja template gets them)."""
        return dataclasses.replace(m, parts=self.parts[i]) if i in self.parts else m

    def tokens(self, tokenizer: Tokenizer, text: str, *,
               add_special_tokens: bool = False) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The rendered prompt's token ids and where each image's run lies."""
        if not self.images or self.prompting is None:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens), ()
        return self.prompting.encode(tokenizer, text, self.images, add_special_tokens=add_special_tokens)


async def chat_images(request: web.Request, messages: Sequence[Message]) -> ChatImages:
    """Check and prepare the image parts of ``messages`` (the module docstring gives the order)."""
    refs = [(i, j, part) for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if part.type == "image_url"]
    if not refs:
        return ChatImages()
    spec = image_spec(request.app[ENGINE].model)
    if spec is None:
        i, j, _ = refs[0]
        raise ApiError.invalid(f"messages[{i}].content[{j}]: this model does not accept images (it has no vision "
                               f"encoder); send text only", f"messages[{i}].content[{j}]", code="images_not_supported")
    limits = ImageLimits.of(request.app[CONFIG].service)
    if len(refs) > limits.max_images:
        i, j, _ = refs[limits.max_images]
        param = f"messages[{i}].content[{j}].image_url.url"
        raise ImageError(f"{param}: this request carries {len(refs)} images; at most {limits.max_images} per request "
                         f"(service.max_images_per_request)", param, code="too_many_images")
    prompting = ImagePrompting.of(request.app[TOKENIZER], spec)
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            prompting.check_text(m.content, f"messages[{i}].content")
        elif isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type == "text" and part.text is not None:
                    prompting.check_text(part.text, f"messages[{i}].content[{j}].text")
    loop = asyncio.get_running_loop()
    prepared = []
    for i, j, part in refs:
        if part.image_url is None:
            raise ApiError.invalid(f"messages[{i}].content[{j}].image_url: required for an image_url part "
                                   '({"url": "data:image/png;base64,..."})', f"messages[{i}].content[{j}].image_url")
        url, param = part.image_url.url, f"messages[{i}].content[{j}].image_url.url"
        data = await fetch(url, param, limits) if is_remote(url) else decode_data_url(url, param, limits)
        # NOTE: decoding and resizing are CPU work: off the event loop (Pillow releases the GIL)
        prepared.append(await loop.run_in_executor(None, prepare, data, spec, limits, param))
    parts = {i: jinja_parts([None if p.type == "image_url" else p.text for p in m.content])
             for i, m in enumerate(messages)
             if isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)}
    return ChatImages(prompting, prepared, parts)


async def fetch(url: str, param: str, limits: ImageLimits) -> bytes:
    """A remote image's bytes, when ``service.allow_remote_images`` allows (module docstring)."""
    if not limits.allow_remote:
        raise ImageError(f"{param}: remote image URLs are not accepted by this server (service.allow_remote_images is "
                         f"false); send the image inline as a data: URL (data:image/png;base64,...)", param,
                         code="remote_image_not_allowed")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limits.fetch_timeout_s)) as http:
            # NOTE: aiohttp refuses the redirect that reaches max_redirects: +1 follows MAX_REDIRECTS
            async with http.get(url, allow_redirects=True, max_redirects=MAX_REDIRECTS + 1) as r:
                if r.status != 200:
                    raise ImageError(f"{param}: fetching the image answered HTTP {r.status}", param,
                                     code="image_fetch_failed")
                if r.content_length is not None:
                    if r.content_length > limits.max_bytes:
                        raise ImageError(f"{param}: the image is {r.content_length} bytes; at most {limits.max_bytes} "
                                         f"bytes per image (service.max_image_bytes)", param, code="image_too_large")
                data = bytearray()
                async for chunk in r.content.iter_chunked(_CHUNK):
                    data += chunk
                    check_bytes(data, param, limits)
                return bytes(data)
    except ImageError:
        raise
    except aiohttp.TooManyRedirects:
        raise ImageError(f"{param}: the image URL redirects more than {MAX_REDIRECTS} times", param,
                         code="image_fetch_failed") from None
    except TimeoutError:
        raise ImageError(f"{param}: the image was not fetched within {limits.fetch_timeout_s:g} s "
                         f"(service.image_fetch_timeout_ms)", param, code="image_fetch_failed") from None
    except (aiohttp.ClientError, ValueError) as e:   # refused, reset, an invalid URL
        raise ImageError(f"{param}: the image could not be fetched ({type(e).__name__})", param,
                         code="image_fetch_failed") from None


__all__ = ["MAX_REDIRECTS", "ChatImages", "chat_images", "fetch"]
