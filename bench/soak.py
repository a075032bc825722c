"""RSS soak: does every process's memory level off under mixed traffic with bad inputs? (issue 51)

Starts ``kvledger up --workers 2`` (coordinator, two workers, gateway; embedded PostgreSQL and NATS
in a temporary state_dir) on a tiny Llama checkpoint with kvledger's vision encoder (so images are
decoded, by the gateway and the workers), sends ``--minutes`` of mixed traffic through the gateway
at ``--concurrency``, and samples every process's RSS (``/proc/<pid>/status``, the workers'
grammar-compiler children included) every ``--sample-s`` seconds.

The mix, drawn from a seeded generator: completions and chats (some repeated: cache hits), chats
with an image, structured outputs (a new choice list / regex / JSON schema each time, and some
repeated: the grammar cache), and bad inputs — malformed JSON, over-cap choice lists and schemas,
a grammar that crashes llguidance's compiler, a 1-bit 4096 × 4096 PNG, a GIF of too many frames,
an unknown model.

It reports, per process, RSS at start / middle / end, its maximum, and the least-squares slope
(MB/min) over the first and the last half of the run; a process "levels off" when the last half's
slope is under 1 MB/min or under a quarter of the first half's.

    python -m bench.soak --minutes 5          # what docs/BENCHMARKS.md reports (a shared 2-core machine)
    python -m bench.soak --minutes 5 --model builtin   # grammars compiled (the vision model's tokenizer
                                                       # is one llguidance cannot read)
    python -m bench.soak --minutes 60         # the hour the issue asks about

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import string
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.tiny_stack import CHAT_TEMPLATE, launch_up

IMAGE_TOKEN = "<|image_pad|>"
TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
            "{% endif %}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
            "<|end_header_id|>\n{% endif %}")
assert CHAT_TEMPLATE  # the text-only template the other benches use; this one takes images


def write_checkpoint(directory: Path) -> Path:
    from shared.text.tokenizer import load_tokenizer
    from tests.checkpoints import add_vision, save_hf, save_tokenizer

    d = save_hf("llama", directory, seed=7, vocab_size=256, num_hidden_layers=2)
    save_tokenizer(d, bos="<s>", eos="</s>", template=TEMPLATE, added=(IMAGE_TOKEN,))
    add_vision(d, image_token_id=load_tokenizer(str(d), 256).encode(IMAGE_TOKEN)[0])
    return d


# --- inputs ----------------------------------------------------------------------------------------

def _png(rng: random.Random, side: int = 48) -> bytes:
    from PIL import Image

    img = Image.frombytes("RGB", (side, side), bytes(rng.getrandbits(8) for _ in range(side * side * 3)))
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def _bomb() -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("1", (4096, 4096)).save(b, "PNG", optimize=True)
    return b.getvalue()


def _many_frames(n: int = 400) -> bytes:
    from PIL import Image

    frames = []
    for i in range(n):
        im = Image.new("L", (16, 16), 0)
        im.putpixel((i % 16, i // 16 % 16), 255)
        frames.append(im)
    b = io.BytesIO()
    frames[0].save(b, "GIF", save_all=True, append_images=frames[1:], duration=10)
    return b.getvalue()


def _url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n))


class Mix:
    """The next request: ``(path, body bytes, kind)``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.bomb, self.gif = _url(_bomb()), _url(_many_frames(), "image/gif")
        self.prompts = [_words(self.rng, 40) for _ in range(8)]
        self.choices = [[_words(self.rng, 2) for _ in range(50)] for _ in range(4)]
        from tests.serving.test_loop_stalls import chained_grammar

        self.chained = chained_grammar()

    def next(self) -> tuple[str, bytes, str]:
        r, rng = self.rng.random(), self.rng
        chat = "/v1/chat/completions"

        def body(path: str, doc: dict[str, Any], kind: str) -> tuple[str, bytes, str]:
            return path, json.dumps({"max_tokens": 4, **doc}).encode(), kind

        if r < 0.25:
            prompt = rng.choice(self.prompts) if rng.random() < 0.5 else _words(rng, 40)
            return body("/v1/completions", {"prompt": prompt}, "completion")
        if r < 0.40:
            return body(chat, {"messages": [{"role": "user", "content": _words(rng, 30)}]}, "chat")
        if r < 0.50:
            parts = [{"type": "text", "text": _words(rng, 5)}, {"type": "image_url", "image_url": {"url": _url(_png(rng))}}]
            return body(chat, {"messages": [{"role": "user", "content": parts}]}, "image")
        if r < 0.62:
            so = ({"choice": rng.choice(self.choices)} if rng.random() < 0.5 else
                  {"choice": [_words(rng, 3) for _ in range(rng.randint(10, 2000))]})
            return body("/v1/completions", {"prompt": "pick", "structured_outputs": so}, "choice")
        if r < 0.70:
            so = {"regex": f"[a-z]{{1,{rng.randint(2, 40)}}}-[0-9]{{{rng.randint(1, 9)}}}"}
            return body("/v1/completions", {"prompt": "code", "structured_outputs": so}, "regex")
        if r < 0.78:
            schema = {"type": "object", "properties": {w: {"type": rng.choice(["string", "integer", "boolean"])}
                                                       for w in _words(rng, rng.randint(1, 12)).split()}}
            return body(chat, {"messages": [{"role": "user", "content": "json"}],
                               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                        "json_schema")
        # bad inputs
        bad = rng.randrange(7)
        if bad == 0:
            return "/v1/completions", b'{"prompt": "x", "max_tokens": ', "bad_json"
        if bad == 1:
            return body("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["c"] * 10001}}, "over_choices")
        if bad == 2:
            deep: dict[str, Any] = {"type": "string"}
            for _ in range(40):
                deep = {"type": "object", "properties": {"a": deep}}
            return body("/v1/completions", {"prompt": "x", "structured_outputs": {"json": json.dumps(deep)}}, "deep_schema")
        if bad == 3 and rng.random() < 0.2:          # a child crash costs a respawn: not too often
            return body("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": self.chained}}, "crash_grammar")
        if bad == 4:
            parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": self.bomb}}]
            return body(chat, {"messages": [{"role": "user", "content": parts}]}, "one_bit_bomb")
        if bad == 5:
            parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": self.gif}}]
            return body(chat, {"messages": [{"role": "user", "content": parts}]}, "many_frames")
        return body("/v1/completions", {"prompt": "x", "model": "nope"}, "unknown_model")


# --- RSS -----------------------------------------------------------------------------------------

def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def processes(stack: dict[str, Any]) -> dict[str, int]:
    procs = {s["name"]: s["pid"] for s in stack["services"] if s.get("pid")}
    for name, pid in list(procs.items()):
        if name.startswith("worker"):
            for i, child in enumerate(sorted(children(pid))):
                procs[f"{name}/grammar-{i}"] = child
    return procs


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares MB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if den == 0 else sum((t - mx) * (v - my) for t, v in points) / den * 60


def summarise(series: dict[str, list[tuple[float, float]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, pts in series.items():
        if len(pts) < 4:
            continue
        mid_t = (pts[0][0] + pts[-1][0]) / 2
        first, last = [p for p in pts if p[0] <= mid_t], [p for p in pts if p[0] >= mid_t]
        s1, s2 = slope(first), slope(last)
        out[name] = {"start_mb": round(pts[0][1], 1), "mid_mb": round(min(pts, key=lambda p: abs(p[0] - mid_t))[1], 1),
                     "end_mb": round(pts[-1][1], 1), "max_mb": round(max(v for _, v in pts), 1),
                     "slope_first_mb_min": round(s1, 2), "slope_last_mb_min": round(s2, 2),
                     "levels_off": s2 < 1.0 or s2 < abs(s1) / 4}
    return out


# --- the run ---------------------------------------------------------------------------------------

async def drive(url: str, stack: dict[str, Any], minutes: float, concurrency: int, sample_s: float,
                seed: int) -> dict[str, Any]:
    mix = Mix(seed)
    counts: dict[str, dict[int, int]] = {}
    series: dict[str, list[tuple[float, float]]] = {}
    t0 = time.monotonic()
    end = t0 + minutes * 60

    async def sampler() -> None:
        while time.monotonic() < end:
            for name, pid in processes(stack).items():
                v = rss_mb(pid)
                if v is not None:
                    series.setdefault(name, []).append((time.monotonic() - t0, v))
            await asyncio.sleep(sample_s)

    async def client(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            path, raw, kind = mix.next()
            try:
                async with http.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status = 0
            by = counts.setdefault(kind, {})
            by[status] = by.get(status, 0) + 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(sampler(), *(client(http) for _ in range(concurrency)))
    # a grammar child replaced after a crash is a new process: keep series with enough points
    return {"minutes": minutes, "concurrency": concurrency, "requests": counts, "rss": summarise(series)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import shutil
    import signal
    import subprocess
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--model", choices=("vision", "builtin"), default="vision",
                    help="vision: a tiny Llama with a vision encoder (images decoded; its tokenizer's decoder is one "
                         "llguidance cannot read, so structured outputs are 400s); builtin: the byte-level model "
                         "(grammars compiled; images refused as unsupported)")
    args = ap.parse_args(argv)
    d = Path(tempfile.mkdtemp(prefix="kvl-soak-"))
    worker = "  pool_bytes: 33554432\n"
    if args.model == "vision":
        worker = f"  model_dir: {write_checkpoint(d / 'model')}\n" + worker
    (d / "kvledger.yaml").write_text(f"state_dir: state\nworker:\n{worker}")
    up, stack = launch_up(d, 2)
    try:
        out = asyncio.run(drive(stack["gateway_url"], stack, args.minutes, args.concurrency, args.sample_s, args.seed))
        out["model"] = args.model
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        shutil.rmtree(d, ignore_errors=True)
    for name, s in sorted(out["rss"].items()):
        print(f"{name:24s} {s['start_mb']:7.1f} → {s['mid_mb']:7.1f} → {s['end_mb']:7.1f} MB (max {s['max_mb']:.1f}); "
              f"slope {s['slope_first_mb_min']:+.2f} then {s['slope_last_mb_min']:+.2f} MB/min; "
              f"{'levels off' if s['levels_off'] else 'STILL GROWING'}", file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
