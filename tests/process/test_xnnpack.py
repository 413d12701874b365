"""The XNNPACK family end to end: the CLI (``lower``, a shared Redis remote, ``watch``) and the API serve exactly what the
benchmark's stock script writes in a fresh process.

Small seeded models only (a 2-layer MLP, a tiny CNN, two linear layers with a layer norm XNNPACK does not take between
them: two partitions), fp32 and int8, and the two edits a user makes (one weight, one layer). Each partition's
``preprocess`` is a step of its own (``lowering/xnnpack.py``): served from the cache, it gives stock's bytes and only the
partitions an edit touches re-run. The stock bytes come from one new process running ``lowercache/bench/stockscript.py``'s script, which imports
no lowercache code, for every model and target the tests lower.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

import lowercache
from lowercache import delegation
from lowercache.cache import history
from lowercache.cache.store import Entry, Store

from tests.helpers.cli import cli
from tests.helpers.isolation import isolate
from tests.helpers.xnnstock import stock_bytes

pytestmark = pytest.mark.usefixtures("through_server")

MODELS = textwrap.dedent('''
    import torch

    EDIT = None  # "weight": one weight of the MLP changed; "layer": its ReLU is a Hardtanh


    def mlp():
        torch.manual_seed(0)
        act = torch.nn.Hardtanh() if EDIT == "layer" else torch.nn.ReLU()
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), act, torch.nn.Linear(16, 4)).eval()
        if EDIT == "weight":
            with torch.no_grad():
                net[2].weight[1, 3] += 0.25
        return net, (torch.randn(1, 8),)


    def cnn():
        torch.manual_seed(1)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5),
        ).eval()
        return net, (torch.randn(1, 3, 16, 16),)


    def two():
        torch.manual_seed(2)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).eval()
        if EDIT == "weight":
            with torch.no_grad():
                net[2].weight[1, 3] += 0.25
        return net, (torch.randn(2, 8),)


    def split():
        torch.manual_seed(4)
        x = torch.randn(2, 8)
        layers = [torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        if EDIT == "layer":  # a norm XNNPACK does not take, without parameters: the last linear becomes a partition
            layers.insert(4, torch.nn.LayerNorm(16, elementwise_affine=False))
        return torch.nn.Sequential(*layers).eval(), (x,)
''')

# (edit, factory, target): every lowering a test compares with stock
LOWERINGS = [
    (None, "mlp", "xnnpack"), ("weight", "mlp", "xnnpack"),
    (None, "mlp", "xnnpack-int8"), ("layer", "mlp", "xnnpack-int8"), ("weight", "mlp", "xnnpack-int8"),
    (None, "cnn", "xnnpack"), (None, "cnn", "xnnpack-int8"),
    (None, "two", "xnnpack"), ("weight", "two", "xnnpack"), (None, "two", "xnnpack-int8"), ("weight", "two", "xnnpack-int8"),
    (None, "split", "xnnpack-int8"), ("layer", "split", "xnnpack-int8"),
]

def write_models(path, edit=None):
    path.write_text(MODELS.replace("EDIT = None", f"EDIT = {edit!r}"))


def load(path, factory):
    spec = importlib.util.spec_from_file_location(f"xnn_models_{abs(hash(path.read_text()))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, factory)()


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """Stock bytes by (edit, factory, target) (``helpers/xnnstock.py``)."""
    return stock_bytes(MODELS, LOWERINGS, tmp_path_factory.mktemp("stock"))


def test_the_cli_serves_stock_bytes_cold_hit_direct_and_after_a_weight_edit(tmp_path, monkeypatch, stock):
    isolate(monkeypatch, tmp_path)
    cache, models = tmp_path / "cache", tmp_path / "models.py"
    write_models(models)

    def lower(out):
        result = cli("lower", f"{models}:mlp", "--target", "xnnpack", "--out", tmp_path / out, cache_dir=cache)
        assert result.returncode == 0, result.stderr
        manifest = json.loads((tmp_path / out / "manifest.json").read_text()) if "direct mode" not in result.stderr else None
        return (tmp_path / out / "model.pte").read_bytes(), manifest, result

    cold, manifest, result = lower("cold")
    assert cold == stock[None, "mlp", "xnnpack"]
    assert "] import the XNNPACK backend: " in result.stderr and "Arm" not in result.stderr, result.stderr
    assert [s["outcome"] for s in manifest["steps"] if s["kind"] == "flow"] == ["miss"]
    assert manifest["target"] == "xnnpack" and "xnnpack_backend_src" in manifest["key_parts"]
    hit, manifest, _ = lower("hit")
    assert hit == cold and [s["outcome"] for s in manifest["steps"]] == ["hit"]
    direct, _, result = lower("direct")
    assert direct == cold and "direct mode: served from the record" in result.stderr

    write_models(models, "weight")
    edited, manifest, _ = lower("edited")
    assert edited == stock["weight", "mlp", "xnnpack"] != cold
    assert [s["outcome"] for s in manifest["steps"] if s["kind"] == "flow"] == ["miss"]
    explained = cli("explain", f"{models}:mlp", "--target", "xnnpack", cache_dir=cache)
    assert explained.returncode == 0 and "program.constants" in explained.stdout, explained.stdout + explained.stderr
    stats = cli("stats", cache_dir=cache)
    assert stats.returncode == 0 and "whole lowering" in stats.stdout, stats.stderr


def outcomes(records, kind="xnnpack"):
    return [(r["name"], r["outcome"]) for r in records if r["kind"] == kind]


@pytest.fixture
def results(monkeypatch):
    """Every ``PreprocessResult`` stock made (stored on a miss) and the step served (on a hit), in order."""
    from lowercache.lowering import xnnpack

    made: dict[str, list] = {"stock": [], "served": []}
    stored, served = xnnpack._stored, xnnpack._served
    monkeypatch.setattr(xnnpack, "_stored", lambda result: made["stock"].append(result) or stored(result))
    monkeypatch.setattr(xnnpack, "_served", lambda entry: made["served"].append(served(entry)) or made["served"][-1])
    return made


def same_result(served, stock):
    """Every field equal, and the named data in stock's order (a dict's equality ignores it)."""
    assert served == stock and type(served.processed_bytes) is type(stock.processed_bytes)
    out, theirs = served.data_store_output, stock.data_store_output
    assert list(out.pte_data.items()) == list(theirs.pte_data.items()) and out.buffers and out.buffers == theirs.buffers
    assert [(k, list(v.items())) for k, v in out.external_data.items()] == [(k, list(v.items())) for k, v in theirs.external_data.items()]


@pytest.mark.parametrize("factory", ["mlp", "cnn", "two"])
@pytest.mark.parametrize("target", ["xnnpack", "xnnpack-int8"])
def test_the_api_serves_stock_bytes_and_hits(tmp_path, monkeypatch, factory, target, stock, results):
    """Cold, a whole-flow hit, then the flow missing over its steps: each partition's result served equal to stock's."""
    from lowercache.lowering import flow

    models = tmp_path / "models.py"
    write_models(models)
    module, example = load(models, factory)
    first = lowercache.lower(module, example, target=target, cache_dir=tmp_path / "cache")
    assert first.pte == stock[None, factory, target]
    partitions = len(results["stock"])
    if factory == "two":  # the layer norm between the two linear layers of a Sequential: named by its class and index
        assert delegation.line(first.delegation) == ("partially delegated (2 partitions); outside the delegate: "
                                                     "aten.native_layer_norm (1 node: LayerNorm model[1])")
    assert outcomes(first.records) == [(f"partition {i}", "miss") for i in range(partitions)] and partitions == (2 if factory == "two" else 1)
    again = lowercache.lower(module, example, target=target, cache_dir=tmp_path / "cache")
    assert again.pte == first.pte and [r["outcome"] for r in again.records] == ["hit"]
    monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + ":another")
    steps = lowercache.lower(module, example, target=target, cache_dir=tmp_path / "cache")
    assert outcomes(steps.records) == [(f"partition {i}", "hit") for i in range(partitions)] and outcomes(steps.records, "flow") == [(target, "miss")]
    assert steps.pte == stock[None, factory, target]
    for served, made in zip(results["served"], results["stock"], strict=True):
        same_result(served, made)


@pytest.mark.parametrize("target", ["xnnpack", "xnnpack-int8"])
def test_an_edit_of_one_partition_re_runs_only_its_step(tmp_path, target, stock):
    cache, models = tmp_path / "cache", tmp_path / "models.py"
    write_models(models)
    lowercache.lower(*load(models, "two"), target=target, cache_dir=cache)
    write_models(models, "weight")  # the second linear layer: the second partition
    edited = lowercache.lower(*load(models, "two"), target=target, cache_dir=cache)
    assert outcomes(edited.records) == [("partition 0", "hit"), ("partition 1", "miss")]
    assert edited.pte == stock["weight", "two", target] != stock[None, "two", target]
    store = Store(cache)
    explained = history.explain(store, "Sequential", target)
    store.close()
    assert any(line.startswith("xnnpack partition 1: missed; changed: program.") for line in explained), explained
    assert not any(line.startswith("xnnpack partition 0") for line in explained), explained


def test_a_partition_an_edit_elsewhere_renumbers_is_served_to_stock_bytes(tmp_path, monkeypatch, stock):
    """The partitioner numbers delegation tags across the program: an edit that adds a partition after the first
    renumbers the first's tag, which its key leaves out (XNNPACK's preprocess never reads it)."""
    from lowercache.lowering import xnnpack

    tags: list[set] = []
    parts = xnnpack.preprocess_parts
    monkeypatch.setattr(xnnpack, "preprocess_parts", lambda ep, specs: tags.append(
        {n.meta.get("delegation_tag") for n in ep.graph.nodes} - {None}) or parts(ep, specs))
    cache, models = tmp_path / "cache", tmp_path / "models.py"
    write_models(models)
    lowercache.lower(*load(models, "split"), target="xnnpack-int8", cache_dir=cache)
    first = tags[0]
    tags.clear()
    write_models(models, "layer")
    edited = lowercache.lower(*load(models, "split"), target="xnnpack-int8", cache_dir=cache)
    assert outcomes(edited.records) == [("partition 0", "hit"), ("partition 1", "miss"), ("partition 2", "miss")]
    assert tags[0] != first  # the served partition's tag was renumbered
    assert edited.pte == stock["layer", "split", "xnnpack-int8"] != stock[None, "split", "xnnpack-int8"]


def test_a_damaged_or_malformed_step_entry_is_recomputed_to_the_same_bytes(tmp_path, monkeypatch, stock, caplog):
    """One entry's stored record damaged, another's well-formed but naming a buffer it does not have: both recompute,
    with a warning, to stock's bytes, and the second is overwritten, so the next run hits."""
    from lowercache.lowering import flow

    cache, models = tmp_path / "cache", tmp_path / "models.py"
    write_models(models)
    module, example = load(models, "two")
    first = lowercache.lower(module, example, target="xnnpack", cache_dir=cache)
    keys = [r["key"] for r in first.records if r["kind"] == "xnnpack"]
    store = Store(cache)
    raw = bytearray(store._entries.get(f"action/xnnpack/{keys[0]}"))
    raw[-2] ^= 0x55
    store._entries.set(f"action/xnnpack/{keys[0]}", bytes(raw))
    good = store.get("xnnpack", keys[1])
    store.put("xnnpack", keys[1], Entry(meta={**good.meta, "data_store": {**good.meta["data_store"], "buffers": 0}}, blobs=good.blobs))
    store.close()
    monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + ":another")
    again = lowercache.lower(module, example, target="xnnpack", cache_dir=cache)
    assert outcomes(again.records) == [("partition 0", "miss"), ("partition 1", "hit")]
    assert again.pte == stock[None, "two", "xnnpack"]
    assert "cache entry xnnpack/" in caplog.text and "cached XNNPACK delegate unusable" in caplog.text
    monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + ":yet another")
    last = lowercache.lower(module, example, target="xnnpack", cache_dir=cache)
    assert outcomes(last.records) == [("partition 0", "hit"), ("partition 1", "hit")] and last.pte == again.pte


@pytest.mark.parametrize("edit", ["weight", "layer"])
def test_an_int8_edit_misses_gives_stock_bytes_then_hits(tmp_path, edit, stock):
    cache, models = tmp_path / "cache", tmp_path / "models.py"
    write_models(models)
    module, example = load(models, "mlp")
    before = lowercache.lower(module, example, target="xnnpack-int8", cache_dir=cache)
    write_models(models, edit)
    module, example = load(models, "mlp")
    edited = lowercache.lower(module, example, target="xnnpack-int8", cache_dir=cache)
    assert edited.pte == stock[edit, "mlp", "xnnpack-int8"] != before.pte
    assert [r["outcome"] for r in edited.records if r["kind"] == "flow"] == ["miss"]
    again = lowercache.lower(module, example, target="xnnpack-int8", cache_dir=cache)
    assert again.pte == edited.pte and [r["outcome"] for r in again.records] == ["hit"]


def test_a_quantize_hit_under_a_flow_miss_gives_stock_bytes(tmp_path, monkeypatch, stock):
    """The stage's hit path asks the family's backend module what stock's stage imports and does to the spec."""
    from lowercache.lowering import flow

    write_models(tmp_path / "models.py")
    module, example = load(tmp_path / "models.py", "mlp")
    lowercache.lower(module, example, target="xnnpack-int8", cache_dir=tmp_path / "cache")
    monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + ":another")  # the flow misses, its stage does not
    again = lowercache.lower(module, example, target="xnnpack-int8", cache_dir=tmp_path / "cache")
    assert [(r["kind"], r["outcome"]) for r in again.records if r["kind"] in ("flow", "quantize")] == [("quantize", "hit"), ("flow", "miss")]
    assert again.pte == stock[None, "mlp", "xnnpack-int8"]


def test_the_numerics_check_says_why_an_xnnpack_delegate_is_not_compared(tmp_path, stock):
    """The check runs TOSA on the TOSA reference model: an XNNPACK delegate has none, and the report says so; bytes stay stock's."""
    write_models(tmp_path / "models.py")
    checked = lowercache.lower(*load(tmp_path / "models.py", "mlp"), target="xnnpack", cache_dir=tmp_path / "cache", check=True)
    assert checked.pte == stock[None, "mlp", "xnnpack"] and checked.numerics["outputs"] == []
    assert checked.numerics["error"] == ("not compared: the check runs TOSA partitions on the TOSA reference model, and "
                                         "this XnnpackBackend delegate holds no TOSA")


def test_a_second_machine_lowers_xnnpack_int8_from_redis(tmp_path, monkeypatch, redis_url, stock):
    """Two empty local caches sharing one Redis (``--remote``): the second lowers nothing, and its bytes are stock's."""
    isolate(monkeypatch, tmp_path)
    models = tmp_path / "models.py"
    write_models(models)

    def lower(machine):
        result = cli("lower", f"{models}:mlp", "--target", "xnnpack-int8", "--remote", redis_url, "--out", tmp_path / machine,
                     cache_dir=tmp_path / f"cache-{machine}", env={"LOWERCACHE_HMAC_KEY": "team-secret"})
        assert result.returncode == 0, result.stderr
        manifest = json.loads((tmp_path / machine / "manifest.json").read_text())
        return (tmp_path / machine / "model.pte").read_bytes(), manifest

    first, manifest = lower("a")
    assert first == stock[None, "mlp", "xnnpack-int8"]
    assert [s["outcome"] for s in manifest["steps"] if s["kind"] == "flow"] == ["miss"]
    second, manifest = lower("b")
    assert second == stock[None, "mlp", "xnnpack-int8"]
    assert [(s["outcome"], s.get("tier")) for s in manifest["steps"]] == [("hit", "remote")]
    assert manifest["remote"]["hits"] > 0 and manifest["remote"]["bytes_read"] > 0


def test_watch_relowers_an_xnnpack_target_on_an_edit_to_stock_bytes(tmp_path, monkeypatch, stock):
    """``lowercache watch`` for ``xnnpack``: the first round and the round after a weight edit each write stock's bytes."""
    isolate(monkeypatch, tmp_path)
    models = tmp_path / "models.py"
    write_models(models)
    watch = subprocess.Popen(
        [sys.executable, "-m", "lowercache.cli", "watch", "models.py:mlp", "-t", "xnnpack", "-o", "out", "--no-server",
         "--max-runs", "2", "--interval", "0.2"],
        cwd=tmp_path, env={**os.environ, "LOWERCACHE_DIR": str(tmp_path / "cache")}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = []
        for line in watch.stdout:  # the first round ends with the line that says what is watched
            lines.append(line)
            if "] watching " in line:
                break
        assert (tmp_path / "out" / "model.pte").read_bytes() == stock[None, "mlp", "xnnpack"], "".join(lines)
        write_models(models, "weight")
        rest = watch.stdout.read()
        assert watch.wait(timeout=600) == 0, "".join(lines) + rest
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert "changed: models.py" in rest and "xnnpack: lowered in" in rest, rest
    assert (tmp_path / "out" / "model.pte").read_bytes() == stock["weight", "mlp", "xnnpack"]


def test_a_server_warms_for_xnnpack_once_used_or_asked_and_its_children_give_stock_bytes(own, stock):
    """A server starts warm for Arm only; its first XNNPACK lowering leaves it to warm for XNNPACK when idle (its
    children then find the quantizer's patterns exported: speed-up qpatterns), and ``server start --target`` warms a
    running one at once. Every .pte is stock's, before and after."""
    from tests.helpers.server import WAIT, wait_until

    server = own(LOWERCACHE_DIRECT="0")
    write_models(server.project / "models.py")
    refused = server("server", "start", "--target", "xnnpack-int9")
    assert refused.returncode == 2 and "unknown target 'xnnpack-int9'" in refused.stderr and not server.status()
    server.start()
    assert server.status()["warm for"] == "TOSA, Ethos-U"

    def lower(factory, out):
        result = server("lower", f"models.py:{factory}", "--target", "xnnpack-int8", "--out", out, "--no-cache")
        assert result.returncode == 0, result.stderr[-2000:]
        return (server.project / out / "model.pte").read_bytes()

    assert lower("cnn", "cold") == stock[None, "cnn", "xnnpack-int8"]
    assert wait_until(lambda: server.status()["warm for"] == "TOSA, Ethos-U, XNNPACK", WAIT)
    assert lower("cnn", "warmed") == stock[None, "cnn", "xnnpack-int8"]
    assert lower("mlp", "other") == stock[None, "mlp", "xnnpack-int8"]

    second = own(LOWERCACHE_DIRECT="0")
    write_models(second.project / "models.py")
    started = second("server", "start", "--target", "xnnpack-int8")
    assert started.returncode == 0, started.stderr[-2000:]
    assert second.status()["warm for"] == "TOSA, Ethos-U, XNNPACK"
    result = second("lower", "models.py:two", "--target", "xnnpack-int8", "--out", "two", "--no-cache")
    assert result.returncode == 0 and (second.project / "two" / "model.pte").read_bytes() == stock[None, "two", "xnnpack-int8"]
