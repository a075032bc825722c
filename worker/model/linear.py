"""``nn.Linear`` whose rows are batch-invariant (see :mod:`kernels.invariant`), and products over
one input fused.

Same parameters and state-dict names as ``torch.nn.Linear``; only the product differs: a
row's bits do not depend on how many rows share the call, so one request's tokens give the
same logits alone, in a prefill unit, or fused with other requests.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.invariant import compiled_serves, linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Fused:
    """Several :class:`Linear` of one input (an attention's q, k, v; an MLP's gate and up) as one
    product where the compiled kernel serves it: it reduces each output element by one code
    whatever the weight's row count, so the bits are the parts' own, while the input is read once
    and one call replaces several (a decode step runs ~100 fewer products on SmolLM2). Elsewhere
    (MKL's padded path, CUDA) the parts run alone, as before.

    The parts' weights become views of the concatenated one, so it costs no memory; a part whose
    weight was replaced or changed in place (``.to()``, a load) is noticed by its pointer and
    version, and the concatenation is made again."""

    def __init__(self, *parts: Linear) -> None:
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        # NOTE: all with a bias or none: a zero bias added to a part without one would turn its -0.0 into +0.0
        self.fusable = len({p.bias is None for p in parts}) == 1
        self._key: tuple | None = None
        self._w: torch.Tensor | None = None
        self._b: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | list[torch.Tensor]:
        joined = self.joined(x)
        if joined is None:
            return [p(x) for p in self.parts]
        # NOTE: views into one product's rows (strided): elementwise ops give the same bits on them;
        # a caller that reduces over one (a q/k norm) makes it contiguous first
        return linear(x, *joined).split_with_sizes(self.sizes, -1)

    def joined(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The concatenated weight and bias, current, where the compiled product serves ``x``; else None."""
        if not (self.fusable and compiled_serves(x, self.parts[0].weight)):
            return None
        if self._key != self._state():
            self._join()
        return self._w, self._b

    def _state(self) -> tuple:
        return tuple((t.data_ptr(), t._version, t.dtype, t.device)
                     for p in self.parts for t in (p.weight, p.bias) if t is not None)

    @torch.no_grad()
    def _join(self) -> None:
        w = torch.cat([p.weight.detach() for p in self.parts])
        b = torch.cat([p.bias.detach() for p in self.parts]) if self.parts[0].bias is not None else None
        at = 0
        for p, n in zip(self.parts, self.sizes):
            p.weight.data = w[at:at + n]
            if b is not None:
                p.bias.data = b[at:at + n]
            at += n
        self._w, self._b = w, b
        self._key = self._state()
