"""The grammar compiler's child process: ``python -m worker.grammar_child`` (started by
:mod:`worker.grammar_pool`, never by hand).

A client's grammar, regex, JSON schema or choice list is compiled here first, in a process of its
own, because llguidance's compile time and memory are the client's to choose: a 1 MB choice list
took ~50 s, and a Lark grammar of a few thousand chained rules overflows the compiler's stack (a
segfault) — on the worker's event loop both stalled or killed the worker. Here the parent can wait
for the answer without blocking, kill the child when the time budget runs out, and survive a
crash: the worker only ever builds a grammar in its own process once this child has compiled it
within the budget.

Imports only the standard library and llguidance (no torch: a child starts in ~0.2 s).

Protocol, on stdin/stdout, each message a 4-byte big-endian length and a JSON object:

1. the parent sends the tokenizer, once: ``{"byte_vocab": n}`` or ``{"hf_json": ..., "n_vocab": n,
   "eos": id}`` (what :func:`lltokenizer` reads); the child answers ``{"ok": true}``;
2. then per job ``{"kind": "json_schema" | "lark" | "regex", "text": ...}`` and the child answers
   ``{"ok": true, "grammar": <llguidance's grammar text>, "seconds": s}`` or ``{"ok": false,
   "error": message}``.

``argv[1]``: the child's address-space limit in MiB (0: none). The child exits when its stdin closes (the parent is gone) or on the parent's death signal.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from typing import Any, BinaryIO


#: How much lower than the worker's the compiler's CPU priority is (``nice``).
NICE = 10


class ByteVocab:
    """llguidance's view of the byte tokenizer: 256 one-byte tokens and a virtual end token."""

    def __init__(self, n: int) -> None:
        self.tokens = [bytes((i,)) for i in range(256)] + [b"<|kvl-end|>"] * (n - 256)
        self.eos_token_id = n - 1
        self.bos_token_id = None
        self.special_token_ids = [n - 1]

    def __call__(self, s: bytes | str) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode("utf-8"))


def lltokenizer(spec: dict[str, Any]) -> Any:
    """The ``llguidance.LLTokenizer`` a tokenizer spec names (the parent builds the same one).
    Raises ValueError for a tokenizer llguidance cannot map to bytes."""
    import llguidance

    if "byte_vocab" in spec:
        n = int(spec["byte_vocab"])
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocab(n)), n_vocab=n)
    return llguidance.LLTokenizer(spec["hf_json"], n_vocab=int(spec["n_vocab"]), eos_token=spec["eos"])


def grammar_of(kind: str, text: str) -> str:
    """llguidance's grammar text for a JSON schema (compact: no whitespace between tokens), a Lark
    grammar or a regex."""
    import llguidance

    M = llguidance.LLMatcher  # noqa: N806 - llguidance's class
    if kind == "json_schema":
        return M.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    if kind == "lark":
        return M.grammar_from_lark(text)
    if kind == "regex":
        return M.grammar_from_regex(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def compile_job(lltok: Any, kind: str, text: str) -> dict[str, Any]:
    """Compile one grammar as the worker will use it: validated, a matcher built and its first
    mask computed (so the parent's own build is known to be cheap enough)."""
    import llguidance

    t0 = time.perf_counter()
    try:
        grammar = grammar_of(kind, text)
    except (ValueError, TypeError, RuntimeError) as e:
        return {"ok": False, "error": str(e)}
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        return {"ok": False, "error": messages[0].strip() if messages else "?"}
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if m.is_error():
        return {"ok": False, "error": m.get_error()}
    m.compute_bitmask()
    return {"ok": True, "grammar": grammar, "seconds": time.perf_counter() - t0}


def read_msg(f: BinaryIO) -> Any:
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    body = f.read(n)
    return json.loads(body) if len(body) == n else None


def write_msg(f: BinaryIO, obj: Any) -> None:
    body = json.dumps(obj).encode()
    f.write(struct.pack(">I", len(body)) + body)
    f.flush()


def _die_with_parent() -> None:
    """Ask Linux for SIGTERM when the worker dies (set here, not in a ``preexec_fn``: the parent
    then spawns this process without a full fork); a parent already gone ends it now."""
    import ctypes
    import os
    import signal

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)    # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() == 1:
        sys.exit(0)


def main() -> int:
    import os
    import resource

    # NOTE: the protocol owns the real stdout; anything a library prints goes to stderr instead
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    # background work: the worker's event loop and model thread come first for the CPU
    os.nice(NICE)
    _die_with_parent()
    if len(sys.argv) > 1 and int(sys.argv[1]) > 0:
        # the memory budget: an allocation past it fails (the compile aborts) instead of the host's memory
        limit = int(sys.argv[1]) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    spec = read_msg(inp)
    if spec is None:
        return 0
    try:
        lltok = lltokenizer(spec)
    except ValueError as e:
        write_msg(out, {"ok": False, "error": str(e)})
        return 1
    write_msg(out, {"ok": True})
    while (job := read_msg(inp)) is not None:
        write_msg(out, compile_job(lltok, job["kind"], job["text"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
