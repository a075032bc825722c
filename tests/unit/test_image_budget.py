"""Issue 51: images are decoded within a pixel, a decoded-memory and a frame budget, checked from
the header before any pixel is decoded (``shared.images.prepare``, the worker's and the gateway's
code). Real crafted files: a 1-bit 4096 × 4096 PNG of ~2 KB (229 MB at its peak before) and a
GIF of many frames; the peak memory of the accepted path is measured in a fresh process."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared.config import ServiceConfig
from shared.images import ImageError, ImageLimits, ImageSpec, decoded_bytes, prepare

ROOT = Path(__file__).resolve().parents[2]
SPEC = ImageSpec(image_size=32, patch_size=8, image_token_id=5)
DEFAULTS = ImageLimits.of(ServiceConfig())
#: The accepted 1-bit bomb's peak over the process's baseline; it was ~229 MB (four full-size RGBA /
#: RGB copies), one RGB copy (48 MiB) and the decoder's buffers now.
MAX_PEAK_BYTES = 120 * 2**20


def one_bit_bomb(side: int = 4096) -> bytes:
    b = io.BytesIO()
    Image.new("1", (side, side)).save(b, "PNG", optimize=True)
    return b.getvalue()


def animated_gif(frames: int, side: int = 16) -> bytes:
    images = []
    for i in range(frames):                 # each frame differs (identical ones would be merged)
        im = Image.new("L", (side, side), 0)
        im.putpixel((i % side, i // side % side), 255)
        images.append(im)
    b = io.BytesIO()
    images[0].save(b, "GIF", save_all=True, append_images=images[1:], duration=10, disposal=1)
    return b.getvalue()


def peak_of(data: bytes, limits: ImageLimits) -> dict:
    """Run ``prepare`` in a fresh process: its peak RSS over its baseline (VmHWM - VmRSS before)."""
    script = textwrap.dedent(f"""
        import json, sys
        from shared.images import ImageError, ImageLimits, ImageSpec, prepare
        from PIL import Image
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        data = sys.stdin.buffer.read()
        Image.new("RGB", (8, 8)).resize((4, 4))     # Pillow's own first-use allocations
        base = status("VmRSS:")
        out = {{}}
        try:
            out["hash"] = prepare(data, ImageSpec(32, 8, 5), ImageLimits(**{limits_dict(limits)!r}), "p").content_hash
        except ImageError as e:
            out["error"] = [e.code, str(e)]
        out["peak"] = status("VmHWM:") - base
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], input=data, capture_output=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def limits_dict(limits: ImageLimits) -> dict:
    return {k: getattr(limits, k) for k in ImageLimits.__slots__}


def test_a_one_bit_4096_square_png_of_2_kb_is_prepared_within_one_rgb_copy() -> None:
    data = one_bit_bomb()
    assert len(data) < 8 * 1024
    assert decoded_bytes("1", (4096, 4096)) == 4096 * 4096 * 3 <= DEFAULTS.max_decoded_bytes
    out = peak_of(data, DEFAULTS)
    print(f"\n1-bit 4096x4096 PNG ({len(data)} B): peak {out['peak'] / 2**20:.1f} MiB over the baseline")
    assert "hash" in out, out
    assert out["peak"] < MAX_PEAK_BYTES, out
    # the same pixels as the RGBA path gave: a black square
    assert prepare(one_bit_bomb(64), SPEC, DEFAULTS, "p").pixels == bytes(32 * 32 * 3)


def test_over_the_decoded_budget_is_refused_from_the_header_before_decoding() -> None:
    limits = ImageLimits(**{**limits_dict(DEFAULTS), "max_decoded_bytes": 32 * 2**20})
    out = peak_of(one_bit_bomb(), limits)
    code, message = out["error"]
    assert code == "image_too_large_decoded", out
    assert "service.max_image_decoded_bytes" in message and "4096×4096" in message and str(32 * 2**20) in message
    assert out["peak"] < 8 * 2**20, out            # nothing full-size was allocated


def test_pixels_are_checked_before_anything_else() -> None:
    limits = ImageLimits(**{**limits_dict(DEFAULTS), "max_pixels": 4096 * 4095})
    with pytest.raises(ImageError) as e:
        prepare(one_bit_bomb(), SPEC, limits, "p")
    assert e.value.code == "image_too_many_pixels" and "service.max_image_pixels" in str(e.value)


def test_an_animated_gif_of_many_frames_is_refused_and_one_within_the_budget_served() -> None:
    many = animated_gif(DEFAULTS.max_frames + 44)
    assert len(many) < 64 * 1024
    with pytest.raises(ImageError) as e:
        prepare(many, SPEC, DEFAULTS, "messages[0].content[1].image_url.url")
    assert e.value.code == "image_too_many_frames" and e.value.param == "messages[0].content[1].image_url.url"
    assert f"{DEFAULTS.max_frames + 44} frames" in str(e.value) and "service.max_image_frames" in str(e.value)
    few = prepare(animated_gif(10), SPEC, DEFAULTS, "p")          # the first frame, as before
    first = Image.open(io.BytesIO(animated_gif(1))).convert("RGB").resize((32, 32), Image.Resampling.BICUBIC)
    assert few.pixels == first.tobytes()


@pytest.mark.parametrize("mode", ["1", "L", "P", "I;16", "CMYK"])
def test_opaque_modes_give_the_pixels_the_alpha_path_gave(mode) -> None:
    """Converting straight to RGB is the composite onto white of an opaque image: the content hash
    of every image without alpha is what it was (no pipeline version bump)."""
    rng = np.random.default_rng(3)
    if mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65535, (37, 53), dtype=np.uint16))
    else:
        img = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
        img = img.convert(mode) if mode != "P" else img.convert("P", palette=Image.Palette.ADAPTIVE)
    rgba = img.convert("RGBA")
    before = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    b = io.BytesIO()
    img.save(b, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    got = prepare(b.getvalue(), SPEC, DEFAULTS, "p")
    decoded = Image.open(io.BytesIO(b.getvalue()))
    rgba = decoded.convert("RGBA")
    want = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    assert got.pixels == want.resize((32, 32), Image.Resampling.BICUBIC).tobytes()
    assert before.size == img.size
