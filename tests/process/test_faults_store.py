"""Faults of the local store, each reproduced for real: a damaged SQLite index, rows
that cannot be read, orphaned value files, a full disk, a read-only directory, and
``lowercache run`` over a broken cache. Each ends with the bytes of a clean run (or a
working housekeeping command) and at most one warning per fault."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import diskcache
import pytest

from lowercache.cache import dbfile
from lowercache.cache.store import Entry, Store

from tests.helpers.cli import ROOT, TINY, warnings_of
from tests.helpers.disks import tmpfs

pytestmark = pytest.mark.usefixtures("through_server")


TARGET = "tosa-fp"


def cli(*args, cache_dir, env=None, timeout=900):
    full_env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lowercache.cli", *map(str, args)], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def flip_head(db: Path, n: int = 16) -> None:
    data = bytearray(db.read_bytes())
    data[:n] = bytes(b ^ 0xFF for b in data[:n])
    db.write_bytes(bytes(data))


def truncate_half(db: Path) -> None:
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])


def age(paths) -> None:
    """Make value files look old, as files left by a lowering an hour ago (orphans are reclaimed after a grace)."""
    for p in paths:
        os.utime(p, (1_000_000, 1_000_000))


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file and directory: content digest and mtime, so a write of any kind shows."""
    out = {}
    for p in sorted(directory.rglob("*")):
        content = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(directory))] = (content, p.stat().st_mtime_ns)
    out["."] = ("dir", directory.stat().st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """One clean lowering: its cache (copied per test) and its output bytes."""
    base = tmp_path_factory.mktemp("seed")
    result = cli("lower", TINY, "-t", TARGET, "-o", base / "out", cache_dir=base / "cache")
    assert result.returncode == 0, result.stderr
    return base / "cache", (base / "out" / "model.pte").read_bytes()


@pytest.fixture
def seeded_cache(seeded, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(seeded[0], cache)
    return cache, seeded[1]


def entries_db(cache: Path) -> Path:
    return cache / "entries" / dbfile.DB_NAME


def meta_db(cache: Path) -> Path:
    return cache / "meta" / dbfile.DB_NAME


# -- a damaged index heals -----------------------------------------------------------------


def test_flipped_head_of_the_entries_index_heals_and_the_lowering_recomputes(seeded_cache, tmp_path):
    cache, clean = seeded_cache
    flip_head(entries_db(cache))
    damaged = entries_db(cache).read_bytes()
    result = cli("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", cache_dir=cache)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "model.pte").read_bytes() == clean
    assert len(warnings_of(result)) == 1 and "damaged" in result.stderr, result.stderr
    kept = dbfile.aside_copies(cache / "entries")
    assert [p.read_bytes() for p in kept if not p.name.endswith(("-wal", "-shm"))] == [damaged]  # kept for a bug report
    store = Store(cache)
    assert any(kind == "flow" for kind, _ in store.actions())  # rebuilt and stored again
    store.close()


def test_half_truncated_meta_index_heals_with_one_warning(seeded_cache, caplog):
    cache, _ = seeded_cache
    truncate_half(meta_db(cache))
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        store = Store(cache)
        store.add_counts({"flow": {"hit": 1}})
        store.put_record("r", [1])
        assert store.counters() == {"count/flow/hit": 1} and store.get_record("r") == [1]
        assert any(kind == "flow" for kind, _ in store.actions())  # the entries were not touched
        store.close()
    assert len(caplog.records) == 1 and "damaged" in caplog.text
    assert len([p for p in dbfile.aside_copies(cache / "meta") if not p.name.endswith(("-wal", "-shm"))]) == 1


def test_damage_met_by_many_processes_is_moved_aside_once(tmp_path):
    """The second process to notice finds the fresh file sound and leaves it alone."""
    store = Store(tmp_path)
    store.put("k", "key", Entry(blobs={"x": b"1"}))
    store.close()
    db = entries_db(tmp_path)
    flip_head(db)
    assert dbfile.move_aside(db) is not None
    fresh = Store(tmp_path)
    fresh.put("k", "key", Entry(blobs={"x": b"2"}))
    assert dbfile.move_aside(db) is None
    assert fresh.get("k", "key").blobs == {"x": b"2"}
    fresh.close()


WORKER = textwrap.dedent(
    """
    import sys, time
    from lowercache.cache.store import Entry, Store

    while time.time() < float(sys.argv[2]):  # start together
        time.sleep(0.01)
    store = Store(sys.argv[1])
    me = sys.argv[3]
    assert store.get("k", "shared") is None or store.get("k", "shared").blobs == {"x": b"same" * 500}
    store.put("k", "shared", Entry(blobs={"x": b"same" * 500}))
    store.put("k", me, Entry(blobs={"x": me.encode() * 500}))
    got = store.get("k", me)
    print("stored" if got is not None and got.blobs == {"x": me.encode() * 500} else "missed")
    store.close()
    """
)


def test_processes_meeting_the_same_damage_at_once_all_go_on(tmp_path):
    import time

    store = Store(tmp_path / "cache")
    store.put("k", "shared", Entry(blobs={"x": b"same" * 500}))
    store.close()
    flip_head(entries_db(tmp_path / "cache"))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    start = str(time.time() + 4)
    procs = [
        subprocess.Popen([sys.executable, script, tmp_path / "cache", start, f"w{i}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [r[1] for r in results]
    assert all(out.strip() == "stored" for out, _ in results), results
    assert all(len(err.strip().splitlines()) <= 1 for _, err in results), results
    moved = [p for p in dbfile.aside_copies(tmp_path / "cache" / "entries") if not p.name.endswith(("-wal", "-shm"))]
    assert len(moved) == 1
    store = Store(tmp_path / "cache")
    assert all(store.get("k", f"w{i}") is not None for i in range(4))
    store.close()


@pytest.mark.parametrize("damage", [flip_head, truncate_half], ids=["flipped-entries", "truncated-meta"])
def test_clear_and_gc_verify_work_on_a_damaged_directory(seeded_cache, damage):
    cache, _ = seeded_cache
    damage(entries_db(cache) if damage is flip_head else meta_db(cache))
    gc = cli("gc", "--verify", cache_dir=cache)
    assert gc.returncode == 0 and "freed" in gc.stdout, gc.stderr
    assert len(warnings_of(gc)) <= 1
    stats = cli("stats", cache_dir=cache)
    assert stats.returncode == 0 and "warning" not in stats.stderr, stats.stderr
    damage(entries_db(cache) if damage is flip_head else meta_db(cache))
    clear = cli("clear", cache_dir=cache)
    assert clear.returncode == 0 and "removed" in clear.stdout, clear.stderr
    assert not list(dbfile.value_files(cache / "entries"))
    assert not dbfile.aside_copies(cache / "entries") and not dbfile.aside_copies(cache / "meta")
    store = Store(cache)
    assert store.entry_count() == {"actions": 0, "blobs": 0} and store.counters() == {}
    store.close()


def test_rows_whose_key_is_in_pickle_form_are_skipped_then_dropped(seeded_cache, tmp_path):
    cache, _ = seeded_cache
    for name in ("entries", "meta"):
        planted = diskcache.Cache(str(cache / name))
        planted.set(("a", "tuple", "key"), b"value")  # diskcache pickles a tuple key
        planted.close()
    before = Store(cache).entry_count()
    for args in (("stats",), ("export", tmp_path / "cache.tar")):
        result = cli(*args, cache_dir=cache)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    gc = cli("gc", "--verify", cache_dir=cache)
    assert gc.returncode == 0 and "1 corrupt entries dropped" in gc.stdout, gc.stdout + gc.stderr
    con = sqlite3.connect(entries_db(cache))
    assert con.execute("SELECT count(*) FROM Cache WHERE raw = 0").fetchone() == (0,)
    con.close()
    assert Store(cache).entry_count() == before


def test_value_files_orphaned_by_a_deleted_index_are_reclaimed_by_gc(seeded_cache):
    cache, _ = seeded_cache
    files = list(dbfile.value_files(cache / "entries"))
    assert files
    age(files)
    entries_db(cache).unlink()
    gc = cli("gc", cache_dir=cache)
    assert gc.returncode == 0, gc.stderr
    assert f"{len(files)} orphaned files removed" in gc.stdout, gc.stdout
    assert not any(p.exists() for p in files)


def test_young_unreferenced_files_are_left_to_their_writer(tmp_path):
    """A value file is written before its row: one younger than the grace may be a concurrent writer's."""
    store = Store(tmp_path)
    store.put("k", "key", Entry(blobs={"x": b"1" * 5000}))
    stray = tmp_path / "entries" / "ab" / "cd" / f"{uuid.uuid4().hex}.val"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"in flight")
    assert store.reclaim_orphans() == (0, 0)
    age([stray, *dbfile.value_files(tmp_path / "entries")])
    assert store.reclaim_orphans() == (1, len(b"in flight"))  # the referenced file stays
    assert store.get("k", "key").blobs == {"x": b"1" * 5000}
    store.close()


# -- a full disk degrades to uncached, and the tool can still free space --------------------------


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_the_run_that_fills_the_disk_warns_once_and_still_serves_hits(tmp_path, monkeypatch, caplog):
    store = Store(tmp_path)
    store.put("k", "old", Entry(blobs={"x": b"kept" * 1000}))
    monkeypatch.setattr(diskcache.Disk, "store", _disk_full)
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert not any(store.put("k", f"new{i}", Entry(blobs={"x": bytes([i]) * 5000})) for i in range(5))
        store.add_counts({"k": {"miss": 5}})
        store.put_record("r", [1])
        assert store.get("k", "old").blobs == {"x": b"kept" * 1000}
    assert len(caplog.records) == 1 and "cannot be written" in caplog.text and "gc" in caplog.text
    store.close()


def _full_disk(directory: Path, room: int):
    """SQLite as on a full disk: opening the index for writing fails while the value files
    take more than ``room`` bytes, so only removing files lets it open again."""
    original = Store._diskcache

    def open_index(store, name):
        used = sum(p.stat().st_size for p in dbfile.value_files(directory / "entries"))
        if used > room:
            raise sqlite3.OperationalError("database or disk is full")
        return original(store, name)

    return open_index


def _fill(directory: Path, n: int = 6) -> None:
    store = Store(directory)
    for i in range(n):
        assert store.put("k", f"key{i}", Entry(blobs={"x": bytes([i]) * 100_000}))
    store.close()


def test_the_next_run_opens_a_full_store_and_serves_hits_with_one_warning(tmp_path, monkeypatch, caplog):
    _fill(tmp_path)
    monkeypatch.setattr(Store, "_diskcache", _full_disk(tmp_path, room=0))
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        store = Store(tmp_path)
        assert store.get("k", "key5").blobs == {"x": bytes([5]) * 100_000}
        assert not store.put("k", "new", Entry(blobs={"x": b"n" * 5000}))
        store.add_counts({"k": {"hit": 1}})
        store.close()
    assert len(caplog.records) == 1 and "cannot be written" in caplog.text, caplog.text


def test_gc_frees_a_full_disk(tmp_path, monkeypatch):
    _fill(tmp_path)
    monkeypatch.setattr(Store, "_diskcache", _full_disk(tmp_path, room=350_000))
    store = Store(tmp_path)
    assert not store.writable
    freed = store.gc(max_size=300_000)
    assert freed >= 300_000 and store.writable
    assert store.volume() <= 300_000
    assert store.get("k", "key5") is not None and store.get("k", "key0") is None  # least recently used went first
    assert store.put("k", "after", Entry(blobs={"x": b"a" * 5000}))
    store.close()


def test_clear_empties_a_full_disk(tmp_path, monkeypatch):
    _fill(tmp_path)
    monkeypatch.setattr(Store, "_diskcache", _full_disk(tmp_path, room=0))
    store = Store(tmp_path)
    assert not store.writable
    assert store.clear() == 12  # 6 steps and their 6 blobs
    assert store.writable and store.entry_count() == {"actions": 0, "blobs": 0}
    assert not list(dbfile.value_files(tmp_path / "entries"))
    store.close()


def test_a_really_full_disk_lowers_uncached_and_gc_and_clear_work(seeded, tmp_path):
    clean = seeded[1]
    with tmpfs(tmp_path / "small", "2m") as disk:
        cache = disk / "cache"
        shutil.copytree(seeded[0], cache)
        filler = disk / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)
        assert os.statvfs(disk).f_bavail == 0
        result = cli("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", cache_dir=cache)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "out" / "model.pte").read_bytes() == clean
        assert len(warnings_of(result)) == 1 and "cannot be written" in result.stderr, result.stderr
        gc = cli("gc", "--max-size", "0", cache_dir=cache)
        assert gc.returncode == 0 and "freed" in gc.stdout, gc.stderr
        assert not list(dbfile.value_files(cache / "entries"))
        clear = cli("clear", cache_dir=cache)
        assert clear.returncode == 0 and "removed" in clear.stdout, clear.stderr


def test_a_lowering_that_fills_a_really_small_disk_warns_once(seeded, tmp_path):
    """The index cannot even be created whole: the run still lowers the clean bytes, with one warning."""
    with tmpfs(tmp_path / "tiny", "120k") as disk:
        result = cli("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", cache_dir=disk / "cache")
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "out" / "model.pte").read_bytes() == seeded[1]
        assert len(warnings_of(result)) == 1 and "cannot be written" in result.stderr, result.stderr
        for command in (("gc",), ("clear",)):
            done = cli(*command, cache_dir=disk / "cache")
            assert done.returncode == 0, done.stderr


# -- read-only touches nothing ----------------------------------------------------------------


@contextlib.contextmanager
def _read_only_mount(path: Path):
    """A read-only bind mount of ``path`` onto itself (root cannot write there either); nothing when not allowed."""
    mounted = os.geteuid() == 0 and not subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode
    if mounted and subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], check=False)
        mounted = False
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_read_only_serves_a_read_only_directory_and_changes_no_byte(seeded_cache, tmp_path):
    cache, clean = seeded_cache
    for p in [cache, *cache.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    before = snapshot(cache)
    try:
        with _read_only_mount(cache) as mounted:
            if mounted:
                with pytest.raises(OSError):
                    (cache / "probe").write_bytes(b"")
            result = cli("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", cache_dir=cache, env={"LOWERCACHE_READ_ONLY": "1"})
            assert result.returncode == 0, result.stderr
            assert "warning" not in result.stderr, result.stderr
            stats = cli("stats", cache_dir=cache, env={"LOWERCACHE_READ_ONLY": "1"})
            assert stats.returncode == 0, stats.stderr
    finally:
        for p in [cache, *cache.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    assert (tmp_path / "out" / "model.pte").read_bytes() == clean
    steps = json.loads((tmp_path / "out" / "manifest.json").read_text())["steps"]
    assert (steps[0]["kind"], steps[0]["outcome"]) == ("flow", "hit")
    assert snapshot(cache) == before


def test_read_only_store_writes_nothing_at_all(seeded_cache):
    cache, _ = seeded_cache
    before = snapshot(cache)
    store = Store(cache, read_only=True)
    assert any(kind == "flow" for kind, _ in store.actions())
    for kind, key in list(store.actions()):
        assert store.get(kind, key) is not None
    assert not store.put("k", "new", Entry(blobs={"x": b"1"}))
    store.add_counts({"flow": {"hit": 1}})
    store.put_record("r", [1])
    store.close()
    assert snapshot(cache) == before


def test_read_only_on_a_missing_directory_creates_nothing(tmp_path):
    store = Store(tmp_path / "absent", read_only=True)
    assert store.get("k", "key") is None and store.entry_count() == {"actions": 0, "blobs": 0}
    store.close()
    assert not (tmp_path / "absent").exists()


# -- lowercache run never fails the user's script because of the cache -----------------------

RUN_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.exir import to_edge_transform_and_lower
    import torch

    spec = importlib.util.spec_from_file_location("tiny", sys.argv[2])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net, example = module.model()
    ep = torch.export.export(net, example)
    edge = to_edge_transform_and_lower(ep, partitioner=[TOSAPartitioner(TosaCompileSpec("TOSA-1.0+FP"))])
    with open(sys.argv[1], "wb") as f:
        f.write(edge.to_executorch().buffer)
    """
)


@pytest.mark.parametrize("fault", ["none", "damaged-index", "unusable-directory"])
def test_run_falls_back_to_uncached_with_one_warning(seeded_cache, tmp_path, fault):
    """The script imports TOSAPartitioner first (its import runs the TOSA backend's half way): the hooks wait for it."""
    cache, clean = seeded_cache
    cache_dir = cache
    before = Store(cache).counters()
    if fault == "damaged-index":
        flip_head(entries_db(cache))
    elif fault == "unusable-directory":
        cache_dir = tmp_path / "a-file"
        cache_dir.write_text("not a directory")
    script = tmp_path / "export_script.py"
    script.write_text(RUN_SCRIPT)
    out = tmp_path / "model.pte"
    result = cli("run", "--", sys.executable, script, out, ROOT / "examples" / "tiny_cnn.py", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == clean
    expected = {"none": [], "damaged-index": ["damaged"], "unusable-directory": ["caching is off"]}[fault]
    assert len(warnings_of(result)) == len(expected) and all(w in result.stderr for w in expected), result.stderr
    if fault != "unusable-directory":
        counters = Store(cache).counters()
        tosa = "count/tosa/hit" if fault == "none" else "count/tosa/miss"
        assert counters.get(tosa, 0) - before.get(tosa, 0) == 1, counters  # the hooks were installed and ran the step
