"""Images in chat prompts: intake, preprocessing, content hashes, and their keys in block hashes.

Shared by the worker and the gateway (Pillow only: no torch, no numpy — the gateway runs in the
coordinator's image, which has neither): the gateway must compute the block hashes a worker will
lease for a request with images, so both prepare an image with this code.

**Intake** (:func:`decode_data_url`, :func:`prepare`), cheapest checks first, each refusal an
:class:`ImageError` (a 400 at the edge) naming the parameter and the limit:

1. a ``data:`` URL with a base64 payload of an allowed media type (PNG, JPEG, WebP, GIF); its
   decoded size is computed from the base64 length and checked against ``service.max_image_bytes``
   *before* anything is decoded;
2. from its header alone, before any pixel is decoded (a 2 KB PNG can declare a 4096 × 4096
   canvas): its width × height against ``service.max_image_pixels``; the bytes one decoded copy
   takes — width × height × channels × bytes per channel, of its own mode or of the RGB / RGBA it
   is converted to, whichever is more — against ``service.max_image_decoded_bytes``; the frames
   an animated image declares against ``service.max_image_frames``;
3. then it is decoded (a GIF's or animated WebP's first frame), made RGB (an alpha channel is
   composited onto white, as transformers' ``convert_to_rgb`` does; an image without one is
   converted straight to RGB, the same pixels without the three RGBA copies), and resized to the
   model's ``image_size`` square with Pillow's bicubic filter.

The peak memory of one image is therefore a small multiple of its decoded budget: a 1-bit
4096 × 4096 PNG of 2 KB cost 229 MB before (four full-size RGBA/RGB copies), ~50 MB now
(``tests/unit/test_image_budget.py`` measures it).

(``service.max_images_per_request`` is counted by the caller before any image is read; remote
``http(s)`` URLs are the worker's business: :mod:`worker.api.images`.)

**Content hash** (:func:`content_hash`): BLAKE2b of the *preprocessed* pixels and the
preprocessing parameters — not of the file. The pixels are exactly what the vision encoder reads,
so two encodings of one picture (a PNG and a lossless WebP) share a hash and a cache, and two
inputs the encoder would see differently never do, whatever made them differ: another image, or
the same file through another decoder or resize (a Pillow upgrade on one worker), which a hash of
the file's bytes would wrongly treat as one. The parameters (format version, size, filter) are
hashed too, so a changed pipeline never matches an older one even where its pixels coincide.

**Keys in the block hash chain** (:func:`image_block_keys`): an image occupies a run of image
tokens in the prompt, all with the model's ``image_token_id``; every block overlapping the run
gets a key naming the image's hash and the offsets within the image it covers. So the same
image in the same place reuses its blocks, another image (or the same one elsewhere) shares none,
and the tenant salt and namespace apply as to any block (``shared.hashing.block_hash``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Pillow decoders an image may use (nothing else is tried: no exotic parsers on client bytes).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
#: ``data:`` URL media types and the decoder each names.
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF"}
#: The preprocessing pipeline's identity: part of every content hash (bump it when the pipeline
#: changes, so that no hash of the older pipeline matches).
PIPELINE = "kvl-image-v1:rgb8-white-alpha:bicubic-square"
REMOTE_SCHEMES = ("http://", "https://")


class ImageError(ValueError):
    """An image part this server refuses; ``param`` names the field, ``code`` the case (a 400)."""

    def __init__(self, message: str, param: str, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """What a model's vision input needs of the serving layer: the square it reads, its patch
    (one image token per patch), and the token id its image positions carry."""

    image_size: int
    patch_size: int
    image_token_id: int

    def __post_init__(self) -> None:
        if self.image_size <= 0 or self.patch_size <= 0 or self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} must be a positive multiple of patch_size "
                             f"{self.patch_size}")
        if self.image_token_id < 0:
            raise ValueError(f"image_token_id must be >= 0, got {self.image_token_id}")

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def describe(self) -> str:
        """The preprocessing parameters, as they enter the content hash."""
        return f"{PIPELINE}:{self.image_size}"


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """``service.max_image_bytes`` / ``max_image_pixels`` / ``max_images_per_request`` /
    ``allow_remote_images`` / ``image_fetch_timeout_ms`` / ``max_image_decoded_bytes`` /
    ``max_image_frames``."""

    max_bytes: int
    max_pixels: int
    max_images: int
    allow_remote: bool = False
    fetch_timeout_s: float = 10.0
    max_decoded_bytes: int = 64 * 2**20
    max_frames: int = 256

    @classmethod
    def of(cls, service: Any) -> ImageLimits:
        """From a :class:`shared.config.ServiceConfig`."""
        return cls(max_bytes=service.max_image_bytes, max_pixels=service.max_image_pixels,
                   max_images=service.max_images_per_request, allow_remote=service.allow_remote_images,
                   fetch_timeout_s=service.image_fetch_timeout_ms / 1000,
                   max_decoded_bytes=service.max_image_decoded_bytes, max_frames=service.max_image_frames)


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """One image ready for the encoder: ``pixels``, the ``S × S × 3`` bytes of its RGB square
    (rows top to bottom, each pixel's R, G, B), and their :func:`content_hash`."""

    pixels: bytes
    content_hash: str


@dataclass(frozen=True, slots=True, eq=False)
class PromptImage:
    """An image placed in a prompt: its tokens are ``[offset, offset + tokens)``."""

    offset: int
    tokens: int
    content_hash: str
    #: The preprocessed pixels (``PreparedImage.pixels``); the gateway's copies need none.
    pixels: bytes | None = None


# --- intake --------------------------------------------------------------------------------------

_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(REMOTE_SCHEMES)


def decode_data_url(url: str, param: str, limits: ImageLimits) -> bytes:
    """The image bytes of a ``data:image/...;base64,...`` URL, within ``limits.max_bytes``
    (checked on the base64 length, before decoding)."""
    m = _DATA_URL.match(url)
    if m is None:
        shown = url[:16] + ("…" if len(url) > 16 else "")   # NOTE: never echo a whole URL (it is the image)
        raise ImageError(f"{param}: expected a data: URL (data:image/png;base64,...) or an http(s) URL, got "
                         f"{shown!r}", param, code="invalid_image_url")
    media, params = m.group(1).strip().lower(), [p.strip().lower() for p in m.group(2).split(";") if p.strip()]
    if media not in MEDIA_TYPES:
        raise ImageError(f"{param}: media type {media or '(none)'!r} is not supported; use one of "
                         f"{', '.join(sorted(MEDIA_TYPES))}", param, code="invalid_image_url")
    if "base64" not in params:
        raise ImageError(f"{param}: the data URL must be base64-encoded (data:{media};base64,...)", param,
                         code="invalid_image_url")
    payload = url[m.end():]
    if len(payload) % 4:
        raise ImageError(f"{param}: the base64 payload is malformed (its length is not a multiple of 4)", param,
                         code="invalid_image_url")
    size = len(payload) // 4 * 3 - (len(payload) - len(payload.rstrip("=")))
    if size > limits.max_bytes:
        raise ImageError(f"{param}: the image is {size} bytes; at most {limits.max_bytes} bytes per image "
                         f"(service.max_image_bytes)", param, code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{param}: the base64 payload is malformed", param, code="invalid_image_url") from None


def check_bytes(data: bytes, param: str, limits: ImageLimits) -> None:
    """``service.max_image_bytes`` for bytes that did not come from a data URL (a fetched image)."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{param}: the image is more than {limits.max_bytes} bytes (service.max_image_bytes)",
                         param, code="image_too_large")


def prepare(data: bytes, spec: ImageSpec, limits: ImageLimits, param: str) -> PreparedImage:
    """Decode, check, convert and resize one image (see the module docstring); CPU-bound, so the
    worker runs it off its event loop."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError:
        raise _too_many_pixels(param, None, limits) from None
    except (OSError, ValueError, SyntaxError):   # UnidentifiedImageError is an OSError
        raise ImageError(f"{param}: not a PNG, JPEG, WebP or GIF image", param, code="invalid_image") from None
    with img:
        w, h = img.size
        if w * h > limits.max_pixels:
            raise _too_many_pixels(param, (w, h), limits)
        if w <= 0 or h <= 0:
            raise ImageError(f"{param}: the image has no pixels ({w}×{h})", param, code="invalid_image")
        _check_header(img, param, limits)
        try:
            img.seek(0)                                  # a GIF's / animated WebP's first frame
            rgb = _rgb(img)
            square = rgb.resize((spec.image_size, spec.image_size), Image.Resampling.BICUBIC)
        except Image.DecompressionBombError:
            raise _too_many_pixels(param, (w, h), limits) from None
        except (OSError, ValueError, SyntaxError, EOFError, MemoryError):
            raise ImageError(f"{param}: the image could not be decoded (truncated or damaged)", param,
                             code="invalid_image") from None
    pixels = square.tobytes()
    assert square.mode == "RGB" and len(pixels) == spec.image_size ** 2 * 3, (square.mode, len(pixels))
    return PreparedImage(pixels, content_hash(pixels, spec))


def decoded_bytes(mode: str, size: tuple[int, int]) -> int:
    """Bytes one full-size copy of an image of ``mode`` takes while it is prepared: its own
    mode's or the RGB / RGBA it is converted to (:func:`_rgb`), whichever is more."""
    from PIL import Image

    try:
        own = len(Image.new(mode, (1, 1)).tobytes())   # bytes per pixel: channels × bytes per channel
    except (ValueError, OSError):
        own = 4
    return size[0] * size[1] * max(own, 3 if mode == "RGB" or not _has_alpha_mode(mode) else 4)


def _has_alpha_mode(mode: str) -> bool:
    return mode in ("RGBA", "LA", "PA", "La", "RGBa", "P")   # P: a palette may carry transparency


def _check_header(img: Any, param: str, limits: ImageLimits) -> None:
    """The decoded-bytes and frame budgets, from what the header declares (nothing decoded)."""
    need = decoded_bytes(img.mode, img.size)
    if need > limits.max_decoded_bytes:
        w, h = img.size
        raise ImageError(f"{param}: the image would take {need} bytes decoded ({w}×{h}, mode {img.mode}); at most "
                         f"{limits.max_decoded_bytes} (service.max_image_decoded_bytes)", param,
                         code="image_too_large_decoded")
    try:
        frames = int(getattr(img, "n_frames", 1))      # headers only: no frame is decoded to count them
    except (OSError, ValueError, SyntaxError, EOFError):
        raise ImageError(f"{param}: the image could not be decoded (truncated or damaged)", param,
                         code="invalid_image") from None
    if frames > limits.max_frames:
        raise ImageError(f"{param}: the image has {frames} frames; at most {limits.max_frames} "
                         f"(service.max_image_frames; only the first is used)", param, code="image_too_many_frames")


def _too_many_pixels(param: str, size: tuple[int, int] | None, limits: ImageLimits) -> ImageError:
    what = f"{size[0]}×{size[1]} = {size[0] * size[1]} pixels" if size else "more pixels than the decoder allows"
    return ImageError(f"{param}: the image has {what}; at most {limits.max_pixels} pixels per image "
                      f"(service.max_image_pixels)", param, code="image_too_many_pixels")


def _rgb(img: Any) -> Any:
    """RGB, any alpha composited onto white (transformers' ``convert_to_rgb``)."""
    from PIL import Image

    if img.mode == "RGB":
        img.load()
        return img
    if img.mode in _OPAQUE and "transparency" not in img.info:
        # NOTE: no alpha to composite: the same pixels as through RGBA, without three full-size copies
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


#: Modes without an alpha channel (converted straight to RGB when no ``transparency`` is declared).
_OPAQUE = frozenset({"1", "L", "P", "CMYK", "YCbCr", "LAB", "HSV", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})


def content_hash(pixels: bytes, spec: ImageSpec) -> str:
    """32 hex digits over the preprocessing parameters and the preprocessed pixels (see the
    module docstring for why not the file's bytes)."""
    h = hashlib.blake2b(digest_size=16, person=b"kvl-image")
    shape = struct.pack("<3I", spec.image_size, spec.image_size, 3)
    for part in (spec.describe().encode(), shape, pixels):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.hexdigest()


# --- block hash keys -------------------------------------------------------------------------------

def image_block_keys(images: Sequence[PromptImage], block_size: int) -> list[tuple[str, ...]]:
    """Per-block ``extra_keys`` for ``shared.hashing.chain_hashes``: block ``i`` gets one key per
    image overlapping it, ``image:<content hash>:<first>:<end>`` (the image's token offsets the
    block covers), in image order; blocks after the last image get none."""
    if not images:
        return []
    n_blocks = -(-max(im.offset + im.tokens for im in images) // block_size)
    keys: list[list[str]] = [[] for _ in range(n_blocks)]
    for im in images:
        end = im.offset + im.tokens
        for b in range(im.offset // block_size, (end - 1) // block_size + 1):
            lo, hi = max(b * block_size, im.offset), min((b + 1) * block_size, end)
            keys[b].append(f"image:{im.content_hash}:{lo - im.offset}:{hi - im.offset}")
    return [tuple(k) for k in keys]


def check_placement(images: Sequence[PromptImage], tokens: Sequence[int], image_token_id: int | None) -> None:
    """ValueError unless every image's run lies in ``tokens``, runs do not overlap, and every
    position of a run holds ``image_token_id`` (an internal contract: the API builds them so)."""
    end = 0
    for im in sorted(images, key=lambda i: i.offset):
        if im.tokens <= 0 or im.offset < end or im.offset + im.tokens > len(tokens):
            raise ValueError(f"image tokens [{im.offset}, {im.offset + im.tokens}) do not fit a prompt of "
                             f"{len(tokens)} tokens (or overlap another image)")
        if image_token_id is None or any(t != image_token_id for t in tokens[im.offset:im.offset + im.tokens]):
            raise ValueError(f"image tokens [{im.offset}, {im.offset + im.tokens}) do not all carry the model's "
                             f"image_token_id ({image_token_id})")
        end = im.offset + im.tokens


# --- the model's vision input, from a checkpoint directory ----------------------------------------

#: ``config.json``'s key for kvledger's vision encoder (``worker.model.vision.VisionConfig``).
CONFIG_KEY = "vision"


def image_spec_of(model_dir: str) -> ImageSpec | None:
    """The :class:`ImageSpec` a checkpoint's ``config.json`` declares (its ``vision`` section and
    ``image_token_id``), None when it declares none or cannot be read: the gateway's copy of what
    the worker's loader (``worker.model.checkpoint``) validates and refuses at start."""
    if not model_dir:
        return None
    try:
        doc = json.loads((Path(model_dir) / "config.json").read_text())
        vision, token = doc.get(CONFIG_KEY), doc.get("image_token_id")
        if not isinstance(vision, dict) or not isinstance(token, int):
            return None
        return ImageSpec(int(vision["image_size"]), int(vision["patch_size"]), token)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


__all__ = ["CONFIG_KEY", "FORMATS", "MEDIA_TYPES", "PIPELINE", "ImageError", "ImageLimits", "ImageSpec",
           "PreparedImage", "PromptImage", "check_bytes", "check_placement", "content_hash", "decode_data_url",
           "decoded_bytes",
           "image_block_keys", "image_spec_of", "is_remote", "prepare"]
