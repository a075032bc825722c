"""bench.worker's offload write ratio: each side compared with the other's writes in the same
place of a pair, and the lower of the two places reported."""

from __future__ import annotations

import torch

from bench.worker import MIN_WRITE_PAIRS, _write_ratio
from shared.hashing import checksum
from shared.ids import ROOT_HASH
from worker.cache.planner import BlockMeta


def test_the_write_ratio_compares_writes_in_the_same_place_of_a_pair(tmp_path) -> None:
    hashes = [f"{i + 1:032x}" for i in range(8)]
    items = []
    for i, h in enumerate(hashes):
        data = torch.full((4096,), i, dtype=torch.uint8)
        items.append((i, BlockMeta(namespace="0" * 32, tenant="default", block_hash=h,
                                   parent_hash=hashes[i - 1] if i else ROOT_HASH, token_start=16 * i,
                                   token_end=16 * (i + 1), form="compressed", spec_digest="d" * 32,
                                   checksum=checksum(memoryview(data.numpy()))), data))
    out = _write_ratio(items, tmp_path, reps=0)
    assert out["offload_write_pairs"] == MIN_WRITE_PAIRS and MIN_WRITE_PAIRS % 2 == 0   # as many of each order
    assert out["offload_write_ratio_first"] > 0 and out["offload_write_ratio_second"] > 0
    assert out["offload_write_ratio_vs_raw"] == min(out["offload_write_ratio_first"], out["offload_write_ratio_second"])
    lo, hi = out["offload_write_ratio_spread"]
    assert 0 < lo <= hi
    assert not any(tmp_path.iterdir())            # every pair's directory is removed
