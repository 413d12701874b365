"""The store: integrity checks, no unpickling, read-only, eviction."""

from __future__ import annotations

import logging
import pickle

import diskcache
import pytest

from lowercache.cache.store import Entry, Store

pytestmark = pytest.mark.quick


def value_files(directory):
    return [p for p in (directory / "entries").rglob("*.val")]


def test_round_trip_and_dedup(tmp_path):
    store = Store(tmp_path)
    entry = Entry(meta={"n": 1}, blobs={"a": b"same", "b": b"same", "c": b"other"})
    assert store.put("k", "key1", entry)
    got = store.get("k", "key1")
    assert got.meta == {"n": 1} and got.blobs == entry.blobs
    assert store.entry_count() == {"actions": 1, "blobs": 2}
    assert store.get("k", "absent") is None


def test_flipped_byte_is_a_miss_with_a_warning(tmp_path, caplog):
    store = Store(tmp_path)
    store.put("k", "key1", Entry(blobs={"x": b"payload-bytes" * 100}))
    for path in value_files(tmp_path):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert store.get("k", "key1") is None
    assert "unusable" in caplog.text
    assert store.get("k", "key1") is None  # dropped, and no crash the second time


def test_pickled_values_are_refused_not_loaded(tmp_path, caplog):
    store = Store(tmp_path)
    store.close()
    planted = diskcache.Cache(str(tmp_path / "entries"))
    planted.set("action/k/key1", {"a pickled": "dict"})  # diskcache pickles non-bytes values
    planted.close()

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    planted = diskcache.Cache(str(tmp_path / "entries"))
    planted.set("action/k/key2", pickle.dumps(Boom()))  # bytes: stored raw, never unpickled
    planted.close()
    store = Store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert store.get("k", "key1") is None
        assert store.get("k", "key2") is None
    assert "pickle" in caplog.text


def test_read_only_writes_nothing(tmp_path):
    Store(tmp_path).put("k", "key1", Entry(blobs={"x": b"1"}))
    ro = Store(tmp_path, read_only=True)
    assert ro.get("k", "key1").blobs == {"x": b"1"}
    assert not ro.put("k", "key2", Entry(blobs={"x": b"2"}))
    assert Store(tmp_path).get("k", "key2") is None


def test_gc_evicts_down_to_the_limit(tmp_path):
    store = Store(tmp_path)
    for i in range(20):
        store.put("k", f"key{i}", Entry(blobs={"x": bytes([i]) * 100_000}))
    assert store.volume() > 1_500_000
    store.gc(max_size=1_200_000)
    assert store.volume() <= 1_200_000
    assert store.get("k", "key19") is not None  # the most recently used survive


def test_verify_all_drops_corrupt_entries(tmp_path):
    store = Store(tmp_path)
    store.put("k", "key1", Entry(blobs={"x": b"abc" * 1000}))
    path = max(value_files(tmp_path), key=lambda p: p.stat().st_size)
    path.write_bytes(path.read_bytes()[:-10])
    assert store.verify_all() == 1


def test_export_import_round_trip_checks_content(tmp_path, caplog):
    import io
    import tarfile

    from lowercache.cache.archive import export_entries, import_entries

    source = Store(tmp_path / "a")
    source.put("flow", "a" * 32, Entry(meta={"m": 1}, blobs={"model.pte": b"pte-bytes", "x.tosa": b"tosa"}))
    source.put("tosa", "b" * 32, Entry(blobs={"tosa": b"tosa"}))
    assert export_entries(source, tmp_path / "cache.tar") == (2, 2)

    target = Store(tmp_path / "b")
    assert import_entries(target, tmp_path / "cache.tar") == 2
    assert target.get("flow", "a" * 32).blobs == {"model.pte": b"pte-bytes", "x.tosa": b"tosa"}

    # A tampered archive: the blob no longer hashes to its name, so its record is skipped.
    with tarfile.open(tmp_path / "cache.tar") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        for member, data in members:
            if data == b"pte-bytes":
                data = b"PTE-BYTES"
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    fresh = Store(tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert import_entries(fresh, tmp_path / "bad.tar") == 1
    assert fresh.get("flow", "a" * 32) is None and fresh.get("tosa", "b" * 32) is not None
    assert "other content" in caplog.text
