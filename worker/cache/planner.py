"""Pure reuse planning and hit validation: which cached blocks a request may resume from.

Nothing here does I/O, reads a clock or touches a pool: the engine gathers facts (what a
slot, a host-tier entry or an offload file says about itself) and asks this module what
they are worth. That keeps the rules that decide correctness small and unit-testable.

Theory of operation
-------------------
A resume at block boundary ``p`` reads, per form, the blocks its scope needs
(:func:`needs`): every block before ``p`` for full-history forms, the window before ``p``
for window forms, block ``p - 1`` for resume-point forms. The coordinator's grant names a
replica for each of those pairs at the longest usable ``p`` it found.

Before a kernel reads a replica the worker checks it in four layers, cheapest first
(:func:`validate`):

1. ``presence``     — the location holds this block, READY, at the leased generation;
2. ``abi``          — it was written under the running model's form spec (layout version,
                      dtype, dims, block size, quantisation: all inside ``spec_digest``);
3. ``intersection`` — it belongs to this request: same namespace and tenant, the block hash
                      recomputed from this request's tokens, its parent, its token span
                      (so every form of a reused block agrees on all three);
4. ``integrity``    — the xxh3 checksum of the bytes equals the one committed to the log,
                      and the bytes have the size and alignment the kernel reads.

Each layer is switchable per form and per layer (``cache.hit_validation``); a reload from
host or disk is always checked for integrity while ``check_offload`` is on. Facts without
which nothing can be read at all (the block is absent, the byte count is wrong) fail the
request whatever the switches say — a switched-off layer never turns "missing" into "hit".

After validation the engine picks the largest boundary whose needs are all satisfied by
good replicas (:func:`best_boundary`), on the prefill grid (:func:`grid_floor`: a resume
off the grid of ``chunk_blocks`` would run different units than a cold prefill and could
change bits, see ``worker.model.model``) and below the last prompt token (whose logits
must be computed).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.ids import ROOT_HASH
from shared.messages import ReplicaRef


class Layer(enum.StrEnum):
    PRESENCE = "presence"
    ABI = "abi"
    INTERSECTION = "intersection"
    INTEGRITY = "integrity"


LAYERS: tuple[Layer, ...] = (Layer.PRESENCE, Layer.ABI, Layer.INTERSECTION, Layer.INTEGRITY)

#: ``(block index, form)``: one form of one block of a request.
Need = tuple[int, str]


# --- which blocks a resume reads ------------------------------------------------------------

def needs(catalogue: FormCatalogue, p: int) -> list[Need]:
    """Every (block, form) a resume at boundary ``p`` (in blocks) reads, in catalogue order."""
    out: list[Need] = []
    if p <= 0:
        return out
    for spec in catalogue.forms:
        if spec.scope is FormScope.FULL_HISTORY:
            lo = 0
        elif spec.scope is FormScope.WINDOW:
            lo = max(0, p - catalogue.window_blocks(spec))
        else:
            lo = p - 1
        out.extend((i, spec.name) for i in range(lo, p))
    return out


def grid_floor(p: int, grid: int) -> int:
    """The largest multiple of ``grid`` that is ≤ ``p``."""
    if grid <= 0:
        raise ValueError(f"grid must be > 0, got {grid}")
    return p - p % grid


def resume_cap(n_tokens: int, block_size: int) -> int:
    """Most blocks a request of ``n_tokens`` may resume from: the last token is always computed."""
    return max(0, (n_tokens - 1) // block_size)


def best_boundary(catalogue: FormCatalogue, good: Iterable[Need] | set[Need], limit: int, grid: int = 1) -> int:
    """The largest ``p ≤ limit`` on the grid whose needs are all in ``good`` (0 if none)."""
    ok = good if isinstance(good, set) else set(good)
    p = grid_floor(max(0, limit), grid)
    while p > 0:
        if all(n in ok for n in needs(catalogue, p)):
            return p
        p -= grid
    return 0


# --- switches ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Switches:
    """Which layers run for which forms (``cache.hit_validation``)."""

    layers: frozenset[Layer] = frozenset(LAYERS)
    #: Forms whose replicas are validated; a form not named here is read unchecked.
    forms: frozenset[str] = frozenset({"compressed", "indexer", "tail", "swa"})
    #: Reloads from host or disk: integrity always, other layers as for any form.
    offload: bool = True

    @classmethod
    def from_config(cls, hv: object, catalogue: FormCatalogue) -> Switches:
        """From a ``shared.config.HitValidation``; forms without a ``check_<form>`` key are checked."""
        forms = frozenset(f for f in catalogue.names if bool(getattr(hv, f"check_{f}", True)))
        return cls(layers=frozenset(Layer(x) for x in getattr(hv, "layers")), forms=forms,
                   offload=bool(getattr(hv, "check_offload")))

    def runs(self, layer: Layer, form: str, reload: bool) -> bool:
        if reload and self.offload:
            return layer is Layer.INTEGRITY or layer in self.layers
        return layer in self.layers and form in self.forms

    def all_run(self, form: str, reload: bool) -> bool:
        """Every layer runs for ``form`` (the case :func:`all_pass` may shortcut)."""
        return all(self.runs(layer, form, reload) for layer in LAYERS)


# --- facts and verdicts ----------------------------------------------------------------------

class BlockMeta(msgspec.Struct, frozen=True, gc=False):
    """What the writer recorded about one replica's bytes (kept beside a slot or host entry).

    A frozen msgspec struct, not a frozen dataclass: one is made per replica on every install,
    reload and validation, and a frozen dataclass's ``__init__`` (an ``object.__setattr__`` per
    field) cost 3.2 us against 0.3. Untracked by the GC (``gc=False``): it holds strings and ints
    only, so it can be part of no cycle. Change a copy with ``msgspec.structs.replace``.
    """

    namespace: str
    tenant: str
    block_hash: str
    parent_hash: str
    token_start: int
    token_end: int
    form: str
    spec_digest: str
    checksum: str
    generation: int = 0

    def at_generation(self, generation: int) -> BlockMeta:
        """This record at a slot's ``generation`` (every install makes one)."""
        return BlockMeta(self.namespace, self.tenant, self.block_hash, self.parent_hash, self.token_start,
                         self.token_end, self.form, self.spec_digest, self.checksum, generation)


class Observed(msgspec.Struct, frozen=True):
    """What the worker found where a replica ref points (``meta`` None = nothing there).

    A frozen msgspec struct for the reason :class:`BlockMeta` is one (one per replica checked:
    2.7 us as a frozen dataclass, 0.3 as a struct)."""

    meta: BlockMeta | None
    nbytes: int = 0
    ready: bool = True
    #: Checksum of the bytes as they will be read; called only if integrity runs.
    checksum: Callable[[], str] = lambda: ""
    #: Storage meets the kernel's alignment (element-aligned, contiguous).
    aligned: bool = True
    #: Why the bytes are known to be damaged ("" = not known): truncated file, bad header,
    #: host copy failing its checksum. Always an integrity failure, whatever the switches.
    damage: str = ""


@dataclass(frozen=True, slots=True)
class Expect:
    """What a replica must be to serve this request."""

    namespace: str
    tenant: str
    block_hashes: Sequence[str]
    block_size: int
    specs: Mapping[str, FormSpec]
    #: ``spec_digest`` per form (computed from ``specs`` when not given; pass it to skip the hashing).
    digests: Mapping[str, str] = field(default_factory=dict)
    #: Storage precision of the specs this worker knows by digest (its forms at every
    #: ``cache.dtype``), so an ABI failure can say "stored as bfloat16" instead of a digest.
    stored_as: Mapping[str, str] = field(default_factory=dict)

    def digest(self, form: str) -> str:
        d = self.digests.get(form)
        return d if d is not None else self.specs[form].spec_digest


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    #: The layer that failed (None when ok).
    layer: Layer | None = None
    detail: str = ""
    #: ``(layer, "pass" | "fail" | "skip")`` for every layer, in order.
    outcomes: tuple[tuple[Layer, str], ...] = ()


def _fail(layer: Layer, detail: str, outcomes: list[tuple[Layer, str]]) -> Verdict:
    outcomes.append((layer, "fail"))
    done = {lay for lay, _ in outcomes}
    outcomes.extend((lay, "skip") for lay in LAYERS if lay not in done)
    return Verdict(False, layer, detail, tuple(outcomes))


def validate(ref: ReplicaRef, index: int, obs: Observed, expect: Expect, switches: Switches,
             *, reload: bool = False) -> Verdict:
    """Check one replica for block ``index`` of the request, layer by layer (see module doc)."""
    form = ref.form
    outcomes: list[tuple[Layer, str]] = []

    def on(layer: Layer) -> bool:
        if switches.runs(layer, form, reload):
            return True
        outcomes.append((layer, "skip"))
        return False

    meta = obs.meta
    spec = expect.specs.get(form)
    # Structural facts: without them nothing can be read, whatever the switches.
    if obs.damage:
        return _fail(Layer.INTEGRITY, f"{form} of block {index} at {ref.location}: {obs.damage}",
                     [(lay, "skip") for lay in LAYERS[:3]])
    if meta is None:
        return _fail(Layer.PRESENCE, f"{form} of block {index} is not at {ref.location}", outcomes)
    if spec is None:
        return _fail(Layer.ABI, f"form {form!r} is not declared by the running model", outcomes)
    if obs.nbytes != spec.bytes_per_block:
        return _fail(Layer.ABI, f"{form} of block {index} holds {obs.nbytes} bytes; the running spec reads "
                                f"{spec.bytes_per_block}", outcomes)
    if on(Layer.PRESENCE):
        if not obs.ready:
            return _fail(Layer.PRESENCE, f"{form} of block {index} at {ref.location} is not READY", outcomes)
        if meta.block_hash != ref.block_hash or meta.form != form:
            return _fail(Layer.PRESENCE, f"{ref.location} holds another block/form for {form} of block {index}",
                         outcomes)
        if not reload and meta.generation != ref.generation:
            return _fail(Layer.PRESENCE, f"{form} of block {index}: slot generation {meta.generation}, lease says "
                                         f"{ref.generation} (slot recycled)", outcomes)
        outcomes.append((Layer.PRESENCE, "pass"))
    if on(Layer.ABI):
        want = expect.digest(form)
        if meta.spec_digest != want:
            was = expect.stored_as.get(meta.spec_digest)
            return _fail(Layer.ABI, f"{form} of block {index} was written under spec {meta.spec_digest}"
                                    f"{f' (stored as {was})' if was else ''}; running spec is {want} (stored as "
                                    f"{spec.dtype})", outcomes)
        outcomes.append((Layer.ABI, "pass"))
    if on(Layer.INTERSECTION):
        hs = expect.block_hashes
        bs = expect.block_size
        parent = hs[index - 1] if index else ROOT_HASH
        why = ""
        if index >= len(hs) or ref.block_hash != hs[index]:
            why = "the lease names a block outside this request's hash chain"
        elif meta.namespace != expect.namespace:
            why = f"namespace {meta.namespace[:12]}… is not the request's {expect.namespace[:12]}…"
        elif meta.tenant != expect.tenant:
            why = "tenant differs"
        elif meta.block_hash != hs[index] or meta.parent_hash != parent:
            why = "hash chain differs from the one recomputed from the request's tokens"
        elif (meta.token_start, meta.token_end) != (index * bs, (index + 1) * bs):
            why = f"token span [{meta.token_start}, {meta.token_end}) is not [{index * bs}, {(index + 1) * bs})"
        if why:
            return _fail(Layer.INTERSECTION, f"{form} of block {index}: {why}", outcomes)
        outcomes.append((Layer.INTERSECTION, "pass"))
    if on(Layer.INTEGRITY):
        if not obs.aligned:
            return _fail(Layer.INTEGRITY, f"{form} of block {index}: storage not aligned for the kernel", outcomes)
        got = obs.checksum()
        if not ref.checksum or got != ref.checksum:
            return _fail(Layer.INTEGRITY, f"{form} of block {index}: checksum {got[:12]}… differs from the "
                                          f"committed {ref.checksum[:12] or '(none)'}…", outcomes)
        outcomes.append((Layer.INTEGRITY, "pass"))
    return Verdict(True, None, "", tuple(outcomes))


def all_pass(ref: ReplicaRef, index: int, obs: Observed, expect: Expect, *, reload: bool = False) -> bool:
    """True only if :func:`validate` (with the same ``reload``) would pass this replica in every
    layer; call it only where :meth:`Switches.all_run` says every layer runs.

    The common case (a good replica, every layer on) in one expression instead of four
    layers' bookkeeping; anything else — a failure, a switched-off layer — goes through
    :func:`validate`, which names the layer. Conservative by construction: each term is one
    of ``validate``'s checks (a property test holds it to that). A reload (host or disk) has
    no slot generation to compare, as in ``validate``.
    """
    m = obs.meta
    hs = expect.block_hashes
    if m is None or obs.damage or not obs.ready or not obs.aligned or index >= len(hs) or not ref.checksum:
        return False
    h = hs[index]
    bs = expect.block_size
    spec = expect.specs.get(ref.form)
    return (spec is not None and obs.nbytes == spec.bytes_per_block
            and ref.block_hash == h and m.block_hash == h and m.form == ref.form
            and (reload or m.generation == ref.generation) and m.spec_digest == expect.digest(ref.form)
            and m.namespace == expect.namespace and m.tenant == expect.tenant
            and m.parent_hash == (hs[index - 1] if index else ROOT_HASH)
            and m.token_start == index * bs and m.token_end == (index + 1) * bs
            and obs.checksum() == ref.checksum)


ALL_PASS: tuple[tuple[Layer, str], ...] = tuple((lay, "pass") for lay in LAYERS)


# --- mapping a grant onto the request ------------------------------------------------------

@dataclass(slots=True)
class ReadPlan:
    """The grant's read refs laid out by (block index, form)."""

    refs: dict[Need, ReplicaRef] = field(default_factory=dict)
    #: Refs naming a block that is not in this request's chain (a protocol error, never read).
    foreign: list[ReplicaRef] = field(default_factory=list)


def map_reads(block_hashes: Sequence[str], refs: Iterable[ReplicaRef]) -> ReadPlan:
    index = {h: i for i, h in enumerate(block_hashes)}
    plan = ReadPlan()
    for r in refs:
        i = index.get(r.block_hash)
        if i is None:
            plan.foreign.append(r)
        else:
            plan.refs[(i, r.form)] = r
    return plan
