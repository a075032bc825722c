"""Image intake, content hashes and image keys in block hashes (``shared.images``), and the image
tokens of a chat prompt (``shared.text.image_prompt``): pure functions, tiny images."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from shared.hashing import chain_hashes
from shared.images import (
    ImageError,
    ImageLimits,
    ImageSpec,
    PromptImage,
    check_placement,
    content_hash,
    decode_data_url,
    image_block_keys,
    prepare,
)
from shared.text.chat_template import BUILTIN, ChatMessage, ChatTemplateError, render
from shared.text.image_prompt import PLACEHOLDER, ImagePrompting, jinja_parts
from shared.text.tokenizer import ByteTokenizer

SPEC = ImageSpec(image_size=32, patch_size=8, image_token_id=255)
LIMITS = ImageLimits(max_bytes=64 * 1024, max_pixels=512 * 512, max_images=4)
NS = "ab" * 16
P = "messages[0].content[1].image_url.url"


def picture(seed: int, size: tuple[int, int] = (40, 30), mode: str = "RGB") -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    return Image.fromarray(a, mode)


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` × ``height`` and whose pixel data is one empty row."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b""))


# --- intake ------------------------------------------------------------------------------------------

def test_a_data_url_is_decoded_resized_and_hashed_by_its_pixels() -> None:
    img = picture(1)
    got = prepare(decode_data_url(data_url(encoded(img, "PNG")), P, LIMITS), SPEC, LIMITS, P)
    assert isinstance(got.pixels, bytes) and got.pixels == img.resize((32, 32), Image.Resampling.BICUBIC).tobytes()
    assert got.content_hash == content_hash(got.pixels, SPEC) and len(got.content_hash) == 32
    # two lossless encodings of one picture share the hash; another picture never does
    webp = prepare(decode_data_url(data_url(encoded(img, "WEBP", lossless=True), "image/webp"), P, LIMITS),
                   SPEC, LIMITS, P)
    assert webp.content_hash == got.content_hash
    other = prepare(encoded(picture(2), "PNG"), SPEC, LIMITS, P)
    assert other.content_hash != got.content_hash
    # the same pixels under other preprocessing parameters: another hash
    assert content_hash(got.pixels, ImageSpec(32, 4, 255)) == got.content_hash        # patches: not preprocessing
    assert content_hash(got.pixels, ImageSpec(64, 8, 255)) != got.content_hash


def test_jpeg_gif_first_frame_and_alpha_on_white() -> None:
    assert len(prepare(encoded(picture(3), "JPEG"), SPEC, LIMITS, P).pixels) == 32 * 32 * 3
    red, blue = Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))
    gif = io.BytesIO()
    red.save(gif, "GIF", save_all=True, append_images=[blue])
    first = prepare(gif.getvalue(), SPEC, LIMITS, P).pixels
    assert set(first[i:i + 3] for i in range(0, len(first), 3)) == {b"\xff\0\0"}
    clear = Image.new("RGBA", (16, 16), (0, 0, 0, 0))     # fully transparent black → white
    assert set(prepare(encoded(clear, "PNG"), SPEC, LIMITS, P).pixels) == {255}


@pytest.mark.parametrize("url, code, says", [
    ("data:image/png;base64,!!!!", "invalid_image_url", "malformed"),
    ("data:image/png;base64,abc", "invalid_image_url", "multiple of 4"),
    ("data:image/png,abcd", "invalid_image_url", "base64-encoded"),
    ("data:image/tiff;base64,abcd", "invalid_image_url", "image/tiff"),
    ("file:///etc/passwd", "invalid_image_url", "data: URL"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), None, None),
])
def test_malformed_urls_are_refused_naming_the_part(url: str, code: str | None, says: str | None) -> None:
    with pytest.raises(ImageError) as e:
        prepare(decode_data_url(url, P, LIMITS), SPEC, LIMITS, P)
    assert e.value.param == P and str(e.value).startswith(P)
    if code is None:
        assert e.value.code == "invalid_image" and "not a PNG, JPEG, WebP or GIF" in str(e.value)
    else:
        assert e.value.code == code and says in str(e.value)

def test_a_refusal_never_echoes_the_image() -> None:
    payload = base64.b64encode(encoded(picture(4), "PNG")).decode()
    for url in (f"data:image/bmp;base64,{payload}", f"image/png;base64,{payload}"):
        with pytest.raises(ImageError) as e:
            decode_data_url(url, P, LIMITS)
        assert payload[:24] not in str(e.value)


def test_the_byte_limit_is_checked_before_decoding_and_names_the_key() -> None:
    small = ImageLimits(max_bytes=100, max_pixels=LIMITS.max_pixels, max_images=4)
    # an invalid payload: refused for its size, so it was never decoded
    with pytest.raises(ImageError) as e:
        decode_data_url("data:image/png;base64," + "!" * 200, P, small)
    assert e.value.code == "image_too_large" and "service.max_image_bytes" in str(e.value) and "100" in str(e.value)
    raw = b"x" * 99
    assert decode_data_url(data_url(raw), P, ImageLimits(99, 1, 1)) == raw        # exactly at the limit


def test_the_pixel_limit_is_read_from_the_header_before_decoding() -> None:
    huge = png_header(5000, 5000)                        # 25M pixels declared, no pixel data to decode
    with pytest.raises(ImageError) as e:
        prepare(huge, SPEC, LIMITS, P)
    assert e.value.code == "image_too_many_pixels" and "service.max_image_pixels" in str(e.value)
    assert "5000×5000" in str(e.value) and str(LIMITS.max_pixels) in str(e.value)
    with pytest.raises(ImageError) as e:                 # past Pillow's own bomb guard: the same answer
        prepare(png_header(100_000, 100_000), SPEC, LIMITS, P)
    assert e.value.code == "image_too_many_pixels" and "service.max_image_pixels" in str(e.value)
    truncated = png_header(64, 64)                       # within the limit, no data: a 400 too
    with pytest.raises(ImageError) as e:
        prepare(truncated, SPEC, LIMITS, P)
    assert e.value.code == "invalid_image"


# --- keys in the block hash chain ---------------------------------------------------------------------

def test_each_block_overlapping_an_image_names_it_and_the_offsets_it_covers() -> None:
    a = PromptImage(offset=10, tokens=16, content_hash="a" * 32)
    b = PromptImage(offset=40, tokens=16, content_hash="b" * 32)
    keys = image_block_keys([a, b], 16)
    assert keys == [(f"image:{'a' * 32}:0:6",), (f"image:{'a' * 32}:6:16",),
                    (f"image:{'b' * 32}:0:8",), (f"image:{'b' * 32}:8:16",)]
    assert image_block_keys([], 16) == []


def test_image_hashes_share_blocks_only_with_the_same_image_in_the_same_place() -> None:
    toks = list(range(10)) + [255] * 16 + list(range(30, 60))
    salt = b"tenant-salt"

    def hashes(images, tokens=toks, tenant_salt=salt):
        return chain_hashes(tokens, 16, NS, tenant_salt, image_block_keys(images, 16))

    a, b = PromptImage(10, 16, "a" * 32), PromptImage(10, 16, "b" * 32)
    ha, hb, plain = hashes([a]), hashes([b]), hashes([])
    assert ha == hashes([PromptImage(10, 16, "a" * 32)])              # same image, same place: same chain
    assert ha[0] != hb[0] and not set(ha) & set(hb)                   # another image: no block shared
    assert not set(ha) & set(plain)                                    # image tokens as text: none either
    assert not set(ha) & set(hashes([a], tenant_salt=b"other"))        # tenants never share
    # the same image one token later (the same tokens otherwise): another chain from its first block
    moved = toks[:11] + [255] * 16 + toks[27:]
    assert not set(hashes([PromptImage(11, 16, "a" * 32)], moved)) & set(ha)
    # the chain only grows: a longer sequence (a reply) keeps the prompt's hashes as its prefix
    assert hashes([a], toks + [7] * 20)[:len(ha)] == ha


def test_placement_is_checked() -> None:
    toks = [1, 2] + [255] * 4 + [3]
    check_placement([PromptImage(2, 4, "a" * 32)], toks, 255)
    for bad in (PromptImage(1, 4, "a" * 32), PromptImage(4, 4, "a" * 32), PromptImage(2, 0, "a" * 32)):
        with pytest.raises(ValueError):
            check_placement([bad], toks, 255)
    with pytest.raises(ValueError, match="image_token_id"):
        check_placement([PromptImage(2, 4, "a" * 32)], toks, None)


# --- the prompt's image tokens --------------------------------------------------------------------------

def test_the_builtin_template_places_each_image_as_its_run_of_image_tokens() -> None:
    prompting = ImagePrompting.of(ByteTokenizer(), SPEC)
    assert (prompting.placeholder, prompting.whole) == (PLACEHOLDER, False)
    imgs = [prepare(encoded(picture(s), "PNG"), SPEC, LIMITS, P) for s in (1, 2)]
    msgs = [ChatMessage("user", f"look {PLACEHOLDER} and {PLACEHOLDER}!")]
    text = render(msgs)
    ids, placed = prompting.encode(ByteTokenizer(), text, imgs)
    head = list("<|user|>\nlook ".encode())
    assert ids[:len(head)] == head and placed[0].offset == len(head)
    assert [p.tokens for p in placed] == [16, 16] and [p.content_hash for p in placed] == [i.content_hash for i in imgs]
    for p in placed:
        assert ids[p.offset:p.offset + p.tokens] == [255] * 16
    assert bytes(t for t in ids if t != 255).decode() == text.replace(PLACEHOLDER, "")
    with pytest.raises(ChatTemplateError, match="rendered 2 image placeholders for the 1 images"):
        prompting.encode(ByteTokenizer(), text, imgs[:1])
    with pytest.raises(ImageError) as e:
        prompting.check_text(f"forged {PLACEHOLDER}", "messages[0].content[0].text")
    assert e.value.param == "messages[0].content[0].text" and e.value.code == "image_placeholder_in_text"
    assert BUILTIN.render(msgs) == text


def test_jinja_parts_are_what_transformers_passes() -> None:
    assert jinja_parts(["a", None, "b"]) == ({"type": "text", "text": "a"}, {"type": "image"},
                                             {"type": "text", "text": "b"})
