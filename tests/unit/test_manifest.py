"""The checkpoint manifest (shared.manifest): written, verified, and every way a checkpoint
directory can differ from it — changed bytes, changed size, a file missing, a file added, an
ill-formed manifest — is refused with a message naming the file or the field."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from shared.manifest import (
    MANIFEST_NAME,
    FileEntry,
    ManifestError,
    checkpoint_digest,
    digest_of,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from shared import manifest as mf

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
CHECKPOINT_FILES = {"config.json", SHARD_1, SHARD_2, "model.safetensors.index.json", "tokenizer.json",
                    "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "extra/notes.txt"}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A directory laid out as save_pretrained writes a sharded checkpoint, plus hidden clutter."""
    d = tmp_path / "ckpt"
    d.mkdir()
    rng = np.random.default_rng(0)
    save_file({"model.embed_tokens.weight": rng.standard_normal((64, 16), dtype=np.float32)}, str(d / SHARD_1))
    save_file({"lm_head.weight": rng.standard_normal((64, 16), dtype=np.float32)}, str(d / SHARD_2))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": SHARD_1, "lm_head.weight": SHARD_2}}))
    (d / "config.json").write_text('{"model_type": "deepseek_v4", "dtype": "bfloat16"}')
    (d / "tokenizer.json").write_text('{"model": {}}')
    (d / "tokenizer_config.json").write_text("{}")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "generation_config.json").write_text("{}")
    (d / "extra").mkdir()
    (d / "extra" / "notes.txt").write_text("nested files count too")
    (d / ".gitattributes").write_text("*.safetensors filter=lfs")  # hidden: not part of the checkpoint
    (d / ".cache" / "huggingface").mkdir(parents=True)
    (d / ".cache" / "huggingface" / "download.lock").write_text("")
    return d


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _flip_byte(p: Path, at: int) -> None:
    data = bytearray(p.read_bytes())
    data[at] ^= 0x01
    p.write_bytes(bytes(data))


def _refused(ckpt: Path) -> str:
    with pytest.raises(ManifestError) as e:
        verify_manifest(ckpt)
    return str(e.value)


def test_write_then_verify(ckpt: Path) -> None:
    calls: list[tuple[int, int]] = []
    path = write_manifest(ckpt, progress=lambda done, total: calls.append((done, total)))
    assert path == ckpt / MANIFEST_NAME
    doc = json.loads(path.read_text())
    assert doc["version"] == 1
    assert set(doc["files"]) == CHECKPOINT_FILES  # no hidden files, not the manifest itself
    for name, entry in doc["files"].items():
        assert entry == {"sha256": _sha(ckpt / name), "bytes": (ckpt / name).stat().st_size}, name
    total = sum((ckpt / n).stat().st_size for n in CHECKPOINT_FILES)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert not list(ckpt.glob(".*.tmp"))

    digest = verify_manifest(ckpt)
    assert len(digest) == 64 and digest == read_manifest(ckpt).digest
    # The digest is the sha256 of the `sha256sum` listing, sorted by name.
    listing = "".join(f"{_sha(ckpt / n)}  {n}\n" for n in sorted(CHECKPOINT_FILES))
    assert digest == hashlib.sha256(listing.encode()).hexdigest()
    # Writing it again over an unchanged checkpoint changes nothing.
    before = path.read_bytes()
    write_manifest(ckpt)
    assert path.read_bytes() == before


def test_a_flipped_byte_in_a_shard_is_named(ckpt: Path) -> None:
    write_manifest(ckpt)
    old = _sha(ckpt / SHARD_2)
    _flip_byte(ckpt / SHARD_2, at=(ckpt / SHARD_2).stat().st_size // 2)
    msg = _refused(ckpt)
    assert f"{SHARD_2}: sha256 {_sha(ckpt / SHARD_2)}, the manifest says {old}" in msg
    assert SHARD_1 not in msg and "kvledger model manifest" in msg


def test_a_changed_size_is_named_before_anything_is_hashed(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_manifest(ckpt)
    size = (ckpt / SHARD_1).stat().st_size
    with open(ckpt / SHARD_1, "ab") as f:
        f.write(b"\0")
    monkeypatch.setattr(mf, "_hash_files", lambda *a: pytest.fail("hashed although the sizes differ"))
    assert f"{SHARD_1}: {size + 1} bytes, the manifest says {size}" in _refused(ckpt)


def test_a_missing_file_is_named(ckpt: Path) -> None:
    write_manifest(ckpt)
    (ckpt / "tokenizer.json").unlink()
    assert "tokenizer.json: listed in the manifest but missing" in _refused(ckpt)


def test_an_added_file_is_named_but_hidden_ones_are_not_part_of_the_checkpoint(ckpt: Path) -> None:
    write_manifest(ckpt)
    (ckpt / ".DS_Store").write_bytes(b"junk")
    (ckpt / ".cache" / "more").write_bytes(b"junk")
    verify_manifest(ckpt)
    (ckpt / "model-00003-of-00003.safetensors").write_bytes(b"late shard")
    assert "model-00003-of-00003.safetensors: present but not in the manifest" in _refused(ckpt)


def test_every_problem_is_named_at_once(ckpt: Path) -> None:
    write_manifest(ckpt)
    (ckpt / "config.json").unlink()
    (ckpt / "new.bin").write_bytes(b"x")
    (ckpt / "tokenizer.json").write_text('{"model": {"changed": 1}}')
    msg = _refused(ckpt)
    assert "config.json: listed" in msg and "new.bin: present" in msg and "tokenizer.json: " in msg


def test_files_larger_than_a_chunk(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = checkpoint_digest(ckpt, require_manifest=False)
    monkeypatch.setattr(mf, "CHUNK_BYTES", 7)  # odd, so every file ends on a partial chunk
    write_manifest(ckpt)
    for name, entry in read_manifest(ckpt).files.items():
        assert entry == FileEntry(_sha(ckpt / name), (ckpt / name).stat().st_size)
    assert verify_manifest(ckpt) == digest
    _flip_byte(ckpt / SHARD_1, at=(ckpt / SHARD_1).stat().st_size - 1)  # the last partial chunk
    assert f"{SHARD_1}: sha256" in _refused(ckpt)


def test_the_digest_is_the_same_with_and_without_a_manifest(ckpt: Path) -> None:
    without = checkpoint_digest(ckpt, require_manifest=False)
    write_manifest(ckpt)
    assert checkpoint_digest(ckpt, require_manifest=False) == without
    assert checkpoint_digest(ckpt, require_manifest=True) == without == verify_manifest(ckpt)
    # Without a manifest the digest still follows the bytes.
    (ckpt / MANIFEST_NAME).unlink()
    _flip_byte(ckpt / SHARD_1, at=100)
    assert checkpoint_digest(ckpt, require_manifest=False) != without


def test_with_a_manifest_checkpoint_digest_verifies(ckpt: Path) -> None:
    write_manifest(ckpt)
    _flip_byte(ckpt / SHARD_1, at=100)
    with pytest.raises(ManifestError, match=SHARD_1):
        checkpoint_digest(ckpt, require_manifest=False)


def test_require_manifest(ckpt: Path) -> None:
    with pytest.raises(ManifestError) as e:
        checkpoint_digest(ckpt, require_manifest=True)
    assert str(e.value) == (f"{ckpt} has no {MANIFEST_NAME} and a manifest is required (worker.require_manifest); "
                            f"create one with `kvledger model manifest {ckpt}`")
    with pytest.raises(ManifestError, match=f"has no {MANIFEST_NAME}; create one with `kvledger model manifest"):
        verify_manifest(ckpt)


GOOD = {"sha256": "a" * 64, "bytes": 3}


@pytest.mark.parametrize(("manifest", "message"), [
    ("{not json", "not valid UTF-8 JSON (Expecting property name"),
    (b"\xff\xfe\xfa", "not valid UTF-8 JSON ('utf-8' codec can't decode"),
    ([], "the top level must be a JSON object"),
    ({"files": {"a": GOOD}}, "field `version` is missing"),
    ({"version": 2, "files": {"a": GOOD}}, "field `version` is 2; this kvledger reads version 1"),
    ({"version": "1", "files": {"a": GOOD}}, "field `version` must be an integer, not '1'"),
    ({"version": True, "files": {"a": GOOD}}, "field `version` must be an integer"),
    ({"version": 1}, "field `files` is missing"),
    ({"version": 1, "files": {}}, "field `files` must be a non-empty object"),
    ({"version": 1, "files": [GOOD]}, "field `files` must be a non-empty object"),
    ({"version": 1, "files": {"a": "0" * 64}}, 'field `files["a"]` must be an object'),
    ({"version": 1, "files": {"a": {"bytes": 3}}}, 'field `files["a"].sha256` is missing'),
    ({"version": 1, "files": {"a": {**GOOD, "sha256": "A" * 64}}}, 'field `files["a"].sha256` must be 64 lowercase'),
    ({"version": 1, "files": {"a": {**GOOD, "sha256": "ab"}}}, 'field `files["a"].sha256` must be 64 lowercase'),
    ({"version": 1, "files": {"a": {"sha256": "a" * 64}}}, 'field `files["a"].bytes` is missing'),
    ({"version": 1, "files": {"a": {**GOOD, "bytes": -1}}}, 'field `files["a"].bytes` must be a non-negative'),
    ({"version": 1, "files": {"a": {**GOOD, "bytes": 3.0}}}, 'field `files["a"].bytes` must be a non-negative'),
    ({"version": 1, "files": {"a": {**GOOD, "bytes": True}}}, 'field `files["a"].bytes` must be a non-negative'),
    ({"version": 1, "files": {"../a": GOOD}}, 'field `files["../a"]`: not a relative path inside the checkpoint'),
    ({"version": 1, "files": {"/etc/a": GOOD}}, "not a relative path inside the checkpoint"),
    ({"version": 1, "files": {"a//b": GOOD}}, "not a relative path inside the checkpoint"),
    ({"version": 1, "files": {".git/a": GOOD}}, 'field `files[".git/a"]`: a hidden file'),
    ({"version": 1, "files": {MANIFEST_NAME: GOOD}}, "the manifest cannot list itself"),
])
def test_an_ill_formed_manifest_names_the_field(ckpt: Path, manifest: object, message: str) -> None:
    path = ckpt / MANIFEST_NAME
    if isinstance(manifest, bytes):
        path.write_bytes(manifest)
    else:
        path.write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    for check in (verify_manifest, read_manifest, lambda d: checkpoint_digest(d, require_manifest=False)):
        with pytest.raises(ManifestError) as e:
            check(ckpt)
        assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)
        assert str(e.value).endswith(f"write it again with `kvledger model manifest {ckpt}`")


def test_not_a_directory(tmp_path: Path) -> None:
    for call in (write_manifest, verify_manifest, lambda d: checkpoint_digest(d, require_manifest=False)):
        with pytest.raises(ManifestError, match=f"checkpoint directory {tmp_path / 'nope'} does not exist"):
            call(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ManifestError, match="is not a directory"):
        write_manifest(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden").write_text("x")
    with pytest.raises(ManifestError, match="has no files"):
        checkpoint_digest(tmp_path / "empty", require_manifest=False)


def test_links_are_followed_as_in_a_hugging_face_snapshot(ckpt: Path, tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc123").write_bytes(b"weights behind a link")
    (ckpt / "linked.safetensors").symlink_to(blobs / "abc123")
    (ckpt / "extra" / "loop").symlink_to(ckpt, target_is_directory=True)  # must not walk forever
    (ckpt / "dangling.json").symlink_to(tmp_path / "gone")  # no file: not part of the checkpoint
    write_manifest(ckpt)
    files = read_manifest(ckpt).files
    assert files["linked.safetensors"] == FileEntry(_sha(blobs / "abc123"), 21)
    assert "dangling.json" not in files and not any(n.startswith("extra/loop") for n in files)
    (blobs / "abc123").write_bytes(b"weights behind a lin!")
    assert "linked.safetensors: sha256" in _refused(ckpt)


def test_a_manifest_that_cannot_be_written(ckpt: Path) -> None:
    (ckpt / f".{MANIFEST_NAME}.tmp").mkdir()  # where it is written first (works as root too)
    with pytest.raises(ManifestError, match=f"cannot write {ckpt / MANIFEST_NAME}: Is a directory"):
        write_manifest(ckpt)
    assert not (ckpt / MANIFEST_NAME).exists()


def test_an_unreadable_file_is_named(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_manifest(ckpt)

    def denying_open(path: object, *args: object, **kwargs: object) -> object:
        if Path(str(path)).name == SHARD_1:  # chmod 0 would not stop root
            raise PermissionError(13, "Permission denied", str(path))
        return open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(mf, "open", denying_open, raising=False)
    assert f"{SHARD_1}: cannot read {ckpt / SHARD_1}: Permission denied" in _refused(ckpt)


def test_digest_of_orders_by_name() -> None:
    a, b = FileEntry("1" * 64, 1), FileEntry("2" * 64, 2)
    assert digest_of({"a": a, "b": b}) == digest_of({"b": b, "a": a}) != digest_of({"a": b, "b": a})
