"""Child process for test_other_release, run by the Python of a venv that holds another
ExecuTorch release (beside this torch): lower small models with lowercache, cold and
warm, and with stock ExecuTorch (``tests/helpers/oracle.py``), and write what it found as JSON
(to a file: Vela prints its summary on stdout).

``python -m tests.other_release_child OUT_JSON CACHE_DIR MODEL:TARGET...``
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path


def _outcome(artifacts, kind: str) -> list[str]:
    return [r["outcome"] for r in artifacts.records if r["kind"] == kind]


def _foreign_modules() -> list[str]:
    """executorch modules loaded from outside this release's own directory: with
    --system-site-packages, the namespace package ``executorch`` spans both releases,
    so a module this release lacks would come from the other one."""
    home = Path(importlib.metadata.distribution("executorch").locate_file("executorch")).resolve()
    foreign = []
    for name, module in sorted(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if (name == "executorch" or name.startswith("executorch.")) and where and home not in Path(where).resolve().parents:
            foreign.append(f"{name}: {where}")
    return foreign


def main(cache_dir: str, cases: list[str]) -> dict:
    import lowercache
    from lowercache.bench import models
    from tests.helpers.oracle import stock_pte

    found: dict = {
        "versions": {d: importlib.metadata.version(d) for d in ("torch", "executorch", "tosa-tools", "ethos-u-vela")},
        "lowercache": lowercache.__file__,
        "cases": {},
    }
    for case in cases:
        model, target = case.split(":")
        module, example = models.MODELS[model]()
        stock = stock_pte(module, example, target)
        module, example = models.MODELS[model]()
        cold = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
        module, example = models.MODELS[model]()  # a fresh, equal model object
        warm = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
        found["cases"][case] = {
            "stock": hashlib.sha256(stock).hexdigest(),
            "cold": hashlib.sha256(cold.pte).hexdigest(),
            "warm": hashlib.sha256(warm.pte).hexdigest(),
            "cold_flow": _outcome(cold, "flow"),
            "warm_flow": _outcome(warm, "flow"),
            "cold_steps": sorted({r["kind"] for r in cold.records if r["outcome"] == "miss"}),
            "files_equal": cold.files == warm.files,
            "speedups": cold.manifest["speedups"],
        }
    found["foreign_modules"] = _foreign_modules()
    return found


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(main(sys.argv[2], sys.argv[3:]), indent=1))
