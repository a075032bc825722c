"""The per-tensor generator every family's seeded initialisation draws from.

Each tensor gets its own generator seeded by blake2b(seed, name), so a tensor's values do not
depend on which other tensors exist or in what order they are filled. Its own module because
the DeepSeek-V4 initialiser (:mod:`worker.model.weights`) and the dense/YOCO one
(:func:`worker.model.dense.model.seed_weights`) share it and neither may import the other.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and the tensor's checkpoint ``name``."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
