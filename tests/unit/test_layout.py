"""The package's layout holds: rooms layered one way, no import circles, no reach into another module's private names."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import ROOT

PACKAGE = ROOT / "lowercache"

pytestmark = pytest.mark.quick


def test_import_contracts_are_kept():
    """pyproject's import-linter contracts: rooms layered, torch kept out of the fast path, no circles."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _contracts(kind: str) -> list[dict]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c for c in config["contracts"] if c["type"] == kind]


def test_the_design_doc_draws_the_layers_of_the_contract():
    """docs/design.md's Layout and pyproject's layers contract describe the flow the same way."""
    (contract,) = _contracts("layers")
    layers = [layer.replace("lowercache.", "") for layer in contract["layers"]]
    design = (ROOT / "docs" / "design.md").read_text()
    drawn = design.split("## Layout", 1)[1].split("```", 2)[1].strip().splitlines()
    assert drawn == layers


def _holds_code(path: Path) -> bool:
    """Whether a module holds more than a docstring (an ``__init__`` that only names its room does not)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def tree_rooms(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every folder of the package holding modules (``lowercache/cache/remote/``) and its modules' names; a dunder
    module (``__init__``, ``__main__``) only when it holds code."""
    rooms: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        modules = rooms.setdefault(path.parent.relative_to(package.parent).as_posix() + "/", set())
        if not path.stem.startswith("__") or _holds_code(path):
            modules.add(path.stem)
    return rooms


def table_rooms(design: str) -> dict[str, set[str]]:
    """The rooms of docs/design.md's layout table and the modules each row names (every backticked name)."""
    rooms: dict[str, set[str]] = {}
    for line in design.split("## Layout", 1)[1].splitlines():
        if line.startswith("| `lowercache"):
            room, modules = (cell.strip() for cell in line.split("|")[1:3])
            rooms[room.strip("`")] = set(re.findall(r"`([^`]+)`", modules))
    return rooms


def layout_mismatches(table: dict[str, set[str]], tree: dict[str, set[str]]) -> list[str]:
    """What the table and the tree disagree on, one line each."""
    found = [f"{room}: a room of the tree with no row" for room in sorted(tree.keys() - table.keys())]
    found += [f"{room}: a row for a room the tree does not have" for room in sorted(table.keys() - tree.keys())]
    for room in sorted(table.keys() & tree.keys()):
        found += [f"{room}{m}: in the tree, not in its row" for m in sorted(tree[room] - table[room])]
        found += [f"{room}{m}: in its row, not in the tree" for m in sorted(table[room] - tree[room])]
    return found


def test_the_design_docs_layout_table_lists_every_room_and_module():
    """docs/design.md's Layout table has one row per room and names every module in it, and nothing else: a module
    or room added, removed or renamed changes the table in the same commit."""
    mismatches = layout_mismatches(table_rooms((ROOT / "docs" / "design.md").read_text()), tree_rooms())
    assert not mismatches, "docs/design.md's layout table is out of step with lowercache/:\n" + "\n".join(mismatches)


def test_the_layout_check_finds_a_room_or_module_out_of_step(tmp_path):
    """The check itself can fail: a module the table lacks, a renamed one and a new room are each reported."""
    package = tmp_path / "lowercache"
    for module in ("__init__.py", "api.py", "cache/store.py", "cache/planted.py", "lowering/regions.py", "newroom/thing.py"):
        (package / module).parent.mkdir(parents=True, exist_ok=True)
        (package / module).write_text('"""A module."""\nx = 1\n')
    (package / "cache" / "__init__.py").write_text('"""Only a docstring: not listed."""\n')
    design = """## Layout

| room | modules | concern |
|---|---|---|
| `lowercache/` | `__init__`, `api` | the face |
| `lowercache/cache/` | `store` | the store |
| `lowercache/lowering/` | `region` | the flow |
"""
    assert layout_mismatches(table_rooms(design), tree_rooms(package)) == [
        "lowercache/newroom/: a room of the tree with no row",
        "lowercache/cache/planted: in the tree, not in its row",
        "lowercache/lowering/regions: in the tree, not in its row",
        "lowercache/lowering/region: in its row, not in the tree",
    ]


def test_the_fast_path_is_kept_from_torch_by_contract():
    kept = {m for c in _contracts("forbidden") if set(c["forbidden_modules"]) == {"torch", "executorch"} for m in c["source_modules"]}
    assert kept == {"lowercache.cli", "lowercache.direct", "lowercache.record", "lowercache.client", "lowercache.config",
                    "lowercache.cache.store", "lowercache.cache.tiers", "lowercache.cache.remote"}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(root: Path = ROOT) -> list[str]:
    """Every place a lowercache module under ``root`` imports or reads another lowercache module's underscore name."""
    found = []
    for path in sorted((root / "lowercache").rglob("*.py")):
        module = _module_name(path, root)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        modules_bound: dict[str, str] = {}  # local name -> lowercache module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node.level, node.module) if node.level else node.module or ""
                if source != "lowercache" and not source.startswith("lowercache."):
                    continue
                for alias in node.names:
                    if _private(alias.name) and source != module:
                        found.append(f"{path.relative_to(root)}:{node.lineno}: from {source} import {alias.name}")
                    modules_bound[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules_bound
                and _private(node.attr)
                and modules_bound[node.value.id] != module
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    assert private_reaches() == []


def test_the_check_finds_a_private_reach(tmp_path, monkeypatch):
    """The checker itself can fail: a reach into a private name, planted in a copy of the package (not the tree the
    other layout tests read, which may run at the same time), is reported."""
    shutil.copytree(PACKAGE, tmp_path / "lowercache", ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / "lowercache" / "cache" / "_planted_for_test.py"
    planted.write_text("from .store import _private_thing\nfrom . import steps\nx = steps._hidden\n")
    reaches = private_reaches(tmp_path)
    assert any("_planted_for_test.py:1: from lowercache.cache.store import _private_thing" in r for r in reaches)
    assert any("_planted_for_test.py:3: steps._hidden" in r for r in reaches)


def test_every_module_opens_with_a_docstring():
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.stat().st_size and ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert missing == []
