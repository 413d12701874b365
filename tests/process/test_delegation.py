"""What runs outside the delegate, and Vela's layers by the user's module paths: said on every path, no byte changed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from lowercache import delegation, estimates
from lowercache.cache.store import Store

from tests.helpers.cli import TINY, cli
from tests.helpers.oracle import stock_pte

pytestmark = pytest.mark.usefixtures("through_server")

TARGET = "ethos-u55-128"
SORT_MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return torch.sort(torch.relu(self.conv(x)), dim=-1).values


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), Block(), Block())

    def forward(self, x):
        return self.features(x) + 1


def model():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(1, 3, 8, 8),)
'''
LINE = "lowercache: partially delegated (3 partitions); outside the delegate: aten.sort (2 nodes: features.2, features.3)"


def _sort_model(tmp_path):
    path = tmp_path / "sorting.py"
    path.write_text(SORT_MODEL)
    return path


def _stock(path, target):
    spec = importlib.util.spec_from_file_location("sorting_stock", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return stock_pte(*module.model(), target)


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_operators_outside_the_delegate_are_said_on_a_miss_a_hit_and_a_direct_hit(tmp_path, cache_dir):
    model = f"{_sort_model(tmp_path)}:model"
    fresh = cli("lower", model, "-t", TARGET, "-o", tmp_path / "fresh", "--no-cache", "--no-server", cache_dir=cache_dir)
    assert fresh.returncode == 0, fresh.stderr
    assert LINE in fresh.stderr
    assert (tmp_path / "fresh" / "model.pte").read_bytes() == _stock(tmp_path / "sorting.py", TARGET)
    section = _manifest(tmp_path / "fresh")["delegation"]
    sort = next(o for o in section["outside"] if o["op"] == "aten.sort.default")
    assert sort == {"op": "aten.sort.default", "nodes": 2, "modules": ["features.2", "features.3"]}
    assert section["delegates"] == 3 and "aten::sort.values" in section["kernels"]

    for run in range(4):  # miss, flow hit (the record confirmed), then direct-mode hits
        out = tmp_path / f"out{run}"
        result = cli("lower", model, "-t", TARGET, "-o", out, "--json", cache_dir=cache_dir)
        assert result.returncode == 0, result.stderr
        assert LINE in result.stderr, (run, result.stderr)
        assert (out / "model.pte").read_bytes() == (tmp_path / "fresh" / "model.pte").read_bytes()
        assert _manifest(out)["delegation"] == section, run
        summary = json.loads(result.stdout)
        assert summary["delegation"] == delegation.json_part(section)["delegation"] and summary["delegated"] == "partially"
        # Vela's estimate, as aot_arm_compiler prints its summary: the same figures on every path
        estimate = estimates.read(out, TARGET, per_layer=False)
        assert summary["vela"]["cycles"] == estimate.cycles > 0 and summary["vela"]["npu_operators"] > 0
        assert f"lowercache: {estimates.summary(estimate)}" in result.stderr.splitlines(), result.stderr
    assert "direct mode: served from the record" in result.stderr
    assert _manifest(tmp_path / "out3")["direct"]["torch_imported"] is False


def test_a_flow_miss_served_by_the_quantize_and_tosa_steps_says_the_same(tmp_path, cache_dir):
    """The stored quantized program and the TOSA entries keep what the section is made of (module paths, tensor names)."""
    model = f"{_sort_model(tmp_path)}:model"
    assert cli("lower", model, "-t", TARGET, "-o", tmp_path / "cold", cache_dir=cache_dir).returncode == 0
    store = Store(cache_dir)
    for kind, key in list(store.actions()):
        if kind in ("flow", "direct"):
            store._discard(f"action/{kind}/{key}")
    store.close()
    again = cli("lower", model, "-t", TARGET, "-o", tmp_path / "again", cache_dir=cache_dir)
    assert again.returncode == 0, again.stderr
    manifest = _manifest(tmp_path / "again")
    outcomes = {s["kind"]: s["outcome"] for s in manifest["steps"] if s["kind"] in ("flow", "quantize", "tosa")}
    assert outcomes == {"flow": "miss", "quantize": "hit", "tosa": "hit"}, outcomes
    assert manifest["delegation"] == _manifest(tmp_path / "cold")["delegation"]
    assert LINE in again.stderr


def test_a_fully_delegated_model_says_so_and_records_its_delegate(tmp_path, cache_dir):
    result = cli("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    assert "outside the delegate" not in result.stderr and "lowercache: fully delegated (1 partition)" in result.stderr.splitlines()
    tosa = cli("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "tosa", "--json", cache_dir=cache_dir)
    assert "lowercache: fully delegated (1 partition)" in tosa.stderr.splitlines() and "Vela" not in tosa.stderr  # no Vela on TOSA
    assert json.loads(tosa.stdout)["delegated"] == "fully" and "vela" not in json.loads(tosa.stdout)
    section = _manifest(tmp_path / "out")["delegation"]
    assert section["delegates"] == 1
    assert all(delegation.is_conversion(o["op"]) for o in section["outside"])  # the input's quantize, the output's dequantize


def test_velas_layers_are_labelled_by_module_path(tmp_path, cache_dir):
    model = f"{_sort_model(tmp_path)}:model"
    assert cli("lower", model, "-t", TARGET, "-o", tmp_path / "out", cache_dir=cache_dir).returncode == 0
    found = estimates.read(tmp_path / "out", TARGET)
    labels = [layer.label for p in found.partitions for layer in p.layers]
    assert "features.0 Conv2D" in labels and "features.2.conv Conv2D" in labels and "features.3.conv Conv2D" in labels
    assert "(top level) Add" in labels
    assert not [label for label in labels if label.startswith(("tosa_", "#"))], labels
    text = "\n".join(estimates.describe(found, None))
    assert "features.3.conv Conv2D" in text and "tosa_" not in text


def test_inserted_layers_take_their_neighbours_module_and_renamed_tensors_still_match():
    layers = [estimates.Layer("#75", "Transpose", 56), estimates.Layer("t0", "Transpose", 128),
              estimates.Layer("r0", "Conv2D", 1040), estimates.Layer("#95", "Transpose", 160)]
    named = estimates.named(layers, {"t0": "features.0", "r0": "features.2.conv"})
    assert [layer.label for layer in named] == ["features.0 Transpose (inserted by Vela)", "features.0 Transpose",
                                               "features.2.conv Conv2D", "features.2.conv Transpose (inserted by Vela)"]

    def estimate(names, cycles):
        layer_list = estimates.named([estimates.Layer(n, "Conv2D", c) for n, c in zip(names, cycles)],
                                     dict(zip(names, ["features.0", "features.3.conv"])))
        return estimates.Estimate(TARGET, [estimates.Partition(0, {}, 0, 2, layer_list)])

    # An edit elsewhere renumbers the TOSA names (tosa_rescale_default_1 -> _2): the same module is the same layer.
    before = estimate(["tosa_rescale_default", "tosa_rescale_default_1"], [100, 200])
    after = estimate(["tosa_rescale_default", "tosa_rescale_default_2"], [100, 250])
    text = "\n".join(estimates.describe(after, before))
    assert "features.3.conv Conv2D cycles 200 -> 250 (+50)" in text and "(new)" not in text, text


@pytest.mark.parametrize("section, said", [
    (None, None),
    ({"delegates": 1, "outside": [{"op": "quantized_decomposed.quantize_per_tensor.default", "nodes": 1, "modules": []}]},
     "fully delegated (1 partition)"),
    ({"delegates": 0, "outside": [{"op": "aten.topk.default", "nodes": 5, "modules": ["a", "b", "c", "d"]}]},
     "not delegated; outside the delegate: aten.topk (5 nodes: a, b, c, ...)"),
    ({"delegates": 2, "outside": [{"op": "aten.sort.default", "nodes": 1, "modules": ["x"]},
                                  {"op": "quantized_decomposed.dequantize_per_tensor.default", "nodes": 2, "modules": []}]},
     "partially delegated (2 partitions); outside the delegate: aten.sort (1 node: x); and 2 quantize/dequantize nodes around them"),
])
def test_the_line(section, said):
    assert delegation.line(section) == said


def test_watch_says_what_falls_back_and_names_layers_by_module(tmp_path, cache_dir):
    _sort_model(tmp_path)
    run = cli("watch", "sorting.py:model", "-t", TARGET, "-o", "out", "--no-server", "--max-runs", "1", cache_dir=cache_dir, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert LINE.removeprefix("lowercache: ") in run.stdout, run.stdout
    layer_lines = [line for line in run.stdout.splitlines() if line.strip().startswith("layers")]
    assert layer_lines and all("tosa_" not in line for line in layer_lines), run.stdout
    assert any("features.3.conv Conv2D" in line for line in layer_lines), run.stdout
