"""The cache-form catalogue: a model's declaration of what cached state it keeps.

Neither the coordinator nor the worker engine hard-codes a model. A model declares its
forms; the coordinator uses only each form's *scope* to decide which blocks must be READY
for a resume at a block boundary ``p``:

* ``full_history`` — every block before ``p`` (compressed entries, indexer keys, plain KV);
* ``window``       — every block overlapping ``[p - window_tokens, p)`` (sliding-window rows);
* ``resume_point`` — the block ending at ``p`` (compressor tail snapshotted at a boundary).

``spec_digest`` covers everything that changes the meaning of the stored bytes, so a
replica saved under one spec is rejected under another (different ratio, width, dtype or
layout version) instead of being misread.
"""

from __future__ import annotations

import enum
import hashlib

import msgspec


class FormScope(enum.StrEnum):
    FULL_HISTORY = "full_history"
    WINDOW = "window"
    RESUME_POINT = "resume_point"


class FormSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One kind of cached state, per block of ``block_size`` tokens."""

    name: str
    scope: FormScope
    #: Bytes one block of this form occupies in a pool slot (all layers together).
    bytes_per_block: int
    #: Storage dtype name as torch spells it (``float32``, ``bfloat16``, ``float8_e4m3fn``).
    dtype: str
    #: Version of this form's byte layout; bump when the layout changes.
    layout_version: int = 1
    #: For ``window`` forms: how many tokens before the resume point must be present.
    window_tokens: int = 0
    #: Free-form shape facts that change the bytes' meaning (ratios, widths, layers).
    #: Entered into ``spec_digest``; sorted so the digest is stable.
    params: dict[str, int | str] = {}

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"form name {self.name!r}: use letters, digits and '_'")
        if self.bytes_per_block <= 0:
            raise ValueError(f"form {self.name}: bytes_per_block must be > 0")
        if self.scope is FormScope.WINDOW and self.window_tokens <= 0:
            raise ValueError(f"form {self.name}: a window form needs window_tokens > 0")
        if self.scope is not FormScope.WINDOW and self.window_tokens:
            raise ValueError(f"form {self.name}: window_tokens is only for window forms")

    @property
    def spec_digest(self) -> str:
        """16-hex digest of everything that decides how the stored bytes are read."""
        canon = msgspec.json.encode(
            [self.name, str(self.scope), self.bytes_per_block, self.dtype,
             self.layout_version, self.window_tokens, sorted(self.params.items())]
        )
        return hashlib.blake2b(canon, digest_size=8).hexdigest()


class FormCatalogue(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """All forms of one model, plus the block size they are counted in."""

    model_id: str
    block_size: int
    forms: tuple[FormSpec, ...]

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        names = [f.name for f in self.forms]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate form names in catalogue: {names}")
        if not self.forms:
            raise ValueError("a catalogue declares at least one form")

    def get(self, name: str) -> FormSpec:
        for f in self.forms:
            if f.name == name:
                return f
        raise KeyError(f"form {name!r} is not declared; declared: {[f.name for f in self.forms]}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.forms)

    def window_blocks(self, form: FormSpec) -> int:
        """Blocks before a resume point that a window form needs (ceil of window/block)."""
        return -(-form.window_tokens // self.block_size)


class FormSpecMismatch(ValueError):
    """State saved under one form spec offered to a reader expecting another."""

    def __init__(self, form: str, expected: FormSpec, got_digest: str, detail: str = "") -> None:
        self.form = form
        msg = (f"form {form!r}: stored state has spec {got_digest}, this model expects "
               f"{expected.spec_digest} ({expected.dtype}, layout v{expected.layout_version}, "
               f"params {dict(sorted(expected.params.items()))})")
        super().__init__(msg + (f": {detail}" if detail else ""))
