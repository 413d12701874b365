"""``lowercache verify`` passes on a sound cache and catches a planted wrong hit."""

from __future__ import annotations

import pytest

from lowercache.lowering import flow
from lowercache.cache.steps import step_key
from lowercache.cache.store import Entry, Store
from lowercache.targets import resolve

from tests.helpers.cli import TINY, cli

pytestmark = pytest.mark.usefixtures("through_server")


def test_verify_passes_then_catches_a_wrong_but_well_formed_entry(tmp_path, cache_dir):
    ok = cli("verify", TINY, "--target", "tosa-int", cache_dir=cache_dir)
    assert ok.returncode == 0, ok.stderr
    assert "byte-identical" in ok.stdout
    # progress as each part starts (the server is off here: five parts), then the result in two lines
    shown = [line.split("]")[0] for line in ok.stderr.splitlines() if line.startswith("lowercache: [")]
    assert shown == [f"lowercache: [{i}/5" for i in range(1, 6)], ok.stderr
    assert ok.stdout.splitlines()[1].startswith("checked: the cached lowering; a lowering in an empty cache; stock in a new process")

    # Plant a wrong hit: same key, well-formed entry, one byte of the .pte changed.
    store = Store(cache_dir)
    from lowercache.lowering.loading import load_model

    loaded = load_model(TINY)
    program = flow.export(loaded.module, loaded.example_inputs)
    parts = flow.flow_parts(program, resolve("tosa-int"), loaded.example_inputs, [loaded.example_inputs], store)
    key = step_key("flow", parts)
    entry = store.get("flow", key)
    assert entry is not None
    pte = bytearray(entry.blobs["model.pte"])
    pte[100] ^= 0x01
    entry.blobs["model.pte"] = bytes(pte)
    assert store.put("flow", key, Entry(meta=entry.meta, blobs=entry.blobs, cost=entry.cost))
    store.close()

    bad = cli("verify", TINY, "--target", "tosa-int", cache_dir=cache_dir)
    assert bad.returncode == 1
    lines = [line for line in bad.stderr.splitlines() if line.startswith("lowercache: mismatch:")]
    assert len(lines) == 1, bad.stderr
    assert "cache: model.pte differs" in lines[0] and "byte 100" in lines[0] and "flow tosa-int (hit" in lines[0]
    assert bad.stderr.rstrip().endswith("lowercache: error: not verified: 1 file differs from stock ExecuTorch's lowering (above)")
