"""The CUDA check: the kernel tests on a GPU, then bench.kernels and bench.model there.

    make gpu-check            # = python -m bench.gpu_check

Runs, on the first CUDA device: ``pytest tests/kernels tests/model/test_triton_path.py`` (the
Triton kernels against their PyTorch references, compiled for the GPU instead of interpreted),
``python -m bench.kernels`` and ``python -m bench.model --quick --device cuda``. Prints one JSON
line: whether each part passed, the tests' summary line and each benchmark's own JSON. Without a
CUDA device it says so in that line and exits 2 (nothing to check), so a CPU-only machine gets a
clear answer instead of a stack trace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def _run(cmd: list[str], timeout_s: int) -> tuple[int, str]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "KVL_KERNEL_BACKEND": "auto"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s} s"
    return p.returncode, p.stdout + p.stderr


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "error": "no CUDA device: torch.cuda.is_available() is false"}))
        return 2
    out: dict = {"gpu": True, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t0 = time.perf_counter()
    rc, text = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "tests/kernels",
                     "tests/model/test_triton_path.py"], 900)
    out["tests_passed"] = rc == 0
    out["tests_summary"] = text.strip().splitlines()[-1] if text.strip() else ""
    rc, text = _run([sys.executable, "-m", "bench.kernels"], 900)
    out["bench_kernels_ok"], out["bench_kernels"] = rc == 0, _last_json(text)
    rc, text = _run([sys.executable, "-m", "bench.model", "--quick", "--device", "cuda"], 900)
    out["bench_model_ok"], out["bench_model"] = rc == 0, _last_json(text)
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0 if out["tests_passed"] and out["bench_kernels_ok"] and out["bench_model_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
