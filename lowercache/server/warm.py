"""What the server holds warm: the imports and a first lowering done once, and the stamps that say it is still current."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .. import environment, startup
from ..cache.digests import stat_key
from ..config import load_settings
from ..targets import FAMILIES


@dataclass
class Warm:
    """What the warm-up left that a child standing in for a new ``python`` process needs (``run/pyexec.py``)."""

    threads: int  # torch's default thread count, before the server set one
    cpus: int  # how many CPUs the server may run on (torch's default follows it)
    start_env: dict[str, str]  # the environment as the server started
    base_path: list[str] | None  # sys.path as the interpreter started, without sys.path[0] (None: unknown)
    read_env: list[str] = field(default_factory=list)  # variables the imports and the warm-up read
    lookups: list[str] = field(default_factory=list)  # module names they looked up
    imported: dict[str, list[str]] = field(default_factory=dict)  # top-level names of those and of every module imported, where found
    installed: tuple[str, ...] = ()  # directories of installed code (stdlib, site-packages, lowercache)
    files: dict[str, list[int] | str | None] = field(default_factory=dict)  # every imported module's file: _file_stamp
    families: set[str] = field(default_factory=set)  # the target families warmed so far, by name

    def remember_files(self) -> None:
        """Note the file of every module imported so far (thousands after the warm-up, checked again before each request)."""
        for module in list(sys.modules.values()):
            origin = getattr(module, "__file__", None)
            if isinstance(origin, str) and os.path.isabs(origin):
                self.files[origin] = _file_stamp(origin)

    def changed_file(self) -> str | None:
        """A file the server imported that has changed since (an upgrade or an edit in place), or None."""
        for path, stamp in self.files.items():
            if _file_stamp(path) != stamp:
                return path
        return None


def _file_stamp(path: str) -> list[int] | str | None:
    """The file's ``stat_key``, None when it is gone (a file missing at the warm-up stays missing); a top-level file of
    site-packages by its content (``pip install -e .`` again rewrites its finder with the same bytes)."""
    if startup.top_level_site_file(path):
        return startup.file_digest(path)
    try:
        return stat_key(os.stat(path))
    except OSError:
        return None


def _installed_dirs() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")} | set(site.getsitepackages())
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # lowercache itself
    return tuple(os.path.join(os.path.normpath(d), "") for d in dirs)


def warm_up(warm: Warm) -> None:
    """Import the stack single-threaded and lower a tiny model into a throwaway cache, listening to what it reads."""
    _listening(warm, lambda: _import_and_lower(warm))
    warm.families.update(family.name for family in FAMILIES if not family.warm_on_use)


def targets_named(argv: list[str]) -> list[str]:
    """The targets a command line names (``--target T``, ``-t T``, ``--target=T``), as typed."""
    found = []
    for i, arg in enumerate(argv):
        if arg in ("--target", "-t") and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--target="):
            found.append(arg.partition("=")[2])
    return found


def family_warmed_on_use(target: str) -> str | None:
    """The name of ``target``'s family when the server warms it on use (``Family.warm_on_use``), else None."""
    from ..targets import family_of

    try:
        family = family_of(target.strip().lower())
    except KeyError:  # not a target: the request's own error
        return None
    return family.name if family.warm_on_use else None


def warm_family(warm: Warm, name: str) -> None:
    """Warm one more family (its ``warm_on_use`` targets) in the server's own process, between requests: what its
    children will find warm, as the start-up's warm-up (what it reads and imports is added to what the children know)."""
    family = next(f for f in FAMILIES if f.name == name)
    _listening(warm, lambda: _lower_tiny(family.warm_on_use))
    warm.families.add(name)


def _listening(warm: Warm, work: Callable[[], None]) -> None:
    from ..record.recorder import listen, remember_modules
    from ..run.replay import CommandRecorder

    settings = load_settings()
    recorder = CommandRecorder("/", settings, [])
    listen(recorder)
    try:
        work()
    finally:
        recorder.close()
    read = {name for name in recorder.env if not environment.shown_only(name)}  # rich's and typer's: never inputs
    warm.read_env = sorted(read | set(warm.read_env))
    warm.lookups = sorted(set(recorder.lookups) | set(warm.lookups))
    warm.imported = startup.found_in(dict(sys.modules), warm.lookups)
    warm.installed = _installed_dirs()
    warm.remember_files()
    remember_modules()


# What ExecuTorch's Arm export script (aot_arm_compiler, ``lowercache run``'s usual command) imports beyond
# the flow: its devtools (which bring pandas), Cortex-M and model-registry modules, about 400 modules
# that each child would otherwise import again. Never the script itself: ``-m`` must find it unimported.
SCRIPT_IMPORTS = (
    "executorch.backends.arm.util._factory", "executorch.backends.arm.vgf", "executorch.backends.cortex_m.edge_compile_config",
    "executorch.backends.cortex_m.passes.cortex_m_pass_manager", "executorch.backends.cortex_m.passes.replace_quant_nodes_pass",
    "executorch.backends.cortex_m.quantizer.quantizer", "executorch.backends.cortex_m.target_config", "executorch.devtools",
    "executorch.devtools.backend_debug", "executorch.devtools.bundled_program.config",
    "executorch.devtools.bundled_program.serialize", "executorch.examples.models", "executorch.examples.models.model_factory",
    "executorch.extension.export_util.utils", "tabulate",
)


def _import_and_lower(warm: Warm) -> None:
    from .. import quiet

    with quiet.captured(import_torch=True) as imports:  # what a new process's imports hold back, its children count too
        import torch

        warm.threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a fork after the intra-op pool ran can hang the child
        from ..lowering.flow import import_stack

        import_stack()
        import rich.console  # noqa: F401
        import rich.progress  # noqa: F401
        import rich.table  # noqa: F401
        import typer  # noqa: F401

        from .. import api, verify  # noqa: F401
        from ..bench import models  # noqa: F401
        from ..cli import commands  # noqa: F401  (the typer commands a lower or verify child runs)
        from ..lowering import loading  # noqa: F401

        for name in ("typer._adapters", *SCRIPT_IMPORTS):  # typer's first parse imports pydantic there, in every child
            try:
                importlib.import_module(name)
            except ImportError:  # another ExecuTorch release: its script imports something else, in the child
                pass
    quiet.inherit(imports.lines)
    _lower_tiny([t for family in FAMILIES for t in family.warm_up])
    _pin_sources()


def _pin_sources() -> None:
    """Turn on and off the hooks of each family whose backend the imports loaded but no warm-up lowered (XNNPACK for
    Arm's export script): its speed-ups read and digest their audited sources (``speedups/sourcepin.py``) once here,
    and each ``run`` child that wraps that backend reuses the digests instead of reading the sources again."""
    for family in FAMILIES:
        if any(m in sys.modules for m in family.hook_modules):
            with importlib.import_module(family.hooks).hooks():
                pass


def _lower_tiny(targets: Iterable[str]) -> None:
    from .. import api, quiet
    from ..bench import models

    with quiet.captured(), tempfile.TemporaryDirectory(prefix="lowercache-warmup-") as scratch:
        module, example = models.tiny_cnn()
        settings = load_settings(cache_dir=scratch, disable=False, read_only=False, remote="")
        for target in targets:
            api.lower(module, example, target=target, settings=settings)
