"""Attribute patches restore exactly what the owner held: descriptors stay descriptors, inherited stays inherited."""

from __future__ import annotations

import pytest

from lowercache.speedups.patching import AttributePatch

pytestmark = pytest.mark.quick


class Base:
    def inherited(self):
        return "base"


class Owner(Base):
    @classmethod
    def make(cls):
        return cls

    @staticmethod
    def helper():
        return "static"


class Child(Owner):
    pass


def test_classmethod_staticmethod_and_inherited_attributes_are_restored():
    entries = {name: vars(Owner).get(name) for name in ("make", "helper", "inherited")}
    patches = [
        AttributePatch(lambda: [Owner], "make", classmethod(lambda cls: "patched")),
        AttributePatch(lambda: [Owner], "helper", staticmethod(lambda: "patched")),
        AttributePatch(lambda: [Owner], "inherited", lambda self: "patched"),
    ]
    for patch in patches:
        with patch.active():
            assert patch.originals[Owner] is not None
    assert {name: vars(Owner).get(name) for name in entries} == entries
    assert Child.make() is Child  # still a classmethod: bound to the class it is called on
    assert Owner().helper() == "static"  # still a staticmethod: no self passed
    assert "inherited" not in vars(Owner) and Owner().inherited() == "base"


def test_originals_are_callable_as_getattr_returned_them():
    patch = AttributePatch(lambda: [Owner], "make", classmethod(lambda cls: "patched"))
    with patch.active():
        assert Child.make() == "patched"
        assert patch.originals[Owner]() is Owner
        assert patch.originals[Owner].__func__(Child) is Child
