"""The drill harness's file-system faults leave the machine's own disk alone.

A soak (seed 20) ran the read-only drill before the full-disk one: the read-only drill had made
the offload directory (a tmpfs of its own) immutable with ``chattr +i``, and undoing it unmounted
"whatever is mounted there", the tmpfs itself; the full-disk drill then filled the machine's disk,
and PostgreSQL with it."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.faults.harness import fill_fs, make_read_only, make_writable, mount_small_fs

SMALL = 8 * 2**20


def test_fill_fs_refuses_a_file_system_larger_than_the_drills_own(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="refusing to fill"):
        fill_fs(tmp_path, SMALL)
    assert not (tmp_path / "filler").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_read_only_and_back_keeps_the_small_file_system_mounted(tmp_path) -> None:
    root = tmp_path / "offload"
    what, why = mount_small_fs(root, SMALL)
    if not what:
        pytest.skip(why)
    try:
        (root / "a").write_bytes(b"x")
        how = make_read_only(root)
        with pytest.raises(OSError):
            (root / "b").write_bytes(b"x")
        make_writable(root)
        assert os.path.ismount(root), f"undoing {how!r} unmounted the tmpfs"
        (root / "b").write_bytes(b"x")
        filler, size = fill_fs(root, SMALL)
        assert size <= SMALL
        filler.unlink()
    finally:
        make_writable(root)
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
