"""The stock oracle: the .pte stock ExecuTorch produces, written straight from the README, with no lowercache code.

Stock lowerings are the suite's largest shared cost, and xdist workers cannot share an in-memory cache, so results
are kept on disk. The key is everything stock's bytes depend on: the installed torch, ExecuTorch, torchao,
tosa-tools and Vela, this file, the exported program in torch's own serialized form (graph, metadata and weights;
stack traces name files from the checkout's root), the inputs and the options. An entry carries its own digest and is
rebuilt if it does not match.
``LOWERCACHE_TEST_ORACLE`` sets the directory; ``off`` turns the disk cache off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Iterator

import torch

from lowercache.bench import models

from . import ROOT

_DISTRIBUTIONS = ("torch", "executorch", "torchao", "tosa-tools", "ethos-u-vela")


def _directory() -> Path | None:
    setting = os.environ.get("LOWERCACHE_TEST_ORACLE", "")
    if setting == "off":
        return None
    if setting:
        return Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowercache-tests" / "oracle"


# Read once at import: the suite's per-test fixtures point XDG_CACHE_HOME at a temporary directory.
DIRECTORY = _directory()


@functools.lru_cache(maxsize=1)
def _toolchain() -> bytes:
    versions = []
    for name in _DISTRIBUTIONS:
        try:
            versions.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name}=absent")
    return ("\n".join(versions) + "\n").encode() + Path(__file__).read_bytes()


def _tensors(digest, samples) -> None:
    for sample in samples:
        for value in sample:
            if isinstance(value, torch.Tensor):
                tensor = value.detach().contiguous().cpu()
                digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            else:
                digest.update(repr(value).encode())
        digest.update(b"|")


# Where this checkout is: the stack traces a program carries name its files.
CHECKOUT = str(ROOT)


def _saved(program: torch.export.ExportedProgram) -> bytes:
    """The program as ``torch.export.save`` writes it, its stack traces naming this checkout's files from its root.

    Stack traces never reach stock's bytes; without this, every other checkout of the project (a worktree, a CI
    runner in another directory) would lower every reference again. The program is left as it was.
    """
    traces = {}
    for node in program.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace and CHECKOUT in trace:
            traces[node] = trace
            node.meta["stack_trace"] = trace.replace(CHECKOUT, "<checkout>")
    try:
        saved = io.BytesIO()
        torch.export.save(program, saved)
        return saved.getvalue()
    finally:
        for node, trace in traces.items():
            node.meta["stack_trace"] = trace


def threads() -> str:
    """What sets torch's intra-op thread count, which can move a float's last bit in calibration (an XNNPACK int8
    attention block: one byte of the .pte): this process's count, and what a new process would start with."""
    settings = (os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS"), len(os.sched_getaffinity(0)))
    return repr((torch.get_num_threads(), settings))


def key(program: torch.export.ExportedProgram, example_inputs, target: str, calibration, options: dict) -> str:
    digest = hashlib.sha256(_toolchain())
    digest.update(_saved(program))
    _tensors(digest, [example_inputs])
    _tensors(digest, calibration or [])
    # A multi-partition lowering's order follows the string-hash seed: a seed set for the process is part of the key.
    seed = os.environ.get("PYTHONHASHSEED", "random")
    digest.update(repr((target, calibration is None, sorted(options.items()), seed, threads())).encode())
    return digest.hexdigest()


def _load(name: str) -> bytes | None:
    if DIRECTORY is None:
        return None
    try:
        blob = (DIRECTORY / name).read_bytes()
    except OSError:
        return None
    stored, payload = blob[:32], blob[32:]
    return payload if hashlib.sha256(payload).digest() == stored else None


def _save(name: str, payload: bytes) -> None:
    if DIRECTORY is None:
        return
    try:
        DIRECTORY.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=DIRECTORY, prefix=".tmp-", delete=False) as tmp:
            tmp.write(hashlib.sha256(payload).digest() + payload)
        os.replace(tmp.name, DIRECTORY / name)
    except OSError:
        pass  # a read-only or full disk only costs the next session a recompute


def stock_pte(module, example_inputs, target: str, calibration=None, per_channel: bool = True, strict: bool = False,
              **vela_options) -> bytes:
    """The .pte stock ExecuTorch produces, from the disk cache when it holds it; ``strict``: both exports dynamo's;
    ``vela_options``: EthosUCompileSpec's ``system_config`` / ``memory_mode``. Only for the expected bytes: a test
    that runs the stock flow under a patch calls :func:`run_stock`."""
    ep = torch.export.export(module, example_inputs, strict=strict)
    name = key(ep, example_inputs, target, calibration, dict(per_channel=per_channel, strict=strict, **vela_options))
    with _locked(name):
        cached = _load(name)
        if cached is None:
            cached = _lower(ep, example_inputs, target, calibration, per_channel, strict, vela_options)
            _save(name, cached)
    return cached


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One lowering per key at a time: a second xdist worker that needs a reference the first is making waits for it and
    reads it, instead of lowering it again (an empty oracle's first minutes). Without a usable directory, no lock."""
    try:
        if DIRECTORY is None:
            raise FileNotFoundError
        (DIRECTORY / ".locks").mkdir(parents=True, exist_ok=True)
        lock = open(DIRECTORY / ".locks" / name, "w")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_stock(module, example_inputs, target: str, calibration=None, per_channel: bool = True, strict: bool = False,
              **vela_options) -> bytes:
    """The stock flow run now, never from the cache: for tests that run it under a speed-up or an audit."""
    ep = torch.export.export(module, example_inputs, strict=strict)
    return _lower(ep, example_inputs, target, calibration, per_channel, strict, vela_options)


def _lower(ep, example_inputs, target, calibration, per_channel, strict, vela_options) -> bytes:
    from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
    from executorch.backends.arm.quantizer import EthosUQuantizer, TOSAQuantizer, get_symmetric_quantization_config
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    ethos = target.startswith("ethos-u")
    spec = EthosUCompileSpec(target, **vela_options) if ethos else TosaCompileSpec({"tosa-int": "TOSA-1.0+INT", "tosa-fp": "TOSA-1.0+FP"}[target])
    if target != "tosa-fp":
        # The quantizer may adjust the compile spec's pass pipeline config, so
        # the partitioner is made after quantization, as in the README's flow.
        quantizer = EthosUQuantizer(spec) if ethos else TOSAQuantizer(spec)
        quantizer.set_global(get_symmetric_quantization_config(is_per_channel=per_channel))
        prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
        for sample in calibration or [example_inputs]:
            prepared(*sample)
        ep = torch.export.export(convert_pt2e(prepared), example_inputs, strict=strict)
    partitioner = EthosUPartitioner(spec) if ethos else TOSAPartitioner(spec)
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner])
    return edge.to_executorch().buffer


@functools.lru_cache(maxsize=None)
def reference(model: str, target: str, edit: str | None = None) -> bytes:
    """Stock .pte of a small benchmark model."""
    module, example = models.MODELS[model](edit=edit)
    return stock_pte(module, example, target)
