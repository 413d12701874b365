"""Stock XNNPACK bytes from the benchmark's stock script (``lowercache/bench/stockscript.py``, which imports no lowercache
code), for every (edit, factory, target) a test lowers, in one new process; kept beside the oracle's entries (each
checked against its digest), so xdist's workers and later runs lower them once.

A models text may hold ``EDIT = None``: the driver writes it once per edit with that line set to the edit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from lowercache.bench.stockscript import source

from .oracle import DIRECTORY, threads

Lowering = tuple[Any, str, str]  # (edit, factory, target)

# Runs the stock script's main once per lowering in this one new process: the models file is rewritten per edit.
DRIVER = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import export
    base = open(sys.argv[2]).read()
    for i, (edit, factory, target) in enumerate(json.loads(sys.argv[3])):
        path = f"{sys.argv[1]}/models_{i}.py"
        with open(path, "w") as f:
            f.write(base.replace("EDIT = None", f"EDIT = {edit!r}"))
        export.main(f"{path}:{factory}", target, f"{sys.argv[1]}/stock_{i}.pte")
''')


def _key(models: str, lowerings: Sequence[Lowering]) -> str:
    """Everything the stock bytes depend on: the installed toolchain, the texts that make them and the thread settings."""
    versions = [f"{d}={metadata.version(d)}" for d in ("torch", "executorch", "torchao")]
    made = [versions, source(), models, DRIVER, [list(x) for x in lowerings], threads()]
    return hashlib.sha256(json.dumps(made).encode()).hexdigest()


def stock_bytes(models: str, lowerings: Sequence[Lowering], scratch: Path) -> dict[Lowering, bytes]:
    """Stock .pte bytes by (edit, factory, target): from the disk cache when all are there, else one new process
    in ``scratch`` (an empty directory)."""
    name = f"xnnpack-{_key(models, lowerings)}.json"
    try:
        kept = json.loads((DIRECTORY / name).read_text()) if DIRECTORY is not None else None
        found = {tuple(k): bytes.fromhex(v) for k, v, d in kept if hashlib.sha256(bytes.fromhex(v)).hexdigest() == d}
        if len(found) == len(lowerings):
            return found
    except (OSError, ValueError, TypeError):
        pass
    (scratch / "export.py").write_text(source())
    (scratch / "base.py").write_text(models)
    (scratch / "driver.py").write_text(DRIVER)
    run = subprocess.run([sys.executable, str(scratch / "driver.py"), str(scratch), str(scratch / "base.py"), json.dumps(lowerings)],
                         capture_output=True, text=True, cwd=scratch, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    found = {tuple(key): (scratch / f"stock_{i}.pte").read_bytes() for i, key in enumerate(lowerings)}
    try:
        if DIRECTORY is not None:
            DIRECTORY.mkdir(parents=True, exist_ok=True)
            partial = DIRECTORY / f".tmp-{os.getpid()}-{name}"
            partial.write_text(json.dumps([[list(k), v.hex(), hashlib.sha256(v).hexdigest()] for k, v in found.items()]))
            os.replace(partial, DIRECTORY / name)
    except OSError:
        pass  # a read-only or full disk only costs the next run a stock lowering
    return found


def lower_here(module: Any, example: Any, target: str) -> bytes:
    """The stock script's flow (its ``lower``) run in this process: for tests that run it under an audit or a speed-up."""
    script: dict[str, Any] = {}
    exec(compile(source(), "export.py", "exec"), script)
    return script["lower"](module, example, target)
