"""The docs stay true to the code: every setting, command and speed-up is documented, links resolve, the README stays short."""

from __future__ import annotations

import re

import pytest
from typer.main import get_command

from lowercache import config
from lowercache.cli.commands import app
from lowercache.speedups import registry
from tests.helpers import ROOT

DOCS = ROOT / "docs"

pytestmark = pytest.mark.quick


def test_every_setting_is_in_the_configuration_page():
    page = (DOCS / "configuration.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")}
    assert set(config._ENV) <= rows, set(config._ENV) - rows
    for name, env in config._ENV.items():
        assert f"`{env}`" in page, env


def test_every_command_is_in_the_commands_page():
    page = (DOCS / "commands.md").read_text()
    commands = set(get_command(app).commands)
    missing = {c for c in commands if f"lowercache {c}" not in page}
    assert not missing


def test_every_speedup_has_a_section():
    headings = {line[4:].split(":")[0].strip() for line in (DOCS / "speedups.md").read_text().splitlines() if line.startswith("### ")}
    names = {n for h in headings for n in re.split(r" and |, ", h)}
    assert set(registry.NAMES) <= names, set(registry.NAMES) - names


def test_links_between_docs_resolve():
    broken = []
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert broken == []


def _anchors(page: str) -> set[str]:
    """The anchors GitHub makes of a page's headings, fenced code left out."""
    prose = re.sub(r"^```.*?^```", "", page, flags=re.S | re.M)
    headings = re.findall(r"^#{1,6} (.+)$", prose, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_to_a_section_name_one():
    broken = []
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", page.read_text()):
            linked = page.parent / target if target else page
            if linked.exists() and anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.name} -> {target}#{anchor}")
    assert broken == []


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 8 * 1024
    quick = readme.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(quick) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick[1].split("&& ", 1)[1] in ci  # CI runs the README's own test command


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("pip install -e '.[test]' && "))
    command = line.split(" && ", 1)[1]
    assert command.startswith("python -m pytest")
    assert command in (ROOT / ".ci" / "run").read_text()
