"""The model through the Triton kernels (the CUDA path), run on CPU by Triton's interpreter.

``TRITON_INTERPRET`` must be set before any ``triton_impl`` module is imported, and it is
process-wide, so the check runs in a child process: prefill one block plus a partial one
and decode a step (three layers: sliding, CSA, HCA) with every kernel call forced to Triton, and compare with the reference
path (float32 tolerance: the kernels reduce in another order).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = r"""
import torch
torch.set_num_threads(1)
from kernels.dispatch import force_backend
from worker.model import ModelConfig, build_model
# Three layers cover every kernel use: sliding only, CSA (indexer), HCA (ratio 8, so that
# an 8-token block closes windows of both; the interpreter is slow, so the run is short).
m = build_model(ModelConfig(num_hidden_layers=3, compress_ratios=(0, 4, 8),
                            mlp_layer_types=("hash_moe", "moe", "moe")))
toks = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
def run():
    st = m.new_state(8)
    out = m.prefill(toks[:11], st)          # one block unit, then a partial one
    return torch.cat([out, m.decode_step(int(toks[11]), st)[None]])
ref = run()
with force_backend("triton"):
    tri = run()
print("MAXDIFF", float((ref - tri).abs().max()))
"""


def test_model_runs_on_the_triton_kernels() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KVL_KERNEL_BACKEND", None)
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", CHILD], cwd=root, env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    diff = float(run.stdout.split("MAXDIFF")[-1])
    assert diff < 1e-4
