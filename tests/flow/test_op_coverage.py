"""More operators and odd graph shapes through every in-flow speed-up, each lowering against stock."""

from __future__ import annotations

import pytest

import lowercache

from tests.helpers.op_zoo import ODD, ZOO
from tests.helpers.oracle import stock_pte


@pytest.mark.parametrize("target", ("tosa-fp", "tosa-int", "ethos-u55-128", "ethos-u85-256"))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_cold_warm_and_edit_match_stock(name, target, cache_dir):
    build = ZOO[name]
    module, example = build()
    expected = stock_pte(module, example, target)
    cold = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
    assert cold.pte == expected
    module, example = build()
    warm = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
    assert [r["outcome"] for r in warm.records if r["kind"] == "flow"] == ["hit"]
    assert warm.pte == expected

    module, example = build(edit=True)
    edited = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
    assert [r["outcome"] for r in edited.records if r["kind"] == "flow"] == ["miss"]
    assert edited.pte == stock_pte(module, example, target)
    assert edited.pte != expected


@pytest.mark.parametrize(
    "name, target", [(name, target) for name, (_, targets) in sorted(ODD.items()) for target in targets]
)
def test_odd_graphs_cold_and_warm_match_stock(name, target, cache_dir):
    build = ODD[name][0]
    module, example = build()
    expected = stock_pte(module, example, target)
    for outcome in ("miss", "hit"):
        module, example = build()
        got = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
        assert [r["outcome"] for r in got.records if r["kind"] == "flow"] == [outcome]
        assert got.pte == expected
