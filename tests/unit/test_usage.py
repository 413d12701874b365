"""The client's table of ``lower``'s and ``verify``'s options, held to the typer commands: the lines it calls well
formed are the lines typer parses, so a usage error is typer's to report in the process, and a good line still goes
to the warm server."""

from __future__ import annotations

import pytest
import typer
from typer.core import TyperArgument, TyperOption

from lowercache.cli import check_spelled
from lowercache.cli.commands import app
from lowercache.cli.usage import GLOBAL_FLAGS, USAGES, well_formed
from lowercache.client import SERVED

LOWER = ["lower", "m.py:model", "-t", "ethos-u55-128", "-o", "out"]
VERIFY = ["verify", "m.py:model", "-t", "ethos-u55-128"]
EVERY_LOWER_OPTION = ["--cache-dir", "c", "--no-cache", "--calibration", "cal.pt", "--per-tensor", "--remote", "redis://h:1/0",
                      "--no-server", "--json", "--no-direct", "--system-config", "S", "--memory-mode", "M", "--check=layers",
                      "--min-snr", "20"]
LINES = [
    LOWER, ["-v", *LOWER], ["--verbose", *LOWER], [*LOWER, *EVERY_LOWER_OPTION], [*LOWER, "--check"],
    ["lower", "--out=out", "--target=ethos-u55-128", "m.py:model"], ["lower", "-oout", "-tethos-u55-128", "m.py:model"],
    ["lower", "-t", "ethos-u55-128", "-o", "out", "--", "-model.py:model"], ["lower", "-", "-t", "x", "-o", "o"],
    [*LOWER, "-t", "tosa-INT"], [*LOWER, "--min-snr", "-3"],
    [*LOWER, "-v"], [*LOWER, "--verbose"], [*LOWER, "--bogus"], [*LOWER, "-x"], [*LOWER, "--json=1"], [*LOWER, "--out"],
    [*LOWER, "-o"], [*LOWER, "extra.py:model"], ["lower", "-t", "x", "-o", "o"], ["lower", "m.py:model", "-t", "x"],
    ["lower", "m.py:model", "-o", "o"], ["lower"], [*LOWER, "--version"], [*LOWER, "--", "second"],
    VERIFY, ["-v", *VERIFY], [*VERIFY, "--cache-dir", "c", "--calibration", "c.pt", "--remote", "r", "--no-server",
                                     "--system-config", "S", "--memory-mode", "M"],
    [*VERIFY, "-o", "out"], [*VERIFY, "--json"], ["verify", "m.py:model"], ["verify", "-t", "x"], [*VERIFY, "-v"],
]


# typer's click (a vendored copy in typer >= 0.20): its usage error is the base of typer's BadParameter
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _group():
    return typer.main.get_command(app)


def typer_takes(args: list[str]) -> bool:
    """Whether typer's parser takes ``args`` (the group's options, the command, its parameters), running nothing."""
    group = _group()
    try:
        with group.make_context("lowercache", list(args), resilient_parsing=False) as ctx:
            protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args  # click >= 8.2
            name, command, rest = group.resolve_command(ctx, [*protected, *ctx.args])
            command.make_context(name, rest, parent=ctx).close()
    except UsageError:
        return False
    return True


def test_the_table_holds_every_option_of_each_served_command_as_typer_declares_it():
    assert set(USAGES) == set(SERVED)
    group = _group()
    assert GLOBAL_FLAGS == {o for p in group.params if p.name == "verbose" for o in p.opts + p.secondary_opts}
    for name, usage in USAGES.items():
        params = group.commands[name].params
        options = [p for p in params if isinstance(p, TyperOption)]
        assert all(isinstance(p, (TyperOption, TyperArgument)) and p.nargs == 1 and not p.multiple for p in params), name
        spellings = lambda p: set(p.opts + p.secondary_opts)  # noqa: E731
        assert usage.flags == {o for p in options if p.is_flag for o in spellings(p)} | {"--help"}, name
        assert usage.values == {o for p in options if not p.is_flag for o in spellings(p)}, name
        assert set(usage.required) == {frozenset(spellings(p)) for p in options if p.required}, name
        assert usage.arguments == sum(1 for p in params if isinstance(p, TyperArgument)), name


@pytest.mark.parametrize("args", LINES, ids=" ".join)
def test_a_line_is_well_formed_exactly_when_typer_parses_it(args):
    spelled = check_spelled(args)  # as dispatch hands lower's lines on
    assert well_formed(spelled) == typer_takes(spelled)


def test_the_lines_cover_both_answers_for_both_commands():
    answers = {(args[args[0] in GLOBAL_FLAGS], typer_takes(check_spelled(args))) for args in LINES}
    assert answers == {("lower", True), ("lower", False), ("verify", True), ("verify", False)}
