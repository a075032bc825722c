"""The config sections' base (``_Section``) and value types, which every module of sections imports."""

from __future__ import annotations

from typing import Annotated

import msgspec

Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass
