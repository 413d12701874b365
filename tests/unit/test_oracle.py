"""The stock oracle's disk cache keys on everything stock's bytes depend on, and a damaged entry is never served."""

from __future__ import annotations

import threading

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


def test_one_lowering_per_key_at_a_time(tmp_path, monkeypatch):
    """A second worker that needs the key the first is lowering waits for it (and then reads its entry); another key
    does not wait."""
    monkeypatch.setattr(oracle, "DIRECTORY", tmp_path)
    order, inside = [], threading.Event()

    def after(name):
        inside.wait(timeout=60)
        with oracle._locked(name):
            order.append(name)

    same, other = (threading.Thread(target=after, args=(name,), daemon=True) for name in ("k", "j"))
    same.start()
    other.start()
    with oracle._locked("k"):
        inside.set()
        other.join(timeout=60)
        same.join(timeout=0.5)
        assert same.is_alive() and order == ["j"]
        order.append("first")
    same.join(timeout=60)
    assert order == ["j", "first", "k"]


def test_the_key_is_the_same_in_another_checkout(monkeypatch):
    """Stack traces name the checkout's files, and they never reach stock's bytes: a program exported in a checkout
    elsewhere keys the same, and the program's own stack traces are left as they were."""
    module, example = models.tiny_cnn()
    program = torch.export.export(module, example)
    traces = [n.meta.get("stack_trace") for n in program.graph.nodes]
    assert any(oracle.CHECKOUT in (t or "") for t in traces)
    here = oracle.key(program, example, "tosa-int", None, {})
    assert [n.meta.get("stack_trace") for n in program.graph.nodes] == traces
    elsewhere = "/somewhere/else/lowercache-checkout"
    for node in program.graph.nodes:
        if node.meta.get("stack_trace"):
            node.meta["stack_trace"] = node.meta["stack_trace"].replace(oracle.CHECKOUT, elsewhere)
    monkeypatch.setattr(oracle, "CHECKOUT", elsewhere)
    assert oracle.key(program, example, "tosa-int", None, {}) == here
    first = next(n for n in program.graph.nodes if n.meta.get("stack_trace"))
    first.meta["stack_trace"] += "\n  one more frame"
    assert oracle.key(program, example, "tosa-int", None, {}) != here
