"""Flow tests: in-process lowerings against the stock oracle (``helpers/oracle.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import pytest

from lowercache import api
from lowercache.bench import models
from lowercache.config import Settings
from lowercache.targets.arm_ethosu import TARGETS as ETHOSU_TARGETS

from tests.helpers.tosa import FAMILIES, MODELS


@pytest.fixture(scope="session")
def partitions(tmp_path_factory) -> Mapping[tuple[str, str], bytes]:
    """Each model's first partition TOSA for one target of each family (the TOSA does not depend on the MAC count):
    made once per worker for the modules that read it, and read-only."""
    cache = tmp_path_factory.mktemp("cache")
    found = {}
    for name in MODELS:
        for family in FAMILIES:
            target = next(t for t in ETHOSU_TARGETS if t.startswith(family))
            module, example = getattr(models, name)()
            artifacts = api.lower(module, example, target=target, settings=Settings(cache_dir=cache))
            found[name, family] = artifacts.files["partition_0.tosa"]
    return MappingProxyType(found)
