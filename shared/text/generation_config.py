"""What the worker takes from a checkpoint's ``generation_config.json``: end-of-sequence ids and
the sampling defaults of requests.

Fields used, validated at start (a wrong type refuses to start, naming the file and the field):

* ``eos_token_id`` — an id or a list of ids that end generation (merged with ``config.json``'s
  and the tokenizer's ``eos_token`` in :mod:`shared.text.tokenizer`);
* ``do_sample``, ``temperature``, ``top_p``, ``top_k`` — the defaults of a request that omits
  them (:class:`SamplingDefaults`). Every other field (``max_length``, ``repetition_penalty``,
  ...) is not used.

**The rule.** In transformers (``GenerationConfig.get_generation_mode``) the sampling fields
act only when ``do_sample`` is true; ``do_sample`` false or absent (its default is False) is
greedy decoding, and ``temperature`` / ``top_p`` / ``top_k`` are ignored (with a warning).
So here:

* ``do_sample: true`` — each of ``temperature``, ``top_p``, ``top_k`` the file sets is the
  default for a request that omits it; one it does not set keeps the API's default
  (temperature 1, top_p 1, top_k 0 = off; transformers' own fallback ``top_k`` 50 is a
  ``generate()`` default, not the checkpoint's choice, and is not applied). Values must lie in
  the API's ranges, since they become request values.
* ``do_sample`` false or absent — the file's sampling fields are ignored and the API's
  defaults apply. It does not make the API greedy: the OpenAI API samples at temperature 1
  unless the client sends ``temperature: 0``, and a ``generate()`` default does not change that.

A value the request sends always wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.text.checkpoint_files import CheckpointFileError, read_json_object

FILE = "generation_config.json"
#: ``max_tokens`` of a request that omits it (both endpoints; the gateway's rate limits estimate
#: a request's tokens with it too). Not the checkpoint's ``max_length``, which is not used.
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request gets for a sampling field it omits (the API's defaults unless a
    checkpoint's ``generation_config.json`` says otherwise; see the module docstring)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    #: Where the values come from: ``"api"`` or the generation_config.json path.
    source: str = "api"

    def resolve(self, temperature: float | None, top_p: float | None,
                top_k: int | None) -> tuple[float, float, int]:
        """``(temperature, top_p, top_k)`` of a request: its own values, else these."""
        return (self.temperature if temperature is None else temperature,
                self.top_p if top_p is None else top_p,
                self.top_k if top_k is None else top_k)


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """The used fields of ``generation_config.json`` as the file states them (None = absent)."""

    path: Path | None = None
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def sampling_defaults(self) -> SamplingDefaults:
        """The request defaults this file sets (the module docstring's rule)."""
        if self.do_sample is not True:
            return SamplingDefaults()
        return SamplingDefaults(*SamplingDefaults().resolve(self.temperature, self.top_p, self.top_k),
                                source=str(self.path))


def _number(path: Path, doc: dict[str, Any], field: str) -> float | None:
    v = doc.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CheckpointFileError(f"{path}: field {field}: expected a number or null, got {v!r}")
    return float(v)


def _int(path: Path, doc: dict[str, Any], field: str) -> int | None:
    v = doc.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CheckpointFileError(f"{path}: field {field}: expected an integer >= 0 or null, got {v!r}")
    return v


def eos_ids_of(path: Path, doc: dict[str, Any]) -> tuple[int, ...]:
    """``eos_token_id`` of a config document: an id, a list of ids, or absent/null.

    Raises :class:`CheckpointFileError` naming ``path`` for anything else.
    """
    v = doc.get("eos_token_id")
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointFileError(f"{path}: field eos_token_id: expected a token id, a list of token ids "
                                  f"or null, got {v!r}")
    return tuple(items)


def load_generation_config(model_dir: str | Path) -> GenerationConfig:
    """``<model_dir>/generation_config.json``, validated; an empty config when ``model_dir`` is
    empty or the file does not exist.

    Raises :class:`CheckpointFileError` (file and field named) for an unreadable file or a
    field of the wrong type.
    """
    if not model_dir:
        return GenerationConfig()
    path = Path(model_dir) / FILE
    doc = read_json_object(path)
    if doc is None:
        return GenerationConfig()
    do_sample = doc.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise CheckpointFileError(f"{path}: field do_sample: expected true, false or null, got {do_sample!r}")
    cfg = GenerationConfig(path=path, eos_token_ids=eos_ids_of(path, doc), do_sample=do_sample,
                           temperature=_number(path, doc, "temperature"), top_p=_number(path, doc, "top_p"),
                           top_k=_int(path, doc, "top_k"))
    if do_sample:
        # Only values that become request defaults must lie in the API's ranges.
        t, p = cfg.temperature, cfg.top_p
        if t is not None and not 0.0 <= t <= 2.0:
            raise CheckpointFileError(f"{path}: field temperature: {t!r} is outside the API's range [0, 2] "
                                      "(with do_sample true it is the default of every request)")
        if p is not None and not 0.0 < p <= 1.0:
            raise CheckpointFileError(f"{path}: field top_p: {p!r} is outside the API's range (0, 1] "
                                      "(with do_sample true it is the default of every request)")
    return cfg


__all__ = ["FILE", "GenerationConfig", "SamplingDefaults", "eos_ids_of", "load_generation_config"]
