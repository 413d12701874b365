"""graphbuild rebuilds a stored program exactly as torch's deserializer does."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from lowercache.lowering.stored import graphbuild, programstore
from lowercache.lowering import quantize
from lowercache.bench import models
from lowercache.cache.hashing import program_parts
from lowercache.targets import resolve


class OpZoo(torch.nn.Module):
    """Ops whose stored arguments and outputs take the less common forms: several
    outputs, list outputs, keywords, dtypes, devices, optional-tensor lists, floats."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("index", torch.tensor([2, 0, 1]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.linear(x)
        a, b = torch.split(y, 4, dim=-1)
        values, indices = torch.topk(a, 2, dim=-1, largest=False)
        var, mean = torch.var_mean(b, dim=-1, keepdim=True, correction=0)
        picked = y[:, self.index]
        ramp = torch.arange(8, dtype=torch.float32, device=x.device) * 0.5
        clamped = torch.clamp(y + ramp, min=-1.5, max=float("inf"))
        chunks = torch.unbind(clamped, dim=0)
        return values, indices.to(torch.int32), var + mean, picked.sum(dim=(0, 1), keepdim=True), chunks[0], y


def _torch_decode(entry, monkeypatch):
    """The program as torch's deserializer alone rebuilds it."""
    with monkeypatch.context() as m:
        m.setattr(programstore, "_rebuild_fast", _unsupported)
        m.setattr(programstore._fast_tensor_meta, "active", contextlib.nullcontext)
        return programstore.decode(entry)


def _unsupported(*args, **kwargs):
    raise graphbuild.Unsupported("test")


def _value(v):
    if isinstance(v, torch.Tensor):
        return (type(v), v.shape, v.stride(), v.dtype, v.device, v.requires_grad, v.is_leaf, str(torch._C._dispatch_keys(v)))
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_value(x) for x in v)
    return type(v), v


def _argument(a):
    if isinstance(a, torch.fx.Node):
        return "node", a.name
    if isinstance(a, (tuple, list)):
        return type(a), tuple(_argument(x) for x in a)
    if isinstance(a, dict):
        return type(a), tuple((k, _argument(v)) for k, v in a.items())
    return type(a), a


def assert_same_program(fast, stock):
    assert fast.graph_module.code == stock.graph_module.code
    fast_nodes, stock_nodes = list(fast.graph.nodes), list(stock.graph.nodes)
    assert [n.name for n in fast_nodes] == [n.name for n in stock_nodes]
    fake_mode = fast_nodes[0].meta["val"].fake_mode
    for a, b in zip(fast_nodes, stock_nodes):
        assert (a.op, a.target, a.type) == (b.op, b.target, b.type), a.name
        assert _argument(a.args) == _argument(b.args) and _argument(a.kwargs) == _argument(b.kwargs), a.name
        assert list(a.meta) == list(b.meta), a.name
        for key in a.meta:
            if key == "val":
                assert _value(a.meta[key]) == _value(b.meta[key]), a.name
            else:
                assert type(a.meta[key]) is type(b.meta[key]) and a.meta[key] == b.meta[key], (a.name, key)
        for v in a.meta["val"] if isinstance(a.meta.get("val"), (tuple, list)) else [a.meta.get("val")]:
            assert not isinstance(v, torch.Tensor) or v.fake_mode is fake_mode
    # Names given to nodes the flow adds later come from the graph's namespace.
    names, stock_names = fast.graph._graph_namespace, stock.graph._graph_namespace
    assert names._used_names == stock_names._used_names and names._base_count == stock_names._base_count
    assert fast.graph_signature == stock.graph_signature
    assert fast.module_call_graph == stock.module_call_graph
    assert fast.range_constraints == stock.range_constraints == {}
    assert fast.graph_module.meta == stock.graph_module.meta
    assert [type(v) for v in fast.verifiers] == [type(v) for v in stock.verifiers]
    assert list(fast.state_dict) == list(stock.state_dict) and list(fast.constants) == list(stock.constants)
    assert program_parts(fast) == program_parts(stock)


@pytest.mark.parametrize(
    ("build", "target"),
    [(models.transformer_block, "ethos-u55-128"), (models.tiny_cnn, "tosa-int"), (OpZoo, None)],
    ids=["transformer-u55", "cnn-int", "op-zoo-float"],
)
def test_graphbuild_equals_torchs_deserializer(build, target, monkeypatch):
    if build is OpZoo:
        torch.manual_seed(0)
        module, example = OpZoo().eval(), (torch.randn(3, 5, 8),)
        program = torch.export.export(module, example)
    else:
        module, example = build()
        spec_target = resolve(target)
        program = torch.export.export(module, example)
        program = quantize.run_stock(program, spec_target, spec_target.compile_spec(), example, [example])
    entry = programstore.encode(program, "spec")
    built = []
    original_build = graphbuild.GraphBuilder.build
    monkeypatch.setattr(graphbuild.GraphBuilder, "build", lambda self, raw: built.append(1) or original_build(self, raw))
    fast = programstore.decode(entry)
    assert built == [1], "the fast builder made the graph"
    assert_same_program(fast, _torch_decode(entry, monkeypatch))
    for args in (example, tuple(torch.randn_like(t) for t in example)):
        torch.testing.assert_close(fast.module()(*args), program.module()(*args), rtol=0, atol=0)


def test_op_zoo_uses_the_less_common_forms():
    """The zoo really stores what its test claims to cover."""
    torch.manual_seed(0)
    program = torch.export.export(OpZoo().eval(), (torch.randn(3, 5, 8),))
    graph = programstore.encode(program, "spec").blobs["program.json"]
    for form in (b'"as_tensors"', b'"as_scalar_type"', b'"as_device"', b'"as_optional_tensors"', b'"as_float"', b'"kind": 2'):
        assert form in graph, form
    multiple = [n for n in program.graph.nodes if isinstance(n.meta.get("val"), (tuple, list)) and n.op == "call_function"]
    assert len(multiple) == 4  # split, topk, var_mean, unbind


def test_unsupported_graph_falls_back_to_torchs_deserializer(monkeypatch, caplog):
    """A graph the builder does not handle is rebuilt whole by torch, with the same result."""
    from torch._export.serde import serialize as serde

    original_graph = vars(serde.GraphModuleDeserializer)["deserialize_graph"]
    module, example = models.tiny_cnn()
    entry = programstore.encode(torch.export.export(module, example), "spec")
    stock = _torch_decode(entry, monkeypatch)
    original_node = graphbuild.GraphBuilder.node
    seen = []

    def refuse_relu(self, node):
        seen.append(node["target"])
        if "relu" in node["target"]:
            raise graphbuild.Unsupported("relu, for the test")
        return original_node(self, node)

    monkeypatch.setattr(graphbuild.GraphBuilder, "node", refuse_relu)
    with caplog.at_level(logging.DEBUG, logger="lowercache"):
        rebuilt = programstore.decode(entry)
    assert any("relu" in t for t in seen) and any("torch's deserializer (relu" in r.getMessage() for r in caplog.records)
    assert_same_program(rebuilt, stock)
    assert vars(serde.GraphModuleDeserializer)["deserialize_graph"] is original_graph, "the patch is undone"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"as_int": 3}, 3),
        ({"as_float": 2}, 2.0),
        ({"as_float": "Infinity"}, float("inf")),
        ({"as_floats": [1, "-Infinity"]}, [1.0, float("-inf")]),
        ({"as_ints": []}, []),
        ({"as_sym_int": {"as_int": 4}}, 4),
        ({"as_sym_ints": [{"as_int": 4}, {"as_int": 5}]}, [4, 5]),
        ({"as_int_lists": [[1, 2], [3]]}, [(1, 2), (3,)]),
        ({"as_device": {"type": "cpu", "index": None}}, torch.device("cpu")),
        ({"as_complex": {"real": 1, "imag": -2}}, complex(1.0, -2.0)),
        ({"as_none": True}, None),
    ],
)
def test_arguments_decode_as_torchs(value, expected):
    from torch._export.serde import schema
    from torch._export.serde import serialize as serde

    builder = graphbuild.GraphBuilder(serde.GraphModuleDeserializer())
    ours = builder.argument(value)
    theirs = serde.GraphModuleDeserializer().deserialize_input(serde._dict_to_dataclass(schema.Argument, value))
    assert _argument(ours) == _argument(theirs) == _argument(expected)


@pytest.mark.parametrize(
    "value",
    [{"as_sym_int": {"as_name": "s0"}}, {"as_sym_ints": [{"as_name": "s0"}]}, {"as_graph": {}}, {"as_sym_bool": {"as_name": "b"}}],
)
def test_symbolic_or_nested_arguments_are_unsupported(value):
    from torch._export.serde import serialize as serde

    with pytest.raises(graphbuild.Unsupported):
        graphbuild.GraphBuilder(serde.GraphModuleDeserializer()).argument(value)
