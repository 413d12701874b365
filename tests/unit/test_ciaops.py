"""One registry walk per CIA-op collection: same operators as stock, new registrations still found."""

from __future__ import annotations

import torch

from lowercache.speedups import ciaops


def _collect_counting_walks(monkeypatch):
    """``_collect_all_valid_cia_ops()`` as ``torch.export`` calls it, and how many registry walks it made."""
    from torch.export import decomp_utils

    real = torch._C._dispatch_get_registrations_for_dispatch_key
    walks = []

    def counting(key):
        walks.append(key)
        return real(key)

    monkeypatch.setattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", counting)
    try:
        found = decomp_utils._collect_all_valid_cia_ops()
    finally:
        monkeypatch.setattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", real)
    return found, len(walks)


def test_same_operators_with_one_walk(monkeypatch):
    stock, stock_walks = _collect_counting_walks(monkeypatch)
    with ciaops.active():
        assert ciaops.enabled()
        patched, walks = _collect_counting_walks(monkeypatch)
    assert not ciaops.enabled()
    assert patched == stock
    assert stock_walks > 2  # one per non-aten namespace
    assert walks == 1


def test_operator_registered_between_collections_is_found(monkeypatch):
    lib = torch.library.Library("lowercache_ciatest", "DEF")
    try:
        with ciaops.active():
            before, _ = _collect_counting_walks(monkeypatch)
            lib.define("twice(Tensor x) -> Tensor")
            lib.impl("twice", lambda x: x + x, "CompositeImplicitAutograd")
            after, walks = _collect_counting_walks(monkeypatch)
    finally:
        lib._destroy()
    new = {str(op) for op in after - before}
    assert new == {"lowercache_ciatest.twice.default"}
    assert walks == 1


def test_unaudited_torch_is_left_alone(monkeypatch):
    monkeypatch.setattr(ciaops, "_AUDITED_DIGEST", "0" * 64)
    with ciaops.active():
        assert not ciaops.enabled()
        _, walks = _collect_counting_walks(monkeypatch)
    assert walks > 2
