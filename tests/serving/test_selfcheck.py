"""The start-up self-check: the offload directory is probed (write, fsync, read back, delete)
before the worker serves; a directory that fails marks the disk tier down with the reason at
once, the worker stays ready (it serves without the tier), and /readyz shows the report."""

from __future__ import annotations

from pathlib import Path

from tests.serving.conftest import MODEL
from worker.selfcheck import check_offload_dir


def test_a_usable_directory_passes_and_keeps_nothing(tmp_path: Path) -> None:
    root = tmp_path / "offload" / "deep"
    assert check_offload_dir(root, "w1") == ""
    assert root.is_dir() and list(root.iterdir()) == [] and root.stat().st_mode & 0o777 == 0o700


def test_an_unusable_directory_says_which_step_failed(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    failure = check_offload_dir(blocker / "offload", "w1")
    assert failure.startswith("cannot create the directory") and "ENOTDIR" in failure, failure


async def test_readyz_reports_the_self_check_and_a_bad_offload_dir_only_degrades_the_tier(serve, tmp_path) -> None:
    async with serve(**{"cache.offload_dir": str(tmp_path / "off")}) as s:
        status, body = await s.get("/readyz")
        assert status == 200 and body["self_check"]["offload"] == "ok" and body["disk_tier"] == "up"
        assert body["self_check"]["pools_allocated"] and body["self_check"]["namespace"] == s.engine.namespace
        assert body["self_check"]["layer_ops"].startswith(("compiled, ", "reference: "))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    async with serve(**{"cache.offload_dir": str(blocker / "off")}) as s:
        status, body = await s.get("/readyz")
        assert status == 200 and body["status"] == "ready", body
        assert body["self_check"]["offload"].startswith("failed: cannot create the directory")
        assert body["disk_tier"] == "down" and "ENOTDIR" in body["disk_tier_reason"]
        r = await s.client().completions.create(model=MODEL, prompt="still served", max_tokens=2)
        assert r.usage.completion_tokens == 2
