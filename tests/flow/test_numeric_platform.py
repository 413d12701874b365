"""A lowering is stock's under this process's numeric settings: calibration's float sums follow torch's thread count,
so a step made under another count is not served (before the count was a key part, a lowering made with two threads
was served with one, and its bytes were not what a run with one thread makes)."""

from __future__ import annotations

import pytest
import torch

import lowercache

from tests.helpers.attention import attention


def _flow(artifacts) -> str:
    return next(r["outcome"] for r in artifacts.records if r["kind"] == "flow")


@pytest.mark.parametrize("target", ["tosa-int", "xnnpack-int8"])
def test_a_lowering_made_with_two_threads_is_not_served_with_one(target, cache_dir):
    net, example = attention()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = lowercache.lower(net, example, target=target, cache_dir=cache_dir)
        torch.set_num_threads(1)
        one = lowercache.lower(net, example, target=target, cache_dir=cache_dir)
        fresh_one = lowercache.lower(net, example, target=target, use_cache=False)
        torch.set_num_threads(2)
        again = lowercache.lower(net, example, target=target, cache_dir=cache_dir)
    finally:
        torch.set_num_threads(saved)
    assert (_flow(two), _flow(one), _flow(again)) == ("miss", "miss", "hit")
    assert one.pte == fresh_one.pte and again.pte == two.pte
    assert one.pte != two.pte  # why the part exists: served across counts, the first run's bytes would be wrong here
    assert one.manifest["key_parts"]["intra_op_threads"] == "1" and two.manifest["key_parts"]["intra_op_threads"] == "2"


def test_the_canary_alone_keeps_a_lowering_from_another_thread_count_from_being_served(cache_dir, monkeypatch):
    """As if the list of named settings had missed the thread count: the computed part still tells the runs apart."""
    from lowercache.lowering import arithmetic

    named = arithmetic.named_parts()
    monkeypatch.setattr(arithmetic, "named_parts", lambda: named)  # the named parts no longer see the count
    net, example = attention()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = lowercache.lower(net, example, target="tosa-int", cache_dir=cache_dir)
        torch.set_num_threads(1)
        one = lowercache.lower(net, example, target="tosa-int", cache_dir=cache_dir)
        fresh_one = lowercache.lower(net, example, target="tosa-int", use_cache=False)
    finally:
        torch.set_num_threads(saved)
    assert (_flow(two), _flow(one)) == ("miss", "miss")
    assert one.pte == fresh_one.pte != two.pte
    assert one.manifest["key_parts"]["intra_op_threads"] == two.manifest["key_parts"]["intra_op_threads"]
