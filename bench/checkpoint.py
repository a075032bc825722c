"""Checkpoint benchmark: what loading a ``save_pretrained`` directory costs at start.

Writes a Llama-shaped checkpoint of random weights with transformers' own ``save_pretrained``
(sharded, bfloat16, ~``--mib`` MiB; transformers is a test dependency) and its manifest, then,
each ``--reps`` times and interleaved: a raw read of every file (the floor: the bytes must be
read once anyway), the checkpoint digest (sha256 per file against the manifest), and the
whole ``load_checkpoint`` (config, digest, weights into the model). Ratios are against the raw
read of the same run.

    python -m bench.checkpoint            # ~512 MiB, 3 reps
    python -m bench.checkpoint --quick    # ~128 MiB, 2 reps

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _raw_read(d: Path) -> int:
    n = 0
    for f in sorted(d.iterdir()):
        with open(f, "rb") as h:
            while chunk := h.read(8 << 20):
                n += len(chunk)
    return n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller checkpoint, fewer repetitions")
    ap.add_argument("--mib", type=int, default=None, help="checkpoint size in MiB (default 512; quick 128)")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    mib = args.mib or (128 if args.quick else 512)
    reps = args.reps or (2 if args.quick else 3)

    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.manifest import checkpoint_digest, write_manifest
    from worker.model.checkpoint import load_checkpoint

    hidden, inter = 1024, 2816
    per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 2          # bf16 bytes
    layers = max(1, round(mib * 2**20 / per_layer))
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    with tempfile.TemporaryDirectory(prefix="kvl-bench-ckpt-") as tmp:
        d = Path(tmp) / "llama"
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d, max_shard_size="128MB")
        write_manifest(d)
        nbytes = sum(f.stat().st_size for f in d.iterdir())
        files = len(list(d.iterdir()))
        raw, digest, load = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            _raw_read(d)
            raw.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            checkpoint_digest(d, require_manifest=True)
            digest.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loaded = load_checkpoint(d, require_manifest=True)
            load.append(time.perf_counter() - t0)
            del loaded
    r, g, ld = statistics.median(raw), statistics.median(digest), statistics.median(load)
    result = {
        "checkpoint_bytes": nbytes,
        "layers": layers,
        "files": files,
        "raw_read_s": round(r, 3),
        "raw_read_gb_s": round(nbytes / r / 1e9, 2),
        "digest_s": round(g, 3),
        "digest_gb_s": round(nbytes / g / 1e9, 2),
        "digest_vs_raw_read": round(g / r, 2),
        "load_s": round(ld, 3),
        "load_vs_raw_read": round(ld / r, 2),
        "reps": reps,
        "mode": "quick" if args.quick else "full",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
