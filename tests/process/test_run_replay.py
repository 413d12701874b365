"""``lowercache run``'s command-level replay (lowercache/run/replay.py), on small scripts without torch.

Each run is a real ``lowercache run`` process wrapping a real Python process;
the assertions are on the files written, the output, the exit code and what
``lowercache run --explain`` says.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from lowercache.cache.store import Store
from lowercache.run.replay import Command

from tests.helpers import replay


@pytest.mark.quick
def test_an_unchanged_command_is_replayed_with_its_files_and_output(tmp_path, cache_dir):
    project = replay.project(tmp_path)
    plain = replay.plain(project, "X")
    expected = (project / "out" / "result.txt").read_bytes()
    (project / "out" / "result.txt").unlink()
    runs = [replay.run(project, cache_dir, "X") for _ in range(3)]
    for result in runs:
        assert (result.returncode, result.stdout, result.stderr) == (0, plain.stdout, plain.stderr)
    assert "hit: replayed 1 files" in replay.explain(project, cache_dir, "X")  # the third run: the second confirmed the record
    assert (project / "out" / "result.txt").read_bytes() == expected
    counters = Store(cache_dir).counters()
    assert counters.get("count/run/hit") == 1 and counters.get("count/run/miss") == 2

    # replay writes the file even when it is gone, with the mode the command left it
    (project / "out" / "result.txt").unlink()
    assert replay.run(project, cache_dir, "X").returncode == 0
    assert (project / "out" / "result.txt").read_bytes() == expected
    assert "hit" in replay.explain(project, cache_dir, "X")
    assert os.stat(project / "out" / "result.txt").st_mode & 0o777 == 0o666 & ~_umask()

    # an input file changed: the command runs
    (project / "in.txt").write_text("abd")
    time.sleep(0.1)
    assert replay.run(project, cache_dir, "X").returncode == 0
    assert (project / "out" / "result.txt").read_text() == "ABDX-"
    assert "in.txt changed" in replay.explain(project, cache_dir, "X")


def _hits(cache_dir) -> int:
    store = Store(cache_dir)
    try:
        return store.counters().get("count/run/hit", 0)
    finally:
        store.close()


def _same_as_plain(project, cache_dir, served: bool, env=None) -> bytes:
    """``lowercache run`` of ``script.py X``, then a plain run: the same exit, output and file; whether the first was
    replayed (``served``). The file's bytes."""
    before = _hits(cache_dir)
    result = replay.run(project, cache_dir, "X", env=env)
    wrote = (project / "out" / "result.txt").read_bytes()
    plain = replay.plain(project, "X", env=env)
    assert (result.returncode, result.stdout, result.stderr) == (0, plain.stdout, plain.stderr)
    assert wrote == (project / "out" / "result.txt").read_bytes()
    assert _hits(cache_dir) == before + served, replay.explain(project, cache_dir, "X")
    return wrote


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_another_argument_or_variable_runs_the_command(tmp_path, cache_dir):
    project = replay.project(tmp_path)
    for _ in range(3):
        replay.run(project, cache_dir, "X")
    assert replay.run(project, cache_dir, "Y").returncode == 0
    assert (project / "out" / "result.txt").read_text() == "ABCY-"
    assert "no record" not in replay.explain(project, cache_dir, "Y") and "hit" not in replay.explain(project, cache_dir, "Y")
    assert replay.run(project, cache_dir, "X", env={"GREETING": "hi"}).returncode == 0
    assert (project / "out" / "result.txt").read_text() == "ABCXhi"
    assert "environment variable GREETING differs from the record's" in replay.explain(project, cache_dir, "X")


@pytest.mark.parametrize(
    "body, reason",
    [
        ("open('log.txt', 'a').write('x')\nprint(open('log.txt').read())", "log.txt, which it also wrote"),
        ("import subprocess\nsubprocess.run(['true'])", "ran a process"),
        ("import socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', 9))\nexcept OSError:\n    pass", "used the network"),
        ("import sys\nsys.stdin.read()", "read standard input"),
        ("try:\n    input()\nexcept EOFError:\n    pass", "read standard input"),
        ("open({outside!r}, 'w').write('x')", "outside the working directory"),
    ],
    ids=["reads-what-it-writes", "subprocess", "network", "stdin", "input", "writes-outside"],
)
def test_a_command_no_record_can_describe_runs_every_time(tmp_path, cache_dir, body, reason):
    outside = tmp_path / "elsewhere.txt"
    project = replay.project(tmp_path, body.format(outside=str(outside)) + "\nprint('done')\n")
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "lowercache.cli", "run", "--", sys.executable, "script.py"], cwd=project, capture_output=True,
            stdin=subprocess.DEVNULL, env={**os.environ, "LOWERCACHE_DIR": str(cache_dir)}, timeout=120,
        )
        assert result.returncode == 0 and result.stdout.endswith(b"done\n"), result.stderr
    explained = replay.explain(project, cache_dir)
    assert "latest record: none: the command" in explained and reason in explained
    assert Store(cache_dir).counters().get("count/run/hit") is None


def test_a_directory_outside_that_exists_already_is_no_write(tmp_path, cache_dir):
    """``os.makedirs(d, exist_ok=True)`` outside the working directory: the run that makes ``d`` cannot be recorded, a
    run that finds it there changes nothing. Torch's ``cache_dir()`` does this for ``TORCHINDUCTOR_CACHE_DIR`` in every
    process once one has lowered, and no command run with that variable set was ever recorded."""
    elsewhere, scratch = tmp_path / "torch-cache", tmp_path / "scratch"  # not under the temporary directory
    scratch.mkdir()
    project = replay.project(tmp_path, f"import os\nos.makedirs({str(elsewhere)!r}, exist_ok=True)\nprint('done')\n")
    assert replay.run(project, cache_dir, env={"TMPDIR": str(scratch)}).stdout == b"done\n"
    assert f"wrote {elsewhere}, outside the working directory" in replay.explain(project, cache_dir)
    for _ in range(3):
        assert replay.run(project, cache_dir, env={"TMPDIR": str(scratch)}).stdout == b"done\n"
    assert "hit: replayed" in replay.run(project, cache_dir, explain=True, env={"TMPDIR": str(scratch)}).stdout.decode()


def test_a_failing_command_passes_its_exit_code_and_error_through(tmp_path, cache_dir):
    project = replay.project(tmp_path, "import sys\nprint('partial')\nraise SystemExit('broken: ' + sys.argv[1])\n")
    plain = replay.plain(project, "now")
    for _ in range(3):
        result = replay.run(project, cache_dir, "now")
        assert (result.returncode, result.stdout, result.stderr) == (plain.returncode, plain.stdout, plain.stderr) == (1, b"partial\n", b"broken: now\n")
    assert "the command exited with 1" in replay.explain(project, cache_dir, "now")


def test_a_command_whose_output_changes_between_identical_runs_is_never_replayed(tmp_path, cache_dir):
    project = replay.project(tmp_path, "import time\nopen('stamp.txt', 'w').write(str(time.time_ns()))\n")
    for _ in range(3):
        assert replay.run(project, cache_dir).returncode == 0
    assert "latest record: untrusted: identical inputs wrote different files" in replay.explain(project, cache_dir)


def test_a_damaged_stored_output_is_not_replayed(tmp_path, cache_dir):
    project = replay.project(tmp_path)
    for _ in range(2):
        replay.run(project, cache_dir, "X")
    store = Store(cache_dir)
    [(kind, key)] = [a for a in store.actions() if a[0] == "run"]
    entry = store.get(kind, key)
    for output in entry.meta["outputs"]:
        if output["kind"] == "file":
            output["digest"] = "0" * 32
    store.put(kind, key, entry)
    store.close()
    assert replay.run(project, cache_dir, "X").returncode == 0
    assert "a stored output is missing or damaged" in replay.explain(project, cache_dir, "X")
    assert (project / "out" / "result.txt").read_text() == "ABCX-"


def test_inputs_run_before_are_replayed_from_an_earlier_record(tmp_path, cache_dir):
    """An edit undone: the confirmed record of the inputs before it answers with what a plain run writes and prints; a
    damaged earlier record answers nothing, and inputs never run before run."""
    project = replay.project(tmp_path)
    for _ in range(3):
        assert replay.run(project, cache_dir, "X").returncode == 0

    def edit(text: str) -> None:
        (project / "in.txt").write_text(text)
        time.sleep(0.1)

    def served_as_plain(text: str, served: bool) -> str:
        edit(text)
        assert _same_as_plain(project, cache_dir, served) == text.upper().encode() + b"X-"
        return replay.explain(project, cache_dir, "X")

    assert "latest record: unconfirmed" in served_as_plain("abd", served=False)
    assert "hit: replayed 1 files and the output from an earlier record" in served_as_plain("abc", served=True)
    assert "latest record: confirmed" in served_as_plain("abd", served=False)
    assert "from its record" in served_as_plain("abd", served=True)
    assert "from an earlier record" in served_as_plain("abc", served=True)
    assert "from its record" in served_as_plain("abd", served=True)

    store = Store(cache_dir)
    latest = Command([sys.executable, "script.py", "X"], cwd=str(project)).key()
    [(kind, key)] = [a for a in store.actions() if a[0] == "run" and a[1] != latest]
    entry = store.get(kind, key)
    entry.blobs[next(o["blob"] for o in entry.meta["outputs"] if o["kind"] == "file")] = b"ABZX-"
    store.put(kind, key, entry)
    store.close()
    assert "1 earlier record did not answer either (the newest: a stored output is missing or damaged)" in served_as_plain(
        "abc", served=False)
    assert "did not answer either (the newest: in.txt changed)" in served_as_plain("abe", served=False)


def test_a_variable_changed_and_set_back_is_replayed_from_the_earlier_record(tmp_path, cache_dir):
    """The earlier-record rule over the environment: the record of the first value answers again (with a variable that
    only says how output is shown set too), and a value no record has seen runs the command."""
    project = replay.project(tmp_path)
    for env in ({"GREETING": "hi"}, {"GREETING": "yo"}):  # each recorded, then confirmed
        _same_as_plain(project, cache_dir, False, env)
        _same_as_plain(project, cache_dir, False, env)
    _same_as_plain(project, cache_dir, True, {"GREETING": "hi"})
    _same_as_plain(project, cache_dir, True, {"GREETING": "hi", "COLUMNS": "80", "LINES": "24"})
    _same_as_plain(project, cache_dir, True, {"GREETING": "yo"})
    _same_as_plain(project, cache_dir, False, {"GREETING": "hey"})
    assert (project / "out" / "result.txt").read_text() == "ABCXhey"


def test_files_written_into_an_out_directory_are_replayed(tmp_path, cache_dir):
    elsewhere = tmp_path / "artifacts"
    project = replay.project(tmp_path, f"open({str(elsewhere / 'model.bin')!r}, 'wb').write(b'\\x00\\x01' * 3)\n")
    elsewhere.mkdir()
    env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir)}
    command = [sys.executable, "-m", "lowercache.cli", "run", "--out", str(elsewhere), "--", sys.executable, "script.py"]
    for _ in range(3):
        assert subprocess.run(command, cwd=project, env=env, capture_output=True, timeout=120).returncode == 0
        (elsewhere / "model.bin").unlink()
    assert subprocess.run(command, cwd=project, env=env, capture_output=True, timeout=120).returncode == 0
    assert (elsewhere / "model.bin").read_bytes() == b"\x00\x01" * 3
    assert Store(cache_dir).counters().get("count/run/hit") == 2


REMOTE_SCRIPT = textwrap.dedent(
    """
    from lowercache.cache.tiers import open_store
    from lowercache.config import load_settings

    store = open_store(load_settings())
    store.get("tosa", "0" * 32)  # as the Arm hook asks the shared tier: a miss, over the network
    store.close()
    open("result.txt", "w").write(open("in.txt").read())
    print("asked", type(store).__name__)
    """
)


def test_the_caches_own_remote_traffic_does_not_stop_a_record(tmp_path, cache_dir, redis_url, raw_redis):
    """A wrapped process's calls to the shared tier are the cache's, not the command's: recorded, then replayed.

    Its own network use still refuses (the ``network`` case above).
    """
    project = replay.project(tmp_path, REMOTE_SCRIPT)
    env = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": "k" * 32}
    runs = [replay.run(project, cache_dir, env=env) for _ in range(3)]
    assert all(r.returncode == 0 and r.stdout == b"asked TieredStore\n" for r in runs), runs[-1].stderr
    assert raw_redis.info("stats")["keyspace_misses"] >= 2  # the two runs that ran asked the remote
    explained = replay.explain(project, cache_dir)
    assert "hit: replayed 1 files" in explained, explained
    assert (project / "result.txt").read_text() == "abc"


def test_another_name_of_lowercaches_interpreter_is_replayed(tmp_path, cache_dir):
    """``python3 script.py`` when lowercache runs on ``python`` (or the reverse): one interpreter, so the command is replayed."""
    here = os.path.dirname(sys.executable)
    names = [f"python{v}" for v in ("", "3", f"3.{sys.version_info.minor}")]
    alias = next((os.path.join(here, n) for n in names if os.path.join(here, n) != sys.executable
                  and os.path.realpath(os.path.join(here, n)) == os.path.realpath(sys.executable)), None)
    if alias is None:
        pytest.skip("no other name of this interpreter in its directory")
    project = replay.project(tmp_path)
    env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir)}
    for _ in range(3):
        result = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--", alias, "script.py", "X"], cwd=project,
                                capture_output=True, env=env, timeout=120)
        assert result.returncode == 0 and (project / "out" / "result.txt").read_text() == "ABCX-"
    explained = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--explain", "--", alias, "script.py", "X"],
                               cwd=project, capture_output=True, env=env, timeout=120).stdout.decode()
    assert "latest lookup: hit" in explained, explained


def _fake_pyenv(tmp_path, interpreter: str):
    """A pyenv laid out as pyenv lays itself out: a shim handing over to ``libexec/pyenv``, which picks ``interpreter``."""
    root = tmp_path / "pyenv"
    (root / "shims").mkdir(parents=True)
    (root / "libexec").mkdir()
    shim = root / "shims" / "python"
    shim.write_text(
        "#!/usr/bin/env bash\nset -e\n\nprogram=\"${0##*/}\"\n\n"
        f'export PYENV_ROOT="{root}"\n'
        f'exec "{root}/libexec/pyenv" exec "$program" "$@"\n'
    )
    pyenv = root / "libexec" / "pyenv"
    pyenv.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = which ]; then echo "{interpreter}"; exit 0; fi\n'
        f'shift 2; exec "{sys.executable}" "$@"\n'
    )
    for f in (shim, pyenv):
        f.chmod(0o755)
    return {"PATH": f"{root / 'shims'}{os.pathsep}{os.environ['PATH']}"}


def _run_shim(project, cache_dir, env, explain=False):
    return subprocess.run(
        [sys.executable, "-m", "lowercache.cli", "run", *(["--explain"] if explain else []), "--", "python", "script.py", "X"],
        cwd=project, capture_output=True, env={**os.environ, "LOWERCACHE_DIR": str(cache_dir), **env}, timeout=120,
    )


def test_a_pyenv_shim_that_starts_lowercaches_python_is_replayed(tmp_path, cache_dir):
    project = replay.project(tmp_path)
    env = _fake_pyenv(tmp_path, sys.executable)
    runs = [_run_shim(project, cache_dir, env) for _ in range(3)]
    assert all(r.returncode == 0 and r.stdout == b"wrote X\n" for r in runs), runs[-1].stderr
    assert "hit: replayed 1 files" in _run_shim(project, cache_dir, env, explain=True).stdout.decode()
    assert Store(cache_dir).counters().get("count/run/hit") == 1


def test_a_pyenv_shim_that_would_start_another_python_runs_every_time(tmp_path, cache_dir):
    project = replay.project(tmp_path)
    env = _fake_pyenv(tmp_path, "/usr/bin/python3-elsewhere")
    runs = [_run_shim(project, cache_dir, env) for _ in range(3)]
    assert all(r.returncode == 0 and r.stdout == b"wrote X\n" for r in runs), runs[-1].stderr
    assert "lowercache's own Python" in _run_shim(project, cache_dir, env, explain=True).stdout.decode()
    assert Store(cache_dir).counters().get("count/run/hit") is None


@pytest.mark.parametrize(
    "args, parsed",
    [
        (["run", "--", "python", "x.py", "--", "-v"], {"argv": ["python", "x.py", "--", "-v"], "outs": [], "cache_dir": None, "remote": None, "no_server": False}),
        (["run", "--out", "a", "--out=b", "--cache-dir=c", "--remote", "redis://h:1/0", "--no-server", "--", "python", "x.py"],
         {"argv": ["python", "x.py"], "outs": ["a", "b"], "cache_dir": "c", "remote": "redis://h:1/0", "no_server": True}),
        (["run", "--explain", "--", "python", "x.py"], None),  # the typer command's, as is every other option
        (["-v", "run", "--", "python", "x.py"], None),
        (["run", "python", "x.py"], None),  # no "--"
        (["run", "--"], None),
        (["run", "--cache-dir", "a", "--cache-dir", "b", "--", "python"], None),
        (["run", "--out", "--", "python"], None),
        (["run", "--no-server=1", "--", "python"], None),
    ],
)
def test_the_light_path_takes_only_the_usual_run_command_lines(args, parsed):
    """``run`` skips typer (0.13 s of imports and parsing) only for command lines it reads exactly as typer would."""
    from lowercache.cli import parse_run

    assert parse_run(args) == parsed


def test_the_light_path_and_the_typer_command_give_the_same_errors(tmp_path, cache_dir):
    """``-v`` sends ``run`` to the typer command; both report a bad setting or a command that cannot start in one line."""
    project = replay.project(tmp_path)
    cases = [("./no-such-program", {}, b"lowercache: error: cannot run ./no-such-program: No such file or directory\n"),
             (sys.executable, {"LOWERCACHE_MAX_SIZE": "lots"}, b"lowercache: error: bad size 'lots'")]
    for program, env, expected in cases:
        results = []
        for front in ([], ["-v"]):
            argv = [*front, "run", "--cache-dir", str(cache_dir), "--", program, "script.py", "X"]
            results.append(subprocess.run([sys.executable, "-m", "lowercache.cli", *argv], cwd=project, capture_output=True,
                                          env={**os.environ, **env}, timeout=120))
        light, typed = results
        assert light.returncode == typed.returncode == 2 and light.stdout == typed.stdout == b""
        assert light.stderr == typed.stderr and light.stderr.startswith(expected) and len(light.stderr.splitlines()) == 1
    assert not (project / "out").exists()


LOWERCACHE_INSIDE = textwrap.dedent(
    """
    from lowercache.cache import toolchain
    toolchain.versions(("xxhash",))  # as lowercache's hooks do in a lowering: it stats every sys.path entry
    with open("result.txt", "w") as f:  # in the script's directory, which a replay writes into atomically
        f.write(open("in.txt").read().upper())
    """
)


def test_lowercaches_own_stats_in_the_command_are_no_input(tmp_path, cache_dir):
    """lowercache's toolchain memo stats the script's directory inside the command; heard, that directory's mtime was an
    input, and the replay's atomic write into it made every other run miss."""
    project = replay.project(tmp_path, LOWERCACHE_INSIDE)
    outcomes = []
    for _ in range(4):
        assert replay.run(project, cache_dir).returncode == 0
        outcomes.append(replay.explain(project, cache_dir).splitlines()[0])
    assert [o.startswith("latest lookup: hit") for o in outcomes] == [False, False, True, True], outcomes
    assert (project / "result.txt").read_text() == "ABC"
