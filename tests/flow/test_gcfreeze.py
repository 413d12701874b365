"""The heap freeze around a lowering: on during it, undone after it, never over the caller's own freeze."""

from __future__ import annotations

import gc
import threading

import pytest

import lowercache
from lowercache.bench import models
from lowercache.speedups.gcfreeze import frozen_heap

from tests.helpers.oracle import stock_pte


@pytest.fixture(autouse=True)
def _clean_heap():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_lowering_runs_frozen_and_unfreezes_after(tmp_path):
    seen: list[int] = []
    module, example = models.tiny_cnn()
    artifacts = lowercache.lower(
        module, example, target="tosa-fp", cache_dir=tmp_path, listener=lambda *_: seen.append(gc.get_freeze_count())
    )
    assert seen and min(seen) > 0, "objects alive before the lowering were not frozen during it"
    assert gc.get_freeze_count() == 0
    assert artifacts.pte == stock_pte(module, example, "tosa-fp")


def test_a_callers_freeze_is_left_alone():
    gc.freeze()
    mine = gc.get_freeze_count()
    # no second freeze (the count would grow) and no unfreeze (it would drop to 0); frozen
    # objects another thread frees meanwhile leave the permanent generation one by one
    with frozen_heap():
        assert mine - 1000 < gc.get_freeze_count() <= mine
    assert mine - 1000 < gc.get_freeze_count() <= mine


def test_disabled_collector_is_left_alone():
    gc.disable()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_nested_and_concurrent_blocks_share_one_freeze():
    entered, release = threading.Event(), threading.Event()
    inside: list[int] = []

    def other():
        with frozen_heap():
            entered.set()
            release.wait(10)
            inside.append(gc.get_freeze_count())

    with frozen_heap():
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0, "the inner block unfroze the outer one"
        worker = threading.Thread(target=other)
        worker.start()
        entered.wait(10)
    assert gc.get_freeze_count() > 0, "the first block to end unfroze a block still running"
    release.set()
    worker.join()
    assert inside and inside[0] > 0
    assert gc.get_freeze_count() == 0


def test_an_exception_unfreezes():
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_a_server_that_froze_its_heap_is_not_walked_again(monkeypatch):
    """The warm server freezes its heap once for its children (``freeze_for_children``): their lowerings leave it frozen,
    and never ask ``gc.get_freeze_count()``, which walks every frozen object."""
    from lowercache.speedups import gcfreeze

    monkeypatch.setattr(gcfreeze, "_kept", False)
    gcfreeze.freeze_for_children()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    counted = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: counted.append(1) or 0)
    with frozen_heap():
        pass
    monkeypatch.undo()
    assert counted == [] and frozen - 1000 < gc.get_freeze_count() <= frozen  # not asked; not frozen again, nor thawed
