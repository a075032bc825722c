"""The interpreter switch set by this directory's conftest must not reach other test directories."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kernel_testing import cpu_only

PROBE = """
import os
def test_env():
    assert os.environ.get("TRITON_INTERPRET") == {expected!r}
"""


@cpu_only
def test_other_directories_do_not_see_the_interpreter(tmp_path: Path):
    """A pytest run over e2e/ (runs before kernels/), kernels/ and unit/ (runs after):
    only the kernels test sees TRITON_INTERPRET=1."""
    tests = tmp_path / "tests"
    for name, expected in (("e2e", None), ("kernels", "1"), ("unit", None)):
        (tests / name).mkdir(parents=True)
        (tests / name / f"test_probe_{name}.py").write_text(PROBE.format(expected=expected))
    shutil.copy(Path(__file__).with_name("conftest.py"), tests / "kernels" / "conftest.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # a bare pytest starts faster
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tests)],
        cwd=tmp_path, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout
