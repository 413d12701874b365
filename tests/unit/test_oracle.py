"""The stock oracle's disk cache keys on everything stock's bytes depend on, and a damaged entry is never served."""

from __future__ import annotations

import torch

from lowercache.bench import models
from tests.helpers import oracle


def _key(module, example, target="tosa-int", calibration=None, **options):
    program = torch.export.export(module, example)
    return oracle.key(program, example, target, calibration, {"per_channel": True, "strict": False, **options})


def test_every_input_of_a_stock_lowering_changes_the_key(monkeypatch):
    module, example = models.tiny_cnn()
    base = _key(module, example)
    assert _key(*models.tiny_cnn()) == base
    weights, _ = models.tiny_cnn(edit="weights")
    structure, _ = models.tiny_cnn(edit="structure")
    others = [
        _key(weights, example),
        _key(structure, example),
        _key(module, (example[0] + 1,)),
        _key(module, example, target="ethos-u55-128"),
        _key(module, example, calibration=[example]),
        _key(module, example, per_channel=False),
        _key(module, example, system_config="Ethos_U55_High_End_Embedded"),
    ]
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    others.append(_key(module, example))
    assert len({base, *others}) == len(others) + 1


def test_a_damaged_entry_is_not_served(tmp_path, monkeypatch):
    monkeypatch.setattr(oracle, "DIRECTORY", tmp_path)
    oracle._save("k", b"stock bytes")
    assert oracle._load("k") == b"stock bytes"
    data = bytearray((tmp_path / "k").read_bytes())
    data[-1] ^= 1
    (tmp_path / "k").write_bytes(bytes(data))
    assert oracle._load("k") is None
    assert oracle._load("missing") is None
