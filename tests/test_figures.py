"""Every figure the README, the docs and the presets quote from BENCHMARKS.md is there, in the section they name.

A sentence (of a paragraph, a list item, a table row or a preset's comment) that names BENCHMARKS.md quotes it: it
must name the section too (``BENCHMARKS.md#anchor``), and each of its figures must appear in that section or in the
section's row of the current-figures table, as written or rounded to fewer decimals (3.538 may be quoted as 3.54,
never as 3.5x anything else). Rows of a history table marked superseded do not count: a figure they alone hold is
not current. A table whose introducing sentence names a section quotes it in every row. A sentence that gives a
measured figure (tau, samples/s, tokens/s, MFU) or names a benchmark (``launch.bench.NAME``) must name its section.
A table row that links a section in its first cell mirrors the current-figures table: its figures are that row's. What is not a figure: anything in code spans
or code blocks, dates, versions, identifiers (Qwen3-8B, H200, fp32, step-1400), issue and arXiv numbers, and
integers below 10.

    pytest tests/test_figures.py        # ``unquoted(root)`` lists, for any tree, what fails
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CURRENT_TABLE = "the-current-figures"

ANCHOR_REF = re.compile(r"BENCHMARKS\.md#([a-z0-9-]+)")
ANCHOR_ID = re.compile(r'<a id="([^"]+)"></a>')
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
NOT_FIGURES = [
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),  # dates
    re.compile(r"\b\d+(?:\.\d+){2,}\b"),  # versions
    re.compile(r"\b(?:issues?|arXiv|PR|pull request)\s+\d[\d.]*(?:\s+and\s+\d+)?", re.IGNORECASE),
]
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(x\b|(?![\w.]\d|[A-Za-z]))")
MEASURED = re.compile(
    r"\b(?:tau|acceptance length)\b[^.;:()]{0,16}?\d|\d\s*(?:samples|tokens|answers|steps)/s\b|\d%\s*MFU|"
    r"\bMFU\s+\d",
    re.IGNORECASE,
)
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z(\[*])")


def figures(text: str) -> list[str]:
    """The figures of ``text``, as written (commas dropped)."""
    text = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", text))
    for pattern in NOT_FIGURES:
        text = pattern.sub(" ", text)
    found = []
    for match in NUMBER.finditer(text):
        whole, decimals = match.group(1).replace(",", ""), match.group(2) or ""
        if not decimals and (int(whole) < 10 or ("," not in match.group(1) and 1990 <= int(whole) < 2100)):
            continue  # a count below 10, or a year
        found.append(whole + decimals)
    return found


def matches(quoted: str, source: str) -> bool:
    """``quoted`` is ``source`` as written or rounded to fewer decimals."""
    q, s = Decimal(quoted), Decimal(source)
    if q == s:
        return True
    places = -q.as_tuple().exponent
    if places >= -s.as_tuple().exponent:
        return False
    step = Decimal(1).scaleb(-places)
    return q in (s.quantize(step, ROUND_HALF_UP), s.quantize(step, ROUND_HALF_EVEN))


def benchmark_sections(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Each anchor of BENCHMARKS.md: its section's current text (to the next anchor; superseded table rows left
    out) with its rows of the current-figures table, and those rows alone."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        ids = ANCHOR_ID.findall(line)
        if ids:
            current = []
            for anchor in ids:
                sections[anchor] = current
            continue
        if re.match(r"#+\s+the current figures\s*$", line, re.IGNORECASE):
            current = sections.setdefault(CURRENT_TABLE, [])
        if current is None:
            continue
        if line.startswith("|") and "superseded" in line.lower():
            continue
        current.append(line)
    rows: dict[str, list[str]] = {}
    for row in sections.get(CURRENT_TABLE, []):
        for anchor in re.findall(r"\]\(#([a-z0-9-]+)\)", row):
            if anchor in sections:
                sections[anchor].append(row)
                rows.setdefault(anchor, []).append(row)
    return (
        {anchor: "\n".join(lines) for anchor, lines in sections.items()},
        {anchor: "\n".join(lines) for anchor, lines in rows.items()},
    )


def markdown_units(text: str) -> list[tuple[int, str, set[str]]]:
    """(line, text, inherited anchors) of each paragraph, list item and table row outside code blocks; a table
    inherits the anchors of the sentence that introduces it."""
    units: list[tuple[int, str, set[str]]] = []
    block: list[str] = []
    start = 0
    fenced = False
    table_anchors: set[str] = set()

    def flush():
        if block:
            units.append((start, " ".join(block), set()))
            block.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        stripped = line.strip()
        if stripped.startswith("|"):
            if not block and units and not units[-1][1].startswith("|") and units[-1][1].rstrip().endswith(":"):
                table_anchors = set(ANCHOR_REF.findall(units[-1][1]))
            elif block:
                table_anchors = set(ANCHOR_REF.findall(block[-1])) if block[-1].rstrip().endswith(":") else set()
            flush()
            units.append((number, stripped, set(table_anchors)))
            continue
        table_anchors = set()
        if not stripped or stripped.startswith("#") or stripped.startswith("<"):
            flush()
            continue
        if re.match(r"([-*]|\d+\.)\s", stripped):
            flush()
        if not block:
            start = number
        block.append(stripped)
    flush()
    return units


def toml_units(text: str) -> list[tuple[int, str, set[str]]]:
    """(line, text, no anchors) of each run of whole-line comments and of each trailing comment."""
    units: list[tuple[int, str, set[str]]] = []
    block: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            body = stripped.lstrip("#").strip()
            if body.startswith(("launch/run_all.sh", ".venv/", "python ", "GGUF=", "drafter.", "data.")):
                continue  # a command the comment shows: code
            if not block:
                start = number
            block.append(body)
            continue
        if block:
            units.append((start, " ".join(block), set()))
            block = []
        if "#" in line and not stripped.startswith("["):
            comment = line.split("#", 1)[1] if '"' not in line.split("#", 1)[0].split("=", 1)[-1] else ""
            if comment:
                units.append((number, comment.strip(), set()))
    if block:
        units.append((start, " ".join(block), set()))
    return units


def texts(root: Path) -> list[Path]:
    return [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "launch").glob("*.toml")),
    ]


def unquoted(root: Path) -> list[str]:
    """Every figure of ``root``'s README, docs and presets that its BENCHMARKS.md does not hold where it is quoted
    from, and every quote or measured figure that names no section: ``file:line: what``."""
    sections, current_rows = benchmark_sections((root / "BENCHMARKS.md").read_text())
    problems = []
    for path in texts(root):
        if not path.is_file():
            continue
        name = path.relative_to(root)
        units = toml_units(path.read_text()) if path.suffix == ".toml" else markdown_units(path.read_text())
        for line, unit, inherited in units:
            for sentence in SENTENCE_END.split(unit) if not unit.startswith("|") else [unit]:
                anchors = set(ANCHOR_REF.findall(sentence)) | inherited
                numbers = figures(sentence)
                names_benchmarks = "BENCHMARKS.md" in sentence or inherited
                if not anchors:
                    if numbers and names_benchmarks:
                        problems.append(f"{name}:{line}: quotes BENCHMARKS.md without naming the section: {sentence}")
                    elif numbers and (MEASURED.search(CODE_SPAN.sub(" ", sentence)) or "launch.bench." in sentence):
                        problems.append(
                            f"{name}:{line}: a measured figure without its BENCHMARKS.md section: {sentence}"
                        )
                    continue
                missing = [a for a in anchors if a not in sections]
                if missing:
                    problems.append(f"{name}:{line}: no such BENCHMARKS.md section {missing}")
                    continue
                # a table row that links its figure's section in its first cell mirrors the current-figures table
                first_cell = sentence.split("|")[1] if sentence.startswith("|") else ""
                own = set(ANCHOR_REF.findall(first_cell))
                if own and all(a in current_rows for a in own):
                    source = figures("\n".join(current_rows[a] for a in own))
                else:
                    source = figures("\n".join(sections[a] for a in anchors))
                for number in numbers:
                    if not any(matches(number, s) for s in source):
                        problems.append(f"{name}:{line}: {number} is not in BENCHMARKS.md#{'/#'.join(sorted(anchors))}")
    return problems


def test_every_quoted_figure_is_in_the_section_it_names():
    problems = unquoted(ROOT)
    assert not problems, "\n" + "\n".join(problems)


def test_the_check_finds_a_figure_that_is_not_there(tmp_path):
    """The checker itself: a superseded figure, a figure of another section and a quote without a section fail; the
    current figure, rounded, passes."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "launch").mkdir()
    (tmp_path / "BENCHMARKS.md").write_text(
        "## The current figures\n\n| what | figure |\n|---|---|\n| [the step](#step) | 6.93 samples/s |\n\n"
        '<a id="step"></a>\n## Step\n\n| date | figure |\n|---|---|\n| 1 | 6.23 samples/s, 57.8% MFU |\n'
        "| 0 | 7.05 samples/s; superseded by `c35741c` |\n\n"
        '<a id="ring"></a>\n## Ring\n\n349 GB/s.\n'
    )
    readme = tmp_path / "README.md"
    readme.write_text("The step trains 6.2 samples/s at 57.8% MFU ([step](BENCHMARKS.md#step)).\n")
    assert unquoted(tmp_path) == []
    for wrong in [
        "The step trains 7.05 samples/s ([step](BENCHMARKS.md#step)).",  # superseded
        "The step trains 349 samples/s ([step](BENCHMARKS.md#step)).",  # another section's
        "The step trains 6.93 samples/s ([BENCHMARKS.md](BENCHMARKS.md)).",  # no section named
        "The step trains 6.93 samples/s.",  # a measured figure, no section
    ]:
        readme.write_text(wrong + "\n")
        assert len(unquoted(tmp_path)) == 1, wrong
