"""The token compressor of CSA and HCA layers (research note §2).

Per token ``j`` the compressor projects ``c_j = W_kv x_j`` and a score ``z_j = W_z x_j +
B[j mod m]``. When a window of ``m`` tokens closes (``(j + 1) % m == 0``) it emits one entry:
a per-channel softmax over the window's slots pools the rows, then RMSNorm, then RoPE at
the window's first position (compress table).

* HCA (``overlap=False``): ``m`` slots, the window's own rows.
* CSA (``overlap=True``): rows are ``2 * width`` wide, ``[a | b]``. Entry ``w`` pools the
  a-halves of window ``w - 1`` and the b-halves of window ``w`` (``2m`` slots); for ``w = 0``
  the a-slots are the (0, −inf) sentinel and weigh nothing.

Rows live in a ring addressed by ``position % R`` (``R = 2m`` CSA, ``m`` HCA) between
forwards. A forward over ``[s, e)`` reads the ring rows of ``[s - R, s)`` before its own,
gathers each closing window's slots from that contiguous stretch, emits entries through
:func:`kernels.compressor.compress_entries`, and then saves its last rows into the ring
with :func:`kernels.compressor.save_state`. So any chunking emits the same entries.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.compressor import compress_entries, save_state
from worker.model.linear import Linear
from worker.model.norms import RMSNorm
from worker.model.rope import RopeTables
from worker.model.state import CompressorSlot, Span


class Compressor(nn.Module):
    """One compressor's weights; parameter names follow the HF checkpoint."""

    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        coff = 2 if overlap else 1
        self.width, self.ratio, self.overlap, self.eps = width, ratio, overlap, eps
        self.kv_proj = Linear(hidden, coff * width, bias=False)
        self.gate_proj = Linear(hidden, coff * width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, coff * width))
        self.kv_norm = RMSNorm(width, eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``x`` ``[N, hidden]`` (any requests' tokens, at ``positions``) → (kv, score), each
        ``[N, coff * width]``: the part of the compressor that runs on a whole batch at once."""
        return self.kv_proj(x), self.gate_proj(x) + self.position_bias[positions % self.ratio]

    def absorb(self, kv: torch.Tensor, score: torch.Tensor, span: Span, slot: CompressorSlot,
               rope: RopeTables, block_size: int) -> int:
        """Take one request's projected rows (positions ``span``), emit every entry whose window
        closes in the span, capture the CSA halo at every block boundary in ``(s, e]``, and
        save the rows for the next forward. Returns the entry count after the span."""
        m, R = self.ratio, slot.ring_kv.shape[0]
        s, e = span.start, span.end
        if e - s == 1 and e % m and e % block_size:
            # One token that closes no window and no block (most decode steps): only the ring
            # changes. The same values the general path stores, without gathering the ring.
            slot.ring_kv[s % R] = kv[0]
            slot.ring_score[s % R] = score[0]
            return s // m
        # Rows of positions [s - R, e): the ring's (in position order), then this span's.
        # NOTE: the ring is read here, before save_state below overwrites it with this
        # span's rows; a span of R or more tokens would otherwise lose the rows it needs.
        ring_pos = torch.arange(s - R, s, device=kv.device) % R
        ext_kv = torch.cat([slot.ring_kv[ring_pos], kv], 0)
        ext_score = torch.cat([slot.ring_score[ring_pos], score], 0)
        base = s - R                                               # position of ext row 0
        keep = min(span.length, R)                                 # ring rows this span replaces
        if self.overlap and slot.halo_layout is not None:
            # NOTE: a resume at a block boundary b starts from the stored halo — the a-halves of
            # rows [b - m, b) in the storage precision — so a run that crosses b must use those
            # rounded values too, for the window after b (here and, through the ring, in later
            # forwards): then cold and resumed runs read the same numbers (worker.model.storage).
            w = self.width
            for b in range((s // block_size + 1) * block_size, e + 1, block_size):
                rows = slice(b - m - base, b - base)
                ext_kv[rows, :w] = slot.halo_layout.round(ext_kv[rows, :w])
                ext_score[rows, :w] = slot.halo_layout.round(ext_score[rows, :w])
                keep = R                                           # rounded rows may lie in the ring
        w_lo, w_hi = s // m, e // m                                # windows closing in [s, e)
        if w_hi > w_lo:
            wins = torch.arange(w_lo, w_hi, device=kv.device)
            cur = (wins * m).unsqueeze(1) + torch.arange(m, device=kv.device) - base   # [n, m]
            if self.overlap:
                d = self.width
                prev = cur - m
                slots_kv = torch.cat([ext_kv[prev][..., :d], ext_kv[cur][..., d:]], 1)
                slots_score = torch.cat([ext_score[prev][..., :d], ext_score[cur][..., d:]], 1)
            else:
                slots_kv, slots_score = ext_kv[cur], ext_score[cur]
            cos, sin = rope.at("compress", wins * m)
            entries = compress_entries(slots_kv, slots_score, self.kv_norm.weight, self.eps, cos, sin)
            slot.write_entries(w_lo, entries)
        if self.overlap:
            first_boundary = (s // block_size + 1) * block_size
            for b in range(first_boundary, e + 1, block_size):
                rows = slice(b - m - base, b - base)
                slot.capture_halo(b // block_size - 1, ext_kv[rows, :self.width], ext_score[rows, :self.width])
        # ext's last rows are positions [e - keep, e), with any boundary rounding above
        save_state(slot.ring_kv, slot.ring_score, ext_kv[-keep:], ext_score[-keep:],
                   torch.arange(e - keep, e, device=kv.device))
        return w_hi
