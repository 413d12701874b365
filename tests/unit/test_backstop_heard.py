"""What the backstop lets go untraced (``tracer.HEARD_DIRFD``): lowercache's own looks at and reads of absolute paths and
the import system's reads, which Python heard already, and nothing native code does unless it passes that very descriptor.

A process starts the real tracer and filter, turns recording on and makes
each kind of call on a file of its own; the tracer's report must name
exactly the calls it stopped for.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.quick

SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, sys
    from lowercache.record import backstop, places, recorder, tracer

    d = sys.argv[1]
    paths = {name: os.path.join(d, name) for name in ("native", "other_fd", "heard_fd", "os_stat", "os_lstat", "os_access",
                                                      "realpath", "opened", "relative", "heard_open", "module_.py",
                                                      "digested", "python_open")}
    for path in paths.values():
        open(path, "w").close()
    number = {spec[0]: nr for nr, spec in tracer.arch()[0].items()}
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(512)

    def fstatat(dirfd, path):
        assert libc.syscall(number["newfstatat"], ctypes.c_long(dirfd), path.encode(), buf, 0) == 0

    started = backstop.start()
    assert not isinstance(started, str), started
    recorder._install()  # the wrappers of os.stat and friends, and the import system's stat
    os.chdir(d)
    started.on()
    fstatat(-100, paths["native"])  # native code, AT_FDCWD
    fstatat(-5, paths["other_fd"])  # native code, a descriptor no process has: still traced
    fstatat(tracer.HEARD_DIRFD, paths["heard_fd"])
    os.stat(paths["os_stat"])
    os.lstat(paths["os_lstat"])
    os.access(paths["os_access"], os.R_OK)
    os.path.realpath(paths["realpath"])
    os.stat("relative")  # relative to the working directory: the descriptor matters, so traced
    fd = libc.syscall(number["openat"], ctypes.c_long(-5), paths["opened"].encode(), 0)  # native, another descriptor
    assert fd >= 0
    os.close(fd)
    fd = libc.syscall(number["openat"], ctypes.c_long(tracer.HEARD_DIRFD), paths["heard_open"].encode(), 0)
    assert fd >= 0
    os.close(fd)
    places.read_file(paths["digested"])  # a record's own read of an input, to digest it
    open(paths["python_open"], "rb").close()  # Python's open: heard by the audit hook, yet traced (the kernel's word)
    sys.path.insert(0, d)
    sys.dont_write_bytecode = True
    import module_  # the import system's stat and read of it, by absolute paths
    report = started.report()
    print(json.dumps(sorted(os.path.basename(p) for p in report["seen"] if p.startswith(d + os.sep))))
    """
)


def test_only_lowercaches_own_looks_at_absolute_paths_go_untraced(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["native", "opened", "other_fd", "python_open", "relative"]
