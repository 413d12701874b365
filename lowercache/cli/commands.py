"""The ``lowercache`` commands (typer): a thin layer over :mod:`lowercache.api`.

``lowercache/cli/__init__.py`` is the entry; it runs these unless a light
path (direct mode, the warm server, ``run``) answers first.

Errors a user can fix (missing file, bad factory, unknown target, unusable
cache directory) print one line, ``lowercache: error: ...``, and exit 2.
A failure inside ExecuTorch itself prints one line and exits 1; set
``LOWERCACHE_DEBUG=1`` for the traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import typer
from typer.core import TyperCommand, TyperGroup
from rich.console import Console

from ..errors import INTERRUPTED, LowercacheError, by_ctrl_c, interrupted, user_line
from ..output import counted
from ..targets import help_text

def _flags_take_no_value(params: list[Any]) -> list[Any]:
    """A flag's help shows no value: typer prints ``<bool>`` beside every flag without a metavar (``--help`` too)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class _Command(TyperCommand):
    """Usage lines as users read them (``lower [OPTIONS] MODEL``): typer braces a required argument (``{MODEL}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.*)\}(\.\.\.)?$", r"\1\2", piece) for piece in super().collect_usage_pieces(ctx)]


class _Group(TyperGroup):
    """A command group whose flags, and its commands' flags, show no value in their help (``--help`` included)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_take_no_value(super().get_params(ctx))

    def get_command(self, ctx: Any, name: str) -> Any:
        command = super().get_command(ctx, name)
        if command is not None:
            _flags_take_no_value(command.get_params(ctx))
        return command


app = typer.Typer(
    cls=_Group,
    help="Incremental, caching lowering of PyTorch models to Arm targets (TOSA, Ethos-U).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()

CacheDir = typer.Option(None, "--cache-dir", help=r"Cache directory \[env: LOWERCACHE_DIR].")


def _complete_target(incomplete: str) -> list[str]:
    """Shell completion for --target (no torch import: the names are plain data)."""
    from ..targets import TARGETS

    return [t for t in TARGETS if t.startswith(incomplete)]


TargetOption = typer.Option(
    ...,
    "--target",
    "-t",
    help=help_text(),
    autocompletion=_complete_target,
)
RemoteUrl = typer.Option(
    None, "--remote", help=r"Shared cache: redis://host:port/db or s3://bucket/prefix \[env: LOWERCACHE_REMOTE]."
)
# Read by main() before the command runs (lowercache.client); declared so the command accepts it.
NoServer = typer.Option(False, "--no-server", help=r"Run in this process, not through the warm server \[env: LOWERCACHE_SERVER=0].")

PerTensor = typer.Option(False, "--per-tensor", help="Quantize weights per tensor instead of per channel.")
SystemConfig = typer.Option(None, "--system-config", help="Ethos-U: Vela's system config from its Arm/vela.ini (default: ExecuTorch's for the target).")
MemoryMode = typer.Option(None, "--memory-mode", help="Ethos-U: Vela's memory mode from its Arm/vela.ini, e.g. Shared_Sram, Sram_Only (default: ExecuTorch's for the target).")
Check = typer.Option(False, "--check", help=r"Also run the lowering on the TOSA reference model against the float model: error, SNR, cosine, top-1 per output; cached; no lowered byte changes (docs/numerics.md) \[env: LOWERCACHE_CHECK].")
CheckMode = typer.Option(None, "--check", is_flag=False, flag_value="outputs", metavar="[=layers]", help=r"Also run the lowering on the TOSA reference model against the float model: error, SNR, cosine, top-1 per output; --check=layers also compares the quantized model with the float one at each module's output (where the error enters); cached; no lowered byte changes (docs/numerics.md) \[env: LOWERCACHE_CHECK].")
MinSnr = typer.Option(None, "--min-snr", metavar="DB", help="With the check (implied): exit 1, after writing the output, when an output's SNR is below DB or the reference model rejected a partition.")
NoDirect = typer.Option(False, "--no-direct", help=r"Do not answer from a direct-mode record (docs/direct-mode.md) \[env: LOWERCACHE_DIRECT=0].")


def _setup_logging() -> None:
    from ..errors import show_warnings_in_one_line

    show_warnings_in_one_line()


_EXECUTING = re.compile(r"While executing %(\w+)")
_EXECUTING_LINE = re.compile(r"^\s*While executing %\w+.*$", re.M)


def _no_traceback(record: logging.LogRecord) -> bool:
    return not (record.exc_info or record.stack_info)


@contextlib.contextmanager
def _logged_tracebacks_hidden() -> Iterator[None]:
    """Drop the tracebacks torch logs (12-19 lines) around a failure the CLI reports in one line; kept under LOWERCACHE_DEBUG.

    torch gives many of its loggers their own handler, so the filter goes on every handler of every torch logger.
    """
    if os.environ.get("LOWERCACHE_DEBUG"):
        yield
        return
    import torch  # noqa: F401  (creates torch's loggers and their handlers)

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.split(".")[0] in ("torch", "executorch")]
    handlers = {h for lg in [logging.root, *loggers] for h in lg.handlers} | ({logging.lastResort} if logging.lastResort else set())
    for h in handlers:
        h.addFilter(_no_traceback)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(_no_traceback)


def _tracebacks_hidden(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` (``lower``, ``verify``) with torch's logged tracebacks hidden, unless its MODEL names no file or its
    target is unknown: it then fails on that before torch is imported, and nothing imports torch for it."""

    @functools.wraps(command)
    def hidden(**options: Any) -> None:
        if _input_problem(options) is not None:
            return command(**options)
        with _logged_tracebacks_hidden():
            return command(**options)

    return hidden


def _input_problem(options: dict[str, Any]) -> Optional[str]:
    """A bad MODEL or target of ``lower``'s or ``verify``'s parsed options (``precheck``), found without importing torch."""
    from ..precheck import problem

    return problem(options["model"], options["target"], options.get("system_config"), options.get("memory_mode"))


def _fail(message: str, code: int, as_json: bool = False) -> None:
    """The one error line, and with ``lower --json`` the same as one JSON object on stdout, where a script reads the summary."""
    print(f"lowercache: error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": message, "exit": code}, sort_keys=True))
    raise typer.Exit(code)


def _fail_input(e: LowercacheError, as_json: bool = False) -> None:
    """The one line of an error in the user's input; under ``LOWERCACHE_DEBUG`` first the traceback of what caused it
    (a factory that raised, a model file that failed to import)."""
    if os.environ.get("LOWERCACHE_DEBUG") and e.__cause__ is not None:
        traceback.print_exception(e.__cause__, file=sys.stderr)
    _fail(str(e), 2, as_json)


def _fail_lowering(e: BaseException, as_json: bool = False) -> None:
    """One line naming the innermost cause: ExecuTorch's pass manager wraps it in a message listing every pass run."""
    if os.environ.get("LOWERCACHE_DEBUG"):
        raise e
    root, seen = e, {id(e)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    text = str(root)
    # torch.fx's interpreter appends the node it was running to the message
    node = _EXECUTING.search("\n".join([text, *map(str, getattr(root, "__notes__", ()))]))
    text = _EXECUTING_LINE.sub("", text)
    message = f"{type(root).__name__}: {' '.join(line.strip() for line in text.splitlines() if line.strip())}"
    if len(message) > 500:
        message = message[:499] + "…"
    if node is not None:
        message += f" (while executing node {node.group(1)})"
    where = user_line(root, text)
    if where is not None:
        message += f" (at {where})"
    _fail(f"lowering failed: {message}", 1, as_json)


@contextlib.contextmanager
def _local_store(cache_dir: Optional[Path], **flags) -> Iterator:
    """The local store for housekeeping commands; a one-line error if it cannot be opened."""
    from ..cache.tiers import open_store  # not api's: that imports torch for a command that reads a store

    try:
        store = open_store(_settings(cache_dir, disable=False, remote="", **flags))
    except LowercacheError as e:
        _fail(str(e), 2)
    try:
        yield store
    finally:
        store.close()


def _settings(cache_dir: Optional[Path], **flags):
    from ..config import load_settings

    return load_settings(cache_dir=cache_dir, **flags)


@app.command(cls=_Command)
@_tracebacks_hidden
def lower(
    model: str = typer.Argument(..., metavar="MODEL", help="path/to/file.py:factory (returns (nn.Module, example_inputs)) or a saved .pt2."),
    target: str = TargetOption,
    out_dir: Path = typer.Option(..., "--out", "-o", help="Directory that receives model.pte, TOSA, Vela output, manifest.json."),
    cache_dir: Optional[Path] = CacheDir,
    no_cache: bool = typer.Option(False, "--no-cache", help="Lower without reading or writing the cache."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help=".pt file with a list of input tuples (torch.load weights_only), or .npz with one array per input, samples on axis 0."),
    per_tensor: bool = PerTensor,
    remote: Optional[str] = RemoteUrl,
    no_server: bool = NoServer,
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary of the run on stdout."),
    no_direct: bool = NoDirect,
    system_config: Optional[str] = SystemConfig,
    memory_mode: Optional[str] = MemoryMode,
    check: Optional[str] = CheckMode,
    min_snr: Optional[float] = MinSnr,
) -> None:
    """Lower MODEL for a target, serving unchanged work from the cache."""
    from ..direct import Request
    from ..lowerer import lower as lowered

    request = Request(model=model, target=target, out_dir=str(out_dir), per_tensor=per_tensor,
                      calibration=str(calibration) if calibration is not None else None,
                      cache_dir=str(cache_dir) if cache_dir is not None else None, no_cache=no_cache, remote=remote,
                      no_direct=no_direct, as_json=as_json, system_config=system_config, memory_mode=memory_mode, check=check,
                      min_snr=min_snr)
    try:
        said = lowered(request, err, verbose=_verbose)
    except LowercacheError as e:
        _fail_input(e, as_json)
    except Exception as e:  # a failure inside torch.export or ExecuTorch
        _fail_lowering(e, as_json)
    err.print(said.table)
    err.print(said.total, markup=False, highlight=False)
    for line in said.lines:
        err.print(f"lowercache: {line}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(said.summary, indent=2, sort_keys=True))
    else:
        out.print(said.wrote)
    if said.short is not None:
        print(f"lowercache: error: {said.short}", file=sys.stderr)
        raise typer.Exit(1)


def _vela_args(system_config: Optional[str], memory_mode: Optional[str]) -> list[str]:
    """Vela's options as ``lower`` takes them, for the ``lower`` command lines another command runs."""
    return [*(["--system-config", system_config] if system_config else []), *(["--memory-mode", memory_mode] if memory_mode else [])]


@app.command(cls=_Command)
@_tracebacks_hidden
def verify(
    model: str = typer.Argument(..., metavar="MODEL", help="path/to/file.py:factory or a saved .pt2."),
    target: str = TargetOption,
    cache_dir: Optional[Path] = CacheDir,
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="Calibration file, as for lower (.pt or .npz)."),
    remote: Optional[str] = RemoteUrl,
    no_server: bool = NoServer,
    system_config: Optional[str] = SystemConfig,
    memory_mode: Optional[str] = MemoryMode,
) -> None:
    """Lower with and without the cache (and in a fresh cache); fail on any byte difference."""
    problem = _input_problem({"model": model, "target": target, "system_config": system_config, "memory_mode": memory_mode})
    if problem is not None:  # before torch is imported
        _fail_input(LowercacheError(problem))
    from ..lowering import loading
    from ..targets import resolve
    from ..verify import Progress, expected, served_now
    from ..verify import verify as run_verify

    environ = dict(os.environ)  # as the command started: torch sets variables of its own once it lowers
    args = [*(["--cache-dir", str(cache_dir)] if cache_dir else []), *(["--remote", remote] if remote else []),
            *(["--calibration", str(calibration)] if calibration is not None else []), *_vela_args(system_config, memory_mode)]
    vela = {"system_config": system_config, "memory_mode": memory_mode}
    try:
        settings = _settings(cache_dir, disable=False, remote=remote)
        if no_server:
            settings = dataclasses.replace(settings, server=False)
        resolve(target, **vela)
        loaded = loading.load_model(model)
        samples = loading.load_calibration(str(calibration)) if calibration is not None else None
        progress = Progress(settings, lambda line: print(f"lowercache: {line}", file=sys.stderr, flush=True))
        mismatches, stock = run_verify(loaded, target, settings, progress, calibration=samples, **vela)
        more, checked = served_now(model, target, settings, stock, str(calibration) if calibration else None, args, environ,
                                   progress=progress, **vela)
        mismatches += more
    except LowercacheError as e:
        _fail_input(e)
    except Exception as e:  # a failure inside torch.export or ExecuTorch
        _fail_lowering(e)
    mismatches, notes = expected(mismatches, target)
    for m in notes:
        print(f"lowercache: note: {m} (as the regions speed-up gives on Ethos-U; the .pte is compared byte for byte)",
              file=sys.stderr)
    for m in mismatches:
        print(f"lowercache: mismatch: {m}", file=sys.stderr)
    if mismatches:
        differ = "differs" if len(mismatches) == 1 else "differ"
        _fail(f"not verified: {counted(len(mismatches), 'file')} {differ} from stock ExecuTorch's lowering (above)", 1)
    out.print(f"verified: what lowercache serves for {model} on {target} is byte-identical to stock ExecuTorch's lowering",
              markup=False, highlight=False, soft_wrap=True)
    out.print(f"checked: the cached lowering; a lowering in an empty cache; {'; '.join(checked)}", markup=False, highlight=False,
              soft_wrap=True)


@app.command(cls=_Command)
def watch(
    model: str = typer.Argument(..., metavar="MODEL", help="path/to/file.py:factory or a saved .pt2, as for lower."),
    targets: List[str] = typer.Option(..., "--target", "-t", help="A target, as for lower; repeat -t for several.", autocompletion=_complete_target),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Output directory; with several -t, each target's output goes to DIR/<target>/."),
    cache_dir: Optional[Path] = CacheDir,
    no_cache: bool = typer.Option(False, "--no-cache", help="Lower without reading or writing the cache (no record of what the factory read is kept: the model file is watched)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="Calibration file, as for lower (.pt or .npz)."),
    per_tensor: bool = PerTensor,
    remote: Optional[str] = RemoteUrl,
    no_server: bool = NoServer,
    no_direct: bool = NoDirect,
    system_config: Optional[str] = SystemConfig,
    memory_mode: Optional[str] = MemoryMode,
    check: bool = Check,
    interval: float = typer.Option(0.5, "--interval", help="Seconds between polls of the watched files.", min=0.05),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", hidden=True, min=1, help="Stop after N rounds of lowering (tests)."),
) -> None:
    """Lower MODEL again on every save of it or of a project file it read; print what ran, Vela's estimate and (--check) the numerics, against the last."""
    from .. import watch as watching

    options = [
        *(["--cache-dir", str(cache_dir)] if cache_dir else []),
        *(["--calibration", str(calibration)] if calibration else []),
        *(["--remote", remote] if remote else []),
        *[flag for flag, on in (("--no-cache", no_cache), ("--per-tensor", per_tensor), ("--no-server", no_server), ("--no-direct", no_direct),
                                ("--check", check)) if on],
        *_vela_args(system_config, memory_mode),
    ]
    try:
        plan = watching.plan(
            model, targets, out_dir, lower_options=options, per_tensor=per_tensor, system_config=system_config, memory_mode=memory_mode,
            calibration=str(calibration) if calibration else None, interval=interval, max_runs=max_runs,
        )
        settings = _settings(cache_dir, disable=False, remote="", check=True if check else None)  # the local store, for the records of what each lowering read
    except LowercacheError as e:
        _fail(str(e), 2)

    def emit(line: str) -> None:
        print(line, flush=True)

    from . import dispatch

    raise typer.Exit(watching.run(plan, dispatch, settings, emit))


@app.command(cls=_Command)
def build(
    names: Optional[List[str]] = typer.Argument(None, metavar="NAME", help="Models to build, by their names in the build file (default: all)."),
    build_file: Optional[Path] = typer.Option(None, "--file", "-f", help=r"Build file (default: lowercache.toml, else \[tool.lowercache] in pyproject.toml, in the working directory)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Pairs lowered at once (default: the core count, bounded by memory; with ray: every pair)."),
    keep_going: bool = typer.Option(False, "--keep-going", "-k", help="Build the other pairs after a failure; report failures at the end (exit 1)."),
    executor: str = typer.Option("local", "--executor", help=r"local (worker processes on this machine) or ray (pip install 'lowercache\[ray]')."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=r"The Ray cluster (default: a Ray on this machine) \[env: RAY_ADDRESS]."),
    compare: Optional[Path] = typer.Option(None, "--compare", help="A previous build-report.json: say what changed since."),
    cache_dir: Optional[Path] = CacheDir,
    remote: Optional[str] = RemoteUrl,
    no_direct: bool = NoDirect,
) -> None:
    """Lower every (model, target) pair of the build file through the cache, in parallel; write build-report.json and .md."""
    from ..zoo import buildfile, schedule

    try:
        if executor not in ("local", "ray"):
            raise LowercacheError(f"unknown executor {executor!r}; use local or ray")
        loaded = buildfile.load(buildfile.find(build_file, Path.cwd()))
        pairs = buildfile.select(loaded, names or [])
        options = schedule.Options(jobs, keep_going, executor, ray_address, str(cache_dir.resolve()) if cache_dir else None, remote, no_direct,
                                   compare.resolve() if compare else None)
        result = schedule.run(loaded, pairs, options, console=out, emit=lambda line: print(line, flush=True))
    except LowercacheError as e:
        _fail(str(e), 2)
    raise typer.Exit(result.code)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def bench(ctx: typer.Context) -> None:
    """Benchmark stock ExecuTorch vs lowercache (options: see `lowercache bench --help`)."""
    from ..bench.harness import main as bench_main

    raise typer.Exit(bench_main(ctx.args))


@app.command()
def stats(
    cache_dir: Optional[Path] = CacheDir,
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object on stdout."),
    zero: bool = typer.Option(False, "--zero", "-z", help="Set the counters (hits, misses, time saved) back to zero; entries stay."),
) -> None:
    """Size against the limit, when counters were zeroed, lowerings served and lowered, errors, hit rate by step (as ccache -s)."""
    from . import stats as report

    with _local_store(cache_dir) as store:
        if zero:
            store.zero_counters()
            out.print(f"counters of {store.directory} set to zero", markup=False, highlight=False)
            return
        found = report.figures(store, _settings(cache_dir).max_size)
    if as_json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return
    for line in report.summary(found):
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    out.print(report.table(found, _verbose))


@app.command(cls=_Command)
def explain(
    model: str = typer.Argument(..., metavar="MODEL", help="The MODEL as given to `lowercache lower`."),
    target: str = TargetOption,
    passes: bool = typer.Option(False, "--passes", help="List every Arm pass of the latest run that ran passes."),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Say which named key parts changed for the last miss of MODEL on a target."""
    from .. import direct
    from ..cache import history
    from ..targets import resolve

    try:
        name = _model_name(model)
        resolved = resolve(target)
    except LowercacheError as e:
        _fail(str(e), 2)
    if not os.path.exists(name.rpartition(":")[0] if not model.endswith(".pt2") else name):
        _fail(f"model file {model.rpartition(':')[0] if not model.endswith('.pt2') else model} does not exist", 2)
    with _local_store(cache_dir) as store:
        for line in history.explain(store, name, resolved.name):
            typer.echo(line)
        for line in direct.explain(store, model, resolved.name):
            typer.echo(line)
        if passes:
            for line in history.explain_passes(store, name, resolved.name):
                typer.echo(line)


def _model_name(model: str) -> str:
    """The history name `lower` records for MODEL, without loading it."""
    if model.endswith(".pt2"):
        return os.path.abspath(model)
    path, sep, factory = model.rpartition(":")
    if not sep:
        raise LowercacheError(f"bad model {model!r}; expected path/to/file.py:factory or a .pt2 file")
    return f"{os.path.abspath(path)}:{factory}"


@app.command()
def gc(
    max_size: Optional[str] = typer.Option(None, "--max-size", help="Evict least-recently-used entries down to this size (e.g. 2G)."),
    verify: bool = typer.Option(False, "--verify", help="Also check every entry and drop corrupt ones."),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Evict entries over the size limit (and, with --verify, corrupt ones)."""
    try:
        limit = _settings(cache_dir, max_size=max_size).max_size
    except LowercacheError as e:
        _fail(str(e), 2)
    with _local_store(cache_dir, max_size=max_size, read_only=False) as store:
        freed = store.gc(limit)  # first: on a full disk it makes the room the other steps need
        orphans, orphan_bytes = store.reclaim_orphans()
        dropped = store.verify_all() if verify else 0
        out.print(
            f"freed {(freed + orphan_bytes) / 2**20:.1f} MiB; {dropped} corrupt entries dropped; "
            f"{orphans} orphaned files removed; size now {store.volume() / 2**20:.1f} MiB"
        )


@app.command()
def clear(cache_dir: Optional[Path] = CacheDir) -> None:
    """Remove every entry, counter and run record."""
    with _local_store(cache_dir, read_only=False) as store:
        removed = store.clear()
        out.print(f"removed {removed} entries from {store.directory}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    cache_dir: Optional[Path] = CacheDir,
    remote: Optional[str] = RemoteUrl,
    outs: List[Path] = typer.Option([], "--out", metavar="DIR", help="A directory outside the working directory the command may write (replayed like the rest)."),
    explain: bool = typer.Option(False, "--explain", help="Say what the latest run of this command did with its record, and why; run nothing."),
    no_server: bool = typer.Option(False, "--no-server", help=r"Run the command as a new process, not in a child of the warm server \[env: LOWERCACHE_SERVER=0]."),
) -> None:
    """Run a command (e.g. `lowercache run -- python export.py`): replayed from its record when nothing it read changed, else run with its lowering steps cached (Arm, XNNPACK), in a child of the warm server when that can stand in for a new python (docs/run.md)."""
    if not ctx.args:
        _fail("nothing to run; usage: lowercache run -- python script.py", 2)
    if explain:
        from ..cache.tiers import open_store
        from ..run.replay import Command, explain as explain_command

        try:
            _settings(cache_dir, remote=remote, server=False if no_server else None)  # a bad flag is an error here too
            store = open_store(_settings(cache_dir, disable=False, remote="", read_only=True))
        except LowercacheError as e:
            _fail(str(e), 2)
        try:
            for line in explain_command(store, Command(argv=list(ctx.args), outs=[str(o) for o in outs])):
                print(line)
        finally:
            store.close()
        return
    from ..run.launch import run_command

    try:
        code = run_command(list(ctx.args), [str(o) for o in outs], cache_dir=cache_dir, remote=remote, no_server=no_server)
    except LowercacheError as e:
        _fail(str(e), 2)
    raise typer.Exit(code)


@app.command(name="export", cls=_Command)
def export_cmd(
    archive: Path = typer.Argument(..., metavar="FILE", help="Tar file to write."),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Pack every local cache entry into one archive (for CI caches that store one file)."""
    from ..cache.archive import export_entries

    with _local_store(cache_dir) as store:
        try:
            actions, blobs = export_entries(store, archive)
        except LowercacheError as e:
            _fail(str(e), 2)
    out.print(f"exported {actions} steps and {blobs} blobs to {archive}")


@app.command(name="import", cls=_Command)
def import_cmd(
    archive: Path = typer.Argument(..., metavar="FILE", help="Tar file made by `lowercache export`."),
    cache_dir: Optional[Path] = CacheDir,
) -> None:
    """Load an archive made by `lowercache export`, checking every entry."""
    from ..cache.archive import import_entries

    with _local_store(cache_dir, read_only=False) as store:
        try:
            stored = import_entries(store, archive)
        except LowercacheError as e:
            _fail(str(e), 2)
    out.print(f"imported {stored} steps from {archive}")


@app.command()
def config(cache_dir: Optional[Path] = CacheDir) -> None:
    """Show the resolved settings and where each came from."""
    from ..config import config_path

    try:
        settings = _settings(cache_dir)
    except LowercacheError as e:
        _fail(str(e), 2)
    from ..config import describe

    rows = [("config file", str(config_path()), "")] + describe(settings)
    width = max(len(name) for name, _, _ in rows)
    for name, value, origin in rows:
        out.print(f"{name:<{width}}  {value}" + (f"  ({origin})" if origin else ""), markup=False, highlight=False, soft_wrap=True)


@app.command()
def speedups() -> None:
    """List the exact speed-ups: on, off by setting (LOWERCACHE_SPEEDUPS), or off because the installed source differs;
    and for each target family, whether it is on for that family's lowerings (a dash: not proven on that family)."""
    from rich.table import Table

    from ..cache.toolchain import version
    from ..speedups import registry
    from ..targets import FAMILIES

    try:
        registry.select(_settings(None).speedups)
        states = registry.report()
    except LowercacheError as e:
        _fail(str(e), 2)
    versions = ", ".join(f"{d} {version(d)}" for d in ("torch", "executorch", "tosa-tools", "ethos-u-vela"))
    out.print(f"installed: {versions}", markup=False, highlight=False)
    table = Table(show_header=True, header_style="bold")
    for column in ("speed-up", "state", *(f.title for f in FAMILIES), "why its bytes equal stock's"):
        table.add_column(column, overflow="fold")
    on = {f.name: 0 for f in FAMILIES}
    for entry in registry.SPEEDUPS:
        cells = []
        for family in FAMILIES:
            applies = registry.applies(entry.name, family.name)
            on[family.name] += applies and states[entry.name] == "on"
            cells.append("-" if not applies else "on" if states[entry.name] == "on" else "off")
        table.add_row(entry.name, states[entry.name], *cells, entry.why)
    out.print(table)
    counts = ", ".join(f"{on[f.name]} for {f.title}" for f in FAMILIES)
    out.print(f"{sum(s == 'on' for s in states.values())} of {len(states)} on ({counts}); set LOWERCACHE_SPEEDUPS=all,-NAME "
              "to turn one off", markup=False, highlight=False)


server_app = typer.Typer(
    cls=_Group,
    help="The warm lowering server: lower and verify run in a process with torch already imported (docs/server.md).",
    no_args_is_help=True,
)
app.add_typer(server_app, name="server")


@server_app.command("start")
def server_start(
    targets: List[str] = typer.Option(
        [], "--target", "-t", metavar="TARGET", autocompletion=_complete_target,
        help="Also warm the server for this target's family now (XNNPACK's is otherwise warmed after its first use); "
             "repeat -t for several."),
) -> None:
    """Start the server, or replace one whose versions, sources or settings differ from this client's."""
    from .. import client
    from ..targets import resolve

    try:
        names = [resolve(target).name for target in targets]
        hello = client.ensure_server(_settings(None))
        if names:
            client.warm_server(names)
    except LowercacheError as e:
        _fail(str(e), 2)
    except client.ServerUnavailable as e:
        _fail(f"cannot start the server: {e}", 1)
    out.print(f"server running (pid {hello['pid']})", markup=False, highlight=False)


@server_app.command("stop")
def server_stop() -> None:
    """Stop the server once the requests it accepted are done."""
    from .. import client

    try:
        reply = client.stop_server()
    except client.ServerUnavailable as e:
        _fail(str(e), 2)
    if reply is None:
        out.print("no server running")
    elif reply.get("exited"):
        out.print(f"server stopped (pid {reply['pid']})", markup=False, highlight=False)
    else:
        out.print(f"server stopping (pid {reply['pid']}): finishing {reply['running'] + reply['queued']} requests", markup=False, highlight=False)


@server_app.command("status")
def server_status() -> None:
    """Version, pid, uptime, requests served, memory; exit 1 when no server runs."""
    from .. import client

    try:
        reply = client.ask({"op": "status"})
        mine = client.identity(_settings(None))
    except (LowercacheError, client.ServerUnavailable) as e:
        _fail(str(e), 2)
    if reply is None:
        out.print(f"no server running (socket directory {client.socket_dir()})", markup=False, highlight=False)
        raise typer.Exit(1)
    who = reply["identity"]
    differ = sorted(k for k in {*who, *mine} if who.get(k) != mine.get(k) and k != "startup")
    if who.get("startup") != mine.get("startup"):
        from .. import startup

        differ.append(startup.changed(who.get("startup"), mine["startup"], "the server's") or "start-up state")
    rows = [
        ("server", f"pid {reply['pid']}, lowercache {who['lowercache']}, torch {who['torch']}, executorch {who['executorch']}"),
        ("state", f"stale: the next request replaces it ({'; '.join(differ)})" if differ else "current"),
        ("uptime", f"{reply['uptime']:.1f} s"),
        ("requests", f"{reply['requests']} served ({reply['failed']} failed), {reply['running']} running, {reply['queued']} queued, at most {reply['jobs']} at once"),
        ("records", f"{reply.get('unconfirmed', 0)} to confirm when idle, {reply.get('confirmed', 0)} confirmation runs done"),
        ("warm for", _family_titles(reply.get("warm") or [])),
        ("memory", f"{reply['rss'] / 2**20:.1f} MiB resident (the server; each request's process adds its own)"),
        ("idle exit", f"after {reply['idle_timeout']} s without a request"),
        ("socket", reply["socket"]),
    ]
    for name, value in rows:
        out.print(f"{name:<10} {value}", markup=False, highlight=False, soft_wrap=True)


def _family_titles(names: list[str]) -> str:
    from ..targets import FAMILIES

    return ", ".join(f.title for f in FAMILIES if f.name in names) or "nothing yet"


_verbose = False
# Commands that import torch: its log handler must exist before third-party noise can be held back.
_TORCH_COMMANDS = {"lower", "verify", "bench", "speedups"}


def _print_version(asked: bool) -> None:
    if asked:
        from . import version_line

        out.print(version_line(), markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback()
def _options(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show the third-party warnings lowercache holds back."),
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="Print lowercache's version and its toolchain's, and exit."),
) -> None:
    global _verbose
    _verbose = verbose


def _fresh_consoles() -> None:
    """Consoles made for this command: rich decides at creation whether a stream is interactive and its colours, and
    a server's child must decide by its client's terminal, not by the server's (which has none).

    Each reads a copy of the environment taken now: what rich looks up while a
    factory runs (``TERM``, ``COLUMNS``, ...) is lowercache's presentation,
    never an input of the record made meanwhile.
    """
    global err, out
    err, out = _console(stderr=True), _console(stderr=False)


def _console(stderr: bool) -> Console:
    from .. import terminal

    size = terminal.size(sys.stderr if stderr else sys.stdout)  # a server's child: its client's terminal
    console = Console(stderr=stderr, _environ=dict(os.environ), **({"width": size[0], "height": size[1]} if size else {}))
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 200  # a CI log has no width to fit: lines are not wrapped at 80, nor table cells cut
    return console


def _settings_problem() -> Optional[str]:
    """A bad setting (``LOWERCACHE_SPEEDUPS=bogus``, a bad size), found before torch is imported, in its one line."""
    from ..client import check_speedups
    from ..config import load_settings

    try:
        check_speedups(load_settings())
    except LowercacheError as e:
        return str(e)
    return None


def run_in_process(args: List[str]) -> object:
    """Run the command line in this process and return its exit code; a server's child runs this too."""
    from .. import quiet
    from .usage import input_problem

    _fresh_consoles()
    _setup_logging()
    command = next((a for a in args if not a.startswith("-")), None)
    options = args[: args.index("--")] if "--" in args else args
    if command in _TORCH_COMMANDS and "--help" not in options:
        problem = _settings_problem()
        if problem is not None:
            print(f"lowercache: error: {problem}", file=sys.stderr)
            if command == "lower" and "--json" in options:
                print(json.dumps({"error": problem, "exit": 2}, sort_keys=True))
            return 2
    code: object = 0
    # help needs no torch, nor a bad MODEL or target: the command fails on it before torch would be imported
    torch_first = command in _TORCH_COMMANDS and "--help" not in options and input_problem(args) is None
    with quiet.captured(import_torch=torch_first) as noise:
        try:
            app(args=args, prog_name="lowercache")
        except SystemExit as e:  # typer turns Ctrl-C into a silent exit 130
            code = interrupted() if e.code == INTERRUPTED and by_ctrl_c(e) else e.code
    quiet.print_held_back(noise, _verbose)
    return code
