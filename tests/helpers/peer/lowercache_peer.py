"""A pytest plugin for the peer tier (``tests/helpers/optests.py``), loaded with ``-p lowercache_peer`` into ExecuTorch's own
backend tests, the same in the stock run and under ``lowercache run``.

It records the digest of every delegate payload a test makes: each ``LoweredBackendModule`` ExecuTorch builds from a
``preprocess`` result (its ``processed_bytes`` and the named data it hands the .pte), as one JSON line per payload in the
file ``LOWERCACHE_PEER_DIGESTS`` names, under the test's id. Wrapping the module's constructor reads what the backend
(or lowercache's cached step) returned, after every backend hook, and changes no byte.

It also seeds torch's generator before collection and before each test: the tests draw their inputs unseeded, so
without a seed no two processes lower the same random data. With it, a test lowers the same inputs in every run, stock
or not, so its payloads can be compared.
"""

from __future__ import annotations

import hashlib
import json
import os

SEED = 0
_current = {"test": ""}


def _digest(data: bytes) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def _record(path: str, backend_id: str, processed_bytes: bytes, data_store_output) -> None:
    data = [] if data_store_output is None else [_digest(buffer) for buffer in data_store_output.buffers]
    row = {"test": _current["test"], "backend": backend_id, "payload": _digest(processed_bytes), "data": data}
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


def pytest_configure(config) -> None:
    path = os.environ.get("LOWERCACHE_PEER_DIGESTS")
    if not path:
        return
    import torch
    from executorch.exir import lowered_backend_module

    cls = lowered_backend_module.LoweredBackendModule
    original = cls.__init__

    def __init__(self, edge_program, backend_id, processed_bytes, compile_specs, named_data_store_output=None):
        _record(path, backend_id, processed_bytes, named_data_store_output)
        original(self, edge_program, backend_id, processed_bytes, compile_specs, named_data_store_output)

    cls.__init__ = __init__
    torch.manual_seed(SEED)


def pytest_runtest_setup(item) -> None:
    if os.environ.get("LOWERCACHE_PEER_DIGESTS"):
        import torch

        _current["test"] = item.nodeid
        torch.manual_seed(SEED)
