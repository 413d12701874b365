"""``jsonhints`` and ``debugtext``: the text XNNPACK's partitions make on their way to bytes, and the text they make
for nobody.

``jsonhints``: ExecuTorch's dataclass encoder and decoder give the same JSON and the same objects with a class's type
hints read once as with them read per field, on every dataclass of the XNNPACK schema. ``debugtext``: the passes'
dumps for a dropped debug message are not written, every other ``print_readable`` is torch's, and with debug logging
on the messages are stock's. Bytes against stock on real graphs: ``test_xnnpack_speedups.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import typing

import pytest
import torch

import lowercache
from lowercache.speedups import debugtext, jsonhints

# A logger that drops debug messages, as the passes' do: a call from here is still not one of theirs.
logger = logging.getLogger("tests.flow.test_serialtext")
logger.setLevel(logging.WARNING)
PASS_LOGGERS = ("executorch.backends.xnnpack._passes.convert_to_linear", "executorch.backends.xnnpack._passes.convert_to_sdpa")


def _schema_classes() -> list[type]:
    from executorch.backends.xnnpack.serialization import xnnpack_graph_schema as schema

    return [c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == schema.__name__]


def _sample(cls: type, depth: int = 0) -> object:
    """An instance of a schema dataclass with every field filled: unions by one of their members, recursively."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        values[field.name] = _value(hints[field.name], depth)
    return cls(**values)


def _value(hint: object, depth: int) -> object:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        members = [a for a in args if a is not type(None)]
        return _value(members[depth % len(members)], depth + 1)
    if origin is list:
        return [_value(args[0], depth + 1) for _ in range(2)] if depth < 3 else []
    if dataclasses.is_dataclass(hint):
        return _sample(hint, depth + 1)
    if hint is bytes:
        return b"\x01\x02"
    if hint is float:
        return 0.5
    if hint is bool:
        return True
    if hint is str:
        return "s"
    if isinstance(hint, type) and issubclass(hint, int):
        return list(hint)[0] if hasattr(hint, "__members__") else 3
    return None


def _decoded(text: str, cls: type) -> object:
    """The decoder's object, or what it raised (the XNNPACK schema's enums are written as numbers, which the decoder,
    made for flatc's JSON, reads by name)."""
    from executorch.exir._serialize._dataclass import _json_to_dataclass

    try:
        return _json_to_dataclass(json.loads(text), cls)
    except KeyError as e:
        return f"KeyError: {e}"


@pytest.mark.quick
def test_the_speed_ups_are_on_for_the_audited_sources():
    assert jsonhints.sources_digest() == jsonhints._AUDITED_DIGEST
    assert debugtext.sources_digest() == debugtext._AUDITED_DIGEST


@pytest.mark.quick
def test_every_schema_class_encodes_and_decodes_as_stock():
    """Every XNNPACK schema dataclass (unions written with their ``_type``), encoded and decoded back."""
    from executorch.exir._serialize._dataclass import _DataclassEncoder

    classes = _schema_classes()
    assert len(classes) > 40
    samples = [_sample(cls, depth) for cls in classes for depth in range(3)]
    stock = [json.dumps(s, cls=_DataclassEncoder) for s in samples]
    assert any("_type" in text for text in stock)  # the encoder's union branch, which reads the hints, was taken
    with jsonhints.active():
        assert [json.dumps(s, cls=_DataclassEncoder) for s in samples] == stock
        assert [jsonhints.type_hints(cls) for cls in classes] == [typing.get_type_hints(cls) for cls in classes]
        decoded = [_decoded(text, type(s)) for text, s in zip(stock, samples)]
    assert decoded == [_decoded(text, type(s)) for text, s in zip(stock, samples)]
    assert sum(not isinstance(d, str) for d in decoded) > 20  # the decoder's union branch ran on these
    assert not jsonhints._hints  # nothing kept past the lowering


def test_a_class_whose_hints_change_between_lowerings_is_read_again():
    from executorch.exir._serialize._dataclass import _DataclassEncoder

    @dataclasses.dataclass
    class Node:
        value: "typing.Union[int, str]"

    with jsonhints.active():
        first = json.dumps(Node(1), cls=_DataclassEncoder)
    Node.__annotations__["value"] = "int"
    with jsonhints.active():
        second = json.dumps(Node(1), cls=_DataclassEncoder)
    assert first == '{"value": 1, "value_type": "int"}' and second == json.dumps(Node(1), cls=_DataclassEncoder) == '{"value": 1}'


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval(), (torch.randn(1, 8),)


class _Dumps:
    """Counts torch writing a dump (``_print_readable``, which ``print_readable`` calls: that one is pinned) for one
    of the two passes, called from the pass directly or through ``debugtext``'s wrapper."""

    def __init__(self, monkeypatch):
        from torch.fx import graph_module

        self.count = 0
        stock = graph_module._print_readable

        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            while frame.f_code.co_filename.endswith(("torch/fx/graph_module.py", "speedups/debugtext.py")):
                frame = frame.f_back
            if frame.f_code.co_filename.endswith(("convert_to_linear.py", "convert_to_sdpa.py")):
                self.count += 1
            return stock(*args, **kwargs)

        monkeypatch.setattr(graph_module, "_print_readable", counted)


def test_an_xnnpack_lowering_writes_no_dump_for_a_dropped_message(monkeypatch):
    dumps = _Dumps(monkeypatch)
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", "all,-debugtext")
    stock = lowercache.lower(*_mlp(), target="xnnpack", use_cache=False).pte
    assert dumps.count == 4  # one partition: ConvertToLinear's two dumps, ConvertToSDPA's two
    dumps.count = 0
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", "all")
    assert lowercache.lower(*_mlp(), target="xnnpack", use_cache=False).pte == stock
    assert dumps.count == 0


def test_with_debug_logging_on_the_messages_are_stocks(monkeypatch):
    records: dict[str, list[str]] = {}

    class Keep(logging.Handler):
        def emit(self, record):
            records.setdefault(setting, []).append(record.getMessage())

    handler = Keep()
    loggers = [logging.getLogger(name) for name in PASS_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)  # through setLevel: it clears the loggers' isEnabledFor caches
        logger.addHandler(handler)
    try:
        for setting in ("all,-debugtext", "all"):
            monkeypatch.setenv("LOWERCACHE_SPEEDUPS", setting)
            lowercache.lower(*_mlp(), target="xnnpack", use_cache=False)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    dumps = [m for m in records["all,-debugtext"] if m.lstrip().startswith("class ")]
    assert len(dumps) == 4 and records["all"] == records["all,-debugtext"]


def test_print_readable_elsewhere_is_torchs():
    """Called for a debug message this module's logger drops, but not from one of the passes."""
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with debugtext.active():
        assert gm.print_readable(print_output=False) == debugtext._originals["print_readable"](gm, False)
        logger.debug(gm.print_readable(print_output=False))
        assert gm.print_readable(False) != debugtext.DROPPED
