"""Numerics after a lowering: the lowered program run on the TOSA reference model, against the eager float model.

The lowered program runs as ExecuTorch's own Arm tester runs it
(``backends/arm/test/tester/arm_tester.py``, ``ToExecutorch.run_artifact``):
the exported program of ``to_executorch()`` called as a module, under a
``TorchFunctionMode`` that hands every ``executorch_call_delegate`` to the
TOSA reference model (``tosa_reference_model.run``, as ``runner_utils.py``
``run_tosa_graph``), and runs the rest, the operators outside the delegates,
as torch kernels. For Ethos-U the delegate holds Vela's command stream, so
each delegate is given its partition's TOSA flatbuffer, the one Vela
compiled: this checks TOSA's semantics, not Vela's command stream or the NPU.

Two cached steps:

- ``reference``: one run of one partition's TOSA on one input, keyed by the
  TOSA's digest, the inputs' digest and the reference model's version; its
  outputs are stored as raw bytes with dtype and shape (read back by dtype
  name, nothing unpickled). An unchanged partition with unchanged inputs is
  not re-run.
- ``check``: the figures of a whole lowering, keyed by the flow step's key
  (which covers the float program, the target and the toolchain), the
  check's inputs (the example inputs, then each calibration sample), the
  reference model's version and this module's code. A hit is read without
  torch (direct mode), so its key parts are built here without it.

Nothing here changes a lowered byte: the program is read after
``to_executorch()`` has produced the .pte. A partition the reference model
rejects is reported, with the reason, not raised.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

from ...cache.digests import digest, digest_json
from ...cache.store import Entry
from .numerics_report import check_parts, code_version, reference_model_version, section

# -- running the lowered program ---------------------------------------------------------------------


class Rejected(Exception):
    """The reference model refused a partition (invalid TOSA, an operator it does not implement)."""


class Killed(Rejected):
    """The reference model's child was killed from outside (out of memory, a signal to the group): not the partition's
    doing, so not stored as its answer."""


class Unstored(Exception):
    """A check whose answer is this run's circumstance (a killed child), to report but not store."""

    def __init__(self, entry: Entry):
        super().__init__("unstored")
        self.entry = entry


# Signals that end a child from outside; any other (a segfault) is the reference model's answer to that input.
_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


_NHWC = (0, 2, 3, 1)
_NNHWC = (0, 1, 3, 4, 2)


def _to_numpy(tensor: Any) -> Any:
    """A tensor as the reference model takes it: channels-last tensors in their memory order (as ``runner_utils``)."""
    import torch

    order = tensor.dim_order()
    if order == _NHWC or order == _NNHWC:
        tensor = tensor.permute(order)
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.contiguous().numpy()


def _from_numpy(array: Any, fake: Any) -> Any:
    """A reference-model output as the partition's output node describes it (shape, dim order)."""
    import torch

    tensor = torch.from_numpy(array.copy())
    shape = list(fake.shape)
    order = fake.dim_order()
    if order in (_NHWC, _NNHWC):
        tensor = tensor.reshape([shape[i] for i in order])
        inverse = [order.index(i) for i in range(len(order))]
        return tensor.permute(inverse).contiguous()
    return tensor.reshape(shape)


def _output_fakes(lowered: Any) -> list[Any]:
    output = lowered.original_module.graph.output_node()
    fakes = []
    for node in output.args[0]:
        value = node.meta.get("val")
        if isinstance(value, (list, tuple)):
            value = value[0]
        fakes.append(value)
    return fakes


class Partitions:
    """Each delegate's TOSA, found by its delegate bytes, and its runs on the reference model as ``reference`` steps."""

    def __init__(self, files: dict[str, bytes], session: Any):
        self.session = session
        self.tosa: list[bytes] = [files[n] for n in sorted(files, key=_partition_number) if n.endswith(".tosa")]
        self.by_delegate: dict[bytes, int] = {}
        for i, data in enumerate(self.tosa):
            self.by_delegate[data] = i
            stream = files.get(f"partition_{i}.vela.bin")
            if stream is not None:
                self.by_delegate[stream] = i
        self.status: list[dict[str, Any]] = [{"partition": i, "status": "not run"} for i in range(len(self.tosa))]

    def index(self, lowered: Any) -> int:
        found = self.by_delegate.get(bytes(lowered.processed_bytes))
        if found is None and not self.tosa:  # another family's delegate (XNNPACK): nothing here can run it
            raise Rejected(f"the check runs TOSA partitions on the TOSA reference model, and this {lowered.backend_id} "
                           "delegate holds no TOSA")
        if found is None:
            raise Rejected(f"delegate {lowered.backend_id} holds bytes no partition file has")
        return found

    def run(self, lowered: Any, inputs: Sequence[Any]) -> list[Any]:
        """One delegate call: the partition's TOSA on the reference model, from the cache when it ran on these inputs."""
        from ...cache.hashing import dtype_name, tensor_bytes, tensor_digest, tensor_from_bytes

        i = self.index(lowered)
        tosa = self.tosa[i]
        fakes = _output_fakes(lowered)
        parts = {
            "tosa": digest(tosa),
            "inputs": digest_json([tensor_digest(t) + ":" + str(list(t.dim_order())) for t in inputs]),
            "reference_model": reference_model_version(),
            "numerics": code_version(),
        }

        def compute() -> Entry:
            outputs = reference_run(tosa, [_to_numpy(t) for t in inputs])
            if isinstance(outputs, str):
                return Entry(meta={"status": "rejected", "reason": outputs})
            tensors = [_from_numpy(a, fake) for a, fake in zip(outputs, fakes)]
            return Entry(
                meta={"status": "valid", "outputs": [{"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for t in tensors]},
                blobs={f"output_{k}": tensor_bytes(t) for k, t in enumerate(tensors)},
            )

        try:
            entry = self.session.run("reference", f"partition {i}", parts, compute)
        except Killed as e:
            self.status[i] = {"partition": i, "status": "rejected", "reason": str(e)}
            raise
        if entry.meta.get("status") != "valid":
            self.status[i] = {"partition": i, "status": "rejected", "reason": str(entry.meta.get("reason", "rejected"))}
            raise Rejected(f"partition {i}: {self.status[i]['reason']}")
        self.status[i] = {"partition": i, "status": "valid"}
        described = entry.meta.get("outputs")
        if not isinstance(described, list) or len(described) != len(fakes):
            raise Rejected(f"partition {i}: its stored outputs are malformed")
        try:
            return [tensor_from_bytes(entry.blobs[f"output_{k}"], str(d["dtype"]), [int(n) for n in d["shape"]]) for k, d in enumerate(described)]
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise Rejected(f"partition {i}: its stored outputs are malformed ({e})") from None


def reference_run(tosa: bytes, arrays: list[Any]) -> list[Any] | str:
    """The reference model's outputs for ``tosa`` on ``arrays``, or why it refused them.

    It runs in a forked child: it is native code, and a flatbuffer it cannot
    read can crash it (a truncated one segfaults), which must not take the
    lowering with it. The outputs come back through a pipe as a JSON header
    (dtype, shape) and raw bytes, nothing pickled. Without ``os.fork`` it runs
    here.
    """
    import tosa_reference_model  # noqa: F401  (imported here: a child importing it could wait on a lock another thread held)

    if not hasattr(os, "fork"):
        return _run_here(tosa, arrays)
    sys.stdout.flush()  # nothing buffered for the child to write a second time
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile() as sink:  # the child's fds 1 and 2: what the native code prints, read back here
        pid = os.fork()
        if pid == 0:  # the child: run, answer, exit without running the parent's cleanup
            code = 0
            try:
                faulthandler.disable()  # a crash is the answer here, not a traceback on the parent's terminal
                os.close(read_end)
                os.dup2(sink.fileno(), 1)
                os.dup2(sink.fileno(), 2)
                answer = _verdict(*_call(tosa, arrays), lambda: _lines(sink))
                with os.fdopen(write_end, "wb") as pipe:
                    if isinstance(answer, str):
                        pipe.write(json.dumps({"rejected": answer}).encode() + b"\n")
                    else:
                        header = [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in answer]
                        pipe.write(json.dumps({"outputs": header}).encode() + b"\n")
                        for a in answer:
                            pipe.write(a.tobytes())
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
        said = _lines(sink)
    return _answer(data, status, said)


def _lines(sink: Any) -> list[str]:
    sink.flush()
    sink.seek(0)
    return [line.strip() for line in sink.read(1 << 16).decode(errors="replace").splitlines() if line.strip()]


def _answer(data: bytes, status: int, said: list[str]) -> list[Any] | str:
    """The child's answer read as data: a reason, or arrays of plain numeric dtypes of the stated shapes."""
    import numpy as np

    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in _OUTSIDE:
        raise Killed(f"the reference model was killed (signal {os.WTERMSIG(status)})")
    if os.WIFSIGNALED(status):
        errors = [line for line in said if "error" in line.lower()]
        last = f": {errors[-1]}" if errors else ""
        return f"the reference model crashed (signal {os.WTERMSIG(status)}){last}"[:300]
    head, _, body = data.partition(b"\n")
    try:
        header = json.loads(head)
        if "rejected" in header:
            return str(header["rejected"])
        arrays, offset = [], 0
        for d in header["outputs"]:
            dtype = np.dtype(str(d["dtype"]))
            if dtype.kind not in "biuf" or dtype.fields is not None:
                raise ValueError(f"dtype {dtype}")
            shape = [int(n) for n in d["shape"]]
            size = dtype.itemsize * math.prod(shape)
            arrays.append(np.frombuffer(body[offset : offset + size], dtype=dtype).reshape(shape).copy())
            offset += size
        if offset != len(body):
            raise ValueError("trailing bytes")
        return arrays
    except (ValueError, KeyError, TypeError) as e:
        return f"the reference model's run gave no usable answer (exit status {status}, {e})"


def _call(tosa: bytes, arrays: list[Any]) -> tuple[Any, Any]:
    """``tosa_reference_model.run``: (outputs, status), or (None, the exception it raised on bad input)."""
    import tosa_reference_model

    try:
        return tosa_reference_model.run(tosa, arrays, verbosity="NONE", initialize_variable_tensor_from_numpy=True)
    except (ValueError, RuntimeError) as e:
        return None, e


def _verdict(outputs: Any, status: Any, said: Callable[[], list[str]]) -> list[Any] | str:
    """The outputs of a valid run, else why not, with the last line the native code printed about it."""
    import tosa_reference_model

    if isinstance(status, Exception) or status != tosa_reference_model.GraphStatus.TOSA_VALID:
        why = str(status) if isinstance(status, Exception) else f"status {str(status).rpartition('.')[2]}"
        lines = [line for line in said() if "error" in line.lower()] or said()
        return " ".join(f"{why}{': ' + lines[-1] if lines else ''}".split())[:300]
    return list(outputs)


def _run_here(tosa: bytes, arrays: list[Any]) -> list[Any] | str:
    with _native_output_kept() as said:
        outputs, status = _call(tosa, arrays)
    return _verdict(outputs, status, said)


@contextlib.contextmanager
def _native_output_kept() -> Iterator[Callable[[], list[str]]]:
    """The reference model's native code prints to file descriptors 1 and 2 (a TOSA version note on every run): kept
    out of lowercache's output; the lines are handed back, a rejected partition's reason is among them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        lines: list[str] = []
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield lambda: lines
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            lines[:] = _lines(sink)


def _partition_number(name: str) -> tuple[int, str]:
    head = name.split(".", 1)[0].rpartition("_")[2]
    return (int(head) if head.isdigit() else -1, name)


def _qdq_ops() -> tuple[Any, ...]:
    """quantize/dequantize overloads that mishandle channels-last input: run in channels-first (as ``runner_utils``)."""
    import torch

    found = []
    ns = torch.ops.quantized_decomposed
    for name in ("quantize_per_tensor", "dequantize_per_tensor", "quantize_per_channel", "dequantize_per_channel"):
        packet = getattr(ns, name, None)
        for overload in ("tensor", "tensor2", "default", "out"):
            if packet is not None and hasattr(packet, overload):
                found.append(getattr(packet, overload))
    return tuple(found)


def run_lowered(program: Any, partitions: Partitions, sample: Sequence[Any]) -> list[Any]:
    """The flat outputs of ``program`` (the exported program of ``to_executorch()``) on ``sample``, delegates on the reference model."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils import _pytree as pytree

    qdq = _qdq_ops()

    class Dispatch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch._higher_order_ops.executorch_call_delegate:
                return partitions.run(args[0], args[1:])
            if func in qdq and args and args[0].dim_order() in (_NHWC, _NNHWC):
                result = func(args[0].to(memory_format=torch.contiguous_format), *args[1:], **kwargs)
                return result.to(memory_format=torch.channels_last)
            return func(*args, **kwargs)

    with torch.no_grad(), Dispatch():
        signature = program.graph_signature
        if signature.buffers_to_mutate:  # as the tester: mutable buffers are the program's I/O
            outputs = program.graph_module(*program.buffers(), *sample)
        else:
            outputs = program.module()(*sample)
    flat, _ = pytree.tree_flatten(outputs)
    kinds = [spec.kind.name for spec in signature.output_specs]
    if len(kinds) == len(flat):
        flat = [t for t, kind in zip(flat, kinds) if kind == "USER_OUTPUT"]
    return flat


def float_outputs(program: Any, samples: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """The eager float model's flat outputs on every sample (the exported float program, run as a module)."""
    import torch
    from torch.utils import _pytree as pytree

    module = program.module()
    found = []
    with torch.no_grad():
        for sample in samples:
            flat, _ = pytree.tree_flatten(module(*sample))
            found.append([t for t in flat if isinstance(t, torch.Tensor)])
    return found


# -- the figures -------------------------------------------------------------------------------------


def figures(reference: Sequence[Any], lowered: Sequence[Any]) -> dict[str, Any]:
    """Error figures of one output over every sample: max and mean absolute error, SNR (dB), cosine similarity, and
    for a classifier's logits (rank 2, two or more classes) the share of rows whose top-1 class agrees.

    ``snr_db`` is None when the outputs are equal (no error: infinite SNR); ``cosine`` is 1.0 for two zero outputs.
    """
    import torch

    ref = torch.cat([r.detach().to(torch.float64).reshape(-1) for r in reference])
    got = torch.cat([g.detach().to(torch.float64).reshape(-1) for g in lowered])
    err = got - ref
    signal, noise = float((ref * ref).sum()), float((err * err).sum())
    norms = float(ref.norm()) * float(got.norm())
    found: dict[str, Any] = {
        "max_abs": float(err.abs().max()) if err.numel() else 0.0,
        "mean_abs": float(err.abs().mean()) if err.numel() else 0.0,
        "snr_db": None if noise == 0.0 else (10.0 * math.log10(signal / noise) if signal > 0.0 else -math.inf),
        "cosine": float((ref * got).sum()) / norms if norms > 0.0 else (1.0 if noise == 0.0 else 0.0),
        "shape": list(reference[0].shape),
        "dtype": str(lowered[0].dtype).removeprefix("torch."),
    }
    if reference[0].dim() == 2 and reference[0].shape[1] >= 2:
        agree = sum(int((r.argmax(dim=1) == g.argmax(dim=1)).sum()) for r, g in zip(reference, lowered))
        rows = sum(int(r.shape[0]) for r in reference)
        found["top1"] = agree / rows if rows else None
        found["top1_rows"] = rows
    if found["snr_db"] == -math.inf:
        found["snr_db"] = -999.0  # a zero reference with an error: no signal (JSON has no infinity)
    return {k: (float(f"{v:.7g}") if isinstance(v, float) else v) for k, v in found.items()}  # 7 significant digits


def compute(program: Any, files: dict[str, bytes], float_ref: list[list[Any]], samples: Sequence[Sequence[Any]], session: Any) -> Entry:
    """The check's entry: per output its figures over every sample, per partition whether the reference model ran it."""
    partitions = Partitions(files, session)
    lowered: list[list[Any]] = []
    meta: dict[str, Any] = {"samples": len(samples), "reference_model": reference_model_version(), "partitions": partitions.status}
    try:
        for sample in samples:
            lowered.append(run_lowered(program, partitions, [t.clone() if hasattr(t, "clone") else t for t in sample]))
    except Rejected as e:
        meta["error"] = f"not compared: {e}"
        meta["outputs"] = []
        if isinstance(e, Killed):
            raise Unstored(Entry(meta=meta)) from None
        return Entry(meta=meta)
    outputs = []
    for k in range(len(float_ref[0]) if float_ref else 0):
        if len(lowered[0]) != len(float_ref[0]) or lowered[0][k].shape != float_ref[0][k].shape:
            meta["error"] = f"output {k}: the lowered program's outputs do not match the float model's in number or shape"
            outputs = []
            break
        outputs.append({"output": k, **figures([s[k] for s in float_ref], [s[k] for s in lowered])})
    meta["outputs"] = outputs
    return Entry(meta=meta)


def inputs_key(samples: Sequence[Sequence[Any]]) -> str | None:
    """The check's inputs as a key part; None when they cannot be hashed (the check then runs uncached)."""
    from ...cache.hashing import Unhashable, inputs_digest

    try:
        return inputs_digest(samples)
    except Unhashable:
        return None


def check(
    session: Any,
    flow_key: str | None,
    samples: Sequence[Sequence[Any]],
    float_program: Any,
    lowered_program: Callable[[], tuple[Any, dict[str, bytes]]],
) -> dict[str, Any]:
    """Run (or serve) the check step; returns the manifest's ``numerics`` section.

    ``lowered_program()`` gives the exported program of ``to_executorch()`` and
    the lowering's files; it is only called on a miss. ``flow_key`` None: the
    flow ran uncached, so the check runs uncached too.
    """
    inputs = inputs_key(samples)
    parts = check_parts(flow_key, inputs) if flow_key is not None and inputs is not None else None

    def run() -> Entry:
        reference = float_outputs(float_program, samples)
        program, files = lowered_program()
        return compute(program, files, reference, samples, session)

    started = time.perf_counter()
    try:
        entry = session.run("check", "numerics", parts, run)
    except Unstored as e:  # this run's answer, not the check's: said, and run again next time
        entry = e.entry
        session.note("check", "numerics", "bypass", time.perf_counter() - started)
    return section(entry.meta, parts)
