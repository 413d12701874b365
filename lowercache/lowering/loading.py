"""Loading user input: model factories, saved programs, calibration files.

Every failure becomes a one-line :class:`LowercacheError` naming the file and
the problem, before any lowering starts or any cache entry is written.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .. import precheck
from ..errors import LowercacheError, user_line
from .stored.savedprogram import load_saved_program


@dataclass
class LoadedModel:
    """A model to lower: an ``nn.Module`` or an already exported program."""

    name: str  # stable identity for run history (``explain``)
    example_inputs: tuple[Any, ...]
    module: torch.nn.Module | None = None
    program: torch.export.ExportedProgram | None = None


def _describe(e: BaseException) -> str:
    """The error's type and first line, and where in the user's code it was raised (``(at model.py:12)``)."""
    text = str(e).strip().splitlines()
    where = user_line(e)
    return (f"{type(e).__name__}: {text[0]}" if text else type(e).__name__) + (f" (at {where})" if where else "")


def _exit_status(e: SystemExit) -> str:
    """``sys.exit``'s argument as the shell would see it: a code, or 1 and the message it prints."""
    if e.code is None or isinstance(e.code, int):
        return str(e.code or 0)
    lines = str(e.code).strip().splitlines()
    return f"1: {lines[0]}" if lines else "1"


def load_model(spec: str) -> LoadedModel:
    """Load ``path/to/file.py:factory`` or a saved ExportedProgram ``.pt2``."""
    problem = precheck.model_problem(spec)
    if problem is not None:
        raise LowercacheError(problem)
    if spec.endswith(".pt2"):
        return _load_program(spec)
    path, _, factory_name = spec.rpartition(":")
    module = _import_file(path)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise LowercacheError(f"{path} has no function {factory_name!r}")
    try:
        result = factory()
    except SystemExit as e:
        raise LowercacheError(f"factory {spec} exited with status {_exit_status(e)}") from None
    except Exception as e:
        raise LowercacheError(f"factory {spec} raised {_describe(e)}") from e  # its traceback: LOWERCACHE_DEBUG=1
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not isinstance(result[0], torch.nn.Module)
        or not isinstance(result[1], tuple)
    ):
        raise LowercacheError(
            f"factory {spec} must return (nn.Module, tuple of example inputs), got {_type_summary(result)}"
        )
    return LoadedModel(name=f"{os.path.abspath(path)}:{factory_name}", module=result[0], example_inputs=result[1])


def _type_summary(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__


def _import_file(path: str) -> Any:
    name = "lowercache_user_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LowercacheError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        sys.modules.pop(name, None)
        raise LowercacheError(f"importing {path} exited with status {_exit_status(e)}") from None
    except Exception as e:
        sys.modules.pop(name, None)
        raise LowercacheError(f"error importing {path}: {_describe(e)}") from e
    return module


def _load_program(path: str) -> LoadedModel:
    program = load_saved_program(path)
    example = getattr(program, "example_inputs", None)
    if not example:
        raise LowercacheError(f"saved program {path} has no example inputs; save it with torch.export.save after export")
    args, kwargs = example
    if kwargs:
        raise LowercacheError(f"saved program {path} takes keyword inputs, which lowercache does not support")
    return LoadedModel(name=os.path.abspath(path), program=program, example_inputs=tuple(args))


def load_calibration(path: str) -> list[tuple[Any, ...]]:
    """Calibration samples from a ``.pt`` or ``.npz`` file; nothing is unpickled.

    ``.pt`` (loaded with ``weights_only=True``): a list of samples; a sample
    is a tuple of input tensors, or a single tensor for one-input models. A
    lone tuple is one sample.

    ``.npz`` (loaded with ``allow_pickle=False``): one array per model input,
    in input order (``numpy.savez(f, x)`` or ``savez(f, x=..., y=...)``), each
    stacking the samples along a new first axis: ``(samples, *input_shape)``.
    """
    if not os.path.isfile(path):
        raise LowercacheError(f"calibration file not found: {path}")
    if path.endswith(".npz"):
        return _load_npz_calibration(path)
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise LowercacheError(f"cannot load calibration file {path}: {_describe(e)}") from None
    if isinstance(data, tuple):
        data = [data]
    if not isinstance(data, list) or not data:
        raise LowercacheError(f"calibration file {path} must hold a non-empty list of input tuples")
    samples = []
    for i, sample in enumerate(data):
        if isinstance(sample, torch.Tensor):
            sample = (sample,)
        if not isinstance(sample, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in sample):
            raise LowercacheError(f"calibration file {path}: sample {i} is not a tuple of tensors")
        samples.append(tuple(sample))
    return samples


def _load_npz_calibration(path: str) -> list[tuple[Any, ...]]:
    import numpy

    try:
        with numpy.load(path, allow_pickle=False) as archive:
            arrays = [archive[name] for name in archive.files]
    except Exception as e:
        raise LowercacheError(f"cannot load calibration file {path}: {_describe(e)}") from None
    if not arrays or any(a.ndim < 1 or a.dtype.kind not in "biuf" for a in arrays):
        raise LowercacheError(f"calibration file {path} must hold one numeric array per input, samples on the first axis")
    count = arrays[0].shape[0]
    if count == 0 or any(a.shape[0] != count for a in arrays):
        raise LowercacheError(f"calibration file {path}: every array needs the same, non-zero number of samples")
    return [tuple(torch.from_numpy(a[i].copy()) for a in arrays) for i in range(count)]


def check_calibration(samples: list[tuple[Any, ...]], example_inputs: tuple[Any, ...], path: str) -> None:
    """Each sample must match the example inputs' count, shapes and dtypes."""
    for i, sample in enumerate(samples):
        if len(sample) != len(example_inputs) or any(
            not isinstance(e, torch.Tensor) or s.shape != e.shape or s.dtype != e.dtype for s, e in zip(sample, example_inputs)
        ):
            raise LowercacheError(f"calibration file {path}: sample {i} does not match the model's example inputs")
