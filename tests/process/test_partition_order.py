"""Partitions are lowered in discovery order in every process (partitionorder.py).

Stock ExecuTorch 1.5.1 orders a multi-partition lowering by the string-hash
seed (executorch#19045), so two fresh processes can emit different bytes
for the same model. These tests run stock and lowercache in child processes
under hash seeds that give each order, and check that lowercache always
produces the bytes stock produces in discovery order, cached or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowercache.lowering import partitionorder
from lowercache.bench import stockref
from tests.helpers import ROOT

TAGS = ["tag0", "tag1"]  # what the partitioner makes for the child's model


def _seed(discovery: bool) -> int:
    """A hash seed under which ``{tag0, tag1}`` iterates in (or not in) discovery order."""
    code = "import sys; print(list(set(sys.argv[1:])) == sys.argv[1:])"
    for seed in range(100):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        out = subprocess.run([sys.executable, "-c", code, *TAGS], env=env, capture_output=True, text=True, check=True)
        if (out.stdout.strip() == "True") == discovery:
            return seed
    raise AssertionError("no hash seed in 0-99 gives the wanted set order")


def _child(mode: str, seed: int, out: Path, cache_dir: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "tests.process.partition_order_child", mode, str(out)] + ([str(cache_dir)] if cache_dir else [])
    # The oracle's disk cache off: the child watches the order stock's own run takes.
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1", "LOWERCACHE_TEST_ORACLE": "off"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory):
    """Pure stock under a discovery-order seed and under the other order."""
    tmp = tmp_path_factory.mktemp("stock")
    good, other = _seed(True), _seed(False)
    return {
        "seeds": (good, other),
        "discovery": _child("stock", good, tmp / "discovery.pte"),
        "other": _child("stock", other, tmp / "other.pte"),
    }


def test_stock_order_follows_the_hash_seed(stock_runs):
    """The upstream behaviour this module exists for; if it stops reproducing, the other tests prove nothing."""
    assert stock_runs["discovery"]["orders"] == [TAGS]
    assert stock_runs["other"]["orders"] == [TAGS[::-1]]
    assert stock_runs["discovery"]["sha256"] != stock_runs["other"]["sha256"], (
        "stock no longer depends on the partition order for this model: pick one that does"
    )


def test_lowercache_gives_stock_discovery_order_bytes_under_any_seed(stock_runs, tmp_path):
    good, other = stock_runs["seeds"]
    expected = stock_runs["discovery"]["sha256"]
    uncached = _child("lowercache", other, tmp_path / "uncached.pte")
    assert uncached["orders"] == [TAGS[::-1]], "the child should see stock's own (non-discovery) order"
    assert uncached["sha256"] == expected
    cache = tmp_path / "cache"
    miss = _child("lowercache", other, tmp_path / "miss.pte", cache)
    hit = _child("lowercache", good, tmp_path / "hit.pte", cache)
    assert miss["sha256"] == hit["sha256"] == expected
    assert hit["orders"] == [], "the second process should be served from the cache without partitioning"


def test_discovery_order():
    tags = {"tag10": 1, "tag2": 2, "tag0": 3}
    assert list(partitionorder.discovery_order(tags)) == ["tag0", "tag2", "tag10"]
    assert partitionorder.discovery_order(tags)["tag10"] == 1
    custom = {"b": 1, "a": 2}
    assert list(partitionorder.discovery_order(custom)) == ["b", "a"]  # not the partitioner's tags: left alone
    assert partitionorder.is_discovery_order(["tag0", "tag1", "tag3"])
    assert not partitionorder.is_discovery_order(["tag1", "tag0"])


def test_benchmark_reference_is_stock_in_discovery_order(stock_runs):
    """What the benchmark compares against when its own stock run used the other order."""
    import hashlib

    spec = str(ROOT / "tests" / "process" / "partition_order_child.py") + ":build"
    assert stockref.seeds_for(TAGS)
    pte = stockref.reference(spec, "ethos-u55-128", None, False, TAGS[::-1])
    assert pte is not None and hashlib.sha256(pte).hexdigest() == stock_runs["discovery"]["sha256"]
