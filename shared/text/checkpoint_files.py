"""Reading the JSON files of a checkpoint directory (``worker.model_dir``) as ``save_pretrained``
writes them: one reader, one error type, so every refusal names the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointFileError(ValueError):
    """A file in ``worker.model_dir`` cannot be used; the message names the file, the field and
    what is allowed. Raised at start: the worker refuses to serve rather than guess."""


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file.

    A file that exists but cannot be read, is not JSON or is not an object is an error: a
    checkpoint with a broken file is refused, not served as if the file were absent.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFileError(f"{path}: cannot read it: {e}") from e
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise CheckpointFileError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointFileError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


__all__ = ["CheckpointFileError", "read_json_object"]
