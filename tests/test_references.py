"""Every cross-reference of the project's own text resolves: Markdown links into the repository (file and anchor),
``BENCHMARKS.md#anchor`` written in presets and scripts, and section references written as ``README "Title"`` or
``docs/NAME.md "Title"`` (a heading of that file starts with the title)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    ROOT / "README.md",
    ROOT / "BENCHMARKS.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "launch").glob("*.toml")),
    *sorted((ROOT / "launch").glob("*.sh")),
    *sorted(p for folder in ("common", "producer", "trainer", "launch") for p in (ROOT / folder).rglob("*.py")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE_ANCHOR = re.compile(r"\b((?:\.\./)?(?:BENCHMARKS|README)\.md|docs/[a-z_]+\.md)#([a-z0-9-]+)")
SECTION = re.compile(r'\b(README|(?:docs/)?[a-z_]+\.md)\s+"([^"]+)"')


def headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found = set(re.findall(r'<a id="([^"]+)"', text))
    for title in headings(path):
        slug = re.sub(r"[^a-z0-9 -]", "", title.lower()).strip().replace(" ", "-")
        found.add(slug)
    return found


def document(name: str, source: Path) -> Path:
    if name == "README":
        return ROOT / "README.md"
    candidate = (source.parent / name) if source.suffix == ".md" else ROOT / name
    return candidate if candidate.is_file() else ROOT / "docs" / Path(name).name


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_resolves(path: Path):
    text = path.read_text()
    broken = []
    targets = [(m.group(1), path.parent) for m in LINK.finditer(text) if path.suffix == ".md"]
    if path.suffix != ".md":  # in Markdown the links above hold them
        targets += [(f"{m.group(1)}#{m.group(2)}", ROOT) for m in BARE_ANCHOR.finditer(text)]
    for target, base in targets:
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        file = (base / file_part).resolve() if file_part else path
        if not file.is_file() and file_part.startswith("../"):
            file = (ROOT / file_part.removeprefix("../")).resolve()
        if not file.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such anchor")
    for match in SECTION.finditer(text):
        name, title = match.group(1), " ".join(match.group(2).split())
        file = document(name, path)
        if not file.is_file():
            broken.append(f'{name} "{title}": no such file')
        elif not any(h.startswith(title) for h in headings(file)):
            broken.append(f'{name} "{title}": no such section')
    assert not broken, broken
