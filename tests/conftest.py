"""Fixtures for every tier: each test's own settings and cache, real Redis and S3 servers on loopback, and the tier
markers (``unit``, ``flow``, ``process``, ``env``) set from the folder a test lives in. Shared helpers are in
``tests/helpers/``; the stock oracle is ``tests/helpers/oracle.py``."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import references
from tests.helpers.isolation import isolate
from tests.helpers.services import BUCKET, RedisServer, start_moto


# A suite started as a background job (`pytest ... &` from a script) inherits SIGINT ignored, and so would every
# command it starts: the Ctrl-C tests would see a command that cannot be interrupted. The tests model a user at a
# terminal, so SIGINT is caught here; a caught signal is reset to the default in every program the tests start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every process of a test run computes at one thread count: the pytest workers and, through the variable, every program
# the tests start. The count is a key part (docs/shared-cache.md), so a cache filled in one process and read in another
# hits only when both ran at one count; giving each its own was a class of failures (a test's new process at the
# default count against its fixture's lowering at one). Tests of the default environment remove the variable (the
# server's, ``helpers/server.base_env``; a new user's, ``process/test_new_home.py``); tests of counts set their own.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# No test reaches a server the user runs: module-scoped fixtures run before the per-test environment below, and the
# server tests start their own in socket directories of their own.
os.environ["LOWERCACHE_SERVER"] = "0"

def pytest_configure(config):
    """One directory of fresh references for the whole run (``helpers/references.py``): the controller makes it,
    xdist's workers get it in their ``workerinput``, and it is removed when the run ends."""
    if hasattr(config, "workerinput"):
        references.begin(config.workerinput.get(references.OPTION))
    else:
        references.begin(tempfile.mkdtemp(prefix="lowercache-references-"))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput[references.OPTION] = str(references.directory())


def pytest_terminal_summary(terminalreporter, config):
    line = references.summary(references.directory()) if references.directory() is not None else None
    if line and not hasattr(config, "workerinput"):
        terminalreporter.write_line(line)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and references.directory() is not None:
        shutil.rmtree(references.directory(), ignore_errors=True)
        references.begin(None)


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def _toolchain_memos(tmp_path_factory) -> list[Path]:
    """The toolchain's memos (``lowercache/cache/toolchain.py``), made once per worker in a process of their own.
    Each test has a default cache directory of its own, and a process without these memos reads every file of the
    lowering stack (seconds), as on a new machine; a user's machine has them from its first lowering on. A test of that
    first lowering removes them."""
    xdg = tmp_path_factory.mktemp("toolchain-memos")
    subprocess.run([sys.executable, "-c", "from lowercache.cache.toolchain import toolchain_parts; toolchain_parts()"],
                   env={**os.environ, "XDG_CACHE_HOME": str(xdg)}, check=True, timeout=600)
    return sorted((xdg / "lowercache").glob("toolchain-*.json"))


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path, monkeypatch, _toolchain_memos):
    """No test reads the developer's own config file or cache; its default cache directory starts with the toolchain's
    memos (above)."""
    isolate(monkeypatch, tmp_path)
    logging.getLogger("lowercache").propagate = True
    default = tmp_path / "xdg-cache" / "lowercache"
    default.mkdir(parents=True, exist_ok=True)
    for memo in _toolchain_memos:
        shutil.copyfile(memo, default / memo.name)


# Real servers for the shared-cache tests, on loopback only.


@pytest.fixture(scope="session")
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server):
    """The shared server, emptied for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def raw_redis(redis_url):
    """A plain redis-py client, to look at and tamper with what lowercache stored."""
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def moto_endpoint():
    import boto3

    server, endpoint = start_moto()
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    )
    client.create_bucket(Bucket=BUCKET)
    client.close()
    yield endpoint
    server.stop()


@pytest.fixture
def s3_env(monkeypatch):
    """Fake credentials, so no test can reach a real AWS account."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "LOWERCACHE_S3_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


@pytest.fixture
def s3_url(moto_endpoint, s3_env, monkeypatch):
    """A fresh prefix in the shared bucket, reached through LOWERCACHE_S3_ENDPOINT."""
    monkeypatch.setenv("LOWERCACHE_S3_ENDPOINT", moto_endpoint)
    return f"s3://{BUCKET}/test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["redis", "s3"])
def any_url(request):
    """Each test once against Redis and once against S3."""
    return request.getfixturevalue("redis_url" if request.param == "redis" else "s3_url")


TIERS = ("unit", "flow", "process", "env")


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier, the folder it lives in (``-m unit``, ``-m "not env"``)."""
    root = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(root).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


def pytest_ignore_collect(collection_path, config):
    """``-m quick``: a test file that marks no test quick is not imported at all. Importing every module (torch, ExecuTorch,
    the helpers they pull in) was most of the quick loop's time; a quick mark is always spelled ``mark.quick`` in its file."""
    if config.getoption("markexpr") != "quick" or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if "mark.quick" not in collection_path.read_text() else None
