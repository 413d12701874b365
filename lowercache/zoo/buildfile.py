"""The build file: ``lowercache.toml``, or ``[tool.lowercache]`` in ``pyproject.toml``, checked by a schema.

pydantic is imported only here, so commands other than ``build`` do not pay
its start-up. A bad file is one :class:`LowercacheError` naming the key.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..config import parse_size
from ..errors import LowercacheError
from ..targets import resolve

BUILD_FILE = "lowercache.toml"
PYPROJECT = "pyproject.toml"
DEFAULT_LAYOUT = "{model}/{target}"
DEFAULT_MEMORY = "2G"  # a small model's lowering; a DeiT-tiny one peaks at several GB: say so per model
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FIELDS = re.compile(r"{([^{}]*)}")


@dataclass(frozen=True)
class Pair:
    """One (model, target) of the build: everything a ``lowercache lower`` command line needs, as plain data."""

    name: str  # the model's name in the build file
    model: str  # file.py:factory or a .pt2, relative to the build file's directory
    target: str
    out: str  # output directory, relative to the build file's directory
    calibration: Optional[str] = None
    per_tensor: bool = False
    memory: int = 2 * 2**30  # bytes one lowering may use: bounds -j, and the Ray task declares it
    system_config: Optional[str] = None  # Vela's, for Ethos-U targets
    memory_mode: Optional[str] = None
    check: bool = False  # the numerics check (docs/numerics.md)

    def lower_args(self, options: list[str]) -> list[str]:
        """``lower`` as a user would type it for this pair, plus the build-wide ``options``."""
        return [
            "lower", self.model, "--target", self.target, "--out", self.out,
            *(["--calibration", self.calibration] if self.calibration else []),
            *(["--per-tensor"] if self.per_tensor else []),
            *(["--system-config", self.system_config] if self.system_config else []),
            *(["--memory-mode", self.memory_mode] if self.memory_mode else []),
            *(["--check"] if self.check else []),
            *options,
        ]


@dataclass
class Build:
    """A checked build file."""

    path: Path
    root: Path  # the directory model, calibration and output paths are relative to
    out: str
    pairs: list[Pair]
    max_snr_drop: Optional[float] = None  # --compare fails the build when a pair's SNR falls more than this (dB)

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(p.name for p in self.pairs))


def find(given: Optional[Path], cwd: Path) -> Path:
    """``--file``, else ``lowercache.toml`` in ``cwd``, else ``pyproject.toml`` there if it has ``[tool.lowercache]``."""
    if given is not None:
        if not given.is_file():
            raise LowercacheError(f"build file not found: {given}")
        return given
    if (cwd / BUILD_FILE).is_file():
        return cwd / BUILD_FILE
    if (cwd / PYPROJECT).is_file() and "lowercache" in _read_toml(cwd / PYPROJECT).get("tool", {}):
        return cwd / PYPROJECT
    raise LowercacheError(f"no build file in {cwd}: write {BUILD_FILE} or [tool.lowercache] in {PYPROJECT}, or pass --file")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise LowercacheError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise LowercacheError(f"cannot read {path}: {e.strerror or e}") from None


def _check_target(name: str) -> str:
    try:
        return resolve(name).name
    except LowercacheError as e:
        raise ValueError(str(e)) from None


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError("a model's name may hold letters, digits, '_', '.' and '-' (it names its output directory)")
    return name


def _check_layout(layout: str) -> str:
    fields = set(_FIELDS.findall(layout))
    if not fields <= {"model", "target"}:
        raise ValueError(f"only {{model}} and {{target}} may appear in a layout, not {sorted(fields - {'model', 'target'})}")
    if "target" not in fields:
        raise ValueError("a layout must contain {target}: each target writes its own directory")
    return layout


def _check_size(text: str) -> str:
    try:
        parse_size(text)
    except LowercacheError as e:
        raise ValueError(str(e)) from None
    return text


def _check_model(spec: str) -> str:
    if not spec.endswith(".pt2") and not spec.rpartition(":")[0]:
        raise ValueError("expected path/to/file.py:factory or a .pt2 file")
    return spec


@functools.cache
def _schema() -> Any:
    """The pydantic model of the build file, made on first use (pydantic's import is not free, and a warm run may not need it)."""
    from typing import Annotated

    from pydantic import AfterValidator, BaseModel, ConfigDict, Field

    Target = Annotated[str, AfterValidator(_check_target)]
    Layout = Annotated[str, AfterValidator(_check_layout)]
    Size = Annotated[str, AfterValidator(_check_size)]

    class ModelEntry(BaseModel):
        model_config = ConfigDict(extra="forbid", populate_by_name=False)
        model: Annotated[str, AfterValidator(_check_model)]
        targets: Optional[list[Target]] = Field(None, min_length=1)
        calibration: Optional[str] = None
        per_tensor: bool = Field(False, alias="per-tensor")
        system_config: Optional[str] = Field(None, alias="system-config")
        memory_mode: Optional[str] = Field(None, alias="memory-mode")
        layout: Optional[Layout] = None
        memory: Optional[Size] = None
        check: Optional[bool] = None

    class BuildFile(BaseModel):
        model_config = ConfigDict(extra="forbid")
        out: str = "build"
        targets: list[Target] = []
        layout: Layout = DEFAULT_LAYOUT
        memory: Size = DEFAULT_MEMORY
        check: bool = False
        max_snr_drop: Optional[float] = Field(None, alias="max-snr-drop", ge=0, allow_inf_nan=False)
        models: dict[Annotated[str, AfterValidator(_check_name)], ModelEntry] = Field(min_length=1)

    return BuildFile


def _one_line(path: Path, error: Any, prefix: str) -> str:
    """One of pydantic's errors as ``file: key.path: what``: an unknown key first (a misspelt key also leaves one missing)."""
    errors = error.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where = prefix + ".".join(str(part) for part in first["loc"] if not (isinstance(part, str) and "[" in part)) or "(top level)"
    message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
    return f"{path.name}: {where}: {message}"


def load(path: Path) -> Build:
    """Read and check a build file: schema, model and calibration files that exist, each pair with at least one target."""
    from pydantic import ValidationError

    data = _read_toml(path)
    prefix = ""
    if path.name == PYPROJECT:
        prefix = "tool.lowercache."
        data = data.get("tool", {}).get("lowercache")
        if not isinstance(data, dict):
            raise LowercacheError(f"{path}: no [tool.lowercache] table")
    try:
        spec = _schema().model_validate(data)
    except ValidationError as e:
        raise LowercacheError(_one_line(path, e, prefix)) from None
    root = path.resolve().parent
    pairs = []
    for name, entry in spec.models.items():
        where = f"{path.name}: {prefix}models.{name}"
        model_file = entry.model if entry.model.endswith(".pt2") else entry.model.rpartition(":")[0]
        if not (root / model_file).is_file():
            raise LowercacheError(f"{where}.model: file not found: {model_file}")
        if entry.calibration is not None and not (root / entry.calibration).is_file():
            raise LowercacheError(f"{where}.calibration: file not found: {entry.calibration}")
        targets = list(dict.fromkeys(entry.targets or spec.targets))
        if not targets:
            raise LowercacheError(f"{where}.targets: no targets (give targets here or at the top level)")
        layout = entry.layout or spec.layout
        memory = parse_size(entry.memory or spec.memory)
        for target in targets:
            try:
                resolve(target, system_config=entry.system_config, memory_mode=entry.memory_mode)
            except LowercacheError as e:
                raise LowercacheError(f"{where}: {e}") from None
            out = os.path.join(spec.out, layout.format(model=name, target=target))
            pairs.append(Pair(name, entry.model, target, out, entry.calibration, entry.per_tensor, memory,
                              entry.system_config, entry.memory_mode, spec.check if entry.check is None else entry.check))
    outs = [os.path.normpath(p.out) for p in pairs]
    clash = next((o for o in outs if outs.count(o) > 1), None)
    if clash is not None:
        raise LowercacheError(f"{path.name}: layout: two pairs write {clash}")
    return Build(path=path, root=root, out=spec.out, pairs=pairs, max_snr_drop=spec.max_snr_drop)


def select(build: Build, names: list[str]) -> list[Pair]:
    """The pairs of the named models (all when none are named); an unknown name is an error."""
    unknown = [n for n in names if n not in build.names]
    if unknown:
        raise LowercacheError(f"no model named {unknown[0]!r} in {build.path.name} (models: {', '.join(build.names)})")
    return [p for p in build.pairs if not names or p.name in names]
