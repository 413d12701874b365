"""The ``lowercache`` entry: answer from the lightest path that can, before typer is even imported.

Every command pays its imports before the cache is asked, and typer, rich
and typer's first parse (it builds pydantic adapters) are a large share of
a hit, so three paths that need neither come first:

- ``lower`` answered from a direct-mode record (``direct.serve``);
- ``lower`` and ``verify`` through the warm server (``client``), whose
  child runs the commands below, when typer would take the command line
  (``usage``: a usage error is reported in this process, starting no server);
- ``run -- COMMAND`` with only the options it usually has (``--out``,
  ``--cache-dir``, ``--remote``, ``--no-server``), parsed here and run by
  the same core as the typer command (``run/launch.py``'s ``run_command``).

Anything else (``--help``, ``--explain``, a global option, an unusual
spelling) goes to the typer commands in :mod:`lowercache.cli.commands`.
"""

from __future__ import annotations

import sys
from typing import List, Optional

# ``lowercache run``'s options that take a value, and its flags, as the light path accepts them.
_RUN_VALUES = {"--out": "outs", "--cache-dir": "cache_dir", "--remote": "remote"}
_RUN_FLAGS = {"--no-server": "no_server"}


def main(argv: Optional[List[str]] = None) -> None:
    try:
        code = dispatch(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # in a light path (direct mode, the client): one line, as the typer commands say it
        from ..errors import interrupted

        code = interrupted()
    sys.exit(code)


def dispatch(args: List[str]) -> object:
    """Run a command line the way a new ``lowercache`` process does, and return its exit code (``watch`` runs its lowerings so)."""
    from ..errors import new_command
    from ..shadowing import own_imports

    new_command()
    if args == ["--version"]:  # as the typer option says it, without importing typer
        print(version_line())
        return 0
    command = next((a for a in args if not a.startswith("-")), None)
    if command == "lower":  # direct mode: an unchanged lowering answered from its record, without torch (docs/direct-mode.md)
        args = check_spelled(args)
        with own_imports():
            from ..direct import serve

        served = serve(args)
        if served is not None:
            return served
    if command == "run":
        wrapped = parse_run(args)
        if wrapped is not None:
            return run_light(**wrapped)
    # then the warm server (docs/server.md), for a command line typer would take: a usage error, a MODEL that names
    # no file or an unknown target is reported here, at once, and starts no server
    with own_imports():
        from ..client import SERVED, run_through_server
        from .usage import input_problem, well_formed

    if command in SERVED and well_formed(args) and input_problem(args) is None:
        served = run_through_server(args)
        if served is not None:
            return served
    return run_in_process(args)


def version_line() -> str:
    """``lowercache 0.1.0 (torch ..., executorch ..., tosa-tools ..., ethos-u-vela ...)``."""
    from ..cache.toolchain import versions

    found = versions(("lowercache", "torch", "executorch", "tosa-tools", "ethos-u-vela"))
    return (f"lowercache {found['lowercache']} (torch {found['torch']}, executorch {found['executorch']}, "
            f"tosa-tools {found['tosa-tools']}, ethos-u-vela {found['ethos-u-vela']})")


def check_spelled(args: List[str]) -> List[str]:
    """``lower``'s bare ``--check`` as ``--check=outputs``: the option takes an optional value (``--check=layers``), and
    spelled so it never takes the next argument (a model path after it) for its value. Arguments after ``--`` are kept."""
    if "--" in args:
        split = args.index("--")
        return check_spelled(args[:split]) + args[split:]
    return ["--check=outputs" if a == "--check" else a for a in args]


def parse_run(args: List[str]) -> dict | None:
    """``run [--out DIR]... [--cache-dir DIR] [--remote URL] [--no-server] -- COMMAND...`` as keyword arguments, or None.

    None for anything the typer command should see: another option, a
    missing ``--`` or command, an empty value, a value option given twice.
    """
    if not args or args[0] != "run" or "--" not in args:
        return None
    split = args.index("--")
    options, argv = args[1:split], args[split + 1 :]
    if not argv:
        return None
    found: dict = {"argv": argv, "outs": [], "cache_dir": None, "remote": None, "no_server": False}
    i = 0
    while i < len(options):
        name, joined, value = options[i].partition("=")
        if name in _RUN_FLAGS and not joined:
            found[_RUN_FLAGS[name]] = True
            i += 1
            continue
        if name not in _RUN_VALUES:
            return None
        if not joined:  # ``--out DIR``, not ``--out=DIR``
            if i + 1 >= len(options):
                return None
            value = options[i + 1]
            i += 1
        i += 1
        if not value or value.startswith("-"):
            return None
        key = _RUN_VALUES[name]
        if key == "outs":
            found["outs"].append(value)
        elif found[key] is not None:
            return None
        else:
            found[key] = value
    return found


def run_light(argv: List[str], outs: List[str], cache_dir: str | None, remote: str | None, no_server: bool) -> int:
    """``lowercache run`` as the typer command runs it, with its one-line errors and exit code 2."""
    from ..errors import LowercacheError, show_warnings_in_one_line
    from ..shadowing import own_imports

    with own_imports():
        from ..run.launch import run_command

    show_warnings_in_one_line()
    try:
        return run_command(argv, outs, cache_dir=cache_dir, remote=remote, no_server=no_server)
    except LowercacheError as e:
        print(f"lowercache: error: {e}", file=sys.stderr)
        return 2


# What typer's first parse imports (pydantic), imported with the commands, blind to the user's modules. Not
# typer.rich_utils (help and usage errors only): an import every command would pay.
LAZY_IMPORTS = ("typer._adapters",)


def preload() -> None:
    """Import ``LAZY_IMPORTS`` (those this install has)."""
    import importlib

    for name in LAZY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def run_in_process(args: List[str]) -> object:
    """Run the command line with the typer commands in this process; its exit code. A server's child runs this too.

    The typer commands, and what typer's first parse and rich's output
    import, are imported blind to the user's modules (``shadowing.py``).
    """
    from ..shadowing import own_imports

    with own_imports():
        from .commands import run_in_process as run_commands

        preload()

    return run_commands(args)
