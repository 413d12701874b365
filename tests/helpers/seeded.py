"""Lowerings made once and copied per test: for tests whose first lowering is only where they start."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import lowercache
from lowercache.bench import models

_COLD: dict[tuple[str, str], tuple[Path, lowercache.Artifacts]] = {}


def cold_cache(model: str, target: str, factory: pytest.TempPathFactory, into: Path) -> lowercache.Artifacts:
    """Copy to ``into`` a cache holding exactly a benchmark model's lowering for ``target``, made once per worker into
    an empty cache; that lowering's artifacts (shared: read them, never change them)."""
    if (model, target) not in _COLD:
        template = factory.mktemp(f"cold-{model}-{target}") / "cache"
        module, example = models.MODELS[model]()
        _COLD[model, target] = template, lowercache.lower(module, example, target=target, cache_dir=template)
    template, artifacts = _COLD[model, target]
    shutil.copytree(template, into)
    return artifacts


def set_aside(base: Path, *names: str) -> None:
    """Copy each ``base / name`` aside, timestamps and modes kept, for :func:`restored` to hand out."""
    for name in names:
        shutil.copytree(base / name, base / f"pristine-{name}", symlinks=True)


def restored(base: Path, *names: str) -> list[Path]:
    """Each ``base / name`` replaced by a copy of what :func:`set_aside` kept: a record made at that path applies to
    the copy, and nothing a test does to the copy reaches what was kept."""
    paths = []
    for name in names:
        at = base / name
        shutil.rmtree(at, ignore_errors=True)
        shutil.copytree(base / f"pristine-{name}", at, symlinks=True)
        paths.append(at)
    return paths
