"""One ``lower`` below the CLI: settings -> target -> record -> load -> lower -> write, and the report to print.

The ``lower`` command parses its options into a :class:`lowercache.direct.Request`, calls :func:`lower`
with it and prints the :class:`lowercache.output.Report` it returns (text or ``--json``), mapping errors
to exit codes.
The warm server's child runs that command, and settles a record in the background with :func:`confirm`;
``watch`` and ``build`` run the ``lower`` command line, so each of them reaches this one sequence (a
direct-mode hit answers before it, from :func:`lowercache.direct.serve`). Direct mode is a context around
the factory and the export (:func:`lowercache.direct.recording`).

A failure counts in ``stats`` and is raised as it came: a :class:`LowercacheError` is the user's to fix
(``input``), anything else failed inside torch or ExecuTorch (``lowering``), as ccache counts failed
compilations. Named ``lowerer``, not ``lower``: a ``lowercache.lower`` module would replace the
``lowercache.lower`` function (the API, loaded lazily) in every process that imported it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from . import direct, estimates, phases, precheck
from .config import Settings
from .errors import LowercacheError
from .output import Report, report, run_summary


def lower(request: direct.Request, console: Any, *, verbose: bool = False) -> Report:
    """Lower ``request.model`` for ``request.target`` through the cache into ``request.out_dir``, with ``lower``'s
    options as the request holds them; what to print at the end.

    ``console``: where the phases are shown as they run (a counter at a terminal, a line each in a log);
    ``verbose``: the table lists every cached step too.
    """
    settings = None
    try:
        settings = request.settings()
        # before torch is imported:
        problem = precheck.problem(request.model, request.target, request.system_config, request.memory_mode)
        if problem is not None:
            raise LowercacheError(problem)
        artifacts, written, timed = _lower(request, settings, console)
    except LowercacheError:
        _count_failure(settings, "input")
        raise
    except Exception:  # a failure inside torch.export or ExecuTorch
        _count_failure(settings, "lowering")
        raise
    out_dir = Path(request.out_dir)
    said = report(_run_summary(artifacts, written, out_dir), estimates.outcome(artifacts.delegation, out_dir, request.target),
                  artifacts.numerics, written, out_dir, request.snr_floor())
    said.table, said.total = phases.table(timed, artifacts.records, verbose)
    return said


def _lower(request: direct.Request, settings: Settings, console: Any) -> tuple[Any, list[Path], phases.Phases]:
    """The lowering itself: its artifacts, the files written, the phases as timed."""
    from . import api
    from .cache.tiers import held
    from .targets import resolve

    resolved = resolve(request.target, system_config=request.system_config, memory_mode=request.memory_mode)
    out_dir = Path(request.out_dir)
    api.check_output_dir(out_dir)
    # The store opened once (an unusable cache directory fails here, early), then what the factory reads:
    with held(settings), direct.recording(request, settings, before=lambda: _import_first(request, settings)) as recorder:
        with phases.progress(console, phases.planned(resolved.quantized, settings.check), resolved.family.backend) as timed:
            timed.begin("load")
            loaded, samples = _load(recorder, request)
            artifacts = api.lower(
                _model(loaded),
                loaded.example_inputs,
                target=request.target,
                calibration=samples,
                per_channel=not request.per_tensor,
                name=loaded.name,
                listener=direct.listening(recorder, timed.listener),
                settings=settings,
                system_config=request.system_config,
                memory_mode=request.memory_mode,
                check=settings.check,
            )
        direct.finish(recorder, artifacts.records, artifacts.manifest)
    return artifacts, api.write_artifacts(artifacts, out_dir), timed


def _import_first(request: direct.Request, settings: Settings) -> None:
    """What a recording run does before its backstop starts, which would trace each file it names: import the whole
    lowering stack, or only the export's when the flow step will likely hit (``direct.likely_hit``; the imports of a
    miss cost seconds more traced, and a hit spares the lowering stack's); and find the toolchain parts, which stat
    thousands of installed files (a warm server's child finds them again: ``server/child.py``)."""
    from .cache.toolchain import toolchain_parts
    from .lowering.flow import import_stack, stack_imported

    if not stack_imported():
        import_stack(lowering=not direct.likely_hit(request, settings))
    toolchain_parts()


def confirm(args: list[str]) -> str:
    """Confirm the direct-mode record of the ``lower`` command line ``args`` without lowering (the warm server, when
    idle): the factory and the export run as :func:`lower` runs them, with the recorder listening (``direct.confirm``)."""

    def key_of(recorder: direct.LowerRecorder) -> Optional[str]:
        from . import api

        request = recorder.request
        loaded, samples = _load(recorder, request)
        return api.flow_key(_model(loaded), loaded.example_inputs, target=request.target, settings=recorder.settings,
                            calibration=samples, per_channel=not request.per_tensor,
                            listener=direct.listening(recorder, lambda *_: None), system_config=request.system_config,
                            memory_mode=request.memory_mode)

    return direct.confirm(args, key_of)


def _load(recorder: Optional[direct.LowerRecorder], request: direct.Request) -> tuple[Any, Optional[list[Any]]]:
    """The model (its file imported and its factory run, with the recorder listening) and the calibration samples, checked against it."""
    from .lowering import loading

    loaded = direct.recorded(recorder, loading.load_model, request.model)
    samples = None
    if request.calibration is not None:
        samples = loading.load_calibration(request.calibration)
        loading.check_calibration(samples, loaded.example_inputs, request.calibration)
    return loaded, samples


def _model(loaded: Any) -> Any:
    """What is lowered: a saved program as loaded, else the factory's module."""
    return loaded.program if loaded.program is not None else loaded.module


def _run_summary(artifacts: Any, written: list[Path], out_dir: Path) -> dict[str, Any]:
    """What ``--json`` says of a lowering: the outcome, step counts, time and files."""
    from .cache.steps import outcome_counts

    flow = next((r for r in artifacts.records if r["kind"] == "flow"), None)
    return run_summary(artifacts.manifest, out_dir, written, flow=flow["outcome"] if flow else None,
                       step_counts=outcome_counts(artifacts.records), seconds=round(sum(artifacts.stages.values()), 4),
                       saved_seconds=round(sum(r["saved"] for r in artifacts.records if r["outcome"] == "hit"), 4))


def _count_failure(settings: Optional[Settings], why: str) -> None:
    """A failed ``lower`` counts in ``stats``; nothing when there is no cache to count in."""
    if settings is None or settings.disable or settings.read_only:
        return
    from .cache.tiers import open_store

    try:
        store = open_store(dataclasses.replace(settings, remote=""))
    except LowercacheError:
        return
    try:
        store.add_counts({"failed": {why: 1}})
    finally:
        store.close()

