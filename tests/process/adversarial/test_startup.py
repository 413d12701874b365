"""The warm server answers only what the client's own interpreter would answer the same way (``lowercache/startup.py``).

Each case starts a server under one start-up state (hash seed, ``-O``, a
``.pth`` file's import finder, a module the server imported), changes it as a
user would, and compares what ``lower`` (and ``run``) serve with a fresh run
in a new process: ``--no-cache --no-server``, or plain ``python``. Each case's
two start-up states give different bytes when run fresh, so the comparison can
fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.server import Server


TARGET = "tosa-fp"

# A model whose bytes follow the hash seed (a set's order), -O (__debug__) and a module it imports (WIDTH).
MODEL = textwrap.dedent(
    """
    import torch
    import {module} as source

    WIDTH = getattr(source, "WIDTH", 8)

    NAMES = {{"alpha", "beta", "gamma", "delta", "epsilon"}}

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleDict({{n: torch.nn.Linear(WIDTH, WIDTH) for n in NAMES}})

        def forward(self, x):
            for layer in self.layers.values():
                x = torch.relu(layer(x))
            return x * (2.0 if __debug__ else 3.0)

    def model():
        return M().eval(), (torch.randn(1, WIDTH),)
    """
)


def lower(server: Server, out: Path, *flags: str, python: tuple[str, ...] = (sys.executable,), **env: str) -> bytes:
    """``lowercache lower`` of the project's model as a new process; the .pte it wrote."""
    result = subprocess.run([*python, "-m", "lowercache.cli", "lower", "model.py:model", "-t", TARGET, "-o", str(out), *flags],
                            cwd=server.project, env={**server.env, **env}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return (out / "model.pte").read_bytes()


def fresh(server: Server, out: Path, **env: str) -> bytes:
    return lower(server, out, "--no-cache", "--no-server", **env)


def project(server: Server, module: str = "widths", width: int = 8) -> None:
    (server.project / "model.py").write_text(MODEL.format(module=module))
    (server.project / f"{module}.py").write_text(f"WIDTH = {width}\n")


def test_a_client_under_another_hash_seed_gets_its_own_seeds_bytes(own, tmp_path):
    server = own(PYTHONHASHSEED="1")
    project(server)
    server.start()
    assert fresh(server, tmp_path / "f1") != fresh(server, tmp_path / "f2", PYTHONHASHSEED="2")  # the seed shapes the bytes
    for run in range(3):  # the server's answer, then a record's (a direct-mode hit is tried from the second run on)
        assert lower(server, tmp_path / f"s{run}", PYTHONHASHSEED="2") == (tmp_path / "f2" / "model.pte").read_bytes(), run
    assert lower(server, tmp_path / "one", PYTHONHASHSEED="1") == (tmp_path / "f1" / "model.pte").read_bytes()
    assert server("server", "stop").returncode == 0
    assert lower(server, tmp_path / "alone", "--no-server", PYTHONHASHSEED="2") == (tmp_path / "f2" / "model.pte").read_bytes()


def test_optimize_by_variable_or_flag_gets_optimized_bytes(own, tmp_path):
    server = own(PYTHONHASHSEED="0")  # the model's bytes follow the seed: a random one would differ run to run
    project(server)
    server.start()
    plain = fresh(server, tmp_path / "plain")
    optimized = fresh(server, tmp_path / "optimized", PYTHONOPTIMIZE="1")
    assert plain != optimized
    assert lower(server, tmp_path / "a") == plain
    for run in range(2):
        assert lower(server, tmp_path / f"v{run}", PYTHONOPTIMIZE="1") == optimized, run
    for run in range(2):
        assert lower(server, tmp_path / f"o{run}", python=(sys.executable, "-O")) == optimized, run
    assert lower(server, tmp_path / "b") == plain


# A vendored tabulate: the installed one's functions (lowercache's flow uses them too), and a WIDTH of its own.
VENDORED_TABULATE = textwrap.dedent(
    """
    import importlib.util, os, sys, sysconfig
    _path = os.path.join(sysconfig.get_paths()["purelib"], "tabulate", "__init__.py")
    _spec = importlib.util.spec_from_file_location("_installed_tabulate", _path)
    _installed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_installed)
    globals().update({k: v for k, v in vars(_installed).items() if not k.startswith("__")})
    WIDTH = 16
    """
)


def test_a_module_on_the_search_path_that_would_shadow_the_servers_runs_in_process(own, tmp_path):
    """``python -m lowercache.cli`` searches the working directory first: its ``tabulate.py`` wins in a new process,
    where the server had imported the installed tabulate (ExecuTorch's devtools use it) before the child ran."""
    server = own(PYTHONHASHSEED="0")
    project(server, module="tabulate")
    (server.project / "tabulate.py").write_text(VENDORED_TABULATE)
    server.start()
    mine = fresh(server, tmp_path / "mine")
    (server.project / "tabulate.py").rename(server.project / "aside.py")
    installed = fresh(server, tmp_path / "installed")
    (server.project / "aside.py").rename(server.project / "tabulate.py")
    assert mine != installed
    for run in range(3):
        assert lower(server, tmp_path / f"served{run}") == mine, run
    result = server("lower", "model.py:model", "-t", TARGET, "-o", tmp_path / "again", LOWERCACHE_DIRECT="0")
    assert "tabulate.py would shadow a module the server imported" in result.stderr


@pytest.fixture
def user_site(tmp_path):
    """A HOME whose user site-packages holds an editable install's ``.pth`` and finder, as ``pip install -e`` writes them."""
    home = tmp_path / "home"
    site_dir = home / ".local" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site_dir.mkdir(parents=True)
    for checkout, width in (("one", 8), ("two", 16)):
        package = tmp_path / checkout / "widthpkg"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"WIDTH = {width}\n")

    def point_to(checkout: str) -> None:
        finder = textwrap.dedent(
            f"""
            import importlib.machinery, importlib.util, sys
            MAPPING = {{"widthpkg": {str(tmp_path / checkout / "widthpkg")!r}}}

            class _EditableFinder:
                @classmethod
                def find_spec(cls, fullname, path=None, target=None):
                    if fullname in MAPPING:
                        return importlib.util.spec_from_file_location(fullname, MAPPING[fullname] + "/__init__.py")
                    return None

            def install():
                if not any(getattr(f, "__name__", "") == "_EditableFinder" for f in sys.meta_path):
                    sys.meta_path.append(_EditableFinder)
            """
        )
        (site_dir / "__editable___widthpkg_0_1_finder.py").write_text(finder)

    (site_dir / "__editable__.widthpkg-0.1.pth").write_text("import __editable___widthpkg_0_1_finder; __editable___widthpkg_0_1_finder.install()\n")
    point_to("one")
    return home, point_to


def test_an_editable_install_pointed_at_another_checkout_is_seen(own, tmp_path, user_site):
    home, point_to = user_site
    server = own(HOME=str(home), PYTHONHASHSEED="0")
    project(server, module="widthpkg")
    (server.project / "widthpkg.py").unlink()  # found through the finder only
    server.start()
    first = fresh(server, tmp_path / "first")
    for run in range(3):  # the third is a direct-mode hit
        assert lower(server, tmp_path / f"a{run}") == first, run
    point_to("two")
    second = fresh(server, tmp_path / "second")
    assert second != first
    for run in range(3):
        assert lower(server, tmp_path / f"b{run}") == second, run


def test_a_module_the_server_imported_at_start_edited_in_place_replaces_it(own, tmp_path):
    """A ``sitecustomize`` on PYTHONPATH runs in every interpreter's start, the server's too; edited, a new one must run."""
    vendored = tmp_path / "vendored"
    vendored.mkdir()
    (vendored / "sitecustomize.py").write_text("import builtins\nbuiltins.LOWERCACHE_TEST_WIDTH = 8\n")
    (vendored / "startwidth.py").write_text("import builtins\nWIDTH = builtins.LOWERCACHE_TEST_WIDTH\n")
    server = own(PYTHONHASHSEED="0")
    server.env["PYTHONPATH"] += os.pathsep + str(vendored)
    project(server, module="startwidth")
    (server.project / "startwidth.py").unlink()
    pid = server.start()
    first = fresh(server, tmp_path / "first")
    assert lower(server, tmp_path / "a") == first
    (vendored / "sitecustomize.py").write_text("import builtins\nbuiltins.LOWERCACHE_TEST_WIDTH = 16\n")
    second = fresh(server, tmp_path / "second")
    assert second != first
    for run in range(3):
        assert lower(server, tmp_path / f"b{run}") == second, run
    assert server.status()["pid"] != str(pid)


def test_run_under_another_start_up_state_stands_in_under_that_state(own, tmp_path):
    """``lowercache run``'s command gets a server started under its own variables (here PYTHONHASHSEED, PYTHONOPTIMIZE)."""
    server = own()
    server.start()
    (server.project / "hashes.py").write_text("print(hash('lowercache'), __debug__)\n")
    for env in ({"PYTHONHASHSEED": "7"}, {"PYTHONHASHSEED": "8"}, {"PYTHONHASHSEED": "8", "PYTHONOPTIMIZE": "1"}):
        plain = subprocess.run([sys.executable, "hashes.py"], cwd=server.project, capture_output=True, env={**server.env, **env})
        for run in range(3):  # a new record, its confirmation, a replay
            served = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--", sys.executable, "hashes.py"],
                                    cwd=server.project, capture_output=True, env={**server.env, **env}, timeout=600)
            assert (served.returncode, served.stdout) == (0, plain.stdout), (env, run, served.stderr[-2000:])


def test_one_interpreter_under_two_names_shares_one_server(own, tmp_path):
    """``python`` and ``python3.11`` of one environment (the ``lowercache`` script's shebang names the latter) are one
    interpreter: neither replaces the other's server (a replacement costs a warm-up, 10 s or more)."""
    here = Path(sys.executable)
    names = [here.with_name(f"python3.{sys.version_info.minor}"), here.with_name("python3")]
    if sys.prefix == sys.base_prefix:  # in a virtual environment the real path is the base interpreter's, elsewhere
        names.append(Path(os.path.realpath(sys.executable)))
    real = next((str(name) for name in names if name.exists() and str(name) != sys.executable), None)
    if real is None:
        pytest.skip("this interpreter has no second name here")
    server = own()
    pid = server.start()
    status = subprocess.run([real, "-m", "lowercache.cli", "server", "status"], cwd=server.project, env=server.env,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and f"pid {pid}" in status.stdout and "current" in status.stdout, status.stdout
