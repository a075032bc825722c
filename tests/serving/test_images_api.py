"""Chat with images over HTTP: a worker serving a tiny Llama checkpoint with kvledger's vision
encoder (written by transformers plus ``tests.checkpoints.add_vision``; nothing downloaded),
driven by the openai client and raw requests.

An image sent twice is served from the cache the second time, bit for bit the same answer; the
gateway's hashes of the request are the worker's; every image the server refuses is a 400 naming
the part and the limit, and nothing of an image reaches a log.
"""

from __future__ import annotations

import base64
import contextlib
import io
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from PIL import Image
from structlog.testing import capture_logs

from gateway.prompt import prompt_tokens
from shared.hashing import chain_hashes
from shared.images import ImageLimits, image_block_keys, image_spec_of
from shared.messages import ReplicaState
from shared.text.chat_template import load_chat_template
from shared.text.image_prompt import ImagePrompting
from shared.text.tokenizer import load_tokenizer
from tests.checkpoints import add_vision, save_hf, save_tokenizer
from tests.serving.conftest import Server, config, serving
from worker.model.checkpoint import load_checkpoint

pytest.importorskip("transformers")

IMAGE_TOKEN = "<|image_pad|>"
#: Qwen2-VL's way: a string content as is, a list of parts with each image as the image token.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
            "{% endif %}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TAIL = " The ledger records every block. Hello! How are you? You are a helpful assistant." * 2


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    d = save_hf("llama", tmp_path_factory.mktemp("vlm") / "llama-vision", seed=4, vocab_size=256)
    save_tokenizer(d, bos="<|begin_of_text|>", eos="<|eot_id|>", template=TEMPLATE, added=(IMAGE_TOKEN,))
    add_vision(d, image_token_id=image_token_id(d))
    return d


def image_token_id(d) -> int:
    """The id the tokenizer gave the added image token (after the trained vocabulary)."""
    return load_tokenizer(str(d), 256).encode(IMAGE_TOKEN)[0]


@pytest.fixture(scope="module")
def vlm(vision_dir):
    return load_checkpoint(vision_dir).model


@pytest.fixture
def serve_vlm(vlm, vision_dir, tmp_path):
    def make(**over: Any) -> contextlib.AbstractAsyncContextManager[Server]:
        return serving(vlm, config(tmp_path, **{"worker.model_dir": str(vision_dir), **over}))

    return make


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(a).save(b, "PNG")
    return b.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(*urls: str, before: str = "Look at this:", after: str = TAIL) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": before}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": after})
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": parts}]


async def image_at(server: Server, messages, image_id: int) -> tuple[int, int]:
    """(first image position, prompt length), from the worker's own /tokenize."""
    status, doc, _ = await server.post("/tokenize", {"messages": messages})
    assert status == 200, doc
    assert doc["tokens"].count(image_id) == 16 * sum(1 for m in messages if isinstance(m["content"], list)
                                                     for p in m["content"] if p["type"] == "image_url")
    return doc["tokens"].index(image_id), doc["count"]


async def test_an_image_sent_twice_is_reused_exactly_and_another_image_is_not(serve_vlm, vision_dir) -> None:
    async with serve_vlm() as server:
        c = server.client()
        msgs = chat(data_url(png(1)))
        at, n = await image_at(server, msgs, image_token_id(vision_dir))
        end = at + 16
        kw: dict[str, Any] = dict(model="llama-vision", max_tokens=5, temperature=0)
        first = await c.chat.completions.create(messages=msgs, **kw)
        again = await c.chat.completions.create(messages=msgs, **kw)
        assert first.usage.prompt_tokens == again.usage.prompt_tokens == n
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached == (n - 1) // 16 * 16 and cached > end          # the image's blocks came from the cache
        assert again.choices[0].message.content == first.choices[0].message.content
        cold = await c.chat.completions.create(messages=msgs, extra_body={"cache_reuse": False}, **kw)
        assert cold.choices[0].message.content == first.choices[0].message.content
        # another picture in the same place: only the blocks wholly before it are reused
        other = await c.chat.completions.create(messages=chat(data_url(png(2))), **kw)
        assert other.usage.prompt_tokens_details.cached_tokens == at // 16 * 16
        # two samples of the image prompt: one prefill, each sample what a request of its own gets
        two = await c.chat.completions.create(messages=msgs, n=2, **kw)
        assert [ch.message.content for ch in two.choices] == [first.choices[0].message.content] * 2
        # a stream carries the same answer
        stream = await c.chat.completions.create(messages=msgs, stream=True, **kw)
        assert "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]) \
            == first.choices[0].message.content


async def test_the_gateway_hashes_an_image_prompt_as_the_worker_does(serve_vlm, vision_dir) -> None:
    msgs = chat(data_url(png(3)), data_url(png(4)), before="Two pictures:")
    async with serve_vlm() as server:
        status, doc, _ = await server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
        assert status == 200, doc
        await server.engine.flush()
        e = server.engine
        tokenizer = load_tokenizer(str(vision_dir), 2**31)        # as python -m gateway loads them
        images = ImagePrompting.of(tokenizer, image_spec_of(str(vision_dir)))
        prompt = prompt_tokens("/v1/chat/completions", {"messages": msgs}, tokenizer,
                               load_chat_template(str(vision_dir)), images, ImageLimits.of(e.cfg.service))
        assert prompt is not None and len(prompt.images) == 2
        _, tok, _ = await server.post("/tokenize", {"messages": msgs})
        assert prompt.tokens == tok["tokens"]
        hashes = chain_hashes(prompt.tokens, e.block_size, e.namespace, e.salt("default"),
                              image_block_keys(prompt.images, e.block_size))
        committed = {t.block_hash for t in server.twin.published if t.to_state == ReplicaState.READY}
        assert len(hashes) == len(prompt.tokens) // 16 and set(hashes) <= committed
        # without the images' keys the gateway would ask for blocks nobody holds, from the first image on
        first = prompt.images[0].offset // 16
        plain = chain_hashes(prompt.tokens, 16, e.namespace, e.salt("default"))
        assert plain[:first] == hashes[:first] and not set(plain[first:]) & committed
        # a remote image: the gateway fetches nothing and gives no hint
        remote = chat("https://example.invalid/cat.png")
        assert prompt_tokens("/v1/chat/completions", {"messages": remote}, tokenizer,
                             load_chat_template(str(vision_dir)), images, ImageLimits.of(e.cfg.service)) is None


async def refused(server: Server, messages, param: str, code: str | None, *says: str) -> None:
    status, doc, _ = await server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 400, doc
    err = doc["error"]
    assert (err["param"], err["code"]) == (param, code), err
    for s in says:
        assert s in err["message"], err


async def test_every_image_the_server_refuses_is_a_400_naming_the_part_and_the_limit(serve_vlm) -> None:
    big = png(5, (64, 64))                              # ~12 kB of noise
    url = "messages[1].content[1].image_url.url"
    with capture_logs() as logs:
        async with serve_vlm(**{"service.max_images_per_request": 2, "service.max_image_bytes": 8000,
                                "service.max_image_pixels": 40 * 30}) as server:
            await refused(server, chat(*[data_url(png(1))] * 3), "messages[1].content[3].image_url.url",
                          "too_many_images", "at most 2", "service.max_images_per_request")
            await refused(server, chat(data_url(big)), url, "image_too_large", "at most 8000 bytes",
                          "service.max_image_bytes")
            await refused(server, chat(data_url(png(1, (41, 30)))), url, "image_too_many_pixels", "41×30",
                          "at most 1200 pixels", "service.max_image_pixels")
            await refused(server, chat("https://example.com/cat.png"), url, "remote_image_not_allowed",
                          "service.allow_remote_images")
            await refused(server, chat("data:image/png;base64,@@@@"), url, "invalid_image_url", "malformed")
            await refused(server, chat("data:image/png;base64," + base64.b64encode(b"GIF89a...").decode()), url,
                          "invalid_image", "not a PNG, JPEG, WebP or GIF")
            await refused(server, chat(data_url(png(1)), after=f"and {IMAGE_TOKEN} too"),
                          "messages[1].content[2].text", "image_placeholder_in_text", IMAGE_TOKEN)
            await refused(server, [{"role": "user", "content": [{"type": "image_url"}]}],
                          "messages[0].content[0].image_url", None, "required")
            status, doc, _ = await server.post("/v1/chat/completions", {"max_tokens": 1, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(1)),
                                                                               "detail": "ultra"}}]}]})
            assert status == 400 and "detail" in doc["error"]["param"], doc
            # within every limit the same request is served
            status, doc, _ = await server.post("/v1/chat/completions",
                                               {"messages": chat(data_url(png(1))), "max_tokens": 1})
            assert status == 200, doc
    payload = base64.b64encode(png(1)).decode()[:32]
    assert logs and not any(payload in str(event) for event in logs)


async def test_a_model_without_a_vision_encoder_refuses_images(serve) -> None:
    async with serve() as server:
        parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(png(1))}}]
        await refused(server, [{"role": "user", "content": parts}], "messages[0].content[1]", "images_not_supported",
                      "does not accept images")


@pytest.fixture
async def image_host():
    """A local HTTP server: ``/cat.png``, ``/big.png`` (and chunked, without a length), ``/missing``,
    ``/hop/<n>`` (redirects n times)."""
    app = web.Application()

    async def cat(request: web.Request) -> web.Response:
        return web.Response(body=png(1), content_type="image/png")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=png(5, (64, 64)), content_type="image/png")

    async def chunked(request: web.Request) -> web.StreamResponse:     # no Content-Length: counted as read
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        raw = png(5, (64, 64))
        for i in range(0, len(raw), 1000):
            await resp.write(raw[i:i + 1000])
        await resp.write_eof()
        return resp

    app.router.add_get("/cat.png", cat)
    app.router.add_get("/big.png", big)
    app.router.add_get("/chunked.png", chunked)

    async def hop(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        raise web.HTTPFound(f"/hop/{n - 1}" if n > 1 else "/cat.png")

    app.router.add_get("/hop/{n}", hop)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


async def test_remote_images_when_allowed_are_fetched_within_the_limits(serve_vlm, image_host) -> None:
    url = "messages[1].content[1].image_url.url"
    async with serve_vlm(**{"service.allow_remote_images": True, "service.max_image_bytes": 8000}) as server:
        c = server.client()
        kw: dict[str, Any] = dict(model="llama-vision", max_tokens=3, temperature=0)
        fetched = await c.chat.completions.create(messages=chat(f"{image_host}/hop/3"), **kw)
        # the same picture sent inline: the same pixels, the same hash, the fetched request's blocks
        inline = await c.chat.completions.create(messages=chat(data_url(png(1))), **kw)
        n = inline.usage.prompt_tokens
        assert inline.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
        assert inline.choices[0].message.content == fetched.choices[0].message.content
        await refused(server, chat(f"{image_host}/hop/4"), url, "image_fetch_failed", "more than 3 times")
        await refused(server, chat(f"{image_host}/big.png"), url, "image_too_large", "service.max_image_bytes")
        await refused(server, chat(f"{image_host}/chunked.png"), url, "image_too_large", "service.max_image_bytes")
        await refused(server, chat(f"{image_host}/missing"), url, "image_fetch_failed", "HTTP 404")
        await refused(server, chat("http://127.0.0.1:1/cat.png"), url, "image_fetch_failed", "could not be fetched")
