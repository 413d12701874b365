"""Caches lowered once per worker and copied per test: for tests whose cold lowering is where they start."""

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
