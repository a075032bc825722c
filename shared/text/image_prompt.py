"""A chat prompt with images: what the template renders for an image, and the token sequence.

An image part renders as the model's *placeholder* and becomes, in the token sequence, a run of
``ImageSpec.tokens_per_image`` tokens with the model's ``image_token_id`` (one per patch of the
vision encoder), whose input rows the encoder's vectors replace (``worker.model.vision``).

* The built-in template (``shared.text.chat_template.render``) gets each message's content as
  text with the placeholder where an image was: :data:`PLACEHOLDER` (``<|image|>``).
* A checkpoint's Jinja template gets a message holding images as transformers' processors pass
  it: content is a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts, in
  the order sent (no URL or bytes: a template that prints its input must not put the image's
  base64 into the prompt). It renders an image as it was written to, normally the model's image
  token (Qwen2-VL ``<|image_pad|>``, LLaVA ``<image>``).

The placeholder is the text of the tokenizer's added token ``image_token_id`` when it has one:
then the rendered text is encoded whole and each placeholder token expanded to the run (what
transformers' processors do: they repeat the image token in the text before tokenizing, and an
added token is split out before any other rule applies). A tokenizer without it (the byte
tokenizer) uses :data:`PLACEHOLDER`: the text between placeholders is encoded piece by piece and
the runs are put between them. Either way the k-th placeholder is the k-th image in message
order, and the count must match (a template that drops or invents images is a 400). A request
with images may not carry the placeholder in its text (a 400 naming the part): text must not
forge an image position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.images import ImageError, ImageSpec, PreparedImage, PromptImage
from shared.text.chat_template import ChatTemplateError
from shared.text.tokenizer import Tokenizer

#: The placeholder of the built-in template (and of any tokenizer without an image token).
PLACEHOLDER = "<|image|>"


def jinja_parts(parts: Sequence[str | None]) -> tuple[dict[str, Any], ...]:
    """A message's parts as a Jinja template receives them: a text, or None for an image."""
    return tuple({"type": "image"} if p is None else {"type": "text", "text": p} for p in parts)


@dataclass(frozen=True, slots=True)
class ImagePrompting:
    """How one model's prompts hold images: its :class:`ImageSpec` and the tokenizer's placeholder."""

    spec: ImageSpec
    placeholder: str
    #: The placeholder is the tokenizer's own image token: the text is encoded whole.
    whole: bool

    @classmethod
    def of(cls, tokenizer: Tokenizer, spec: ImageSpec) -> ImagePrompting:
        text = tokenizer.added_token(spec.image_token_id)
        if text and tokenizer.encode(text, add_special_tokens=False) == [spec.image_token_id]:
            return cls(spec, text, True)
        return cls(spec, PLACEHOLDER, False)

    def check_text(self, text: str, param: str) -> None:
        """A text of a request with images must not hold the placeholder."""
        if self.placeholder in text:
            raise ImageError(f"{param}: contains {self.placeholder!r}, the model's image placeholder; send images as "
                             f"image_url parts", param, code="image_placeholder_in_text")

    def encode(self, tokenizer: Tokenizer, text: str, images: Sequence[PreparedImage], *,
               add_special_tokens: bool = False) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The token ids of a rendered prompt holding ``images`` (in order), and where each lies."""
        tid, n = self.spec.image_token_id, self.spec.tokens_per_image
        if self.whole:
            raw = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            found = sum(1 for t in raw if t == tid)
            _check_count(found, len(images))
            ids: list[int] = []
            placed: list[PromptImage] = []
            for t in raw:
                if t == tid:
                    im = images[len(placed)]
                    placed.append(PromptImage(len(ids), n, im.content_hash, im.pixels))
                    ids += [tid] * n
                else:
                    ids.append(t)
            return ids, tuple(placed)
        pieces = text.split(self.placeholder)
        _check_count(len(pieces) - 1, len(images))
        ids, placed = [], []
        for k, piece in enumerate(pieces):
            if piece:
                ids += tokenizer.encode(piece, add_special_tokens=add_special_tokens and k == 0)
            if k < len(images):
                placed.append(PromptImage(len(ids), n, images[k].content_hash, images[k].pixels))
                ids += [tid] * n
        return ids, tuple(placed)


def _check_count(rendered: int, sent: int) -> None:
    if rendered != sent:
        raise ChatTemplateError(f"messages: the chat template rendered {rendered} image placeholders for the "
                                f"{sent} images sent; this model's template cannot place them", "messages",
                                code="chat_template_error")


__all__ = ["PLACEHOLDER", "ImagePrompting", "jinja_parts"]
