"""`kvledger model manifest|verify DIR` as an operator runs them: the installed entry point in a
subprocess, exit codes, and one readable line on stderr for every failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.manifest import MANIFEST_NAME, checkpoint_digest
from tests.e2e.coordinator_processes import REPO, clean_env

SCRIPT = Path(sys.executable).with_name("kvledger")  # the console script `pip install` made
KVLEDGER = [str(SCRIPT)] if SCRIPT.exists() else [
    sys.executable, "-c", "import sys; from kvledger.cli import main; sys.exit(main())"]


def kvledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVLEDGER, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "deepseek_v4"}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (d / "tokenizer.json").write_text("{}")
    return d


def test_manifest_then_verify_then_a_corrupted_shard(ckpt: Path) -> None:
    expected = checkpoint_digest(ckpt, require_manifest=False)
    made = kvledger("model", "manifest", str(ckpt))
    assert made.returncode == 0, made.stderr
    assert made.stdout.splitlines() == [f"wrote {ckpt / MANIFEST_NAME}: 3 files, 1.0 MiB (1,048,607 bytes)",
                                        f"checkpoint digest: {expected}"]
    assert set(json.loads((ckpt / MANIFEST_NAME).read_text())["files"]) == {
        "config.json", "model.safetensors", "tokenizer.json"}

    ok = kvledger("model", "verify", str(ckpt))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [f"{ckpt}: 3 files match the manifest", f"checkpoint digest: {expected}"]

    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[12345] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    bad = kvledger("model", "verify", str(ckpt))
    assert bad.returncode == 1 and bad.stdout == ""
    (line,) = bad.stderr.splitlines()
    assert line.startswith(f"kvledger model verify: checkpoint {ckpt} does not match its {MANIFEST_NAME}: "
                           "model.safetensors: sha256 ")
    assert "Traceback" not in bad.stderr


def test_verify_without_a_manifest_says_how_to_make_one(ckpt: Path) -> None:
    r = kvledger("model", "verify", str(ckpt))
    assert r.returncode == 1
    assert r.stderr.splitlines() == [(f"kvledger model verify: {ckpt} has no {MANIFEST_NAME}; "
                                      f"create one with `kvledger model manifest {ckpt}`")]


def test_no_such_directory_and_no_subcommand(tmp_path: Path) -> None:
    for command in ("manifest", "verify"):
        r = kvledger("model", command, str(tmp_path / "nope"))
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.splitlines() == [(f"kvledger model {command}: {tmp_path / 'nope'} does not exist "
                                          "(give the checkpoint directory, as worker.model_dir)")]
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in kvledger("model", "verify", str(tmp_path / "file")).stderr
    usage = kvledger("model")
    assert usage.returncode == 2 and "manifest" in usage.stdout and "verify" in usage.stdout
    missing_dir = kvledger("model", "verify")
    assert missing_dir.returncode == 2 and "the following arguments are required: DIR" in missing_dir.stderr


@pytest.mark.parametrize("family", ["yoco", "deepseek_v4"])
def test_model_init_writes_weights_another_user_can_read(tmp_path: Path, family: str) -> None:
    """The weights get the other files' mode: safetensors writes them 0600, and a worker running as
    another user (the images' `kvledger`) could not read them (found by deploy/smoke.sh)."""
    d = tmp_path / family
    r = kvledger("model", "init", str(d), "--family", family)
    assert r.returncode == 0, r.stderr
    weights = d / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == (d / "config.json").stat().st_mode & 0o777
    assert weights.stat().st_mode & 0o004   # readable by others (the default umask, 022)
