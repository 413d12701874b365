"""checkskip and retraceskip share one wrapper on XNNPACK's pass manager run (``speedups/passrun.py``): either may be
switched off first, and each pins stock's ``transform`` whatever is installed."""

from __future__ import annotations

import pytest

from lowercache.speedups import checkskip, passrun, retraceskip

pytestmark = pytest.mark.quick


def _transform():
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    return XNNPACKPassManager.transform


@pytest.mark.parametrize("first_off", ["checkskip", "retraceskip"])
def test_either_speed_up_may_be_switched_off_first(first_off):
    stock = _transform()
    modules = {"checkskip": checkskip, "retraceskip": retraceskip}
    checkskip.enable()
    assert retraceskip.sources_digest() == retraceskip._AUDITED_DIGEST  # pinned on stock's, not on the wrapper
    retraceskip.enable()
    try:
        assert _transform() is passrun._transform and passrun.original() is stock
        assert set(passrun._scopes) == {"checkskip", "retraceskip"}
        modules[first_off]._patch.disable()
        assert _transform() is passrun._transform and set(passrun._scopes) == set(modules) - {first_off}
    finally:
        modules[next(name for name in modules if name != first_off)]._patch.disable()
    assert _transform() is stock and passrun._scopes == {}


def test_each_scope_is_entered_for_one_run_and_left_after():
    seen = []

    class Manager:
        passes = ()

    from contextlib import contextmanager

    @contextmanager
    def scope(name):
        seen.append(("in", name))
        yield
        seen.append(("out", name))

    stock = _transform()
    passrun.add("a", lambda manager: scope("a"))
    passrun.add("b", lambda manager: scope("b"))
    try:
        passrun._stock[-1] = lambda manager: seen.append(("run", None)) or "result"
        assert _transform()(Manager()) == "result"
    finally:
        passrun._stock[-1] = stock
        passrun.remove("a")
        passrun.remove("b")
    assert _transform() is stock
    assert seen == [("in", "a"), ("in", "b"), ("run", None), ("out", "b"), ("out", "a")]
