"""The docs stand on this repository alone: every relative link in README.md and docs/*.md
names a file that exists here (and an anchor that exists in it), and none points outside."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


_HTML_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors for a file's headings (lowercase, punctuation dropped, spaces → '-') and
    its explicit ``<a id="...">`` anchors (BENCHMARKS.md's tables and run log use them)."""
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
        out.update(_HTML_ANCHOR.findall(line))
    return out


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repository(md: Path) -> None:
    bad = []
    for target in _LINK.findall(md.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{md.name}: " + "; ".join(bad)


def test_readme_points_to_the_architecture_in_the_repository() -> None:
    text = (ROOT / "README.md").read_text()
    assert "(docs/architecture.md)" in text
    assert "../shared/" not in text
    arch = (ROOT / "docs" / "architecture.md").read_text()
    for heading in ("## Processes", "## The replica life cycle", "## The worker life cycle", "## Invariants",
                    "## The protocol", "## What is durable when"):
        assert heading in arch, heading
