"""Prompts with images through the engine: reuse is exact, keyed by the image, and per tenant.

A dense model with a vision encoder (seeded); images are prepared by ``shared.images`` as the API
prepares them. Every warm result is compared with a cache-disabled engine's cold run of the same
request with ``torch.equal`` (logits and tokens).
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

from shared.images import ImageLimits, ImageSpec, PromptImage, prepare
from tests.twin import InProcessCoordinator
from tests.worker.conftest import BS, config
from worker.engine import Engine
from worker.model.dense import DenseConfig, build_dense
from worker.model.vision import VisionConfig, image_spec
from worker.scheduler import GenRequest, Scheduler
from shared.tenants import Tenant

IMG = 255            # the image token id (a byte that UTF-8 text never holds)
AT = 20              # the image's first position: it covers [20, 36), the end of block 0 to block 2


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def vlm(request):
    dtype = getattr(torch, request.param)
    model = build_dense(DenseConfig(vision=VisionConfig(image_size=32, patch_size=8), image_token_id=IMG),
                        seed=7, dtype=dtype)
    assert model.check_invariance() == []
    return model


def image(seed: int, spec: ImageSpec) -> PromptImage:
    px = np.random.default_rng(seed).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(px).save(b, "PNG")
    im = prepare(b.getvalue(), spec, ImageLimits(2**20, 2**20, 4), "image")
    return PromptImage(AT, spec.tokens_per_image, im.content_hash, im.pixels)


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, IMG, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def with_image(tail: list[int], img: PromptImage) -> list[int]:
    return text(AT, 1) + [IMG] * img.tokens + tail


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


def engines(vlm, tmp_path, **over):
    cold = Engine(vlm, config(tmp_path / "cold", **over), None)
    twin = InProcessCoordinator()
    return cold, twin, Engine(vlm, config(tmp_path, **over), twin)


async def test_a_warm_resume_at_every_block_after_the_image_and_inside_it_is_bit_identical(vlm, tmp_path) -> None:
    spec = image_spec(vlm)
    img = image(1, spec)
    assert spec.tokens_per_image == 16 and img.offset + img.tokens == 36
    toks = with_image(text(6 * BS + 5 - 36, 2), img)
    # prompt pieces of one block: the stepper cuts the image between two forwards too
    cold, twin, e = engines(vlm, tmp_path, **{"service.max_batch_tokens": BS})
    await e.start()
    try:
        first = await e.generate(toks, max_tokens=3, images=[img])
        assert first.cached_tokens == 0 and "vision" in first.timings
        assert same(first, await cold.generate(toks, max_tokens=3, images=[img]))
        # b = 2: the cached prefix ends at 32, inside the image (its last 4 rows are recomputed)
        for b in range(2, 7):
            keep = max(b * BS, 36)
            probe = toks[:keep] + [(t + b) % IMG for t in toks[keep:keep + 7]]
            warm = await e.generate(probe, max_tokens=3, images=[img])
            assert warm.cached_tokens == b * BS, (b, warm.cached_tokens, warm.fallbacks)
            assert ("vision" in warm.timings) == (b * BS < 36)      # an image wholly cached is not encoded
            assert same(warm, await cold.generate(probe, max_tokens=3, images=[img])), b
        # the echo path's cold pass computes the same bits at the last prompt position
        logits = await e.prompt_logits(toks, [img])
        assert logits.shape[0] == len(toks) and torch.equal(logits[-1], first.logits[0])
    finally:
        await e.stop()
        await cold.stop()
    assert not twin.rejected


async def test_another_image_shares_no_block_the_same_one_reuses_tenants_never_share(vlm, tmp_path) -> None:
    spec = image_spec(vlm)
    a, b = image(1, spec), image(2, spec)
    assert a.content_hash != b.content_hash
    tail = text(40, 3)
    cold, twin, e = engines(vlm, tmp_path)
    await e.start()
    try:
        await e.generate(with_image(tail, a), max_tokens=1, images=[a])
        rb = await e.generate(with_image(tail, b), max_tokens=2, images=[b])
        assert rb.cached_tokens == BS          # block 0 ends before the image; block 1 holds a's rows
        assert same(rb, await cold.generate(with_image(tail, b), max_tokens=2, images=[b]))
        again = await e.generate(with_image(tail, a), max_tokens=2, images=[a])
        assert again.cached_tokens == (len(with_image(tail, a)) - 1) // BS * BS
        assert same(again, await cold.generate(with_image(tail, a), max_tokens=2, images=[a]))
        assert not torch.equal(again.logits[0], rb.logits[0])    # the same tokens: the image made the difference
        other = await e.generate(with_image(tail, a), max_tokens=1, tenant="other", images=[a])
        assert other.cached_tokens == 0 and other.hit_tokens == 0
        # the same tokens without the image (its token id as text): no block of the image is reused
        plain = await e.generate(with_image(tail, a), max_tokens=1)
        assert plain.cached_tokens == BS
    finally:
        await e.stop()
        await cold.stop()
    assert not twin.rejected


async def test_an_image_request_batched_with_others_keeps_its_bits(vlm, tmp_path) -> None:
    spec = image_spec(vlm)
    img = image(3, spec)
    reqs = [(with_image(text(30, 4), img), [img]), (text(50, 5), []), (text(9, 6), []),
            (with_image(text(3, 7), img), [img])]
    cold, twin, e = engines(vlm, tmp_path, **{"service.max_batch_tokens": 40})
    await e.start()
    try:
        got = await asyncio.gather(*(e.generate(t, max_tokens=4, images=i) for t, i in reqs))
        assert e.stepper.segments > e.stepper.forwards        # requests shared forwards
        for (t, i), r in zip(reqs, got):
            assert same(r, await cold.generate(t, max_tokens=4, images=i))
    finally:
        await e.stop()
        await cold.stop()


async def test_forked_samples_of_an_image_prompt_decode_what_a_request_of_their_own_would(vlm, tmp_path) -> None:
    spec = image_spec(vlm)
    img = image(4, spec)
    toks = with_image(text(25, 8), img)
    cold, twin, e = engines(vlm, tmp_path)
    await e.start()
    sched = Scheduler(e, config(tmp_path).service)
    try:
        req = GenRequest(tokens=toks, max_tokens=3, tenant=Tenant("default"), keep_logits=True, images=(img,))
        first = sched.submit(req)
        second = sched.submit(req, fork_of=first)
        a, b = await first.wait(), await second.wait()
        assert second.forked
        want = await cold.generate(toks, max_tokens=3, images=[img])
        for o in (a, b):
            assert o.tokens == want.tokens and torch.equal(o.logits, want.logits)
        await e.flush()
        # the fork cached its reply under the image's hashes: a later turn resumes past the reply
        turn = toks + b.tokens + text(20, 9)
        later = await e.generate(turn, max_tokens=2, images=[img])
        assert later.cached_tokens == (len(toks) + 2) // BS * BS
        assert same(later, await cold.generate(turn, max_tokens=2, images=[img]))
    finally:
        await sched.stop()
        await e.stop()
        await cold.stop()
    assert not twin.rejected


async def test_images_in_a_prompt_must_be_placed_on_image_tokens(vlm, tmp_path) -> None:
    img = image(1, image_spec(vlm))
    cold = Engine(vlm, config(tmp_path / "cold"), None)
    try:
        with pytest.raises(ValueError, match="image_token_id"):
            await cold.generate(text(60, 1), max_tokens=1, images=[img])
    finally:
        await cold.stop()
