"""docs/configuration.md is what launch/tools/config_docs.py writes from common/config/, field for field."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import common.config
from launch.tools import config_docs

ROOT = Path(__file__).resolve().parents[1]


def config_copy(tmp_path: Path, edit) -> object:
    """A copy of the config package whose ``target.py`` is changed by ``edit(source) -> source``, imported as a
    package of its own (its modules import each other relatively, so the copy's sections are the edited ones)."""
    name = f"config_copy_{uuid.uuid4().hex}"
    folder = tmp_path / name
    shutil.copytree(ROOT / "common" / "config", folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "target.py").write_text(edit((folder / "target.py").read_text()))
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the ClassVar annotations through it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for loaded in [key for key in sys.modules if key == name or key.startswith(name + ".")]:
            del sys.modules[loaded]
        raise
    return module


def add_target_field(source: str) -> str:
    """TargetConfig with one more field (documented, with its READ_BY entry), as another engineer would add one."""
    head, cls, body = source.partition("class TargetConfig")
    read_by = "READ_BY: ClassVar[dict[str, str]] = {"
    before, _, after = body.partition(read_by)
    fields, post_init, rest = after.partition("    def __post_init__")
    return (
        head
        + cls
        + before
        + read_by
        + '\n        "extra_knob": "trainer",'
        + fields
        + '    extra_knob: int = 0\n    """A field added without rerunning the generator."""\n\n'
        + post_init
        + rest
    )


def test_the_committed_page_is_what_the_generator_writes():
    page = config_docs.render(common.config)
    assert config_docs.differences(page, (ROOT / "docs" / "configuration.md").read_text()) == [], (
        f"docs/configuration.md is stale: run {config_docs.COMMAND}"
    )


def test_every_field_has_a_docstring_and_a_reader():
    sections = config_docs.sections(common.config)  # raises naming the key otherwise
    documented = {f.key for section in sections for f in section.fields}
    assert len(documented) > 50 and all(f.doc for section in sections for f in section.fields)
    assert all(section.doc for section in sections)


def test_every_field_of_every_section_has_its_row():
    import dataclasses
    import typing

    from common.drafter.kinds import KINDS

    page = (ROOT / "docs" / "configuration.md").read_text()
    for section in dataclasses.fields(common.config.RunConfig):
        cls = typing.get_type_hints(common.config.RunConfig)[section.name]
        for f in dataclasses.fields(cls):
            if "table_named_by" not in f.metadata:  # the drafter's options: one table per kind, below
                assert f"| `{section.name}.{f.name}` |" in page, f"{section.name}.{f.name}"
    for kind in KINDS.values():
        for name in kind.options.names():
            assert f"| `drafter.{kind.name}.{name}` |" in page, f"drafter.{kind.name}.{name}"


def test_the_check_names_a_field_added_without_rerunning_the_generator(tmp_path):
    changed = config_copy(tmp_path, add_target_field)
    assert [f.key for f in config_docs.sections(changed)[0].fields][-1] == "target.extra_knob"
    committed = config_docs.render(common.config)  # the page as committed with the config before the field
    found = config_docs.differences(config_docs.render(changed), committed)
    assert found == ["missing: target.extra_knob"], found


def test_the_check_names_a_row_removed_or_changed_by_hand():
    page = config_docs.render(common.config)
    without = "\n".join(line for line in page.splitlines() if not line.startswith("| `ring.credits` |")) + "\n"
    assert config_docs.differences(page, without) == ["missing: ring.credits"]
    edited = page.replace("| `training.lr` | number | `0.0006` |", "| `training.lr` | number | `0.001` |")
    assert edited != page and config_docs.differences(page, edited) == ["differs: training.lr"]


def test_a_field_without_a_docstring_is_an_error_naming_it(tmp_path):
    undocumented = config_copy(
        tmp_path,
        lambda source: re.sub(
            r'(\n    seed: int = 0\n)    """Seed of the random weights[^\n]*\n', r"\1", source, count=1
        ),
    )
    with pytest.raises(config_docs.ConfigDocError, match=r"target\.seed: no docstring"):
        config_docs.sections(undocumented)


def test_the_command_checks_and_writes(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_docs.render(common.config).replace("| `eval.paths` |", "| `eval.pathz` |"))
    command = [sys.executable, "-m", "launch.tools.config_docs", "--out", str(stale)]
    checked = subprocess.run([*command, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 1
    assert "missing: eval.paths" in checked.stderr and "not in common/config/: eval.pathz" in checked.stderr
    assert subprocess.run(command, cwd=ROOT, capture_output=True, timeout=120).returncode == 0
    assert subprocess.run([*command, "--check"], cwd=ROOT, capture_output=True, timeout=120).returncode == 0


def test_the_docs_anchors_into_benchmarks_and_docs_resolve():
    """Links such as BENCHMARKS.md#producer-27b land on an anchor that exists (an explicit id or a heading)."""

    def anchors(path: Path) -> set[str]:
        text = path.read_text()
        found = set(re.findall(r'<a id="([^"]+)"', text))
        for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
            slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            found.add(slug)
        return found

    for page in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")) or "#" not in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if linked.suffix == ".md":
                assert anchor in anchors(linked), f"{page.name} links {target}"
