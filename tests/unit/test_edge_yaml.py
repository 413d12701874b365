"""ExecuTorch parses its edge dialect's ``edge.yaml`` at import; lowercache brings ruamel's C parser, which must read it as the pure one does."""

from __future__ import annotations

import importlib.util
import os

import pytest
import ruamel.yaml.main
from ruamel.yaml import YAML

pytestmark = pytest.mark.quick


def _edge_yaml() -> str:
    """The installed ExecuTorch's ``exir/dialects/edge/edge.yaml``, read without importing ExecuTorch."""
    spec = importlib.util.find_spec("executorch")
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(spec.submodule_search_locations[0], "exir", "dialects", "edge", "edge.yaml")
    with open(path, encoding="utf-8") as file:
        return file.read()


def test_the_c_parser_is_installed():
    """Without it every new interpreter that imports ExecuTorch parses edge.yaml in pure Python (docs/speedups.md#startup)."""
    assert ruamel.yaml.main.CParser is not None


def test_the_c_parser_reads_edge_yaml_as_the_pure_parser_does():
    """ExecuTorch's own call (``YAML(typ="safe").load``) picks the C parser; the edge dialect's op table must not change with it."""
    text = _edge_yaml()
    fast = YAML(typ="safe").load(text)
    pure = YAML(typ="safe", pure=True).load(text)
    assert YAML(typ="safe").Parser is ruamel.yaml.main.CParser
    assert fast == pure
    assert repr(fast) == repr(pure)  # same types and order, not only equal values
    assert len(pure) > 100
