"""The Python API, and the one core the CLI is a thin layer over.

- :func:`lower`: lower a module (or exported program) for a target, through
  the cache; returns the artifacts.
- :func:`cached`: a context manager that serves the Arm preprocess and Vela
  steps of unchanged stock ExecuTorch calls inside it from the cache.
- :func:`write_artifacts`: write artifacts and manifest to a directory,
  staged inside it and renamed into place (a failed write removes what it staged).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .lowering import arm, flow
from .cache import history
from .config import Settings, load_settings
from .errors import LowercacheError
from .lowering.flow import Artifacts
from .cache.hashing import digest
from .cache.steps import Listener, Session, activate
from .cache.store import Store
from .lowering.targets import resolve
from .speedups import registry

__all__ = ["lower", "cached", "write_artifacts", "open_store", "Artifacts"]


def open_store(settings: Settings) -> Store | None:
    """The store the settings name (local, or local then remote), or None when caching is disabled."""
    if settings.disable:
        return None
    local = Store(settings.cache_dir, max_size=settings.max_size, read_only=settings.read_only)
    if not settings.remote:
        return local
    from .cache.remote import TieredStore, connect, hmac_key_from_env

    mode = settings.remote_mode
    if settings.read_only:  # read-only means every tier, as in ccache
        if mode == "write-only":
            return local  # a remote that may be neither read nor written
        mode = "read-only"
    try:
        ttl = {"ttl_seconds": settings.remote_ttl} if settings.remote_ttl else {}
        remote = connect(
            settings.remote,
            mode=mode,
            hmac_key=hmac_key_from_env(),
            require_signed=settings.remote_require_signed,
            **ttl,
        )
    except LowercacheError:
        local.close()
        raise
    return TieredStore(local, remote)


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
) -> Artifacts:
    """Lower ``model`` for ``target`` as the stock ExecuTorch Arm flow would, from cache when possible.

    ``per_channel=False`` quantizes weights per tensor. ``name`` identifies the model in run history (``lowercache explain``);
    it defaults to the module's class name.
    """
    resolved = resolve(target, per_channel)
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
            artifacts = flow.lower_program(model, resolved, example, samples, session)
        else:
            artifacts = flow.lower_module(model, example, resolved, samples, session)
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


def _unwritable(out: Path, why: str) -> LowercacheError:
    return LowercacheError(f"cannot write output directory {out}: {why}")


def check_output_dir(out_dir: str | os.PathLike) -> None:
    """Fail before a lowering, not after it, when ``out_dir`` cannot receive the artifacts.

    Probes the nearest existing directory on the way to ``out_dir`` with a
    temporary directory, removed at once: nothing is left behind.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise _unwritable(out, "it exists and is not a directory")
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise _unwritable(out, f"{probe} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lowercache-probe-", dir=probe))
    except OSError as e:
        raise _unwritable(out, f"{probe}: {e.strerror or e}") from None


def write_artifacts(artifacts: Artifacts, out_dir: str | os.PathLike) -> list[Path]:
    """Write every artifact and ``manifest.json`` into ``out_dir``; a failed write removes what it staged.

    Files are staged in a temporary directory inside ``out_dir`` and each is
    renamed into place: a rename within one directory never crosses devices,
    so a mount point (a Docker or CI volume) receives output, and the
    parent's permissions do not matter. Concurrent writers each stage their
    own files and replace whole files, so they all succeed with the same
    bytes. Files of the previous lowering that this one does not write are
    removed (see :func:`_stale_files`) just before the new manifest, which
    goes last: a run killed in between leaves them still listed, for the
    next run to remove.
    """
    out = Path(out_dir)
    files = dict(artifacts.files)
    files["manifest.json"] = (json.dumps(artifacts.manifest, indent=2, sort_keys=True) + "\n").encode()
    created = not out.is_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
        stale = _stale_files(out, files)
        _remove_abandoned_staging(out)
        tmp = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    except OSError as e:
        _remove_if_empty(out, created)
        raise _unwritable(out, e.strerror or str(e)) from None
    moved: list[tuple[Path, int]] = []
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for name in sorted(files, key=lambda n: n == "manifest.json"):
            if name == "manifest.json":
                for path in stale:
                    with contextlib.suppress(OSError):
                        path.unlink()
            os.replace(tmp / name, out / name)
            moved.append((out / name, (out / name).stat().st_ino))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:  # leave no partial directory, but keep a concurrent writer's files
            for path, inode in moved:
                with contextlib.suppress(OSError):
                    if path.stat().st_ino == inode:
                        path.unlink()
        _remove_if_empty(out, created)
        raise _unwritable(out, e.strerror or str(e)) from None
    shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in sorted(files)]


STAGING_PREFIX = ".lowercache-tmp-"
ABANDONED_AFTER_S = 3600  # far longer than writing a few files takes: a staging folder this old lost its writer


def _remove_abandoned_staging(out: Path) -> None:
    """Staging folders a killed run left in ``out``; a live writer's folder is minutes old at most."""
    now = time.time()
    for path in out.glob(f"{STAGING_PREFIX}*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink() and now - path.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(path)


def _remove_if_empty(out: Path, created: bool) -> None:
    """A failed first write leaves no directory (a concurrent writer's files keep it)."""
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()


def _stale_files(out: Path, files: dict[str, bytes]) -> list[Path]:
    """Files the previous lowering in ``out`` wrote and this one does not: a stale ``partition_1.tosa`` would pass for output.

    Only files ``out/manifest.json`` lists, with plain names, that still hold
    the bytes it records: a user's other files, or a listed file they have
    changed since, are kept.
    """
    try:
        previous = json.loads((out / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return []
    listed = previous.get("files") if isinstance(previous, dict) else None
    if not isinstance(listed, dict):
        return []
    stale = []
    for name, record in listed.items():
        if name in files or name.startswith(".") or not isinstance(record, dict) or Path(name).name != name:
            continue
        path = out / name
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size != record.get("size"):
                continue
            if digest(path.read_bytes()) == record.get("xxh3_128"):
                stale.append(path)
        except OSError:
            continue
    return stale


@contextlib.contextmanager
def cached(cache_dir: str | os.PathLike | None = None, *, read_only: bool | None = None) -> Iterator[Session]:
    """Serve the Arm steps of stock ExecuTorch calls inside the block from the cache.

    Inside the block, every partition's TOSA lowering (the Arm pass pipeline)
    and every Vela compile go through the cache; the rest of
    ``to_edge_transform_and_lower`` and ``to_executorch`` run as usual. The
    yielded session records what was hit.
    """
    settings = load_settings(cache_dir=cache_dir, read_only=read_only)
    registry.select(settings.speedups)
    store = open_store(settings)
    session = Session(store)
    try:
        with arm.hooks(), activate(session):
            yield session
    finally:
        session.flush_counts()
        if store is not None:
            store.close()
