"""The key's own-code part covers what byte-shaping code imports (docs/design.md, Keys cover lowercache itself)."""

from __future__ import annotations

import ast
import os
import shutil
import sys
from pathlib import Path

import pytest

from lowercache.cache import toolchain

pytestmark = pytest.mark.quick


def _module_file(package: str, dotted: str) -> str | None:
    """``lowercache.a.b`` as a path relative to ``package`` (``a/b.py`` or ``a/b/__init__.py``); None if neither."""
    parts = dotted.split(".")[1:]
    for candidate in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if parts and os.path.isfile(os.path.join(package, candidate)):
            return candidate
    return None


def _imported(package: str, module: str) -> set[str]:
    """The lowercache modules ``module`` (a path relative to ``package``) imports, anywhere in its code."""
    dotted = "lowercache." + module.removesuffix(".py").replace("/", ".")
    here = dotted.removesuffix(".__init__") if module.endswith("__init__.py") else dotted.rsplit(".", 1)[0]
    tree = ast.parse(Path(package, module).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            names |= {source, *(f"{source}.{a.name}" for a in node.names)}
    found = {_module_file(package, n) for n in names if n.split(".")[0] == "lowercache"}
    return {f for f in found if f is not None}


def unlisted(package: str) -> dict[str, list[str]]:
    """Modules imported by byte-shaping code that are neither hashed nor excluded with a reason: module -> importers."""
    hashed = set(toolchain.byte_shaping_modules(package))
    missing: dict[str, list[str]] = {}
    for module in sorted(hashed):
        for imported in sorted(_imported(package, module)):
            if imported not in hashed and imported not in toolchain.NOT_BYTE_SHAPING:
                missing.setdefault(imported, []).append(module)
    return missing


def test_every_import_of_byte_shaping_code_is_hashed_or_excluded_with_a_reason():
    assert unlisted(toolchain._PACKAGE) == {}
    assert all(reason.strip() for reason in toolchain.NOT_BYTE_SHAPING.values())


def test_a_new_import_of_unlisted_code_is_found(tmp_path):
    package = tmp_path / "lowercache"
    shutil.copytree(toolchain._PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    flow = package / "lowering" / "flow.py"
    flow.write_text(flow.read_text() + "\n\ndef _late():\n    from ..watch import watch  # noqa: F401\n")
    assert unlisted(str(package)) == {"watch.py": ["lowering/flow.py"]}


def test_delegation_is_in_the_key():
    """Its section is stored with the flow entry, so an edit to it must change every key."""
    assert "delegation.py" in toolchain.byte_shaping_modules()


def _read_digest(root: Path) -> str:
    """``source_digest`` without its memo: every file read."""
    import xxhash

    h = xxhash.xxh3_128()
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(dirs)
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(directory, name)
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def test_the_source_digest_memo_answers_only_while_no_file_moved(tmp_path):
    """A hit stats the Arm backend's files instead of reading them; an edit in place (same size) is still seen."""
    root = tmp_path / "backend"
    (root / "passes").mkdir(parents=True)
    (root / "a.py").write_text("X = 1\n")
    (root / "passes" / "b.py").write_text("Y = 2\n")
    first = toolchain.source_digest(str(root))
    assert first == toolchain.source_digest(str(root)) == _read_digest(root)
    (root / "passes" / "b.py").write_text("Y = 3\n")
    assert toolchain.source_digest(str(root)) == _read_digest(root) != first
    (root / "passes" / "c.py").write_text("")
    assert toolchain.source_digest(str(root)) == _read_digest(root)


def test_the_versions_memo_follows_installs_upgrades_and_edits(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def install(version: str) -> None:
        for old in site.glob("fakedist-*.dist-info"):
            shutil.rmtree(old)
        (site / f"fakedist-{version}.dist-info").mkdir()
        (site / f"fakedist-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakedist\nVersion: {version}\n")

    names = ("fakedist", "torch")
    assert toolchain.versions(names) == {"fakedist": "absent", "torch": toolchain.version("torch")}
    install("1.0")
    assert toolchain.versions(names)["fakedist"] == toolchain.version("fakedist") == "1.0"
    assert toolchain.versions(names)["fakedist"] == "1.0"  # from the memo
    install("2.0")
    assert toolchain.versions(names)["fakedist"] == "2.0"
    (site / "fakedist-2.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 2.0.1\n")
    assert toolchain.versions(names)["fakedist"] == toolchain.version("fakedist") == "2.0.1"


def test_the_versions_memo_keeps_one_entry_per_search_path(tmp_path, monkeypatch):
    """The client, the server's child and ``python -m`` search different paths: each finds its own entry, so a direct-mode
    hit after a lowering through the server does not search again; a path of its own still sees its own installs."""
    import importlib.metadata

    searches, torch = [], toolchain.version("torch")
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: searches.append(name) or real(name))
    client, server, path = tmp_path / "client", tmp_path / "server", list(sys.path)
    client.mkdir(), server.mkdir()

    def versions_from(place: Path, names: tuple[str, ...] = ("torch",)) -> dict[str, str]:
        monkeypatch.setattr(sys, "path", [str(place), *path])
        return toolchain.versions(names)

    for place in (client, server, client, server, client):
        assert versions_from(place) == {"torch": torch}
    assert searches == ["torch", "torch"]  # one search per path, then the memo
    (server / "fakedist-1.0.dist-info").mkdir()
    (server / "fakedist-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 1.0\n")
    assert versions_from(server, ("fakedist", "torch"))["fakedist"] == "1.0"
    assert versions_from(client, ("fakedist", "torch"))["fakedist"] == "absent"


def test_the_source_digest_memo_sees_files_added_removed_renamed_and_skips_tests(tmp_path):
    """The memo lists the files and stats the directories: no walk while none moved, and every kind of move is seen."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.py").write_text("A = 1\n")
    (root / "b.fbs").write_text("table T {}\n")
    digest = toolchain.source_digest(str(root), suffixes=(".py", ".fbs"))

    def fresh() -> str:
        return toolchain.source_digest(str(root), suffixes=(".py", ".fbs"))

    (root / "sub" / "deeper").mkdir()
    (root / "sub" / "deeper" / "c.py").write_text("C = 3\n")  # a new file in a new directory: only its parent moved
    added = fresh()
    assert added != digest
    (root / "sub" / "deeper" / "c.py").rename(root / "sub" / "deeper" / "d.py")
    renamed = fresh()
    assert renamed not in (digest, added)
    (root / "sub" / "deeper" / "d.py").unlink()
    (root / "sub" / "deeper").rmdir()
    assert fresh() == digest
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("X = 1\n")
    (root / "notes.txt").write_text("not code\n")
    assert fresh() == digest
    (root / "b.fbs").write_text("table U {}\n")
    assert fresh() != digest


def test_a_hashed_package_counts_its_data_files_not_its_headers_or_libraries(tmp_path):
    root = tmp_path / "pkg"
    (root / "include").mkdir(parents=True)
    (root / "ops.yaml").write_text("- op: add\n")
    (root / "bin").mkdir()
    (root / "bin" / "flatc").write_bytes(b"\x7fELF 1")

    def whole() -> str:
        return toolchain.source_digest(str(root), every_file=True)

    digest = whole()
    (root / "include" / "a.h").write_text("int a;\n")
    (root / "_ext.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (root / "stub.pyi").write_text("X: int\n")
    assert whole() == digest
    (root / "ops.yaml").write_text("- op: sub\n")
    edited = whole()
    assert edited != digest
    (root / "bin" / "flatc").write_bytes(b"\x7fELF 2")
    assert whole() not in (digest, edited)


def test_an_edit_to_a_hashed_package_that_no_one_imported_changes_the_toolchain(tmp_path, monkeypatch):
    """A lowering imports some modules only when it needs them: the key covers the whole package, not what is imported."""
    site = tmp_path / "site"
    (site / "fakestack" / "passes").mkdir(parents=True)
    (site / "fakestack" / "__init__.py").write_text("")
    (site / "fakestack" / "passes" / "late.py").write_text("SCALE = 1\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(toolchain, "HASHED_PACKAGES", (*toolchain.HASHED_PACKAGES, "fakestack"))
    toolchain.forget_parts()
    before = toolchain.toolchain_parts()["fakestack_src"]
    toolchain.forget_parts()
    (site / "fakestack" / "passes" / "late.py").write_text("SCALE = 2\n")
    after = toolchain.toolchain_parts()["fakestack_src"]
    toolchain.forget_parts()
    assert "fakestack.passes.late" not in __import__("sys").modules
    assert before != after


def _copies(tmp_path: Path, package: str, module: str, sites: tuple[str, ...]) -> dict[str, Path]:
    """A copy of ``package`` in each of ``sites`` (directories below ``tmp_path``), its ``module`` setting SCALE to the
    copy's number (1, 2, ...): site name -> site directory."""
    copies = {}
    for scale, name in enumerate(sites, 1):
        site = tmp_path / name
        (site / package).mkdir(parents=True)
        (site / package / module).write_text(f"SCALE = {scale}\n")
        copies[name] = site
    return copies


def test_a_namespace_packages_part_stays_with_the_portion_its_modules_came_from(tmp_path, monkeypatch):
    """ExecuTorch is a namespace package: a script that puts a vendored copy first on its search path moves the
    package's search locations, not the modules already imported; the part must not move to the copy's files while
    the installed ones run (then an edit of the installed ones would go unseen)."""
    import sys

    copies = _copies(tmp_path, "fakens", "mod.py", ("installed", "vendored"))
    monkeypatch.setattr(toolchain, "HASHED_PACKAGES", (*toolchain.HASHED_PACKAGES, "fakens"))
    monkeypatch.syspath_prepend(str(copies["installed"]))
    for name in ("fakens", "fakens.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    toolchain.forget_parts()
    __import__("fakens.mod")
    installed = toolchain.toolchain_parts()["fakens_src"]
    monkeypatch.syspath_prepend(str(copies["vendored"]))
    assert toolchain.package_dirs()[-1] == str(copies["installed"] / "fakens")
    assert toolchain.toolchain_parts()["fakens_src"] == installed
    (copies["installed"] / "fakens" / "mod.py").write_text("SCALE = 3\n")  # an edit of the code that runs
    toolchain.forget_parts()
    assert toolchain.toolchain_parts()["fakens_src"] != installed
    for name in ("fakens", "fakens.mod"):
        monkeypatch.delitem(sys.modules, name)
    assert toolchain.package_dirs()[-1] == str(copies["vendored"] / "fakens")  # nothing imported: where an import goes
    toolchain.forget_parts()


def test_parts_follow_the_package_a_changed_search_path_finds_and_an_imported_ones_own(tmp_path, monkeypatch):
    """Parts found early (before a recorder's backstop) must agree with a lowering's later, after a script put another
    copy of a package first on its search path; once a package is imported, its own directory is the one hashed."""
    import sys

    copies = _copies(tmp_path, "fakestack", "__init__.py", ("a", "b"))
    monkeypatch.setattr(toolchain, "HASHED_PACKAGES", (*toolchain.HASHED_PACKAGES, "fakestack"))
    monkeypatch.syspath_prepend(str(copies["a"]))
    toolchain.forget_parts()
    first = toolchain.toolchain_parts()["fakestack_src"]
    monkeypatch.syspath_prepend(str(copies["b"]))
    second = toolchain.toolchain_parts()["fakestack_src"]
    assert first != second and toolchain.package_dirs()[-1] == str(copies["b"] / "fakestack")
    monkeypatch.delitem(sys.modules, "fakestack", raising=False)
    __import__("fakestack")  # from b, first on the path
    monkeypatch.syspath_prepend(str(copies["a"]))
    assert toolchain.toolchain_parts()["fakestack_src"] == second
    monkeypatch.delitem(sys.modules, "fakestack")
    assert toolchain.toolchain_parts()["fakestack_src"] == first
    toolchain.forget_parts()


def test_explain_names_the_files_a_source_part_changed_for(tmp_path):
    """ccache's debug mode names the input that changed: a toolchain part that moved names its files too."""
    from lowercache.cache import history

    root = tmp_path / "pkg"
    (root / "passes").mkdir(parents=True)
    (root / "passes" / "fuse.py").write_text("A = 1\n")
    (root / "ops.yaml").write_text("- add\n")
    first = toolchain.source_digest(str(root), every_file=True)
    (root / "passes" / "fuse.py").write_text("A = 2\n")
    (root / "passes" / "new.py").write_text("")
    second = toolchain.source_digest(str(root), every_file=True)
    assert toolchain.changed_files(first, second) == ["passes/fuse.py", "passes/new.py"]
    assert history._with_files("executorch_src", first, second) == "executorch_src (passes/fuse.py, passes/new.py)"
    assert history._with_files("target", first, second) == "target"
    (root / "ops.yaml").write_text("- sub\n")
    third = toolchain.source_digest(str(root), every_file=True)
    assert toolchain.changed_files(second, third) == ["ops.yaml"]
    assert toolchain.changed_files(first, third) == []  # not a change this machine saw in one step: no files named


def test_in_toolchain_part_is_what_the_digest_counts(tmp_path):
    """Records leave out what the toolchain part counts, and only that: a package's tests and compiled libraries
    are not in the digest, so a record checks them itself."""
    root = str(tmp_path / "pkg") + os.sep
    assert toolchain.in_toolchain_part(root + "exir/passes/x.py", (root,))
    assert toolchain.in_toolchain_part(root + "data/bin/flatc", (root,))
    assert not toolchain.in_toolchain_part(root + "backends/arm/test/common.py", (root,))
    assert not toolchain.in_toolchain_part(root + ".git/config", (root,))
    assert not toolchain.in_toolchain_part(root + "extension/_portable_lib.cpython-311-x86_64-linux-gnu.so", (root,))
    assert not toolchain.in_toolchain_part(str(tmp_path / "other" / "x.py"), (root,))
    (tmp_path / "pkg" / "backends" / "arm" / "test").mkdir(parents=True)
    (tmp_path / "pkg" / "backends" / "arm" / "test" / "common.py").write_text("A = 1\n")
    (tmp_path / "pkg" / ".git").mkdir()
    (tmp_path / "pkg" / ".git" / "config").write_text("[core]\n")
    assert toolchain.source_digest(root.rstrip(os.sep), every_file=True) == toolchain.source_digest(str(tmp_path / "empty"), every_file=True)
