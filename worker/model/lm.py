"""What every model family shares: the batched forward's skeleton and the prefill schedule.

A family (:class:`worker.model.model.HybridAttentionLM`, :class:`worker.model.dense.model.DenseLM`)
implements four things — its per-request state (``new_state``), its forms (``form_layouts``),
the rows of one forward up to the last hidden state (``_body``) and the head (``_head``) —
and inherits the rest: token-id checks, one forward over several requests with each state
advanced and its exportable blocks marked, grid-anchored prefill, decode steps.

Exactness is each family's own argument (its ops are batch-invariant, see
``kernels.invariant``); the skeleton only keeps to it: a request's rows are contiguous in the
batch, every state commits its span after the forward, and logits are cut per request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.invariant import PROBE_ROWS, calibrate, invariant_here, rules
from shared.forms import FormCatalogue
from worker.model.recycle import BufferRecycler
from worker.model.state import Batch, CacheState, Embeds, Segment
from worker.model.storage import CACHE_DTYPES, StorageError

if TYPE_CHECKING:
    from worker.model.vision import PromptEmbeds

#: The seed of :meth:`CausalLM.arithmetic_digest`'s tokens. Changing it changes every namespace.
ARITHMETIC_SEED = 20261204


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's bytes, on the host (what the probes compare and the arithmetic digest hashes)."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


class CausalLM(nn.Module):
    #: The family's name as ``kvledger`` reports it ("deepseek_v4", "llama", "qwen2", "qwen3").
    family = ""

    def __init__(self) -> None:
        super().__init__()
        #: Whether fused forwards and decode-made blocks are exact here (``kernels.invariant.probe``;
        #: the worker sets it from the probe at start). False: one request per forward, and only
        #: blocks of block-aligned units are exportable.
        self.batch_invariant = True
        #: The checkpoint's digest when it was loaded from a directory (``shared.manifest``);
        #: ``None`` for seeded weights (their namespace is the digest of the tensors themselves).
        self.checkpoint_digest: str | None = None
        #: The default ``cache.dtype`` of states and layouts made without one (``worker.model.storage``;
        #: ``auto`` = the family's own). An engine passes its own setting explicitly, so engines
        #: with different settings may share one model. The precision changes what a request
        #: computes (rows are read back as stored): it is part of the forms' specs and the namespace.
        self.cache_dtype = "auto"
        #: Where a family's request states take their buffers and give them back when they die
        #: (:mod:`worker.model.recycle`); ``None``, or a bound of 0, allocates every state afresh.
        #: The worker sets it (``worker.kept_state_bytes``).
        self.recycler: BufferRecycler | None = None
        #: The probes this model passed (:meth:`check_invariance` with ``reuse``), by everything
        #: the answer depends on in this process: see :meth:`_probe_key`.
        self._passed_probes: set[tuple] = set()
        #: :meth:`arithmetic_digest`'s answers, by the same key.
        self._digests: dict[tuple, str] = {}

    # ---- what a family provides ---------------------------------------------------------------

    def new_state(self, block_size: int, capacity: int | None = None, *,
                  cache_dtype: str | None = None) -> CacheState:
        """A fresh per-request state (``cache_dtype``: the storage precision; None = :attr:`cache_dtype`)."""
        raise NotImplementedError

    def form_layouts(self, block_size: int, cache_dtype: str | None = None) -> dict:
        """``{form: FormLayout}`` at ``block_size`` (``cache_dtype`` None = :attr:`cache_dtype`)."""
        raise NotImplementedError

    def _body(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Every row's last hidden state (before the head), cached state read and written."""
        raise NotImplementedError

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _hidden(self, ids: torch.Tensor, batch: Batch, need: torch.Tensor | None) -> torch.Tensor:
        """The last hidden state of the rows ``need`` (every row when None) — what the head reads.
        A family whose last layers only matter for the rows whose logits are wanted (YOCO's
        cross-decoder) overrides this to run them on those rows alone."""
        h = self._body(ids, batch)
        return h if need is None else h[need]

    def _embed(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The input rows of a forward (what ``_body`` starts from): the token embeddings, with
        each segment's ``embeds`` (an image's vectors) copied over its rows — a copy, so every
        row still depends on its own inputs alone."""
        x = self.model.embed_tokens(ids)
        for g in batch.segments:
            if g.embeds is not None:
                x[g.embeds.rows + g.rows.start] = g.embeds.vectors.to(x.dtype)
        return x

    def _product_shapes(self) -> set[tuple[int, int]]:
        """``(in, out)`` of every product the forward runs, for :meth:`check_invariance`."""
        return {(m.in_features, m.out_features) for m in self.modules() if isinstance(m, nn.Linear)}

    def _grouped_shapes(self) -> set[tuple[int, int, int]]:
        """``(groups, in, out)`` of every grouped product (``bmm_rows`` against a module's
        weight, declared as its ``grouped_shape``), for :meth:`check_invariance`."""
        return {m.grouped_shape for m in self.modules() if getattr(m, "grouped_shape", None)}

    # ---- shared ---------------------------------------------------------------------------------

    def use_cache_dtype(self, cache_dtype: str) -> None:
        """Store cached state in ``cache_dtype`` from now on (``StorageError`` for an unknown name;
        a form that cannot be stored so — fp8 groups too small for its rows — says so when its
        layout is built)."""
        if cache_dtype not in CACHE_DTYPES:
            raise StorageError(f"cache.dtype {cache_dtype!r}: use one of {', '.join(CACHE_DTYPES)}")
        self.cache_dtype = cache_dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def declare_forms(self, block_size: int, cache_dtype: str | None = None) -> FormCatalogue:
        """The catalogue this model declares to the coordinator."""
        return FormCatalogue(model_id=self.cfg.model_id, block_size=block_size,
                             forms=tuple(layout.spec for layout in self.form_layouts(block_size, cache_dtype).values()))

    def check_invariance(self, block_size: int | None = None, cache_dtype: str | None = None, *,
                         reuse: bool = False, max_rows: int = PROBE_ROWS[-1]) -> list[str]:
        """Find this machine's row floor at this model's shapes and dtype (``kernels.invariant.calibrate``,
        products of up to ``max_rows`` rows: the most one forward runs), then — given the
        engine's ``block_size`` — run the whole forward both ways
        (:meth:`probe_forward`, states stored at ``cache_dtype``). Sets :attr:`batch_invariant`;
        returns what failed (empty: invariant).

        ``reuse``: a probe this model already passed in this process, with the same weights (same
        storage, no in-place change since), block size, cache dtype, intra-op threads and
        ``kernels.invariant`` settings, is not run again (an engine built on a model another
        engine probed: 0.5-0.8 s of forwards each time for the tiny model, the bulk of building
        one). A failed probe is always run again; :meth:`distrust_invariance` forgets them all."""
        key = (*self._probe_key(block_size, cache_dtype), max_rows) if reuse else None
        if key is not None and key in self._passed_probes:
            self.batch_invariant = True
            return []
        if self.device.type != "cpu":
            # NOTE: the rules are measured for the CPU path only; cuBLAS and the Triton kernels
            # (fixed tiles, but not yet checked row against batch) run one request per forward.
            failures = [f"batch invariance is established for the CPU path only, not for {self.device.type}"]
        else:
            failures = calibrate(self._product_shapes(), dtype=self.dtype, grouped=self._grouped_shapes(),
                                 max_rows=max_rows)
        self.batch_invariant = not failures
        if not failures and block_size is not None and invariant_here():
            failures = self.probe_forward(block_size, cache_dtype=cache_dtype)
            self.batch_invariant = not failures
            if not failures:
                self._passed_probes.add((*self._probe_key(block_size, cache_dtype), max_rows))
        return failures

    @torch.no_grad()
    def arithmetic_digest(self, block_size: int, cache_dtype: str | None = None, *, chunk_blocks: int = 1) -> str:
        """A digest of the bits this model computes here, for the cache namespace: a seeded
        prompt (:meth:`arithmetic_prompt_tokens`: past the window and the indexer's selection) run
        alone (one unit with batch-invariant ops, else :meth:`prefill`'s units of ``chunk_blocks``,
        the engine's schedule then), then one decode token; the logits of both and every form's
        payload of the first two and the last whole block (and, for a model with a vision encoder,
        its vectors of a seeded image), hashed. ``""``
        when two identical runs differ (nothing computed here can be promised to another run).

        The namespace's other parts (weights, versions, the compute fingerprint) do not see the
        project's own code: a build whose arithmetic changed without a ``KERNEL_ABI_VERSION`` bump
        would reuse blocks the old arithmetic wrote. Two builds (or machines, or row floors) that
        compute other bits here get other namespaces. A run that differs only on inputs this one
        does not reach stays the version rule's job. Memoised per process like a passed probe."""
        key = (*self._probe_key(block_size, cache_dtype), chunk_blocks, self.batch_invariant)
        if key in self._digests:
            return self._digests[key]
        # With batch-invariant ops a unit's bits do not depend on how the prompt is cut (tested):
        # one unit then, two forwards fewer.
        units = None if self.batch_invariant else chunk_blocks
        runs = {self._arithmetic_run(block_size, cache_dtype, units) for _ in range(2)}
        digest = runs.pop() if len(runs) == 1 else ""
        self._digests[key] = digest
        return digest

    def arithmetic_prompt_tokens(self, block_size: int) -> int:
        """The digest's prompt length: whole blocks past everything a query can reach but not
        read in full — the sliding window, and the sparse indexer's selection (``index_topk``
        compressed entries of ``csa_ratio`` tokens) — so that the window slides and the top-k
        chooses, then three tokens; two blocks at least. Capped by the model's positions.

        NOTE: a prompt shorter than the selection reads every compressed entry, so a change in how
        the indexer scores or ranks them would not move the digest (stop 40's two blocks did not
        reach a real checkpoint's window or top-k)."""
        cfg = self.cfg
        reach = getattr(cfg, "sliding_window", 0) or 0
        if getattr(cfg, "csa_layers", ()):
            reach = max(reach, cfg.index_topk * cfg.csa_ratio)
        n = block_size * max(2, -(-(reach + 1) // block_size)) + 3
        # (every family's config has max_position_embeddings; the prompt and its next token fit)
        return min(n, (cfg.max_position_embeddings - 1) // block_size * block_size)

    def _arithmetic_run(self, block_size: int, cache_dtype: str | None, chunk_blocks: int | None) -> str:
        """One run of :meth:`arithmetic_digest`; ``chunk_blocks`` None: the prompt as one unit."""
        g = torch.Generator().manual_seed(ARITHMETIC_SEED)
        n = self.arithmetic_prompt_tokens(block_size)
        prompt = torch.randint(0, self.cfg.vocab_size, (n,), generator=g)
        nxt = torch.randint(0, self.cfg.vocab_size, (1,), generator=g)
        state = self.new_state(block_size, -(-(n + 1) // block_size) * block_size, cache_dtype=cache_dtype)
        h = hashlib.blake2b(digest_size=16, person=b"kvl-arithmetic")

        def add(name: str, t: torch.Tensor) -> None:
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(_bits(t))

        add("prompt", self.prefill(prompt, state, chunk_blocks=chunk_blocks, logits="last") if chunk_blocks
            else self.forward_batch([(prompt, state)])[0])
        add("decode", self.forward_batch([(nxt, state)])[0])
        # the first two blocks and the last whole one (past the window and the selection)
        for i in sorted({0, 1, n // block_size - 1}):
            payload = state.export_block(i)
            for form in sorted(payload):
                add(f"block{i}:{form}", payload[form])
        if getattr(self, "vision", None) is not None:
            # An image's block keys hash its preprocessed pixels, not what the encoder makes of
            # them: the encoder's arithmetic has to be in here too.
            from worker.model.vision import encode_images
            side = self.vision.cfg.image_size
            pixels = torch.randint(0, 256, (side * side * 3,), dtype=torch.uint8, generator=g)
            add("image", encode_images(self, [pixels.numpy().tobytes()])[0])
        return h.hexdigest()

    def distrust_invariance(self) -> None:
        """A fused forward was caught differing at run time (``worker.stepper``): no fusing on this
        model, and no passed probe of it reused (a new engine probes again)."""
        self.batch_invariant = False
        self._passed_probes.clear()

    def _probe_key(self, block_size: int | None, cache_dtype: str | None) -> tuple:
        """What a probe's answer depends on in one process: the settings, the threads, the row
        floor and mode of ``kernels.invariant``, and the weights (each parameter's storage and its
        in-place version counter: loading and in-place writes bump it; a write through ``.data``
        would not, and nothing here writes weights that way)."""
        weights = tuple((p.data_ptr(), p._version) for p in self.parameters())
        return (block_size, cache_dtype, torch.get_num_threads(), rules(), str(self.dtype), weights)

    @torch.no_grad()
    def probe_forward(self, block_size: int, *, cache_dtype: str | None = None, seed: int = 0) -> list[str]:
        """Requests run fused, as the stepper fuses them, against each run alone: what differs.

        The product probe covers the matrix products only; a pointwise op, an attention reduction
        or a kernel path of this machine's own (a float16 one, say) can still make a row's bits
        depend on its batch. Here the whole forward answers, at the model's dtype and shapes, in
        two rounds. Round 1: step 1 fuses two prompts (one crossing a block boundary); step 2 fuses
        both requests' first decode token with a third request's prompt. Round 2 (short requests,
        the shape of a float16 mix that once differed under load): three one-token prompts and a
        seven-token one in one step, then their four decode tokens in the next. Every request's
        last-token logits must be the same bits as when it runs alone. Costs 17 small forwards at
        start.
        """
        g = torch.Generator().manual_seed(seed)
        vocab = self.cfg.vocab_size
        out: list[str] = []
        for lengths, late in (((block_size + 3, 5), (block_size + 1,)), ((1, 1, 1, 7), ())):
            out.extend(self._probe_round(block_size, cache_dtype, g, vocab, lengths, late))
        return out

    def _probe_round(self, block_size: int, cache_dtype: str | None, g: torch.Generator, vocab: int,
                     lengths: tuple[int, ...], late: tuple[int, ...]) -> list[str]:
        """Step 1 fuses the prompts of ``lengths``; step 2 fuses their first decode tokens with
        the prompts of ``late``. Each request's logits against the same request alone."""
        prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (*lengths, *late)]
        nxt = [torch.randint(0, vocab, (1,), generator=g) for _ in lengths]
        longest = max(n + (1 if i < len(lengths) else 0) for i, n in enumerate((*lengths, *late)))
        capacity = -(-longest // block_size) * block_size       # the longest request, in whole blocks

        alone: list[list[bytes]] = []
        for i, p in enumerate(prompts):
            st = self.new_state(block_size, capacity, cache_dtype=cache_dtype)
            row = [_bits(self.forward_batch([(p, st)])[0])]
            if i < len(lengths):
                row.append(_bits(self.forward_batch([(nxt[i], st)])[0]))
            alone.append(row)
        sts = [self.new_state(block_size, capacity, cache_dtype=cache_dtype) for _ in prompts]
        step1 = self.forward_batch(list(zip(prompts[:len(lengths)], sts)))
        step2 = self.forward_batch([*zip(nxt, sts), *zip(prompts[len(lengths):], sts[len(lengths):])])
        fused = [[_bits(step1[i]), _bits(step2[i])] for i in range(len(lengths))]
        fused += [[_bits(step2[len(lengths) + j])] for j in range(len(late))]
        out = []
        for i, (a, f) in enumerate(zip(alone, fused)):
            for step, (x, y) in enumerate(zip(a, f)):
                if x != y:
                    what = "decode token" if step else f"{prompts[i].numel()}-token prompt"
                    out.append(f"whole-forward probe: request {i}'s {what} gives other logits fused than alone "
                               f"({len(prompts)} requests, {self.dtype}, block size {block_size}, "
                               f"cache.dtype {cache_dtype or self.cache_dtype})")
        return out

    def check_step(self, tokens: torch.Tensor | Sequence[int], state: CacheState) -> None:
        """Raise ``ValueError`` if ``tokens`` cannot run on ``state`` (ids outside the vocabulary,
        no tokens, past the state's capacity) — without touching the state: the step loop
        checks every request this way before a fused forward, so one bad request fails alone."""
        state.span(self._ids(tokens).numel())

    def _ids(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor on the model's device; ``ValueError`` outside the vocabulary."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        return ids

    # NOTE: inference mode, not no_grad: no version counter or view tracking on each of the
    # forward's ~8,500 small ops (a decode step 9.9 -> 8.0 ms, the same bits). What it creates
    # (the logits) is read-only outside it; a state is allocated outside and only written here,
    # so it stays an ordinary tensor that restore, fork and export use as before.
    @torch.inference_mode()
    def forward_batch(self, work: Sequence[tuple[torch.Tensor | Sequence[int], CacheState]
                                            | tuple[torch.Tensor | Sequence[int], CacheState, Embeds | None]], *,
                      logits: str = "last") -> list[torch.Tensor]:
        """Run several requests' next tokens as ONE forward and advance each state.

        ``work`` is ``(tokens, state)`` or ``(tokens, state, embeds)`` per request (distinct
        states; any lengths: a decode token, a prefill unit); ``embeds`` replaces the input of
        some of its rows (an image's vectors, :meth:`_embed`). Every op is batch-invariant
        (``kernels.invariant``), so each request's rows come out bit-identical to running it
        alone. Returns, per request, logits ``[T, vocab]`` (``logits="all"``) or ``[vocab]`` of
        its last token (``"last"``).
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits={logits!r}: use 'all' or 'last'")
        if not work:
            return []
        if len({id(item[1]) for item in work}) != len(work):
            raise ValueError("forward_batch: each request state may appear once per forward")
        invariant = self.batch_invariant and invariant_here()
        if len(work) > 1 and not invariant:
            raise RuntimeError("this model's ops are not batch-invariant on this machine "
                               "(kernels.invariant.probe failed, or torch runs more than one intra-op thread): "
                               "run requests one at a time")
        ids_list = [self._ids(item[0]) for item in work]
        segs, row = [], 0
        for ids, item in zip(ids_list, work):
            state, embeds = item[1], (item[2] if len(item) > 2 else None)
            span = state.span(ids.numel())
            if embeds is not None and embeds.rows.numel() and (int(embeds.rows.min()) < 0
                                                               or int(embeds.rows.max()) >= span.length):
                raise ValueError(f"embeds name rows outside this step's {span.length} rows")
            segs.append(Segment(state, span, slice(row, row + span.length), embeds))
            row += span.length
        batch = Batch(tuple(segs), torch.cat([g.span.positions for g in segs]) if len(segs) > 1
                      else segs[0].span.positions)
        ids = torch.cat(ids_list) if len(ids_list) > 1 else ids_list[0]
        need = torch.tensor([g.rows.stop - 1 for g in segs], device=self.device) if logits == "last" else None
        h = self._hidden(ids, batch, need)
        for g in segs:
            g.state.commit(g.span, invariant=invariant)
        out = self._head(h)
        if logits == "last":
            return list(out.unbind(0))
        return [out[g.rows] for g in segs]

    def extend(self, tokens: torch.Tensor | Sequence[int], state: CacheState, *,
               logits: str = "all", embeds: PromptEmbeds | None = None) -> torch.Tensor:
        """Run ``tokens`` as ONE unit at the state's position and advance the state.

        Any length is valid (tests use it for arbitrary chunkings). Returns logits
        ``[T, vocab]`` (``logits="all"``) or ``[vocab]`` for the last token (``"last"``).
        ``embeds``: the prompt's image vectors by position (``worker.model.vision.PromptEmbeds``).
        """
        piece = embeds.piece(state.pos, self._ids(tokens).numel()) if embeds is not None else None
        return self.forward_batch([(tokens, state, piece)], logits=logits)[0]

    def prefill(self, tokens: torch.Tensor | Sequence[int], state: CacheState, *, chunk_blocks: int = 1,
                logits: str = "all", embeds: PromptEmbeds | None = None) -> torch.Tensor:
        """Prefill ``tokens`` from the state's position (a block boundary) in grid-anchored units:
        each unit ends on a multiple of ``chunk_blocks`` blocks (or at the last full block), and
        the trailing partial block is a unit of its own. Without batch invariance this is the
        schedule a resumed request can follow exactly (``RequestState.commit``)."""
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        bs = state.block_size
        if state.pos % bs:
            raise ValueError(f"prefill must start on a block boundary; the state is at {state.pos} "
                             f"(block size {bs}) — continue with decode_step or extend")
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        unit = chunk_blocks * bs
        start, end = state.pos, state.pos + ids.numel()
        full_end = end - end % bs
        outs = []
        s = start
        while s < full_end:
            e = min((s // unit + 1) * unit, full_end)      # next grid point, or the last full block
            outs.append(self.extend(ids[s - start:e - start], state, logits=logits, embeds=embeds))
            s = e
        if s < end:
            # NOTE: the trailing partial block is a unit of its own and is never exportable.
            outs.append(self.extend(ids[s - start:], state, logits=logits, embeds=embeds))
        if logits == "last":
            return outs[-1]
        return torch.cat(outs, 0)

    def decode_step(self, token: int | torch.Tensor, state: CacheState) -> torch.Tensor:
        """One token at the state's position; returns its logits ``[vocab]``."""
        return self.extend([int(token)], state, logits="last")
