"""Reading a saved ExportedProgram (``.pt2``) as data: nothing in the file is unpickled or run.

``torch.export.load`` unpickles (``weights_only=False``) every weight or
constant whose config says ``use_pickle``, custom and opaque objects, legacy
pickled weight files, and example inputs a weights-only load refuses; it
parses symbolic shape expressions with sympy (which uses ``eval``), compiles
guard code, loads AOTInductor libraries, and resolves each node's target by
walking attributes of ``torch`` (``torch.os.system`` resolves). A crafted
``.pt2`` can run a shell command that way.

This reader checks the archive's configs and graph first and refuses each of
those, naming it; it then builds the program with torch's own deserializer
from raw tensor bytes and weights-only example inputs, so a file written by
``torch.export.save`` gives the program ``torch.export.load`` would.
"""

from __future__ import annotations

import io
import json
import operator
import re
from typing import Any

import torch

from ...errors import LowercacheError

MODEL = "model"  # the program torch.export.save writes and torch.export.load returns

# node targets as text: under torch.ops (no dunder steps) or a symbolic-int helper; the walk can
# still reach a plain method (torch.ops.loaded_libraries.add), so _check_nodes checks what was built
_OP_TARGET = re.compile(r"torch\.ops(\.(?!__)\w+){2,3}")


class Refused(Exception):
    """The archive holds something that loading would unpickle or run."""


def _symbolic_functions() -> frozenset[Any]:
    from torch._export.serde import serialize

    return frozenset(serialize._SYM_OPS | {operator.getitem})


def _symbolic_targets() -> frozenset[str]:
    return frozenset(f"{f.__module__}.{f.__name__}" for f in _symbolic_functions())


def load_saved_program(path: str) -> torch.export.ExportedProgram:
    """The ExportedProgram in ``path``; a one-line :class:`LowercacheError` on anything unsafe or unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LowercacheError(f"cannot read saved program {path}: {e.strerror or e}") from None
    try:
        return _read(data)
    except Refused as e:
        raise LowercacheError(f"refusing saved program {path}: {e}") from None
    except Exception as e:
        lines = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {_first_sentence(lines[0])}" if lines else type(e).__name__
        raise LowercacheError(f"cannot load saved program {path}: {reason}") from None


def _first_sentence(line: str) -> str:
    """The first sentence of an error's first line: torch's archive reader adds about 300 characters of advice
    about corrupt checkpoints after the one that says what is wrong."""
    return re.split(r"(?<=[a-z0-9)])\. (?=[A-Z])", line, maxsplit=1)[0]


def _read(data: bytes) -> torch.export.ExportedProgram:
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass
    from torch.export.pt2_archive import _package as package
    from torch.export.pt2_archive import constants as names

    reader = package.PT2ArchiveReader(io.BytesIO(data))
    version = reader.read_string(names.ARCHIVE_VERSION_PATH)
    if version != names.ARCHIVE_VERSION_VALUE:
        raise Refused(f"archive version {version!r}, not {names.ARCHIVE_VERSION_VALUE!r} (older formats are pickles)")
    files = set(reader.get_file_names())
    model_file = names.MODELS_FILENAME_FORMAT.format(MODEL)
    if model_file not in files:
        raise Refused(f"it holds no {model_file}; save it with torch.export.save")
    for legacy in (f"{names.WEIGHTS_DIR}{MODEL}.pt", f"{names.CONSTANTS_DIR}{MODEL}.pt"):
        if legacy in files:
            raise Refused(f"{legacy} is a pickle (the legacy weights format)")
    _check_payloads(package, reader, names.WEIGHTS_CONFIG_FILENAME_FORMAT.format(MODEL), "weight", (names.WEIGHT_FILENAME_PREFIX,))
    _check_payloads(
        package,
        reader,
        names.CONSTANTS_CONFIG_FILENAME_FORMAT.format(MODEL),
        "constant",
        (names.TENSOR_CONSTANT_FILENAME_PREFIX,),
    )
    program_bytes = reader.read_bytes(model_file)
    _check_graph(json.loads(program_bytes))
    example_inputs = _example_inputs(reader.read_bytes(names.SAMPLE_INPUTS_FILENAME_FORMAT.format(MODEL)))
    serialized = _bytes_to_dataclass(schema.ExportedProgram, program_bytes)
    state_dict = package._load_state_dict(reader, MODEL)
    constants = package._load_constants(reader, MODEL)
    program = ExportedProgramDeserializer(None).deserialize(serialized, state_dict, constants, example_inputs)
    _check_nodes(program)
    return program


def _check_nodes(program: torch.export.ExportedProgram) -> None:
    """After building, before anything runs the graph: every call is a torch operator (the target check on the text, made exact)."""
    operators = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
    symbolic = _symbolic_functions()
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op in ("call_method", "call_module") or (
                node.op == "call_function" and not (isinstance(node.target, operators) or node.target in symbolic)
            ):
                raise Refused(f"node {node.name} calls {node.target!r}, which is not a torch operator")


def _check_payloads(package: Any, reader: Any, config_file: str, kind: str, raw_prefixes: tuple[str, ...]) -> None:
    """Every weight or constant must be raw tensor bytes: torch unpickles the rest."""
    config = package._load_payload_config(reader, config_file)
    for fqn, meta in config.config.items():
        if not meta.path_name.startswith(raw_prefixes):
            raise Refused(f"{kind} {fqn!r} is a {meta.path_name.rstrip('0123456789')} object, which torch loads with pickle")
        if meta.use_pickle:
            raise Refused(f"{kind} {fqn!r} is stored as a pickle (use_pickle), which lowercache never unpickles")


def _check_graph(doc: Any) -> None:
    """Refuse what deserializing or running the graph would evaluate: guard code, sympy text, callables outside torch.ops."""
    if not isinstance(doc, dict):
        raise Refused("models/model.json is not a program")
    if doc.get("guards_code"):
        raise Refused("it holds guard code (Python source torch compiles)")
    allowed = _symbolic_targets()
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if item.get("as_expr") is not None:
                raise Refused("it holds symbolic shape expressions (sympy parses them with eval); lowercache lowers static shapes")
            target = item.get("target")
            if isinstance(target, str) and "inputs" in item and not (_OP_TARGET.fullmatch(target) or target in allowed):
                raise Refused(f"a node calls {target[:80]!r}, which is not a torch operator")
            stack.extend(item.values())


def _example_inputs(data: bytes) -> Any:
    """Example inputs, weights-only: torch's own loader retries a refused file with ``weights_only=False``."""
    if not data:
        return {}
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        lines = str(e).strip().splitlines()
        raise Refused(f"its example inputs need a full unpickle ({lines[0][:120] if lines else type(e).__name__})") from None
    if not isinstance(value, (tuple, dict)):
        raise Refused(f"its example inputs are a {type(value).__name__}, not a tuple")
    return value
