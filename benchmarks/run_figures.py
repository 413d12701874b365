"""``lowercache run`` in front of ExecuTorch's aot_arm_compiler, as a shell times whole commands.

    python benchmarks/run_figures.py [--models tiny_cnn,transformer_block] [--target ethos-u55-128] [--repeat 1]
        [--edit structure|weights] [--non-strict] [--no-run-ahead]

For each model, in fresh project directories whose ``model.py`` defines ``ModelUnderTest`` and
``ModelInputs`` from the benchmark's seeded builders (an edit rewrites its last line, as a user edits a
file): the plain command, then under ``lowercache run`` twice over, each with an empty cache of its own:
as a new process (``--no-server``) and in a child of the warm server (started once beforehand, in a
socket directory of the benchmark's own; its start is timed apart). Each goes through the phases cold,
the first re-run (it confirms the record: the script runs, its Arm steps served), a warm re-run
(replayed), one block edited (its structure, or with ``--edit weights`` its weights) and that edit undone
(the base model written back: replayed from the record the edit replaced). ``--non-strict``
passes aot_arm_compiler's ``--non_strict_export``: its re-export after ``convert_pt2e`` is then ``lower``'s own
``reexport`` step under ``run``. ``--no-run-ahead`` sets ``LOWERCACHE_RUN_AHEAD=0`` for every lowercache command (``run``'s
runner off, docs/run.md#run-ahead), for an A/B of it. Every .pte is compared byte for byte with the plain
command's for the same model text. Beside them, ``lowercache lower model.py:make`` through the same
server: the model lowered once into an empty cache, then the same edit timed (the aim: an edit under
``run`` as fast as ``lower`` with that edit). Prints Markdown tables and the load (``uptime``) before and after.
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
from lowercache.targets.arm_tosa import PROFILES as TOSA_TARGETS

MODELS = Path(__file__).resolve().parent.parent / "lowercache" / "bench" / "models.py"
PHASES = ("cold", "warm, first re-run", "warm (replayed)", "one block edited", "the edit undone")
MODES = {"new process": ["--no-server"], "warm server": []}
LOWER_TARGETS = {aot_name: name for name, aot_name in TOSA_TARGETS.items()}  # aot_arm_compiler's names -> lower's
RUN_AHEAD: dict[str, str] = {}  # {"LOWERCACHE_RUN_AHEAD": "0"} with --no-run-ahead


def model_source(model: str, edit: str | None) -> str:
    """``model.py``: the benchmark's model builders, then the two names aot_arm_compiler reads; the edit on its own line."""
    return (MODELS.read_text() + f"\n\nEDIT = {edit!r}\nModelUnderTest, ModelInputs = MODELS[{model!r}](edit=EDIT)\n"
            "\n\ndef make():\n    return ModelUnderTest, ModelInputs\n")


def aot(target: str, flags: list[str]) -> list[str]:
    return ["-m", "executorch.backends.arm.scripts.aot_arm_compiler", "--model_name=model.py", "--delegate", "--quantize",
            f"--target={target}", "--output=out", *flags]


def user_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}


def lc_env(root: Path, cache: Path) -> dict[str, str]:
    """lowercache from this checkout, a cache, no config file, the benchmark's own server socket directory.

    ``root``: the benchmark's directory, whose ``run`` exists (the client falls back
    to the user's default socket directory when ``XDG_RUNTIME_DIR`` does not)."""
    user = user_env()
    return {**user, "PYTHONPATH": os.pathsep.join(p for p in (str(MODELS.parents[2]), user.get("PYTHONPATH", "")) if p),
            "LOWERCACHE_DIR": str(cache), "LOWERCACHE_CONFIG": str(root / "none.toml"), "XDG_RUNTIME_DIR": str(root / "run"),
            **RUN_AHEAD}


def write_model(project: Path, model: str, edit: str | None) -> None:
    text = model_source(model, edit)
    if not (project / "model.py").exists() or (project / "model.py").read_text() != text:
        (project / "model.py").write_text(text)
        time.sleep(0.1)


def one(
    model: str, target: str, root: Path, edited: str, flags: list[str], bench_root: Path
) -> dict[tuple[str, str], tuple[float, float, bool]]:
    """Per mode and phase: plain seconds, lowercache run seconds, bytes equal. ``root``: this model's
    directory; ``bench_root``: the benchmark's, whose server the warm-server rows use."""
    pte = Path("out") / f"model_arm_delegate_{target}.pte"
    plain: dict[str | None, tuple[float, bytes]] = {}
    for edit in (None, edited):
        project = root / "plain"
        project.mkdir(exist_ok=True)
        write_model(project, model, edit)
        seconds = timed([sys.executable, *aot(target, flags)], user_env(), project, timeout=3600)
        plain[edit] = (seconds, (project / pte).read_bytes())
        (project / pte).unlink()
    results: dict[tuple[str, str], tuple[float, float, bool]] = {}
    for mode, mode_flags in MODES.items():
        project = root / mode.replace(" ", "-")
        project.mkdir()
        lc = [sys.executable, "-m", "lowercache.cli", "run", *mode_flags, "--", sys.executable, *aot(target, flags)]
        for phase in PHASES:
            edit = edited if phase == "one block edited" else None
            write_model(project, model, edit)
            env = lc_env(bench_root, root / f"cache-{project.name}")
            seconds = timed(lc, env, project, timeout=3600)
            results[(mode, phase)] = (plain[edit][0], seconds, (project / pte).read_bytes() == plain[edit][1])
            explained = subprocess.run([*lc[:4], "--explain", *lc[4:]], env=env, cwd=project, capture_output=True, text=True).stdout
            ran = next((line for line in explained.splitlines() if line.startswith("latest run:")), "")
            if mode == "warm server" and "as a new process" in ran and phase != "warm (replayed)":
                print(f"note: {model} {phase}: {ran}", flush=True)
    project = root / "lower"
    project.mkdir()
    lower = [sys.executable, "-m", "lowercache.cli", "lower", "model.py:make", "-t", LOWER_TARGETS.get(target, target), "-o", "out"]
    env = lc_env(bench_root, root / "cache-lower")
    write_model(project, model, None)
    timed(lower, env, project, timeout=3600)
    write_model(project, model, edited)
    results[("lower", "one block edited")] = (plain[edited][0], timed(lower, env, project, timeout=3600), True)
    return results


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,transformer_block")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--edit", choices=("structure", "weights"), default="structure")
    parser.add_argument("--non-strict", action="store_true", help="aot_arm_compiler --non_strict_export")
    parser.add_argument("--no-run-ahead", action="store_true", help="LOWERCACHE_RUN_AHEAD=0 (run's runner off)")
    args = parser.parse_args()
    flags = ["--non_strict_export"] if args.non_strict else []
    if args.no_run_ahead:
        RUN_AHEAD["LOWERCACHE_RUN_AHEAD"] = "0"
    print(f"load before: {uptime()}")
    root = Path(tempfile.mkdtemp(prefix="lcrf", dir="/tmp"))  # short: a socket path holds at most 107 bytes
    (root / "run").mkdir(mode=0o700)
    server = [sys.executable, "-m", "lowercache.cli", "server"]
    try:
        print(f"server start (once): {timed([*server, 'start'], lc_env(root, root / 'cache'), root, timeout=600):.1f} s", flush=True)
        lines = ["| model | phase | plain aot_arm_compiler (s) | `run`, new process (s) | `run`, warm server (s) | speed-up, new process / warm server | bytes equal |",
                 "|---|---|---:|---:|---:|---:|---|"]
        lowers = [f"| model | `lower`, {args.edit} edit, warm server (s) | `run`, same edit, warm server (s) | `run` / `lower` |",
                  "|---|---:|---:|---:|"]
        for model in args.models.split(","):
            reps = []
            for i in range(args.repeat):
                reps.append(one(model, args.target, Path(tempfile.mkdtemp(prefix=f"{model}-{i}-", dir=root)), args.edit, flags, root))
            for phase in PHASES:
                plain = statistics.median(r[("new process", phase)][0] for r in reps)
                new, warm = (statistics.median(r[(mode, phase)][1] for r in reps) for mode in MODES)
                equal = all(r[(mode, phase)][2] for r in reps for mode in MODES)
                lines.append(f"| {model} | {phase} | {plain:.2f} | {new:.2f} | {warm:.2f} | {plain / new:.1f}x / {plain / warm:.1f}x | "
                             f"{'yes' if equal else '**NO**'} |")
                print(lines[-1], flush=True)
            edit_lower = statistics.median(r[("lower", "one block edited")][1] for r in reps)
            edit_run = statistics.median(r[("warm server", "one block edited")][1] for r in reps)
            lowers.append(f"| {model} | {edit_lower:.2f} | {edit_run:.2f} | {edit_run / edit_lower:.2f}x |")
            print(lowers[-1], flush=True)
    finally:
        subprocess.run([*server, "stop"], env=lc_env(root, root / "cache"), capture_output=True, timeout=300)
        shutil.rmtree(root, ignore_errors=True)
    print(f"load after: {uptime()}")
    print("\n".join(lines))
    print()
    print("\n".join(lowers))


if __name__ == "__main__":
    main()
