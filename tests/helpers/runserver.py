"""``lowercache run`` through a real server (the ``run_server`` fixture): run, explain, and a command run both ways."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .server import WAIT, Server


def run(server: Server, project: Path, *argv: str, flags: tuple[str, ...] = (), stdin: bytes = b"", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowercache.cli", "run", *flags, "--", *argv], cwd=project, input=stdin,
                          env={**server.env, **env}, capture_output=True, timeout=WAIT, umask=0o027)


def explain(server: Server, project: Path, *argv: str) -> str:
    return run(server, project, *argv, flags=("--explain",)).stdout.decode()


def both(server: Server, project: Path, *argv: str, outputs: tuple[str, ...] = (), **kwargs) -> list[tuple]:
    """The command as a new process, then through the server: (status, stdout, stderr, {file: (bytes, mode)}) for each."""
    seen = []
    for flags in (("--no-server",), ()):
        result = run(server, project, *argv, flags=flags, **kwargs)
        files = {}
        for name in outputs:
            path = project / name
            files[name] = (path.read_bytes(), path.stat().st_mode & 0o777)
            path.unlink()
        seen.append((result.returncode, result.stdout, result.stderr, files))
    return seen


def project_with(tmp_path: Path, files: dict[str, str]) -> Path:
    project = tmp_path / "project"
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    return project
