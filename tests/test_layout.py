"""The layout the project keeps: the user's commands lie directly in launch/ (supervisor, status, check, ...);
the project's own instruments lie below it, the benchmarks in launch/bench/ and the fuzzers, the soak program and
the demo peers in launch/tools/. The library packages never reach into launch/, and neither they nor the user's
commands import an instrument. Producer and trainer meet only in common/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("common", "producer", "trainer")
PROGRAMS = ("bench", "coupled", "demo", "fuzz", "soak")  # file name prefixes of the instruments
INSTRUMENTS = ("launch.bench", "launch.tools")


def imported_modules(path: Path, package: tuple[str, ...] | None = None) -> set[str]:
    """Every module ``path`` imports, by its full name, anywhere in the file (inside functions too).
    ``from a import b`` counts as ``a`` and ``a.b`` (b may be a module); relative imports are resolved
    against ``package`` (by default the folder the file lies in, below the repository root)."""
    tree = ast.parse(path.read_text())
    if package is None:
        package = path.resolve().relative_to(ROOT).parent.parts if path.resolve().is_relative_to(ROOT) else ()
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - node.level + 1]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module
        if module:
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def imported_instruments(path: Path, package: tuple[str, ...] | None = None) -> set[str]:
    return {
        name
        for name in imported_modules(path, package)
        if any(name == i or name.startswith(i + ".") for i in INSTRUMENTS)
    }


def user_commands() -> list[Path]:
    """The modules of launch/ outside its instruments: what the user runs (and what those import)."""
    instruments = [ROOT / "launch" / "bench", ROOT / "launch" / "tools"]
    return sorted(p for p in (ROOT / "launch").rglob("*.py") if not any(p.is_relative_to(i) for i in instruments))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_benchmarks_and_demo_programs_are_outside_the_library_packages():
    misplaced = [
        str(p.relative_to(ROOT))
        for package in LIBRARY
        for p in (ROOT / package).glob("*.py")
        if p.stem.startswith(PROGRAMS)
    ]
    assert not misplaced, f"programs in a library package (move them to launch/bench/ or launch/tools/): {misplaced}"


def test_no_instrument_lies_beside_the_users_commands():
    misplaced = [str(p.relative_to(ROOT)) for p in user_commands() if p.stem.startswith(PROGRAMS)]
    assert not misplaced, f"instruments directly in launch/ (move them to launch/bench/ or launch/tools/): {misplaced}"
    assert (ROOT / "launch" / "bench" / "__init__.py").is_file() and (
        ROOT / "launch" / "tools" / "__init__.py"
    ).is_file()


def test_every_module_beside_the_users_commands_serves_them():
    """A module of launch/ outside the instruments is a command (it runs as ``python -m``) or what a command or the
    library imports; one that only an instrument imports (as launch/memory.py was, for the kinds benchmark alone)
    belongs beside it, in launch/bench/ or launch/tools/."""
    modules = [p for p in user_commands() if p.name != "__init__.py"]
    served = {name for p in modules for name in imported_modules(p)}
    served |= {name for package in LIBRARY for p in (ROOT / package).rglob("*.py") for name in imported_modules(p)}
    stray = [
        str(p.relative_to(ROOT)) for p in modules if "__main__" not in p.read_text() and module_name(p) not in served
    ]
    assert not stray, f"modules of launch/ that no command uses (move them beside their instrument): {stray}"


def test_library_packages_do_not_import_launch():
    offenders = [
        str(p.relative_to(ROOT))
        for package in LIBRARY
        for p in (ROOT / package).rglob("*.py")
        if "launch" in imported_packages(p)
    ]
    assert not offenders, offenders


def test_neither_the_library_nor_the_users_commands_import_an_instrument():
    files = [p for package in LIBRARY for p in (ROOT / package).rglob("*.py")] + user_commands()
    offenders = {str(p.relative_to(ROOT)): sorted(imported_instruments(p)) for p in files if imported_instruments(p)}
    assert not offenders, offenders


# What each library package may not import: producer and trainer share only common/, which stands alone.
FORBIDDEN = {
    "common": {"producer", "trainer", "launch"},
    "producer": {"trainer", "launch"},
    "trainer": {"producer", "launch"},
}


def test_producer_and_trainer_meet_only_in_common():
    offenders = {
        str(p.relative_to(ROOT)): sorted(imported_packages(p) & forbidden)
        for package, forbidden in FORBIDDEN.items()
        for p in (ROOT / package).rglob("*.py")
        if imported_packages(p) & forbidden
    }
    assert not offenders, offenders


def test_the_layout_check_sees_an_import_across(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from producer.target import Target\n")  # inside a function counts too
    assert "producer" in imported_packages(module)


def test_the_layout_check_sees_an_instrument_imported(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from launch import status\n\ndef f():\n    from launch.bench.util import synchronize\n")
    assert imported_instruments(module) == {"launch.bench.util", "launch.bench.util.synchronize"}
    module.write_text("from launch import tools\nimport launch.progress\n")  # the package itself counts too
    assert imported_instruments(module) == {"launch.tools"}
    module.write_text("from launch import status, mps\nimport launch.progress\n")  # a user command is no instrument
    assert not imported_instruments(module)
    module.write_text("from .tools import fuzz\nfrom . import bench\n")  # relative, as in a module of launch/
    assert imported_instruments(module, package=("launch",)) == {"launch.tools", "launch.tools.fuzz", "launch.bench"}


MAX_FUNCTION_LINES, MAX_CLASS_LINES, MAX_COMMAND_LINES = 60, 300, 4000
"""The house's sizes: a function a reader takes in at once, a class of one role, launch/'s own modules (the user's
commands and the launcher) beside its instruments."""


def test_no_function_or_class_outgrows_a_reading_and_the_users_commands_stay_small():
    too_long = []
    for package in (*LIBRARY, "launch"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    limit = MAX_FUNCTION_LINES
                elif isinstance(node, ast.ClassDef):
                    limit = MAX_CLASS_LINES
                else:
                    continue
                if (lines := node.end_lineno - node.lineno + 1) > limit:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.name} {lines} lines")
    assert not too_long, too_long
    assert sum(len(path.read_text().splitlines()) for path in user_commands()) < MAX_COMMAND_LINES
