"""The per-layer check's torch-free side (``numerics_report.py``): its rows, where the error enters, the table, the
check's mode from flag, variable and config, and a direct-mode hit that must find the layers entry the record names."""

from __future__ import annotations

import pytest

from lowercache import direct
from lowercache.cache.steps import step_key
from lowercache.cache.store import Entry
from lowercache.cli import check_spelled
from lowercache.config import parse_check
from lowercache.errors import LowercacheError
from lowercache.lowering.check import numerics_report


def _rows():
    return numerics_report.layer_rows([
        {"module": "features", "snr_db": 20.0, "max_abs": 0.2},
        {"module": "features.0", "snr_db": 40.0, "max_abs": 0.01},
        {"module": "features.1", "snr_db": 38.0, "max_abs": 0.02},
        {"module": "features.1.conv", "snr_db": 39.0, "max_abs": 0.02},
        {"module": "features.2", "snr_db": 21.0, "max_abs": 0.2},
        {"module": "classifier", "snr_db": 18.0, "max_abs": 0.3},
    ])


def test_each_row_drops_against_the_row_before_it_at_its_depth_and_the_largest_drop_is_where_the_error_enters():
    rows = {r["module"]: r for r in _rows()}
    assert rows["features.0"]["drop_db"] is None and "from_snr_db" not in rows["features.0"]
    assert rows["features.1"]["drop_db"] == 2.0 and rows["features.2"]["drop_db"] == 17.0
    assert rows["features.2"]["from_snr_db"] == 38.0 and rows["features.1.conv"]["depth"] == 3
    assert rows["classifier"]["drop_db"] == 2.0  # against "features", at depth 1
    layers = {"samples": 2, "modules": _rows()}
    assert numerics_report.largest_drop(layers)["module"] == "features.2"
    exact_then_lossy = numerics_report.layer_rows([{"module": "a", "snr_db": None}, {"module": "b", "snr_db": 30.0}])
    assert numerics_report.largest_drop({"modules": exact_then_lossy})["module"] == "b"  # none drops: the first inexact
    assert numerics_report.largest_drop({"modules": []}) is None


def test_the_table_shows_the_shallow_modules_and_says_where_the_error_enters():
    said = numerics_report.layer_lines({"layers": {"samples": 2, "modules": _rows()}})
    assert said[0].startswith("numerics per layer (quantized model vs float at each module's output, 2 inputs)")
    assert not any("features.1.conv" in line for line in said)  # deeper than SHOWN_DEPTH: in manifest.json only
    assert "  (1 deeper modules in manifest.json)" in said
    assert said[-1] == "error enters at features.2: SNR drops from 38.0 dB to 21.0 dB"
    assert numerics_report.layer_lines({"outputs": []}) == []  # --check without layers: no table
    refused = numerics_report.layer_lines({"layers": {"samples": 1, "modules": [], "error": "the target is not quantized"}})
    assert refused == ["numerics per layer (quantized model vs float at each module's output, 1 input): the target is not quantized"]


def test_json_leaves_out_the_key_parts_of_both_steps():
    section = {"outputs": [], "key_parts": {"flow": "f"}, "layers": {"modules": [], "key_parts": {"flow": "f"}}}
    assert numerics_report.json_part(section) == {"numerics": {"outputs": [], "layers": {"modules": []}}}


@pytest.mark.parametrize(("value", "mode"), [(True, "outputs"), (False, ""), (None, ""), ("1", "outputs"), ("off", ""),
                                             ("layers", "layers"), (" Layers ", "layers"), ("outputs", "outputs")])
def test_the_check_mode_from_a_flag_a_variable_or_the_config(value, mode):
    assert parse_check(value, "check") == mode


def test_a_bad_check_mode_is_a_one_line_error():
    with pytest.raises(LowercacheError, match="use outputs or layers"):
        parse_check("layer", "--check")


def test_a_bare_check_is_spelled_so_it_never_takes_the_model_path_for_its_value():
    assert check_spelled(["lower", "--check", "m.py:f", "-t", "tosa-int"]) == ["lower", "--check=outputs", "m.py:f", "-t", "tosa-int"]
    assert check_spelled(["lower", "--check=layers", "m.py:f"]) == ["lower", "--check=layers", "m.py:f"]
    assert check_spelled(["run", "--", "prog", "--check"]) == ["run", "--", "prog", "--check"]


def test_direct_mode_parses_the_check_mode_and_keys_its_record_by_it():
    base = ["lower", "m.py:f", "-t", "tosa-int", "-o", "out"]
    plain, outputs = direct.parse_lower(base), direct.parse_lower([*base, "--check"])
    layers = direct.parse_lower([*base, "--check=layers"])
    assert (plain.check, outputs.check, layers.check) == (None, "outputs", "layers")  # None: the setting decides
    assert outputs.key() == direct.parse_lower([*base, "--check=outputs"]).key()
    assert len({plain.key(), outputs.key(), layers.key()}) == 3
    assert direct.parse_lower([*base, "--check=other"]) is None and direct.parse_lower([*base, "--check", "--check"]) is None


class _Store:
    def __init__(self, entries):
        self.entries = entries

    def get(self, kind, key):
        return self.entries.get((kind, key))


def test_a_direct_mode_hit_with_layers_needs_the_layers_entry_its_record_names():
    check = numerics_report.check_parts("flowkey", "inputs")
    layers = numerics_report.layers_parts("flowkey", "inputs")
    recorded = {"key_parts": check, "outputs": [], "layers": {"key_parts": layers}}
    entries = {("check", step_key("check", check)): Entry(meta={"samples": 1, "outputs": [{"output": 0, "snr_db": 20.0}]})}
    store = _Store(entries)
    assert numerics_report.stored(store, recorded, "flowkey") is not None  # --check alone: the layers entry is not needed
    assert numerics_report.stored(store, recorded, "flowkey", "layers") is None  # not stored: the normal path runs it
    entries[("layers", step_key("layers", layers))] = Entry(meta={"samples": 1, "modules": [{"module": "conv1", "snr_db": 30.0}]})
    found, _ = numerics_report.stored(store, recorded, "flowkey", "layers")
    assert found["layers"]["modules"] == [{"module": "conv1", "snr_db": 30.0, "depth": 1, "drop_db": None}] and found["layers"]["key_parts"] == layers
    stale = {**recorded, "layers": {"key_parts": {**layers, "layers": "layers:v0:old"}}}
    assert numerics_report.stored(store, stale, "flowkey", "layers") is None  # the per-layer code changed since
