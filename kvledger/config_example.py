"""``kvledger.example.yaml``, generated from the schema so that it lists every key.

Each key of :class:`shared.config.Config` is written with its default, under the comment written
beside its field in ``shared/config.py`` (``#:`` lines; else :data:`kvledger.config_reference.EXTRA`)
and, for a choice, the values allowed; a section's docstring heads the section. The file loads
to exactly the defaults. A unit test fails when the checked-in file differs from what this
renders, so a key added to the schema is added here by running::

    python -m kvledger.config_example --write kvledger.example.yaml    # or: kvledger config example --write …
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import msgspec

from kvledger.config_reference import EXAMPLE, SECTION_MODULES, _default, _field_comments, descriptions
from shared.config import Config

WIDTH = 100

HEADER = """\
# kvledger configuration: every key, shown with its default (every key is optional).
# Generated from shared/config.py: python -m kvledger.config_example --write kvledger.example.yaml
# (a test fails when this file is out of date; edit the comments there, not here).
# Any key can be overridden by an environment variable KVL_<SECTION>__<KEY>, e.g.
#   KVL_CACHE__BLOCK_SIZE=32   KVL_CACHE__HIT_VALIDATION__CHECK_TAIL=false
# plus the short forms KVL_DATABASE_URL, KVL_NATS_URL and KVL_STATE_DIR. Unknown keys are errors.
"""


def _struct(t: Any) -> type[msgspec.Struct] | None:
    return t if isinstance(t, type) and issubclass(t, msgspec.Struct) else None


def _base(t: Any) -> Any:
    return typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t


def _scalar(v: Any) -> str:
    """A YAML flow value that loads back to ``v``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        # NOTE: JSON strings are YAML; plain only where YAML reads the same string back
        plain = v and v.replace("_", "").replace("-", "").replace(".", "").replace("/", "").replace(":", "").isalnum()
        return v if plain and not v[0].isdigit() and v.lower() not in ("true", "false", "null", "yes", "no",
                                                                        "on", "off", "y", "n", "~") else json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_scalar(str(k))}: {_scalar(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no YAML form for default {v!r}")


def _comment(text: str, indent: str) -> list[str]:
    text = " ".join(text.replace("``", "`").split())
    return [f"{indent}# {ln}" for ln in textwrap.wrap(text, WIDTH - len(indent) - 2, break_on_hyphens=False)]


def _choices(t: Any) -> str:
    t = _base(t)
    if typing.get_origin(t) is typing.Literal:
        return "Allowed: " + ", ".join(map(str, typing.get_args(t))) + "."
    if typing.get_origin(t) is list:
        inner = _base(typing.get_args(t)[0])
        if typing.get_origin(inner) is typing.Literal:
            return "Each of: " + ", ".join(map(str, typing.get_args(inner))) + "."
    return ""


def render() -> str:
    """The whole example file."""
    docs, described = _field_comments(), descriptions()
    out = [HEADER.rstrip("\n")]

    def walk(struct: type[msgspec.Struct], path: list[str], depth: int) -> None:
        indent = "  " * depth
        for f in msgspec.structs.fields(struct):
            dotted = ".".join([*path, f.name])
            sub = _struct(f.type)
            if depth == 0:
                out.append("")
            if sub is not None:
                doc = (sub.__doc__ or "").strip() if sub.__doc__ != msgspec.Struct.__doc__ else ""
                lines = _comment(doc, indent) if doc and sub.__module__ in SECTION_MODULES else []
                out.extend(lines)
                out.append(f"{indent}{f.name}:")
                walk(sub, [*path, f.name], depth + 1)
                continue
            text = described.get(dotted) or docs.get((struct.__name__, f.name), "")
            if _choices(f.type):
                text = (text.rstrip() + ("" if text.rstrip().endswith((".", ")")) else ".") + " "
                        if text else "") + _choices(f.type)
            out.extend(_comment(text, indent))
            default = _default(f)
            item = _struct(_base(typing.get_args(_base(f.type))[0])) if typing.get_origin(_base(f.type)) is list \
                else None
            out.append(f"{indent}{f.name}: {_scalar(default)}")
            if item is not None:        # a list of records (auth.keys): each field, as a commented entry
                out.append(f"{indent}# Each entry:")
                for i, g in enumerate(msgspec.structs.fields(item)):
                    gd = _default(g)
                    value = "(required)" if gd is msgspec.NODEFAULT else _scalar(gd)
                    about = docs.get((item.__name__, g.name), "")
                    text = " ".join(f"{g.name}: {value}{f'  -- {about}' if about else ''}".replace("``", "`").split())
                    out.extend(textwrap.wrap(text, WIDTH, initial_indent=f"{indent}#   {'- ' if i == 0 else '  '}",
                                             subsequent_indent=f"{indent}#       ", break_on_hyphens=False))
    walk(Config, [], 0)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.config_example", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", metavar="FILE", nargs="?", const=str(EXAMPLE),
                   help=f"write it to FILE (default {EXAMPLE.name} at the repository root) instead of printing it")
    args = p.parse_args(argv)
    return run(args.write)


def run(write: str | None) -> int:
    text = render()
    if write:
        Path(write).write_text(text)
        print(f"wrote {write}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
