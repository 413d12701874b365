"""A safe stored form of an ``ExportedProgram``: no pickle, checked before it is rebuilt.

The quantization stage (``quantize.py``) and the re-export step
(``reexport.py``) store their output this way. The form is torch.export's own JSON schema for the graph (op identity
by qualified name, arguments, node metadata), written with the tensor parts
switched off, plus every parameter, buffer, constant and example input as
raw bytes with dtype, shape and stride. Before a stored program is rebuilt,
the JSON is checked for anything that would run code or evaluate text:
symbolic shape expressions (sympy parses them), guard code, custom objects
and nested graphs are refused, so such programs are not stored at all. A
hit rebuilds the graph with ``graphbuild`` and the rest with torch's
deserializer.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import re
import typing
from typing import Any, Callable

import torch

from . import graphbuild
from ...cache.hashing import dtype_name, tensor_bytes, tensor_from_bytes
from ...cache.store import Entry
from ...speedups.patching import AttributePatch

log = logging.getLogger("lowercache")

FORMAT = "prepare_pt2e>calibrate>convert_pt2e>export:v1"

# JSON keys of torch.export's schema whose content would be parsed as code or
# expressions when the program is rebuilt, or that this format does not carry.
# One pattern: a single pass over a program JSON of several megabytes.
_REFUSED_KEYS = re.compile(rb'"(as_expr|as_custom_obj|as_graph|as_sym_float|as_sym_bool)"')

class FormatError(ValueError):
    """A stored program that cannot be rebuilt safely; the stage recomputes."""


def tensor_record(t: Any) -> dict[str, Any]:
    """How a stored tensor is described: everything but its bytes; FormatError if it cannot be stored."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or t.is_sparse or t.is_quantized:
        raise FormatError(f"unsupported tensor {type(t).__name__}")
    return {
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "parameter": isinstance(t, torch.nn.Parameter),
        "requires_grad": bool(t.requires_grad),
    }


def encode(program: torch.export.ExportedProgram, spec_digest: str) -> Entry:
    """The stored form of a quantized program (JSON graph + raw tensors)."""
    from torch._export.serde import serialize as serde

    if program.example_inputs is None:
        raise FormatError("no example inputs")
    args, kwargs = program.example_inputs
    if kwargs:
        raise FormatError("keyword example inputs")
    with _no_canonical_form_check.active(), _fast_union_create.active(), _fast_to_dict.active():
        graph = serde.serialize(
            program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
        ).exported_program
    groups = {"state_dict": program.state_dict, "constants": program.constants}
    groups["example_inputs"] = {str(i): t for i, t in enumerate(args)}
    return stored_entry(graph, groups, spec_digest)


def encode_or_note(program: torch.export.ExportedProgram, spec_digest: str, storing: bool) -> Entry:
    """``encode``, or an entry saying why the program is not stored."""
    if not storing:  # uncached or unkeyed: encoding would be wasted work
        return Entry(meta={"stored": False, "reason": "not stored"})
    try:
        return encode(program, spec_digest)
    except FormatError as err:
        log.info("quantized program not stored (%s)", err)
        return Entry(meta={"stored": False, "reason": str(err)})


def stored_entry(
    graph: bytes, groups: dict[str, dict[str, Any]], spec_digest: str, doc: dict[str, Any] | None = None
) -> Entry:
    """The entry for a program's JSON and its tensors by group (state_dict, constants, example_inputs).

    ``doc``: the JSON already parsed, by a caller that has just written
    ``graph`` from it (parsing a large program again is not free).
    """
    _check_graph(graph, doc)
    tensors: dict[str, dict[str, Any]] = {}
    chunks: list[bytes] = []
    offset = 0
    for group, items in groups.items():
        for name, t in items.items():
            record = tensor_record(t)
            data = tensor_bytes(t)
            tensors[f"{group}/{name}"] = {**record, "offset": offset, "size": len(data)}
            chunks.append(data)
            offset += len(data)
    blobs = {"program.json": graph, "tensors": b"".join(chunks)}  # one blob: one file write per entry
    meta = {"format": FORMAT, "tensors": tensors, "compile_spec_after": spec_digest}
    return Entry(meta=meta, blobs=blobs)


def _check_graph(graph: bytes, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parsed program JSON (``doc`` if given, its parse), once checked to hold nothing that would be parsed as code."""
    if refused := _REFUSED_KEYS.search(graph):
        raise FormatError(f"program holds {refused.group(0).decode()} values")
    if doc is None:
        try:
            doc = json.loads(graph)
        except ValueError as err:
            raise FormatError(f"program JSON: {err}") from None
    if not isinstance(doc, dict) or doc.get("range_constraints") or doc.get("guards_code"):
        raise FormatError("program has shape constraints or guard code")
    return doc


def tensor_from_record(record: dict[str, Any], packed: bytes) -> torch.Tensor:
    """A stored tensor from its record (``tensor_record`` plus offset and size) and the packed bytes."""
    start, size = record["offset"], record["size"]
    if start < 0 or size < 0 or start + size > len(packed):
        raise FormatError("tensor outside the stored bytes")
    flat = tensor_from_bytes(packed[start : start + size], record["dtype"], record["shape"])
    t = torch.empty_strided(record["shape"], record["stride"], dtype=flat.dtype)
    t.copy_(flat)
    if record["parameter"]:
        return torch.nn.Parameter(t, requires_grad=record["requires_grad"])
    return t.requires_grad_(record["requires_grad"])


def decode(entry: Entry, doc: dict[str, Any] | None = None) -> torch.export.ExportedProgram:
    """Rebuild a stored quantized program; FormatError if it is not one this format wrote.

    ``doc``: the entry's JSON already parsed (as in ``stored_entry``); it is consumed.
    """
    from torch._export.serde import serialize as serde

    if entry.meta.get("format") != FORMAT:
        raise FormatError("not a stored quantized program")
    with _no_cyclic_gc():
        doc = _check_graph(entry.blobs["program.json"], doc)
        groups: dict[str, dict[str, torch.Tensor]] = {"state_dict": {}, "constants": {}, "example_inputs": {}}
        for blob, record in entry.meta["tensors"].items():
            group, _, name = blob.partition("/")
            groups[group][name] = tensor_from_record(record, entry.blobs["tensors"])
        args = tuple(groups["example_inputs"][str(i)] for i in range(len(groups["example_inputs"])))
        with _fast_tensor_meta.active():
            try:
                return _rebuild_fast(doc, groups["state_dict"], groups["constants"], args)
            except graphbuild.Unsupported as err:
                log.debug("stored graph rebuilt by torch's deserializer (%s)", err)
            deserializer = serde.ExportedProgramDeserializer()
            return deserializer.deserialize(_schema(doc), groups["state_dict"], groups["constants"], (args, {}))


def _rebuild_fast(
    doc: dict[str, Any], state_dict: dict[str, torch.Tensor], constants: dict[str, torch.Tensor], args: tuple[Any, ...]
) -> torch.export.ExportedProgram:
    """torch's deserializer with the graph built from the JSON by ``graphbuild``;
    ``graphbuild.Unsupported`` if the graph needs torch's own builder."""
    from torch._export.serde import serialize as serde

    module = doc.get("graph_module")
    if not isinstance(module, dict) or not isinstance(module.get("graph"), dict):
        raise FormatError("program JSON without a graph")
    program = _schema({**doc, "graph_module": {**module, "graph": graphbuild.EMPTY_GRAPH}})
    program.graph_module.graph = graphbuild.RawGraph(module["graph"])
    with graphbuild.raw_graphs.active():
        return serde.ExportedProgramDeserializer().deserialize(program, state_dict, constants, (args, {}))


@contextlib.contextmanager
def _no_cyclic_gc() -> typing.Iterator[None]:
    """Pause the cyclic collector while a program is rebuilt.

    Rebuilding allocates tens of thousands of objects that all stay alive, so
    the collections it triggers find nothing, yet each full one walks the
    whole heap, which after a stock lowering in the same process is most of
    a decode. Reference counting still frees as usual; the
    collector is re-enabled (if it was on) as soon as the program is built.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _fake_from_meta(self: Any, tensor_meta: Any) -> Any:
    """``deserialize_tensor_meta`` for static shapes without the fake-mode dispatch.

    Stock calls ``torch.empty_strided`` under the deserializer's FakeTensorMode,
    which runs the op on the meta device and wraps the result as
    ``FakeTensor(mode, meta_tensor, device)``; this builds that directly,
    without the dispatch. Symbolic sizes go the stock way.
    """
    from torch._export.serde import serialize as serde
    from torch._subclasses.fake_tensor import FakeTensor

    sizes = tuple(self.deserialize_sym_int(v) for v in tensor_meta.sizes)
    strides = tuple(self.deserialize_sym_int(v) for v in tensor_meta.strides)
    if not all(type(v) is int for v in sizes + strides):
        return _fast_tensor_meta.originals[serde.GraphModuleDeserializer](self, tensor_meta)
    device = serde.deserialize_device(tensor_meta.device)
    dtype = serde._SERIALIZE_TO_TORCH_DTYPE[tensor_meta.dtype]
    meta = torch.empty_strided(sizes, strides, dtype=dtype, device="meta")
    fake = FakeTensor(self.fake_tensor_mode, meta, device)
    return fake.requires_grad_(True) if tensor_meta.requires_grad else fake


def _deserializer_class() -> list[Any]:
    from torch._export.serde import serialize as serde

    return [serde.GraphModuleDeserializer]


_fast_tensor_meta = AttributePatch(_deserializer_class, "deserialize_tensor_meta", _fake_from_meta)


@functools.lru_cache(maxsize=None)
def _converter(cls: Any) -> Callable[[Any], Any]:
    """A function turning decoded JSON into torch.export's schema dataclass ``cls``.

    The same rules as torch's ``_dict_to_dataclass``, worked out once per
    schema type instead of once per value (that function asks ``typing``
    for the same hints for every node field, which dominates rebuilding a
    large program). ``test_quantize`` compares both on a real program.
    """
    import dataclasses
    import types

    from torch._export.serde import schema
    from torch._export.serde import serialize as serde
    from torch._export.serde.union import _Union

    cls = serde._resolve_schema_cls(cls)
    if isinstance(cls, str):
        raise FormatError(f"unresolved schema type {cls!r}")
    origin = typing.get_origin(cls)
    if origin is typing.Annotated:
        return _converter(cls.__origin__)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
        inner = typing.get_args(cls)
        if len(inner) != 2:
            raise FormatError(f"unexpected optional type {cls!r}")
        convert_inner = _converter(inner[0])
        return lambda data: None if data is None else convert_inner(data)
    if isinstance(cls, type) and issubclass(cls, _Union):
        hints = typing.get_type_hints(cls, globalns=vars(schema))
        converters = {f.name: _converter(hints[f.name]) for f in dataclasses.fields(cls)}
        blank = _blank_union(cls)
        if blank is None:
            return lambda data: cls.create(**{k: converters[k](v) for k, v in _one_item(cls, data)})

        def union(data: Any) -> Any:
            ((name, value),) = _one_item(cls, data)
            if name not in converters:
                raise FormatError(f"{cls.__name__} has no field {name!r}")
            return _new_union(cls, blank, name, converters[name](value))

        return union
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls, globalns=vars(schema))
        fields = [(f.name, _converter(hints[f.name])) for f in dataclasses.fields(cls)]

        def record(data: Any) -> Any:
            if not isinstance(data, dict):
                raise FormatError(f"bad {cls.__name__} value")
            return cls(**{name: convert(data[name]) for name, convert in fields if name in data})

        if not _plain_construction(cls) or hasattr(cls, "__post_init__") or not all(
            f.init for f in dataclasses.fields(cls)
        ):
            return record
        defaults = [(f.default, f.default_factory) for f in dataclasses.fields(cls)]
        missing = dataclasses.MISSING

        def plain_record(data: Any) -> Any:
            # What the generated ``__init__`` does: each field assigned in order, from the
            # data or else its default.
            if not isinstance(data, dict):
                raise FormatError(f"bad {cls.__name__} value")
            obj = object.__new__(cls)
            values = obj.__dict__
            for (name, convert), (default, factory) in zip(fields, defaults):
                if name in data:
                    values[name] = convert(data[name])
                elif factory is not missing:
                    values[name] = factory()
                elif default is not missing:
                    values[name] = default
                else:
                    raise FormatError(f"{cls.__name__} lacks {name!r}")
            return obj

        return plain_record
    args = typing.get_args(cls)

    def plain(data: Any) -> Any:
        if isinstance(data, list):
            return [_converter(args[0])(d) for d in data] if data else data
        if isinstance(data, dict):
            return {k: _converter(args[1])(v) for k, v in data.items()}
        return float(data) if cls is float else data

    return plain


def _plain_construction(cls: type) -> bool:
    """Whether a dataclass's generated ``__init__`` only assigns its fields in
    order (and calls ``__post_init__`` if any): no custom ``__new__``,
    ``__setattr__``, slots or freezing."""
    params = getattr(cls, "__dataclass_params__", None)
    return (
        params is not None
        and params.init
        and not params.frozen
        and cls.__new__ is object.__new__
        and cls.__setattr__ is object.__setattr__
        and "__slots__" not in vars(cls)
    )


def _one_item(cls: type, data: Any) -> Any:
    if not isinstance(data, dict) or len(data) != 1:
        raise FormatError(f"bad {cls.__name__} value")
    return data.items()


def schema_program(graph: bytes) -> Any:
    """The stored JSON as torch.export's schema ``ExportedProgram``."""
    try:
        doc = json.loads(graph)
    except ValueError as err:
        raise FormatError(f"program JSON: {err}") from None
    return _schema(doc)


def _schema(doc: Any) -> Any:
    from torch._export.serde import schema

    try:
        return _converter(schema.ExportedProgram)(doc)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise FormatError(f"program JSON: {err}") from None


def _serde_module() -> list[Any]:
    from torch._export.serde import serialize as serde

    return [serde]


# Skip ``serialize``'s self-test of the canonical form (a deep copy whose result
# is discarded; two thirds of the serialization time).
_no_canonical_form_check = AttributePatch(_serde_module, "canonicalize", lambda *args, **kwargs: None)


def _union_class() -> list[Any]:
    from torch._export.serde.union import _Union

    return [_Union]


@functools.lru_cache(maxsize=None)
def _blank_union(cls: type) -> dict[str, None] | None:
    """Every field of union ``cls`` set to None, or None if ``cls`` is not built plainly."""
    import dataclasses

    from torch._export.serde.union import _Union

    if not (_plain_construction(cls) and cls.__post_init__ is _Union.__post_init__):
        return None
    blank = {f.name: None for f in dataclasses.fields(cls)}
    cls(**blank)  # __post_init__'s check depends on the class only: run it once
    return blank


def _new_union(cls: type, blank: dict[str, None], name: str, value: Any) -> Any:
    """What ``cls.create(name=value)`` builds: every field set in order (None but
    the one given), then the tag; without ``__init__``, ``__post_init__`` and
    ``fields()`` per value. ``blank`` is ``_blank_union(cls)``."""
    from torch._export.serde.union import _UnionTag

    obj = object.__new__(cls)
    fields = obj.__dict__
    fields.update(blank)
    fields[name] = value
    obj._type = _UnionTag.create(name, cls)
    return obj


def _union_create(cls: Any, **kwargs: Any) -> Any:
    """``_Union.create`` through ``_new_union`` for plainly built unions."""
    blank = _blank_union(cls)
    if blank is None or len(kwargs) != 1 or next(iter(kwargs)) not in blank:
        return _fast_union_create.originals[_union_class()[0]].__func__(cls, **kwargs)  # torch's, with its errors
    ((name, value),) = kwargs.items()
    return _new_union(cls, blank, name, value)


# Writing the stored form builds some 50,000 union values (a DeiT-tiny program).
_fast_union_create = AttributePatch(_union_class, "create", classmethod(_union_create))


def _to_dict(obj: Any) -> Any:
    """torch's ``_dataclass_to_dict``, with its type tests decided once per type."""
    kind = type(obj)
    convert = _to_dict_by_type.get(kind)
    if convert is None:
        convert = _to_dict_by_type[kind] = _to_dict_for(kind)
    return convert(obj)


def _to_dict_for(kind: type) -> Callable[[Any], Any]:
    import dataclasses

    from torch._export.serde import serialize as serde
    from torch._export.serde.union import _Union

    original = _fast_to_dict.originals[serde]
    # The same tests in the same order as torch's function, on the type.
    if issubclass(kind, type):
        return original  # a class object: ``is_dataclass`` looks at the object itself
    if issubclass(kind, _Union):
        return lambda o: {o.type: _to_dict(o.value)}
    if dataclasses.is_dataclass(kind):
        names = tuple(f.name for f in dataclasses.fields(kind))
        return lambda o: {name: _to_dict(getattr(o, name)) for name in names}
    if issubclass(kind, list):
        return lambda o: [_to_dict(x) for x in o]
    if issubclass(kind, tuple):
        return lambda o: tuple(_to_dict(x) for x in o)
    if issubclass(kind, dict):
        return lambda o: {k: _to_dict(v) for k, v in o.items()}
    if issubclass(kind, float):
        return original  # infinities and NaN are spelled as strings
    return lambda o: o


_to_dict_by_type: dict[type, Callable[[Any], Any]] = {}
_fast_to_dict = AttributePatch(_serde_module, "_dataclass_to_dict", _to_dict)
