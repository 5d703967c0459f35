"""The layout the project keeps: benchmarks, fuzzers, the soak program and demo peers live in launch/, not in the
library packages, and those packages never reach into launch/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("common", "producer", "trainer")
PROGRAMS = ("bench_", "demo", "fuzz", "soak")


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return {name.split(".")[0] for name in names}


def test_benchmarks_and_demo_programs_are_outside_the_library_packages():
    misplaced = [str(p.relative_to(ROOT)) for package in LIBRARY for p in (ROOT / package).glob("*.py")
                 if p.stem.startswith(PROGRAMS)]
    assert not misplaced, f"programs in a library package (move them to launch/): {misplaced}"


def test_library_packages_do_not_import_launch():
    offenders = [str(p.relative_to(ROOT)) for package in LIBRARY for p in (ROOT / package).rglob("*.py")
                 if "launch" in imported_packages(p)]
    assert not offenders, offenders
