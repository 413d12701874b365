"""The zoo figure (issue #29): ``lowercache build -j N`` against a sequential loop of stock export scripts.

    python benchmarks/zoo.py [--models tiny_cnn,residual_cnn,transformer_block]
                             [--targets ethos-u55-128,ethos-u85-256,tosa-int] [--jobs 2] [--out DIR]

In a fresh project (one ``<model>.py`` per model: the benchmark's builders and a factory, as the process
scenario writes them; the stock script as ``export.py``; a copy of lowercache's sources on ``PYTHONPATH``;
empty caches; a private server socket directory), each phase is timed as a shell times whole commands:

- stock loop: ``python export.py <model>.py:model TARGET out.pte`` for every pair, one after another;
- cold: ``lowercache build -j N`` into an empty cache (the warm server starts on demand inside it);
- warm, first re-run: nothing changed; unchanged pairs are flow hits in workers, confirming direct mode's records;
- warm: nothing changed; every pair a direct-mode hit in the build's own process;
- one model edited (its second block's structure): only its pairs run; the stock loop runs again in full.

Every ``model.pte`` is compared with the stock script's for the same pair. Prints a Markdown table and
writes ``zoo.json`` and ``report.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lowercache.bench import stockscript
from lowercache.bench.process import lowercache_command, model_source, timed

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent / "lowercache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,residual_cnn,transformer_block")
    parser.add_argument("--targets", default="ethos-u55-128,ethos-u85-256,tosa-int")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--edit", default=None, help="the model edited in the last phase (default: the first)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model_names, targets = args.models.split(","), args.targets.split(",")
    edited = args.edit or model_names[0]
    root = Path(tempfile.mkdtemp(prefix="lczoo"))
    run_dir = Path(tempfile.mkdtemp(prefix="lcz", dir="/tmp"))  # short: a socket path holds about 100 bytes
    project = root / "project"
    project.mkdir()
    (project / "export.py").write_text(stockscript.source())
    shutil.copytree(PACKAGE, root / "src" / "lowercache", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "config.toml").write_text("")
    user = {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}
    env = {**user, "PYTHONPATH": os.pathsep.join(p for p in (str(root / "src"), user.get("PYTHONPATH", "")) if p),
           "XDG_RUNTIME_DIR": str(run_dir), "LOWERCACHE_CONFIG": str(root / "config.toml"),
           "LOWERCACHE_DIR": str(root / "cache"), "LOWERCACHE_SERVER_IDLE_TIMEOUT": "7200"}
    for name in model_names:
        (project / f"{name}.py").write_text(model_source(name, None))
    (project / "lowercache.toml").write_text(
        f"out = \"build\"\ntargets = {json.dumps(targets)}\n" + "".join(f"\n[models.{n}]\nmodel = \"{n}.py:model\"\n" for n in model_names)
    )
    lc = lowercache_command()
    pairs = [(m, t) for m in model_names for t in targets]
    seconds: dict[str, float] = {}
    stock_pte: dict[tuple[str, str], bytes] = {}
    identical: dict[str, bool] = {}
    served: dict[str, dict[str, int]] = {}

    def stock_loop(phase: str) -> None:
        total = 0.0
        for model, target in pairs:
            out = root / "stock" / phase / f"{model}-{target}.pte"
            out.parent.mkdir(parents=True, exist_ok=True)
            total += timed([sys.executable, "export.py", f"{model}.py:model", target, str(out)], user, project)
            stock_pte[(model, target)] = out.read_bytes()
        seconds[f"stock loop ({phase})"] = total
        print(f"stock loop ({phase}): {total:.1f} s", flush=True)

    def build(phase: str) -> None:
        seconds[phase] = timed([*lc, "build", "-j", str(args.jobs)], env, project)
        report = json.loads((project / "build" / "build-report.json").read_text())
        counts: dict[str, int] = {}
        for row in report["pairs"]:
            key = f"{row['outcome']} ({row['how']})"
            counts[key] = counts.get(key, 0) + 1
        served[phase] = counts
        identical[phase] = all(
            (project / "build" / m / t / "model.pte").read_bytes() == stock_pte[(m, t)] for m, t in pairs
        )
        print(f"{phase}: {seconds[phase]:.2f} s; {counts}; byte-identical to stock: {identical[phase]}", flush=True)

    load_before = os.getloadavg()
    try:
        stock_loop("cold")
        build("cold")
        build("warm, first re-run")
        build("warm")
        (project / f"{edited}.py").write_text(model_source(edited, "structure"))
        stock_loop("after the edit")
        build(f"{edited} edited")
    finally:
        subprocess.run([*lc, "server", "stop"], env={**env, "LOWERCACHE_SERVER": "1"}, cwd=project, capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    load_after = os.getloadavg()
    stock_cold, stock_edit = seconds["stock loop (cold)"], seconds["stock loop (after the edit)"]
    rows = [
        ("cold", stock_cold, seconds["cold"]),
        ("warm, first re-run", stock_cold, seconds["warm, first re-run"]),
        ("warm (nothing changed)", stock_cold, seconds["warm"]),
        (f"{edited} edited (its {len(targets)} pairs run)", stock_edit, seconds[f"{edited} edited"]),
    ]
    phase_keys = ["cold", "warm, first re-run", "warm", f"{edited} edited"]
    lines = [
        f"{len(model_names)} models x {len(targets)} targets ({', '.join(model_names)}; {', '.join(targets)}), "
        f"`lowercache build -j {args.jobs}` vs a sequential loop of the stock script; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, {os.cpu_count()} CPUs",
        "",
        "| phase | stock loop | lowercache build | speed-up | served | model.pte == stock |",
        "|---|---:|---:|---:|---|---|",
    ]
    for (label, stock, ours), key in zip(rows, phase_keys):
        how = ", ".join(f"{n} {k}" for k, n in sorted(served[key].items()))
        lines.append(f"| {label} | {stock:.1f} s | {ours:.2f} s | {stock / ours:.1f}x | {how} | {'yes' if identical[key] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        (args.out / "zoo.json").write_text(json.dumps({"seconds": seconds, "served": served, "identical": identical,
                                                        "load": [load_before, load_after], "models": model_names,
                                                        "targets": targets, "jobs": args.jobs}, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
