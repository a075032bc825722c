"""``nn.Linear`` whose rows are batch-invariant (see :mod:`kernels.invariant`).

Same parameters and state-dict names as ``torch.nn.Linear``; only the product differs: a
row's bits do not depend on how many rows share the call, so one request's tokens give the
same logits alone, in a prefill unit, or fused with other requests.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.invariant import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
