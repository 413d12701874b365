"""One format for an entry (issue 25): the action record, and the run history under concurrent processes.

The same malformed records are planted in the local store, on a real Redis
(sealed and signed with the team's key, as a buggy or hostile teammate would
write them) and in an archive for ``lowercache import``. Every tier refuses
every one the same way: a miss and one warning, and where a lowering reads
them, a recompute with the stock bytes.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import subprocess
import sys
import tarfile
import time

import diskcache
import pytest

import lowercache
from lowercache.cache import history
from lowercache.cache import remote as rm
from lowercache.cache.digests import digest
from lowercache.cache.records import ActionRecord, CorruptEntry, parse
from lowercache.cache.store import Entry, Store, frame
from lowercache.config import Settings

from tests.helpers.cli import ROOT, TINY, cli, stock_tiny


pytestmark = pytest.mark.timeout(900)

KIND, KEY = "flow", "ab" * 16
TEAM_KEY = b"team-secret"
BLOBS = {"model.pte": b"pte-bytes", "output/summary.csv": b"csv"}


def valid(kind: str = KIND, key: str = KEY) -> dict:
    """The record today's code writes for a small entry."""
    return {
        "kind": kind,
        "key": key,
        "meta": {"n": 1, "shape": [1, 3], "f": 0.5, "s": "x", "none": None, "ok": True},
        "blobs": {name: digest(data) for name, data in BLOBS.items()},
        "cost": 1.25,
    }


def _with(**changes) -> bytes:
    return json.dumps({**valid(), **changes}, sort_keys=True).encode()


def _without(field: str) -> bytes:
    record = valid()
    del record[field]
    return json.dumps(record).encode()


def _nested(depth: int) -> dict:
    meta: dict = {"leaf": 1}
    for _ in range(depth):
        meta = {"a": meta}
    return meta


_GOOD = json.dumps(valid(), sort_keys=True)

MALFORMED: dict[str, bytes] = {
    "not JSON": b"{not json",
    "not UTF-8": b"\xff\xfe" + _GOOD.encode("utf-16-le"),
    "empty": b"",
    "a list": json.dumps([valid()]).encode(),
    "a string": b'"flow"',
    "extra field": _with(extra=1),
    "missing kind": _without("kind"),
    "missing meta": _without("meta"),
    "missing blobs": _without("blobs"),
    "missing cost": _without("cost"),
    "wrong kind": _with(kind="tosa"),
    "wrong key": _with(key="cd" * 16),
    "kind not a string": _with(kind=["flow"]),
    "key not a string": _with(key=None),
    "duplicate field": _GOOD[:-1].encode() + b', "kind": "tosa"}',
    "meta a list": _with(meta=[1, 2]),
    "meta a string": _with(meta="{}"),
    "meta NaN": _GOOD.replace('"f": 0.5', '"f": NaN').encode(),
    "meta Infinity": _GOOD.replace('"f": 0.5', '"f": -Infinity').encode(),
    "meta huge float": _GOOD.replace('"f": 0.5', '"f": 1e999').encode(),
    "meta huge integer": _with(meta={"n": 10**30}),
    "meta integer of 5000 digits": _GOOD.replace('"n": 1', '"n": ' + "9" * 5000).encode(),
    "meta nested NaN": _GOOD.replace('"shape": [1, 3]', '"shape": [1, [2, {"x": NaN}]]').encode(),
    "meta nested too deep": _with(meta=_nested(100)),
    "meta nested past the parser": b'{"meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "blobs a list": _with(blobs=[digest(b"pte-bytes")]),
    "blob digest upper case": _with(blobs={"model.pte": digest(b"pte-bytes").upper()}),
    "blob digest short": _with(blobs={"model.pte": digest(b"pte-bytes")[:31]}),
    "blob digest a number": _with(blobs={"model.pte": 12345}),
    "blob digest null": _with(blobs={"model.pte": None}),
    "blob name climbs out": _with(blobs={"../model.pte": digest(b"pte-bytes")}),
    "blob name absolute": _with(blobs={"/etc/model.pte": digest(b"pte-bytes")}),
    "blob name empty": _with(blobs={"": digest(b"pte-bytes")}),
    "blob name with NUL": _with(blobs={"model\u0000.pte": digest(b"pte-bytes")}),
    "cost a string": _with(cost="1.25"),
    "cost null": _with(cost=None),
    "cost a boolean": _with(cost=True),
    "cost negative": _with(cost=-1.0),
    "cost NaN": _GOOD.replace('"cost": 1.25', '"cost": NaN').encode(),
    "cost huge float": _GOOD.replace('"cost": 1.25', '"cost": 1e400').encode(),
    "cost huge integer": _GOOD.replace('"cost": 1.25', '"cost": ' + "9" * 400).encode(),
}
CASES = sorted(MALFORMED)


def unusable(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lowercache" and r.levelno == logging.WARNING and text in r.getMessage()]


# -- the reader itself --------------------------------------------------------------------------


def test_valid_record_round_trips_in_the_bytes_earlier_releases_wrote():
    record = parse(_GOOD.encode(), KIND, KEY)
    assert record.to_bytes() == _GOOD.encode()  # json.dumps(record, sort_keys=True), as store, remote and archive wrote
    assert record.entry(BLOBS) == Entry(meta=valid()["meta"], blobs=BLOBS, cost=1.25)
    assert ActionRecord.of(KIND, KEY, Entry(meta=valid()["meta"], blobs=BLOBS, cost=1.25)) == record
    integral = parse(_GOOD.replace('"cost": 1.25', '"cost": 3').encode(), KIND, KEY)
    assert integral.cost == 3.0 and isinstance(integral.cost, float)


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES)
def test_the_reader_refuses(case):
    with pytest.raises(CorruptEntry):
        parse(MALFORMED[case], KIND, KEY)


def test_an_entry_that_could_not_be_read_back_is_not_stored(tmp_path, caplog):
    store = Store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert not store.put(KIND, KEY, Entry(meta={"x": float("nan")}))
        assert not store.put(KIND, KEY, Entry(meta={"x": object()}))
    assert store.get(KIND, KEY) is None and store.entry_count() == {"actions": 0, "blobs": 0}
    assert len(unusable(caplog, "not storing")) == 1  # one warning per fault per directory
    assert store.put(KIND, KEY, Entry(meta={"shape": (1, 3)}))  # a tuple is written as the list it reads back as
    assert store.get(KIND, KEY).meta == {"shape": [1, 3]}


# -- the same records in every tier -------------------------------------------------------------


def plant_local(directory, raw: bytes) -> None:
    """Overwrite the stored record with ``raw``, framed so that its checksum holds."""
    planted = diskcache.Cache(str(directory / "entries"))
    planted.set(f"action/{KIND}/{KEY}", frame(raw))
    planted.close()


@pytest.mark.parametrize("case", CASES)
def test_local_store_refuses(tmp_path, caplog, case):
    store = Store(tmp_path)
    assert store.put(KIND, KEY, Entry(meta=valid()["meta"], blobs=BLOBS, cost=1.25))
    plant_local(tmp_path, MALFORMED[case])
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert store.get(KIND, KEY) is None
    assert len(unusable(caplog, f"cache entry {KIND}/{KEY[:12]} is unusable")) == 1, caplog.text
    assert store.get(KIND, KEY) is None and store.entry_count()["actions"] == 0  # dropped
    assert store.put(KIND, KEY, Entry(meta={}, blobs=BLOBS, cost=1.0))  # the recompute is stored and served
    assert store.get(KIND, KEY).blobs == BLOBS


def test_gc_verify_drops_malformed_records(tmp_path):
    store = Store(tmp_path)
    store.put(KIND, KEY, Entry(blobs=BLOBS))
    store.put("tosa", "cd" * 16, Entry(blobs={"tosa": b"t"}))
    plant_local(tmp_path, MALFORMED["cost NaN"])
    assert store.verify_all() == 1
    assert store.get("tosa", "cd" * 16) is not None


def guarded(redis_url: str, mode: str = "read-write") -> rm.Guarded:
    return rm.connect(redis_url, mode=mode, hmac_key=TEAM_KEY, require_signed=True)


@pytest.mark.parametrize("case", CASES)
def test_remote_tier_refuses(tmp_path, redis_url, caplog, case):
    writer = guarded(redis_url, "write-only")  # a teammate's client with the right key: the record is signed
    for data in BLOBS.values():
        assert writer.put(f"blob/{digest(data)}", data)
    assert writer.put(f"action/{KIND}/{KEY}", MALFORMED[case])
    writer.close()

    tiered = rm.TieredStore(Store(tmp_path / "a"), guarded(redis_url))
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert tiered.get(KIND, KEY) is None
    refused = unusable(caplog, f"ignoring remote entry action/{KIND}/{KEY}")
    assert len(refused) == 1 and len(unusable(caplog, "")) == 1, caplog.text
    stats = tiered.remote.stats()
    assert (stats["hits"], stats["refused"], stats["verified"]) == (0, 1, 0)
    assert tiered.local.get(KIND, KEY) is None  # nothing malformed reached the local cache
    # The recompute replaces the malformed record, so the next client is served.
    assert tiered.put(KIND, KEY, Entry(meta={"n": 2}, blobs=BLOBS, cost=1.0))
    tiered.close()
    fresh = rm.TieredStore(Store(tmp_path / "b"), guarded(redis_url))
    got = fresh.get(KIND, KEY)
    assert got is not None and got.blobs == BLOBS and got.meta == {"n": 2} and fresh.last_tier == "remote"
    fresh.close()


def archive_with(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("case", CASES)
def test_archive_import_refuses(tmp_path, caplog, case):
    from lowercache.cache.archive import import_entries

    members = {f"blob/{digest(data)}": data for data in BLOBS.values()}
    archive_with(tmp_path / "good.tar", {**members, f"action/{KIND}/{KEY}.json": _GOOD.encode()})
    archive_with(tmp_path / "bad.tar", {**members, f"action/{KIND}/{KEY}.json": MALFORMED[case]})
    assert import_entries(Store(tmp_path / "good"), tmp_path / "good.tar") == 1  # the control: a valid record imports
    store = Store(tmp_path / "bad")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert import_entries(store, tmp_path / "bad.tar") == 0
    assert len(unusable(caplog, f"archive record action/{KIND}/{KEY}.json is unusable")) == 1, caplog.text
    assert store.get(KIND, KEY) is None


# -- lowerings that meet malformed records recompute the stock bytes ----------------------------

TARGET = "tosa-fp"
BROKEN = ("extra field", "blob digest upper case", "meta NaN", "cost huge integer", "wrong key")
"""Malformed forms for the end-to-end tests, one per action record, in turn."""


@functools.cache
def stock() -> bytes:
    return stock_tiny(TARGET)


def example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_example_records", ROOT / "examples" / "tiny_cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model()


def lower(cache_dir, **settings) -> lowercache.Artifacts:
    module, inputs = example()
    return lowercache.lower(module, inputs, target=TARGET, settings=Settings(cache_dir=cache_dir, **settings), listener=lambda *a: None)


def outcomes(artifacts: lowercache.Artifacts) -> dict[str, str]:
    return {r["kind"]: r["outcome"] for r in artifacts.records if r["kind"] in ("flow", "tosa")}


def malformed_for(kind: str, key: str, i: int) -> bytes:
    """A malformed stand-in for the record of ``kind``/``key`` (the cases above, filed under it)."""
    case = BROKEN[i % len(BROKEN)]
    return MALFORMED[case].replace(KIND.encode(), kind.encode(), 1).replace(KEY.encode(), key.encode())


def test_a_lowering_over_malformed_local_records_recomputes_stock_bytes(tmp_path, caplog):
    first = lower(tmp_path / "cache")
    assert first.pte == stock()
    store = Store(tmp_path / "cache")
    actions = list(store.actions())
    store.close()
    assert {"flow", "tosa"} <= {kind for kind, _ in actions}
    planted = diskcache.Cache(str(tmp_path / "cache" / "entries"))
    for i, (kind, key) in enumerate(actions):
        planted.set(f"action/{kind}/{key}", frame(malformed_for(kind, key, i)))
    planted.close()
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        again = lower(tmp_path / "cache")
    assert again.pte == stock()
    assert outcomes(again) == {"flow": "miss", "tosa": "miss"}
    warned = unusable(caplog, "is unusable")
    assert warned and len(warned) == len(unusable(caplog, "")) <= len(actions), caplog.text
    assert outcomes(lower(tmp_path / "cache")) == {"flow": "hit"}  # recomputed entries replaced them


def test_a_lowering_over_malformed_remote_records_recomputes_stock_bytes(tmp_path, redis_url, raw_redis, caplog, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", TEAM_KEY.decode())
    assert lower(tmp_path / "a", remote=redis_url).pte == stock()
    keys = sorted(k.decode()[len(rm.DEFAULT_PREFIX) :] for k in raw_redis.keys(f"{rm.DEFAULT_PREFIX}action/*"))
    assert any(k.startswith("action/flow/") for k in keys) and any(k.startswith("action/tosa/") for k in keys)
    writer = guarded(redis_url, "write-only")
    for i, name in enumerate(keys):
        _, kind, key = name.split("/", 2)
        assert writer.put(name, malformed_for(kind, key, i))
    writer.close()
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        got = lower(tmp_path / "b", remote=redis_url)
    assert got.pte == stock()
    assert outcomes(got) == {"flow": "miss", "tosa": "miss"}
    assert got.manifest["remote"]["refused"] >= 2  # the flow and tosa records at least
    assert unusable(caplog, "ignoring remote entry action/flow/")
    # The recomputed, signed records replaced the malformed ones: a third client is served by the remote.
    healed = lower(tmp_path / "c", remote=redis_url)
    assert healed.pte == stock() and outcomes(healed) == {"flow": "hit"}
    assert next(r for r in healed.records if r["kind"] == "flow")["tier"] == "remote"


def test_lowercache_import_of_malformed_records_then_lower_recomputes_stock_bytes(tmp_path):
    out = tmp_path / "out"
    assert cli("lower", TINY, "-t", TARGET, "-o", out, cache_dir=tmp_path / "a").returncode == 0
    exported = cli("export", tmp_path / "good.tar", cache_dir=tmp_path / "a")
    assert exported.returncode == 0, exported.stderr
    with tarfile.open(tmp_path / "good.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar}
    actions = [name for name in members if name.startswith("action/")]
    assert any(name.startswith("action/flow/") for name in actions)
    for i, name in enumerate(actions):
        _, kind, key = name[: -len(".json")].split("/", 2)
        members[name] = malformed_for(kind, key, i)
    archive_with(tmp_path / "bad.tar", members)

    imported = cli("import", tmp_path / "bad.tar", cache_dir=tmp_path / "b")
    assert imported.returncode == 0, imported.stderr
    warnings = [line for line in imported.stderr.splitlines() if "warning" in line]
    assert len(warnings) == len(actions) and all("is unusable" in line for line in warnings), imported.stderr
    store = Store(tmp_path / "b")
    assert list(store.actions()) == []
    store.close()
    lowered = cli("lower", TINY, "-t", TARGET, "-o", tmp_path / "out-b", cache_dir=tmp_path / "b")
    assert lowered.returncode == 0, lowered.stderr
    assert (tmp_path / "out-b" / "model.pte").read_bytes() == stock() == (out / "model.pte").read_bytes()


# -- run history under concurrent processes -----------------------------------------------------

_RECORDER = """
import os, sys, time
from pathlib import Path
from lowercache.cache import history
from lowercache.cache.store import Store

directory, worker, runs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
history.KEEP_RUNS = 1000  # so that pruning cannot hide a lost run
store = Store(directory / "cache")
(directory / f"ready-{worker}").touch()
while not (directory / "go").exists():
    time.sleep(0.001)
for i in range(runs):
    step = {"kind": "flow", "name": f"w{worker}-r{i}", "outcome": "miss", "key": "k", "parts": {"p": str(i)}, "seconds": 0.1}
    history.record_run(store, "model", "tosa-fp", [step])
"""

WORKERS, RUNS = 4, 25


def test_concurrent_processes_lose_no_run(tmp_path):
    Store(tmp_path / "cache").close()
    children = [
        subprocess.Popen([sys.executable, "-c", _RECORDER, str(tmp_path), str(w), str(RUNS)], stderr=subprocess.PIPE, text=True)
        for w in range(WORKERS)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < WORKERS and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    for child in children:
        _, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        assert "warning" not in err, err
    runs = Store(tmp_path / "cache").get_record("history/tosa-fp/model")
    names = sorted(run["steps"][0]["name"] for run in runs)
    assert names == sorted(f"w{w}-r{i}" for w in range(WORKERS) for i in range(RUNS))
    for w in range(WORKERS):  # each process's runs in the order it recorded them
        mine = [run["steps"][0]["name"] for run in runs if run["steps"][0]["name"].startswith(f"w{w}-")]
        assert mine == [f"w{w}-r{i}" for i in range(RUNS)]


def test_history_keeps_the_last_runs_and_reads_the_old_layout(tmp_path):
    store = Store(tmp_path)
    old = [{"time": 1.0, "steps": [{"kind": "flow", "name": "tosa-fp", "outcome": "miss", "key": "k0", "parts": {"graph": "a"}}], "passes": []}]
    store.put_record("history/tosa-fp/model", old)  # as every earlier release wrote it
    for i in range(history.KEEP_RUNS + 2):
        step = {"kind": "flow", "name": "tosa-fp", "outcome": "miss", "key": f"k{i + 1}", "parts": {"graph": "ab"[i % 2]}, "seconds": 0.1}
        history.record_run(store, "model", "tosa-fp", [step])
    runs = store.get_record("history/tosa-fp/model")
    assert len(runs) == history.KEEP_RUNS and runs[-1]["steps"][0]["key"] == f"k{history.KEEP_RUNS + 2}"
    assert history.explain(store, "model", "tosa-fp")[-1] == "flow tosa-fp: missed; changed: graph"


def test_read_only_history_writes_nothing(tmp_path):
    Store(tmp_path).close()
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    ro = Store(tmp_path, read_only=True)
    history.record_run(ro, "model", "tosa-fp", [{"kind": "flow", "name": "x", "outcome": "miss", "key": "k", "parts": {}, "seconds": 0.0}])
    ro.close()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before
    assert Store(tmp_path).get_record("history/tosa-fp/model") is None


def test_explain_leaves_out_malformed_runs(tmp_path):
    store = Store(tmp_path)
    good = [
        {"time": float(i), "steps": [{"kind": "flow", "name": "tosa-fp", "outcome": "miss", "key": f"k{i}", "parts": {"graph": g}}], "passes": []}
        for i, g in enumerate("ab")
    ]
    junk = ["run", {"steps": "flow"}, {"steps": [{"kind": "flow"}]}, {"steps": [], "passes": [["p", "ran", "1", {}]]}]
    store.put_record("history/tosa-fp/model", [good[0], *junk, good[1]])
    assert history.explain(store, "model", "tosa-fp")[-1] == "flow tosa-fp: missed; changed: graph"
    assert history.explain_passes(store, "model", "tosa-fp")[0].startswith("no recorded run")
    history.record_run(store, "model", "tosa-fp", [{**good[1]["steps"][0], "seconds": 0.1}])
    assert len(store.get_record("history/tosa-fp/model")) == 3  # the malformed runs are not carried on
