"""Every distribution whose code a lowering imports is in the key (``cache/toolchain.py``): by version, and the packages
that do the lowering by their sources too.

A fresh interpreter lowers a small model for each target family (the numerics check on, which runs the TOSA reference
model) and lists where every module it imported came from. A new dependency of torch, ExecuTorch, the Arm or XNNPACK
backend, Vela or lowercache fails here until it is named in ``STACK`` or in ``NOT_STACK`` with its reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from lowercache.cache import toolchain

CHILD = textwrap.dedent('''
    import importlib.metadata, json, os, sys, sysconfig, tempfile
    started = set(sys.modules)  # the interpreter's start-up (site's .pth files): the start-up state's, not the lowering's
    import torch
    import lowercache

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 4)).eval()
    inputs = (torch.randn(1, 3, 8, 8),)
    for target in ("ethos-u55-128", "xnnpack-int8"):
        lowercache.lower(net, inputs, target=target, cache_dir=tempfile.mkdtemp(), check=target.startswith("ethos"))
    stdlib = {os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib")}
    owners = importlib.metadata.packages_distributions()
    found = {}
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if name in started or not isinstance(where, str) or (where.startswith(tuple(stdlib)) and "-packages" not in where):
            continue
        top = name.split(".")[0]
        found[top] = owners.get(top) or owners.get(os.path.basename(os.path.dirname(where))) or [where]
    print(json.dumps(found))
''')


def test_every_distribution_a_lowering_imports_is_in_the_key(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**__import__("os").environ, "LOWERCACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    named = {"torch", "executorch", "tosa-tools", "ethos-u-vela", *toolchain.STACK, *toolchain.NOT_STACK}
    unnamed = {top: owners for top, owners in imported.items() if not set(owners) & named}
    assert unnamed == {}, "imported by a lowering, from distributions the key does not name"
    assert {"torch", "executorch", "torchao", "ethosu", "tosa_serializer"} <= set(imported)
    assert set(toolchain.HASHED_PACKAGES) - {"torchgen", "functorch"} <= set(imported)


def test_not_stack_says_why():
    assert all(reason.strip() for reason in toolchain.NOT_STACK.values())
    assert not set(toolchain.STACK) & set(toolchain.NOT_STACK)
