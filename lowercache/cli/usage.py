"""Whether typer would take a ``lower`` or ``verify`` command line, decided without importing typer.

A command line goes to the warm server only when it is well formed: a usage
error (an unknown option, an option without its value, a missing argument or
required option) is typer's to report, in this process, at once, and starts no
server (which would take seconds and stay behind). The table below is held to
the typer commands by ``tests/unit/test_usage.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

# The app's own options, before the command (``--version`` and completion answer without a command).
GLOBAL_FLAGS = frozenset({"--verbose", "-v"})


@dataclass(frozen=True)
class Usage:
    values: frozenset[str]  # options that take a value: ``--out DIR``, ``--out=DIR``, ``-o DIR``, ``-oDIR``
    flags: frozenset[str]  # options that take none
    required: tuple[frozenset[str], ...]  # each one required option, by all its spellings
    arguments: int  # positional arguments


_SHARED_VALUES = {"--target", "-t", "--cache-dir", "--calibration", "--remote", "--system-config", "--memory-mode"}
USAGES = {
    "lower": Usage(
        # ``--check`` alone is spelled ``--check=outputs`` before this table is asked (``cli.check_spelled``)
        values=frozenset(_SHARED_VALUES | {"--out", "-o", "--min-snr", "--check"}),
        flags=frozenset({"--no-cache", "--per-tensor", "--no-server", "--json", "--no-direct", "--help"}),
        required=(frozenset({"--target", "-t"}), frozenset({"--out", "-o"})),
        arguments=1,
    ),
    "verify": Usage(
        values=frozenset(_SHARED_VALUES),
        flags=frozenset({"--no-server", "--help"}),
        required=(frozenset({"--target", "-t"}),),
        arguments=1,
    ),
}


def well_formed(args: list[str]) -> bool:
    """Whether ``args`` (global flags, a command of :data:`USAGES`, its options and arguments) parse without a usage
    error. A value's type is not checked here: the command reports a bad one in its own words, wherever it runs."""
    return parse(args) is not None


@dataclass(frozen=True)
class Parsed:
    arguments: list[str]  # the positional ones: ``lower``'s MODEL
    values: dict[str, str]  # each option's value by the spelling given (``-t``, ``--target``), the last one given

    def value(self, *spellings: str) -> str | None:
        return next((self.values[s] for s in spellings if s in self.values), None)


def parse(args: list[str]) -> Parsed | None:
    """A well-formed command line's arguments and option values, or None for a usage error."""
    i = 0
    while i < len(args) and args[i] in GLOBAL_FLAGS:
        i += 1
    usage = USAGES.get(args[i]) if i < len(args) else None
    if usage is None:
        return None
    seen: set[str] = set()
    positional: list[str] = []
    values: dict[str, str] = {}
    rest = args[i + 1:]
    j = 0
    while j < len(rest):
        arg = rest[j]
        j += 1
        if arg == "--":
            positional += rest[j:]
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if name in usage.values:
                if not eq:
                    if j >= len(rest):
                        return None
                    value = rest[j]
                    j += 1
                values[name] = value
            elif name not in usage.flags or eq:
                return None
            seen.add(name)
        elif arg.startswith("-") and arg != "-":
            name = arg[:2]
            if name not in usage.values:
                return None
            value = arg[2:]
            if len(arg) == 2:
                if j >= len(rest):
                    return None
                value = rest[j]
                j += 1
            values[name] = value
            seen.add(name)
        else:
            positional.append(arg)
    if len(positional) != usage.arguments or not all(seen & spellings for spellings in usage.required):
        return None
    return Parsed(positional, values)


def input_problem(args: list[str]) -> str | None:
    """What is wrong with a well-formed ``lower`` or ``verify`` line's MODEL or target, found without importing torch
    (``precheck``): the one line the command prints for it. None when nothing is found, or the line is not well formed."""
    from ..precheck import problem

    parsed = parse(args)
    if parsed is None:
        return None
    return problem(parsed.arguments[0], parsed.value("--target", "-t") or "", parsed.value("--system-config"),
                   parsed.value("--memory-mode"))
