"""``checkskip``: a check it skips would have passed, and a change to anything the check reads runs it again, with
stock's outcome.

Every skipped check of XNNPACK lowerings (a CNN and a transformer block, fp32 and int8) also runs the real check
beside it, which must pass. Then a pass of XNNPACK's pass manager changes, between two checks, one thing the check
reads (a node's value, a value held in a list, the signature, the state dict, a get_attr target); the check runs
and raises as it does without the speed-up. Bytes: ``test_xnnpack_speedups.py`` lowers with the speed-up on and off
and compares every payload and the .pte with stock's.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.fx.passes.infra.pass_base import PassResult

import lowercache
from lowercache.bench import models
from lowercache.speedups import checkskip

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def audited(monkeypatch):
    """Every skipped check also runs the real one; the lowering goes on with the skip."""
    found = {"skips": 0}
    real_check = checkskip._check

    def audit(self, exported_program):
        before = checkskip.stats()["skipped"]
        result = real_check(self, exported_program)
        if checkskip.stats()["skipped"] > before:
            checkskip._originals["check"](self, exported_program)  # raises if the skipped check would have
            found["skips"] += 1
        return result

    monkeypatch.setattr(checkskip, "_check", audit)
    return found


@pytest.mark.parametrize("target", ["xnnpack", "xnnpack-int8"])
@pytest.mark.parametrize("factory", ["tiny_cnn", "transformer_block"])
def test_every_skipped_check_would_have_passed(audited, factory, target):
    module, example = getattr(models, factory)()
    checkskip.reset_stats()
    lowercache.lower(module, example, target=target, use_cache=False)
    stats = checkskip.stats()
    assert audited["skips"] == stats["skipped"] >= 20 and stats["checked"] >= 5, stats


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


def _edge_program():
    from executorch.exir import to_edge

    torch.manual_seed(0)
    return to_edge(torch.export.export(_Net().eval(), (torch.randn(2, 4),))).exported_program()


def _changes():
    """Changes a pass makes to what the check reads, each one the check refuses."""

    def value_dropped(ep, gm):
        next(n for n in gm.graph.nodes if n.op == "call_function").meta.pop("val")

    def list_item_replaced(ep, gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        node.meta["val"] = [node.meta["val"]]
        yield  # checked as it is (a list of a tensor passes), then changed in place
        node.meta["val"][0] = object()

    def signature_renamed(ep, gm):
        ep.graph_signature.input_specs[0].arg.name = "no_such_node"

    def state_entry_removed(ep, gm):
        ep.state_dict.pop(next(iter(ep.state_dict)))

    def attribute_replaced(ep, gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        with gm.graph.inserting_before(node):
            gm.graph.get_attr("extra")
        gm.extra = torch.zeros(1)
        yield  # checked as it is (a tensor attribute passes), then replaced by something no verifier allows
        gm.extra = object()

    return {f.__name__: f for f in (value_dropped, list_item_replaced, signature_renamed, state_entry_removed,
                                    attribute_replaced)}


def _idle_pass():
    """A pass of XNNPACK's kind that changes nothing."""
    from executorch.backends.xnnpack._passes.xnnpack_pass import XNNPACKPass

    class Idle(XNNPACKPass):
        def call(self, graph_module):
            return PassResult(graph_module, False)

    return Idle


def _run(change, skip: bool):
    """XNNPACK's pass manager over a small edge program: idle passes, and a pass that makes the change (a change
    that yields is made in two steps, the first one valid, each by a pass of its own); what the checks raise, and
    the speed-up's counts."""
    import inspect

    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack._passes.xnnpack_pass import XNNPACKPass

    two_steps = inspect.isgeneratorfunction(change)
    started = []

    class Change(XNNPACKPass):
        def call(self, graph_module):
            if started:
                next(started[0], None)
            elif two_steps:
                started.append(change(self.exported_program, graph_module))
                next(started[0])
            else:
                change(self.exported_program, graph_module)
            return PassResult(graph_module, False)

    Idle = _idle_pass()
    passes = [Idle, Change, Idle, Idle, Change, Idle] if two_steps else [Idle, Idle, Change, Idle]
    if skip:
        checkskip.enable()
    checkskip.reset_stats()
    try:
        XNNPACKPassManager(_edge_program(), passes=passes).transform()
    except Exception as e:  # the pass manager wraps what the check raised
        cause = e.__cause__ or e
        return re.sub(r" at 0x[0-9a-f]+", "", f"{type(cause).__name__}: {cause}"), checkskip.stats()
    finally:
        if skip:
            checkskip.disable()
    return None, checkskip.stats()


@pytest.mark.parametrize("name", sorted(_changes()))
def test_a_change_to_what_the_check_reads_is_checked(name):
    change = _changes()[name]
    stock, _ = _run(change, skip=False)
    served, stats = _run(change, skip=True)
    assert stock is not None and "Error" in stock
    assert served == stock
    assert stats["skipped"] >= 2 and stats["checked"] >= 2, stats  # idle passes skipped; the change checked


def test_idle_passes_are_skipped_and_pass():
    def nothing(ep, gm):
        pass

    stock, _ = _run(nothing, skip=False)
    served, stats = _run(nothing, skip=True)
    assert stock is None and served is None
    assert stats == {"checked": 1, "skipped": 7}, stats  # one check of the program, then two per pass skipped


def test_a_program_with_a_verifier_of_its_own_is_always_checked():
    """A verifier that is not torch's or made by ExecuTorch's pinned factories may read anything: no check is
    skipped."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    Idle = _idle_pass()
    program = _edge_program()
    calls = []

    class Own(program.verifiers[0]):
        dialect = "OWN"

        def check_additional(self, gm):
            calls.append(gm)

    program._verifiers = [Own]
    checkskip.enable()
    checkskip.reset_stats()
    try:
        XNNPACKPassManager(program, passes=[Idle, Idle, Idle]).transform()
    finally:
        checkskip.disable()
    assert checkskip.stats() == {"checked": 6, "skipped": 0}
    assert len(calls) == 6
