"""``lowercache verify`` checks what ``lower`` would serve now: a poisoned direct-mode record is caught.

A confirmed record of one model is pointed at another model's (well-formed,
signed-off) flow entry: ``lower`` would serve the other model's bytes from
the record without running anything. ``verify`` must say so, naming the
direct record, where it used to say "verified" (its own lowerings never ask
the record).
"""

from __future__ import annotations

from lowercache import direct
from lowercache.cache.store import Entry, Store

from tests.helpers.cli import ROOT, cli

TARGET = "tosa-int"
WIDE = """
import torch

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval(), (torch.randn(1, 3, 8, 8),)
"""


def test_verify_names_a_poisoned_direct_record(tmp_path, cache_dir):
    (tmp_path / "wide.py").write_text(WIDE)
    tiny = f"{ROOT}/examples/tiny_cnn.py:model"
    for model in (tiny, tiny, f"{tmp_path}/wide.py:model"):  # the tiny model's record is confirmed by its second run
        result = cli("lower", model, "-t", TARGET, "-o", tmp_path / "out", cache_dir=cache_dir, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]

    ok = cli("verify", tiny, "-t", TARGET, cache_dir=cache_dir, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "direct record (flow entry" in ok.stdout and "stock in a new process" in ok.stdout

    store = Store(cache_dir)
    request = direct.Request(model=tiny, target=TARGET, out_dir="", cwd=str(tmp_path))
    record = store.get("direct", request.key()).meta
    wide = direct.Request(model=f"{tmp_path}/wide.py:model", target=TARGET, out_dir="", cwd=str(tmp_path))
    record["flow"] = store.get("direct", wide.key()).meta["flow"]
    assert record["status"] == "confirmed"
    assert store.put("direct", request.key(), Entry(meta=record))
    store.close()

    poisoned = cli("lower", tiny, "-t", TARGET, "-o", tmp_path / "served", cache_dir=cache_dir, cwd=tmp_path)
    assert "direct mode: served from the record" in poisoned.stderr  # the poison is live: lower serves it
    bad = cli("verify", tiny, "-t", TARGET, cache_dir=cache_dir, cwd=tmp_path)
    assert bad.returncode == 1
    lines = [line for line in bad.stderr.splitlines() if line.startswith("lowercache: mismatch:")]
    assert lines and all(line.startswith("lowercache: mismatch: direct record: ") for line in lines), bad.stderr[-2000:]
    assert any("model.pte differs" in line for line in lines)
