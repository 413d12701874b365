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


def restore(pristine: Path, at: Path) -> Path:
    """``at`` replaced by a copy of ``pristine``, timestamps and modes kept: a record made at ``at`` (before it was
    copied aside as ``pristine``) applies to the copy, and nothing a test does to the copy reaches ``pristine``."""
    shutil.rmtree(at, ignore_errors=True)
    shutil.copytree(pristine, at, symlinks=True)
    return at
