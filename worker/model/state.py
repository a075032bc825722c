"""Per-request cache state: the only place the model reads or writes cached state.

Theory of operation
-------------------
A request's state is a set of preallocated buffers (static shapes: nothing is reallocated
as the request grows) indexed by absolute token position or entry number:

* ``swa``       ``[layers, capacity, head_dim]`` — every layer's raw K=V row per token;
  attention reads the rows of its window ``[t - W + 1, t]`` from here;
* ``entries``   per CSA/HCA layer ``[capacity // ratio, head_dim]`` — compressed entries;
* ``index_keys`` per CSA layer ``[capacity // ratio, index_head_dim]`` — indexer keys;
* ``rings``     per compressor, ``kv``/``score`` ``[R, coff * width]`` — the compressor's
  recent projected rows, addressed by ``position % R`` (R = 2m for CSA, m for HCA), reset to
  (0, −inf) so rows "before position 0" weigh nothing;
* ``halos``     ``[capacity_blocks, n_csa, 2, m, head_dim + index_head_dim]`` — the CSA
  overlap halo captured at every block's end boundary (the ``tail`` payload).

Block granularity: :meth:`export_block` cuts one block's payload per form out of these
buffers, and :meth:`restore` builds the state at a block boundary ``P`` from cached
payloads. Only the pieces a resume at ``P`` needs are restored (entries and indexer keys
of every block before ``P``, the window rows ``[P - W + 1, P)``, the halo at ``P``); the
rest stay zero and are never read — :meth:`window_rows` asserts that.

``reset`` clears positions and rings, not the history buffers: every read is of a
position or entry this request wrote or restored (window reads assert their lower bound),
so stale rows of an earlier request are never reached.

Exportability: with batch-invariant ops (``worker.model.model``) every completed block is
exportable, whether prefill units or decode steps computed it: a cold prefill of the same
tokens computes the same bits. Without them, only blocks of block-aligned units are (a
block completed by decode steps would hold correct values computed by other operations, and
caching it could make a resumed request differ in bits from a cold one).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.forms import FormSpec, FormSpecMismatch
from worker.model.config import ModelConfig, check_block_size
from worker.model.forms import COMPRESSED, INDEXER, SWA, TAIL, FormLayout, describe_mismatch, form_layouts

MAIN, IDX = "main", "indexer"


class BlockPayload(dict):
    """One block's payloads, ``{form name: tensor}``, plus the spec each was written under.

    A plain ``dict`` subclass so it can be stored as-is; ``specs`` travels with it so a
    reader under a different spec rejects it (:class:`shared.forms.FormSpecMismatch`).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, FormSpec]) -> None:
        super().__init__(tensors)
        self.specs: dict[str, FormSpec] = dict(specs)


def timed(timer: Any, form: str) -> Any:
    """``timer.form(form)`` (a :class:`worker.cache.cost.FormTimer`), or nothing when ``timer`` is None."""
    return contextlib.nullcontext() if timer is None else timer.form(form)


@dataclass(frozen=True, slots=True)
class Span:
    """The positions ``[start, end)`` one forward computes."""

    start: int
    end: int
    positions: torch.Tensor  # int64 [end - start]

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Embeds:
    """Input vectors that replace the token embedding at some rows of one request's span (an
    image's patch vectors, ``worker.model.vision``): ``vectors[k]`` is the input of row ``rows[k]``."""

    rows: torch.Tensor     # int64 [k], offsets from the span's start
    vectors: torch.Tensor  # [k, hidden]


@dataclass(frozen=True, slots=True)
class Segment:
    """One request's part of a batched forward: its state, its span, its rows in the batch, and
    the rows whose input is not a token embedding (``CausalLM._embed``)."""

    state: CacheState
    span: Span
    rows: slice
    embeds: Embeds | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """The rows of one forward: several requests' spans, concatenated in segment order."""

    segments: tuple[Segment, ...]
    positions: torch.Tensor  # int64 [rows], every segment's positions in order
    #: What a family computes once per forward and reads in every layer (e.g. the dense family's
    #: K/V buffers and row bounds for ``kernels.invariant.attention_cached``).
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])


#: Every request state alive in this process (made by a family's constructor or by :meth:`CacheState.fork`),
#: for :func:`live_state_bytes`; a state leaves it when it is collected.
_live: weakref.WeakSet[CacheState] = weakref.WeakSet()


def live_states() -> list[CacheState]:
    """Every request state alive in this process now."""
    for _ in range(3):
        try:
            return list(_live)
        except RuntimeError:   # the set changed while it was copied (a state made or collected on another thread)
            continue
    return []


def live_state_bytes() -> int:
    """Bytes of the buffers every live request state holds (``kvl_worker_state_bytes``)."""
    return sum(s.buffer_bytes for s in live_states())


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, looking into lists, tuples and dicts a few levels down."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)


class CacheState:
    """What every family's per-request state shares: the position, spans and their commit,
    which blocks are exportable, and the spec check of a payload offered to ``restore``.

    A subclass allocates its buffers, sets ``layouts`` (``{form: FormLayout}``) and implements
    ``export_block(i)`` and ``restore(blocks, n_blocks)``; both go through the checks here.
    """

    #: The dtype the state keeps cached rows in (payloads are decoded into it on restore).
    buffer_dtype: torch.dtype = torch.float32

    def _init_positions(self, block_size: int, capacity: int, device: torch.device | str) -> None:
        if capacity <= 0 or capacity % block_size:
            raise ValueError(f"capacity {capacity} must be a positive multiple of block_size {block_size}")
        self.block_size, self.capacity = block_size, capacity
        self.device = torch.device(device)
        _live.add(self)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the storage this state's tensors hold (each storage once, whole: a kept buffer
        longer than the capacity counts in full) — what one request's state costs in memory."""
        seen: dict[int, int] = {}
        for t in _tensors(vars(self)):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def _reset_positions(self) -> None:
        self.pos = 0
        self._export_from = 0      # first block this state may export
        self._exact = torch.zeros(self.capacity // self.block_size, dtype=torch.bool)

    @property
    def completed_blocks(self) -> int:
        return self.pos // self.block_size

    def fork(self) -> CacheState:
        """An independent copy at the same position, for ``n`` > 1 samples of one prefill: each
        sample decodes its own copy of the state the prompt left. Every buffer is copied (the
        config and form layouts are shared, they are immutable), so the copies' steps compute
        the bits the original's would."""
        memo = {id(self.cfg): self.cfg, id(self.layouts): self.layouts}
        recycler = getattr(self, "_recycler", None)
        if recycler is not None:    # shared, never copied (worker.model.recycle)
            memo[id(recycler)] = recycler
        twin = copy.deepcopy(self, memo=memo)
        _live.add(twin)
        return twin

    def span(self, length: int) -> Span:
        """The next ``length`` positions; checks capacity."""
        if length <= 0:
            raise ValueError("a forward needs at least one token")
        end = self.pos + length
        if end > self.capacity:
            raise ValueError(f"request would reach {end} tokens; this state holds {self.capacity} "
                             f"(capacity, at most max_position_embeddings)")
        return Span(self.pos, end, torch.arange(self.pos, end, device=self.device))

    def commit(self, span: Span, *, invariant: bool = True) -> None:
        """Advance past ``span``. With batch-invariant ops every block it completes is exportable
        (a cold prefill computes the same bits, whatever its units); without, only blocks of a
        block-aligned span are."""
        assert span.start == self.pos, "spans must be committed in order"
        bs = self.block_size
        if invariant or (span.start % bs == 0 and span.end % bs == 0):
            self._exact[span.start // bs:span.end // bs] = True
        self.pos = span.end

    def _check_exportable(self, i: int) -> None:
        if not (self._export_from <= i < self.completed_blocks):
            raise ValueError(f"block {i} is not exportable: this state holds computed blocks "
                             f"[{self._export_from}, {self.completed_blocks})")
        if not bool(self._exact[i]):
            raise ValueError(f"block {i} was not computed by a block-aligned unit (decode steps or an "
                             f"unaligned chunk); a cold prefill would compute it differently, so it is "
                             f"not exported")

    def _check_restore(self, blocks: Sequence[Mapping[str, torch.Tensor]], n_blocks: int) -> None:
        if len(blocks) < n_blocks:
            raise ValueError(f"restore: {n_blocks} blocks requested, {len(blocks)} given")
        if n_blocks * self.block_size > self.capacity:
            raise ValueError(f"restore: {n_blocks} blocks exceed this state's capacity of {self.capacity} tokens")

    def _payload(self, blocks: Sequence[Mapping[str, torch.Tensor]], i: int, form: str,
                 specs: Mapping[str, FormSpec] | None) -> torch.Tensor:
        layout = self.layouts[form]
        block = blocks[i]
        if form not in block:
            raise ValueError(f"restore: block {i} lacks form {form!r}, which a resume at block "
                             f"{len(blocks)} needs")
        got_spec = getattr(block, "specs", {}).get(form) or (specs or {}).get(form)
        if got_spec is None:
            raise ValueError(f"restore: block {i} form {form!r} carries no form spec; pass BlockPayload "
                             f"objects or specs=")
        if got_spec.spec_digest != layout.spec.spec_digest:
            raise FormSpecMismatch(form, layout.spec, got_spec.spec_digest, describe_mismatch(layout.spec, got_spec))
        t = block[form]
        if tuple(t.shape) != layout.shape or t.dtype != layout.dtype:
            raise ValueError(f"restore: block {i} form {form!r} has shape {tuple(t.shape)} {t.dtype}; its spec "
                             f"says {layout.shape} {layout.dtype} (corrupt payload)")
        # the logical tensor, decoded from the storage precision into the dtype the state keeps
        return layout.decode(t.to(self.device), self.buffer_dtype)

    def _payload_out(self, out: dict[str, torch.Tensor]) -> BlockPayload:
        for name, t in out.items():
            assert tuple(t.shape) == self.layouts[name].shape, (name, t.shape)
        return BlockPayload(out, {name: self.layouts[name].spec for name in out})


class CompressorSlot:
    """What one compressor (a layer's main or indexer compressor) may touch in the state."""

    def __init__(self, state: RequestState, layer: int, kind: str, ratio: int, overlap: bool,
                 width: int, ring_kv: torch.Tensor, ring_score: torch.Tensor, entries: torch.Tensor,
                 entries_layout: FormLayout | None, halo_layout: FormLayout | None) -> None:
        self._state, self.layer, self.kind = state, layer, kind
        self.ratio, self.overlap, self.width = ratio, overlap, width
        self.ring_kv, self.ring_score = ring_kv, ring_score
        self._entries = entries
        # Storage rounding (``worker.model.storage``): None when the cache stores float32 rows.
        self._entries_layout = entries_layout if entries_layout is not None and entries_layout.lossy else None
        #: Rounds the halo rows a block boundary leaves (None: stored as computed).
        self.halo_layout = halo_layout if halo_layout is not None and halo_layout.lossy else None

    def reset(self) -> None:
        # NOTE: kv 0 / score -inf is the sentinel for rows before position 0; a new request
        # must never see another request's rows (the stale-ring bug of research note §7).
        self.ring_kv.zero_()
        self.ring_score.fill_(float("-inf"))

    def write_entries(self, first: int, rows: torch.Tensor, *, stored: bool = False) -> None:
        """Entries ``first…``; rounded to the storage precision unless they come from storage."""
        if self._entries_layout is not None and not stored:
            rows = self._entries_layout.round(rows)
        self._entries[first:first + rows.shape[0]] = rows

    def entries(self, n: int) -> torch.Tensor:
        """The first ``n`` entries (a view)."""
        return self._entries[:n]

    def capture_halo(self, block: int, kv_a: torch.Tensor, score_a: torch.Tensor) -> None:
        """Record the a-halves ``[m, width]`` of the window closing at block ``block``'s end."""
        self._state._capture_halo(self.layer, self.kind, block, kv_a, score_a)


class RequestState(CacheState):
    """Cache state of one request of the hybrid model (batch 1). See the module docstring."""

    #: Rows are kept in float32 whatever the storage precision (they are rounded to it as written).
    buffer_dtype = torch.float32

    def __init__(self, cfg: ModelConfig, block_size: int, capacity: int | None = None,
                 device: torch.device | str = "cpu", cache_dtype: str = "auto") -> None:
        check_block_size(cfg, block_size)
        capacity = cfg.max_position_embeddings if capacity is None else capacity
        self._init_positions(block_size, capacity, device)
        self.cfg = cfg
        self.layouts: dict[str, FormLayout] = form_layouts(cfg, block_size, cache_dtype)
        swa = self.layouts[SWA]
        self._swa_round = swa.round if swa.lossy else None
        f32 = dict(dtype=torch.float32, device=self.device)
        D, dI = cfg.head_dim, cfg.index_head_dim
        self._swa = torch.zeros(cfg.num_hidden_layers, capacity, D, **f32)
        self._csa_index = {layer: i for i, layer in enumerate(cfg.csa_layers)}
        n_blocks = capacity // block_size
        self._halos = (torch.zeros(n_blocks, len(cfg.csa_layers), 2, cfg.csa_ratio, D + dI, **f32)
                       if cfg.csa_layers else None)
        self._slots: dict[tuple[int, str], CompressorSlot] = {}
        for layer in cfg.compressed_layers:
            m = cfg.compress_ratios[layer]
            csa = cfg.is_csa(layer)
            kinds = [(MAIN, D)] + ([(IDX, dI)] if csa else [])
            for kind, width in kinds:
                coff = 2 if csa else 1
                ring = coff * m
                self._slots[(layer, kind)] = CompressorSlot(
                    self, layer, kind, m, csa, width,
                    torch.zeros(ring, coff * width, **f32), torch.zeros(ring, coff * width, **f32),
                    torch.zeros(capacity // m, width, **f32),
                    self.layouts.get(COMPRESSED if kind == MAIN else INDEXER), self.layouts.get(TAIL))
        self.reset()

    @classmethod
    def from_blocks(cls, cfg: ModelConfig, block_size: int, blocks: Sequence[Mapping[str, torch.Tensor]],
                    n_blocks: int, *, capacity: int | None = None, device: torch.device | str = "cpu",
                    specs: Mapping[str, FormSpec] | None = None) -> RequestState:
        """A state at ``n_blocks * block_size`` built from cached payloads (see :meth:`restore`)."""
        state = cls(cfg, block_size, capacity, device)
        state.restore(blocks, n_blocks, specs=specs)
        return state

    # ---- lifecycle -------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the state for a new request: position 0, compressor rings at (0, −inf)."""
        self._reset_positions()
        self._swa_lo = 0           # first position whose swa rows this state holds
        for slot in self._slots.values():
            slot.reset()

    # ---- what the model touches --------------------------------------------------------

    def write_swa(self, layer: int, start: int, rows: torch.Tensor) -> None:
        if self._swa_round is not None:
            rows = self._swa_round(rows)
        self._swa[layer, start:start + rows.shape[0]] = rows

    def window_rows(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Raw K=V rows of positions ``[lo, hi)`` (a view)."""
        assert lo >= self._swa_lo, f"window row {lo} was not restored (held from {self._swa_lo})"
        return self._swa[layer, lo:hi]

    def compressor(self, layer: int, kind: str = MAIN) -> CompressorSlot:
        return self._slots[(layer, kind)]

    def _capture_halo(self, layer: int, kind: str, block: int, kv_a: torch.Tensor, score_a: torch.Tensor) -> None:
        c = self._csa_index[layer]
        D = self.cfg.head_dim
        cols = slice(0, D) if kind == MAIN else slice(D, D + self.cfg.index_head_dim)
        self._halos[block, c, 0, :, cols] = kv_a
        self._halos[block, c, 1, :, cols] = score_a

    # ---- block payloads ----------------------------------------------------------------

    def export_block(self, i: int) -> BlockPayload:
        """Block ``i``'s payload per form (fresh tensors, fixed shapes); see ``worker.model.forms``."""
        self._check_exportable(i)
        bs, cfg = self.block_size, self.cfg
        out: dict[str, torch.Tensor] = {}
        if COMPRESSED in self.layouts:
            parts = []
            for layer in cfg.compressed_layers:
                k = bs // cfg.compress_ratios[layer]
                parts.append(self._slots[(layer, MAIN)].entries((i + 1) * k)[i * k:])
            out[COMPRESSED] = torch.cat(parts, 0)
        if INDEXER in self.layouts:
            k = bs // cfg.csa_ratio
            out[INDEXER] = torch.cat([self._slots[(layer, IDX)].entries((i + 1) * k)[i * k:]
                                      for layer in cfg.csa_layers], 0)
        if TAIL in self.layouts:
            out[TAIL] = self._halos[i].clone()
        out[SWA] = self._swa[:, i * bs:(i + 1) * bs].clone()
        # every row is already rounded to the storage precision: encoding it is exact
        return self._payload_out({name: self.layouts[name].encode(t) for name, t in out.items()})

    def restore(self, blocks: Sequence[Mapping[str, torch.Tensor]], n_blocks: int, *,
                specs: Mapping[str, FormSpec] | None = None, timer: Any = None) -> None:
        """Reset, then build the state at ``P = n_blocks * block_size`` from cached payloads
        (``timer``: a :class:`worker.cache.cost.FormTimer` the time per form is added to).

        ``blocks[i]`` (``i < n_blocks``) must hold ``compressed`` and ``indexer``; the blocks
        overlapping ``[P - W + 1, P)`` must hold ``swa``; block ``n_blocks - 1`` must hold
        ``tail``. Other forms present are ignored. Every payload's spec is checked against
        this model's (``BlockPayload.specs`` or ``specs=``).
        """
        cfg, bs = self.cfg, self.block_size
        self._check_restore(blocks, n_blocks)
        self.reset()
        if n_blocks == 0:
            return
        P = n_blocks * bs
        if COMPRESSED in self.layouts:
            with timed(timer, COMPRESSED):
                hist = torch.stack([self._payload(blocks, i, COMPRESSED, specs) for i in range(n_blocks)])
                row = 0
                for layer in cfg.compressed_layers:
                    k = bs // cfg.compress_ratios[layer]
                    self._slots[(layer, MAIN)].write_entries(0, hist[:, row:row + k].reshape(-1, cfg.head_dim),
                                                             stored=True)
                    row += k
        if INDEXER in self.layouts:
            with timed(timer, INDEXER):
                hist = torch.stack([self._payload(blocks, i, INDEXER, specs) for i in range(n_blocks)])
                k = bs // cfg.csa_ratio
                for c, layer in enumerate(cfg.csa_layers):
                    self._slots[(layer, IDX)].write_entries(
                        0, hist[:, c * k:(c + 1) * k].reshape(-1, cfg.index_head_dim), stored=True)
        first = max(0, P - self.layouts[SWA].spec.window_tokens) // bs
        with timed(timer, SWA):
            for i in range(first, n_blocks):
                self._swa[:, i * bs:(i + 1) * bs] = self._payload(blocks, i, SWA, specs)
        self._swa_lo = first * bs
        if TAIL in self.layouts:
            with timed(timer, TAIL):
                halo = self._payload(blocks, n_blocks - 1, TAIL, specs)
                self._halos[n_blocks - 1] = halo
                m, D = cfg.csa_ratio, cfg.head_dim
                slots = torch.arange(P - m, P, device=self.device) % (2 * m)
                for c, layer in enumerate(cfg.csa_layers):
                    for kind, cols in ((MAIN, slice(0, D)), (IDX, slice(D, D + cfg.index_head_dim))):
                        slot = self._slots[(layer, kind)]
                        w = slot.width
                        # NOTE: only the a-halves of the last closed window are read after P; the
                        # b-halves and older rows keep the (0, -inf) sentinel and are never gathered.
                        slot.ring_kv[slots, :w] = halo[c, 0, :, cols]
                        slot.ring_score[slots, :w] = halo[c, 1, :, cols]
        self.pos = P
        self._export_from = n_blocks
