"""The Ray executor: each pending pair is a Ray task declaring its CPU and memory, on a cluster or a local Ray.

Only plain data crosses to a task (the ``lower`` command line, the
working directory, the module search path) and only a small JSON-able
dict comes back. The task runs the same worker process as the local
executor, so results land where every build finds them: in the cache,
whose shared tier (Redis or S3, ``--remote``) makes one machine's result a
hit for every other, and in the output directory when the driver shares
the worker's file system. When it does not, the driver writes the pair's
output itself, from the shared tier (:func:`fetch`). Secrets such as
``LOWERCACHE_HMAC_KEY`` are never sent: each worker needs its own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from typing import Any, Iterator, Optional

from ..errors import LowercacheError
from . import local
from .buildfile import Pair

CPUS_PER_TASK = 1


def _lower(args: list[str], cwd: str, syspath: list[str]) -> dict[str, Any]:
    """The task body, on a Ray worker."""
    return local.run_blocking(args, cwd, syspath)


class RayExecutor:
    """Submits pairs as Ray tasks (at most ``jobs`` in flight) and polls them for the scheduler."""

    name = "ray"

    def __init__(self, jobs: int, cwd: str, syspath: list[str], options: list[str], address: Optional[str]) -> None:
        try:
            import ray
        except ImportError:
            raise LowercacheError("--executor ray needs Ray: pip install 'lowercache[ray]'") from None
        self.ray = ray
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            with _native_stderr() as said:
                try:
                    ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, logging_level="ERROR", log_to_driver=False)
                    failed = None
                except (ConnectionError, RuntimeError, ValueError) as e:
                    failed = e
            where = f" at {address}" if address else ""
            if failed is not None and "InvalidAuthToken" in said[0]:
                raise LowercacheError(f"cannot reach the Ray cluster{where}: it refused this machine's authentication token "
                                      "(set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, to the cluster's: `ray get-auth-token` on "
                                      "its head prints it; RAY_AUTH_MODE=token)") from None
            if failed is not None:
                raise LowercacheError(f"cannot reach the Ray cluster{where}: {str(failed).splitlines()[0]}") from None
            sys.stderr.write(said[0])  # a connection that succeeded keeps whatever Ray's native code said
        self.task = ray.remote(_lower)
        self.jobs, self.cwd, self.syspath, self.options = jobs, cwd, syspath, options
        self.running: dict[Any, tuple[Pair, float]] = {}

    def free(self) -> bool:
        return len(self.running) < self.jobs

    def busy(self) -> bool:
        return bool(self.running)

    def submit(self, pair: Pair) -> None:
        ref = self.task.options(num_cpus=CPUS_PER_TASK, memory=pair.memory, max_retries=0).remote(
            pair.lower_args(self.options), self.cwd, self.syspath
        )
        self.running[ref] = (pair, time.perf_counter())

    def finished(self, wait: float) -> list[tuple[Pair, dict[str, Any]]]:
        if not self.running:
            return []
        done, _ = self.ray.wait(list(self.running), num_returns=1, timeout=wait)
        results = []
        for ref in done:
            pair, started = self.running.pop(ref)
            try:
                result = dict(self.ray.get(ref))
            except self.ray.exceptions.RayError as e:
                result = {"code": 1, "error": f"the Ray task failed: {str(e).strip().splitlines()[-1][:300]}"}
            result["seconds"] = time.perf_counter() - started
            results.append((pair, result))
        return results

    def cancel(self) -> list[Pair]:
        refs = list(self.running)
        for ref in refs:
            self.ray.cancel(ref)  # KeyboardInterrupt in the task, which stops its worker process (local.run_blocking)
        if refs:  # let the tasks stop their workers before a shutdown kills the Ray worker processes
            self.ray.wait(refs, num_returns=len(refs), timeout=local.STOP_GRACE_S + 5)
        stopped = [pair for pair, _ in self.running.values()]
        self.running = {}
        return stopped

    def close(self) -> None:
        self.cancel()
        if self.started_ray:
            self.ray.shutdown()


@contextlib.contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """What native code writes to file descriptor 2 meanwhile (Ray's GCS client retries print a line a second), held
    back and handed over as ``said[0]`` once the block ends."""
    said = [""]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            said[0] = held.read().decode("utf-8", "replace")


def fetch(pair: Pair, cwd: str, syspath: list[str], options: list[str]) -> dict[str, Any]:
    """Write a pair's output here after a task on another machine lowered it: ``lower`` again, a hit in the shared tier."""
    return local.run_blocking(pair.lower_args(options), cwd, syspath)
