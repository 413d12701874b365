"""Faults of the shared remote tier (issue 30), reproduced against a real Redis and moto's S3.

Each test ends with the bytes of a clean lowering, or with what lowercache
promises instead (docs/faults.md): a forged entry is never served to a client
that checks signatures; a wrong key does not damage the shared cache; a
read-only client writes nothing anywhere; a remote hit needs no Arm import.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys

import pytest

import lowercache
from lowercache.api import open_store
from lowercache.bench import models
from lowercache.cache import remote as rm
from lowercache.cache.hashing import digest
from lowercache.cache.store import Store
from lowercache.config import Settings, load_settings

from tests.helpers.cli import TINY, cli, stock_tiny
from tests.helpers.oracle import reference


pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("through_server")]

KEY = "action/flow/" + "ab" * 16
TEAM_KEY = "team-secret"


@functools.lru_cache(maxsize=None)
def stock_example(target: str) -> bytes:
    """Stock bytes of examples/tiny_cnn.py, once per session."""
    return stock_tiny(target)


def warnings_with(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lowercache" and r.levelno == logging.WARNING and text in r.getMessage()]


def lower_tiny(target: str, cache_dir, **settings) -> lowercache.Artifacts:
    module, example = models.tiny_cnn()
    return lowercache.lower(module, example, target=target, settings=Settings(cache_dir=cache_dir, **settings), listener=lambda *a: None)


def flow_step(artifacts: lowercache.Artifacts) -> dict:
    return next(r for r in artifacts.records if r["kind"] == "flow")


def snapshot(client) -> dict[bytes, bytes]:
    return {k: client.get(k) for k in client.keys("*")}


# -- 1. a remote without a key is an explicit choice ----------------------------------------


@pytest.fixture
def forged_remote(tmp_path, redis_url):
    """The issue's forgery: an unsigned tosa-int flow record whose model.pte is tosa-fp's valid program."""
    int_key = flow_step(lower_tiny("tosa-int", tmp_path / "scratch"))["key"]
    fp_program = reference("tiny_cnn", "tosa-fp")
    forger = rm.connect(redis_url)  # no key: anyone who can reach the server
    assert forger.put(f"blob/{digest(fp_program)}", fp_program)
    record = {"kind": "flow", "key": int_key, "meta": {}, "blobs": {"model.pte": digest(fp_program)}, "cost": 9.0}
    assert forger.put(f"action/flow/{int_key}", json.dumps(record).encode())
    forger.close()
    assert fp_program != reference("tiny_cnn", "tosa-int")
    return redis_url


def test_forged_entry_is_not_served_without_a_key(tmp_path, forged_remote, caplog):
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        got = lower_tiny("tosa-int", tmp_path / "cache", remote=forged_remote)  # the default: signatures required
    assert got.pte == reference("tiny_cnn", "tosa-int")
    assert flow_step(got)["outcome"] == "miss"
    off = warnings_with(caplog, "is off")
    assert len(off) == 1 and "LOWERCACHE_HMAC_KEY" in off[0] and "LOWERCACHE_REMOTE_REQUIRE_SIGNED=0" in off[0]
    assert got.manifest["remote"]["hits"] == 0 and got.manifest["remote"]["off"]
    # Nothing forged reached the local cache either: a second run hits locally with the right bytes.
    again = lower_tiny("tosa-int", tmp_path / "cache", remote=forged_remote)
    assert flow_step(again)["tier"] == "local" and again.pte == reference("tiny_cnn", "tosa-int")


def test_forged_entry_is_refused_with_a_key_and_replaced(tmp_path, forged_remote, caplog, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", TEAM_KEY)
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        got = lower_tiny("tosa-int", tmp_path / "a", remote=forged_remote)
    assert got.pte == reference("tiny_cnn", "tosa-int")
    assert flow_step(got)["outcome"] == "miss"
    refused = warnings_with(caplog, "ignoring remote entry")
    assert len(refused) == 1 and "not signed" in refused[0]
    # An unsigned entry is no other key's: the recomputed, signed one replaced it.
    healed = lower_tiny("tosa-int", tmp_path / "b", remote=forged_remote)
    assert flow_step(healed)["tier"] == "remote" and healed.pte == reference("tiny_cnn", "tosa-int")
    assert healed.manifest["remote"]["refused"] == 0


def test_unsigned_use_is_a_choice_that_warns_once(tmp_path, forged_remote, caplog):
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        got = lower_tiny("tosa-int", tmp_path / "cache", remote=forged_remote, remote_require_signed=False)
    assert len(warnings_with(caplog, "unchecked")) == 1
    # Why the warning: without a key the remote's word is taken, forgeries included.
    assert got.pte == reference("tiny_cnn", "tosa-fp")


def test_cli_without_a_key_warns_once_and_lowers_correctly(tmp_path, redis_url):
    env = {"LOWERCACHE_REMOTE": redis_url}
    result = cli("lower", TINY, "-t", "tosa-fp", "-o", tmp_path / "out", cache_dir=tmp_path / "cache", env=env)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("lowercache: warning:")]
    assert len(warnings) == 1 and "LOWERCACHE_HMAC_KEY" in warnings[0], result.stderr
    assert (tmp_path / "out" / "model.pte").read_bytes() == stock_example("tosa-fp")

    unsigned = {**env, "LOWERCACHE_REMOTE_REQUIRE_SIGNED": "0"}
    for out, cache in (("a", "cache-a"), ("b", "cache-b")):  # b: many entries read unchecked, one warning
        result = cli("lower", TINY, "-t", "tosa-fp", "-o", tmp_path / out, cache_dir=tmp_path / cache, env=unsigned)
        assert result.returncode == 0, result.stderr
    assert result.stderr.count("unchecked") == 1, result.stderr
    assert (tmp_path / "b" / "model.pte").read_bytes() == stock_example("tosa-fp")


def test_config_shows_the_setting(tmp_path):
    result = cli("config", cache_dir=tmp_path / "cache", env={"LOWERCACHE_REMOTE_REQUIRE_SIGNED": "no"})
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("remote_require_signed"))
    assert "false" in line and "env LOWERCACHE_REMOTE_REQUIRE_SIGNED" in line
    assert load_settings(cache_dir=tmp_path).remote_require_signed is True
    bad = cli("config", cache_dir=tmp_path / "cache", env={"LOWERCACHE_REMOTE_REQUIRE_SIGNED": "maybe"})
    assert bad.returncode == 2 and "remote_require_signed" in bad.stderr


# -- 2. a wrong key does not thrash the shared cache ------------------------------------------


def test_wrong_key_client_leaves_the_shared_cache_intact(tmp_path, redis_url, raw_redis, monkeypatch, caplog):
    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", TEAM_KEY)
    lower_tiny("tosa-int", tmp_path / "good", remote=redis_url)
    before = snapshot(raw_redis)

    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", "an-old-secret")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        wrong = lower_tiny("tosa-int", tmp_path / "wrong", remote=redis_url)
    assert wrong.pte == reference("tiny_cnn", "tosa-int")
    assert wrong.manifest["remote"]["key_probably_wrong"]
    assert len(warnings_with(caplog, "probably wrong")) == 1
    after = snapshot(raw_redis)
    assert {k: after.get(k) for k in before} == before  # no entry overwritten

    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", TEAM_KEY)
    good = lower_tiny("tosa-int", tmp_path / "fresh", remote=redis_url)
    assert flow_step(good)["tier"] == "remote"
    assert good.manifest["remote"]["hits"] >= 2 and good.manifest["remote"]["refused"] == 0
    assert good.pte == reference("tiny_cnn", "tosa-int")


def test_wrong_key_does_not_overwrite_entries_read_or_unread(any_url):
    good = rm.connect(any_url, hmac_key=b"A")
    assert good.put(KEY, b"data") and good.put("blob/" + "0" * 32, b"blob")
    wrong = rm.connect(any_url, hmac_key=b"B")
    assert wrong.get(KEY) is None and wrong.mismatched == 1
    assert not wrong.put(KEY, b"other data")  # read and found signed with another key
    assert wrong.put("blob/" + "0" * 32, b"other blob")  # not read: a present value is left as it is
    assert wrong.writes == 0
    reader = rm.connect(any_url, hmac_key=b"A")
    assert reader.get(KEY) == b"data" and reader.get("blob/" + "0" * 32) == b"blob"


class DictRemote(rm.Remote):
    """A backend with only get and put: the base class's look-first ``add`` serves it."""

    name = "dict://"

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def get(self, key):
        return self.values.get(key)

    def put(self, key, data):
        self.values[key] = data


def test_backend_without_conditional_writes_is_not_overwritten_either():
    backend = DictRemote()
    assert rm.Guarded(backend, hmac_key=b"A").put(KEY, b"data")
    stored = dict(backend.values)
    wrong = rm.Guarded(backend, hmac_key=b"B")
    assert wrong.put(KEY, b"other") and wrong.writes == 0
    assert backend.values == stored
    assert wrong.put("blob/" + "1" * 32, b"new") and wrong.writes == 1


def test_wrong_key_stops_writing_after_most_reads_fail(redis_url, caplog):
    good = rm.connect(redis_url, hmac_key=b"A")
    for i in range(3):
        good.put(f"action/x/{i:032x}", b"data")
    wrong = rm.connect(redis_url, hmac_key=b"B")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        for i in range(2):
            assert wrong.get(f"action/x/{i:032x}") is None
        assert wrong.can_write  # two mismatches may be tampering
        assert wrong.get(f"action/x/{2:032x}") is None
        assert not wrong.can_write and not wrong.put("action/new/" + "1" * 32, b"new")
        wrong.get(f"action/x/{0:032x}")
    assert len(warnings_with(caplog, "probably wrong")) == 1
    assert wrong.stats()["key_probably_wrong"] and not wrong.off
    assert good.get(f"action/x/{0:032x}") == b"data"


def test_a_right_key_with_a_few_tampered_entries_keeps_writing(redis_url, raw_redis):
    good = rm.connect(redis_url, hmac_key=b"A")
    for i in range(8):
        good.put(f"action/x/{i:032x}", b"data")
    for i in range(3):  # tampered: altered after signing
        stored = bytearray(raw_redis.get(f"lowercache/action/x/{i:032x}"))
        stored[-1] ^= 0xFF
        raw_redis.set(f"lowercache/action/x/{i:032x}", bytes(stored))
    reader = rm.connect(redis_url, hmac_key=b"A")
    assert [reader.get(f"action/x/{i:032x}") for i in range(3, 8)] == [b"data"] * 5
    assert all(reader.get(f"action/x/{i:032x}") is None for i in range(3))
    assert reader.can_write and not reader.key_probably_wrong


def test_write_only_refresh_replaces_entries_of_an_old_key(any_url):
    rm.connect(any_url, hmac_key=b"old").put(KEY, b"data")
    assert rm.connect(any_url, hmac_key=b"new", mode="write-only").put(KEY, b"data")
    assert rm.connect(any_url, hmac_key=b"new").get(KEY) == b"data"


def test_damaged_entry_is_replaced_by_the_client_that_found_it(redis_url, raw_redis):
    raw_redis.set(f"lowercache/{KEY}", b"junk")
    remote = rm.connect(redis_url, hmac_key=b"A")
    assert remote.get(KEY) is None and remote.mismatched == 0
    assert remote.put(KEY, b"data") and remote.writes == 1
    assert rm.connect(redis_url, hmac_key=b"A").get(KEY) == b"data"


# -- 3. read-only means read-only for every tier -----------------------------------------------


def test_read_only_writes_nothing_to_the_remote(tmp_path, redis_url, raw_redis):
    env = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": TEAM_KEY}
    assert cli("lower", TINY, "-t", "tosa-fp", "-o", tmp_path / "a", cache_dir=tmp_path / "a-cache", env=env).returncode == 0
    before = snapshot(raw_redis)
    assert before
    result = cli(
        "lower", TINY, "-t", "tosa-int", "-o", tmp_path / "b", cache_dir=tmp_path / "b-cache",
        env={**env, "LOWERCACHE_READ_ONLY": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert snapshot(raw_redis) == before
    assert (tmp_path / "b" / "model.pte").read_bytes() == stock_example("tosa-int")


def test_read_only_settings_make_the_remote_read_only(tmp_path, redis_url):
    for mode in ("read-write", "read-only"):
        store = open_store(Settings(cache_dir=tmp_path / "c", read_only=True, remote=redis_url, remote_mode=mode))
        assert store.remote.mode == "read-only" and not store.remote.can_write
        store.close()
    store = open_store(Settings(cache_dir=tmp_path / "c", read_only=True, remote=redis_url, remote_mode="write-only"))
    assert isinstance(store, Store)  # nothing it may do with a write-only remote
    store.close()


# -- 4. the compile-spec memo travels through the remote -------------------------------------------

_REMOTE_HIT = """
import json, sys
import lowercache
from lowercache.bench import models
from lowercache.cache.hashing import digest
from lowercache.config import Settings

def arm_modules():
    return sorted(m for m in sys.modules if m.startswith("executorch.backends.arm"))

at_hit = []

def listener(phase, record, label):
    if phase == "end" and record is not None and record.kind == "flow":
        at_hit.extend(arm_modules())

module, example = models.tiny_cnn()
got = lowercache.lower(module, example, target=sys.argv[1], settings=Settings(cache_dir=sys.argv[2], remote=sys.argv[3]),
                       listener=listener)
flow = next(r for r in got.records if r["kind"] == "flow")
print(json.dumps({"outcome": flow["outcome"], "tier": flow["tier"], "pte": digest(got.pte),
                  "arm_at_hit": at_hit, "arm_at_end": arm_modules()}))
"""


@pytest.mark.parametrize("target", ["tosa-fp", "tosa-int"])
def test_remote_hit_on_an_empty_cache_imports_no_arm_backend(tmp_path, redis_url, monkeypatch, target):
    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", TEAM_KEY)
    lower_tiny(target, tmp_path / "filler", remote=redis_url)
    child = subprocess.run(
        [sys.executable, "-c", _REMOTE_HIT, target, str(tmp_path / "empty"), redis_url],
        capture_output=True, text=True, timeout=600,  # this process's thread settings: the count is a key part
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert (seen["outcome"], seen["tier"]) == ("hit", "remote")
    assert seen["arm_at_hit"] == []
    assert seen["arm_at_end"] == [], "something after the hit (a manifest field?) imported the Arm backend"
    assert seen["pte"] == digest(reference("tiny_cnn", target))


def test_memo_record_is_shared_checked_and_kept(tmp_path, redis_url, raw_redis, caplog):
    name = "memo/compile_spec/tosa-fp/" + "0" * 32
    writer = rm.TieredStore(Store(tmp_path / "a"), rm.connect(redis_url, hmac_key=b"A"))
    writer.put_record(name, "f" * 32)
    writer.put_record("runs/tiny/tosa-fp", ["local only"])
    assert raw_redis.keys("lowercache/record/*") == [f"lowercache/record/{name}".encode()]
    reader = rm.TieredStore(Store(tmp_path / "b"), rm.connect(redis_url, hmac_key=b"A"))
    assert reader.get_record(name) == "f" * 32 and reader.remote.hits == 1
    assert reader.local.get_record(name) == "f" * 32  # kept locally
    assert reader.get_record("runs/tiny/tosa-fp") is None
    other = rm.TieredStore(Store(tmp_path / "c"), rm.connect(redis_url, hmac_key=b"B"))
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert other.get_record(name) is None  # signed with another key: refused like any entry
    assert other.remote.refused == 1


def test_write_only_refresh_re_signs_memo_records(tmp_path, redis_url):
    name = "memo/compile_spec/tosa-fp/" + "0" * 32
    rm.TieredStore(Store(tmp_path / "a"), rm.connect(redis_url, hmac_key=b"old")).put_record(name, "f" * 32)
    refresh = rm.TieredStore(Store(tmp_path / "a"), rm.connect(redis_url, hmac_key=b"new", mode="write-only"))
    assert refresh.get_record(name) == "f" * 32 and refresh.remote.writes == 1
    reader = rm.TieredStore(Store(tmp_path / "b"), rm.connect(redis_url, hmac_key=b"new"))
    assert reader.get_record(name) == "f" * 32


def test_memo_value_that_is_not_a_digest_is_recomputed(tmp_path):
    from lowercache.lowering import arm, flow
    from lowercache.targets import resolve

    target = resolve("tosa-fp")
    store = Store(tmp_path / "c")
    name = f"memo/compile_spec/tosa-fp/{flow.digest_json(flow.toolchain_parts())}"
    store.put_record(name, "not a digest")
    assert flow.target_spec_digest(target, store) == arm.compile_spec_digest(target.compile_spec())
    store.close()
