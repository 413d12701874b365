"""The shared cache end to end: separate local caches sharing a real Redis or S3 (moto)."""

from __future__ import annotations

import json
import logging

import pytest

import lowercache
from lowercache.bench import models
from lowercache.config import Settings

from tests.helpers.cli import TINY, cli, stock_tiny
from tests.helpers.oracle import reference
from tests.helpers.services import RedisServer, free_port

pytestmark = pytest.mark.usefixtures("through_server")


def flow_record(out):
    steps = json.loads((out / "manifest.json").read_text())["steps"]
    return next(s for s in steps if s["kind"] == "flow")


def test_second_machine_lowers_from_redis(tmp_path, redis_url):
    import redis

    env = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": "team-secret"}
    first = cli("lower", TINY, "-t", "ethos-u55-128", "-o", tmp_path / "a", cache_dir=tmp_path / "cache-a", env=env)
    assert first.returncode == 0, first.stderr
    assert flow_record(tmp_path / "a")["outcome"] == "miss"

    second = cli("lower", TINY, "-t", "ethos-u55-128", "-o", tmp_path / "b", cache_dir=tmp_path / "cache-b", env=env)
    assert second.returncode == 0, second.stderr
    record = flow_record(tmp_path / "b")
    assert record["outcome"] == "hit" and record["tier"] == "remote"
    assert (tmp_path / "b" / "model.pte").read_bytes() == stock_tiny("ethos-u55-128")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["remote"]["hits"] > 0 and manifest["remote"]["bytes_read"] > 0

    # The remote hit was written back: a third run on machine B needs no remote.
    third = cli("lower", TINY, "-t", "ethos-u55-128", "-o", tmp_path / "b", cache_dir=tmp_path / "cache-b")
    assert flow_record(tmp_path / "b")["tier"] == "local", third.stderr

    stats = cli("stats", cache_dir=tmp_path / "cache-b")
    assert "remote" in stats.stdout

    # Read-only (a pull request job): lowers, writes nothing to the remote.
    client = redis.Redis.from_url(redis_url)
    keys_before = set(client.keys("*"))
    ro = cli(
        "lower", TINY, "-t", "tosa-int", "-o", tmp_path / "c", cache_dir=tmp_path / "cache-c",
        env={**env, "LOWERCACHE_REMOTE_MODE": "read-only"},
    )
    assert ro.returncode == 0, ro.stderr
    assert set(client.keys("*")) == keys_before
    client.close()


def test_wrongly_signed_remote_entries_are_refused_and_recomputed(tmp_path, redis_url):
    writer = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": "team-secret"}
    assert cli("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "a", cache_dir=tmp_path / "a-cache", env=writer).returncode == 0
    reader = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": "another-secret"}
    result = cli("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "b", cache_dir=tmp_path / "b-cache", env=reader)
    assert result.returncode == 0, result.stderr
    assert "signature" in result.stderr and "lowercache: warning:" in result.stderr
    assert flow_record(tmp_path / "b")["outcome"] == "miss"
    assert (tmp_path / "b" / "model.pte").read_bytes() == stock_tiny("tosa-int")


def test_redis_killed_mid_run(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", "team-secret")
    server = RedisServer()
    killed = []

    def kill_when_lowering(phase, record, label):
        if phase == "stage" and label == "to_edge" and not killed:
            server.kill()
            killed.append(label)

    module, example = models.tiny_cnn()
    try:
        with caplog.at_level(logging.WARNING, logger="lowercache"):
            artifacts = lowercache.lower(
                module, example, target="ethos-u55-128",
                settings=Settings(cache_dir=tmp_path / "cache", remote=server.url),
                listener=kill_when_lowering,
            )
    finally:
        server.kill()
    assert killed
    assert artifacts.pte == reference("tiny_cnn", "ethos-u55-128")
    assert artifacts.manifest["remote"]["off"] is True
    off = [r for r in caplog.records if "is off" in r.getMessage()]
    assert len(off) == 1


def test_s3_round_trip(tmp_path, s3_url, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", "team-secret")
    module, example = models.tiny_cnn()
    first = lowercache.lower(
        module, example, target="tosa-fp", settings=Settings(cache_dir=tmp_path / "a", remote=s3_url), listener=lambda *a: None
    )
    second = lowercache.lower(
        module, example, target="tosa-fp", settings=Settings(cache_dir=tmp_path / "b", remote=s3_url), listener=lambda *a: None
    )
    flow = [r for r in second.records if r["kind"] == "flow"][0]
    assert flow["outcome"] == "hit" and flow["tier"] == "remote"
    assert second.pte == first.pte == reference("tiny_cnn", "tosa-fp")


def test_unreachable_remote_is_a_warning_not_a_failure(tmp_path):
    result = cli(
        "lower", TINY, "-t", "tosa-fp", "-o", tmp_path / "out", cache_dir=tmp_path / "cache",
        env={"LOWERCACHE_REMOTE": f"redis://127.0.0.1:{free_port()}/0", "LOWERCACHE_HMAC_KEY": "team-secret"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("is off") == 1
    assert (tmp_path / "out" / "model.pte").read_bytes() == stock_tiny("tosa-fp")


@pytest.mark.parametrize("url", ["redis://", "ftp://somewhere/x"])
def test_malformed_remote_url_is_a_one_line_error(tmp_path, url):
    result = cli("lower", TINY, "-t", "tosa-fp", "-o", tmp_path / "out", cache_dir=tmp_path / "cache", env={"LOWERCACHE_REMOTE": url})
    assert result.returncode == 2
    assert len([line for line in result.stderr.splitlines() if line.startswith("lowercache: error:")]) == 1
    assert not (tmp_path / "out").exists()


def test_redis_ttl_from_settings(tmp_path, redis_url, monkeypatch):
    import redis

    monkeypatch.setenv("LOWERCACHE_REMOTE", redis_url)
    monkeypatch.setenv("LOWERCACHE_REMOTE_TTL", "3600")
    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", "team-secret")
    from lowercache.api import open_store
    from lowercache.config import load_settings
    from lowercache.cache.store import Entry

    store = open_store(load_settings(cache_dir=tmp_path / "cache"))
    store.put("flow", "c" * 32, Entry(blobs={"model.pte": b"x"}))
    store.close()
    client = redis.Redis.from_url(redis_url)
    ttls = [client.ttl(k) for k in client.keys("*")]
    client.close()
    assert ttls and all(0 < t <= 3600 for t in ttls)
