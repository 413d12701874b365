"""What the backstop below Python costs a cold lowering (docs/direct-mode.md, "The backstop below Python").

    python benchmarks/backstop_cost.py [--model examples/mobilenet_v2.py:model] [--target ethos-u55-128] [--repeat 3]
    python benchmarks/backstop_cost.py --wall --repeat 5      # also whole cold --no-server lowerings, A/B (quiet machine)

1. The price of one traced call, in this process: blocks of ``stat`` calls on
   a missing path, untraced, then traced (once the backstop has started here
   every call is), CPU seconds of this process and of the tracer per call.
2. The calls a cold lowering has traced: ``lowercache lower`` into an empty
   cache, through a warm server and with ``--no-server``, each writing
   ``manifest.json``'s ``backstop`` counts; calls times the price is the
   backstop's CPU, against the lowering's own (the client's CPU with
   ``--no-server``; the server's child is not the client's, so only its calls
   are given).
3. With ``--wall``: cold ``--no-server`` lowerings alternating with the
   backstop (the default) and without it (``backstop.start`` made to fail:
   the record is then untrusted, all else the same), the median wall seconds
   of each. Take these on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import posix
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_OFF = ("import sys; import lowercache.record.backstop as b; b.start = lambda: 'off for the measurement'; "
        "from lowercache.cli import main; sys.argv[0] = 'lowercache'; main()")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _stats(count: int) -> float:
    started = _cpu()
    for i in range(count):
        try:
            posix.stat(f"/nonexistent-lowercache-{i % 7}")
        except OSError:
            pass
    return _cpu() - started


def _process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def price_per_call(count: int = 20000, blocks: int = 5) -> tuple[float, float, float, float]:
    """(untraced, traced) CPU microseconds per call in this process, the tracer's per traced call, and the CPU
    seconds of starting the backstop (this process's and the tracer's)."""
    from lowercache.record import backstop

    plain = [_stats(count) for _ in range(blocks)]  # before the filter: once it is in, every call of the process stops
    started = _cpu()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    below = backstop.start()
    if isinstance(below, str):
        raise SystemExit(f"no backstop here: {below}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = _cpu() - started + (after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime) + _process_cpu(below.pid)
    below.on()
    traced = [_stats(count) for _ in range(blocks)]
    below.off()
    report = below.report() or {}
    tracer = float(report.get("cpu", 0.0)) / max(1, report.get("stops", [1])[0])  # its start-up included: an upper bound
    return statistics.median(plain) / count * 1e6, statistics.median(traced) / count * 1e6, tracer * 1e6, start


def cold(model: str, target: str, flags: list[str], env: dict[str, str], off: bool = False) -> tuple[float, float, dict]:
    """One cold lowering into an empty cache: wall seconds, the client's CPU seconds, manifest.json's backstop counts."""
    with tempfile.TemporaryDirectory(prefix="lowercache-backstop-cost-") as tmp:
        run_env = {**env, "LOWERCACHE_DIR": os.path.join(tmp, "cache")}
        head = [sys.executable, "-c", _OFF] if off else [sys.executable, "-m", "lowercache.cli"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run([*head, "lower", model, "-t", target, "-o", os.path.join(tmp, "out"), *flags], env=run_env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(os.path.join(tmp, "out", "manifest.json")) as f:
            counts = json.load(f).get("backstop", {})
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="examples/mobilenet_v2.py:model")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--wall", action="store_true")
    parser.add_argument("--price", action="store_true", help=argparse.SUPPRESS)  # step 1 alone, in a process of its own
    args = parser.parse_args()
    if args.price:
        print(json.dumps(price_per_call()))
        return
    # In a process of its own: once traced, this process and every process it starts would stay traced.
    plain, traced, tracer, start = json.loads(subprocess.run([sys.executable, __file__, "--price"], check=True,
                                                             capture_output=True, text=True).stdout)
    price = traced - plain + tracer
    print(f"one call: {plain:.1f} us untraced, {traced:.1f} us traced, the tracer {tracer:.1f} us: {price:.1f} us of CPU added")
    print(f"starting the backstop: {start:.3f} s of CPU (the tracer's interpreter, its attach, the filter)")
    env = dict(os.environ)
    run = tempfile.mkdtemp(prefix="lcbs")
    env["XDG_RUNTIME_DIR"] = run  # a server of this measurement's own
    try:
        cold(args.model, args.target, [], env)  # starts the server; its own imports are not the lowering's
        for label, flags in (("through the warm server", []), ("--no-server", ["--no-server"])):
            for _ in range(args.repeat):
                wall, cpu, counts = cold(args.model, args.target, flags, env)
                calls = counts.get("calls", 0)
                share = f", {calls * price / 1e6 / cpu:.1%} of the client's {cpu:.1f} s CPU" if flags else ""
                print(f"cold, {label}: {calls} calls traced ({counts.get('recorded', 0)} while recording, "
                      f"{counts.get('added', 0)} paths added): {calls * price / 1e6:.3f} s of CPU{share}; {wall:.1f} s wall")
        if args.wall:
            seconds: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeat):
                for on in (True, False):
                    seconds[on].append(cold(args.model, args.target, ["--no-server"], env, off=not on)[0])
            on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
            print(f"cold --no-server, median of {args.repeat}: {on:.2f} s with the backstop, {off:.2f} s without ({on / off - 1:+.1%})")
    finally:
        subprocess.run([sys.executable, "-m", "lowercache.cli", "server", "stop"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
