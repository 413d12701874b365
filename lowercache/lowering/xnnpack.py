"""The XNNPACK integration: what the flow asks a family's backend module, for ExecuTorch's XNNPACK backend.

An XNNPACK lowering is cached as the whole flow, its quantization stage
(``quantize.py``) and one step per partition: ``XnnpackBackend.preprocess``
is wrapped (step kind ``xnnpack``), its result stored (the delegate's bytes,
its debug-handle map, and the named data it hands the NamedDataStore: the
serialized weights, each buffer and entry as stock made them) and keyed by
the partition's program and compile specs, so an edit re-runs only the
partitions it touches, under ``lower`` and ``build`` (``hooks``) and inside a
script under ``lowercache run`` (``install_permanently``). The hooks also turn on the exact speed-ups proven on
XNNPACK's graphs (the registry's ``families``; docs/speedups.md#families),
none of the Arm flow's own patches. The key parts that are
XNNPACK's own: the partitioner's configuration (:func:`compile_spec_digest`)
and the backend's sources, its flatbuffer schema included
(:func:`backend_source_parts`), which the common toolchain part does not hash.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
from typing import Any

from .switches import Switches
from ..speedups.patching import Patch
from ..targets.xnnpack import FAMILY, QUANTIZER_MODULE, XNNPACK_MODULE
from ..cache.digests import digest_json
from ..cache.hashing import IGNORED_META, Unhashable, canon, program_parts
from ..cache.steps import current_session
from ..cache.store import Entry
from ..cache.toolchain import source_digest
from . import arithmetic

log = logging.getLogger("lowercache")
BACKEND_SOURCES = (".py", ".fbs")  # the delegate's payload is serialized with the backend's own schema


def compile_spec_digest(spec: Any) -> str:
    """Digest of the partitioner ``spec`` (its keyword arguments) makes: its configs and their enabled precisions, its
    mode, and the compile specs it hands the backend. What each config accepts is the backend's code (its source part)."""
    partitioner = FAMILY.partitioner(None, spec)  # type: ignore[arg-type]  # the target is not read
    return digest_json({
        "partitioner": type(partitioner).__qualname__,
        "arguments": sorted(spec),
        "configs": [[name, type(c).__module__ + "." + type(c).__qualname__, sorted(str(p) for p in c.enabled_precision_types)]
                    for name, c in partitioner.target_partitioner_configs.items()],
        "per_op_mode": bool(partitioner.per_op_mode),
        "backend": partitioner.delegation_spec.backend_id,
        "compile_specs": [[cs.key, cs.value.hex()] for cs in partitioner.delegation_spec.compile_specs],
    })


def pass_insertions_digest() -> str:
    """XNNPACK has no registry of user pass insertions: its pass list is the backend's code."""
    return "none"


def spec_after_quantize(spec: Any) -> None:
    """The stock quantization stage leaves XNNPACK's partitioner arguments as they were: nothing to reproduce."""


def import_quantizer() -> None:
    """Import what the stock quantization stage imports, which a hit on the stage skips: the XNNPACK quantizer."""
    importlib.import_module(QUANTIZER_MODULE)


@functools.lru_cache(maxsize=1)
def backend_source_parts() -> dict[str, str]:
    """The XNNPACK backend's sources (Python and flatbuffer schema): a local patch misses though the version is the same.

    Once per process, as ``toolchain_parts``: the code that runs is what the process imported (a walk of the
    backend's tree per partition cost DeiT-tiny 51 walks, a second with the backstop tracing them)."""
    spec = importlib.util.find_spec("executorch")
    root = os.path.join(list(spec.submodule_search_locations or [])[0], "backends", "xnnpack") if spec else ""
    return {"xnnpack_backend_src": source_digest(root, suffixes=BACKEND_SOURCES)}


def import_backend() -> None:
    """Import the XNNPACK backend (seconds in a new process): only on a miss."""
    importlib.import_module(XNNPACK_MODULE)
    importlib.import_module("executorch.backends.xnnpack.partition.xnnpack_partitioner")


TAG = "delegation_tag"


def _tag_pattern(nodes: Any) -> str:
    """Which of a partition's nodes carry which delegation tag, each tag by the order it first appears in, not by its
    number. The partitioner numbers tags across the whole program, so an edit anywhere renumbers every partition's
    (its own, and its inputs' from other partitions); no code ``preprocess`` runs reads a tag (docs/design.md#xnnpack),
    so the numbers shape no byte of the payload."""
    order: dict[Any, int] = {}
    return digest_json([[n.name, order.setdefault(n.meta[TAG], len(order))] for n in nodes if TAG in n.meta])


def preprocess_parts(edge_program: Any, compile_specs: Any) -> dict[str, str] | None:
    """Key parts of one partition's ``preprocess``, or None when it must not be cached: the partition's program (its
    nodes' ``debug_handle`` among their metadata), the source functions the linear and SDPA passes group nodes by (which
    the common graph digest leaves out), the compile specs (``dqlinear_partitioner`` picks the passes), the toolchain."""
    try:
        parts = {f"program.{k}": v for k, v in program_parts(edge_program, IGNORED_META | {TAG}).items()}
        parts["source_fns"] = digest_json([[n.name, canon(n.meta.get("source_fn_stack"))] for n in edge_program.graph.nodes])
        parts["delegation_tags"] = _tag_pattern(edge_program.graph.nodes)
    except Unhashable:
        return None
    parts["compile_specs"] = digest_json([[spec.key, bytes(spec.value).hex()] for spec in compile_specs])
    parts.update(arithmetic.step_parts())
    parts.update(backend_source_parts())
    return parts


class _Unstorable(Exception):
    """Stock's result holds something the step does not store: it is handed back as it is, uncached."""

    def __init__(self, result: Any):
        super().__init__("unstorable preprocess result")
        self.result = result


def _data_entries(entries: dict[str, Any]) -> list[list[Any]]:
    """A NamedDataStore map as ordered JSON (its order is the order the .pte lays the data out in)."""
    rows = []
    for key, entry in entries.items():
        layout = entry.tensor_layout
        form = None if layout is None else [layout.scalar_type.name, [int(s) for s in layout.sizes], [int(d) for d in layout.dim_order]]
        rows.append([key, int(entry.buffer_index), int(entry.alignment), form])
    return rows


def _stored(result: Any) -> Entry:
    """``preprocess``'s result as an entry: bytes as blobs, the rest as ordered JSON (or :class:`_Unstorable`)."""
    handles = result.debug_handle_map
    output = result.data_store_output
    storable = (
        type(result.processed_bytes) is bytes
        and result._delegate_info_meta is None
        and (handles is None or all(isinstance(k, (int, str)) and isinstance(v, (tuple, list)) and all(type(i) is int for i in v)
                                    for k, v in handles.items()))
        and (output is None or all(type(b) is bytes for b in output.buffers))
    )
    if not storable:
        raise _Unstorable(result)
    meta: dict[str, Any] = {
        "debug_handle_map": None if handles is None else [[k, type(v).__name__, list(v)] for k, v in handles.items()],
        "data_store": None if output is None else {
            "buffers": len(output.buffers),
            "pte_data": _data_entries(output.pte_data),
            "external_data": [[name, _data_entries(entries)] for name, entries in output.external_data.items()],
        },
    }
    blobs = {"delegate": result.processed_bytes}
    blobs.update({f"data/{i}": buffer for i, buffer in enumerate(output.buffers if output is not None else ())})
    return Entry(meta=meta, blobs=blobs)


def _int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"not an integer: {value!r}")
    return value


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise ValueError(f"not a list: {values!r}")
    return [_int(v) for v in values]


def _served(entry: Entry) -> Any:
    """The ``PreprocessResult`` stock gave, from its entry: every field equal, the data store's order kept.
    Every stored value is checked (ValueError, KeyError or TypeError when one is not as :func:`_stored` writes it)."""
    from executorch.exir._serialize._named_data_store import NamedDataStoreOutput
    from executorch.exir._serialize.data_serializer import DataEntry
    from executorch.exir.backend.backend_details import PreprocessResult
    from executorch.exir.scalar_type import ScalarType
    from executorch.exir.tensor_layout import TensorLayout

    store = entry.meta["data_store"]
    count = 0 if store is None else _int(store["buffers"])

    def entries(rows: list[list[Any]]) -> dict[str, Any]:
        made = {}
        for key, index, alignment, form in rows:
            if not isinstance(key, str) or not 0 <= _int(index) < count:
                raise ValueError(f"bad data entry {key!r}")
            layout = None if form is None else TensorLayout(ScalarType[form[0]], _ints(form[1]), _ints(form[2]))
            made[key] = DataEntry(index, _int(alignment), layout)
        return made

    output = None if store is None else NamedDataStoreOutput(
        buffers=[entry.blobs[f"data/{i}"] for i in range(count)],
        pte_data=entries(store["pte_data"]),
        external_data={str(name): entries(rows) for name, rows in store["external_data"]},
    )
    handles = entry.meta["debug_handle_map"]
    if handles is not None:
        handles = {k if isinstance(k, str) else _int(k): tuple(_ints(v)) if kind == "tuple" else _ints(v) for k, kind, v in handles}
    return PreprocessResult(processed_bytes=entry.blobs["delegate"], debug_handle_map=handles, data_store_output=output)


def _preprocess(edge_program: Any, compile_specs: Any) -> Any:
    original = _originals["preprocess"]
    session = current_session()
    if session is None:
        return original(edge_program, compile_specs)
    parts = preprocess_parts(edge_program, compile_specs)  # before the call: the backend's passes change the program
    index = len(session.outputs.get("xnnpack", []))
    computed: list[Any] = []

    def compute() -> Entry:
        computed.append(original(edge_program, compile_specs))
        return _stored(computed[-1])

    try:
        entry = session.run("xnnpack", f"partition {index}", parts, compute)
    except _Unstorable as unstorable:
        return unstorable.result
    if computed:
        return computed[-1]
    try:
        return _served(entry)
    except (KeyError, TypeError, ValueError) as err:  # an entry that does not rebuild is a miss, never a crash
        log.warning("cached XNNPACK delegate unusable (%s); recomputing", err)
        result = original(edge_program, compile_specs)
        with contextlib.suppress(_Unstorable):
            session.replace("xnnpack", parts, _stored(result))
        return result


_originals: dict[str, Any] = {}
_switches = Switches((FAMILY.name,), {}, {})


def _apply() -> None:
    backend = importlib.import_module(XNNPACK_MODULE).XnnpackBackend
    if "preprocess" not in _originals:
        _originals["preprocess"] = backend.preprocess
        backend.preprocess = staticmethod(_preprocess)
    _switches.on()


def _undo() -> None:
    _switches.off()
    if "preprocess" in _originals:
        importlib.import_module(XNNPACK_MODULE).XnnpackBackend.preprocess = staticmethod(_originals.pop("preprocess"))


_hooks = Patch(_apply, _undo)
hooks = _hooks.active


_permanent: list[bool] = []


def install_permanently(module_name: str) -> None:
    """Used by ``lowercache run``: wrap ``XnnpackBackend.preprocess`` for the life of the process (once)."""
    if not _permanent:
        _permanent.append(True)
        _hooks.enable()
