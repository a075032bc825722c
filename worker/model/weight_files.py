"""Safetensors files into a model: which files a checkpoint has, and the checked copy of every tensor.

Shared by the checkpoint loader (:mod:`worker.model.checkpoint`, every family, under each
family's names) and :func:`worker.model.weights.load_safetensors` (kvledger's own naming). Every
model tensor must be present with its shape, and a file tensor with no place is refused, so a
checkpoint that does not fit fails at start with :class:`WeightsError` naming the tensors.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

#: The dtypes a checkpoint may declare and hold its floating tensors in (config key worker.dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsError(ValueError):
    """A checkpoint does not fit the model: names, shapes or dtypes differ."""


def files_of(path: Path) -> list[Path]:
    """One safetensors file, or every ``*.safetensors`` file of a directory."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{path}: no *.safetensors files in this directory")
        return files
    if not path.exists():
        raise WeightsError(f"{path}: no such file")
    return [path]


def weight_files(directory: Path) -> list[Path]:
    """``model.safetensors.index.json``'s shards, else every ``*.safetensors`` file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from e
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise WeightsError(f"{index} names shards that are not in the directory: {missing}")
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors files and no model.safetensors.index.json")
    return files


def _where(files: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    if key in found:
                        raise WeightsError(f"tensor {key} appears in both {found[key].name} and {f.name}")
                    found[key] = f
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise WeightsError(f"{f}: not a readable safetensors file ({e})") from e
    return found


class _Files:
    """Every file of the checkpoint opened once (a header parse per file, not per tensor)."""

    def __init__(self, files: list[Path]) -> None:
        self._stack = contextlib.ExitStack()
        self._h = {f: self._stack.enter_context(safe_open(str(f), framework="pt")) for f in files}

    def get(self, path: Path, key: str) -> torch.Tensor:
        t = self._h[path].get_tensor(key)
        if t.dtype.is_floating_point and t.dtype not in DTYPES.values():
            raise WeightsError(f"tensor {key} in {path.name} is {t.dtype}: quantised weights are not supported")
        return t

    def close(self) -> None:
        self._stack.close()


@torch.no_grad()
def load_weights(model: torch.nn.Module, files: list[Path], target: Callable[[str], tuple[str, Any] | None], *,
                 ignore: Callable[[str], bool] = lambda k: False, optional: frozenset[str] = frozenset()) -> None:
    """Copy every tensor of ``model`` from the checkpoint, through ``target`` (checkpoint name →
    ``(our name, None)`` or ``(our name, (expert, slot))`` for stacked experts). Every tensor must
    be present with its shape; a checkpoint tensor with no place is an error (unless ``ignore``)."""
    expected = model.state_dict()
    found = _where(files)
    plain: dict[str, tuple[Path, str]] = {}
    pieces: dict[str, dict[tuple[int, int], tuple[Path, str]]] = {}
    extra = []
    for key, path in found.items():
        if ignore(key):
            continue
        t = target(key)
        if t is None or t[0] not in expected:
            extra.append(key)
        elif t[1] is None:
            plain[t[0]] = (path, key)
        else:
            pieces.setdefault(t[0], {})[t[1]] = (path, key)
    missing = sorted(k for k in expected if k not in plain and k not in pieces and k not in optional)
    if missing or extra:
        raise WeightsError(f"checkpoint does not match the model: missing {missing[:8]}"
                           f"{' …' if len(missing) > 8 else ''} ({len(missing)}), unexpected {sorted(extra)[:8]}"
                           f"{' …' if len(extra) > 8 else ''} ({len(extra)})")
    opened = _Files(files)
    try:
        _copy_all(expected, plain, pieces, opened)
    finally:
        opened.close()


def _copy_all(expected, plain, pieces, opened: _Files) -> None:
    for name, dest in expected.items():
        if name in plain:
            t = opened.get(*plain[name])
            src = plain[name][1]
        elif name in pieces:
            parts = pieces[name]
            n_exp, n_slot = dest.shape[0], 1 + max(s for _, s in parts)
            gaps = [(e, s) for e in range(n_exp) for s in range(n_slot) if (e, s) not in parts]
            if gaps or len(parts) != n_exp * n_slot:
                raise WeightsError(f"tensor {name}: the checkpoint lacks expert pieces {gaps[:4]} "
                                   f"(or has experts beyond n_routed_experts {n_exp})")
            t = torch.stack([torch.cat([opened.get(*parts[(e, s)]) for s in range(n_slot)], 0) for e in range(n_exp)])
            src = f"{name} (from {len(parts)} expert tensors)"
        else:
            continue
        if tuple(t.shape) != tuple(dest.shape):
            raise WeightsError(f"tensor {src}: shape {tuple(t.shape)} in the checkpoint, the model needs "
                               f"{tuple(dest.shape)}")
        if t.dtype.is_floating_point != dest.dtype.is_floating_point:
            raise WeightsError(f"tensor {src}: dtype {t.dtype} in the checkpoint, the model needs {dest.dtype}")
        dest.copy_(t)   # converts to the model's dtype
