"""The Python API, and the one core the CLI is a thin layer over.

- :func:`lower`: lower a module (or exported program) for a target, through
  the cache; returns the artifacts.
- :func:`cached`: a context manager that serves the per-partition steps of
  every target family (Arm's preprocess and Vela, XNNPACK's preprocess) of
  unchanged stock ExecuTorch calls inside it from the cache.
- :func:`write_artifacts`: write artifacts and manifest to a directory,
  staged inside it and renamed into place (a failed write removes what it staged).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .lowering import flow
from .cache import history
from .config import Settings, load_settings, parse_check
from .errors import LowercacheError
from .output import check_output_dir, write_files
from .lowering.flow import Artifacts
from .cache.steps import Listener, Session, activate
from .cache.tiers import open_store
from .targets import FAMILIES, resolve
from .speedups import registry

__all__ = ["lower", "cached", "write_artifacts", "open_store", "check_output_dir", "Artifacts"]


def lower(
    model: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Sequence[Any] | None = None,
    *,
    target: str,
    cache_dir: str | os.PathLike | None = None,
    calibration: Sequence[Sequence[Any]] | None = None,
    use_cache: bool = True,
    per_channel: bool = True,
    name: str | None = None,
    listener: Listener | None = None,
    settings: Settings | None = None,
    system_config: str | None = None,
    memory_mode: str | None = None,
    check: bool | str = False,
) -> Artifacts:
    """Lower ``model`` for ``target`` as the stock ExecuTorch Arm flow would, from cache when possible.

    ``per_channel=False`` quantizes weights per tensor. ``system_config`` and ``memory_mode`` choose Vela's
    (Ethos-U targets; default: ExecuTorch's for the target). ``name`` identifies the model in run history (``lowercache explain``);
    it defaults to the module's class name. ``check`` runs the lowered program on the TOSA reference model against the
    float model (the example inputs, then each calibration sample) into ``artifacts.numerics`` and the manifest; ``check="layers"``
    adds the per-layer figures (``numerics["layers"]``); it changes no lowered byte (docs/numerics.md).
    """
    resolved = resolve(target, per_channel, system_config, memory_mode)
    mode = parse_check(check, "check")
    settings = settings or load_settings(cache_dir=cache_dir, disable=None if use_cache else True)
    registry.select(settings.speedups)
    if isinstance(model, torch.export.ExportedProgram):
        if example_inputs is None:
            example_inputs = tuple(model.example_inputs[0]) if model.example_inputs else None
        if example_inputs is None:
            raise LowercacheError("example_inputs are required for a program saved without them")
        default_name = "ExportedProgram"
    else:
        if example_inputs is None:
            raise LowercacheError("example_inputs are required to export a module")
        default_name = type(model).__qualname__
    example = tuple(example_inputs)
    samples = [tuple(s) for s in calibration] if calibration is not None else None
    store = open_store(settings)
    try:
        session = Session(store, listener=listener, replay_output=listener is None)
        if isinstance(model, torch.export.ExportedProgram):
            artifacts = flow.lower_program(model, resolved, example, samples, session, check=mode)
        else:
            artifacts = flow.lower_module(model, example, resolved, samples, session, check=mode)
        artifacts.manifest = flow.manifest(artifacts, resolved, name or default_name)
        remote = getattr(store, "remote", None)
        if remote is not None:
            artifacts.manifest["remote"] = remote.stats()
        session.flush_counts()
        if store is not None:
            history.record_run(store, name or default_name, resolved.name, artifacts.records)
        return artifacts
    finally:
        if store is not None:
            store.close()


def flow_key(
    model: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Sequence[Any],
    *,
    target: str,
    settings: Settings,
    calibration: Sequence[Sequence[Any]] | None = None,
    per_channel: bool = True,
    listener: Listener | None = None,
    system_config: str | None = None,
    memory_mode: str | None = None,
) -> str | None:
    """The key :func:`lower` would give its flow step, without lowering (None: the program cannot be keyed)."""
    resolved = resolve(target, per_channel, system_config, memory_mode)
    registry.select(settings.speedups)
    samples = [tuple(s) for s in calibration] if calibration is not None else None
    store = open_store(settings)
    try:
        return flow.flow_key(model, tuple(example_inputs), resolved, samples, Session(store, listener=listener))
    finally:
        if store is not None:
            store.close()


def write_artifacts(artifacts: Artifacts, out_dir: str | os.PathLike) -> list[Path]:
    """Write every artifact and ``manifest.json`` into ``out_dir``, staged and renamed into place (see :func:`lowercache.output.write_files`)."""
    return write_files(artifacts.files, artifacts.manifest, out_dir)


@contextlib.contextmanager
def cached(cache_dir: str | os.PathLike | None = None, *, read_only: bool | None = None) -> Iterator[Session]:
    """Serve the per-partition steps of stock ExecuTorch calls inside the block from the cache, for every target family.

    Inside the block, each family's hooks are on (``Family.hooks``): every
    partition's TOSA lowering (the Arm pass pipeline), every Vela compile and
    every XNNPACK ``preprocess`` go through the cache; the rest of
    ``to_edge_transform_and_lower`` and ``to_executorch`` run as usual. The
    yielded session records what was hit.
    """
    settings = load_settings(cache_dir=cache_dir, read_only=read_only)
    registry.select(settings.speedups)
    store = open_store(settings)
    session = Session(store)
    try:
        with contextlib.ExitStack() as hooks:
            for module in dict.fromkeys(family.hooks for family in FAMILIES):  # the Arm families share one module
                hooks.enter_context(importlib.import_module(module).hooks())
            with activate(session):
                yield session
    finally:
        session.flush_counts()
        if store is not None:
            store.close()
