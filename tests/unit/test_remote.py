"""The remote tier against real servers on loopback: Redis, S3 (moto), and broken ones."""

from __future__ import annotations

import logging
import shutil
import threading
import time

import pytest

from lowercache.cache import remote as rm
from lowercache.errors import LowercacheError
from lowercache.cache.store import Entry, Store

from tests.helpers.services import BUCKET, RedisServer, SilentServer, free_port


pytestmark = pytest.mark.timeout(120)

COMPRESSIBLE = b"tosa.conv2d weights " * 5000
KEY = "action/flow/" + "ab" * 16


def remote_warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lowercache" and r.levelno == logging.WARNING and text in r.getMessage()]


# -- servers -------------------------------------------------------------------


class Spy(rm.Remote):
    """Delegates to a remote and records which calls reached it."""

    def __init__(self, inner: rm.Remote):
        self.inner, self.name, self.calls = inner, inner.name, []

    def get(self, key):
        self.calls.append("get")
        return self.inner.get(key)

    def put(self, key, data):
        self.calls.append("put")
        self.inner.put(key, data)


class Stuck(rm.Remote):
    """A remote whose calls never return, as when a DNS lookup hangs."""

    name = "stuck://"

    def __init__(self):
        self.release = threading.Event()

    def get(self, key):
        self.release.wait()

    def put(self, key, data):
        self.release.wait()


# -- wire format -----------------------------------------------------------------


@pytest.mark.quick
def test_seal_round_trip_signed_and_unsigned():
    bound = rm.digest_key(KEY)
    assert rm.unseal(rm.seal(COMPRESSIBLE, None, bound), None, bound) == COMPRESSIBLE
    assert rm.unseal(rm.seal(COMPRESSIBLE, b"A", bound), b"A", bound) == COMPRESSIBLE
    assert rm.unseal(rm.seal(b"", b"A", bound), b"A", bound) == b""


def test_seal_compresses():
    assert len(rm.seal(COMPRESSIBLE, b"A", rm.digest_key(KEY))) < len(COMPRESSIBLE) // 10


@pytest.mark.parametrize(
    "blob, error",
    [(b"", rm.BadHeader), (b"LCR", rm.BadHeader), (b"XXXX" + bytes(100), rm.BadHeader), (b"\x80\x04K\x01.", rm.BadHeader)],
)
def test_unseal_refuses_what_is_not_a_sealed_value(blob, error):
    with pytest.raises(error):
        rm.unseal(blob, None, None)


@pytest.mark.quick
def test_unseal_checks_the_signature():
    bound = rm.digest_key(KEY)
    signed_a = rm.seal(b"data", b"key A", bound)
    with pytest.raises(rm.BadSignature):
        rm.unseal(signed_a, b"key B", bound)
    with pytest.raises(rm.BadSignature, match="not signed"):
        rm.unseal(rm.seal(b"data", None, bound), b"key A", bound)
    assert rm.unseal(signed_a, None, bound) == b"data"  # nothing to check it against


def test_unseal_refuses_altered_bytes():
    bound = rm.digest_key(KEY)
    for hmac_key, error in ((b"A", rm.BadSignature), (None, rm.BadContent)):
        sealed = bytearray(rm.seal(COMPRESSIBLE, hmac_key, bound))
        sealed[-20] ^= 0x01
        with pytest.raises(error):
            rm.unseal(bytes(sealed), hmac_key, bound)


def test_unseal_refuses_a_value_sealed_for_another_key():
    sealed = rm.seal(b"data", b"A", rm.digest_key("blob/" + "1" * 32))
    with pytest.raises(rm.WrongKey):
        rm.unseal(sealed, b"A", rm.digest_key("blob/" + "2" * 32))
    with pytest.raises(rm.WrongKey):
        rm.unseal(rm.seal(b"data", b"A"), b"A", rm.digest_key(KEY))


def test_unseal_caps_the_decompressed_size():
    bomb = rm.seal(bytes(16 * 2**20), None)
    assert len(bomb) < 2**16
    with pytest.raises(rm.EntryTooLarge):
        rm.unseal(bomb, None, None, max_size=2**20)


def test_unseal_does_not_trust_the_size_in_an_unsigned_header():
    sealed = bytearray(rm.seal(bytes(16 * 2**20), None))
    size_at = 4 + 1 + 16 + 16
    sealed[size_at : size_at + 8] = (100).to_bytes(8, "big")
    with pytest.raises(rm.BadContent, match="more bytes"):
        rm.unseal(bytes(sealed), None, None)


# -- URLs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/x",
        "cache.example.com",
        "",
        "redis://",
        "redis://:secret@/0",
        "redis://host:99999/0",
        "redis://host:port/0",
        "redis://host:6379/zero",
        "s3://",
        "s3://Bad_Bucket/x",
        "s3://user:secret@bucket/x",
        "s3://bucket/x?versionId=1",
    ],
)
def test_open_remote_rejects_bad_urls_in_one_line(url):
    with pytest.raises(LowercacheError) as caught:
        rm.open_remote(url)
    message = str(caught.value)
    assert "\n" not in message and "secret" not in message


def test_open_remote_parses_urls(s3_env):
    redis_remote = rm.open_remote("redis://:secret@127.0.0.1:6390/2", ttl_seconds=60, timeout=1.0)
    assert isinstance(redis_remote, rm.RedisRemote) and "secret" not in redis_remote.name
    assert redis_remote.ttl_seconds == 60 and redis_remote.prefix == "lowercache/"
    s3 = rm.open_remote("s3://my-bucket/team/ci/", endpoint_url="http://127.0.0.1:1")
    assert isinstance(s3, rm.S3Remote) and (s3.bucket, s3.prefix) == ("my-bucket", "team/ci/")
    assert rm.open_remote("s3://my-bucket").prefix == "lowercache/"
    assert rm.open_remote("s3://my-bucket", ttl_seconds=None).prefix == "lowercache/"  # unset options pass through
    with pytest.raises(LowercacheError, match="ttl_seconds"):
        rm.open_remote("s3://my-bucket", ttl_seconds=60)
    with pytest.raises(LowercacheError, match="mode"):
        rm.connect("redis://127.0.0.1:6390/0", mode="append-only")


def test_hmac_key_from_env():
    assert rm.hmac_key_from_env({}) is None
    assert rm.hmac_key_from_env({rm.ENV_HMAC_KEY: ""}) is None
    assert rm.hmac_key_from_env({rm.ENV_HMAC_KEY: "s3cret"}) == b"s3cret"


# -- both backends -------------------------------------------------------------------------


def test_round_trip(any_url):
    remote = rm.connect(any_url, hmac_key=b"A")
    assert remote.get(KEY) is None
    assert remote.put(KEY, COMPRESSIBLE)
    assert remote.get(KEY) == COMPRESSIBLE
    assert (remote.hits, remote.misses, remote.writes, remote.errors) == (1, 1, 1, 0)
    assert 0 < remote.bytes_written == remote.bytes_read < len(COMPRESSIBLE)
    assert not remote.off
    remote.close()


def test_read_only_writes_nothing(any_url):
    writer, reader = rm.connect(any_url), rm.connect(any_url, mode="read-only")
    assert not reader.put(KEY, b"data")
    assert writer.get(KEY) is None
    writer.put(KEY, b"data")
    assert reader.get(KEY) == b"data"
    assert reader.writes == 0


def test_write_only_reads_nothing(any_url):
    spy = Spy(rm.open_remote(any_url))
    recache = rm.Guarded(spy, mode="write-only")
    assert recache.put(KEY, b"data")
    assert recache.get(KEY) is None
    assert spy.calls == ["put"]
    assert rm.connect(any_url).get(KEY) == b"data"


def test_entry_signed_with_another_key_is_refused(any_url, caplog):
    rm.connect(any_url, hmac_key=b"key A").put(KEY, b"data")
    other = rm.connect(any_url, hmac_key=b"key B")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert other.get(KEY) is None
    assert len(remote_warnings(caplog, "signature does not match")) == 1
    assert (other.refused, other.misses, other.hits) == (1, 1, 0)
    assert not other.off  # a bad entry is not a fault


def test_unsigned_entry_is_refused_when_a_key_is_required(any_url, caplog):
    rm.connect(any_url).put(KEY, b"data")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert rm.connect(any_url, hmac_key=b"key A").get(KEY) is None
    assert len(remote_warnings(caplog, "not signed")) == 1


def test_refusal_warnings_are_capped(redis_url, raw_redis, caplog):
    for i in range(12):
        raw_redis.set(f"lowercache/blob/{i:032x}", b"junk")
    remote = rm.connect(redis_url)
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert all(remote.get(f"blob/{i:032x}") is None for i in range(12))
    assert len(remote_warnings(caplog, "ignoring remote entry")) == 10
    assert len(remote_warnings(caplog, "not reported")) == 1
    assert remote.refused == 12 and not remote.off


def test_s3_object_too_large_to_be_an_entry_is_refused_unread(s3_url):
    rm.connect(s3_url).put(KEY, COMPRESSIBLE)
    backend = rm.open_remote(s3_url)
    backend.max_value_size = 10  # below any sealed value
    remote = rm.Guarded(backend)
    assert remote.get(KEY) is None
    assert remote.refused == 1 and not remote.off


# -- Redis specifics --------------------------------------------------------------------------


def test_redis_stores_compressed_values_under_the_prefix(redis_url, raw_redis):
    rm.connect(redis_url).put(KEY, COMPRESSIBLE)
    assert raw_redis.keys() == [f"lowercache/{KEY}".encode()]
    assert raw_redis.strlen(f"lowercache/{KEY}") < len(COMPRESSIBLE) // 10


def test_redis_ttl(redis_url, raw_redis):
    rm.connect(redis_url, ttl_seconds=100).put(KEY, b"data")
    assert 0 < raw_redis.ttl(f"lowercache/{KEY}") <= 100
    rm.connect(redis_url).put("blob/" + "0" * 32, b"data")
    assert raw_redis.ttl("lowercache/blob/" + "0" * 32) == -1  # no TTL: kept until evicted


@pytest.mark.quick
def test_tampered_redis_value_is_refused(redis_url, raw_redis, caplog):
    remote = rm.connect(redis_url, hmac_key=b"A")
    remote.put(KEY, COMPRESSIBLE)
    stored = bytearray(raw_redis.get(f"lowercache/{KEY}"))
    stored[-1] ^= 0xFF
    raw_redis.set(f"lowercache/{KEY}", bytes(stored))
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert remote.get(KEY) is None
    assert len(remote_warnings(caplog, "ignoring remote entry")) == 1


def test_value_copied_to_another_key_is_refused(redis_url, raw_redis):
    remote = rm.connect(redis_url, hmac_key=b"A")
    remote.put(KEY, b"output of step one")
    other = "action/flow/" + "cd" * 16
    raw_redis.set(f"lowercache/{other}", raw_redis.get(f"lowercache/{KEY}"))
    assert remote.get(other) is None
    assert remote.refused == 1


def test_planted_pickle_is_refused(redis_url, raw_redis):
    import pickle

    raw_redis.set(f"lowercache/{KEY}", pickle.dumps({"x": 1}))
    remote = rm.connect(redis_url)
    assert remote.get(KEY) is None
    assert remote.refused == 1


def test_s3_stores_under_the_url_prefix(s3_url, moto_endpoint):
    import boto3

    remote = rm.connect(s3_url)
    remote.put(KEY, COMPRESSIBLE)
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    prefix = s3_url.split("/", 3)[3]
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    assert [o["Key"] for o in listed] == [f"{prefix}/{KEY}"]
    assert listed[0]["Size"] < len(COMPRESSIBLE) // 10


# -- faults ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["redis", "s3"])
def test_unreachable_remote_turns_off_once(scheme, s3_env, caplog):
    port = free_port()  # nothing listens there
    if scheme == "redis":
        remote = rm.connect(f"redis://127.0.0.1:{port}/0")
    else:
        remote = rm.connect(f"s3://{BUCKET}/x", endpoint_url=f"http://127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        started = time.monotonic()
        assert remote.get(KEY) is None
        assert time.monotonic() - started < 5
        assert remote.off and remote.off_reason
        assert not remote.put(KEY, b"data")
        assert remote.get(KEY) is None
    assert len(remote_warnings(caplog, "is off")) == 1
    assert "continuing with the local cache" in remote_warnings(caplog, "is off")[0]


def test_redis_killed_mid_use(caplog):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer()
    try:
        remote = rm.connect(server.url, hmac_key=b"A")
        assert remote.put(KEY, b"data") and remote.get(KEY) == b"data"
        server.kill()
        with caplog.at_level(logging.WARNING, logger="lowercache"):
            started = time.monotonic()
            assert remote.get(KEY) is None
            assert not remote.put(KEY, b"data")
            assert remote.get(KEY) is None
            assert time.monotonic() - started < 5
    finally:
        server.kill()
    assert remote.off and remote.errors == 1
    assert len(remote_warnings(caplog, "is off")) == 1


@pytest.mark.parametrize("scheme", ["redis", "s3"])
def test_silent_remote_times_out(scheme, s3_env, caplog):
    server = SilentServer()
    try:
        if scheme == "redis":
            remote = rm.connect(f"redis://127.0.0.1:{server.port}/0", timeout=0.5)
        else:
            remote = rm.connect(f"s3://{BUCKET}/x", endpoint_url=f"http://127.0.0.1:{server.port}", timeout=0.5)
        with caplog.at_level(logging.WARNING, logger="lowercache"):
            started = time.monotonic()
            assert remote.get(KEY) is None
            assert time.monotonic() - started < 3
            started = time.monotonic()
            assert not remote.put(KEY, b"data")  # off: returns at once
            assert time.monotonic() - started < 0.1
    finally:
        server.close()
    assert remote.off
    assert len(remote_warnings(caplog, "is off")) == 1


def test_deadline_bounds_a_call_that_never_returns(caplog):
    stuck = Stuck()
    remote = rm.Guarded(stuck, deadline=0.3)
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        started = time.monotonic()
        assert remote.get(KEY) is None
        assert time.monotonic() - started < 2
    assert remote.off and "RemoteTimeout" in remote.off_reason
    stuck.release.set()


# -- the tiered store ------------------------------------------------------------------------


def make_entry() -> Entry:
    return Entry(meta={"target": "tosa-int", "ops": 3}, blobs={"pte": COMPRESSIBLE, "log": b"ok"}, cost=1.5)


def test_remote_hit_is_written_back_locally(redis_url, tmp_path):
    entry = make_entry()
    ci = rm.TieredStore(Store(tmp_path / "ci"), rm.connect(redis_url, hmac_key=b"A"))
    assert ci.put("flow", "k1", entry)
    laptop = rm.TieredStore(Store(tmp_path / "laptop"), rm.connect(redis_url, hmac_key=b"A"))
    assert laptop.local.get("flow", "k1") is None
    got = laptop.get("flow", "k1")
    assert got is not None and got.digest() == entry.digest() and got.cost == entry.cost
    assert laptop.remote.hits == 3  # the record and two blobs
    assert laptop.local.get("flow", "k1").digest() == entry.digest()
    assert laptop.get("flow", "missing") is None
    ci.close()
    laptop.close()


def test_equal_blobs_are_uploaded_once(redis_url, raw_redis, tmp_path):
    tiered = rm.TieredStore(Store(tmp_path / "c"), rm.connect(redis_url))
    tiered.put("flow", "k1", make_entry())
    tiered.put("flow", "k2", make_entry())
    assert tiered.remote.writes == 4  # two blobs, two records
    assert len(raw_redis.keys("lowercache/blob/*")) == 2


def test_tiered_store_with_a_dead_remote_uses_the_local_cache(tmp_path, caplog):
    tiered = rm.TieredStore(Store(tmp_path / "c"), rm.connect(f"redis://127.0.0.1:{free_port()}/0"))
    entry = make_entry()
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert tiered.get("flow", "k1") is None
        assert tiered.put("flow", "k1", entry)
        assert tiered.get("flow", "k1").digest() == entry.digest()
    assert tiered.remote.off
    assert len(remote_warnings(caplog, "is off")) == 1


def test_remote_blob_with_other_content_is_a_miss(redis_url, raw_redis, tmp_path, caplog):
    entry = make_entry()
    rm.TieredStore(Store(tmp_path / "a"), rm.connect(redis_url)).put("flow", "k1", entry)
    from lowercache.cache.hashing import digest

    # A writer without the signing key can still seal a wrong blob; the digest check catches it.
    key = f"blob/{digest(b'ok')}"
    raw_redis.set(f"lowercache/{key}", rm.seal(b"not ok", None, rm.digest_key(key)))
    reader = rm.TieredStore(Store(tmp_path / "b"), rm.connect(redis_url))
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        assert reader.get("flow", "k1") is None
    assert len(remote_warnings(caplog, "other content")) == 1
    assert reader.local.get("flow", "k1") is None


def test_tiered_modes(redis_url, raw_redis, tmp_path):
    entry = make_entry()
    untrusted = rm.TieredStore(Store(tmp_path / "a"), rm.connect(redis_url, mode="read-only"))
    assert untrusted.put("flow", "k1", entry)
    assert raw_redis.dbsize() == 0
    refresh = rm.TieredStore(Store(tmp_path / "a"), rm.connect(redis_url, mode="write-only"))
    assert refresh.get("flow", "k1").digest() == entry.digest()  # a local hit, pushed to the remote
    assert refresh.remote.writes == 3 and refresh.remote.hits == 0
    fresh = rm.TieredStore(Store(tmp_path / "b"), rm.connect(redis_url, mode="read-only"))
    assert fresh.get("flow", "k1").digest() == entry.digest()
