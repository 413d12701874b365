"""``lowercache run`` of a small script that reads a file and writes one: the project, the wrapped and the plain run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import os, sys
    data = open("in.txt").read()
    os.makedirs("out", exist_ok=True)
    with open(os.path.join("out", "result.txt"), "w") as f:
        f.write(data.upper() + sys.argv[1] + os.environ.get("GREETING", "-"))
    print("wrote", sys.argv[1])
    print("to stderr", file=sys.stderr)
    """
)


def project(tmp_path, script: str = SCRIPT):
    project = tmp_path / "project"
    project.mkdir()
    (project / "script.py").write_text(script)
    (project / "in.txt").write_text("abc")
    time.sleep(0.1)  # a file changed within 50 ms of a run is not trusted as an input
    return project


def run(project, cache_dir, *args, explain=False, env=None):
    flags = ["--explain"] if explain else []
    return subprocess.run(
        [sys.executable, "-m", "lowercache.cli", "run", *flags, "--", sys.executable, "script.py", *args],
        cwd=project, capture_output=True, env={**os.environ, "LOWERCACHE_DIR": str(cache_dir), **(env or {})}, timeout=120,
    )


def explain(project, cache_dir, *args) -> str:
    return run(project, cache_dir, *args, explain=True).stdout.decode()


def plain(project, *args, env=None):
    return subprocess.run([sys.executable, "script.py", *args], cwd=project, capture_output=True, env={**os.environ, **(env or {})},
                          timeout=120)


def replayed(project, cache_dir, env=None) -> None:
    """Run until the command is replayed (recorded, confirmed, replayed)."""
    for _ in range(3):
        assert run(project, cache_dir, env=env).returncode == 0
    assert "latest lookup: hit" in explain(project, cache_dir), explain(project, cache_dir)


def same_as_plain(project, cache_dir, env=None) -> str:
    """Run once more under lowercache, then plainly; both must write and print the same. What explain said."""
    served_run = run(project, cache_dir, env=env)
    explained = explain(project, cache_dir)
    served_file = (project / "out.txt").read_bytes()
    plain_run = plain(project, env=env)
    assert (served_run.returncode, served_run.stdout) == (plain_run.returncode, plain_run.stdout)
    assert served_file == (project / "out.txt").read_bytes(), explained
    return explained
