"""Program and graph helpers shared by the flow tests: comparable forms, modules with awkward graphs, outcomes."""

from __future__ import annotations

import json
import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor

from lowercache.bench.passgraphs import form

SMALL_TARGETS = ("tosa-int", "tosa-fp", "ethos-u55-128", "ethos-u55-256", "ethos-u85-256")
# One speed-up alone against stock: every small model and every kind of target (float TOSA, INT TOSA, INT + Vela) at
# least once, and the transformer on both quantized paths. flow/test_identity lowers every model on every target with
# all speed-ups on, and flow/test_speedups each speed-up off in turn.
PAIRS = (("tiny_cnn", "tosa-int"), ("residual_cnn", "ethos-u55-128"), ("transformer_block", "tosa-fp"),
         ("transformer_block", "ethos-u55-128"))


def outcomes(artifacts, kind):
    return [r["outcome"] for r in artifacts.records if r["kind"] == kind]


def describe(program: torch.export.ExportedProgram) -> list:
    """Every node's name, op, target, arguments and metadata (provenance aside)."""
    return [
        (n.op, n.name, str(n.target), form(n.args), form(n.kwargs), {k: form(v) for k, v in n.meta.items() if k != "from_node"})
        for n in program.graph.nodes
    ]


def same_program(mine: torch.export.ExportedProgram, stock: torch.export.ExportedProgram) -> None:
    assert describe(mine) == describe(stock)
    assert mine.graph_signature == stock.graph_signature
    assert list(mine.state_dict) == list(stock.state_dict) and list(mine.constants) == list(stock.constants)
    assert [(e.fqn, e.signature) for e in mine.module_call_graph] == [(e.fqn, e.signature) for e in stock.module_call_graph]
    modes = {id(n.meta["val"].fake_mode) for n in mine.graph.nodes if isinstance(n.meta.get("val"), FakeTensor)}
    assert len(modes) == 1  # new nodes' values come from the program's own fake mode


class ConvertsAndReshapes(torch.nn.Module):
    """``to`` leaves an ``_assert_tensor_metadata`` with keyword arguments, in another form than a
    trace records; ``reshape`` and ``to`` are CompositeImplicitAutograd operators torch decomposes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        y = torch.relu(x.to(torch.float32)) * self.scale
        return y.reshape(3, 2).transpose(0, 1).reshape(6), torch.amax(y, [-1], True)


class Cond(torch.nn.Module):
    def forward(self, x):
        def true_fn(x):
            return torch.relu(x) + 1

        def false_fn(x):
            return torch.sigmoid(x) * 2

        y = torch.cond(x.sum() > 0, true_fn, false_fn, (x,))
        return torch.relu(y) - 1


def without_varying_meta(graph: bytes) -> dict:
    """The stored JSON without what two stock exports of one graph in one process
    already differ in: ``from_node`` (graphs named by object id) and torch's
    ``_torchdynamo_disable*`` markers in ``custom`` (they depend on what the
    process traced before: 11 nodes on a first export of transformer_block, 27 after)."""
    doc = json.loads(graph)
    for node in doc["graph_module"]["graph"]["nodes"]:
        meta = node.get("metadata", {})
        meta.pop("from_node", None)
        if "custom" in meta:
            custom = {k: v for k, v in json.loads(meta["custom"]).items() if not k.startswith("_torchdynamo_disable")}
            meta["custom"] = json.dumps(custom)
    return doc


def churn_patch(enable, disable, threads: int = 4, rounds: int = 200) -> None:
    """Enable and disable a reference-counted patch from several threads at once."""
    def churn():
        for _ in range(rounds):
            enable()
            disable()

    workers = [threading.Thread(target=churn) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
