"""Shared fixtures. ``stock_pte`` is the oracle: the stock ExecuTorch Arm flow,
written here straight from the README, independent of lowercache's own code."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import uuid

import pytest
import torch

from lowercache.bench import models

from .servers import RedisServer, start_moto

# No test reaches a server the user runs: module-scoped fixtures run before the per-test environment below, and the
# server tests start their own in socket directories of their own.
os.environ["LOWERCACHE_SERVER"] = "0"

SMALL_TARGETS = ("tosa-int", "tosa-fp", "ethos-u55-128", "ethos-u55-256", "ethos-u85-256")


def stock_pte(module, example_inputs, target: str, calibration=None, per_channel: bool = True, strict: bool = False,
              **vela_options) -> bytes:
    """The .pte stock ExecuTorch produces, with no lowercache code involved; ``strict``: both exports dynamo's;
    ``vela_options``: EthosUCompileSpec's ``system_config`` / ``memory_mode``."""
    from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
    from executorch.backends.arm.quantizer import EthosUQuantizer, TOSAQuantizer, get_symmetric_quantization_config
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    ep = torch.export.export(module, example_inputs, strict=strict)
    ethos = target.startswith("ethos-u")
    spec = EthosUCompileSpec(target, **vela_options) if ethos else TosaCompileSpec({"tosa-int": "TOSA-1.0+INT", "tosa-fp": "TOSA-1.0+FP"}[target])
    if target != "tosa-fp":
        # The quantizer may adjust the compile spec's pass pipeline config, so
        # the partitioner is made after quantization, as in the README's flow.
        quantizer = EthosUQuantizer(spec) if ethos else TOSAQuantizer(spec)
        quantizer.set_global(get_symmetric_quantization_config(is_per_channel=per_channel))
        prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
        for sample in calibration or [example_inputs]:
            prepared(*sample)
        ep = torch.export.export(convert_pt2e(prepared), example_inputs, strict=strict)
    partitioner = EthosUPartitioner(spec) if ethos else TOSAPartitioner(spec)
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner])
    return edge.to_executorch().buffer


def churn_patch(enable, disable, threads: int = 4, rounds: int = 200) -> None:
    """Enable and disable a reference-counted patch from several threads at once."""
    import threading

    def churn():
        for _ in range(rounds):
            enable()
            disable()

    workers = [threading.Thread(target=churn) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()


@functools.lru_cache(maxsize=None)
def reference(model: str, target: str, edit: str | None = None) -> bytes:
    """Stock .pte of a small model, computed once per test session."""
    module, example = models.MODELS[model](edit=edit)
    return stock_pte(module, example, target)


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path, monkeypatch):
    """No test reads the developer's own config file or cache."""
    for var in (
        "LOWERCACHE_DIR",
        "LOWERCACHE_MAX_SIZE",
        "LOWERCACHE_DISABLE",
        "LOWERCACHE_READ_ONLY",
        "LOWERCACHE_REMOTE",
        "LOWERCACHE_REMOTE_MODE",
        "LOWERCACHE_REMOTE_TTL",
        "LOWERCACHE_REMOTE_REQUIRE_SIGNED",
        "LOWERCACHE_HMAC_KEY",
        "LOWERCACHE_S3_ENDPOINT",
        "LOWERCACHE_SPEEDUPS",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOWERCACHE_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("LOWERCACHE_SERVER", "0")  # each test runs in its own processes; tests/test_server.py starts servers
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    logging.getLogger("lowercache").propagate = True


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


BUCKET = "lowercache-test"


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


# The fast developer loop (docs/development.md): `python -m pytest -m quick` runs these, a subset that
# touches every room in a few minutes; CI runs everything.
QUICK = (
    "tests/test_layout.py",
    "tests/test_docs.py",
    "tests/test_store.py",
    "tests/test_keys.py",
    "tests/test_patching.py",
    "tests/test_quiet.py::test_capture_holds_third_party_and_passes_lowercache_and_errors",
    "tests/test_speedups.py::test_selection_grammar",
    "tests/test_speedups.py::test_every_switchable_module_is_registered_and_ordered",
    "tests/test_speedups.py::test_pins_match_the_installed_sources",
    "tests/test_speedups.py::test_a_speedup_whose_source_differs_switches_itself_off",
    "tests/test_identity.py::test_cold_and_warm_match_stock[tiny_cnn-tosa-int]",
    "tests/test_identity.py::test_cold_and_warm_match_stock[transformer_block-tosa-fp]",
    "tests/test_identity.py::test_edits_miss_and_match_stock",
    "tests/test_cli.py::test_bad_input_gives_one_line_and_leaves_nothing",
    "tests/test_faults_store.py::test_flipped_head_of_the_entries_index_heals_and_the_lowering_recomputes",
    "tests/test_faults_remote.py::test_forged_entry_is_not_served_without_a_key",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)
