"""Worker processes on this machine: each pending pair is a ``lowercache lower`` process, at most ``-j`` at once.

A worker is the ``lower`` command line a user would type, run the way a
new ``lowercache`` process runs it (direct mode, then the warm server when
one runs or may start, else in the process), so its bytes are exactly
``lower``'s. It gets this process's ``sys.path``: direct mode records the
module search path, and a record made by a build is then one that the
same ``lowercache`` invocation, by hand or in a later build, can use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any, Optional

from .buildfile import Pair

# Runs the CLI with the module search path it is given (argv[1], JSON), then the command line.
_BOOT = "import sys, json; sys.path[:] = json.loads(sys.argv.pop(1)); from lowercache.cli import main; main(sys.argv[1:])"
STOP_GRACE_S = 10.0  # after Ctrl-C, how long a worker may take to remove its staging directory before it is killed


def worker_command(args: list[str], syspath: list[str]) -> list[str]:
    """The worker's argv: this interpreter running ``lowercache`` ``args`` with ``syspath``."""
    return [sys.executable, "-c", _BOOT, json.dumps(syspath), *args]


def error_line(code: int, stderr: str) -> str:
    """The one-line cause of a failed ``lower``: its ``lowercache: error:`` line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("lowercache: error:")]
    line = (errors or lines[-1:] or [f"exited with status {code}"])[-1]
    return line.removeprefix("lowercache: error: ")[:500]


def run_blocking(args: list[str], cwd: str, syspath: list[str]) -> dict[str, Any]:
    """Run one worker to the end (a Ray task does this); a small JSON-able result.

    Interrupted (a cancelled Ray task gets KeyboardInterrupt), it stops the worker as Ctrl-C would.
    """
    started = time.perf_counter()
    proc = subprocess.Popen(worker_command(args, syspath), cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        _, stderr = proc.communicate()
    except BaseException:
        _stop([proc])
        raise
    return _result(proc.returncode, started, stderr)


def _result(code: int, started: float, stderr: str) -> dict[str, Any]:
    """A finished worker as the scheduler reads it: exit code, seconds, host, and the one-line cause of a failure."""
    result: dict[str, Any] = {"code": code, "seconds": time.perf_counter() - started, "host": socket.gethostname()}
    if code != 0:
        result["error"] = error_line(code, stderr)
    return result


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT, then SIGKILL for those still running after a grace period."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class _Running:
    pair: Pair
    proc: subprocess.Popen
    stderr: IO[bytes]
    started: float


class LocalExecutor:
    """Runs pairs as worker processes, at most ``jobs`` at once; polled by the scheduler."""

    name = "local"

    def __init__(self, jobs: int, cwd: str, syspath: list[str], options: list[str]) -> None:
        self.jobs, self.cwd, self.syspath, self.options = jobs, cwd, syspath, options
        self.running: list[_Running] = []

    def free(self) -> bool:
        return len(self.running) < self.jobs

    def busy(self) -> bool:
        return bool(self.running)

    def submit(self, pair: Pair) -> None:
        stderr = tempfile.TemporaryFile()
        proc = subprocess.Popen(worker_command(pair.lower_args(self.options), self.syspath), cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=stderr)
        self.running.append(_Running(pair, proc, stderr, time.perf_counter()))

    def finished(self, wait: float) -> list[tuple[Pair, dict[str, Any]]]:
        """The pairs whose worker exited, waiting up to ``wait`` seconds for the first."""
        deadline = time.monotonic() + wait
        while True:
            done = [r for r in self.running if r.proc.poll() is not None]
            if done or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        results = []
        for r in done:
            self.running.remove(r)
            results.append((r.pair, self._result(r)))
        return results

    def _result(self, r: _Running) -> dict[str, Any]:
        stderr = ""
        if r.proc.returncode != 0:
            r.stderr.seek(0)
            stderr = r.stderr.read().decode(errors="replace")
        r.stderr.close()
        return _result(r.proc.returncode, r.started, stderr)

    def cancel(self) -> list[Pair]:
        """Stop every running worker as Ctrl-C would; the pairs stopped."""
        _stop([r.proc for r in self.running])
        for r in self.running:
            r.stderr.close()
        stopped = [r.pair for r in self.running]
        self.running = []
        return stopped

    def close(self) -> None:
        self.cancel()


def default_jobs(memory_per_job: int, cpus: Optional[int] = None) -> int:
    """The core count, bounded by the memory available now divided by what one lowering may use."""
    cores = cpus or len(os.sched_getaffinity(0))
    available = _available_memory()
    if available is None:
        return max(cores, 1)
    return max(1, min(cores, available // max(memory_per_job, 1)))


def _available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
