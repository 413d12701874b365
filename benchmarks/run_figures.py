"""``lowercache run`` in front of ExecuTorch's aot_arm_compiler, as a shell times whole commands.

    python benchmarks/run_figures.py [--models tiny_cnn,transformer_block] [--target ethos-u55-128] [--repeat 1]

For each model, in a fresh project directory whose ``model.py`` defines ``ModelUnderTest`` and
``ModelInputs`` from the benchmark's seeded builders (an edit rewrites its last line, as a user edits a
file), with an empty cache: the plain command, then under ``lowercache run``: cold, the first re-run (it
confirms the record: the script runs, its Arm steps served), a warm re-run (replayed), and one block's
structure edited. Every .pte is compared byte for byte with the plain command's for the same model text.
Prints a Markdown table and the load (``uptime``) before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowercache.bench.process import timed

MODELS = Path(__file__).resolve().parent.parent / "lowercache" / "bench" / "models.py"
PHASES = ("cold", "warm, first re-run", "warm (replayed)", "one block edited")


def model_source(model: str, edit: str | None) -> str:
    """``model.py``: the benchmark's model builders, then the two names aot_arm_compiler reads; the edit on its own line."""
    return MODELS.read_text() + f"\n\nEDIT = {edit!r}\nModelUnderTest, ModelInputs = MODELS[{model!r}](edit=EDIT)\n"


def aot(target: str) -> list[str]:
    return ["-m", "executorch.backends.arm.scripts.aot_arm_compiler", "--model_name=model.py", "--delegate", "--quantize",
            f"--target={target}", "--output=out"]


def one(model: str, target: str, root: Path) -> dict[str, tuple[float, float, bool]]:
    """Per phase: plain seconds, lowercache run seconds, bytes equal."""
    project = root / "project"
    project.mkdir(parents=True)
    pte = project / "out" / f"model_arm_delegate_{target}.pte"
    user = {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}
    plain_env = {**user, "PYTHONPATH": user.get("PYTHONPATH", "")}
    lc_env = {**user, "PYTHONPATH": os.pathsep.join(p for p in (str(MODELS.parents[2]), user.get("PYTHONPATH", "")) if p),
              "LOWERCACHE_DIR": str(root / "cache"), "LOWERCACHE_CONFIG": str(root / "none.toml")}
    lc = [sys.executable, "-m", "lowercache.cli", "run", "--", sys.executable, *aot(target)]
    results: dict[str, tuple[float, float, bool]] = {}
    plain: dict[str | None, tuple[float, bytes]] = {}
    for phase in PHASES:
        edit = "structure" if phase == "one block edited" else None
        text = model_source(model, edit)
        if not (project / "model.py").exists() or (project / "model.py").read_text() != text:
            (project / "model.py").write_text(text)
            time.sleep(0.1)
        if edit not in plain:
            seconds = timed([sys.executable, *aot(target)], plain_env, project, timeout=3600)
            plain[edit] = (seconds, pte.read_bytes())
            pte.unlink()
        seconds = timed(lc, lc_env, project, timeout=3600)
        results[phase] = (plain[edit][0], seconds, pte.read_bytes() == plain[edit][1])
    return results


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,transformer_block")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"load before: {uptime()}")
    lines = ["| model | phase | plain aot_arm_compiler (s) | lowercache run (s) | speed-up | bytes equal |", "|---|---|---:|---:|---:|---|"]
    for model in args.models.split(","):
        reps = []
        for _ in range(args.repeat):
            root = Path(tempfile.mkdtemp(prefix="lc-run-figures-"))
            try:
                reps.append(one(model, args.target, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        for phase in PHASES:
            plain = statistics.median(r[phase][0] for r in reps)
            run = statistics.median(r[phase][1] for r in reps)
            equal = all(r[phase][2] for r in reps)
            lines.append(f"| {model} | {phase} | {plain:.2f} | {run:.2f} | {plain / run:.1f}x | {'yes' if equal else '**NO**'} |")
            print(lines[-1], flush=True)
    print(f"load after: {uptime()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
