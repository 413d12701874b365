"""One-frame ``format_stack()[-2]``: the very line the full call keeps, on real lowerings and on edge cases."""

from __future__ import annotations

import sys
import traceback
import types

import pytest

from lowercache.speedups import callsite
from lowercache.bench import models

from tests.helpers.oracle import run_stock


@pytest.fixture
def shim(monkeypatch):
    """The shim as the call sites see it, with this file's stamping functions registered as sites."""
    monkeypatch.setattr(callsite, "_codes", {_stamp.__code__, _self_recursive.__code__})
    return callsite._shim()


def _stamp(shim):
    return shim.format_stack()[-2], traceback.format_stack()[-2], type(shim.format_stack()).__name__


def _calls_stamp(shim):
    return _stamp(shim)


def _recurse(n, shim):
    return _stamp(shim) if n == 0 else _recurse(n - 1, shim)


def _self_recursive(n, shim):
    return _self_recursive(n - 1, shim) if n else (shim.format_stack()[-2], traceback.format_stack()[-2])


def test_the_caller_line_is_the_full_calls(shim):
    fast, full, kind = _calls_stamp(shim)
    assert fast == full and "_calls_stamp" in full and "return _stamp(shim)" in full
    assert kind == "_CallerLine"  # one frame formatted


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 6])
def test_runs_of_identical_frames(shim, depth):
    """``format`` collapses a fourth identical frame and after: the full call keeps the summary line."""
    fast, full, kind = _recurse(depth, shim)
    assert fast == full
    if depth >= 3:  # four or more _recurse frames on one line
        assert kind == "list" and "Previous line repeated" in full
    else:
        assert kind == "_CallerLine"


def test_caller_on_the_same_line_as_the_site(shim):
    fast, full = _self_recursive(1, shim)
    assert fast == full


def test_traceback_limit_takes_the_full_call(shim, monkeypatch):
    monkeypatch.setattr(sys, "tracebacklimit", 5, raising=False)
    fast, full, kind = _calls_stamp(shim)
    assert fast == full and kind == "list"


def test_other_callers_get_the_real_function(shim):
    mine, real = shim.format_stack(limit=2), traceback.format_stack(limit=2)
    assert isinstance(mine, list) and mine == real


@pytest.mark.parametrize("target", ["tosa-fp", "ethos-u55-128"])
def test_every_stamp_of_a_lowering_is_the_full_calls(target, monkeypatch):
    """Audit a stock lowering: at each call from the three sites, one frame against the full list."""
    assert callsite.sources_digest() == callsite._AUDITED_DIGEST  # the pinned sources are the installed ones
    sites = callsite._functions()
    monkeypatch.setattr(callsite, "_codes", {fn.__code__ for fn in sites})
    compared: list[bool] = []

    def audit(f=None, limit=None):
        frame = sys._getframe(1)
        full = traceback.format_stack(frame if f is None else f, limit)
        if f is None and limit is None and frame.f_code in callsite._codes:
            line = callsite.caller_line(frame)
            if line is not None:
                compared.append(line == full[-2])
        return full

    auditing = types.ModuleType("traceback")
    auditing.__dict__.update(traceback.__dict__)
    auditing.format_stack = audit
    for module_name, _ in callsite._SITES:
        monkeypatch.setattr(sys.modules[module_name], "traceback", auditing)
    run_stock(*models.transformer_block(), target)
    assert len(compared) > 10 and all(compared), compared


def test_enable_swaps_the_sites_modules_and_disable_restores():
    callsite._functions()
    modules = [sys.modules[name] for name, _ in callsite._SITES]
    with callsite.active():
        assert all(m.traceback is not traceback and m.traceback.format_stack is callsite.format_stack for m in modules)
        assert modules[0].traceback.extract_stack is traceback.extract_stack
    assert all(m.traceback is traceback for m in modules)
