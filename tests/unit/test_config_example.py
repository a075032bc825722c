"""kvledger.example.yaml is generated from the schema (``kvledger.config_example``): every key,
with its default and its description, loading back to exactly the defaults; the checked-in
file is what the generator writes now, so a key added to shared/config.py without regenerating
fails here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvledger import config_example
from kvledger.config_reference import config_rows
from shared.config import Config, ServiceConfig, parse_config

ROOT = Path(__file__).parents[2]
REGENERATE = "run: python -m kvledger.config_example --write kvledger.example.yaml"


def _leaves(doc: dict[str, Any], path: tuple[str, ...] = ()) -> set[str]:
    out: set[str] = set()
    for k, v in doc.items():
        if isinstance(v, dict) and v:      # a section (an empty mapping is a key's value: version_weights)
            out |= _leaves(v, (*path, k))
        else:
            out.add(".".join((*path, k)))
    return out


def test_checked_in_example_is_the_generated_one() -> None:
    assert (ROOT / "kvledger.example.yaml").read_text() == config_example.render(), REGENERATE


def test_every_key_with_its_default_and_description() -> None:
    text = config_example.render()
    doc = yaml.safe_load(text)
    assert _leaves(doc) == {r["key"] for r in config_rows()}
    assert parse_config(doc) == Config()            # every value shown is the default
    # each key sits under its description (a comment line just above it)
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if ln.strip() and not ln.lstrip().startswith("#") and not ln.rstrip().endswith(":"):
            assert lines[i - 1].lstrip().startswith("#"), f"no description above {ln!r}"
    assert "# Tokens per block" in text and "  block_size: 16\n" in text
    assert "Allowed: refill, error." in " ".join(ln.strip("# ") for ln in lines)      # a choice's values


def test_a_new_key_changes_the_rendering(monkeypatch) -> None:
    """What makes the first test fail when someone adds a key and does not regenerate."""
    class Service(ServiceConfig, kw_only=True):
        #: Not a real key.
        brand_new_key: int = 7

    fields = {f.name: (f.type, msgspec.field(default_factory=f.default_factory) if f.default_factory
                       is not msgspec.NODEFAULT else f.default) for f in msgspec.structs.fields(Config)}
    fields["service"] = (Service, msgspec.field(default_factory=Service))
    Cfg = msgspec.defstruct("Config", [(k, t, d) for k, (t, d) in fields.items()], kw_only=True)
    monkeypatch.setattr(config_example, "Config", Cfg)
    text = config_example.render()
    assert "  brand_new_key: 7\n" in text and text != (ROOT / "kvledger.example.yaml").read_text()


def test_cli_prints_and_writes(tmp_path, capsys) -> None:
    from kvledger.cli import main

    assert main(["config", "example"]) == 0
    assert capsys.readouterr().out == config_example.render()
    out = tmp_path / "example.yaml"
    assert main(["config", "example", "--write", str(out)]) == 0
    assert out.read_text() == config_example.render()
