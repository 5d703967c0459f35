"""The layout the project keeps: benchmarks, fuzzers, the soak program and demo peers live in launch/, not in the
library packages, and those packages never reach into launch/. Producer and trainer meet only in common/."""

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


# What each library package may not import: producer and trainer share only common/, which stands alone.
FORBIDDEN = {"common": {"producer", "trainer", "launch"}, "producer": {"trainer", "launch"}, "trainer": {"producer", "launch"}}


def test_producer_and_trainer_meet_only_in_common():
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & forbidden)
                 for package, forbidden in FORBIDDEN.items() for p in (ROOT / package).rglob("*.py")
                 if imported_packages(p) & forbidden}
    assert not offenders, offenders


def test_the_layout_check_sees_an_import_across(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from producer.target import Target\n")  # inside a function counts too
    assert "producer" in imported_packages(module)
