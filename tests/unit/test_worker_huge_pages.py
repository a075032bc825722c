"""``python -m worker`` asks torch for 2 MiB pages for its large tensors (``worker/__main__.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# the worker's entry point up to its main(), then a weight-sized tensor's address
PROBE = """
import os, runpy, sys
sys.argv = ['worker', '--help']
try:
    runpy.run_module('worker', run_name='__main__')
except SystemExit:
    pass
import torch
t = torch.ones(64 << 20, dtype=torch.uint8)     # a weight-sized tensor, every page touched
huge = [int(line.split()[1]) for line in open('/proc/self/smaps_rollup') if line.startswith('AnonHugePages:')]
print(os.environ.get('THP_MEM_ALLOC_ENABLE'), huge[0] if huge else -1)
"""
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _probe(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.split()[-2:]


@pytest.mark.skipif(not os.path.exists(THP) or "[never]" in open(THP).read(),
                    reason="this kernel gives no process transparent huge pages")
def test_the_worker_holds_large_tensors_in_huge_pages() -> None:
    setting, kib = _probe()
    assert setting == "1" and int(kib) >= 32 << 10, kib     # most of the 64 MiB in 2 MiB pages


def test_an_operator_can_keep_4_kib_pages() -> None:
    setting, _ = _probe(THP_MEM_ALLOC_ENABLE="0")
    assert setting == "0"
