"""Deferred code generation in a real lowering: a discarded debug message generates no code; a kept one is stock's."""

from __future__ import annotations

import logging

import pytest

from lowercache.bench import models
from lowercache.speedups import lazycode

from tests.helpers.xnnstock import lower_here

MESSAGE = "Partitioned graph module: "


def _lower() -> bytes:
    """The stock script's XNNPACK flow on a self-attention block: four partitions, so four debug messages."""
    return lower_here(*models.transformer_block(), "xnnpack")


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith(MESSAGE):
            self.messages.append(text)


@pytest.fixture
def root_at_debug():
    root, handler = logging.getLogger(), _Kept()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.setLevel(level)
        root.removeHandler(handler)


def test_a_discarded_partition_message_generates_no_code(monkeypatch):
    stock = _lower()
    generated = []
    real = lazycode.materialize
    monkeypatch.setattr(lazycode, "materialize", lambda gm: generated.append(gm) or real(gm))
    assert not logging.getLogger().isEnabledFor(logging.DEBUG)
    with lazycode.active():
        got = _lower()
        with_skip = len(generated)
        generated.clear()
        monkeypatch.setattr(lazycode, "_discarded", lambda frame: False)
        assert _lower() == got
    assert got == stock
    assert with_skip <= len(generated) - 4  # one whole-program generation per partition saved


def test_a_kept_partition_message_is_stocks(root_at_debug):
    stock = _lower()
    wanted = list(root_at_debug.messages)
    root_at_debug.messages.clear()
    with lazycode.active():
        got = _lower()
    assert len(wanted) == 4 and "def forward" in wanted[0]
    assert root_at_debug.messages == wanted and got == stock
    assert lazycode.DISCARDED not in "".join(wanted)
